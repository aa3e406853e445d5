"""Triton window K=V rows and per-head RoPE, same signatures and numerics as reference.py.

``norm_rope_pack``: one program per row does kv_norm (fp32 sum of squares, / D, 1/sqrt, x * r
* w, bf16 RNE), RoPE on the tail pairs (fp32 complex product, bf16 RNE), fp8 act_quant per
32-block (the linear op's ue8m0 scale and software e4m3 rounding) and stores the packed bytes
to the output and, optionally, to a ring slot. ``rope_heads``: one program per (row, head block)
copies the nope dims and rotates the tail pairs. A row is read as its even and odd elements so
the pairs need no shuffles. The rotations come in as fp32 (cos, sin) from the caller's complex64.

Rounding: the products of the complex multiply are rounded separately, as torch's complex64
(enable_fp_fusion=False keeps the GPU from fusing them into FMAs); sqrt and division are the
IEEE ones (sqrt_rn, div_rn). Only the sum of squares may differ from the reference: its fp32
summation order is the reduction tree's, not torch's (see tests/test_window_kv_triton.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..linear.triton import _check_device, _e4m3_code, _interpreting, _ue8m0_exponent
from ..sparse_attn.triton import _to_bf16

FP8_BLOCK = 32
_INV_FP8_MAX = torch.tensor(1.0 / 448.0, dtype=torch.float32).item()  # fp32(1/448)


@triton.jit
def _round_bf16(x, INTERPRET: tl.constexpr):
    """fp32 -> the nearest bf16 value (RNE), kept in fp32."""
    return _to_bf16(x, INTERPRET).to(tl.float32)


@triton.jit
def _rotate(even, odd, cs_ptr, pair, mask, INVERSE: tl.constexpr, INTERPRET: tl.constexpr):
    """(even + i odd) * (cos + i sin) at the rotation pairs ``pair`` (cs_ptr: this row's
    [R/2, 2] fp32), conjugate if INVERSE; each product rounded to fp32, the sums then to bf16."""
    c = tl.load(cs_ptr + 2 * pair, mask=mask, other=1.0)
    s = tl.load(cs_ptr + 2 * pair + 1, mask=mask, other=0.0)
    if INVERSE:
        s = -s
    re = even * c - odd * s
    im = even * s + odd * c
    return _round_bf16(re, INTERPRET), _round_bf16(im, INTERPRET)


@triton.jit
def _norm_rope_pack_kernel(kv_ptr, w_ptr, cs_ptr, out_ptr, ring_ptr, ring_row_ptr,
                           ring_slot_ptr, eps, inv_max, B, S, ring_stride_b, ring_stride_s,
                           D: tl.constexpr, R2: tl.constexpr, BLOCK_KB: tl.constexpr,
                           HAS_RING: tl.constexpr, INTERPRET: tl.constexpr):
    """kv: [N, D] bf16; w: [D] bf16; cs: [N, R2, 2] fp32; out: [N, D + D/32] uint8; ring:
    [B, S, D + D/32] uint8 with strides (ring_stride_b, ring_stride_s, 1); ring_row,
    ring_slot: [N] int64. All but the ring contiguous. Grid (N,)."""
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
    r = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(sum_sq, D * 1.0) + eps))
    y_even = _round_bf16(x_even * r * w_even, INTERPRET)
    y_odd = _round_bf16(x_odd * r * w_odd, INTERPRET)

    rope_pair = pair - (D // 2 - R2)  # index into this row's rotations; < 0: nope dims
    is_rope = (rope_pair >= 0) & mask
    rot_even, rot_odd = _rotate(y_even, y_odd, cs_ptr + n * (2 * R2), rope_pair, is_rope,
                                False, INTERPRET)
    y_even = tl.where(is_rope, rot_even, y_even)
    y_odd = tl.where(is_rope, rot_odd, y_odd)

    # act_quant per 32-block (SPEC §2.2); 1/s is a power of two so y * (1/s) == y / s
    amax = tl.maximum(tl.max(tl.abs(y_even), 1), tl.max(tl.abs(y_odd), 1))  # [BLOCK_KB]
    e = _ue8m0_exponent(amax, inv_max)
    inv_s = ((254 - e) << 23).to(tl.float32, bitcast=True)[:, None]
    code_even = _e4m3_code(y_even * inv_s).to(tl.uint8)
    code_odd = _e4m3_code(y_odd * inv_s).to(tl.uint8)
    scale_byte = e.to(tl.uint8)  # the ue8m0 byte is the biased exponent

    out_row = out_ptr + n * (D + KB)
    tl.store(out_row + 2 * pair, code_even, mask=mask)
    tl.store(out_row + 2 * pair + 1, code_odd, mask=mask)
    tl.store(out_row + D + offs_b, scale_byte, mask=b_mask)
    if HAS_RING:
        slot = tl.load(ring_slot_ptr + n)
        seq = tl.load(ring_row_ptr + n)
        # out-of-range entries are caller errors; skipping them keeps the write in bounds
        if (slot >= 0) & (slot < S) & (seq >= 0) & (seq < B):
            ring_at = ring_ptr + seq * ring_stride_b + slot * ring_stride_s
            tl.store(ring_at + 2 * pair, code_even, mask=mask)
            tl.store(ring_at + 2 * pair + 1, code_odd, mask=mask)
            tl.store(ring_at + D + offs_b, scale_byte, mask=b_mask)


@triton.jit
def _rope_heads_kernel(x_ptr, cs_ptr, out_ptr, H, D: tl.constexpr, R2: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_NOPE: tl.constexpr, BLOCK_R2: tl.constexpr,
                       INVERSE: tl.constexpr, INTERPRET: tl.constexpr):
    """x, out: [N, H, D] bf16; cs: [N, R2, 2] fp32; all contiguous. Grid (N, cdiv(H, BLOCK_H))."""
    n = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h[:, None] < H
    row = n * H * D + offs_h[:, None] * D  # [BLOCK_H, 1]
    offs_nope = tl.arange(0, BLOCK_NOPE)[None, :]
    nope_mask = h_mask & (offs_nope < D - 2 * R2)
    tl.store(out_ptr + row + offs_nope, tl.load(x_ptr + row + offs_nope, mask=nope_mask),
             mask=nope_mask)
    pair = tl.arange(0, BLOCK_R2)[None, :]
    pair_mask = pair < R2
    mask = h_mask & pair_mask
    col = D - 2 * R2 + 2 * pair
    x_even = tl.load(x_ptr + row + col, mask=mask, other=0.0).to(tl.float32)
    x_odd = tl.load(x_ptr + row + col + 1, mask=mask, other=0.0).to(tl.float32)
    y_even, y_odd = _rotate(x_even, x_odd, cs_ptr + n * (2 * R2), pair, pair_mask, INVERSE,
                            INTERPRET)
    tl.store(out_ptr + row + col, y_even.to(tl.bfloat16), mask=mask)  # exact: already bf16
    tl.store(out_ptr + row + col + 1, y_odd.to(tl.bfloat16), mask=mask)


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_rot(rot: torch.Tensor, n: int, d: int) -> int:
    """Validate rot [n, R/2] complex64 with R <= d; returns R/2."""
    _need(isinstance(rot, torch.Tensor) and rot.dtype == torch.complex64 and rot.dim() == 2,
          f"rot must be a 2-D complex64 [N, R/2] tensor, got "
          f"{getattr(rot, 'dtype', type(rot))} {tuple(getattr(rot, 'shape', ()))}")
    r2 = rot.shape[1]
    _need(rot.shape[0] == n and 1 <= r2 and 2 * r2 <= d,
          f"rot shape {tuple(rot.shape)} does not match N = {n} rows with 1 <= R/2 <= D/2 = "
          f"{d // 2}")
    return r2


def _cos_sin(rot: torch.Tensor) -> torch.Tensor:
    """complex64 [N, R/2] -> contiguous fp32 [N, R/2, 2] (cos, sin)."""
    return torch.view_as_real(rot.resolve_conj().contiguous())


def norm_rope_pack(kv: torch.Tensor, weight: torch.Tensor, eps: float, rot: torch.Tensor,
                   ring: torch.Tensor | None = None, ring_row: torch.Tensor | None = None,
                   ring_slot: torch.Tensor | None = None) -> torch.Tensor:
    """``pack_window_rows(apply_rope(rms_norm(kv, weight, eps), rot))``, optionally into a ring.

    kv: [N, D] bf16, D a multiple of 32; weight: [D] bf16 (kv_norm); rot: [N, R/2] complex64
    rotations of each row's position (rope_rotations), 2 * (R/2) <= D.
    ring: optional [B, S, D + D/32] uint8 window ring (last dim contiguous), written in place:
    row i goes to ring[ring_row[i], ring_slot[i]] (ring_row, ring_slot: [N] int64); rows with
    ring_slot < 0 are not written. At most one row per (ring_row, ring_slot) pair; entries
    outside [0, B) x [0, S) are not checked on the host (it would need a sync) and not written.
    Returns the packed rows [N, D + D/32] uint8: D e4m3 codes then D/32 ue8m0 exponents.
    Finite inputs only.
    """
    _need(isinstance(kv, torch.Tensor) and kv.dtype == torch.bfloat16 and kv.dim() == 2,
          f"kv must be a 2-D bf16 [N, D] tensor, got {getattr(kv, 'dtype', type(kv))} "
          f"{tuple(getattr(kv, 'shape', ()))}")
    n, d = kv.shape
    _need(d > 0 and d % FP8_BLOCK == 0,
          f"kv's last dim D = {d} must be a positive multiple of the quant block {FP8_BLOCK}")
    _need(isinstance(weight, torch.Tensor) and weight.dtype == torch.bfloat16
          and tuple(weight.shape) == (d,),
          f"weight must be a bf16 [{d}] tensor, got {getattr(weight, 'dtype', type(weight))} "
          f"{tuple(getattr(weight, 'shape', ()))}")
    r2 = _check_rot(rot, n, d)
    row_bytes = d + d // FP8_BLOCK
    tensors = [kv, weight, rot]
    if ring is None:
        _need(ring_row is None and ring_slot is None,
              "ring_row and ring_slot were given without a ring")
    else:
        _need(isinstance(ring, torch.Tensor) and ring.dtype == torch.uint8 and ring.dim() == 3
              and ring.shape[2] == row_bytes and ring.stride(2) == 1,
              f"ring must be a uint8 [B, S, {row_bytes}] tensor with a contiguous last dim, got "
              f"{getattr(ring, 'dtype', type(ring))} {tuple(getattr(ring, 'shape', ()))}")
        for name, index in (("ring_row", ring_row), ("ring_slot", ring_slot)):
            _need(isinstance(index, torch.Tensor) and index.dtype == torch.int64
                  and tuple(index.shape) == (n,),
                  f"{name} must be an int64 [{n}] tensor when a ring is given, got "
                  f"{getattr(index, 'dtype', type(index))} {tuple(getattr(index, 'shape', ()))}")
        tensors += [ring, ring_row, ring_slot]
    _check_device(*tensors)
    out = torch.empty(n, row_bytes, dtype=torch.uint8, device=kv.device)
    if n == 0:
        return out
    has_ring = ring is not None
    if not has_ring:  # placeholders: HAS_RING=False never touches them
        ring, ring_row, ring_slot = out, out, out
    _norm_rope_pack_kernel[(n,)](
        kv.contiguous(), weight.contiguous(), _cos_sin(rot), out, ring,
        ring_row.contiguous(), ring_slot.contiguous(), float(eps), _INV_FP8_MAX,
        ring.shape[0] if has_ring else 0, ring.shape[1] if has_ring else 0,
        ring.stride(0) if has_ring else 0, ring.stride(1) if has_ring else 0,
        D=d, R2=r2, BLOCK_KB=triton.next_power_of_2(d // FP8_BLOCK), HAS_RING=has_ring,
        INTERPRET=_interpreting(), num_warps=4, enable_fp_fusion=False)
    return out


def rope_heads(x: torch.Tensor, rot: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """RoPE on the last R dims of every head: ``apply_rope(x, rot.unsqueeze(1), inverse)``.

    x: [N, H, D] bf16; rot: [N, R/2] complex64, one row per position; inverse multiplies by
    the conjugate. Returns a new [N, H, D] bf16 tensor (x is not modified).
    """
    _need(isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16 and x.dim() == 3,
          f"x must be a 3-D bf16 [N, H, D] tensor, got {getattr(x, 'dtype', type(x))} "
          f"{tuple(getattr(x, 'shape', ()))}")
    n, h, d = x.shape
    r2 = _check_rot(rot, n, d)
    _check_device(x, rot)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if out.numel() == 0:
        return out
    block_h = min(triton.next_power_of_2(h), 8)
    _rope_heads_kernel[(n, triton.cdiv(h, block_h))](
        x.contiguous(), _cos_sin(rot), out, h, D=d, R2=r2, BLOCK_H=block_h,
        BLOCK_NOPE=triton.next_power_of_2(max(d - 2 * r2, 1)),
        BLOCK_R2=triton.next_power_of_2(r2), INVERSE=bool(inverse), INTERPRET=_interpreting(),
        num_warps=4, enable_fp_fusion=False)
    return out
