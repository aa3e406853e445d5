"""Sparse attention from the packed caches, warp-specialized in Gluon (Hopper).

Why: the Triton kernel (``triton.sparse_attn_paged``) decodes a block's packed rows, then runs
its MMAs, then decodes the next block, in the same warps: Triton waits for each ``tl.dot``'s
wgmma right after issuing it, and at 64 heads x 512 columns one program holds an SM, so the
tensor cores idle while rows are decoded (docs/benchmarks.md, twenty-eighth session). Here a
producer partition (4 warps) decodes each 64-row block into a shared-memory ring while the
consumer partition (two warp groups, the default one) runs the logits' and P.V's wgmmas on the
block before, handing buffers over by mbarriers. The producer's packed bytes come by async
copies into raw stages of 16 rows, two stages ahead of the one it decodes, so that about 17 KB
a program are in flight (register loads of 8 rows at a time left one index -> page -> row
chain of global latencies in line per 8 rows).

Programs: one an SM (its 12 warps' registers fill one, 168 a thread at launch; at D = 512 its
shared memory too), each taking the launch's (token, split) items in turn (``PERSISTENT``).
The ring's stages and their mbarrier phases run on from one item to the next, so the producer
decodes an item's first blocks while the consumer finishes the item before, and the consumer
copies the next item's q in (async copies) once the item's wgmmas are done with q. An item
stages its output through its last ring stage, which the producer gets back after that (from
the accumulator's layout the stores went 4 bytes a thread, and their addresses spilled). A
program an item paid its q load, its pipeline's fill and its drain each time: at two blocks
an item (a window alone, as in every prefill of an SWA layer) that was most of its time. Each
item's sums are the same whichever program runs it: no bit depends on the programs. A launch
with no more items than programs (most decode steps) compiles without the item loop
(``PERSIST`` off): under Triton 3.6 the loop's live values spill inside the producer's
sub-block loop. That spill costs every item, so long items (more than
``PERSIST_MAX_BLOCKS`` blocks a split: the 640 rows of a ratio-2 layer's decode) keep a
program an item, where the saved start is a small part of the item.

What bounds it: neither side alone. At b = 256 over 640 rows (H100) the producer alone (the
consumer handing stages straight back) takes 81 of the 121 us, and the consumer with the
producer only copying 90. The consumer's warp groups in FlashMLA's roles (one on the logits
and the softmax, handing P to the other; no barrier of both in the block loop) timed no
faster, and fewer producer barriers (the stores under one if/elif chain, the next copies
after the decode) were slower; both were deleted (docs/benchmarks.md, forty-ninth session).

Code size: the producer walks a block's sub-blocks in a loop, not unrolled. Unrolled, its
decode paths came to 100 KB of SASS, and its warps stalled on instruction fetch (Nsight
Compute, thirty-first session); in a loop they are about 39 KB. The ring's row slice must be
static, so each decoded piece is stored under one of NSUB static branches. The bf16 output
goes through the ring's shared memory (free by then), so the stores are 16 bytes a thread.

Scope: ``triton.sparse_attn_paged``'s lists (window entries from the ring or the step's new
rows, then compressed entries through the block table), its splits and its merge (with
``out_rot``), 64 heads a program, D 128, 256 or 512. Its reference is
``reference.sparse_attn_paged`` and its twin the Triton kernel, which the CPU tests run under
the interpreter; Gluon kernels do not run under the interpreter, so this one is checked on a
GPU against both, and on the CPU only compiled for sm_90a.

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
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                               warpgroup_mma, warpgroup_mma_wait)

from ..common.triton import cdiv, is_hopper, sm_count
from .triton import (_FP4_WORD_BF16_ASM, check_paged_devices, check_paged_inputs, check_split_args,
                     finish_paged, paged_operands, paged_output, plan_splits, split_partials)

ROWS, MAX_HEADS = 64, 64  # list entries per block (rows per ring stage); heads a program
BLOCK_N, HEADS = gl.constexpr(ROWS), gl.constexpr(MAX_HEADS)  # the same, for the kernels
SUB_ROWS = 16  # rows per raw stage: the producer's async-copy unit
# rows the producer decodes per shared-memory store (a multiple of the swizzle's period, 8, and
# a divisor of SUB_ROWS): 8, two stores a raw stage. With the copies in their own layout a whole
# raw stage a store (16) was 0.4-4.6% slower (H100, in every cut, the same bits), and at one
# 64-block a program the consumer gets its first rows sooner
ROWS_PER_STORE = 8
RAW_STAGES = 3  # raw stages: while one is decoded, the copies of the next two are in flight
PRODUCER_WARPS = gl.constexpr(4)
# the producer's registers a thread (setmaxnreg); the consumers get the rest. 136 against 120
# (H100, alternating, the same bits): b = 256 decode over 640 rows 5% faster, an 8K prefill's
# 14% (window only) and 6% (ratio 2), b = 1-64 within 2%; 144 gained less
PRODUCER_REGS = 136
SMEM_BYTES = 232448  # an sm_90 block's shared memory (227 KB)
# a launch's programs: one an SM (a program's registers fill one), each taking the
# (token, split) items in turn, so that an item's first blocks are decoded and its q copied in
# while the item before finishes; off: a program an item, each paying its start and its end
PERSISTENT = True
# ... where a split has at most this many 64-blocks: the loop's spills (Triton 3.6) cost each
# item more than its saved start where items are long. H100, against one program an item:
# 2-block items 22% faster (an SWA layer's 8K prefill), 8-21% in the invariant mode's 2-block
# splits; 10-block items 11% slower (b = 256 decode over 640 rows), 0.5% (an 8K prefill's)
PERSIST_MAX_BLOCKS = 4


def smem_bytes(d: int, stages: int) -> int:
    """Shared memory the kernel takes at head dim d: q, the bf16 ring, the raw stages, and 4 KB
    for the consumer's reductions and layout changes (measured 4132 B at d = 512)."""
    return (MAX_HEADS + stages * ROWS) * d * 2 + RAW_STAGES * SUB_ROWS * (d + d // 16) + 4352


def unsupported(q: torch.Tensor, window_ring: torch.Tensor,
                compressed_pool: torch.Tensor | None) -> str | None:
    """Why sparse_attn_paged_ws cannot run on these operands (q [T, H, D]), or None: the
    heads and head dim it is built for, caches it can copy from in place, a Hopper GPU."""
    if not 1 <= q.shape[1] <= MAX_HEADS or q.shape[2] not in (128, 256, 512):
        return (f"q {tuple(q.shape)}: H must be 1..{MAX_HEADS} and D 128, 256 or 512 (the async "
                f"copies move 4 bytes or more)")
    for name, x in (("window_ring", window_ring), ("compressed_pool", compressed_pool)):
        if x is not None and x.data_ptr() % 16:  # read in place: never copied
            return (f"{name} must start 16-byte aligned (the rows are copied in 16-byte "
                    f"pieces), got address {x.data_ptr():#x}")
    if not is_hopper(q.device):
        return f"sparse_attn_paged_ws runs on a Hopper GPU (sm_90: its wgmma), got q on {q.device}"
    return None


# the names of Triton 3.9 / 3.6
_thread_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))
_async_copy = async_copy.async_load if hasattr(async_copy, "async_load") else \
    async_copy.async_copy_global_to_shared


@gluon.jit
def _reinterpret(buf, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
    """buf's shared memory viewed as ``dtype`` ``shape`` in ``layout`` (the method's name in
    Triton 3.9 / 3.6)."""
    if _REINTERPRET:
        return buf.reinterpret(dtype, shape, layout)
    else:
        return buf._reinterpret(dtype, shape, layout)


@gluon.constexpr_function
def _rows_layout(D, lanes_max):
    """[rows, D] bytes or values over the producer's 4 warps, 16 a thread, at most lanes_max
    lanes on a row (the rest of a warp on further rows)."""
    lanes = min(lanes_max, D // 16)
    return gl.BlockedLayout([1, 16], [32 // lanes, lanes], [4, 1], [1, 0])


@gluon.constexpr_function
def _copy_layout(D):
    """A warp on whole rows: the layout in which a raw stage's codes are read and decoded rows
    are stored."""
    return _rows_layout(D, 32)


@gluon.constexpr_function
def _gather_layout(D):
    """[SUB_ROWS, D] bytes (a raw stage's codes) for the async copies: 8 lanes on 128 bytes of
    a row, a warp on 4 rows, the 4 warps on 16, so that each thread's copies all come from one
    list entry (its row pointer, entry id and page computed once, where a warp on whole rows
    would give each thread 4 entries at D = 512). The scales' [rows, D/16] take it too (lanes
    past the row's end repeat its first ones), so that both copies' row pointers come in one
    distribution."""
    return _rows_layout(D, 8)


@gluon.constexpr_function
def _raw_layout():
    """The raw stages' bytes in shared memory (their rows as the async copies land them)."""
    return gl.SwizzledSharedLayout(16, 1, 1, [1, 0])


@gluon.constexpr_function
def _pair_layout(D):
    """[RS, D/32, 2, 16]: a lane per 16-column chunk of a row (a warp per row, or rows at D <
    512), each 32-column block's two chunks on a pair axis, so that the block's scale byte
    broadcasts over both."""
    lanes = min(32, D // 16)
    return gl.BlockedLayout([1, 1, 1, 16], [32 // lanes, lanes // 2, 2, 1], [4, 1, 1, 1],
                            [3, 2, 1, 0])


@gluon.jit
def _entry_ids(widx_ptr, cidx_ptr, t, e, WW, K, sw_t, sc_t):
    """List entries e of token t: (window id or -1, compressed row or -1)."""
    wr = gl.load(widx_ptr + t * sw_t + e, mask=e < WW, other=-1)
    cr = gl.load(cidx_ptr + t * sc_t + (e - WW), mask=(e >= WW) & (e < WW + K), other=-1)
    return wr, cr


@gluon.jit
def _page_of(bt_base, cr, PAGES, PAGE_ROWS, PAGE_SHIFT: gl.constexpr):
    """The pool page of compressed row cr (-1: none, or an unallocated entry: page 0, as the
    reference's clamp)."""
    g = gl.where(cr >= 0, cr, 0)
    pg = g >> PAGE_SHIFT if PAGE_SHIFT >= 0 else g // PAGE_ROWS
    page = gl.load(bt_base + pg, mask=(cr >= 0) & (pg < PAGES), other=0)
    return gl.maximum(page, 0)


@gluon.jit
def _copy_rows(codes, extra, ring_ptr, new_ptr, pool_ptr, wr, cr, page, N_RING, N_NEW,
               PAGE_ROWS, PAGE_SHIFT: gl.constexpr, D: gl.constexpr, SUB: gl.constexpr):
    """Start async copies of SUB list entries' packed bytes into one raw stage (wr, cr and
    page in SliceLayout(1, _gather_layout(D))): a window row
    (wr >= 0: ring row or new row) as its D codes into ``codes`` and its D/32 exponents into
    ``extra``; a compressed row (cr >= 0) as its D/2 bytes of e2m1 pairs into ``codes`` and
    its D/16 scales into ``extra``. Bytes no entry fills are zero."""
    LC: gl.constexpr = _gather_layout(D)
    RB: gl.constexpr = D + D // 32
    CB: gl.constexpr = D // 2 + D // 16
    # rows start ALIGN-byte aligned (the tensors 16-byte aligned, the host checks): a hint
    # for the copies' vector width, which the select of two pointers would otherwise lose
    ALIGN: gl.constexpr = min(16, RB & -RB, CB & -CB)
    r = gl.where(wr >= 0, wr, 0).to(gl.int64)
    w_ptr = gl.where(r < N_RING, ring_ptr + r * RB,
                     new_ptr + gl.minimum(r - N_RING, N_NEW - 1) * RB)
    g = gl.where(cr >= 0, cr, 0)
    row = g & ((1 << PAGE_SHIFT) - 1) if PAGE_SHIFT >= 0 else g % PAGE_ROWS
    c_ptr = pool_ptr + (page.to(gl.int64) * PAGE_ROWS + row) * CB
    is_w, is_c = wr >= 0, cr >= 0

    col = gl.arange(0, D, layout=gl.SliceLayout(0, LC))
    base = gl.multiple_of(gl.where(is_w, w_ptr, c_ptr), ALIGN)
    ok = is_w[:, None] | (is_c[:, None] & (col < D // 2)[None, :])
    _async_copy(codes, base[:, None] + col[None, :], mask=ok)
    ecol = gl.arange(0, D // 16, layout=gl.SliceLayout(0, LC))
    base = gl.multiple_of(gl.where(is_w, w_ptr + D, c_ptr + D // 2), ALIGN)
    ok = (is_w[:, None] & (ecol < D // 32)[None, :]) | is_c[:, None]
    _async_copy(extra, base[:, None] + ecol[None, :], mask=ok)


@gluon.jit
def _window_decode(codes, extra, RS: gl.constexpr, D: gl.constexpr):
    """RS window rows from a raw stage's slices, bf16 [RS, D]: e4m3 code x 2^(e-127) in fp32,
    exact, then to bf16 (as the reference rounds it)."""
    L4: gl.constexpr = _pair_layout(D)
    c = gl.convert_layout(gl.reshape(codes.load(_copy_layout(D)), [RS, D // 32, 2, 16]), L4)
    e = extra.slice(0, D // 32, dim=1).load(gl.SliceLayout(2, gl.SliceLayout(3, L4)))
    scale = (e.to(gl.int32) << 23).to(gl.float32, bitcast=True)  # 2^(e-127); 0 -> 0
    v = c.to(gl.float8e4nv, bitcast=True).to(gl.float32) * scale[:, :, None, None]
    return gl.reshape(v, [RS, D]).to(gl.bfloat16)  # exact


@gluon.jit
def _compressed_decode(words, extra, RS: gl.constexpr, D: gl.constexpr):
    """RS compressed rows from a raw stage's slices (``words``: the e2m1 pairs as int32 words,
    [RS, D/8]), bf16 [RS, D]: the Triton kernel's word decode (_FP4_WORD_BF16_ASM, 8 nibbles a
    call, by table straight to bf16, times its 16-element group's e4m3 scale in bf16, exact),
    a thread per 16-element group (two words)."""
    lanes: gl.constexpr = min(32, D // 16)
    LW: gl.constexpr = gl.BlockedLayout([1, 2], [32 // lanes, lanes], [4, 1], [1, 0])
    L3W: gl.constexpr = gl.BlockedLayout([1, 1, 2], [32 // lanes, lanes, 1], [4, 1, 1],
                                         [2, 1, 0])
    w = gl.convert_layout(gl.reshape(words.load(LW), [RS, D // 16, 2]), L3W)
    sc = extra.load(gl.SliceLayout(2, L3W))
    scb = sc.to(gl.float8e4nv, bitcast=True).to(gl.float32).to(gl.bfloat16)  # exact
    e0, e1, e2, e3, e4, e5, e6, e7 = gl.inline_asm_elementwise(
        _FP4_WORD_BF16_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [w, scb[:, :, None]],
        dtype=(gl.bfloat16,) * 8, is_pure=True, pack=1)
    # nibble t of word k of group c: element 16c + 8k + t
    v = gl.join(gl.join(gl.join(e0, e4), gl.join(e2, e6)),
                gl.join(gl.join(e1, e5), gl.join(e3, e7)))
    return gl.reshape(v, [RS, D])


@gluon.jit
def _next_copies(raw_codes, raw_extra, ring_ptr, new_ptr, widx_ptr, pool_ptr, bt_base, cidx_ptr,
                 t, e_lo, w, n_sub, wr, cr, page, cr1, wr1, sub, N_RING, N_NEW, WW, K, PAGES,
                 PAGE_ROWS, sw_t, sc_t, PAGE_SHIFT: gl.constexpr, D: gl.constexpr,
                 SUB: gl.constexpr, RAW: gl.constexpr):
    """_producer_item's step: start sub-block w's copies (its entries wr, cr and pages page),
    then move the entries one sub-block on: (page, wr, cr) of w + 1 and (wr1, cr1) of w + 2."""
    if w < n_sub:
        _copy_rows(raw_codes.index(w % RAW), raw_extra.index(w % RAW), ring_ptr, new_ptr,
                   pool_ptr, wr, cr, page, N_RING, N_NEW, PAGE_ROWS, PAGE_SHIFT, D, SUB)
    async_copy.commit_group()  # (empty past the end: the wait count stays the same)
    page = _page_of(bt_base, cr1, PAGES, PAGE_ROWS, PAGE_SHIFT)
    wr2, cr2 = _entry_ids(widx_ptr, cidx_ptr, t, e_lo + (w + 2) * SUB + sub, WW, K, sw_t, sc_t)
    return page, wr1, cr1, wr2, cr2


@gluon.jit
def _producer(ring_ptr, new_ptr, widx_ptr, pool_ptr, bt_ptr, trow_ptr, cidx_ptr, kv_bufs, ready,
              empty, raw_codes, raw_extra, N_ITEMS, SPLITS, BPS, NB, N_RING, N_NEW, WW, K,
              PAGES, PAGE_ROWS, sw_t, sc_t, bt_r, PAGE_SHIFT: gl.constexpr, D: gl.constexpr,
              STAGES: gl.constexpr, RS: gl.constexpr, SUB: gl.constexpr,
              RAW: gl.constexpr, PERSIST: gl.constexpr):
    """Fill the ring with the program's items' list blocks in turn (_item), the program's
    n-th block into stage n % STAGES: the ring runs on across items, so the next item's first
    blocks are decoded while the consumer finishes the item before. PERSIST off: the
    program's one item, with no item loop (whose live values spill inside the sub-block loop
    under Triton 3.6)."""
    if PERSIST:
        n0 = 0  # blocks this program filled before the item
        for w in range(gl.program_id(0), N_ITEMS, gl.num_programs(0)):
            t, s, j_lo, j_hi = _item(w, SPLITS, BPS, NB)
            _thread_barrier()  # every thread has decoded the last item's raw stages
            _producer_item(ring_ptr, new_ptr, widx_ptr, pool_ptr, bt_ptr, trow_ptr, cidx_ptr,
                           kv_bufs, ready, empty, raw_codes, raw_extra, t, j_lo, j_hi, n0,
                           N_RING, N_NEW, WW, K, PAGES, PAGE_ROWS, sw_t, sc_t, bt_r,
                           PAGE_SHIFT, D, STAGES, RS, SUB, RAW)
            n0 += j_hi - j_lo
    else:
        t, s, j_lo, j_hi = _item(gl.program_id(0), SPLITS, BPS, NB)
        _producer_item(ring_ptr, new_ptr, widx_ptr, pool_ptr, bt_ptr, trow_ptr, cidx_ptr,
                       kv_bufs, ready, empty, raw_codes, raw_extra, t, j_lo, j_hi, 0, N_RING,
                       N_NEW, WW, K, PAGES, PAGE_ROWS, sw_t, sc_t, bt_r, PAGE_SHIFT, D, STAGES,
                       RS, SUB, RAW)


@gluon.jit
def _producer_item(ring_ptr, new_ptr, widx_ptr, pool_ptr, bt_ptr, trow_ptr, cidx_ptr, kv_bufs,
                   ready, empty, raw_codes, raw_extra, t, j_lo, j_hi, n0, N_RING, N_NEW, WW, K,
                   PAGES, PAGE_ROWS, sw_t, sc_t, bt_r, PAGE_SHIFT: gl.constexpr,
                   D: gl.constexpr, STAGES: gl.constexpr, RS: gl.constexpr,
                   SUB: gl.constexpr, RAW: gl.constexpr):
    """Fill the ring with token t's list blocks j_lo..j_hi-1 (64 entries each: window entries,
    then compressed ones), the i-th block into stage (n0 + i) % STAGES.

    The packed bytes travel by async copies, SUB entries (a sub-block) a raw stage, RAW - 1
    sub-blocks ahead of the one being decoded: at step w the copies of sub-block w start and
    sub-block u = w - (RAW - 1) is decoded from its raw stage into the ring, RS rows a store
    (a multiple of the ring's swizzle period, 8 rows). Each sub-block's list entries are
    loaded two steps before its copies start and its pages one step before, so no index or
    page load waits in line. One barrier a step: after it, every thread's copies of
    sub-block u have landed and every thread has finished decoding u - 1, whose raw stage
    sub-block w reuses."""
    NSUB: gl.constexpr = BLOCK_N // SUB
    WORD_LAYOUT: gl.constexpr = gl.SwizzledSharedLayout(4, 1, 1, [1, 0])  # raw codes as words
    LI: gl.constexpr = gl.SliceLayout(1, _gather_layout(D))  # the list entries' ids
    L2: gl.constexpr = _copy_layout(D)  # [RS, D] values, 16 columns a thread
    sub = gl.arange(0, SUB, layout=LI)
    rows = gl.arange(0, RS, layout=gl.SliceLayout(1, L2))
    bt_base = bt_ptr + gl.load(trow_ptr + t) * bt_r  # the token's block-table row
    n_sub = (j_hi - j_lo) * NSUB
    e_lo = j_lo * BLOCK_N
    wr, cr = _entry_ids(widx_ptr, cidx_ptr, t, e_lo + sub, WW, K, sw_t, sc_t)
    page = _page_of(bt_base, cr, PAGES, PAGE_ROWS, PAGE_SHIFT)
    wr1, cr1 = _entry_ids(widx_ptr, cidx_ptr, t, e_lo + SUB + sub, WW, K, sw_t, sc_t)
    for p0 in gl.static_range(RAW - 1):  # the first sub-blocks' copies
        page, wr, cr, wr1, cr1 = _next_copies(
            raw_codes, raw_extra, ring_ptr, new_ptr, widx_ptr, pool_ptr, bt_base, cidx_ptr, t,
            e_lo, p0, n_sub, wr, cr, page, cr1, wr1, sub, N_RING, N_NEW, WW, K, PAGES,
            PAGE_ROWS, sw_t, sc_t, PAGE_SHIFT, D, SUB, RAW)
    for i in range(j_hi - j_lo):
        stage = (n0 + i) % STAGES
        mbarrier.wait(empty.index(stage), (((n0 + i) // STAGES) & 1) ^ 1)
        buf = kv_bufs.index(stage)
        for q in range(NSUB):  # a loop, not unrolled: the decode's code stays in the I-cache
            u = i * NSUB + q  # the sub-block decoded now
            w = u + RAW - 1  # the sub-block whose copies start now
            async_copy.wait_group(RAW - 2)  # sub-block u's copies (this thread's) have landed
            _thread_barrier()
            page, wr, cr, wr1, cr1 = _next_copies(
                raw_codes, raw_extra, ring_ptr, new_ptr, widx_ptr, pool_ptr, bt_base, cidx_ptr,
                t, e_lo, w, n_sub, wr, cr, page, cr1, wr1, sub, N_RING, N_NEW, WW, K, PAGES,
                PAGE_ROWS, sw_t, sc_t, PAGE_SHIFT, D, SUB, RAW)
            codes = raw_codes.index(u % RAW)
            words = _reinterpret(codes, gl.int32, [SUB, D // 4], WORD_LAYOUT)
            extra = raw_extra.index(u % RAW)
            e0 = e_lo + u * SUB
            for r0 in gl.static_range(0, SUB, RS):
                c_rs = codes.slice(r0, RS, dim=0)
                w_rs = words.slice(r0, RS, dim=0).slice(0, D // 8, dim=1)
                x_rs = extra.slice(r0, RS, dim=0)
                if e0 + r0 + RS <= WW:  # window rows only
                    v = gl.convert_layout(_window_decode(c_rs, x_rs, RS, D), L2)
                elif e0 + r0 >= WW:  # compressed rows only
                    v = gl.convert_layout(_compressed_decode(w_rs, x_rs, RS, D), L2)
                else:  # the rows where the window part ends: each one or the other
                    is_w = e0 + r0 + rows < WW
                    v = gl.where(is_w[:, None],
                                 gl.convert_layout(_window_decode(c_rs, x_rs, RS, D), L2),
                                 gl.convert_layout(_compressed_decode(w_rs, x_rs, RS, D), L2))
                for qq in gl.static_range(NSUB):  # the ring's row slice must be static
                    if q == qq:
                        buf.slice(qq * SUB + r0, RS, dim=0).store(v.to(gl.bfloat16))
        fence_async_shared()
        mbarrier.arrive(ready.index(stage), count=1)
    async_copy.wait_group(0)


@gluon.jit
def _store_output(stage, acc, m_o, l_o, sink_ptr, o_ptr, t, H, O_LAYOUT: gl.constexpr,
                  D: gl.constexpr, num_warps: gl.constexpr):
    """An unsplit item's end: o = acc / (l + e^(sink-m)) in bf16 (acc in O_LAYOUT, m_o and l_o
    in its rows' slice), stored 16 bytes a thread, a warp on whole rows. In the accumulator's
    layout the stores would go 4 bytes a thread over 8 rows, and a convert_layout would take
    scratch the kernel's shared memory has no room for, so o goes through the item's last ring
    stage (the caller has waited until no wgmma reads the stage, and the producer waits for
    it)."""
    heads = gl.arange(0, HEADS, layout=gl.SliceLayout(1, O_LAYOUT))
    l_o = l_o + gl.exp(gl.load(sink_ptr + heads, mask=heads < H, other=0.0) - m_o)
    o = (acc / gl.where(l_o > 0, l_o, 1.0)[:, None]).to(gl.bfloat16)
    st_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
    buf = _reinterpret(stage, gl.bfloat16, [HEADS, D], gl.SwizzledSharedLayout(8, 1, 8, [1, 0]))
    _thread_barrier()
    buf.store(o)
    _thread_barrier()
    h_st = gl.arange(0, HEADS, layout=gl.SliceLayout(1, st_layout))
    d_st = gl.arange(0, D, layout=gl.SliceLayout(0, st_layout))
    gl.store(o_ptr + (t * H + h_st)[:, None] * D + d_st[None, :], buf.load(st_layout),
             mask=(h_st < H)[:, None])


@gluon.jit
def _item(w, SPLITS, BPS, NB):
    """Work item w of the launch: (token t as int64, split s, its first 64-block, its end; no
    block where an explicit num_splits leaves the split past the list's end)."""
    s = w % SPLITS
    j_lo = s * BPS
    return (w // SPLITS).to(gl.int64), s, j_lo, gl.maximum(gl.minimum(j_lo + BPS, NB), j_lo)


@gluon.jit
def _load_q(q_smem, q_ptr, t, H, D: gl.constexpr, num_warps: gl.constexpr):
    """Start async copies of token t's q [H, D] bf16 into q_smem [HEADS, D] (padded heads
    zero), 16 rows at a time (16 bytes a thread, few addresses live at once), one group."""
    lanes: gl.constexpr = min(32, D // 8)
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // lanes, lanes], [num_warps, 1], [1, 0])
    rows = gl.arange(0, 16, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    for r0 in gl.static_range(0, HEADS, 16):
        _async_copy(q_smem.slice(r0, 16, dim=0),
                    q_ptr + (t * H + r0 + rows)[:, None] * D + cols[None, :],
                    mask=(r0 + rows < H)[:, None])
    async_copy.commit_group()


@gluon.jit
def _consumer(q_smem, kv_bufs, ready, empty, q_ptr, widx_ptr, cidx_ptr, sink_ptr, o_ptr,
              ml_ptr, acc_ptr, N_ITEMS, SPLITS, BPS, NB, H, WW, K, sw_t, sc_t, scale,
              D: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr,
              PERSIST: gl.constexpr, num_warps: gl.constexpr):
    """The program's items in turn (_item), each an online softmax over the blocks the
    producer fills; then o [t] = acc / (l + e^(sink-m)), or SPLIT: the item's fp32 m, l and
    acc stored as the Triton kernel's partials (m then l [2, T, S, H], acc [T, S, H, D]) for
    its merge. q_smem holds the first item's q; once an item's wgmmas are done with it, the
    next item's q starts coming in (its first blocks are being decoded meanwhile) while the
    output is staged through the item's last ring stage, which then goes back to the
    producer."""
    G = gl.num_programs(0)
    if PERSIST:
        n0 = 0  # blocks this program consumed before the item
        for w in range(gl.program_id(0), N_ITEMS, G):
            n0 = _consumer_item(q_smem, kv_bufs, ready, empty, q_ptr, widx_ptr, cidx_ptr,
                                sink_ptr, o_ptr, ml_ptr, acc_ptr, w, G, n0, N_ITEMS, SPLITS,
                                BPS, NB, H, WW, K, sw_t, sc_t, scale, D, STAGES, SPLIT,
                                num_warps)
    else:
        _consumer_item(q_smem, kv_bufs, ready, empty, q_ptr, widx_ptr, cidx_ptr, sink_ptr,
                       o_ptr, ml_ptr, acc_ptr, gl.program_id(0), G, 0, N_ITEMS, SPLITS, BPS,
                       NB, H, WW, K, sw_t, sc_t, scale, D, STAGES, SPLIT, num_warps)


@gluon.jit
def _consumer_item(q_smem, kv_bufs, ready, empty, q_ptr, widx_ptr, cidx_ptr, sink_ptr, o_ptr,
                   ml_ptr, acc_ptr, w, G, n0, N_ITEMS, SPLITS, BPS, NB, H, WW, K, sw_t, sc_t,
                   scale, D: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr,
                   num_warps: gl.constexpr):
    """_consumer's item w (of a program taking every G-th), its blocks the program's n0-th
    on; returns n0 past them."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, BLOCK_N // 2, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, D // 2, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    t, sp, j_lo, j_hi = _item(w, SPLITS, BPS, NB)
    t_next = ((w + G) // SPLITS).to(gl.int64)  # the next item's token
    q_next = (w + G < N_ITEMS) & (t_next != t)  # its q must come in
    # the q copied in during the item before (if any) has landed, for the wgmmas to read
    async_copy.wait_group(0)
    _thread_barrier()
    fence_async_shared()
    m_i = gl.full([HEADS], -1e30, gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([HEADS], gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([HEADS, D], gl.float32, layout=o_layout)
    for i in range(j_hi - j_lo):
        stage = (n0 + i) % STAGES
        phase = ((n0 + i) // STAGES) & 1
        e_idx = (j_lo + i) * BLOCK_N + cols
        wr = gl.load(widx_ptr + t * sw_t + e_idx, mask=e_idx < WW, other=-1)
        cr = gl.load(cidx_ptr + t * sc_t + (e_idx - WW),
                     mask=(e_idx >= WW) & (e_idx < WW + K), other=-1)
        valid = (wr >= 0) | (cr >= 0)
        mbarrier.wait(ready.index(stage), phase)
        kv = kv_bufs.index(stage)
        s = warpgroup_mma(q_smem, kv.permute((1, 0)),
                          gl.zeros([HEADS, BLOCK_N], gl.float32, layout=s_layout),
                          is_async=True)
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
        if SPLIT or i < j_hi - j_lo - 1:  # unsplit, the last stage holds the output first
            mbarrier.arrive(empty.index(stage), count=1)
    if q_next:  # the item's wgmmas are done with q: the next item's comes in now
        _thread_barrier()
        _load_q(q_smem, q_ptr, t_next, H, D, num_warps)
    last = kv_bufs.index((n0 + j_hi - j_lo - 1) % STAGES)  # (unsplit: a block or more)
    n0 += j_hi - j_lo
    heads = gl.arange(0, HEADS, layout=gl.SliceLayout(1, o_layout))
    dcols = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    if SPLIT:  # fp32 partials: 8 bytes a thread, 4 threads on 32 bytes of a row, as they are
        part = (t * SPLITS + sp) * H  # row of head 0 in the [T, S, H] partials
        heads_s = gl.arange(0, HEADS, layout=gl.SliceLayout(1, s_layout))
        gl.store(ml_ptr + part + heads_s, m_i, mask=heads_s < H)
        gl.store(ml_ptr + N_ITEMS * H + part + heads_s, l_i, mask=heads_s < H)
        gl.store(acc_ptr + (part + heads)[:, None] * D + dcols[None, :], acc,
                 mask=(heads < H)[:, None])
    else:
        _store_output(last, acc, gl.convert_layout(m_i, gl.SliceLayout(1, o_layout)),
                      gl.convert_layout(l_i, gl.SliceLayout(1, o_layout)), sink_ptr, o_ptr, t,
                      H, o_layout, D, num_warps)  # (both groups' wgmmas are done)
        _thread_barrier()  # every thread has read its part back
        mbarrier.arrive(empty.index((n0 - 1) % STAGES), count=1)
    return n0


@gluon.jit
def _sparse_attn_ws_kernel(q_ptr, sink_ptr, ring_ptr, new_ptr, widx_ptr, pool_ptr, bt_ptr,
                           trow_ptr, cidx_ptr, o_ptr, ml_ptr, acc_ptr, scale, H, N_RING, N_NEW,
                           WW, K, PAGES, PAGE_ROWS, SPLITS, BLOCKS_PER_SPLIT, sw_t, sc_t, bt_r,
                           D: gl.constexpr, PAGE_SHIFT: gl.constexpr, STAGES: gl.constexpr,
                           RS: gl.constexpr, SUB: gl.constexpr, RAW: gl.constexpr,
                           SPLIT: gl.constexpr, PERSIST: gl.constexpr,
                           PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr):
    """Work items (token t, split s), item w = t * SPLITS + s, program p taking items p, p + G,
    p + 2G, ... (G programs; _item): q [T, H, D] bf16 (H <= 64, padded heads load 0); the
    token's list is widx [t, :WW] (ring rows [*, D + D/32] or the step's new rows, uint8) then
    cidx [t, :K] (rows of the pool [*, PAGE_ROWS, D/2 + D/16] through block-table row
    trow[t]), of which the item takes 64-blocks [s*BPS, (s+1)*BPS); o [T, H, D] bf16, or
    SPLIT: the partials ml, acc (see _consumer). Each item's sums are the same whichever
    program runs it, so G changes no bit."""
    n_items = N_NEW * SPLITS
    nb = gl.cdiv(WW + K, BLOCK_N)
    t0 = (gl.program_id(0) // SPLITS).to(gl.int64)  # the first item's token
    q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
    qr = gl.arange(0, HEADS, layout=gl.SliceLayout(1, q_layout))
    qc = gl.arange(0, D, layout=gl.SliceLayout(0, q_layout))
    q = gl.load(q_ptr + t0 * H * D + qr[:, None] * D + qc[None, :], mask=(qr < H)[:, None],
                other=0.0)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [HEADS, D],
                                       gl.NVMMASharedLayout.get_default_for([HEADS, D],
                                                                            gl.bfloat16), q)
    kv_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, D],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_N, D],
                                                                             gl.bfloat16))
    raw_codes = gl.allocate_shared_memory(gl.uint8, [RAW, SUB, D], _raw_layout())
    raw_extra = gl.allocate_shared_memory(gl.uint8, [RAW, SUB, D // 16], _raw_layout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    fence_async_shared()
    gl.warp_specialize([
        (_consumer, (q_smem, kv_bufs, ready, empty, q_ptr, widx_ptr, cidx_ptr, sink_ptr, o_ptr,
                     ml_ptr, acc_ptr, n_items, SPLITS, BLOCKS_PER_SPLIT, nb, H, WW, K, sw_t,
                     sc_t, scale, D, STAGES, SPLIT, PERSIST, num_warps)),
        (_producer, (ring_ptr, new_ptr, widx_ptr, pool_ptr, bt_ptr, trow_ptr, cidx_ptr, kv_bufs,
                     ready, empty, raw_codes, raw_extra, n_items, SPLITS, BLOCKS_PER_SPLIT, nb,
                     N_RING, N_NEW, WW, K, PAGES, PAGE_ROWS, sw_t, sc_t, bt_r, PAGE_SHIFT, D,
                     STAGES, RS, SUB, RAW, PERSIST)),
    ], [PRODUCER_WARPS], [PRODUCER_REGS])


def sparse_attn_paged_ws(q: torch.Tensor, sink: torch.Tensor, scale: float,
                        window_ring: torch.Tensor, new_rows: torch.Tensor,
                        window_ids: torch.Tensor, compressed_pool: torch.Tensor | None,
                        block_table: torch.Tensor | None, token_row: torch.Tensor,
                        compressed_idx: torch.Tensor, *, num_splits: int | None = None,
                        split_blocks: int | None = None, stages: int = 2,
                        programs: int | None = None, out: torch.Tensor | None = None,
                        out_rot: torch.Tensor | None = None) -> torch.Tensor:
    """``triton.sparse_attn_paged`` (the same arguments, results and splits) on a Hopper GPU,
    warp-specialized: H <= 64 heads, D 128, 256 or 512, the ring and the pool 16-byte aligned.
    num_splits and split_blocks cut each list into programs as there (by default splits of
    SPLIT_BLOCKS 64-blocks, the same cut in every step), the splits merged by the Triton
    kernel's merge (which also turns ``out_rot`` back); ``stages`` ring stages of 64 decoded
    rows in shared memory; ``programs`` the programs launched, each taking the (token, split)
    items in turn (None: one an SM where PERSISTENT and a split has at most
    PERSIST_MAX_BLOCKS blocks, else one an item; never more than the items; no bit depends on
    it). Returns [T, H, D] bf16."""
    t, h, d, ww, k = check_paged_inputs(q, sink, window_ring, new_rows, window_ids,
                                        compressed_pool, block_table, token_row, compressed_idx)
    reason = unsupported(q, window_ring, compressed_pool)
    if reason:
        raise ValueError(reason)
    if stages < 1 or smem_bytes(d, stages) > SMEM_BYTES:
        raise ValueError(f"stages = {stages}: the ring, q and the raw stages must fit in "
                         f"{SMEM_BYTES} B of shared memory at D = {d}, got "
                         f"{smem_bytes(d, stages)} B")
    check_split_args(num_splits, split_blocks)
    if programs is not None and (not isinstance(programs, int) or programs < 1):
        raise ValueError(f"programs must be a positive int or None, got {programs!r}")
    check_paged_devices(q, sink, window_ring, new_rows, window_ids, compressed_pool,
                        block_table, token_row, compressed_idx)
    out, r2, done = paged_output(q, sink, out, out_rot, ww + k)
    if done:
        return out
    q, sink, ring, new_rows, widx, pool, table, token_row, cidx, n_ring, page_shift = \
        paged_operands(q, sink, window_ring, new_rows, window_ids, compressed_pool, block_table,
                       token_row, compressed_idx, align=16)
    s, per_split = plan_splits(t, cdiv(ww + k, ROWS), q.device, num_splits,
                               split_blocks)
    if q.data_ptr() % 16:  # q is copied in 16-byte pieces: a fresh (aligned) copy
        q = q.clone()
    partials = split_partials(q, s) if s > 1 else None
    if programs is None:
        programs = sm_count(q.device) if PERSISTENT and per_split <= PERSIST_MAX_BLOCKS \
            else t * s
    programs = min(programs, t * s)
    _sparse_attn_ws_kernel[(programs,)](
        q, sink, ring, new_rows, widx, pool, table, token_row, cidx, out,
        *(partials or (sink, sink)), float(scale), h, n_ring, t, ww, k, table.shape[1],
        pool.shape[1], s, per_split, widx.stride(0), cidx.stride(0), table.stride(0), D=d,
        PAGE_SHIFT=page_shift, STAGES=stages, RS=ROWS_PER_STORE, SUB=SUB_ROWS, RAW=RAW_STAGES,
        SPLIT=s > 1, PERSIST=programs < t * s, PRODUCER_REGS=PRODUCER_REGS, num_warps=8)
    return finish_paged(out, partials, sink, out_rot, r2)
