"""Quantisers of V4.1 (docs/numerics.md §2): fp8 e4m3 with ue8m0 scales per 32, fp4 e2m1 with ue8m0
scales per 32 (index q/k) or e4m3 scales per 16 (compressed latents).

Every function works on the last dimension in contiguous blocks and computes in fp32. The
fake-quant ("in place" in the reference) forms return bf16 values that are exactly
representable in the packed formats, so the caches can store them packed without loss.
"""
from __future__ import annotations

import torch

FP8_MAX = 448.0
FP4_MAX = 6.0
FP8_BLOCK = 32
INDEX_FP4_BLOCK = 32
LATENT_FP4_BLOCK = 16
_INV_FP8_MAX = torch.tensor(1.0 / FP8_MAX, dtype=torch.float32).item()  # fp32(1/448)
_INV_FP4_MAX = torch.tensor(1.0 / FP4_MAX, dtype=torch.float32).item()  # fp32(1/6)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """[..., K] -> [..., K/block, block] fp32."""
    if x.shape[-1] % block:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of the quant block {block}")
    return x.float().unflatten(-1, (-1, block))


def pow2_ceil_scale(t: torch.Tensor) -> torch.Tensor:
    """``2^ceil(log2(t))`` for positive fp32 ``t``, exactly, from the exponent bits (ue8m0)."""
    bits = t.float().contiguous().view(torch.int32)
    exp = (bits >> 23) & 0xFF
    exp = exp + ((bits & 0x7FFFFF) != 0).to(torch.int32)  # round up unless a power of two
    return (exp << 23).view(torch.float32)


def round_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Round fp32 to the nearest e4m3 value (ties to even), saturating at +-448; fp32 out."""
    return v.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()


def round_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Round fp32 to the nearest e2m1 value {0,.5,1,1.5,2,3,4,6} (ties to the even code),
    saturating at 6, keeping the sign; fp32 out."""
    a = v.abs()
    q = torch.where(a <= 0.25, 0.0,
        torch.where(a < 0.75, 0.5,
        torch.where(a <= 1.25, 1.0,
        torch.where(a < 1.75, 1.5,
        torch.where(a <= 2.5, 2.0,
        torch.where(a < 3.5, 3.0,
        torch.where(a <= 5.0, 4.0, 6.0)))))))
    return torch.copysign(q, v)


def act_quant(x: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 activation quantisation (docs/numerics.md §2), the non-in-place form.

    x: [..., K] bf16. Returns (x_q [..., K] fp32 holding e4m3 values, s [..., K/block] fp32
    powers of two) with x ~= x_q * s per block.
    """
    xb = _blocks(x, block)  # [..., KB, block]
    amax = xb.abs().amax(-1).clamp_min(1e-4)
    s = pow2_ceil_scale(amax * _INV_FP8_MAX)
    xq = round_e4m3(xb / s.unsqueeze(-1))
    return xq.flatten(-2), s


def fp8_fake_quant(x: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """act_quant in place: bf16 [..., K] -> bf16 values on the e4m3 x ue8m0 grid (exact)."""
    xq, s = act_quant(x, block)
    return (xq.unflatten(-1, (-1, block)) * s.unsqueeze(-1)).flatten(-2).to(x.dtype)


def fp4_scales_ue8m0(xb: torch.Tensor) -> torch.Tensor:
    """Per-block ue8m0 scale for index q/k: 2^ceil(log2(max(amax, 6*2^-126)/6))."""
    amax = xb.abs().amax(-1).clamp_min(FP4_MAX * 2.0 ** -126)
    return pow2_ceil_scale(amax * _INV_FP4_MAX)


def fp4_scales_e4m3(xb: torch.Tensor) -> torch.Tensor:
    """Per-block e4m3 scale for latents: e4m3_RNE_satfinite(max(amax, 6*2^-9) / 6)."""
    amax = xb.abs().amax(-1).clamp_min(FP4_MAX * 2.0 ** -9)
    return round_e4m3(amax / FP4_MAX)


def fp4_quant(x: torch.Tensor, block: int, scale_fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """fp4 e2m1 quantisation (docs/numerics.md §2). x: [..., K] bf16/fp32.

    Returns (codes [..., K] fp32 e2m1 values, s [..., K/block] fp32); scale_fmt "ue8m0" (index
    q/k, block 32) or "e4m3" (compressed latents, block 16).
    """
    xb = _blocks(x, block)
    if scale_fmt == "ue8m0":
        s = fp4_scales_ue8m0(xb)
    elif scale_fmt == "e4m3":
        s = fp4_scales_e4m3(xb)
    else:
        raise ValueError(f"fp4 scale_fmt must be 'ue8m0' or 'e4m3', got {scale_fmt!r}")
    q = round_e2m1((xb / s.unsqueeze(-1)).clamp(-FP4_MAX, FP4_MAX))
    return q.flatten(-2), s


def fp4_fake_quant(x: torch.Tensor, block: int, scale_fmt: str) -> torch.Tensor:
    """fp4_act_quant in place: bf16 [..., K] -> bf16 values on the e2m1 x scale grid (exact)."""
    q, s = fp4_quant(x, block, scale_fmt)
    return (q.unflatten(-1, (-1, block)) * s.unsqueeze(-1)).flatten(-2).to(x.dtype)


def index_fp4_fake_quant(x: torch.Tensor) -> torch.Tensor:
    """Index q/k: fp4 e2m1, block 32, ue8m0 scales."""
    return fp4_fake_quant(x, INDEX_FP4_BLOCK, "ue8m0")


def latent_fp4_fake_quant(x: torch.Tensor) -> torch.Tensor:
    """Compressed latents: fp4 e2m1, block 16, e4m3 scales."""
    return fp4_fake_quant(x, LATENT_FP4_BLOCK, "e4m3")
