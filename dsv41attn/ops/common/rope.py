"""Rotary embeddings (docs/numerics.md §4): interleaved pairs on the last ``rope_head_dim``
dims, per-layer base, YaRN on every layer with ratio > 0. Angles are computed per position on
demand (the same fp32 values as the reference's table row ``fp32(p) * f_j``), so no table is
cached.
"""
from __future__ import annotations

import math

import torch

from ...config import AttentionConfig, LayerSpec


def rope_frequencies(cfg: AttentionConfig, spec: LayerSpec) -> torch.Tensor:
    """f_j for j = 0..rope_head_dim/2-1, fp32 [rope_head_dim/2], YaRN-corrected if spec.yarn."""
    dim, base = cfg.rope_head_dim, spec.rope_base
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if spec.yarn and cfg.original_seq_len > 0:
        def corr(rot: float) -> float:
            return dim * math.log(cfg.original_seq_len / (rot * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corr(cfg.beta_fast)), 0)
        high = min(math.ceil(corr(cfg.beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        smooth = 1 - ramp
        freqs = freqs / cfg.rope_factor * (1 - smooth) + freqs * smooth
    return freqs


def rope_rotations(freqs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """e^{i * fp32(p) * f_j}: complex64 [*positions.shape, rope_head_dim/2]."""
    angles = positions.to(torch.float32).unsqueeze(-1) * freqs.to(positions.device)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rope(x: torch.Tensor, rotations: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last 2*R dims of x in interleaved (even, odd) pairs; returns a new tensor.

    x: [..., D] bf16 whose leading dims end with the position dims of ``rotations``
    ([P..., R] complex64); for per-head tensors pass rotations already unsqueezed over heads.
    The product is complex64 (as the reference), rounded back to x's dtype.
    """
    rope_dims = 2 * rotations.shape[-1]
    nope, tail = x[..., :-rope_dims], x[..., -rope_dims:]
    pairs = tail.float().unflatten(-1, (-1, 2))
    re, im = pairs[..., 0], pairs[..., 1]
    c, s = rotations.real, rotations.imag
    if inverse:
        s = -s
    # the complex64 product written out, each product rounded to fp32 before the sum: torch's
    # own complex multiply takes a vector or a scalar path (fused or not) by tensor size, so
    # its last bit would depend on how many tokens share the call
    rotated = torch.stack([re * c - im * s, re * s + im * c], -1).flatten(-2).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)
