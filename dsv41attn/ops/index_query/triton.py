"""The index query's RoPE and fp4 fake quantisation as one Triton kernel: the same bits as
reference.py (docs/numerics.md §2, §5 step 4).

One program per (token, BLOCK_H heads). A head's D values are held as (even, odd) pairs: the
last R/2 pairs turn by the token's rotation (rope_rotate: each product rounded to fp32, the
sums to bf16, as torch's CPU complex64 multiply), then every 32-element block (16 pairs) gets
its ue8m0 scale s = 2^ceil(log2(max(amax, 6 * 2^-126) * fp32(1/6))) from the exponent bits,
x / s (exact) is rounded to the nearest e2m1 value (ties to the even code, saturating at 6, the
sign kept, -0 included) and q * s (exact) is stored as bf16. It replaces the ~10 elementwise
torch kernels of the reference on the triton backend.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.triton import (any_nan, cdiv, check_device, check_rot, cos_sin, interpreting,
                             pow2_ceil_exponent, require, rope_rotate)

BLOCK_H = 4  # heads per program
INDEX_FP4_BLOCK = tl.constexpr(32)
_FP4_AMAX_FLOOR = tl.constexpr(7.052966104933725e-38)  # 6 * 2^-126
_INV_FP4_MAX = torch.tensor(1.0 / 6.0, dtype=torch.float32).item()  # fp32(1/6), as quant.py


@triton.jit
def _e2m1_round(v):
    """fp32 v -> the nearest e2m1 value in fp32 as quant.round_e2m1: {0, .5, 1, 1.5, 2, 3, 4, 6},
    ties to the even code, saturating at 6, the sign of v kept (copysign: -0 for small
    negatives)."""
    a = tl.abs(v)
    q = tl.where(a <= 0.25, 0.0, tl.where(a < 0.75, 0.5, tl.where(a <= 1.25, 1.0, tl.where(
        a < 1.75, 1.5, tl.where(a <= 2.5, 2.0, tl.where(a < 3.5, 3.0, tl.where(
            a <= 5.0, 4.0, 6.0)))))))
    sign = v.to(tl.int32, bitcast=True) & -2147483648  # 0x80000000
    return (q.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _fake_quant(xe, xo, inv_fp4_max, BLOCK_H: tl.constexpr, NB: tl.constexpr):
    """fp4_fake_quant(x, 32, "ue8m0") of the pairs (xe, xo) [BLOCK_H, 16 NB] fp32 (bf16 values):
    the e2m1 x ue8m0 values as fp32 pairs of the same shape."""
    ve = tl.reshape(xe, (BLOCK_H, NB, 16))
    vo = tl.reshape(xo, (BLOCK_H, NB, 16))
    amax = tl.maximum(tl.max(tl.abs(ve), 2), tl.max(tl.abs(vo), 2))
    amax = tl.maximum(amax, _FP4_AMAX_FLOOR)
    e = pow2_ceil_exponent(amax * inv_fp4_max)
    s = tl.broadcast_to((e << 23).to(tl.float32, bitcast=True)[:, :, None], (BLOCK_H, NB, 16))
    qe = _e2m1_round(tl.div_rn(ve, s)) * s
    qo = _e2m1_round(tl.div_rn(vo, s)) * s
    # a block holding a NaN gives zeros, as the reference's (its NaN amax makes the scale -0)
    nan = (any_nan(ve, 2) | any_nan(vo, 2))[:, :, None]
    qe = tl.where(nan, 0.0, qe)
    qo = tl.where(nan, 0.0, qo)
    return tl.reshape(qe, (BLOCK_H, NB * 16)), tl.reshape(qo, (BLOCK_H, NB * 16))


@triton.jit
def _rope_fp4_heads_kernel(x_ptr, cs_ptr, out_ptr, H, inv_fp4_max, D: tl.constexpr,
                           R2: tl.constexpr, BLOCK_H: tl.constexpr, INTERPRET: tl.constexpr):
    """x, out: [N, H, D] bf16; cs: [N, R2, 2] fp32 (cos, sin); contiguous. Grid (N,
    cdiv(H, BLOCK_H))."""
    n = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h[:, None] < H
    row = n * H * D + offs_h[:, None] * D  # [BLOCK_H, 1]
    pair = tl.arange(0, D // 2)[None, :]  # [1, D/2]
    col = 2 * pair
    xe = tl.load(x_ptr + row + col, mask=h_ok, other=0.0).to(tl.float32)
    xo = tl.load(x_ptr + row + col + 1, mask=h_ok, other=0.0).to(tl.float32)
    j = pair - (D // 2 - R2)  # rotation index of the pair; < 0: a nope pair
    turn = j >= 0
    re, im = rope_rotate(xe, xo, cs_ptr + n * (2 * R2), tl.maximum(j, 0), turn, False, INTERPRET)
    xe = tl.where(turn, re, xe)
    xo = tl.where(turn, im, xo)
    qe, qo = _fake_quant(xe, xo, inv_fp4_max, BLOCK_H, D // INDEX_FP4_BLOCK)
    tl.store(out_ptr + row + col, qe.to(tl.bfloat16), mask=h_ok)  # exact: on the bf16 grid
    tl.store(out_ptr + row + col + 1, qo.to(tl.bfloat16), mask=h_ok)


def rope_fp4_heads(q: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """``reference.rope_fp4_heads`` in one kernel. q: [N, H, D] bf16, D a power of two and a
    multiple of 32; rot: [N, R/2] complex64. Returns a new [N, H, D] bf16 tensor."""
    require(isinstance(q, torch.Tensor) and q.dtype == torch.bfloat16 and q.dim() == 3,
            f"q must be a 3-D bf16 [N, H, D] tensor, got {getattr(q, 'dtype', type(q))} "
            f"{tuple(getattr(q, 'shape', ()))}")
    n, h, d = q.shape
    require(d >= 32 and d & (d - 1) == 0,
            f"q {tuple(q.shape)}: head dim D = {d} must be a power of two >= 32 (fp4 blocks of 32)")
    r2 = check_rot(rot, n, d)
    check_device(q, rot)
    out = torch.empty(n, h, d, dtype=torch.bfloat16, device=q.device)
    if out.numel() == 0:
        return out
    _rope_fp4_heads_kernel[(n, cdiv(h, BLOCK_H))](
        q.contiguous(), cos_sin(rot), out, h, _INV_FP4_MAX, D=d, R2=r2, BLOCK_H=BLOCK_H,
        INTERPRET=interpreting(), num_warps=4, enable_fp_fusion=False)
    return out
