"""Sparse attention from the packed caches, warp-specialized in Gluon (Hopper).

Why: the Triton kernel (``triton.sparse_attn_paged``) decodes a block's packed rows, then runs
its MMAs, then decodes the next block, in the same warps: Triton waits for each ``tl.dot``'s
wgmma right after issuing it, and at 64 heads x 512 columns one program holds an SM, so the
tensor cores idle while rows are decoded (docs/benchmarks.md, twenty-eighth session). Here a
producer partition (4 warps) decodes each 64-row block into a shared-memory ring while the
consumer partition (two warp groups, the default one) runs the logits' and P.V's wgmmas on the
block before, handing buffers over by mbarriers.

Scope of this first kernel: ``triton.sparse_attn_paged``'s lists (window entries from the ring
or the step's new rows, then compressed entries through the block table), no split of the
list (one program a token), no ``out_rot``, 64 heads a program, D a multiple of 64 up to 512.
Its reference is
``reference.sparse_attn_paged`` and its twin the Triton kernel, which the CPU tests run under
the interpreter; Gluon kernels do not run under the interpreter, so this one is checked on a
GPU against the Triton kernel, and on the CPU only compiled for sm_90a.

Numerics as the Triton kernel's: each row's e4m3 codes times its block's 2^(e-127), exact in
bf16; logits one wgmma chain over D in K order; running max from -1e30 over the logits, p
rounded to bf16 before P.V; acc = acc * alpha + p.kv in fp32; the sink added to the
denominator at the end. The row sums of p may add in another order than the Triton kernel's.
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                               warpgroup_mma, warpgroup_mma_wait)

from ..common.buffers import out_buffer
from ..common.triton import check_rot, rope_heads
from .triton import check_paged_inputs, merge_splits, plan_splits

ROWS, MAX_HEADS = 64, 64  # list entries per block (rows per ring stage); heads a program
BLOCK_N, HEADS = gl.constexpr(ROWS), gl.constexpr(MAX_HEADS)  # the same, for the kernels
ROWS_PER_STORE = 8  # rows the producer decodes per shared-memory store (the swizzle's period)
PRODUCER_WARPS = gl.constexpr(4)
# the producer's registers a thread (setmaxnreg; sm_90a at D = 512 on Triton 3.6: 16 B of stack,
# 112 B at 56 registers); the consumers get the rest (204)
PRODUCER_REGS = 96


@gluon.jit
def _row_ptrs(ring_ptr, new_ptr, ids, N_RING, N_NEW, RB: gl.constexpr):
    """Byte pointers of window entries ``ids`` (as triton._window_ptrs): id < N_RING: ring row
    id; id >= N_RING: new row id - N_RING (clamped to the last); -1: ring row 0 (masked)."""
    r = gl.where(ids >= 0, ids, 0).to(gl.int64)
    return gl.where(r < N_RING, ring_ptr + r * RB,
                    new_ptr + gl.minimum(r - N_RING, N_NEW - 1) * RB)


@gluon.constexpr_function
def _chunk_layout(W, E):
    """[RS, D/16, E] over W warps: a lane per 16-column chunk of a row, a warp per row, a
    chunk's E elements (or bytes) in one thread; the distribution of a [RS, D] tile whose
    threads each hold 16 consecutive columns (PRODUCER_LAYOUT), so that a chunk's scale is one
    load a thread and its codes one vector load."""
    return gl.BlockedLayout([1, 1, E], [1, 32, 1], [W, 1, 1], [2, 1, 0])


@gluon.jit
def _window_rows(ring_ptr, new_ptr, ids, ok, N_RING, N_NEW, RS: gl.constexpr,
                 D: gl.constexpr):
    """Window rows ids (ok: valid) decoded to fp32 [RS, D/16, 16]: e4m3 code x 2^(e-127),
    exact."""
    L3: gl.constexpr = _chunk_layout(PRODUCER_WARPS, 16)
    RB: gl.constexpr = D + D // 32
    ptr = _row_ptrs(ring_ptr, new_ptr, ids, N_RING, N_NEW, RB)
    ptr = gl.convert_layout(ptr, gl.SliceLayout(1, gl.SliceLayout(2, L3)))
    ok = gl.convert_layout(ok, gl.SliceLayout(1, gl.SliceLayout(2, L3)))
    chunk = gl.arange(0, D // 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    inner = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    codes = gl.load(ptr[:, None, None] + chunk[None, :, None] * 16 + inner[None, None, :],
                    mask=ok[:, None, None], other=0)
    e = gl.load(ptr[:, None] + D + chunk[None, :] // 2, mask=ok[:, None], other=0)
    scale = (e.to(gl.int32) << 23).to(gl.float32, bitcast=True)  # 2^(e-127); 0 -> 0
    return codes.to(gl.float8e4nv, bitcast=True).to(gl.float32) * scale[:, :, None]


@gluon.jit
def _compressed_rows(pool_ptr, bt_base, cr, ok, PAGES, PAGE_ROWS, PAGE_SHIFT: gl.constexpr,
                     RS: gl.constexpr, D: gl.constexpr):
    """Compressed rows g = cr (ok: valid) of the token's pages decoded to fp32 [RS, D/16,
    16]: each e2m1 nibble (element 2i low) re-encoded as the e4m3 byte s|0 0 e1 e0|m 0 0 (its
    value x 2^-6), times its 16-element group's e4m3 scale x 64, exact. Page -1 (unallocated)
    reads page 0, as the reference's clamp."""
    L3: gl.constexpr = _chunk_layout(PRODUCER_WARPS, 16)
    L3H: gl.constexpr = _chunk_layout(PRODUCER_WARPS, 8)
    g = gl.where(ok, cr, 0)
    if PAGE_SHIFT >= 0:
        pg, row = g >> PAGE_SHIFT, g & ((1 << PAGE_SHIFT) - 1)
    else:
        pg, row = g // PAGE_ROWS, g % PAGE_ROWS
    page = gl.load(bt_base + pg, mask=ok & (pg < PAGES), other=0)
    ptr = pool_ptr + (gl.maximum(page, 0) * PAGE_ROWS + row) * (D // 2 + D // 16)
    ptr_h = gl.convert_layout(ptr, gl.SliceLayout(1, gl.SliceLayout(2, L3H)))
    ok_h = gl.convert_layout(ok, gl.SliceLayout(1, gl.SliceLayout(2, L3H)))
    chunk = gl.arange(0, D // 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3H)))
    inner = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3H)))
    pairs = gl.load(ptr_h[:, None, None] + chunk[None, :, None] * 8 + inner[None, None, :],
                    mask=ok_h[:, None, None], other=0).to(gl.int32)
    n = gl.reshape(gl.join(pairs & 15, pairs >> 4), [RS, D // 16, 16])  # element 2i: low
    n = gl.convert_layout(n, L3)
    code = (((n & 8) << 4) | ((n & 7) << 2)).to(gl.uint8)
    ptr3 = gl.convert_layout(ptr, gl.SliceLayout(1, gl.SliceLayout(2, L3)))
    ok3 = gl.convert_layout(ok, gl.SliceLayout(1, gl.SliceLayout(2, L3)))
    chunk3 = gl.arange(0, D // 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    sc = gl.load(ptr3[:, None] + D // 2 + chunk3[None, :], mask=ok3[:, None], other=0)
    scf = sc.to(gl.float8e4nv, bitcast=True).to(gl.float32) * 64.0
    return code.to(gl.float8e4nv, bitcast=True).to(gl.float32) * scf[:, :, None]


@gluon.jit
def _producer(ring_ptr, new_ptr, widx_ptr, pool_ptr, bt_ptr, trow_ptr, cidx_ptr, kv_bufs, ready,
              empty, t, j_lo, j_hi, N_RING, N_NEW, WW, K, PAGES, PAGE_ROWS, sw_t, sc_t, bt_r,
              PAGE_SHIFT: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
              RS: gl.constexpr):
    """Decode list blocks j_lo..j_hi-1 (64 entries each: window entries, then compressed
    ones) into the ring, the i-th into stage i % STAGES, RS rows a store (a multiple of the
    shared layout's swizzle period, 8 rows)."""
    L3: gl.constexpr = _chunk_layout(PRODUCER_WARPS, 16)
    rows = gl.arange(0, RS, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
    bt_base = bt_ptr + gl.load(trow_ptr + t) * bt_r  # the token's block-table row
    for i in range(j_hi - j_lo):
        j = j_lo + i
        stage = i % STAGES
        phase = (i // STAGES) & 1
        mbarrier.wait(empty.index(stage), phase ^ 1)
        buf = kv_bufs.index(stage)
        for r0 in gl.static_range(0, BLOCK_N, RS):
            e0 = j * BLOCK_N + r0
            e_idx = e0 + rows
            if e0 + RS <= WW:  # window rows only
                wr = gl.load(widx_ptr + t * sw_t + e_idx)
                v = _window_rows(ring_ptr, new_ptr, wr, wr >= 0, N_RING, N_NEW, RS, D)
            elif e0 >= WW:  # compressed rows only
                cr = gl.load(cidx_ptr + t * sc_t + (e_idx - WW), mask=e_idx < WW + K, other=-1)
                v = _compressed_rows(pool_ptr, bt_base, cr, cr >= 0, PAGES, PAGE_ROWS,
                                     PAGE_SHIFT, RS, D)
            else:  # the rows where the window part ends: each one or the other
                wr = gl.load(widx_ptr + t * sw_t + e_idx, mask=e_idx < WW, other=-1)
                cr = gl.load(cidx_ptr + t * sc_t + (e_idx - WW),
                             mask=(e_idx >= WW) & (e_idx < WW + K), other=-1)
                v = _window_rows(ring_ptr, new_ptr, wr, wr >= 0, N_RING, N_NEW, RS, D) + \
                    _compressed_rows(pool_ptr, bt_base, cr, cr >= 0, PAGES, PAGE_ROWS,
                                     PAGE_SHIFT, RS, D)
            buf.slice(r0, RS, dim=0).store(gl.reshape(v.to(gl.bfloat16), [RS, D]))
        fence_async_shared()
        mbarrier.arrive(ready.index(stage), count=1)


@gluon.jit
def _consumer(q_smem, kv_bufs, ready, empty, widx_ptr, cidx_ptr, sink_ptr, o_ptr, ml_ptr,
              acc_ptr, t, j_lo, j_hi, H, WW, K, sw_t, sc_t, scale, D: gl.constexpr,
              STAGES: gl.constexpr, SPLIT: gl.constexpr, num_warps: gl.constexpr):
    """The online softmax over the blocks the producer fills; then o [t] = acc / (l +
    e^(sink-m)), or SPLIT: this split's fp32 m, l and acc stored as the Triton kernel's
    partials (m then l [2, T, S, H], acc [T, S, H, D]) for its merge."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, BLOCK_N // 2, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, D // 2, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    m_i = gl.full([HEADS], -1e30, gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([HEADS], gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([HEADS, D], gl.float32, layout=o_layout)
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    for i in range(j_hi - j_lo):
        stage = i % STAGES
        phase = (i // STAGES) & 1
        e_idx = (j_lo + i) * BLOCK_N + cols
        wr = gl.load(widx_ptr + t * sw_t + e_idx, mask=e_idx < WW, other=-1)
        cr = gl.load(cidx_ptr + t * sc_t + (e_idx - WW), mask=(e_idx >= WW) & (e_idx < WW + K),
                     other=-1)
        valid = (wr >= 0) | (cr >= 0)
        mbarrier.wait(ready.index(stage), phase)
        kv = kv_bufs.index(stage)
        s = warpgroup_mma(q_smem, kv.permute((1, 0)),
                          gl.zeros([HEADS, BLOCK_N], gl.float32, layout=s_layout), is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=[s])
        s = gl.where(valid[None, :], s, float("-inf")) * scale
        m_new = gl.maximum(m_i, gl.max(s, 1))  # >= -1e30: no inf - inf
        alpha = gl.exp(m_i - m_new)
        p = gl.exp(s - m_new[:, None])
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        pb = gl.convert_layout(p.to(gl.bfloat16), p_layout)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        acc = warpgroup_mma(pb, kv, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        mbarrier.arrive(empty.index(stage), count=1)
    heads = gl.arange(0, HEADS, layout=gl.SliceLayout(1, o_layout))
    h_mask = heads < H
    dcols = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    if SPLIT:
        n_s = gl.num_programs(1)
        part = (t * n_s + gl.program_id(1)) * H  # row of head 0 in the [T, S, H] partials
        heads_s = gl.arange(0, HEADS, layout=gl.SliceLayout(1, s_layout))
        gl.store(ml_ptr + part + heads_s, m_i, mask=heads_s < H)
        gl.store(ml_ptr + gl.num_programs(0) * n_s * H + part + heads_s, l_i, mask=heads_s < H)
        gl.store(acc_ptr + (part + heads)[:, None] * D + dcols[None, :], acc,
                 mask=h_mask[:, None])
    else:
        m_o = gl.convert_layout(m_i, gl.SliceLayout(1, o_layout))
        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
        l_o = l_o + gl.exp(gl.load(sink_ptr + heads, mask=h_mask, other=0.0) - m_o)
        o = (acc / gl.where(l_o > 0, l_o, 1.0)[:, None]).to(gl.bfloat16)
        gl.store(o_ptr + t * H * D + heads[:, None] * D + dcols[None, :], o,
                 mask=h_mask[:, None])


@gluon.jit
def _sparse_attn_ws_kernel(q_ptr, sink_ptr, ring_ptr, new_ptr, widx_ptr, pool_ptr, bt_ptr,
                           trow_ptr, cidx_ptr, o_ptr, ml_ptr, acc_ptr, scale, H, N_RING, N_NEW,
                           WW, K, PAGES, PAGE_ROWS, BLOCKS_PER_SPLIT, sw_t, sc_t, bt_r,
                           D: gl.constexpr, PAGE_SHIFT: gl.constexpr, STAGES: gl.constexpr,
                           RS: gl.constexpr, SPLIT: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                           num_warps: gl.constexpr):
    """One program a (token t, split s): q [T, H, D] bf16 (H <= 64, padded heads load 0); the
    token's list is widx [t, :WW] (ring rows [*, D + D/32] or the step's new rows, uint8) then
    cidx [t, :K] (rows of the pool [*, PAGE_ROWS, D/2 + D/16] through block-table row
    trow[t]), of which the program takes 64-blocks [s*BPS, (s+1)*BPS); o [T, H, D] bf16, or
    SPLIT: the partials ml, acc (see _consumer)."""
    t = gl.program_id(0).to(gl.int64)
    j_lo = gl.program_id(1) * BLOCKS_PER_SPLIT
    j_hi = gl.minimum(j_lo + BLOCKS_PER_SPLIT, gl.cdiv(WW + K, BLOCK_N))
    q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
    qr = gl.arange(0, HEADS, layout=gl.SliceLayout(1, q_layout))
    qc = gl.arange(0, D, layout=gl.SliceLayout(0, q_layout))
    q = gl.load(q_ptr + t * H * D + qr[:, None] * D + qc[None, :], mask=(qr < H)[:, None],
                other=0.0)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [HEADS, D],
                                       gl.NVMMASharedLayout.get_default_for([HEADS, D],
                                                                            gl.bfloat16), q)
    kv_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, D],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_N, D],
                                                                             gl.bfloat16))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    fence_async_shared()
    gl.warp_specialize([
        (_consumer, (q_smem, kv_bufs, ready, empty, widx_ptr, cidx_ptr, sink_ptr, o_ptr, ml_ptr,
                     acc_ptr, t, j_lo, j_hi, H, WW, K, sw_t, sc_t, scale, D, STAGES, SPLIT,
                     num_warps)),
        (_producer, (ring_ptr, new_ptr, widx_ptr, pool_ptr, bt_ptr, trow_ptr, cidx_ptr, kv_bufs,
                     ready, empty, t, j_lo, j_hi, N_RING, N_NEW, WW, K, PAGES, PAGE_ROWS, sw_t,
                     sc_t, bt_r, PAGE_SHIFT, D, STAGES, RS)),
    ], [PRODUCER_WARPS], [PRODUCER_REGS])


def sparse_attn_paged_ws(q: torch.Tensor, sink: torch.Tensor, scale: float,
                        window_ring: torch.Tensor, new_rows: torch.Tensor,
                        window_ids: torch.Tensor, compressed_pool: torch.Tensor | None,
                        block_table: torch.Tensor | None, token_row: torch.Tensor,
                        compressed_idx: torch.Tensor, *, num_splits: int | None = None,
                        split_blocks: int | None = None, stages: int = 2, out: torch.Tensor | None = None,
                        out_rot: torch.Tensor | None = None) -> torch.Tensor:
    """``triton.sparse_attn_paged`` (the same arguments, results and splits) on a Hopper GPU,
    warp-specialized: H <= 64 heads, D a multiple of 64 up to 512. num_splits and split_blocks
    cut each list into programs as there (by default splits of SPLIT_BLOCKS 64-blocks, the same
    cut in every step), the splits merged by the Triton kernel's merge (which also turns ``out_rot`` back);
    ``stages`` ring stages of 64 decoded rows in shared memory. Returns [T, H, D] bf16."""
    t, h, d, ww, k = check_paged_inputs(q, sink, window_ring, new_rows, window_ids,
                                        compressed_pool, block_table, token_row, compressed_idx)
    rb = d + d // 32
    if h > MAX_HEADS or d % 64 or d > 512:
        raise ValueError(f"q {tuple(q.shape)}: H must be 1..{MAX_HEADS} and D a multiple of 64 "
                         f"up to 512")
    if stages < 1 or (stages * ROWS + MAX_HEADS) * d * 2 > 200 * 1024:
        raise ValueError(f"stages = {stages}: the ring and q must fit in shared memory")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if split_blocks is not None and split_blocks < 0:
        raise ValueError(f"split_blocks must be >= 0, got {split_blocks}")
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device)[0] < 9:
        raise ValueError(f"sparse_attn_paged_ws runs on a Hopper or newer CUDA GPU, got q on "
                         f"{q.device}")
    r2 = 0 if out_rot is None else check_rot(out_rot, t, d)
    out = out_buffer(out, q.shape, torch.bfloat16, q.device)
    if out.numel() == 0:
        return out
    if ww + k == 0:  # no entries at all: every row is empty, o = 0 (as the reference)
        return out.zero_()  # (its rotation back is the identity)
    n_ring = window_ring.numel() // rb
    q, sink, new_rows, token_row = (x.contiguous() for x in (q, sink, new_rows, token_row))
    widx, cidx = (x if x.stride(1) == 1 or x.shape[1] <= 1 else x.contiguous()
                  for x in (window_ids, compressed_idx))
    ring = window_ring if n_ring else new_rows
    pool, table = (compressed_pool.contiguous(), block_table.contiguous()) if k else \
        (ring, token_row.view(1, -1))  # never read without k
    page_rows = pool.shape[1]
    page_shift = page_rows.bit_length() - 1 if page_rows & (page_rows - 1) == 0 else -1
    s, per_split = plan_splits(t, triton.cdiv(ww + k, ROWS), q.device, num_splits,
                               split_blocks)
    ml = acc = sink  # partials: unused without a split
    if s > 1:  # m and l [2, T, S, H], acc [T, S, H, D]
        ml = q.new_empty(2, t, s, h, dtype=torch.float32)
        acc = q.new_empty(t, s, h, d, dtype=torch.float32)
    _sparse_attn_ws_kernel[(t, s)](
        q, sink, ring, new_rows, widx, pool, table, token_row, cidx, out, ml, acc, float(scale),
        h, n_ring, t, ww, k, table.shape[1], page_rows, per_split, widx.stride(0),
        cidx.stride(0), table.stride(0), D=d, PAGE_SHIFT=page_shift, STAGES=stages,
        RS=ROWS_PER_STORE, SPLIT=s > 1, PRODUCER_REGS=PRODUCER_REGS, num_warps=8)
    if s > 1:
        merge_splits(ml, acc, sink, out, out_rot, r2)
    elif out_rot is not None:
        out = rope_heads(out, out_rot, inverse=True, in_place=True)
    return out
