"""Triton sparse attention with a per-head sink (SPEC §4.5), same numerics as reference.py.

``sparse_attn`` (bf16 rows) and ``sparse_attn_paged`` (the packed caches: fp8 window rows,
paged fp4 compressed rows, decoded in registers). One program per (b, query i, head block
[, split]) walks the index list in blocks of 64 in list order, gathers the KV rows (K = V, MQA)
by pointer arithmetic, and runs the reference's online softmax: fp32 logits from bf16 tl.dot,
running max from -1e30 over logits only, p cast to bf16 before P.V, fp32 accumulator, sink
added to the denominator after the last block. The paged op can split a list over programs
(flash-decoding) and merge their fp32 partials in a second kernel.
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
def _finish(o_ptr, sink_ptr, bi, offs_h, h_mask, offs_d, m_i, l_i, acc, H, D: tl.constexpr,
            INTERPRET: tl.constexpr):
    """Add the sink to the denominator, divide, store o[bi, offs_h, offs_d] bf16. Empty row:
    l = 0, m = -1e30: o = 0 / inf = 0; with sink = -inf too, l = 0 and o = 0 / 1 (no NaN)."""
    sink = tl.load(sink_ptr + offs_h, mask=h_mask, other=0.0)
    l_i = l_i + tl.exp(sink - m_i)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o = _to_bf16(o, INTERPRET).to(tl.bfloat16)
    tl.store(o_ptr + bi * H * D + offs_h[:, None] * D + offs_d[None, :], o, mask=h_mask[:, None])


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

    _finish(o_ptr, sink_ptr, bi, offs_h, h_mask, offs_d, m_i, l_i, acc, H, D, INTERPRET)


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


# ---- paged variant: rows decoded in registers from the packed caches --------------------------

NUM_SMS = 132  # H200; the CUDA device's own count is used when there is one
MAX_SPLIT_QUERIES = 4  # split the index list only for decode-like calls (M <= this)
BLOCK_H_MAX = 64  # paged head tile: up to 64 (rows decoded once per tile; H200 D=512: fastest)


@triton.jit
def _window_tile(win_base, rows, ok, D: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_N, D] fp32 of packed window rows (D e4m3 codes, then D/32 ue8m0 exponents).

    rows: [BLOCK_N] int64 (rows ~ok give 0). Loaded as [BLOCK_N, D/32, 32]: the codes load as
    vectors, each exponent byte once.
    """
    ptr, ok3 = win_base + rows[:, None, None] * (D + D // 32), ok[:, None, None]
    blk = tl.arange(0, D // 32)[None, :, None]
    codes = tl.load(ptr + blk * 32 + tl.arange(0, 32)[None, None, :], mask=ok3, other=0)
    e = tl.load(ptr + D + blk, mask=ok3, other=0)  # [BLOCK_N, D/32, 1]
    s = (e.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # 2^(e-127); byte 0 -> 0 (as ref)
    v = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * s
    return tl.reshape(v, (BLOCK_N, D))


@triton.jit
def _compressed_tile(pool_ptr, bt_base, g, ok, PAGES, PAGE_ROWS, D: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    """[BLOCK_N, D] fp32 of compressed rows g of one sequence (rows ~ok give 0).

    Row g is pool[bt[g // PAGE_ROWS], g % PAGE_ROWS]: D/2 bytes of e2m1 pairs (element 2i in
    the low nibble), then D/16 e4m3 scales. Loaded as [BLOCK_N, D/16, 8] bytes; each nibble
    is re-encoded as an e4m3 byte for the hardware fp8 conversion, join + reshape interleave.
    """
    pg = g // PAGE_ROWS
    page = tl.load(bt_base + pg, mask=ok & (pg < PAGES), other=0)
    page = tl.maximum(page, 0)  # -1 (unallocated) reads page 0, like the reference's clamp
    ptr = (pool_ptr + (page * PAGE_ROWS + g % PAGE_ROWS) * (D // 2 + D // 16))[:, None, None]
    blk, ok3 = tl.arange(0, D // 16)[None, :, None], ok[:, None, None]
    byte = tl.load(ptr + blk * 8 + tl.arange(0, 8)[None, None, :], mask=ok3, other=0)
    # e2m1 nibble s|e1 e0|m -> e4m3 byte s|0 0 e1 e0|m 0 0, worth the e2m1 value * 2^-6
    lo = ((byte & 7) << 2) | ((byte & 8) << 4)
    hi = ((byte >> 2) & 0x1C) | (byte & 0x80)
    e4 = tl.reshape(tl.join(lo, hi), (BLOCK_N, D // 16, 16))  # element 2i from the low nibble
    sc = tl.load(ptr + D // 2 + blk, mask=ok3, other=0)  # [BLOCK_N, D/16, 1] e4m3
    sc = sc.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 64.0
    v = e4.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc
    return tl.reshape(v, (BLOCK_N, D))


@triton.jit
def _kv_tile(win_base, widx_base, pool_ptr, bt_base, cidx_base, j0, WW, K, PAGES, PAGE_ROWS,
             D: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr):
    """Rows of list entries j0..j0+BLOCK_N (window_idx row, then compressed_idx row): the
    [BLOCK_N, D] bf16 tile (fp32 holding bf16 values under the interpreter) and the valid mask.
    """
    offs_n = j0 + tl.arange(0, BLOCK_N)
    wr = tl.load(widx_base + offs_n, mask=offs_n < WW, other=-1)
    cr = tl.load(cidx_base + (offs_n - WW), mask=(offs_n >= WW) & (offs_n < WW + K), other=-1)
    ok_w, ok_c = wr >= 0, cr >= 0
    wr, cr = tl.where(ok_w, wr, 0).to(tl.int64), tl.where(ok_c, cr, 0).to(tl.int64)
    if j0 + BLOCK_N <= WW:  # window entries only
        kv = _window_tile(win_base, wr, ok_w, D, BLOCK_N)
    elif j0 >= WW:  # compressed entries only
        kv = _compressed_tile(pool_ptr, bt_base, cr, ok_c, PAGES, PAGE_ROWS, D, BLOCK_N)
    else:  # the block where the window part ends: each row is one or the other (or 0)
        kv = _window_tile(win_base, wr, ok_w, D, BLOCK_N) + _compressed_tile(
            pool_ptr, bt_base, cr, ok_c, PAGES, PAGE_ROWS, D, BLOCK_N)
    if not INTERPRET:  # exact: every cached value is a bf16 value
        # opaque copy: the two dots want two register layouts of the tile; without it the
        # compiler decodes it twice (and spills), with it both read one shared-memory copy
        kv = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [kv.to(tl.bfloat16)],
                                       dtype=tl.bfloat16, is_pure=False, pack=2)
    return kv, ok_w | ok_c


@triton.jit
def _sparse_attn_paged_kernel(
        q_ptr, sink_ptr, win_ptr, widx_ptr, pool_ptr, bt_ptr, cidx_ptr, o_ptr, ml_ptr, acc_ptr,
        scale, M, H, NW, WW, K, PAGES, PAGE_ROWS, BLOCKS_PER_SPLIT, sw_b, sw_m, sc_b, sc_m, bt_b,
        D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
        INTERPRET: tl.constexpr):
    """One (b, query i, head block, split s) program over list blocks [s*BPS, (s+1)*BPS).

    The list of query (b, i) is window_idx[b, i, :WW] then compressed_idx[b, i, :K]. SPLIT:
    write fp32 partials m, l [B*M, S, H] (ml_ptr: m then l) and acc [B*M, S, H, D] for
    _combine_kernel; else finish with the sink and store o [B, M, H, D] bf16.
    """
    bi = tl.program_id(0).to(tl.int64)  # flat b * M + i
    sp = tl.program_id(2)
    b, i = bi // M, bi % M
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + bi * H * D + offs_h[:, None] * D + offs_d[None, :],
                mask=h_mask[:, None], other=0.0)
    if INTERPRET:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], -1e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    win_base = win_ptr + b * NW * (D + D // 32)
    widx_base = widx_ptr + b * sw_b + i * sw_m
    cidx_base = cidx_ptr + b * sc_b + i * sc_m
    j_start = sp * BLOCKS_PER_SPLIT * BLOCK_N
    j_end = tl.minimum(j_start + BLOCKS_PER_SPLIT * BLOCK_N, WW + K)
    for j0 in range(j_start, j_end, BLOCK_N):
        kv, valid = _kv_tile(win_base, widx_base, pool_ptr, bt_ptr + b * bt_b, cidx_base, j0, WW,
                             K, PAGES, PAGE_ROWS, D, BLOCK_N, INTERPRET)
        s = tl.dot(q, tl.trans(kv))
        s = tl.where(valid[None, :], s, float("-inf")) * scale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(_to_bf16(p, INTERPRET), kv)
        m_i = m_new

    if SPLIT:
        ns = tl.num_programs(2)
        part = (bi * ns + sp) * H + offs_h  # [BLOCK_H] rows of the [B*M, S, H] partials
        tl.store(ml_ptr + part, m_i, mask=h_mask)
        tl.store(ml_ptr + tl.num_programs(0) * ns * H + part, l_i, mask=h_mask)
        tl.store(acc_ptr + part[:, None] * D + offs_d[None, :], acc, mask=h_mask[:, None])
    else:
        _finish(o_ptr, sink_ptr, bi, offs_h, h_mask, offs_d, m_i, l_i, acc, H, D, INTERPRET)


@triton.jit
def _combine_kernel(ml_ptr, acc_ptr, sink_ptr, o_ptr, H, S, D: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr):
    """Merge S partials: M = max m_s, l = sum l_s e^(m_s-M), acc = sum acc_s e^(m_s-M).

    Grid: (B * M, cdiv(H, BLOCK_H), D / BLOCK_D); then the sink and the division as unsplit.
    """
    bi, offs_h = tl.program_id(0).to(tl.int64), tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask, offs_d = offs_h < H, tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    m_max = tl.full([BLOCK_H], -1e30, tl.float32)
    for s in range(0, S):
        m_max = tl.maximum(m_max, tl.load(ml_ptr + (bi * S + s) * H + offs_h, mask=h_mask,
                                          other=-1e30))
    l_i, acc = tl.zeros([BLOCK_H], tl.float32), tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for s in range(0, S):
        part = (bi * S + s) * H + offs_h
        w = tl.exp(tl.load(ml_ptr + part, mask=h_mask, other=-1e30) - m_max)
        l_i += tl.load(ml_ptr + tl.num_programs(0) * S * H + part, mask=h_mask, other=0.) * w
        acc += tl.load(acc_ptr + part[:, None] * D + offs_d[None, :], mask=h_mask[:, None],
                       other=0.0) * w[:, None]
    _finish(o_ptr, sink_ptr, bi, offs_h, h_mask, offs_d, m_max, l_i, acc, H, D, INTERPRET)


def _pick_splits(programs: int, n_blocks: int, m: int, sms: int) -> int:
    """Splits of the list's 64-blocks for decode: fill one wave of ``sms`` programs (at D=512 a
    program has an SM to itself: more waves measured slower on an H200); 1 for prefill."""
    if m > MAX_SPLIT_QUERIES or 2 * programs > sms or n_blocks <= 1:
        return 1
    s = min(n_blocks, sms // programs)
    return triton.cdiv(n_blocks, triton.cdiv(n_blocks, s))  # no split left without a block


def sparse_attn_paged(q: torch.Tensor, sink: torch.Tensor, scale: float,
                      window_rows: torch.Tensor, window_idx: torch.Tensor,
                      compressed_pool: torch.Tensor | None, block_table: torch.Tensor | None,
                      compressed_idx: torch.Tensor, out: torch.Tensor | None = None,
                      num_splits: int | None = None, block_h: int | None = None,
                      num_warps: int | None = None) -> torch.Tensor:
    """``reference.sparse_attn_paged`` in Triton: rows decoded in registers from the packed bytes.

    q: [B, M, H, D] bf16; sink: [H] fp32; window_rows: [B, Nw, D + D/32] uint8 (e4m3 codes,
    ue8m0 exponent per 32); window_idx: [B, M, Ww] int32 rows of window_rows, -1 skip;
    compressed_pool: [P, page_rows, D/2 + D/16] uint8 (e2m1 pairs, e4m3 scale per 16) or None;
    block_table: [B, pages] int64 page ids (or None); compressed_idx: [B, M, K] int32 row
    numbers g (row g = pool[block_table[b, g // page_rows], g % page_rows]), -1 skip.
    Each query's list is its window entries then its compressed entries, walked in blocks of
    64. out: optional contiguous [B, M, H, D] bf16 buffer. num_splits: programs per (query,
    head block) over the list (flash-decoding), None = heuristic. block_h: head tile (power of
    two >= 16), None = H rounded up to a power of two in [16, 64]. Returns [B, M, H, D] bf16;
    a query without entries gives 0 (no NaN).
    """
    for name, t, rank in (("q", q, 4), ("sink", sink, 1), ("window_rows", window_rows, 3),
                          ("window_idx", window_idx, 3), ("compressed_idx", compressed_idx, 3)):
        if t.dim() != rank:
            raise ValueError(f"{name} must have {rank} dims, got {tuple(t.shape)}")
    b, m, h, d = q.shape
    ww, k = window_idx.shape[2], compressed_idx.shape[2]
    block_h = block_h or min(BLOCK_H_MAX, max(BLOCK_H, triton.next_power_of_2(h)))
    if q.dtype != torch.bfloat16 or sink.dtype != torch.float32 or window_rows.dtype != \
            torch.uint8 or window_idx.dtype != torch.int32 or compressed_idx.dtype != torch.int32:
        raise TypeError(f"want q bf16, sink fp32, window_rows uint8, window_idx and "
                        f"compressed_idx int32; got {q.dtype}, {sink.dtype}, "
                        f"{window_rows.dtype}, {window_idx.dtype}, {compressed_idx.dtype}")
    if d < 32 or d & (d - 1) or block_h < 16 or block_h & (block_h - 1):
        raise ValueError(f"head dim {d} (>= 32) and block_h {block_h} (>= 16) must be powers of 2")
    if sink.shape[0] != h or window_rows.shape[0] != b or window_rows.shape[2] != d + d // 32 \
            or window_idx.shape[:2] != (b, m) or compressed_idx.shape[:2] != (b, m):
        raise ValueError(f"shapes do not match q {tuple(q.shape)}: sink {tuple(sink.shape)}, "
                         f"window_rows {tuple(window_rows.shape)} (want [{b}, Nw, "
                         f"{d + d // 32}]), window_idx {tuple(window_idx.shape)}, "
                         f"compressed_idx {tuple(compressed_idx.shape)}")
    if k:
        if compressed_pool is None or block_table is None:
            raise ValueError("compressed entries need compressed_pool and block_table")
        if compressed_pool.dtype != torch.uint8 or block_table.dtype != torch.int64:
            raise TypeError(f"want compressed_pool uint8, block_table int64; got "
                            f"{compressed_pool.dtype}, {block_table.dtype}")
        if compressed_pool.dim() != 3 or compressed_pool.shape[2] != d // 2 + d // 16 \
                or block_table.dim() != 2 or block_table.shape[0] != b:
            raise ValueError(f"compressed_pool {tuple(compressed_pool.shape)} is not [P, "
                             f"page_rows, {d // 2 + d // 16}] or block_table "
                             f"{tuple(block_table.shape)} is not [{b}, pages]")
    if len({t.device for t in (q, sink, window_rows, window_idx, compressed_idx,
                               *((compressed_pool, block_table) if k else ()))}) != 1:
        raise ValueError("all tensors must be on one device")
    if out is None:
        out = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
    elif out.shape != q.shape or out.dtype != torch.bfloat16 or out.device != q.device \
            or not out.is_contiguous():
        raise ValueError("out must be a contiguous bf16 tensor shaped like q on q's device")
    if out.numel() == 0:
        return out
    if ww + k == 0:  # no entries at all: every row is empty, o = 0 (as the reference)
        return out.zero_()
    if window_rows.shape[1] == 0:  # Nw = 0 (so every window entry is -1): a valid pointer
        window_rows = window_rows.new_zeros(b, 1, window_rows.shape[2])
    q, sink, window_rows = q.contiguous(), sink.contiguous(), window_rows.contiguous()
    # index lists keep their batch/query strides (the layer passes an expanded window list)
    widx, cidx = (t if t.stride(2) == 1 or t.shape[2] <= 1 else t.contiguous()
                  for t in (window_idx, compressed_idx))
    pool, table = (compressed_pool.contiguous(), block_table.contiguous()) if k else \
        (window_rows, sink.new_zeros(b, 1, dtype=torch.int64))  # never read without k
    n_blocks, h_blocks = triton.cdiv(ww + k, BLOCK_N), triton.cdiv(h, block_h)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count \
        if q.device.type == "cuda" else NUM_SMS  # (cached by torch)
    s = _pick_splits(b * m * h_blocks, n_blocks, m, sms) if num_splits is None else num_splits
    if s < 1:
        raise ValueError(f"num_splits must be >= 1, got {s}")
    ml = acc = sink  # partials: unused without a split
    if s > 1:  # m and l [2, B*M, S, H], acc [B*M, S, H, D]
        ml, acc = q.new_empty(2, b * m, s, h, dtype=torch.float32), q.new_empty(
            b * m, s, h, d, dtype=torch.float32)
    interp, warps = _interpreting(), num_warps or (4 if d <= 128 else 8)
    _sparse_attn_paged_kernel[(b * m, h_blocks, s)](
        q, sink, window_rows, widx, pool, table, cidx, out, ml, acc, float(scale), m, h,
        window_rows.shape[1], ww, k, table.shape[1], pool.shape[1], triton.cdiv(n_blocks, s),
        widx.stride(0), widx.stride(1), cidx.stride(0), cidx.stride(1), table.stride(0),
        D=d, BLOCK_H=block_h, BLOCK_N=BLOCK_N, SPLIT=s > 1, INTERPRET=interp, num_warps=warps)
    if s > 1:
        bd = min(d, 128)  # small merge tiles: enough programs to read the partials fast
        _combine_kernel[(b * m, triton.cdiv(h, BLOCK_H), d // bd)](
            ml, acc, sink, out, h, s, D=d, BLOCK_H=BLOCK_H, BLOCK_D=bd, INTERPRET=interp)
    return out
