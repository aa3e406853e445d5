"""Triton window K=V rows and per-head RoPE, same signatures and numerics as reference.py.

``norm_rope_pack``: one program per row does kv_norm (fp32 sum of squares, / D, 1/sqrt, x * r
* w, bf16 RNE), RoPE on the tail pairs (fp32 complex product, bf16 RNE), fp8 act_quant per
32-block (the ue8m0 scale and software e4m3 rounding of common.triton, as the linear op's)
and stores the packed bytes to the output and, optionally, to a ring slot. ``rope_heads`` (its
kernel lives in common.triton, which the output op shares; re-exported here): one program per
(row, head block) copies the nope dims and rotates the tail pairs (common.triton.rope_rotate,
as here). A row is read as its even and odd elements so the pairs need no shuffles. The
rotations come in as fp32 (cos, sin) from the caller's complex64.

Rounding: the products of the complex multiply are rounded separately, as torch's complex64
(enable_fp_fusion=False keeps the GPU from fusing them into FMAs); sqrt and division are the
IEEE ones (sqrt_rn, div_rn). Only the sum of squares may differ from the reference: its fp32
summation order is the reduction tree's, not torch's (see tests/test_window_kv_triton.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.triton import (FP8_BLOCK, INV_FP8_MAX, any_nan, check_device, check_rot, cos_sin,
                             e4m3_code, interpreting, next_pow2, require, rms_scale, rope_heads,
                             rope_rotate, round_bf16, ue8m0_exponent)

__all__ = ["norm_rope_pack", "rope_heads"]  # rope_heads lives in common.triton (output uses it)


@triton.jit
def _norm_rope_pack_kernel(kv_ptr, w_ptr, cs_ptr, out_ptr, ring_ptr, ring_row_ptr,
                           ring_slot_ptr, pos_ptr, position_ptr, eps, inv_max, B, S,
                           ring_stride_b, ring_stride_s, D: tl.constexpr, R2: tl.constexpr,
                           BLOCK_KB: tl.constexpr, HAS_RING: tl.constexpr,
                           HAS_ROW: tl.constexpr, HAS_POS: tl.constexpr,
                           INTERPRET: tl.constexpr):
    """kv: [N, D] bf16; w: [D] bf16; cs: [N, R2, 2] fp32; out: [N, D + D/32] uint8; ring:
    [B, S, D + D/32] uint8 with strides (ring_stride_b, ring_stride_s, 1); ring_row,
    ring_slot: [N] int64 (HAS_ROW), or ring_slot alone holding flat slots row * S + slot;
    pos: [B] int64, position: [N] int64 (HAS_POS: pos[row] = position[n] for each written
    row). All but the ring contiguous. Grid (N,)."""
    n = tl.program_id(0).to(tl.int64)
    KB: tl.constexpr = D // 32
    offs_b = tl.arange(0, BLOCK_KB)  # scale blocks of the row
    b_mask = offs_b < KB
    pair = offs_b[:, None] * 16 + tl.arange(0, 16)[None, :]  # [BLOCK_KB, 16]: elements 2p, 2p+1
    mask = b_mask[:, None]
    x_even = tl.load(kv_ptr + n * D + 2 * pair, mask=mask, other=0.0).to(tl.float32)
    x_odd = tl.load(kv_ptr + n * D + 2 * pair + 1, mask=mask, other=0.0).to(tl.float32)
    w_even = tl.load(w_ptr + 2 * pair, mask=mask, other=0.0).to(tl.float32)
    w_odd = tl.load(w_ptr + 2 * pair + 1, mask=mask, other=0.0).to(tl.float32)

    # RMSNorm: squares of bf16 values are exact in fp32; only their sum's order can differ
    sum_sq = tl.sum(tl.sum(x_even * x_even + x_odd * x_odd, 1), 0)
    r = rms_scale(sum_sq, eps, D)
    y_even = round_bf16(x_even * r * w_even, INTERPRET)
    y_odd = round_bf16(x_odd * r * w_odd, INTERPRET)

    rope_pair = pair - (D // 2 - R2)  # index into this row's rotations; < 0: nope dims
    is_rope = (rope_pair >= 0) & mask
    rot_even, rot_odd = rope_rotate(y_even, y_odd, cs_ptr + n * (2 * R2), rope_pair, is_rope,
                                    False, INTERPRET)
    y_even = tl.where(is_rope, rot_even, y_even)
    y_odd = tl.where(is_rope, rot_odd, y_odd)

    # act_quant per 32-block (docs/numerics.md §2); 1/s is a power of two so y * (1/s) == y / s
    amax = tl.maximum(tl.max(tl.abs(y_even), 1), tl.max(tl.abs(y_odd), 1))  # [BLOCK_KB]
    e = ue8m0_exponent(amax, inv_max)
    inv_s = ((254 - e) << 23).to(tl.float32, bitcast=True)[:, None]
    code_even = e4m3_code(y_even * inv_s).to(tl.uint8)
    code_odd = e4m3_code(y_odd * inv_s).to(tl.uint8)
    scale_byte = e.to(tl.uint8)  # the ue8m0 byte is the biased exponent
    # a block holding a NaN or an infinity: zero codes under scale byte 255 (2^128 = inf), so
    # every element decodes to 0 * inf = NaN and every logit that reads the row is NaN, as
    # with the reference's bytes (whose NaN scale or codes decode to NaN); never finite
    bad = any_nan(y_even, 1, INF=True) | any_nan(y_odd, 1, INF=True)
    code_even = tl.where(bad[:, None], 0, code_even).to(tl.uint8)
    code_odd = tl.where(bad[:, None], 0, code_odd).to(tl.uint8)
    scale_byte = tl.where(bad, 255, e).to(tl.uint8)

    out_row = out_ptr + n * (D + KB)
    tl.store(out_row + 2 * pair, code_even, mask=mask)
    tl.store(out_row + 2 * pair + 1, code_odd, mask=mask)
    tl.store(out_row + D + offs_b, scale_byte, mask=b_mask)
    if HAS_RING:
        slot = tl.load(ring_slot_ptr + n)
        if HAS_ROW:
            seq = tl.load(ring_row_ptr + n)
        else:  # a flat slot row * S + slot (a negative one is not written)
            seq = tl.where(slot >= 0, slot // S, -1)
            slot = slot % S
        # out-of-range entries are caller errors; skipping them keeps the write in bounds
        if (slot >= 0) & (slot < S) & (seq >= 0) & (seq < B):
            ring_at = ring_ptr + seq * ring_stride_b + slot * ring_stride_s
            tl.store(ring_at + 2 * pair, code_even, mask=mask)
            tl.store(ring_at + 2 * pair + 1, code_odd, mask=mask)
            tl.store(ring_at + D + offs_b, scale_byte, mask=b_mask)
            if HAS_POS:
                tl.store(pos_ptr + seq, tl.load(position_ptr + n))


def norm_rope_pack(kv: torch.Tensor, weight: torch.Tensor, eps: float, rot: torch.Tensor,
                   ring: torch.Tensor | None = None, ring_row: torch.Tensor | None = None,
                   ring_slot: torch.Tensor | None = None, *,
                   positions: torch.Tensor | None = None,
                   position: torch.Tensor | None = None) -> torch.Tensor:
    """``pack_window_rows(apply_rope(rms_norm(kv, weight, eps), rot))``, optionally into a ring.

    kv: [N, D] bf16, D a multiple of 32; weight: [D] bf16 (kv_norm); rot: [N, R/2] complex64
    rotations of each row's position (rope_rotations), 2 * (R/2) <= D.
    ring: optional [B, S, D + D/32] uint8 window ring (last dim contiguous), written in place:
    row i goes to ring[ring_row[i], ring_slot[i]] (ring_row, ring_slot: [N] int64), or with
    ring_row None to flat slot ring_slot[i] = row * S + slot; rows with ring_slot < 0 are not
    written. At most one row per ring slot; entries outside the ring are not checked on the
    host (it would need a sync) and not written. positions, position (with a ring): [B] and
    [N] int64, positions[row of i] = position[i] for every row written (the ring's sequence
    positions advanced with its rows; at most one row per sequence then).
    Returns the packed rows [N, D + D/32] uint8: D e4m3 codes then D/32 ue8m0 exponents.
    Finite inputs only.
    """
    require(isinstance(kv, torch.Tensor) and kv.dtype == torch.bfloat16 and kv.dim() == 2,
          f"kv must be a 2-D bf16 [N, D] tensor, got {getattr(kv, 'dtype', type(kv))} "
          f"{tuple(getattr(kv, 'shape', ()))}")
    n, d = kv.shape
    require(d > 0 and d % FP8_BLOCK == 0,
          f"kv's last dim D = {d} must be a positive multiple of the quant block {FP8_BLOCK}")
    require(isinstance(weight, torch.Tensor) and weight.dtype == torch.bfloat16
          and tuple(weight.shape) == (d,),
          f"weight must be a bf16 [{d}] tensor, got {getattr(weight, 'dtype', type(weight))} "
          f"{tuple(getattr(weight, 'shape', ()))}")
    r2 = check_rot(rot, n, d)
    row_bytes = d + d // FP8_BLOCK
    tensors = [kv, weight, rot]
    if ring is None:
        require(ring_row is None and ring_slot is None,
              "ring_row and ring_slot were given without a ring")
    else:
        require(isinstance(ring, torch.Tensor) and ring.dtype == torch.uint8 and ring.dim() == 3
              and ring.shape[2] == row_bytes and ring.stride(2) == 1,
              f"ring must be a uint8 [B, S, {row_bytes}] tensor with a contiguous last dim, got "
              f"{getattr(ring, 'dtype', type(ring))} {tuple(getattr(ring, 'shape', ()))}")
        indices = (("ring_slot", ring_slot),) if ring_row is None else \
            (("ring_row", ring_row), ("ring_slot", ring_slot))
        for name, index in indices:
            require(isinstance(index, torch.Tensor) and index.dtype == torch.int64
                  and tuple(index.shape) == (n,),
                  f"{name} must be an int64 [{n}] tensor when a ring is given, got "
                  f"{getattr(index, 'dtype', type(index))} {tuple(getattr(index, 'shape', ()))}")
        tensors += [ring, ring_slot] + ([] if ring_row is None else [ring_row])
    if positions is None:
        require(position is None, "position was given without positions")
    else:
        b = ring.shape[0] if ring is not None else None
        require(ring is not None, "positions were given without a ring")
        require(isinstance(positions, torch.Tensor) and positions.dtype == torch.int64
              and tuple(positions.shape) == (b,) and positions.is_contiguous(),
              f"positions must be a contiguous int64 [{b}] tensor (one per ring row), got "
              f"{getattr(positions, 'dtype', type(positions))} "
              f"{tuple(getattr(positions, 'shape', ()))}")
        require(isinstance(position, torch.Tensor) and position.dtype == torch.int64
              and tuple(position.shape) == (n,),
              f"position must be an int64 [{n}] tensor with positions, got "
              f"{getattr(position, 'dtype', type(position))} "
              f"{tuple(getattr(position, 'shape', ()))}")
        tensors += [positions, position]
    check_device(*tensors)
    out = torch.empty(n, row_bytes, dtype=torch.uint8, device=kv.device)
    if n == 0:
        return out
    has_ring, has_row, has_pos = ring is not None, ring_row is not None, positions is not None
    if not has_ring:  # placeholders: HAS_RING=False never touches them
        ring, ring_slot = out, out
    if not has_row:
        ring_row = out
    if not has_pos:
        positions, position = out, out
    _norm_rope_pack_kernel[(n,)](
        kv.contiguous(), weight.contiguous(), cos_sin(rot), out, ring,
        ring_row.contiguous(), ring_slot.contiguous(), positions, position.contiguous(),
        float(eps), INV_FP8_MAX,
        ring.shape[0] if has_ring else 0, ring.shape[1] if has_ring else 0,
        ring.stride(0) if has_ring else 0, ring.stride(1) if has_ring else 0,
        D=d, R2=r2, BLOCK_KB=next_pow2(d // FP8_BLOCK), HAS_RING=has_ring,
        HAS_ROW=has_row, HAS_POS=has_pos, INTERPRET=interpreting(), num_warps=4,
        enable_fp_fusion=False)
    return out
