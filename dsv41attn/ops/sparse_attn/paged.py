"""The paged sparse attention the triton backend runs: the warp-specialized Gluon kernel
(``gluon.sparse_attn_paged_ws``) where it runs, else the Triton kernel
(``triton.sparse_attn_paged``, which the CPU tests run under the interpreter).

Both take the same arguments, cut the lists into the same splits (``plan_splits``) and merge
them by the same kernel; inside a program they round at the same points, only the row sums of
p may add in another order. So the choice must not follow the step: it follows the device and
the layer only (a Hopper GPU, a Triton with Gluon, H <= 64 heads, D 128, 256 or 512, the
caches 16-byte aligned, no Triton-only launch option), never the batch or the lists'
lengths, and a sequence keeps its bits alone and in any batch.
"""
from __future__ import annotations

import os

import torch

from ..common.triton import is_hopper
from .triton import sparse_attn_paged as _triton_paged

try:
    from .gluon import MAX_HEADS, sparse_attn_paged_ws, unsupported
except (ImportError, AttributeError):  # a Triton without Gluon, or another Gluon API
    sparse_attn_paged_ws = None

_WS_OPTIONS = frozenset({"num_splits", "split_blocks", "out", "out_rot"})
# Triton fixes interpretation when a kernel is defined (at import); Gluon has no interpreter
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


def uses_gluon(q: torch.Tensor, window_ring: torch.Tensor,
               compressed_pool: torch.Tensor | None, options=()) -> bool:
    """Whether ``sparse_attn_paged`` runs the Gluon kernel for these operands: it runs them
    (``gluon.unsupported``) and no Triton-only option is asked for."""
    return (sparse_attn_paged_ws is not None and not _INTERPRETED and q.dim() == 3
            and set(options) <= _WS_OPTIONS
            and unsupported(q, window_ring, compressed_pool) is None)


def kernel_report() -> str:
    """Which kernel the triton backend's attention runs on this machine (``env``)."""
    if sparse_attn_paged_ws is None:
        return "the Triton kernel (this Triton has no usable Gluon)"
    if _INTERPRETED:
        return "the Triton kernel, interpreted (TRITON_INTERPRET=1; Gluon has no interpreter)"
    hopper = [f"cuda:{i}" for i in range(torch.cuda.device_count())
              if is_hopper(torch.device("cuda", i))] if torch.cuda.is_available() else []
    if not hopper:
        return "the Triton kernel (no Hopper GPU: the Gluon kernel needs sm_90)"
    return (f"on {', '.join(hopper)} the warp-specialized Gluon kernel (H <= {MAX_HEADS}, D "
            f"128/256/512; else the Triton kernel)")


def sparse_attn_paged(q: torch.Tensor, sink: torch.Tensor, scale: float,
                      window_ring: torch.Tensor, new_rows: torch.Tensor,
                      window_ids: torch.Tensor, compressed_pool: torch.Tensor | None,
                      block_table: torch.Tensor | None, token_row: torch.Tensor,
                      compressed_idx: torch.Tensor, **options) -> torch.Tensor:
    """``triton.sparse_attn_paged`` (its arguments, results and options), through the Gluon
    kernel where ``uses_gluon``."""
    kernel = sparse_attn_paged_ws if uses_gluon(q, window_ring, compressed_pool, options) \
        else _triton_paged
    return kernel(q, sink, scale, window_ring, new_rows, window_ids, compressed_pool,
                  block_table, token_row, compressed_idx, **options)
