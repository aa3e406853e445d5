"""Triton sparse attention with a per-head sink (SPEC §4.5), same numerics as reference.py.

One program per (b, query i, block of 16 heads). It walks idx[b, i, :] in blocks of 64 in list
order, gathers the KV rows (K = V, MQA) by pointer arithmetic, and runs the online softmax of
the reference: fp32 logits from bf16 tl.dot, running max from -1e30 over logits only, p cast to
bf16 before P.V, fp32 accumulator, sink added to the denominator after the last block.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # index-list block: fixed by the reference's rounding points (SPEC §10.6)
BLOCK_H = 16  # head tile: tl.dot needs every dim >= 16


@triton.jit
def _to_bf16(x, INTERPRET: tl.constexpr):
    """fp32 -> bf16 with round-to-nearest-even (the hardware cast, as torch's .bfloat16()).

    Under the interpreter its cast truncates and its tl.dot reads bf16 bit patterns as integers
    (triton#11584), so there we round by bits and keep the (exact) value in fp32.
    """
    if INTERPRET:
        u = x.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000  # finite x only: all we round here
        y = u.to(tl.float32, bitcast=True)
    else:
        y = x.to(tl.bfloat16)
    return y


@triton.jit
def _sparse_attn_kernel(q_ptr, kv_ptr, sink_ptr, idx_ptr, o_ptr, scale, M, H, N, W,
                        D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                        INTERPRET: tl.constexpr):
    """q, o: [B, M, H, D] bf16; kv: [B, N, D] bf16; sink: [H] fp32; idx: [B, M, W] int32.

    All tensors contiguous. Grid: (B * M, cdiv(H, BLOCK_H)). INTERPRET (CPU interpreter only)
    feeds tl.dot the same bf16 values widened to fp32, which is exact (see _to_bf16).
    """
    bi = tl.program_id(0).to(tl.int64)  # flat b * M + i; int64 so offsets cannot overflow
    hb = tl.program_id(1)
    b = bi // M
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    offs_d = tl.arange(0, D)
    row_off = bi * H * D + offs_h[:, None] * D + offs_d[None, :]  # [BLOCK_H, D]
    # padded heads load q = 0: their logits are finite and their rows are never stored
    q = tl.load(q_ptr + row_off, mask=h_mask[:, None], other=0.0)
    if INTERPRET:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], -1e30, tl.float32)  # literal: jit bodies read constexpr globals only
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    kv_base = kv_ptr + b * N * D
    idx_base = idx_ptr + bi * W
    for j0 in range(0, W, BLOCK_N):
        offs_n = j0 + tl.arange(0, BLOCK_N)
        rows = tl.load(idx_base + offs_n, mask=offs_n < W, other=-1)  # tail counts as -1
        valid = rows >= 0
        rows = tl.where(valid, rows, 0).to(tl.int64)  # clamp -1 to row 0 for the address only
        kv = tl.load(kv_base + rows[:, None] * D + offs_d[None, :], mask=valid[:, None],
                     other=0.0)  # [BLOCK_N, D] bf16, serves as K and V
        if INTERPRET:
            kv = kv.to(tl.float32)
        s = tl.dot(q, tl.trans(kv))  # [BLOCK_H, BLOCK_N] fp32
        s = tl.where(valid[None, :], s, float("-inf")) * scale
        m_new = tl.maximum(m_i, tl.max(s, 1))  # >= -1e30, so never -inf: no inf - inf
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])  # invalid entries: exp(-inf) = 0
        l_i = l_i * alpha + tl.sum(p, 1)
        pb = _to_bf16(p, INTERPRET)  # the reference's rounding point before P.V
        acc = acc * alpha[:, None] + tl.dot(pb, kv)
        m_i = m_new

    sink = tl.load(sink_ptr + offs_h, mask=h_mask, other=0.0)
    l_i = l_i + tl.exp(sink - m_i)  # empty row: exp(sink + 1e30) = inf and acc = 0, so o = 0
    # l_i = 0 only for an empty row with sink = -inf: acc / 1 = 0 keeps "empty row -> 0", no NaN
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o = _to_bf16(o, INTERPRET).to(tl.bfloat16)  # 2nd cast exact (interpreter) or a no-op
    tl.store(o_ptr + row_off, o, mask=h_mask[:, None])


def _interpreting() -> bool:
    """The CPU interpreter multiplies bf16 bit patterns in tl.dot (triton#11584): widen there.

    triton.jit picks the interpreter when the kernel is defined, so ask the kernel, not the env.
    """
    return type(_sparse_attn_kernel).__name__ == "InterpretedFunction"


def sparse_attn(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor,
                scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """o[b,i,h] = sum_t e^{l_t} kv[idx_t] / (sum_t e^{l_t} + e^{sink_h}), l_t = scale q.kv[idx_t].

    q: [B, M, H, D] bf16; kv: [B, N, D] bf16 (rows addressed by idx); sink: [H] fp32;
    idx: [B, M, W] int32 row numbers into kv, -1 = skip (W may be 0). out: optional
    [B, M, H, D] bf16 contiguous buffer to write into. Returns [B, M, H, D] bf16; a query
    with no valid entry gives 0 (no NaN). D must be a power of two >= 16.
    """
    if q.dim() != 4 or kv.dim() != 3 or idx.dim() != 3 or sink.dim() != 1:
        raise ValueError(f"bad ranks: q {tuple(q.shape)}, kv {tuple(kv.shape)}, "
                         f"idx {tuple(idx.shape)}, sink {tuple(sink.shape)}")
    b, m, h, d = q.shape
    n = kv.shape[1]
    if kv.shape[0] != b or kv.shape[2] != d:
        raise ValueError(f"kv {tuple(kv.shape)} does not match q {tuple(q.shape)}")
    if idx.shape[:2] != (b, m):
        raise ValueError(f"idx {tuple(idx.shape)} does not match q {tuple(q.shape)}")
    if sink.shape[0] != h:
        raise ValueError(f"sink {tuple(sink.shape)} does not match {h} heads")
    if q.dtype != torch.bfloat16 or kv.dtype != torch.bfloat16:
        raise TypeError(f"q and kv must be bf16, got {q.dtype}, {kv.dtype}")
    if sink.dtype != torch.float32 or idx.dtype != torch.int32:
        raise TypeError(f"sink must be fp32 and idx int32, got {sink.dtype}, {idx.dtype}")
    if d < 16 or d & (d - 1):
        raise ValueError(f"head dim {d} must be a power of two >= 16")
    if len({t.device for t in (q, kv, sink, idx)}) != 1:
        raise ValueError("q, kv, sink, idx must be on one device")
    if out is None:
        out = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
    elif out.shape != q.shape or out.dtype != torch.bfloat16 or out.device != q.device \
            or not out.is_contiguous():
        raise ValueError("out must be a contiguous bf16 tensor shaped like q on q's device")
    if out.numel() == 0:
        return out
    if idx.shape[2] == 0:  # no entries at all: every row is empty, o = 0 (as the reference)
        return out.zero_()
    q, kv, sink, idx = q.contiguous(), kv.contiguous(), sink.contiguous(), idx.contiguous()
    grid = (b * m, triton.cdiv(h, BLOCK_H))
    _sparse_attn_kernel[grid](q, kv, sink, idx, out, float(scale), m, h, n, idx.shape[2],
                              D=d, BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, INTERPRET=_interpreting(),
                              num_warps=4 if d <= 128 else 8)  # 8 warps: less spill at D=512
    return out


def sparse_attn_paged(q: torch.Tensor, sink: torch.Tensor, scale: float,
                      window_rows: torch.Tensor, window_idx: torch.Tensor,
                      compressed_pool: torch.Tensor | None, block_table: torch.Tensor | None,
                      compressed_idx: torch.Tensor) -> torch.Tensor:
    """``reference.sparse_attn_paged``'s signature: rows unpacked by torch, then the kernel."""
    from .reference import paged_rows, unpack_compressed_rows, unpack_window_rows

    window = unpack_window_rows(window_rows)
    kv, idx = window, window_idx
    if compressed_idx.shape[-1]:
        g = torch.arange(int(compressed_idx.max()) + 1, device=q.device)
        compressed = unpack_compressed_rows(paged_rows(compressed_pool, block_table, g))
        kv = torch.cat([window, compressed], dim=1)
        shifted = torch.where(compressed_idx >= 0, compressed_idx + window.shape[1], -1)
        idx = torch.cat([window_idx, shifted.to(torch.int32)], dim=-1)
    return sparse_attn(q, kv, sink, idx, scale)
