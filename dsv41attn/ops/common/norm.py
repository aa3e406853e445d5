"""RMSNorm (docs/numerics.md §4)."""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``bf16(w * (x_f32 * rsqrt(mean(x_f32^2) + eps)))`` over the last dim.

    x: [..., N] bf16; weight: [N] bf16 (promoted to fp32 for the product). Output x's dtype.
    """
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf).to(x.dtype)
