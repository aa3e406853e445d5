"""Triton compressor epilogue (docs/numerics.md §5, step 3): the same numerics as
``reference.pool_norm_rope_pack``, from the wkv/wgate outputs to the packed paged rows.

Three launches at r > 1 and two at r = 1 (a fixed count, no host sync: CUDA-graph capturable).
Stage 1 (``_pool_kernel``, r > 1 only) pools in parallel over (4 groups, 128 channels) tiles:
per-channel softmax over the r tokens, fp32, the reference's order, rounded to bf16 and kept as
fp32 in a [N, D] scratch buffer. Stage 2 (``_latent_kernel``) runs one program per (BLOCK_G
groups, BK-channel chunk): channels are held as (even, odd) pairs, the RoPE pairs and the fp4
byte pairs alike; each program sums the squares of the whole row's bf16(pooled) for the RMS
(every chunk, in chunk order: each program gets the same bits), normalises its chunk (the
latent), rotates and packs it into the rows pool, and stores its chunk's part of latent .
index_wk^T (fp32, bf16 tl.dot) in an [N, D/BK, DI] scratch; both read stage 1's values (r = 1:
the bf16 kv row). Stage 3 (``_key_kernel``) adds the parts in chunk order and gives the index
key its bf16 rounding, norm, RoPE and pack.

Before, one program per 16 groups walked the 8 chunks of V4.1-Flash's D = 512 in series
(~36 us for one group, latency-bound); the chunks now run side by side. The rows are the same
bytes as that kernel's (the same chunk code); the index key's fp32 sum now adds eight chunk
parts instead of chaining one accumulator through the chunks' dots (an fp32-ulp difference,
before the bf16 cast, like the GEMM order below).

Rounding points follow the reference: correctly rounded division and sqrt (div_rn, sqrt_rn),
no fused multiply-add on the GPU (enable_fp_fusion=False: torch's CPU rounds every product
before its sum), bf16 round-to-nearest-even where the reference casts. fp4 e2m1 codes come from
compares on x / s, e4m3 and ue8m0 scales from the fp32 bits (bit-exact with packing.py). Not
bit-exact: exp (the softmax), the RMS sum order, torch's rsqrt (here 1 / sqrt) and the GEMM
order, each about an fp32 ulp before a bf16 cast. Under TRITON_INTERPRET the bf16 -> fp32 cast
is wrong on subnormal bf16 inputs (never seen in activations or weights).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..common.triton import (any_nan, cdiv, check_device, cos_sin, e4m3_code, e4m3_to_fp32,
                             interpreting, next_pow2, pow2_ceil_exponent, require, rms_scale,
                             rope_rotate, round_bf16, to_bf16)
from ..linear.triton import _dense_sum_kernel, _last_range_sum, _tile_counters, dense_linear
from . import reference

BLOCK_G = 16  # groups per program: tl.dot needs M >= 16
MAX_BK = 64  # channels per chunk (32 pairs); bounds the registers at D = 512
POOL_BLOCK_G, POOL_BLOCK_C = 4, 128  # stage 1's tile: groups x channels per program
_INV_FP4_MAX = torch.tensor(1.0 / 6.0, dtype=torch.float32).item()  # fp32(1/6), as quant.py


@triton.jit
def _e2m1_nibble(v):
    """fp32 v = x / s -> nibble sign << 3 | index into (0, .5, 1, 1.5, 2, 3, 4, 6), rounding as
    quant.round_e2m1: nearest, ties to the even code, |v| > 5 -> 6, -0 keeps its sign."""
    a = tl.abs(v)
    idx = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
           + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
           + (a > 5.0).to(tl.int32))
    return idx | ((v.to(tl.int32, bitcast=True) >> 28) & 8)


@triton.jit
def _e4m3_scale(t):
    """Positive fp32 t -> (e4m3 byte, its fp32 value): e4m3_code's rounding (to nearest even,
    saturating at 448: torch's float8_e4m3fn cast of the clamped value)."""
    code = e4m3_code(t)  # t > 0: no sign bit
    return code, e4m3_to_fp32(code.to(tl.uint8))


@triton.jit
def _latent_fp4(xe, xo, BLOCK_G: tl.constexpr, NB: tl.constexpr):
    """quant.fp4_quant(x, 16, "e4m3") of x = pairs (xe, xo) [BLOCK_G, 8 NB] fp32 (bf16 values).

    Returns (bytes [BLOCK_G, 8 NB] int32, element 2i in the low nibble; e4m3 scale bytes
    [BLOCK_G, NB] int32), as packing.pack_compressed_rows lays them out.
    """
    ve = tl.reshape(xe, (BLOCK_G, NB, 8))
    vo = tl.reshape(xo, (BLOCK_G, NB, 8))
    amax = tl.maximum(tl.max(tl.abs(ve), 2), tl.max(tl.abs(vo), 2))
    amax = tl.maximum(amax, 0.01171875)  # 6 * 2^-9
    code, s = _e4m3_scale(tl.div_rn(amax, tl.full((BLOCK_G, NB), 6.0, tl.float32)))
    s = tl.broadcast_to(s[:, :, None], (BLOCK_G, NB, 8))
    nib = _e2m1_nibble(tl.div_rn(ve, s)) | (_e2m1_nibble(tl.div_rn(vo, s)) << 4)
    # a group holding a NaN: the reference's bytes, the NaN scale 0x7F over +6 nibbles (its
    # NaN amax, scale and quotients), so the row decodes to NaN (an infinity saturates there)
    nan = any_nan(ve, 2) | any_nan(vo, 2)
    nib = tl.where(nan[:, :, None], 0x77, nib)
    code = tl.where(nan, 0x7F, code)
    return tl.reshape(nib, (BLOCK_G, NB * 8)), code


@triton.jit
def _index_fp4(xe, xo, inv_fp4_max, BLOCK_G: tl.constexpr, NB: tl.constexpr):
    """quant.fp4_quant(x, 32, "ue8m0") of x = pairs (xe, xo) [BLOCK_G, 16 NB] fp32.

    Returns (bytes [BLOCK_G, 16 NB] int32; ue8m0 exponent bytes [BLOCK_G, NB] int32), as
    packing.pack_index_keys. inv_fp4_max: fp32(1/6).
    """
    ve = tl.reshape(xe, (BLOCK_G, NB, 16))
    vo = tl.reshape(xo, (BLOCK_G, NB, 16))
    amax = tl.maximum(tl.max(tl.abs(ve), 2), tl.max(tl.abs(vo), 2))
    amax = tl.maximum(amax, 7.052966104933725e-38)  # 6 * 2^-126
    e = pow2_ceil_exponent(amax * inv_fp4_max)  # the ue8m0 byte of 2^ceil(log2)
    s = tl.broadcast_to((e << 23).to(tl.float32, bitcast=True)[:, :, None], (BLOCK_G, NB, 16))
    nib = _e2m1_nibble(tl.div_rn(ve, s)) | (_e2m1_nibble(tl.div_rn(vo, s)) << 4)
    # a block holding a NaN decodes to zeros, as the reference's (its NaN amax makes the
    # scale -0, whose byte is 0)
    nan = any_nan(ve, 2) | any_nan(vo, 2)
    nib = tl.where(nan[:, :, None], 0, nib)
    e = tl.where(nan, 0, e)
    return tl.reshape(nib, (BLOCK_G, NB * 16)), e


@triton.jit
def _rope(xe, xo, rot_ptr, g64, ok, pair0, NP: tl.constexpr, PAIRS: tl.constexpr,
          ROPE: tl.constexpr, INTERPRET: tl.constexpr):
    """RoPE (rope.apply_rope) of pairs pair0 .. pair0+NP-1 of a row of PAIRS pairs; only the
    last ROPE/2 pairs turn. xe, xo: [G, NP] fp32 (bf16 values); rot: [N, ROPE/2, 2] fp32
    (cos, sin). Returns the pairs as bf16 values in fp32, as the complex64 product rounded."""
    j = pair0 + tl.arange(0, NP) - (PAIRS - ROPE // 2)  # index into the rotations
    turn = j >= 0
    re, im = rope_rotate(xe, xo, rot_ptr + g64[:, None] * ROPE, tl.maximum(j, 0)[None, :],
                         ok[:, None] & turn[None, :], False, INTERPRET)
    return tl.where(turn[None, :], re, xe), tl.where(turn[None, :], im, xo)


@triton.jit
def _pooled(kv_ptr, score_ptr, g64, ok, ch, RATIO: tl.constexpr, D: tl.constexpr,
            INTERPRET: tl.constexpr):
    """bf16(pooled) of channels ch [C] of groups g64 [G], as fp32 [G, C]; rows ~ok are 0.

    RATIO 1: the kv row. Otherwise per channel: top = max_t score_t, e_t = exp(score_t - top),
    gate_t = e_t / sum_t e_t, pooled = sum_t kv_t * gate_t from +0 in t order (torch's
    softmax over dim 1, then the sum over it).
    """
    offs = g64[:, None] * (RATIO * D) + ch[None, :]
    mask = ok[:, None]
    if RATIO == 1:
        x = tl.load(kv_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        top = tl.load(score_ptr + offs, mask=mask, other=0.0)
        for t in tl.static_range(1, RATIO):
            top = tl.maximum(top, tl.load(score_ptr + offs + t * D, mask=mask, other=0.0))
        total = tl.zeros_like(top)
        for t in tl.static_range(RATIO):
            total += tl.exp(tl.load(score_ptr + offs + t * D, mask=mask, other=0.0) - top)
        x = tl.zeros_like(top)
        for t in tl.static_range(RATIO):
            e = tl.exp(tl.load(score_ptr + offs + t * D, mask=mask, other=0.0) - top)
            kv = tl.load(kv_ptr + offs + t * D, mask=mask, other=0.0).to(tl.float32)
            x += kv * tl.div_rn(e, total)
    return round_bf16(x, INTERPRET)


@triton.jit
def _pool_kernel(kv_ptr, score_ptr, pooled_ptr, page_ptr, slot_ptr, N, P, PAGE_ROWS,
                 RATIO: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr,
                 BLOCK_C: tl.constexpr, INTERPRET: tl.constexpr):
    """Stage 1 (RATIO > 1): pooled[g, ch] = bf16(pooled) as fp32 (_pooled: elementwise per
    channel, so the same bits whatever the tile). kv, score: [N, RATIO, D] fp32; pooled: [N, D]
    fp32, written for the groups the epilogue writes (others: untouched). Grid (cdiv(N,
    BLOCK_G), D / BLOCK_C)."""
    g64, ok, _ = _group_rows(page_ptr, slot_ptr, N, P, PAGE_ROWS, BLOCK_G)
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    x = _pooled(kv_ptr, score_ptr, g64, ok, ch, RATIO, D, INTERPRET)
    tl.store(pooled_ptr + g64[:, None] * D + ch[None, :], x, mask=ok[:, None])


@triton.jit
def _chunk_in(kv_ptr, pooled_ptr, g64, ok, ch, RATIO: tl.constexpr, D: tl.constexpr,
              INTERPRET: tl.constexpr):
    """bf16(pooled) of channels ch [C] of groups g64, fp32 [G, C], rows ~ok 0: RATIO 1 the kv
    row (_pooled), else stage 1's values (the same bits, loaded the way _pooled loads)."""
    if RATIO == 1:
        x = _pooled(kv_ptr, kv_ptr, g64, ok, ch, RATIO, D, INTERPRET)  # no score at RATIO 1
    else:
        x = tl.load(pooled_ptr + g64[:, None] * D + ch[None, :], mask=ok[:, None], other=0.0)
    return x


@triton.jit
def _sum_sq_chunk(sum_sq, kv_ptr, pooled_ptr, g64, ok, k0, half,
                  RATIO: tl.constexpr, D: tl.constexpr, INTERPRET: tl.constexpr):
    """sum_sq + the squares of chunk k0's (even, odd) channels, [G] fp32."""
    pe = _chunk_in(kv_ptr, pooled_ptr, g64, ok, k0 + 2 * half, RATIO, D, INTERPRET)
    po = _chunk_in(kv_ptr, pooled_ptr, g64, ok, k0 + 2 * half + 1, RATIO, D,
                   INTERPRET)
    return sum_sq + (tl.sum(pe * pe, 1) + tl.sum(po * po, 1))


@triton.jit
def _latent_chunk(key_e, key_o, kv_ptr, pooled_ptr, norm_w_ptr, wk_ptr, rot_ptr,
                  row_ptr, g64, ok, rs, k0, half, out, RATIO: tl.constexpr, D: tl.constexpr,
                  ROPE: tl.constexpr, BLOCK_G: tl.constexpr, BK: tl.constexpr,
                  INTERPRET: tl.constexpr):
    """Chunk k0 of the latent: normalised, accumulated into latent . wk^T (key_e, key_o),
    rotated, packed and stored. Returns the updated (key_e, key_o)."""
    ch = k0 + 2 * half
    pe = _chunk_in(kv_ptr, pooled_ptr, g64, ok, ch, RATIO, D, INTERPRET)
    po = _chunk_in(kv_ptr, pooled_ptr, g64, ok, ch + 1, RATIO, D, INTERPRET)
    we = tl.load(norm_w_ptr + ch).to(tl.float32)[None, :]
    wo = tl.load(norm_w_ptr + ch + 1).to(tl.float32)[None, :]
    le = to_bf16(we * (pe * rs), INTERPRET)  # the pre-RoPE latent, bf16 (fp32 when INTERPRET)
    lo = to_bf16(wo * (po * rs), INTERPRET)
    w_ptr = wk_ptr + (2 * out[None, :]) * D + ch[:, None]  # [BK/2, DI/2]: wk[2i, ch]^T
    w_ee = tl.load(w_ptr)
    w_eo = tl.load(w_ptr + 1)
    w_oe = tl.load(w_ptr + D)
    w_oo = tl.load(w_ptr + D + 1)
    if INTERPRET:  # its tl.dot misreads bf16 (see to_bf16); fp32 holds them exactly
        w_ee, w_eo = w_ee.to(tl.float32), w_eo.to(tl.float32)
        w_oe, w_oo = w_oe.to(tl.float32), w_oo.to(tl.float32)
    key_e = tl.dot(lo, w_eo, tl.dot(le, w_ee, key_e))
    key_o = tl.dot(lo, w_oo, tl.dot(le, w_oe, key_o))
    xe, xo = _rope(le.to(tl.float32), lo.to(tl.float32), rot_ptr, g64, ok, k0 // 2, BK // 2,
                   D // 2, ROPE, INTERPRET)
    packed, scales = _latent_fp4(xe, xo, BLOCK_G, BK // 16)
    tl.store(row_ptr + k0 // 2 + half[None, :], packed.to(tl.uint8), mask=ok[:, None])
    tl.store(row_ptr + D // 2 + k0 // 16 + tl.arange(0, BK // 16)[None, :],
             scales.to(tl.uint8), mask=ok[:, None])
    return key_e, key_o


@triton.jit
def _group_rows(page_ptr, slot_ptr, N, P, PAGE_ROWS, BLOCK_G: tl.constexpr):
    """This program's groups: (g64 [BLOCK_G] int64, ok: the group exists and its (page, slot)
    is inside the pools, dest: its int64 row of the pools)."""
    g = tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)
    g64 = g.to(tl.int64)
    page = tl.load(page_ptr + g64, mask=g < N, other=-1)
    slot = tl.load(slot_ptr + g64, mask=g < N, other=0)
    ok = (g < N) & (page >= 0) & (page < P) & (slot >= 0) & (slot < PAGE_ROWS)
    return g64, ok, page * PAGE_ROWS + slot


@triton.jit
def _latent_kernel(
        kv_ptr, pooled_ptr, norm_w_ptr, wk_ptr, rot_ptr, rows_ptr, part_ptr, page_ptr, slot_ptr,
        N, P, PAGE_ROWS, eps, RATIO: tl.constexpr, D: tl.constexpr, DI: tl.constexpr,
        ROPE: tl.constexpr, BLOCK_G: tl.constexpr, BK: tl.constexpr, UNROLL: tl.constexpr,
        INTERPRET: tl.constexpr):
    """Stage 2: channel chunk c = program_id(1) of BLOCK_G groups' latents. Every program sums
    the whole row's squares (all chunks, in chunk order: the same RMS bits in each), normalises
    its chunk (the bf16 latent), stores its RoPE'd fp4 packing in the rows pool and its part of
    the index key, latent_c . wk[:, c]^T in fp32, in part [N, D/BK, DI] (even key channels,
    then odd). kv: [N, RATIO, D] (read at RATIO 1 only); pooled: [N, D] fp32 from stage 1
    (RATIO > 1); norm_w: [D] bf16; wk: [DI, D] bf16; rot: [N, ROPE/2, 2] fp32; rows: [P,
    PAGE_ROWS, D/2 + D/16] uint8; page, slot: [N] int64. Grid (cdiv(N, BLOCK_G), D / BK).
    Groups outside the pools are neither loaded nor stored. UNROLL: the squares' loop unrolled
    (the same operations in the same order)."""
    g64, ok, dest = _group_rows(page_ptr, slot_ptr, N, P, PAGE_ROWS, BLOCK_G)
    half = tl.arange(0, BK // 2)  # pair numbers within a chunk
    sum_sq = tl.zeros([BLOCK_G], tl.float32)
    if UNROLL:
        for k0 in tl.static_range(0, D, BK):
            sum_sq = _sum_sq_chunk(sum_sq, kv_ptr, pooled_ptr, g64, ok, k0, half,
                                   RATIO, D, INTERPRET)
    else:
        for k0 in range(0, D, BK):
            sum_sq = _sum_sq_chunk(sum_sq, kv_ptr, pooled_ptr, g64, ok, k0, half,
                                   RATIO, D, INTERPRET)
    rs = rms_scale(sum_sq, eps, D)[:, None]

    c = tl.program_id(1)
    out = tl.arange(0, DI // 2)  # index-key pairs
    key_e = tl.zeros([BLOCK_G, DI // 2], tl.float32)
    key_o = tl.zeros([BLOCK_G, DI // 2], tl.float32)
    row_ptr = rows_ptr + dest[:, None] * (D // 2 + D // 16)
    key_e, key_o = _latent_chunk(key_e, key_o, kv_ptr, pooled_ptr, norm_w_ptr, wk_ptr,
                                 rot_ptr, row_ptr, g64, ok, rs, c * BK, half, out, RATIO, D,
                                 ROPE, BLOCK_G, BK, INTERPRET)
    part = part_ptr + (g64[:, None] * (D // BK) + c) * DI + out[None, :]
    tl.store(part, key_e, mask=ok[:, None])
    tl.store(part + DI // 2, key_o, mask=ok[:, None])


@triton.jit
def _key_kernel(part_ptr, k_norm_w_ptr, rot_ptr, keys_ptr, page_ptr, slot_ptr, N, P, PAGE_ROWS,
                eps, inv_fp4_max, DI: tl.constexpr, ROPE: tl.constexpr, CHUNKS: tl.constexpr,
                BLOCK_G: tl.constexpr, INTERPRET: tl.constexpr):
    """Stage 3: the index keys of BLOCK_G groups: the latent chunks' parts (part [N, CHUNKS,
    DI] fp32) added in chunk order, rounded to bf16 (linear's output), k_norm, RoPE, fp4 with
    ue8m0 scales, stored in keys [P, PAGE_ROWS, DI/2 + DI/32] uint8. Grid (cdiv(N, BLOCK_G),)."""
    g64, ok, dest = _group_rows(page_ptr, slot_ptr, N, P, PAGE_ROWS, BLOCK_G)
    out = tl.arange(0, DI // 2)
    part = part_ptr + g64[:, None] * (CHUNKS * DI) + out[None, :]
    key_e = tl.load(part, mask=ok[:, None], other=0.0)
    key_o = tl.load(part + DI // 2, mask=ok[:, None], other=0.0)
    for c in tl.static_range(1, CHUNKS):
        key_e += tl.load(part + c * DI, mask=ok[:, None], other=0.0)
        key_o += tl.load(part + c * DI + DI // 2, mask=ok[:, None], other=0.0)
    ke = round_bf16(key_e, INTERPRET)  # linear's bf16 output
    ko = round_bf16(key_o, INTERPRET)
    rk = rms_scale(tl.sum(ke * ke, 1) + tl.sum(ko * ko, 1), eps, DI)[:, None]
    ke = round_bf16(tl.load(k_norm_w_ptr + 2 * out).to(tl.float32)[None, :] * (ke * rk),
                    INTERPRET)
    ko = round_bf16(tl.load(k_norm_w_ptr + 2 * out + 1).to(tl.float32)[None, :] * (ko * rk),
                    INTERPRET)
    ke, ko = _rope(ke, ko, rot_ptr, g64, ok, 0, DI // 2, DI // 2, ROPE, INTERPRET)
    packed, scales = _index_fp4(ke, ko, inv_fp4_max, BLOCK_G, DI // 32)
    key_ptr = keys_ptr + dest[:, None] * (DI // 2 + DI // 32)
    tl.store(key_ptr + out[None, :], packed.to(tl.uint8), mask=ok[:, None])
    tl.store(key_ptr + DI // 2 + tl.arange(0, DI // 32)[None, :], scales.to(tl.uint8),
             mask=ok[:, None])


# ---- the r > 1 projections (wkv and wgate, fp32 weights) -------------------------------------
PROJECT_LANES = 128  # fp64 accumulator lanes: lane j sums the products at k = j (mod 128)
PROJECT_RANGE_K = 512  # K range per partial: the ranges' sums are added in order
PROJECT_SMALL_M = 16  # project_rows / torch float64 crossover of the step-sized mode when
# each call converts the weights: H200, V4.1-Flash's 2 x [512, 5120], CUDA graph, us for
# (project_rows, torch): 15 / 43 at T = 1, 22 / 58 at 8, 46 / 58 at 16, 156 / 64 at 64
# project_rows: the ranges' partials added by each tile's last program (the decode GEMMs'
# counter pattern) instead of a second launch (_dense_sum_kernel, 4.0-6.4 us of Full r=2's b = 1
# compressor branch on the H100 and H200 timelines): the same additions in the same order, so
# the same bits. Not yet run on a GPU: bench --part layers --roles "Full r=2" --decode 1x4096
# --variant base --variant ls:ops.compressor.triton.PROJECT_LAST_SUM=1
PROJECT_LAST_SUM = False
PROJECT_SMALL_M_PREPARED = 8  # the same crossover against one float64 GEMM on ProjectWeights:
# H200, 2 x [512, 5120], CUDA graph, us (project_rows, prepared): 16.0 / 17.9 at T = 1,
# 24.9 / 26.1 at 8, 57.6 / 26.1 at 12, 197.5 / 31.9 at 64, - / 65.3 at 256 (torch with its
# per-call conversions: 74.2 at 64, 116.4 at 256)


@triton.jit
def _halve(p, BM: tl.constexpr, BN: tl.constexpr, W: tl.constexpr):
    """[BM, BN, W] -> [BM, BN, W/2]: lane 2i + lane 2i+1 (an order fixed by the indices, not by
    the register layout)."""
    a, b = tl.split(tl.reshape(p, (BM, BN, W // 2, 2)))
    return a + b


@triton.jit
def _project_range(x_row, w_row, m_ok, n_ok, k_lo, K, BM: tl.constexpr, BN: tl.constexpr,
                   LANES: tl.constexpr, RANGE_K: tl.constexpr):
    """sum_k x[m, k] w[n, k] over k in [k_lo, k_lo + RANGE_K) as fp64 [BM, BN]: each product
    exact (bf16 x fp32 values), lane j = k mod LANES summed in K order, then the lanes
    pairwise (_halve)."""
    tl.static_assert(LANES == 128)
    offs_k = tl.arange(0, LANES)
    acc = tl.zeros([BM, BN, LANES], tl.float64)
    for k0 in tl.static_range(0, RANGE_K, LANES):
        k = k_lo + k0 + offs_k
        k_ok = k < K
        xv = tl.load(x_row + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        wv = tl.load(w_row + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += xv.to(tl.float32).to(tl.float64)[:, None, :] * wv.to(tl.float64)[None, :, :]
    s = _halve(_halve(_halve(acc, BM, BN, 128), BM, BN, 64), BM, BN, 32)
    s = _halve(_halve(_halve(s, BM, BN, 16), BM, BN, 8), BM, BN, 4)
    return tl.sum(_halve(s, BM, BN, 2), 2)  # one lane left: its sum is itself


@triton.jit
def _project_kernel(x_ptr, wkv_ptr, wgate_ptr, part_ptr, M, N, K, BM: tl.constexpr,
                    BN: tl.constexpr, LANES: tl.constexpr, RANGE_K: tl.constexpr,
                    out_ptr=None, cnt_ptr=None, RANGES: tl.constexpr = 0):
    """x: [M, K] bf16; wkv, wgate: [N, K] fp32, contiguous; part: [cdiv(K, RANGE_K), 2, M, N]
    fp64, range r's sums of kv (0) and score (1). Grid (2 * cdiv(N, BN), cdiv(M, BM), K
    ranges): axis 0 walks the N tiles of wkv, then of wgate. RANGES > 0 (= the K ranges): the
    tile's last program to finish (by its zeroed counter in cnt) adds the ranges' partials in
    range order, as _dense_sum_kernel does, and writes out [2, M, N] fp32 itself."""
    tiles = tl.cdiv(N, BN)
    pid = tl.program_id(0)
    which = (pid >= tiles).to(tl.int64)
    if pid < tiles:
        w_ptr = wkv_ptr
    else:
        w_ptr = wgate_ptr
    offs_n = (pid % tiles) * BN + tl.arange(0, BN)
    offs_m = tl.program_id(1) * BM + tl.arange(0, BM)
    m_ok = offs_m < M
    n_ok = offs_n < N
    r = tl.program_id(2)
    part = _project_range(x_ptr + offs_m.to(tl.int64)[:, None] * K,
                          w_ptr + offs_n.to(tl.int64)[:, None] * K, m_ok, n_ok, r * RANGE_K, K,
                          BM, BN, LANES, RANGE_K)
    mn = (which * M + offs_m.to(tl.int64)[:, None]) * N + offs_n[None, :]  # in a [2, M, N]
    mask = m_ok[:, None] & n_ok[None, :]
    if RANGES > 0:
        last, y = _last_range_sum(part_ptr, part, mn, mask, r, 2 * M * N,
                                  cnt_ptr + tl.program_id(1) * tl.num_programs(0) + pid, RANGES)
        if last:
            tl.store(out_ptr + mn, y.to(tl.float32), mask=mask)
    else:
        tl.store(part_ptr + r * (2 * M * N) + mn, part, mask=mask)


def _check_project(x, wkv, wgate) -> None:
    for name, t in (("x", x), ("wkv", wkv), ("wgate", wgate)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    require(x.dim() == 2 and x.dtype == torch.bfloat16,
            f"x must be [T, dim] bf16, got {tuple(x.shape)} {x.dtype}")
    require(wkv.dim() == 2 and wkv.dtype == torch.float32 and wkv.shape[1] == x.shape[1],
            f"wkv must be fp32 [D, dim={x.shape[1]}], got {tuple(wkv.shape)} {wkv.dtype}")
    require(wgate.shape == wkv.shape and wgate.dtype == torch.float32,
            f"wgate must be fp32 {tuple(wkv.shape)} like wkv, got {tuple(wgate.shape)} "
            f"{wgate.dtype}")
    check_device(x, wkv, wgate)


def project_rows(x: torch.Tensor, wkv: torch.Tensor, wgate: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.project`` for a few rows (decode) in two launches: x: [T, dim] bf16; wkv,
    wgate: [D, dim] fp32. Returns (kv, score) [T, D] fp32 each.

    Each output is its exact dot product summed in fp64 in an order fixed by the K width alone
    (per PROJECT_RANGE_K range: PROJECT_LANES lanes in K order, then pairwise; the ranges in
    order, in a second kernel) and rounded once to fp32: the same bits whatever T or the tile,
    and the reference's correctly rounded value unless the fp64 sum lands within about 2^-29
    of an fp32 rounding boundary. Its fp64 FMAs run on CUDA cores, so it beats torch's float64
    GEMM (and its float64 copies of the weights) only up to PROJECT_SMALL_M rows; the partials
    take ranges x 2 x T x D x 8 bytes. Raises ValueError on a bad dtype, shape or device."""
    _check_project(x, wkv, wgate)
    return _project_rows(x, wkv, wgate)


def _project_rows(x: torch.Tensor, wkv: torch.Tensor, wgate: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """project_rows on checked operands."""
    m, k = x.shape
    n = wkv.shape[0]
    out = torch.empty(2, m, n, dtype=torch.float32, device=x.device)  # kv, score
    if out.numel() == 0 or k == 0:
        return out[0].zero_(), out[1].zero_()
    ranges = cdiv(k, PROJECT_RANGE_K)
    bm, bn, warps = (next_pow2(m), 8, 4) if m <= 8 else (8, 8, 8)
    part = torch.empty(ranges, 2, m, n, dtype=torch.float64, device=x.device)
    grid = (2 * cdiv(n, bn), cdiv(m, bm), ranges)
    last_sum = {} if not PROJECT_LAST_SUM else dict(
        out_ptr=out, cnt_ptr=_tile_counters(x.device, grid[0] * grid[1]), RANGES=ranges)
    _project_kernel[grid](
        x.contiguous(), wkv.contiguous(), wgate.contiguous(), part, m, n, k, BM=bm, BN=bn,
        LANES=PROJECT_LANES, RANGE_K=PROJECT_RANGE_K, num_warps=warps, **last_sum)
    if last_sum:
        return out[0], out[1]
    block = 1024  # the ranges' partials added in range order, rounded once to fp32
    _dense_sum_kernel[(cdiv(out.numel(), block),)](
        part, out, out.numel(), ranges, FP64=True, BLOCK=block, INTERPRET=interpreting())
    return out[0], out[1]


@dataclass(eq=False)
class ProjectWeights:
    """wkv and wgate [D, dim] fp32 as one float64 [2 D, dim] tensor ``both`` (an exact copy),
    so that the step-sized mode's projections past a few rows run as one float64 GEMM without
    converting the weights on every call. Built once per layer by ``project_weights``; holds
    2 x 8 x D x dim bytes (42 MB at V4.1-Flash's D = 512, dim = 5120). It serves only the
    tensors it was built from, unchanged since (``serves``) or since ``prepare_project``
    refreshed it in place. ``reads``: the calls that read it (as ``WoACodes.reads``)."""

    wkv: torch.Tensor
    wgate: torch.Tensor
    both: torch.Tensor
    versions: tuple[int, int]
    reads: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes held beside the weights (the float64 copy)."""
        return self.both.numel() * self.both.element_size()

    def serves(self, wkv: torch.Tensor, wgate: torch.Tensor) -> bool:
        """True for the very tensors it copied, not written in place since (host check)."""
        return (wkv is self.wkv and wgate is self.wgate
                and (wkv._version, wgate._version) == self.versions)


def project_weights(wkv: torch.Tensor, wgate: torch.Tensor) -> ProjectWeights:
    """``ProjectWeights`` of a layer's r > 1 compressor weights (fp32 [D, dim], one device)."""
    for name, t in (("wkv", wkv), ("wgate", wgate)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    require(wkv.dim() == 2 and wkv.dtype == torch.float32,
            f"wkv must be fp32 [D, dim], got {tuple(wkv.shape)} {wkv.dtype}")
    require(wgate.shape == wkv.shape and wgate.dtype == torch.float32,
            f"wgate must be fp32 {tuple(wkv.shape)} like wkv, got {tuple(wgate.shape)} "
            f"{wgate.dtype}")
    require(wkv.device == wgate.device, f"wkv and wgate on one device, got {wkv.device} and "
            f"{wgate.device}")
    return ProjectWeights(wkv, wgate, torch.cat([wkv, wgate]).double(),
                          (wkv._version, wgate._version))


def prepare_project(wkv: torch.Tensor, wgate: torch.Tensor,
                    previous: ProjectWeights | None = None) -> dict:
    """The step-sized mode's extra arguments of ``project`` for one layer: its
    ``ProjectWeights`` (``ops.backends``: built when the layer is). ``previous``: the layer's
    copy so far; when it was made from these very tensors (since written in place), it is
    rewritten in place and returned, so that a decode graph that captured it reads the new
    values."""
    if isinstance(previous, ProjectWeights) and previous.serves(wkv, wgate):
        return {"prepared": previous}  # unchanged: nothing to rebuild
    if isinstance(previous, ProjectWeights) and previous.wkv is wkv and previous.wgate is wgate \
            and previous.both.shape == (wkv.shape[0] + wgate.shape[0], wkv.shape[1]):
        previous.both.copy_(torch.cat([wkv, wgate]))  # exact: fp32 -> float64
        previous.versions = (wkv._version, wgate._version)
        return {"prepared": previous}
    return {"prepared": project_weights(wkv, wgate)}


def project(x: torch.Tensor, wkv: torch.Tensor, wgate: torch.Tensor, *,
            fixed_order: bool = True, prepared: ProjectWeights | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.project`` on the triton backend: x: [T, dim] bf16; wkv, wgate: [D, dim]
    fp32 -> (kv, score) [T, D] fp32. ``fixed_order`` (the batch-invariant mode): dense_linear
    for both, one summation order at every T. False (the step-sized mode): ``project_rows``
    up to a few rows, a float64 GEMM above (each correctly rounded but for the rare fp64
    near-tie, so the two agree to the bit almost everywhere): one GEMM on ``prepared``'s
    float64 weights when it serves wkv and wgate (from PROJECT_SMALL_M_PREPARED rows),
    else ``reference.project`` (which converts the weights; from PROJECT_SMALL_M rows)."""
    _check_project(x, wkv, wgate)
    if fixed_order:
        return dense_linear(x, wkv), dense_linear(x, wgate)
    if prepared is not None and not isinstance(prepared, ProjectWeights):
        raise TypeError(f"prepared must be a ProjectWeights or None, got "
                        f"{type(prepared).__name__}")
    ready = prepared is not None and prepared.serves(wkv, wgate)
    if x.shape[0] <= (PROJECT_SMALL_M_PREPARED if ready else PROJECT_SMALL_M):
        return _project_rows(x, wkv, wgate)
    if not ready:
        return reference.project(x, wkv, wgate)
    m, d = x.shape[0], wkv.shape[0]
    prepared.reads += 1
    both = torch.mm(x.double(), prepared.both.t())  # [T, 2 D] float64
    out = torch.empty(2, m, d, dtype=torch.float32, device=x.device)
    out.copy_(both.view(m, 2, d).transpose(0, 1))  # rounded once to fp32, as the reference
    return out[0], out[1]


RECENT_BLOCK_D = 128  # channels per program of _recent_kernel


@triton.jit
def _recent_kernel(rkv_ptr, rsc_ptr, nkv_ptr, nsc_ptr, members_ptr, write_ptr, okv_ptr,
                   osc_ptr, N_RING, T, D, R: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    """Grid (T, cdiv(D, BLOCK_D)): token t's r members' kv and score channels (from the rings
    or this step's rows, ids clamped as reference.recent_group), then its own channels into
    the rings at write[t] (when >= 0). Rings [N_RING, D], new [T, D], out [T, R, D]: fp32,
    contiguous."""
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    j = tl.arange(0, BLOCK_R)
    j_ok = j < R
    m = tl.load(members_ptr + t * R + j, mask=j_ok, other=0)
    in_ring = m < N_RING
    ring_at = tl.minimum(m, N_RING - 1)
    new_at = tl.minimum(tl.maximum(m - N_RING, 0), T - 1)
    ok = j_ok[:, None] & d_ok[None, :]
    ring_off = ring_at[:, None] * D + offs_d[None, :]
    new_off = new_at[:, None] * D + offs_d[None, :]
    ring_rows = ok & in_ring[:, None]
    new_rows = ok & (m >= N_RING)[:, None]
    out_off = (t * R + j)[:, None] * D + offs_d[None, :]
    kv = tl.where(ring_rows, tl.load(rkv_ptr + ring_off, mask=ring_rows, other=0.0),
                  tl.load(nkv_ptr + new_off, mask=new_rows, other=0.0))
    sc = tl.where(ring_rows, tl.load(rsc_ptr + ring_off, mask=ring_rows, other=0.0),
                  tl.load(nsc_ptr + new_off, mask=new_rows, other=0.0))
    tl.store(okv_ptr + out_off, kv, mask=ok)
    tl.store(osc_ptr + out_off, sc, mask=ok)
    w = tl.load(write_ptr + t)
    if w >= 0:
        tl.store(rkv_ptr + w * D + offs_d, tl.load(nkv_ptr + t * D + offs_d, mask=d_ok),
                 mask=d_ok)
        tl.store(rsc_ptr + w * D + offs_d, tl.load(nsc_ptr + t * D + offs_d, mask=d_ok),
                 mask=d_ok)


def recent_gather_write(recent_kv: torch.Tensor, recent_score: torch.Tensor,
                        new_kv: torch.Tensor, new_score: torch.Tensor, members: torch.Tensor,
                        write: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.recent_gather_write`` in one launch (the same values: a copy). The rings'
    gathers and writes run side by side, hence the reference's condition that no write slot
    is a member slot; write slots past the rings are caller errors (not checked: a sync)."""
    tensors = {"recent_kv": recent_kv, "recent_score": recent_score, "new_kv": new_kv,
               "new_score": new_score, "members": members, "write": write}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    require(recent_kv.dim() == 3 and recent_kv.dtype == torch.float32
            and recent_kv.is_contiguous(),
            f"recent_kv must be a contiguous fp32 [B, r + R, D] ring, got "
            f"{recent_kv.dtype} {tuple(recent_kv.shape)}")
    require(recent_score.shape == recent_kv.shape and recent_score.dtype == torch.float32
            and recent_score.is_contiguous(),
            f"recent_score must be a contiguous fp32 {tuple(recent_kv.shape)} ring like "
            f"recent_kv, got {recent_score.dtype} {tuple(recent_score.shape)}")
    d = recent_kv.shape[2]
    require(members.dim() == 2 and members.dtype == torch.int64,
            f"members must be int64 [T, r], got {members.dtype} {tuple(members.shape)}")
    t, r = members.shape
    for name, new in (("new_kv", new_kv), ("new_score", new_score)):
        require(new.dtype == torch.float32 and tuple(new.shape) == (t, d),
                f"{name} must be fp32 [{t}, {d}] (T = members' rows, D = the rings'), got "
                f"{new.dtype} {tuple(new.shape)}")
    require(write.dtype == torch.int64 and tuple(write.shape) == (t,),
            f"write must be int64 [{t}], got {write.dtype} {tuple(write.shape)}")
    check_device(*tensors.values())
    kv = torch.empty(t, r, d, dtype=torch.float32, device=new_kv.device)
    score = torch.empty_like(kv)
    if t and r and d:
        _recent_kernel[(t, cdiv(d, RECENT_BLOCK_D))](
            recent_kv, recent_score, new_kv.contiguous(), new_score.contiguous(),
            members.contiguous(), write.contiguous(), kv, score,
            recent_kv.shape[0] * recent_kv.shape[1], t, d, R=r,
            BLOCK_R=next_pow2(r), BLOCK_D=RECENT_BLOCK_D, num_warps=2)
    return kv, score


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _check(kv, score, norm_weight, index_wk, index_k_norm, rot, rows_pool, keys_pool, page,
           slot) -> None:
    """Dtypes, shapes and devices of pool_norm_rope_pack's arguments (ValueError; TypeError
    for an argument that is not a tensor)."""
    tensors = {"kv": kv, "norm_weight": norm_weight, "index_wk": index_wk,
               "index_k_norm": index_k_norm, "rot": rot, "rows_pool": rows_pool,
               "keys_pool": keys_pool, "page": page, "slot": slot}
    if score is not None:
        tensors["score"] = score
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if kv.dim() != 3 or kv.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"kv must be [N, r, D] fp32 or bf16, got {tuple(kv.shape)} {kv.dtype}")
    n, r, d_lat = kv.shape
    if (score is None) != (r == 1):
        raise ValueError(f"score must be given iff r > 1; r = {r}, score is "
                         f"{'None' if score is None else 'given'}")
    if score is not None and (score.shape != kv.shape or score.dtype != torch.float32):
        raise ValueError(f"score must be fp32 {tuple(kv.shape)} like kv, got "
                         f"{tuple(score.shape)} {score.dtype}")
    if index_wk.dim() != 2 or index_wk.shape[1] != d_lat or index_wk.dtype != torch.bfloat16:
        raise ValueError(f"index_wk must be bf16 [d, D={d_lat}], got {tuple(index_wk.shape)} "
                         f"{index_wk.dtype}")
    d_idx = index_wk.shape[0]
    for name, t, size in (("norm_weight", norm_weight, d_lat), ("index_k_norm", index_k_norm, d_idx)):
        if tuple(t.shape) != (size,) or t.dtype != torch.bfloat16:
            raise ValueError(f"{name} must be bf16 [{size}], got {tuple(t.shape)} {t.dtype}")
    for name, size in (("D", d_lat), ("d", d_idx)):
        if not _is_pow2(size) or size < 32:
            raise ValueError(f"{name} = {size} must be a power of two >= 32")
    if rot.dim() != 2 or rot.shape[0] != n or rot.dtype != torch.complex64:
        raise ValueError(f"rot must be complex64 [N={n}, R/2], got {tuple(rot.shape)} {rot.dtype}")
    rope = 2 * rot.shape[1]
    if not 0 < rope <= min(d_lat, d_idx):
        raise ValueError(f"rope dims 2 * {rot.shape[1]} must be in 1..min(D, d) = "
                         f"{min(d_lat, d_idx)}")
    for name, pool, width in (("rows_pool", rows_pool, d_lat // 2 + d_lat // 16),
                              ("keys_pool", keys_pool, d_idx // 2 + d_idx // 32)):
        if pool.dim() != 3 or pool.shape[2] != width or pool.dtype != torch.uint8 \
                or not pool.is_contiguous():
            raise ValueError(f"{name} must be a contiguous uint8 [P, page_rows, {width}], got "
                             f"{tuple(pool.shape)} {pool.dtype}"
                             f"{'' if pool.is_contiguous() else ' (not contiguous)'}")
    if rows_pool.shape[:2] != keys_pool.shape[:2]:
        raise ValueError(f"rows_pool {tuple(rows_pool.shape)} and keys_pool "
                         f"{tuple(keys_pool.shape)} must share [P, page_rows]")
    for name, t in (("page", page), ("slot", slot)):
        if tuple(t.shape) != (n,) or t.dtype != torch.int64:
            raise ValueError(f"{name} must be int64 [N={n}], got {tuple(t.shape)} {t.dtype}")
    check_device(*tensors.values())


def pool_norm_rope_pack(kv: torch.Tensor, score: torch.Tensor | None, norm_weight: torch.Tensor,
                        index_wk: torch.Tensor, index_k_norm: torch.Tensor, eps: float,
                        rot: torch.Tensor, rows_pool: torch.Tensor, keys_pool: torch.Tensor,
                        page: torch.Tensor, slot: torch.Tensor) -> None:
    """The compressor's epilogue for N completed groups; see reference.pool_norm_rope_pack.
    r > 1: stage 1 pools into an [N, D] fp32 scratch, stage 2 does the rest; r = 1: stage 2.

    kv: [N, r, D] fp32 or bf16 (r = 1: the bf16 wkv row as [N, 1, D]); score: [N, r, D] fp32,
    None iff r == 1; norm_weight: [D] bf16; index_wk: [d, D] bf16; index_k_norm: [d] bf16;
    eps: float; rot: [N, R/2] complex64 (cos, sin at each group's first token); rows_pool:
    [P, page_rows, D/2 + D/16] uint8 and keys_pool: [P, page_rows, d/2 + d/32] uint8,
    contiguous, written in place at [page[i], slot[i]]; page, slot: [N] int64. Rows with
    page[i] < 0 are skipped; (page, slot) pairs of written rows must be distinct, page < P and
    0 <= slot < page_rows (out-of-range entries are not written). D and d: powers of two >= 32,
    R <= min(D, d). Finite inputs. Raises ValueError (TypeError for a non-tensor) before writing
    anything on a bad dtype, shape or device.
    """
    _check(kv, score, norm_weight, index_wk, index_k_norm, rot, rows_pool, keys_pool, page,
           slot)
    n, r, d_lat = kv.shape
    if n == 0 or rows_pool.shape[0] * rows_pool.shape[1] == 0:
        return
    rot_cs = cos_sin(rot)  # [N, R/2, 2] fp32 (cos, sin)
    kv, page, slot = kv.contiguous(), page.contiguous(), slot.contiguous()
    pooled = kv  # unused at r = 1
    # Unrolled stage-2 loops: the same bits, 38.8 vs 41.8 us at r = 2 (H200, one group); at r = 1
    # (kv read directly) the loop is faster, 36.3 vs 37.8 us.
    interp = interpreting()
    if r > 1:
        score = score.contiguous()
        pooled = torch.empty((n, d_lat), dtype=torch.float32, device=kv.device)
        block_c = min(POOL_BLOCK_C, d_lat)
        _pool_kernel[(cdiv(n, POOL_BLOCK_G), d_lat // block_c)](
            kv, score, pooled, page, slot, n, rows_pool.shape[0], rows_pool.shape[1],
            RATIO=r, D=d_lat, BLOCK_G=POOL_BLOCK_G, BLOCK_C=block_c, INTERPRET=interp,
            num_warps=4, enable_fp_fusion=False)  # as stage 2: no fused multiply-add
    bk = min(MAX_BK, d_lat)
    d_idx, chunks = index_wk.shape[0], d_lat // bk
    part = torch.empty((n, chunks, d_idx), dtype=torch.float32, device=kv.device)
    _latent_kernel[(cdiv(n, BLOCK_G), chunks)](
        kv, pooled, norm_weight.contiguous(), index_wk.contiguous(), rot_cs, rows_pool, part,
        page, slot, n, rows_pool.shape[0], rows_pool.shape[1], float(eps), RATIO=r, D=d_lat,
        DI=d_idx, ROPE=2 * rot.shape[1], BLOCK_G=BLOCK_G, BK=bk, UNROLL=r > 1,
        INTERPRET=interp, num_warps=4,
        enable_fp_fusion=False)  # the reference rounds every product before its sum
    _key_kernel[(cdiv(n, BLOCK_G),)](
        part, index_k_norm.contiguous(), rot_cs, keys_pool, page, slot, n, rows_pool.shape[0],
        rows_pool.shape[1], float(eps), _INV_FP4_MAX, DI=d_idx, ROPE=2 * rot.shape[1],
        CHUNKS=chunks, BLOCK_G=BLOCK_G, INTERPRET=interp, num_warps=4, enable_fp_fusion=False)
