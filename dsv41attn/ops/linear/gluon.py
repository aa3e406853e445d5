"""fp8_linear's square tiles (PRESCALE_MIN_M rows and more) warp-specialized in Gluon (Hopper).

Why: ``triton._fp8_gemm_kernel``'s PRESCALED tiles take each 32-block's dot out of the tensor
cores and add it, times the block's weight scale, before the next block (the reference's
rounding points). There each block's scale bytes are loaded from global memory inside the K
loop, and a program's warps wait on those loads, on each wgmma and on their own TMA issue in
turn: 300-350 TFLOP/s at 8K rows. Here a producer warp group keeps a ring of [128, BK] x
tiles and [128, BK] weight tiles filled by TMA (BK = 64, or 128 at long K), and two consumer
warp groups, each on 64 of the tile's 128 rows, run each block's wgmma and add it,
independently of each other (while one adds, the other's wgmma runs). The weight's operand is
its bf16 values with the block scales folded in (``triton.e4m3_to_bf16(weight, scale)``), so a
block's dot comes out already scaled and is added with no scale load and no multiply; with
CODES, TMA brings the weight's e4m3 tile instead and a converter warp group folds it into the
stage's bf16 tile (no pass over the weight per call). A launch runs one program an SM, each
taking output tiles in turn with its ring running on across them (``PERSISTENT``), so a
tile's first loads overlap the previous tile's stores: one program a tile paid the ring's
fill and its epilogue alone (H100, 8K rows: wq_b 1768 -> 1616 us). Where K's ranges run as
items of their own (split), programs may take those in turn too (``PERSISTENT_SPLIT``, off:
timed, no gain). Every partition walks its items through ``_each_item``.

The second kernel below, the swapped tiles, serves decode steps past 64 rows (see there).

Numerics: those of the Triton tiles (their reference beside them, ``_fp8_gemm_kernel``): each
32-block's dot is one wgmma chain over its K from no accumulator, added into its range's fp32
accumulator from -0 in K order, K's ranges (``k_order``) added in range order. Folding a
power-of-two scale 2^s into the weight scales every product and the block's sum by 2^s exactly
while they stay in fp32's normal range, so the wgmma's sum is the unfolded sum times 2^s, bit
for bit (``triton.foldable_scales`` says which weights keep it there). Note the ``+`` below:
written ``acc + dot`` in Triton, the compiler may fold the add into the MMA's accumulator (an
H100 gave other bits that way); Gluon emits the wgmma and the add as written.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                               warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..common.triton import E4M3_BF16_BITS_ASM, cdiv, is_hopper, sm_count

BLOCK_M = 128  # token rows a tile: two consumer warp groups of 64
BLOCK_N = 128  # weight rows (output columns) a tile
BLOCK_K = 64  # two 32-blocks a ring stage (128-byte rows: the widest TMA swizzle), 4 stages;
STAGES = 4
# four a stage (3 stages) where K is long enough: H100, M = 8192, the GEMM alone, us (64 / 128):
# wo_b (K 8192) 1495 / 1323, wq_a (5120) 258 / 228, wkv (5120) 117 / 105; but wq_b (K 1280,
# 10 stages a tile) 1614 / 3232
WIDE_K, WIDE_MIN_K, WIDE_STAGES = 128, 4096, 3
# a launch's programs: one an SM (a program's ring fills its shared memory), each taking the
# output tiles in turn, so a tile's TMA loads run while the tile before is stored and no
# program pays the ring's fill alone (off: one program a tile)
PERSISTENT = True
# ... also where K's ranges run as items of their own (split: each item a tile's range, its
# fp32 partial summed after; wq_a and wkv at 128-511 rows, 20 and 40 ranges of a few blocks).
# Off: timed on an H100 (act_quant + GEMM, the same bits) it changed nothing beyond 0.5%
# (wq_a and wkv at 256 and 511 rows; the layers at b = 1 and 256 within 0.5%); its GPU test is
# test_programs_take_items_in_turn_with_the_same_bits (split)
PERSISTENT_SPLIT = False
GROUP = gl.constexpr(8)  # row tiles taken together along N (a group shares its weight tiles in L2)
CONSUMER_REGS, PRODUCER_REGS = 232, 40  # setmaxnreg: the consumers' accumulators, the TMA group's
# CODES (the weight's e4m3 codes, folded in the ring by a converter warp group): 64-wide
# stages, an fp8 and a bf16 weight tile each; 16 warps share the register file
CODES_STAGES, CODES_CONSUMER_REGS, CONVERTER_REGS = 4, 208, 64

_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
_cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier  # (3.9's name, 3.6's)


@gluon.jit
def _neg_zeros(shape: gl.constexpr, layout: gl.constexpr):
    """fp32 -0.0 from its bits (common.triton.neg_zeros: Triton 3.6 makes a -0.0 constant +0)."""
    return (gl.full(shape, 1, gl.int32, layout) << 31).to(gl.float32, bitcast=True)


@gluon.jit
def _item_k(w, TILES, KS, CHUNKS, RANGES, GRANULE: gl.constexpr, J: gl.constexpr,
            SPLIT: gl.constexpr):
    """Work item w of a launch: (its output tile, its K range r, the range's 32-blocks [b0, b1)
    and the ring steps [ks0, ks1) that hold them, J blocks a step). SPLIT: item w is tile
    w % TILES of range w // TILES (a range's tiles next to each other, as a grid of (tiles,
    ranges) programs ran them); else tile w over all KS steps, r = 0."""
    if SPLIT:
        t = w % TILES
        r = w // TILES
        b0 = r * CHUNKS // RANGES * GRANULE
        b1 = (r + 1) * CHUNKS // RANGES * GRANULE
        ks0 = b0 // J
        ks1 = (b1 + J - 1) // J
    else:
        t = w
        r = 0
        b0 = 0
        b1 = KS * J
        ks0 = 0
        ks1 = KS
    return t, r, b0, b1, ks0, ks1


@gluon.jit
def _range_out(c_ptr, r, M, N, SPLIT: gl.constexpr):
    """Where an item's output goes: SPLIT, range r's fp32 partial in c [RANGES, M, N]; else
    c [M, N] itself."""
    if SPLIT:
        return c_ptr + r.to(gl.int64) * M * N
    else:
        return c_ptr


@gluon.jit
def _each_item(fn: gl.constexpr, args, where: gl.constexpr, where_args, TILES, KS, CHUNKS,
               RANGES, GRANULE: gl.constexpr, J: gl.constexpr, SPLIT: gl.constexpr,
               PERSIST: gl.constexpr):
    """A partition's items: fn(*args, o0, o1, r, b0, b1, ks0, ks1, n0) for each (_item_k: a
    tile, or with SPLIT a tile's K range r, its 32-blocks [b0, b1) in ring steps [ks0, ks1)),
    (o0, o1) = where(t, *where_args) its tile's offsets, n0 the ring steps this program's
    earlier items took (the ring's stages and phases run on across items). PERSIST: items p,
    p + G, ... of G programs; else item p alone, with no item loop."""
    if PERSIST:
        n0 = 0
        for w in range(gl.program_id(0), TILES * RANGES if SPLIT else TILES,
                       gl.num_programs(0)):
            t, r, b0, b1, ks0, ks1 = _item_k(w, TILES, KS, CHUNKS, RANGES, GRANULE, J, SPLIT)
            o0, o1 = where(t, *where_args)
            fn(*args, o0, o1, r, b0, b1, ks0, ks1, n0)
            n0 += ks1 - ks0
    else:
        t, r, b0, b1, ks0, ks1 = _item_k(gl.program_id(0), TILES, KS, CHUNKS, RANGES, GRANULE,
                                         J, SPLIT)
        o0, o1 = where(t, *where_args)
        fn(*args, o0, o1, r, b0, b1, ks0, ks1, 0)


@gluon.jit
def _tile(t, M, N, BN: gl.constexpr):
    """Output tile t's (off_m, off_n): GROUP row tiles at a time along N (a group shares its
    weight tiles in L2), as _fp8_gemm_kernel orders its programs."""
    tiles_m = gl.cdiv(M, 128)
    width = GROUP * gl.cdiv(N, BN)
    first_m = t // width * GROUP
    rows = gl.minimum(tiles_m - first_m, GROUP)
    return (first_m + (t % width) % rows) * 128, (t % width) // rows * BN


@gluon.jit
def _producer_tile(a_desc, b_desc, a_bufs, b_bufs, ready, empty, off_m, off_n, r, B0, B1, KS0,
                   KS1, n0):
    """An item of the TMA partition (_each_item): fill ring stage n % STAGES (n = n0 + k -
    KS0: the ring's count runs on across a program's items) with K step k's a tile [rows, BK]
    from row off_m and b tile [rows, BK] from row off_n (rows past the ends read as 0), k in
    [KS0, KS1), once both consumers released it."""
    nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    BK: gl.constexpr = a_desc.block_type.shape[1]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    for i in range(KS1 - KS0):
        n = n0 + i
        s = n % STAGES
        mbarrier.wait(empty.index(s), ((n // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), nbytes)
        _tma_load(a_desc, [off_m, (KS0 + i) * BK], ready.index(s), a_bufs.index(s))
        _tma_load(b_desc, [off_n, (KS0 + i) * BK], ready.index(s), b_bufs.index(s))


@gluon.jit
def _producer(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, KS, CHUNKS, RANGES,
              GRANULE: gl.constexpr, SPLIT: gl.constexpr, PERSIST: gl.constexpr):
    """The square tiles' TMA partition: this program's items in turn (_each_item,
    _producer_tile)."""
    BN: gl.constexpr = b_desc.block_type.shape[0]
    _each_item(_producer_tile, (a_desc, b_desc, a_bufs, b_bufs, ready, empty), _tile,
               (M, N, BN), gl.cdiv(M, 128) * gl.cdiv(N, BN), KS, CHUNKS, RANGES, GRANULE,
               a_desc.block_type.shape[1] // 32, SPLIT, PERSIST)


@gluon.jit
def _converter_tile(w8_bufs, b_bufs, ready, conv, ws_ptr, KB, SROWS, off_m, off_n, r, B0, B1,
                    KS0, KS1, n0):
    """An item of the converter partition (_each_item), the fold in the ring (CODES): once
    stage n % STAGES (n = n0 + k - KS0) holds K step k's
    e4m3 weight tile [BN, BK], write its bf16 values times their 32 x 32 blocks' scales
    (2^(e - 127), e from ws [SROWS, KB] bytes) into the stage's bf16 tile, as
    ``triton.e4m3_to_bf16(weight, scale)`` does (exact for foldable scales), and tell the
    consumers (conv). Rows past N are TMA's zeros (their scale row clamped in range)."""
    STAGES: gl.constexpr = w8_bufs.type.shape[0]
    BN: gl.constexpr = w8_bufs.type.shape[1]
    BK: gl.constexpr = w8_bufs.type.shape[2]
    J: gl.constexpr = BK // 32
    LW: gl.constexpr = gl.BlockedLayout([1, 16], [16, 2], [4, 1], [1, 0])  # a 32-block: 2 lanes a row
    srow = gl.minimum((off_n + gl.arange(0, BN, layout=gl.SliceLayout(1, LW))) // 32, SROWS - 1)
    for i in range(KS1 - KS0):
        n = n0 + i
        s = n % STAGES
        mbarrier.wait(ready.index(s), (n // STAGES) & 1)
        for j in gl.static_range(J):
            e = gl.load(ws_ptr + srow * KB + ((KS0 + i) * J + j)).to(gl.int32)
            scale = (e << 23).to(gl.float32, bitcast=True)  # foldable: 2^-63 .. 1, normal
            w = w8_bufs.index(s).slice(32 * j, 32, dim=1).load(LW).to(gl.float32)
            b_bufs.index(s).slice(32 * j, 32, dim=1).store((w * scale[:, None]).to(gl.bfloat16))
        fence_async_shared()  # the stores before the consumers' wgmma reads (async proxy)
        _cta_barrier()
        mbarrier.arrive(conv.index(s), count=1)


@gluon.jit
def _converter(w8_bufs, b_bufs, ready, conv, ws_ptr, KB, SROWS, M, N, KS, CHUNKS, RANGES,
               GRANULE: gl.constexpr, SPLIT: gl.constexpr, PERSIST: gl.constexpr):
    """The converter partition: this program's items in turn, as _producer's."""
    BN: gl.constexpr = w8_bufs.type.shape[1]
    _each_item(_converter_tile, (w8_bufs, b_bufs, ready, conv, ws_ptr, KB, SROWS), _tile,
               (M, N, BN), gl.cdiv(M, 128) * gl.cdiv(N, BN), KS, CHUNKS, RANGES, GRANULE,
               w8_bufs.type.shape[2] // 32, SPLIT, PERSIST)


@gluon.jit
def _consumer_tile(a_bufs, b_bufs, ready, conv, empty, c_ptr, M, N, CHUNKS, RANGES, half,
                   GRANULE: gl.constexpr, BN: gl.constexpr, SPLIT: gl.constexpr,
                   CODES: gl.constexpr, OUT_BF16: gl.constexpr, off_m, off_n, rng, B0, B1,
                   KS0, KS1, n0):
    """An item of a consumer partition (_each_item): rows [off_m + 64 half, +64) of the tile,
    every 32-block's wgmma from zero, added in K order into its range's accumulator; the
    ranges added in order; stored fp32, or rounded once to bf16 (RNE). SPLIT: the item's K
    steps [KS0, KS1) hold one range, its 32-blocks [B0, B1) (a step it shares with a
    neighbouring range adds only its own blocks), stored as range rng's fp32 partial at c +
    rng M N. CODES: a stage's weight tile is ready once the
    converter says so (conv), after TMA's (ready). Ring stage n % STAGES (n = n0 + k - KS0)
    holds K step k."""
    L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                instr_shape=[16, BN, 16])
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    BK: gl.constexpr = a_bufs.type.shape[2]
    c_ptr = _range_out(c_ptr, rng, M, N, SPLIT)
    J: gl.constexpr = BK // 32
    EDGES: gl.constexpr = SPLIT and GRANULE % J != 0  # ranges may end inside a step
    acc = _neg_zeros([64, BN], L)  # -0 + p == p for every p
    total = _neg_zeros([64, BN], L)
    zero = gl.zeros([64, BN], gl.float32, L)
    r_end = CHUNKS // RANGES * GRANULE  # the 32-block where range 0 ends
    r = 0
    for i in range(KS1 - KS0):
        n = n0 + i
        s = n % STAGES
        mbarrier.wait(ready.index(s), (n // STAGES) & 1)
        if CODES:
            mbarrier.wait(conv.index(s), (n // STAGES) & 1)
        a_s = a_bufs.index(s).slice(half * 64, 64, dim=0)
        b_s = b_bufs.index(s)
        for j in gl.static_range(J):
            part = warpgroup_mma(a_s.slice(32 * j, 32, dim=1),
                                 b_s.slice(32 * j, 32, dim=1).permute((1, 0)), zero,
                                 use_acc=False, is_async=True)
            part = warpgroup_mma_wait(num_outstanding=0, deps=[part])
            if j == J - 1:
                mbarrier.arrive(empty.index(s), count=1)
            if EDGES:
                blk = (KS0 + i) * J + j
                if (blk >= B0) & (blk < B1):
                    acc = acc + part
            else:
                acc = acc + part
            if RANGES > 1 and not SPLIT:
                if (KS0 + i) * J + j + 1 == r_end:  # range r is complete: into total, r + 1 from -0
                    total = total + acc
                    acc = _neg_zeros([64, BN], L)
                    r += 1
                    r_end = (r + 1) * CHUNKS // RANGES * GRANULE
    if RANGES == 1 or SPLIT:
        total = acc  # (-0 + acc is acc)
    cols = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, L))
    rows = off_m + half * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, L))
    ptrs = c_ptr + rows.to(gl.int64)[:, None] * N + cols[None, :]
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    if OUT_BF16:
        gl.store(ptrs, total.to(gl.bfloat16), mask=mask)
    else:
        gl.store(ptrs, total, mask=mask)


@gluon.jit
def _consumer(a_bufs, b_bufs, ready, conv, empty, c_ptr, M, N, KS, CHUNKS, RANGES, half,
              GRANULE: gl.constexpr, BN: gl.constexpr, SPLIT: gl.constexpr,
              CODES: gl.constexpr, OUT_BF16: gl.constexpr, PERSIST: gl.constexpr):
    """A consumer partition (rows 64 half .. of each tile): this program's items in turn, as
    _producer's (_consumer_tile). An item's output is stored from the accumulator's
    registers while the producer already fills the ring with the next item's first steps."""
    _each_item(_consumer_tile, (a_bufs, b_bufs, ready, conv, empty, c_ptr, M, N, CHUNKS,
                                RANGES, half, GRANULE, BN, SPLIT, CODES, OUT_BF16),
               _tile, (M, N, BN), gl.cdiv(M, 128) * gl.cdiv(N, BN), KS, CHUNKS, RANGES,
               GRANULE, a_bufs.type.shape[2] // 32, SPLIT, PERSIST)


@gluon.jit
def _fp8_values_ws_kernel(a_desc, b_desc, c_ptr, ws_ptr, M, N, KB, SROWS, KS, CHUNKS, RANGES,
                          GRANULE: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr,
                          CODES: gl.constexpr, B_LAYOUT: gl.constexpr, OUT_BF16: gl.constexpr,
                          PERSIST: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                          PRODUCER_REGS: gl.constexpr, CONVERTER_REGS: gl.constexpr):
    """[128, BN] output tiles (GROUP row tiles at a time along N, as _fp8_gemm_kernel: _tile):
    x's bf16 values through a_desc ([M, K], [128, BK] boxes), the weight's folded bf16 values
    through b_desc ([N, K], [BN, BK] boxes), or (CODES) its e4m3 codes, which a converter
    partition folds with ws [SROWS, KB] (e8m0 bytes) into B_LAYOUT bf16 tiles in the ring;
    c [M, N] fp32 or bf16. KS = K / BK steps; K cut as k_order's (CHUNKS chunks of GRANULE
    32-blocks, RANGES ranges). An item is an output tile, or (SPLIT) an output tile's K
    range, written as that range's fp32 partial into c [RANGES, M, N] (_item_k: a range's
    tiles next to each other). One item a program, item program_id(0); PERSIST: G programs,
    program p taking items p, p + G, ... in turn, its ring running on across them. An item's
    arithmetic is the same either way: no bit depends on the programs."""
    BN: gl.constexpr = b_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    a_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 128, BK], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, BK], B_LAYOUT)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumers
    if CODES:
        w8_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BN, BK], b_desc.layout)
        conv = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(conv.index(i), count=1)
        fence_async_shared()
        gl.warp_specialize([
            (_consumer, (a_bufs, b_bufs, ready, conv, empty, c_ptr, M, N, KS, CHUNKS, RANGES,
                         0, GRANULE, BN, SPLIT, CODES, OUT_BF16, PERSIST)),
            (_consumer, (a_bufs, b_bufs, ready, conv, empty, c_ptr, M, N, KS, CHUNKS, RANGES,
                         1, GRANULE, BN, SPLIT, CODES, OUT_BF16, PERSIST)),
            (_producer, (a_desc, b_desc, a_bufs, w8_bufs, ready, empty, M, N, KS, CHUNKS,
                         RANGES, GRANULE, SPLIT, PERSIST)),
            (_converter, (w8_bufs, b_bufs, ready, conv, ws_ptr, KB, SROWS, M, N, KS, CHUNKS,
                          RANGES, GRANULE, SPLIT, PERSIST)),
        ], [4, 4, 4], [CONSUMER_REGS, PRODUCER_REGS, CONVERTER_REGS])
    else:  # (no converter: the consumers wait on ready alone; conv is not read)
        fence_async_shared()
        gl.warp_specialize([
            (_consumer, (a_bufs, b_bufs, ready, ready, empty, c_ptr, M, N, KS, CHUNKS, RANGES,
                         0, GRANULE, BN, SPLIT, CODES, OUT_BF16, PERSIST)),
            (_consumer, (a_bufs, b_bufs, ready, ready, empty, c_ptr, M, N, KS, CHUNKS, RANGES,
                         1, GRANULE, BN, SPLIT, CODES, OUT_BF16, PERSIST)),
            (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, KS, CHUNKS,
                         RANGES, GRANULE, SPLIT, PERSIST)),
        ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])


def unsupported(k: int, device: torch.device, out: torch.Tensor,
                stage_k: int = BLOCK_K) -> str | None:
    """Why fp8_values_gemm_ws (or, stage_k SWAP_BK, fp8_swap_gemm_ws) cannot run a K of k on
    this device into out, or None."""
    if not is_hopper(device):
        return f"device {device}: the kernel's wgmma needs an sm_90 GPU"
    if k % stage_k:
        return f"K {k}: a multiple of {stage_k} wanted (whole ring stages)"
    if out.dtype not in (torch.bfloat16, torch.float32) or not out.is_contiguous():
        return f"out {out.dtype}: a contiguous bf16 or fp32 tensor wanted"
    return None


def fp8_values_gemm_ws(x_values: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
                       chunks: int, ranges: int, granule: int, split: bool = False,
                       w_scale: torch.Tensor | None = None,
                       programs: int | None = None) -> torch.Tensor:
    """out [M, N] (fp32, or bf16: rounded once) = x's bf16 values [M, K] times the weight's
    folded bf16 values [N, K] (``e4m3_to_bf16(weight, scale)``), or its e4m3 codes w [N, K]
    with w_scale [ceil(N / 32), K / 32] (e8m0, foldable: the converter folds them in the ring),
    K cut as k_order's (chunks, ranges, granule): the bits of ``_fp8_gemm_kernel``'s PRESCALED
    tiles on the unfolded weight. split: the ranges run as separate programs, each writing its
    fp32 partial into out [ranges, M, N] (for ``triton._split_sum_kernel``, which adds them in
    range order). programs: the programs launched on the folded values, each taking items (an
    output tile, or with split a tile's range) in turn (None: one an SM where PERSISTENT, and
    PERSISTENT_SPLIT with split, else one an item; never more than the items): the same bits
    whatever it is. (The codes' converter, at 64 registers, spills in the item loop: those
    launches run one program an item.) The caller checked ``unsupported``."""
    if programs is not None and (not isinstance(programs, int) or programs < 1):
        raise ValueError(f"programs must be a positive int or None, got {programs!r}")
    x_values = x_values.contiguous()
    w = w.contiguous()
    m, k = x_values.shape
    n = w.shape[0]
    codes = w.dtype == torch.float8_e4m3fn
    assert codes == (w_scale is not None)
    if codes:
        bk, stages = BLOCK_K, CODES_STAGES
    else:
        bk, stages = (WIDE_K, WIDE_STAGES) if k >= WIDE_MIN_K and k % WIDE_K == 0 else \
            (BLOCK_K, STAGES)
    a_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_M, bk], gl.bfloat16)
    b_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, bk], gl.bfloat16)
    w_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, bk], gl.float8e4nv) if codes \
        else b_layout
    a_desc = TensorDescriptor.from_tensor(x_values, [BLOCK_M, bk], a_layout)
    b_desc = TensorDescriptor.from_tensor(w, [BLOCK_N, bk], w_layout)
    ws = w_scale.contiguous().view(torch.uint8) if codes else x_values  # (not read unless codes)
    srows, kb = (ws.shape[0], ws.shape[1]) if codes else (1, k // 32)
    split = bool(split and ranges > 1)
    assert out.shape == ((ranges, m, n) if split else (m, n))
    assert not split or out.dtype == torch.float32
    items = cdiv(m, BLOCK_M) * cdiv(n, BLOCK_N) * (ranges if split else 1)
    if programs is None:
        programs = sm_count(x_values.device) if PERSISTENT and not codes \
            and (PERSISTENT_SPLIT or not split) else items
    programs = items if codes else min(programs, items)
    _fp8_values_ws_kernel[(programs,)](
        a_desc, b_desc, out, ws, m, n, kb, srows, k // bk, chunks, ranges, GRANULE=granule,
        STAGES=stages, SPLIT=split, CODES=codes, B_LAYOUT=b_layout,
        OUT_BF16=out.dtype == torch.bfloat16, PERSIST=programs < items,
        CONSUMER_REGS=CODES_CONSUMER_REGS if codes else CONSUMER_REGS,
        PRODUCER_REGS=PRODUCER_REGS, CONVERTER_REGS=CONVERTER_REGS, num_warps=4)
    return out


# The decode-sized GEMM with the operands swapped (fp8_linear's wide and decode tiles past 16
# token rows: weight rows on the wgmma's 64-row side, the token rows its narrow side).
SWAP_BN = 128  # weight rows a tile: two consumer warp groups of 64
SWAP_BK = 128  # four 32-blocks a ring stage (the weight's 128-byte rows)
SWAP_MAX_BT = 128  # token rows a tile at most (the wgmma's N; [64, BT] fp32 accumulators)
SWAP_SMEM = 200 * 1024  # the ring's shared memory at most (the H100/H200 block limit: 227 KB)
# Two variants, both the same bits as the default tiles on an H100 (forty-third session):
# SWAP_NARROW lost 5-98% on wo_b (off); SWAP_INFLIGHT, which acts on 32- and 64-row token tiles
# only, won 9-16% on wo_b at 48-64 rows (on; linear.triton.SWAP_WS_LONG_MIN_M).
SWAP_NARROW = False  # narrower token tiles where the widest would leave SMs idle (swap_tile)
SWAP_INFLIGHT = True  # several of a stage's block dots in flight per wait (_swap_consumer_tile)
# the weight's e4m3 codes into the wgmma's bf16 operand by their bits (common.triton's
# E4M3_BF16_BITS_ASM: integer ops and one bf16 FMA a pair) rather than by the conversion
# units (an e4m3 -> f16 unpack a pair, then an f16 -> bf16 conversion an element, 16 results
# a clock an SM): exact for every code but the NaNs, so the caller runs these tiles only on
# weights without them (triton.nan_free_codes)
SWAP_CODE_BITS = True
# a launch's programs: one an SM, each taking the items (tiles) in turn with its ring running
# on across them, as the square tiles' PERSISTENT (off: one program an item); and where K's
# ranges run as items of their own (split: wo_b at 65-511 rows; off: timed on an H100, wo_b
# at 256 rows 81.8 -> 84.0 us, at 511 186.1 -> 186.2)
SWAP_PERSISTENT = True
SWAP_PERSISTENT_SPLIT = False


@gluon.jit
def _block_scale(ws_ptr, srow, KB, blk):
    """The weight's 32-block scales 2^(e - 127) of 32-block column blk (clamped in range: a
    block past K is loaded but not used) for the rows of srow (e8m0 bytes of ws [SROWS, KB])."""
    e = gl.load(ws_ptr + srow * KB + gl.minimum(blk, KB - 1)).to(gl.int32)
    # as common.triton.e8m0_to_fp32 (torch's cast): 0 -> 2^-127 (subnormal), 255 -> NaN
    s = gl.where(e == 0, 0x400000, gl.where(e == 255, 0x7FC00000, e << 23))
    return s.to(gl.float32, bitcast=True)


@gluon.jit
def _swap_add(acc, total, part, scale, blk, B0, B1, r, r_end, CHUNKS, RANGES,
              GRANULE: gl.constexpr, SPLIT: gl.constexpr, EDGES: gl.constexpr,
              L: gl.constexpr):
    """32-block blk's dot times its rows' scale (a power of two: exact) added into the range's
    accumulator (EDGES: only blocks in [B0, B1)); ranges summed in the program (RANGES > 1,
    not SPLIT): where range r ends there, the accumulator goes into total and range r + 1
    starts from -0."""
    part = part * scale[:, None]
    if EDGES:
        if (blk >= B0) & (blk < B1):
            acc = acc + part
    else:
        acc = acc + part
    if RANGES > 1 and not SPLIT:
        if blk + 1 == r_end:  # range r is complete: into total, r + 1 from -0
            total = total + acc
            acc = _neg_zeros(acc.shape, L)
            r += 1
            r_end = (r + 1) * CHUNKS // RANGES * GRANULE
    return acc, total, r, r_end


_E4M3_BF16_ASM = gl.constexpr(E4M3_BF16_BITS_ASM)  # (common.triton: codes by their bits)


@gluon.jit
def _swap_dot(w_s, x_s, j: gl.constexpr, zero, AL: gl.constexpr, BITS: gl.constexpr):
    """32-block j of the stage, issued: the weight rows' e4m3 codes [64, 32] into registers
    as bf16 (exact; BITS: by _E4M3_BF16_ASM), times the token rows' values [BT, 32]^T, from
    no accumulator."""
    c = w_s.slice(32 * j, 32, dim=1).load(AL)
    if BITS:
        a = gl.inline_asm_elementwise(_E4M3_BF16_ASM, "=r,h", [c.to(gl.uint8, bitcast=True)],
                                      dtype=gl.bfloat16, is_pure=True, pack=2)
    else:
        a = c.to(gl.bfloat16)
    return warpgroup_mma(a, x_s.slice(32 * j, 32, dim=1).permute((1, 0)), zero, use_acc=False,
                         is_async=True)


@gluon.jit
def _swap_tile_at(t, M, BT: gl.constexpr):
    """Output tile t's (off_n, off_m): the token tiles of one weight tile next to each other
    (programs running side by side share its bytes in L2)."""
    tiles_m = gl.cdiv(M, BT)
    return t // tiles_m * 128, t % tiles_m * BT


@gluon.jit
def _swap_producer(w_desc, x_desc, w_bufs, x_bufs, ready, empty, M, N, KS, CHUNKS, RANGES,
                   GRANULE: gl.constexpr, SPLIT: gl.constexpr, PERSIST: gl.constexpr):
    """The swapped tiles' TMA partition: this program's items in turn (_each_item), each K
    step's weight tile [128, BK] and token tile [BT, BK] (_producer_tile, the weight's first:
    its rows are the MMA's)."""
    BT: gl.constexpr = x_desc.block_type.shape[0]
    _each_item(_producer_tile, (w_desc, x_desc, w_bufs, x_bufs, ready, empty), _swap_tile_at,
               (M, BT), gl.cdiv(N, 128) * gl.cdiv(M, BT), KS, CHUNKS, RANGES, GRANULE,
               x_desc.block_type.shape[1] // 32, SPLIT, PERSIST)


@gluon.jit
def _swap_consumer(w_bufs, x_bufs, ready, empty, ws_ptr, c_ptr, M, N, KB, SROWS, KS, CHUNKS,
                   RANGES, half, GRANULE: gl.constexpr, SPLIT: gl.constexpr,
                   INFLIGHT: gl.constexpr, OUT_BF16: gl.constexpr, BITS: gl.constexpr,
                   PERSIST: gl.constexpr):
    """A consumer partition (weight rows 64 half .. of each tile): this program's items in
    turn, as _swap_producer's (_swap_consumer_tile). An item's output is stored from the
    accumulator's registers while the producer already fills the ring with the next item's
    first steps."""
    BT: gl.constexpr = x_bufs.type.shape[1]
    _each_item(_swap_consumer_tile, (w_bufs, x_bufs, ready, empty, ws_ptr, c_ptr, M, N, KB,
                                     SROWS, CHUNKS, RANGES, half, GRANULE, SPLIT, INFLIGHT,
                                     OUT_BF16, BITS),
               _swap_tile_at, (M, BT), gl.cdiv(N, 128) * gl.cdiv(M, BT), KS, CHUNKS, RANGES,
               GRANULE, x_bufs.type.shape[2] // 32, SPLIT, PERSIST)


@gluon.jit
def _swap_consumer_tile(w_bufs, x_bufs, ready, empty, ws_ptr, c_ptr, M, N, KB, SROWS, CHUNKS,
                        RANGES, half, GRANULE: gl.constexpr, SPLIT: gl.constexpr,
                        INFLIGHT: gl.constexpr, OUT_BF16: gl.constexpr, BITS: gl.constexpr,
                        off_n, off_m, rng, B0, B1, KS0, KS1, n0):
    """An item of a consumer partition (_each_item): weight rows [off_n + 64 half, +64) of
    the tile against its BT token rows: each
    32-block's dot (the weight's e4m3 values, exact in bf16, from the stage into the wgmma's
    register operand; the token rows' bf16 values from the stage) from no accumulator, times
    the rows' block scale, added in K order into its range's fp32 accumulator from -0; the
    ranges added in order; y^T's tile stored into c [M, N] as fp32 or rounded once to bf16.
    SPLIT: as _consumer_tile's. One block dot at a time (issued, waited for, added); INFLIGHT
    (SWAP_INFLIGHT): up to 32 token rows a stage's four dots in flight together (one wait),
    then added in K order; at 64 two at a time (each added while the next runs: four [64, 64]
    fp32 dots beside the accumulators spill); at 128 one at a time still. Ring stage
    n % STAGES (n = n0 + k - KS0: the ring's count runs on across a program's tiles) holds
    K step k."""
    STAGES: gl.constexpr = w_bufs.type.shape[0]
    c_ptr = _range_out(c_ptr, rng, M, N, SPLIT)
    BT: gl.constexpr = x_bufs.type.shape[1]
    BK: gl.constexpr = x_bufs.type.shape[2]
    gl.static_assert(BK == 128)  # four blocks a stage: the scales s0..s3
    J: gl.constexpr = 4
    L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                instr_shape=[16, BT, 16])
    AL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=L, k_width=2)
    EDGES: gl.constexpr = SPLIT and GRANULE % J != 0  # ranges may end inside a step
    rows = off_n + half * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, L))
    srow = gl.minimum(rows // 32, SROWS - 1)
    acc = _neg_zeros([64, BT], L)  # -0 + p == p for every p
    total = _neg_zeros([64, BT], L)
    zero = gl.zeros([64, BT], gl.float32, L)
    r_end = CHUNKS // RANGES * GRANULE  # the 32-block where range 0 ends
    r = 0
    # each K step's four block scales, loaded a step ahead (off the dots' path)
    s0 = _block_scale(ws_ptr, srow, KB, KS0 * J)
    s1 = _block_scale(ws_ptr, srow, KB, KS0 * J + 1)
    s2 = _block_scale(ws_ptr, srow, KB, KS0 * J + 2)
    s3 = _block_scale(ws_ptr, srow, KB, KS0 * J + 3)
    for i in range(KS1 - KS0):
        n = n0 + i
        s = n % STAGES
        blk = (KS0 + i) * J
        t0 = _block_scale(ws_ptr, srow, KB, blk + 4)
        t1 = _block_scale(ws_ptr, srow, KB, blk + 5)
        t2 = _block_scale(ws_ptr, srow, KB, blk + 6)
        t3 = _block_scale(ws_ptr, srow, KB, blk + 7)
        mbarrier.wait(ready.index(s), (n // STAGES) & 1)
        w_s = w_bufs.index(s).slice(half * 64, 64, dim=0)
        x_s = x_bufs.index(s)
        if INFLIGHT and BT <= 32:  # the stage's four dots in flight together
            p0 = _swap_dot(w_s, x_s, 0, zero, AL, BITS)
            p1 = _swap_dot(w_s, x_s, 1, zero, AL, BITS)
            p2 = _swap_dot(w_s, x_s, 2, zero, AL, BITS)
            p3 = _swap_dot(w_s, x_s, 3, zero, AL, BITS)
            p0, p1, p2, p3 = warpgroup_mma_wait(num_outstanding=0, deps=[p0, p1, p2, p3])
            mbarrier.arrive(empty.index(s), count=1)
            acc, total, r, r_end = _swap_add(acc, total, p0, s0, blk, B0, B1, r, r_end, CHUNKS,
                                             RANGES, GRANULE, SPLIT, EDGES, L)
            acc, total, r, r_end = _swap_add(acc, total, p1, s1, blk + 1, B0, B1, r, r_end,
                                             CHUNKS, RANGES, GRANULE, SPLIT, EDGES, L)
            acc, total, r, r_end = _swap_add(acc, total, p2, s2, blk + 2, B0, B1, r, r_end,
                                             CHUNKS, RANGES, GRANULE, SPLIT, EDGES, L)
            acc, total, r, r_end = _swap_add(acc, total, p3, s3, blk + 3, B0, B1, r, r_end,
                                             CHUNKS, RANGES, GRANULE, SPLIT, EDGES, L)
        elif INFLIGHT and BT <= 64:  # two in flight, each added while the next runs
            p0 = _swap_dot(w_s, x_s, 0, zero, AL, BITS)
            p1 = _swap_dot(w_s, x_s, 1, zero, AL, BITS)
            p0 = warpgroup_mma_wait(num_outstanding=1, deps=[p0])
            acc, total, r, r_end = _swap_add(acc, total, p0, s0, blk, B0, B1, r, r_end, CHUNKS,
                                             RANGES, GRANULE, SPLIT, EDGES, L)
            p2 = _swap_dot(w_s, x_s, 2, zero, AL, BITS)
            p1 = warpgroup_mma_wait(num_outstanding=1, deps=[p1])
            acc, total, r, r_end = _swap_add(acc, total, p1, s1, blk + 1, B0, B1, r, r_end,
                                             CHUNKS, RANGES, GRANULE, SPLIT, EDGES, L)
            p3 = _swap_dot(w_s, x_s, 3, zero, AL, BITS)
            p2 = warpgroup_mma_wait(num_outstanding=1, deps=[p2])
            acc, total, r, r_end = _swap_add(acc, total, p2, s2, blk + 2, B0, B1, r, r_end,
                                             CHUNKS, RANGES, GRANULE, SPLIT, EDGES, L)
            p3 = warpgroup_mma_wait(num_outstanding=0, deps=[p3])
            mbarrier.arrive(empty.index(s), count=1)
            acc, total, r, r_end = _swap_add(acc, total, p3, s3, blk + 3, B0, B1, r, r_end,
                                             CHUNKS, RANGES, GRANULE, SPLIT, EDGES, L)
        else:
            for j in gl.static_range(J):
                part = _swap_dot(w_s, x_s, j, zero, AL, BITS)
                part = warpgroup_mma_wait(num_outstanding=0, deps=[part])
                if j == J - 1:
                    mbarrier.arrive(empty.index(s), count=1)
                if j == 0:
                    sc = s0
                elif j == 1:
                    sc = s1
                elif j == 2:
                    sc = s2
                else:
                    sc = s3
                acc, total, r, r_end = _swap_add(acc, total, part, sc, blk + j, B0, B1, r,
                                                 r_end, CHUNKS, RANGES, GRANULE, SPLIT, EDGES, L)
        s0 = t0
        s1 = t1
        s2 = t2
        s3 = t3
    if RANGES == 1 or SPLIT:
        total = acc  # (-0 + acc is acc)
    toks = off_m + gl.arange(0, BT, layout=gl.SliceLayout(0, L))
    ptrs = c_ptr + (toks[None, :] * N + rows[:, None])  # (int32: M N < 2^31, checked)
    mask = (rows < N)[:, None] & (toks < M)[None, :]
    if OUT_BF16:
        gl.store(ptrs, total.to(gl.bfloat16), mask=mask)
    else:
        gl.store(ptrs, total, mask=mask)


@gluon.jit(do_not_specialize=["RANGES"])
def _fp8_swap_ws_kernel(w_desc, x_desc, c_ptr, ws_ptr, M, N, KB, SROWS, KS, CHUNKS, RANGES,
                        GRANULE: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr,
                        INFLIGHT: gl.constexpr, OUT_BF16: gl.constexpr, BITS: gl.constexpr,
                        PERSIST: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                        PRODUCER_REGS: gl.constexpr):
    """[128 weight rows, BT token rows] tiles of y^T (the token tiles of one weight tile next
    to each other, sharing its bytes in L2: _swap_tile_at): the weight's e4m3 codes through
    w_desc ([N, K], [128, BK] boxes), x's bf16 values (act_quant's, exact) through x_desc ([M,
    K], [BT, BK] boxes), ws [SROWS, KB] the weight's e8m0 block scales; c [M, N] fp32 or bf16.
    KS = K / BK steps; K cut as k_order's (CHUNKS chunks of GRANULE 32-blocks, RANGES ranges).
    An item is a tile, or (SPLIT) a tile's K range, written as that range's fp32 partial into
    c [RANGES, M, N] (_item_k). INFLIGHT: see _swap_consumer_tile. BITS: SWAP_CODE_BITS (the
    weight holds no NaN code). One item a program, item program_id(0); PERSIST: G programs,
    program p taking items p, p + G, ... in turn, its ring running on across them. An item's
    arithmetic is the same either way: no bit depends on the programs."""
    BK: gl.constexpr = x_desc.block_type.shape[1]
    BT: gl.constexpr = x_desc.block_type.shape[0]
    w_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, 128, BK], w_desc.layout)
    x_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, BK], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumers
    fence_async_shared()
    gl.warp_specialize([
        (_swap_consumer, (w_bufs, x_bufs, ready, empty, ws_ptr, c_ptr, M, N, KB, SROWS, KS,
                          CHUNKS, RANGES, 0, GRANULE, SPLIT, INFLIGHT, OUT_BF16, BITS,
                          PERSIST)),
        (_swap_consumer, (w_bufs, x_bufs, ready, empty, ws_ptr, c_ptr, M, N, KB, SROWS, KS,
                          CHUNKS, RANGES, 1, GRANULE, SPLIT, INFLIGHT, OUT_BF16, BITS,
                          PERSIST)),
        (_swap_producer, (w_desc, x_desc, w_bufs, x_bufs, ready, empty, M, N, KS, CHUNKS,
                          RANGES, GRANULE, SPLIT, PERSIST)),
    ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])


def swap_tile(m: int, n: int = 0, sms: int = 0) -> tuple[int, int]:
    """(token rows a tile, ring stages) of fp8_swap_gemm_ws for M rows of an N-row weight: the
    narrowest power-of-two wgmma side from 16 that holds M, at most SWAP_MAX_BT; given n and
    the SM count (SWAP_NARROW), halved down to 32 while the tiles would leave SMs idle (more
    token tiles, each reading the weight tile from L2, rather than K's ranges as programs
    with their partials). As many stages as SWAP_SMEM holds (the weight's [128, 128] codes
    and the tokens' [BT, 128] values a stage)."""
    bt = 16
    while bt < min(m, SWAP_MAX_BT):
        bt *= 2
    if SWAP_NARROW and n and sms:
        while bt > 32 and cdiv(n, SWAP_BN) * cdiv(m, bt) < sms:
            bt //= 2
    return bt, min(8, SWAP_SMEM // (SWAP_BN * SWAP_BK + bt * SWAP_BK * 2))


def fp8_swap_gemm_ws(x_values: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                     out: torch.Tensor, chunks: int, ranges: int, granule: int,
                     split: bool = False, bt: int = 0,
                     programs: int | None = None) -> torch.Tensor:
    """out [M, N] (fp32, or bf16: rounded once) = x's bf16 values [M, K] (act_quant's: codes
    times their power-of-two row scales, exact) times the weight's e4m3 codes w [N, K] with
    their block scales w_scale [ceil(N / 32), K / 32] (e8m0), K cut as k_order's (chunks,
    ranges, granule): the bits of ``_fp8_decode_kernel``'s VALUES tiles. split: the ranges run
    as separate programs, each writing its fp32 partial into out [ranges, M, N] (for
    ``triton._split_sum_kernel``). bt: the token rows a tile (swap_tile's; 0: swap_tile(M)).
    programs: the programs launched, each taking items (a tile, or with split a tile's range)
    in turn (None: one an SM where SWAP_PERSISTENT, and SWAP_PERSISTENT_SPLIT with split,
    else one an item; never more than the items): the same bits whatever it is. The caller
    checked ``unsupported(K, device, out, SWAP_BK)``."""
    if programs is not None and (not isinstance(programs, int) or programs < 1):
        raise ValueError(f"programs must be a positive int or None, got {programs!r}")
    x_values = x_values.contiguous()
    w = w.contiguous()
    m, k = x_values.shape
    n = w.shape[0]
    bt, stages = swap_tile(m) if not bt else (bt, swap_tile(bt)[1])
    x_layout = gl.NVMMASharedLayout.get_default_for([bt, SWAP_BK], gl.bfloat16)
    w_layout = gl.NVMMASharedLayout.get_default_for([SWAP_BN, SWAP_BK], gl.float8e4nv)
    x_desc = TensorDescriptor.from_tensor(x_values, [bt, SWAP_BK], x_layout)
    w_desc = TensorDescriptor.from_tensor(w, [SWAP_BN, SWAP_BK], w_layout)
    ws = w_scale.contiguous().view(torch.uint8)
    split = bool(split and ranges > 1)
    assert out.shape == ((ranges, m, n) if split else (m, n))
    assert not split or out.dtype == torch.float32
    assert m * n < 2 ** 31  # the tile's output offsets in int32
    items = cdiv(n, SWAP_BN) * cdiv(m, bt) * (ranges if split else 1)
    if programs is None:
        programs = sm_count(x_values.device) if SWAP_PERSISTENT \
            and (SWAP_PERSISTENT_SPLIT or not split) else items
    programs = min(programs, items)
    _fp8_swap_ws_kernel[(programs,)](
        w_desc, x_desc, out, ws, m, n, ws.shape[1], ws.shape[0], k // SWAP_BK, chunks, ranges,
        GRANULE=granule, STAGES=stages, SPLIT=split, INFLIGHT=SWAP_INFLIGHT,
        OUT_BF16=out.dtype == torch.bfloat16, BITS=SWAP_CODE_BITS, PERSIST=programs < items,
        CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, num_warps=4)
    return out
