"""Window K=V rows and per-head RoPE (docs/numerics.md §4, §5), plain torch: the spec in code.

``norm_rope_pack`` is kv_norm, RoPE on the last rope_head_dim dims, fp8 act_quant (32-blocks,
ue8m0) and packing into the window row layout, plus the optional ring write; ``rope_heads`` is
RoPE on every head of a [N, H, D] tensor (the query, and the inverse on the attention output).
"""
from __future__ import annotations

import torch

from ..common.norm import rms_norm
from ..common.packing import pack_window_rows
from ..common.rope import apply_rope


def norm_rope_pack(kv: torch.Tensor, weight: torch.Tensor, eps: float, rot: torch.Tensor,
                   ring: torch.Tensor | None = None, ring_row: torch.Tensor | None = None,
                   ring_slot: torch.Tensor | None = None, *,
                   positions: torch.Tensor | None = None,
                   position: torch.Tensor | None = None) -> torch.Tensor:
    """``pack_window_rows(apply_rope(rms_norm(kv, weight, eps), rot))``, optionally into a ring.

    kv: [N, D] bf16, D a multiple of 32; weight: [D] bf16 (kv_norm); rot: [N, R/2] complex64
    rotations of each row's position (rope_rotations), 2 * (R/2) <= D.
    ring: optional [B, S, D + D/32] uint8 window ring, written in place: row i goes to
    ring[ring_row[i], ring_slot[i]] (ring_row, ring_slot: [N] int64), or with ring_row None
    to flat slot ring_slot[i] = row * S + slot; rows with ring_slot < 0 are not written. At
    most one row per ring slot. positions, position (with a ring): [B] and [N] int64,
    positions[row of i] = position[i] for every row written (at most one per sequence).
    Returns the packed rows [N, D + D/32] uint8: D e4m3 codes then D/32 ue8m0 exponents.
    """
    packed = pack_window_rows(apply_rope(rms_norm(kv, weight, eps), rot))  # [N, D + D/32]
    if ring is not None:
        keep = ring_slot >= 0
        if ring_row is None:
            ring_row, ring_slot = ring_slot // ring.shape[1], ring_slot % ring.shape[1]
        ring[ring_row[keep], ring_slot[keep]] = packed[keep]
        if positions is not None:
            positions[ring_row[keep]] = position[keep]
    return packed


def rope_heads(x: torch.Tensor, rot: torch.Tensor, inverse: bool = False, *,
               in_place: bool = False) -> torch.Tensor:
    """RoPE on the last R dims of every head: ``apply_rope(x, rot.unsqueeze(1), inverse)``.

    x: [N, H, D] bf16; rot: [N, R/2] complex64, one row per position; inverse multiplies by
    the conjugate. Returns a new [N, H, D] bf16 tensor (x is not modified). in_place: the
    caller no longer needs x, which the Triton op then rotates in place; here it changes
    nothing.
    """
    return apply_rope(x, rot.unsqueeze(1), inverse)
