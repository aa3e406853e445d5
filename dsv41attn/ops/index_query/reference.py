"""The index query's RoPE and fp4 fake quantisation (docs/numerics.md §5, step 4), plain torch:
the spec in code."""
from __future__ import annotations

import torch

from ..common.quant import index_fp4_fake_quant
from ..common.rope import apply_rope


def rope_fp4_heads(q: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """``index_fp4_fake_quant(apply_rope(q, rot.unsqueeze(1)))``: RoPE on the last R dims of
    every index head, then each head's 32-element blocks onto the e2m1 x ue8m0 grid.

    q: [N, H, D] bf16 (the index query, D a multiple of 32); rot: [N, R/2] complex64, one row
    per position. Returns a new [N, H, D] bf16 tensor."""
    return index_fp4_fake_quant(apply_rope(q, rot.unsqueeze(1)))
