"""Backend selection: chosen once per layer or stack (an argument, never a global flag).

"reference" runs every op in plain torch (the spec in code); "triton" runs the ops that have
a Triton kernel through it (sparse attention with sink over the packed caches, the fp8
linears) and the rest through the reference ops, on whatever device the tensors live.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

BACKENDS = ("reference", "triton")


@dataclass(frozen=True)
class Ops:
    """The op implementations one backend uses."""

    name: str
    sparse_attn_paged: Callable
    fp8_linear: Callable


def get_ops(backend: str) -> Ops:
    if backend == "reference":
        from .linear.reference import fp8_linear
        from .sparse_attn.reference import sparse_attn_paged
    elif backend == "triton":
        try:
            from .linear.triton import fp8_linear
            from .sparse_attn.triton import sparse_attn_paged
        except ImportError as e:  # triton missing
            raise ValueError(f"backend 'triton' needs the triton package: {e}") from e
    else:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return Ops(backend, sparse_attn_paged, fp8_linear)
