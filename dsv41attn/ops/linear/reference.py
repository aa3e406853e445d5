"""The linears of the layer (docs/numerics.md §4): fp8 e4m3 weights with ue8m0 32x32 block
scales, fed by fp8 act-quantised activations; bf16 and fp32 weights through F.linear.

Rounding points of the fp8 GEMM: each 32-wide K block is summed exactly and rounded once to
fp32, scaled by the activation and weight block scales (powers of two: exact), and the blocks
are accumulated in fp32 in K order. The output is bf16.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..common.cpu_kernels import torch_bf16_matmul
from ..common.norm import rms_norm
from ..common.quant import FP8_BLOCK, act_quant
from ..common.rope import apply_rope


def fp8_gemm(x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
             weight_scale: torch.Tensor, max_rows: int = 64) -> torch.Tensor:
    """Blockwise-scaled fp8 GEMM.

    x_q: [M, K] fp32 holding e4m3 values; x_scale: [M, K/32] fp32; weight: [N, K]
    float8_e4m3fn; weight_scale: [ceil(N/32), ceil(K/32)] float8_e8m0fnu. Returns [M, N] fp32.
    """
    m, k = x_q.shape
    n = weight.shape[0]
    blk = FP8_BLOCK
    w = weight.to(torch.float64)  # e4m3 products are exact in fp64, and so are 32-term sums
    w_scale = weight_scale.float().repeat_interleave(blk, dim=0)[:n]  # [N, KB]
    out = torch.empty(m, n, dtype=torch.float32, device=x_q.device)
    for r0 in range(0, m, max_rows):
        xs = x_q[r0:r0 + max_rows].to(torch.float64)
        sx = x_scale[r0:r0 + max_rows]
        acc = out[r0:r0 + max_rows]
        for kb in range(k // blk):
            part = (xs[:, kb * blk:(kb + 1) * blk] @ w[:, kb * blk:(kb + 1) * blk].T).float()
            part.mul_(sx[:, kb:kb + 1]).mul_(w_scale[:, kb])  # powers of two: exact
            if kb == 0:
                acc.copy_(part)
            else:
                acc.add_(part)
    return out


def check_rope(rope, m: int, n: int, out_dtype: torch.dtype) -> tuple[torch.Tensor, int, int]:
    """Validate fp8_linear's ``rope`` = (rot, head_dim) for an [m, n] output: rot [m, R/2]
    complex64, head_dim an even divisor of n with R <= head_dim, a bf16 output. Returns (rot,
    head_dim, R/2); raises ValueError naming what is wrong (before anything runs)."""
    if not isinstance(rope, tuple) or len(rope) != 2:
        raise ValueError(f"rope must be a (rot, head_dim) pair, got {type(rope).__name__}")
    rot, d = rope
    if isinstance(d, bool) or not isinstance(d, int) or d < 2 or d % 2 or n % d:
        raise ValueError(f"rope's head_dim must be an even int dividing the output's {n} "
                         f"columns, got {d!r}")
    if not isinstance(rot, torch.Tensor) or rot.dtype != torch.complex64 or rot.dim() != 2 \
            or rot.shape[0] != m or not 1 <= rot.shape[1] <= d // 2:
        raise ValueError(f"rope's rot must be a complex64 [{m}, R/2] tensor with 1 <= R/2 <= "
                         f"{d // 2}, got {getattr(rot, 'dtype', type(rot))} "
                         f"{tuple(getattr(rot, 'shape', ()))}")
    if out_dtype != torch.bfloat16:
        raise ValueError(f"rope needs a bf16 output, got out_dtype={out_dtype}")
    return rot, d, rot.shape[1]


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, *,
               out_dtype: torch.dtype = torch.bfloat16,
               norm: tuple[torch.Tensor, float] | None = None,
               rope: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """y = x W^T for an fp8 weight: act_quant(x) then the blockwise fp8 GEMM.

    x: [..., K] bf16; weight [N, K] e4m3; weight_scale [ceil(N/32), ceil(K/32)] e8m0.
    Returns [..., N] in ``out_dtype``: bf16 (the layer's outputs), or torch.float32 for the
    GEMM's fp32 result before that cast (a tensor-parallel wo_b partial, all-reduced first).
    norm: (weight [K] bf16, eps): x is RMSNorm'd first (the query's q_norm before wq_b).
    rope: (rot [M, R/2] complex64, head_dim D): the bf16 output's columns are heads of D,
    and each head's last R dims turn by its row's rotation (the query's RoPE after wq_b:
    apply_rope on the [M, N/D, D] view).
    """
    lead = x.shape[:-1]
    m = x.reshape(-1, x.shape[-1]).shape[0]
    if rope is not None:
        rot, d, _ = check_rope(rope, m, weight.shape[0], out_dtype)
    if norm is not None:
        x = rms_norm(x, *norm)
    x_q, s = act_quant(x.reshape(-1, x.shape[-1]))
    y = fp8_gemm(x_q, s, weight, weight_scale).to(out_dtype)
    if rope is not None:
        y = apply_rope(y.view(m, -1, d), rot.unsqueeze(1)).view(m, -1)
    return y.reshape(*lead, weight.shape[0])


def fp8_linear_pair(x: torch.Tensor, w1: torch.Tensor, s1: torch.Tensor, w2: torch.Tensor,
                    s2: torch.Tensor, *, norm: tuple[torch.Tensor, float] | None = None,
                    rope: tuple[torch.Tensor, int] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Two fp8 linears of one input (wq_b and the index wq_b share the query's qr):
    (fp8_linear(x, w1, s1, norm=norm, rope=rope), fp8_linear(x, w2, s2, norm=norm)), bf16:
    rope turns the first output only (the query's heads)."""
    if norm is not None:
        x = rms_norm(x, *norm)
    return fp8_linear(x, w1, s1, rope=rope), fp8_linear(x, w2, s2)  # fp8_linear checks rope


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """bf16 or fp32 weight: F.linear in the weight's dtype (fp32 accumulation); bf16 on torch's
    own CPU kernel (``cpu_kernels``: the golden fixtures' rounding on any CPU).

    An fp32 weight (the ratio > 1 compressor's wkv / wgate) is applied in float64 and rounded
    once to fp32: the correctly rounded product, which a BLAS fp32 GEMM is not (its blocking,
    and so its last bits, change with the number of rows), so a token's projections do not
    depend on which other tokens share its call. Every golden fixture keeps every bit."""
    if weight.dtype == torch.float32:
        return F.linear(x.double(), weight.double()).float()
    with torch_bf16_matmul(x.device):
        return F.linear(x.to(weight.dtype), weight)
