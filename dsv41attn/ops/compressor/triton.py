"""Triton compressor epilogue (docs/numerics.md §5, step 3): the same numerics as
``reference.pool_norm_rope_pack``, from the wkv/wgate outputs to the packed paged rows.

Two launches at r > 1 (a fixed count, no host sync: CUDA-graph capturable), one at r = 1.
Stage 1 (``_pool_kernel``, r > 1 only) pools in parallel over (4 groups, 128 channels) tiles:
per-channel softmax over the r tokens, fp32, the reference's order, rounded to bf16 and kept as
fp32 in a [N, D] scratch buffer. Stage 2 (``_norm_rope_pack_kernel``) runs one program per
BLOCK_G groups. Channels are held as (even, odd) pairs, the RoPE pairs and the fp4 byte pairs
alike, and walked in chunks of BK: pass 1 sums the squares of bf16(pooled) for the RMS, pass 2
normalises (the latent), accumulates latent . index_wk^T in fp32 (bf16 tl.dot), rotates and
packs the latent chunk; both read stage 1's values (r = 1: the bf16 kv row). The index key
then gets its norm, RoPE and pack.

Stage 2 is the former one-kernel epilogue with its two pooling passes replaced by loads of the
same values, laid out as those loads were: the same chunks, tiles, warps and layouts (the RMS
sums reduce in the same blocked layout, the key norm in the same mma layout), so every output
byte is the same as the one-kernel version's (checked on an H200 for 1 to 2048 groups at r = 1
and 2). Before, each program pooled its groups' r tokens twice, chunk after chunk: 66 us a call
at r = 2 for one group as for 2048 (one latency-bound program per 16 groups); now 39-44 us.
What is left is stage 2's chunk chain (~36 us for one program, as at r = 1).

Rounding points follow the reference: correctly rounded division and sqrt (div_rn, sqrt_rn),
no fused multiply-add on the GPU (enable_fp_fusion=False: torch's CPU rounds every product
before its sum), bf16 round-to-nearest-even where the reference casts. fp4 e2m1 codes come from
compares on x / s, e4m3 and ue8m0 scales from the fp32 bits (bit-exact with packing.py). Not
bit-exact: exp (the softmax), the RMS sum order, torch's rsqrt (here 1 / sqrt) and the GEMM
order, each about an fp32 ulp before a bf16 cast. Under TRITON_INTERPRET the bf16 -> fp32 cast
is wrong on subnormal bf16 inputs (never seen in activations or weights).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.triton import (check_device, cos_sin, e4m3_code, e4m3_to_fp32, interpreting,
                             pow2_ceil_exponent, rms_scale, rope_rotate, round_bf16, to_bf16)

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
    g = tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)
    g64 = g.to(tl.int64)
    ok = _in_pools(page_ptr, slot_ptr, g64, g < N, P, PAGE_ROWS)
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    x = _pooled(kv_ptr, score_ptr, g64, ok, ch, RATIO, D, INTERPRET)
    tl.store(pooled_ptr + g64[:, None] * D + ch[None, :], x, mask=ok[:, None])


@triton.jit
def _in_pools(page_ptr, slot_ptr, g64, live, P, PAGE_ROWS):
    """Whether groups g64 (where live) have a (page, slot) inside the pools."""
    page = tl.load(page_ptr + g64, mask=live, other=-1)
    slot = tl.load(slot_ptr + g64, mask=live, other=0)
    return live & (page >= 0) & (page < P) & (slot >= 0) & (slot < PAGE_ROWS)


@triton.jit
def _chunk_in(kv_ptr, score_ptr, pooled_ptr, g64, ok, ch, RATIO: tl.constexpr, D: tl.constexpr,
              INTERPRET: tl.constexpr):
    """bf16(pooled) of channels ch [C] of groups g64, fp32 [G, C], rows ~ok 0: RATIO 1 the kv
    row (_pooled), else stage 1's values (the same bits, loaded the way _pooled loads)."""
    if RATIO == 1:
        x = _pooled(kv_ptr, score_ptr, g64, ok, ch, RATIO, D, INTERPRET)
    else:
        x = tl.load(pooled_ptr + g64[:, None] * D + ch[None, :], mask=ok[:, None], other=0.0)
    return x


@triton.jit
def _sum_sq_chunk(sum_sq, kv_ptr, score_ptr, pooled_ptr, g64, ok, k0, half,
                  RATIO: tl.constexpr, D: tl.constexpr, INTERPRET: tl.constexpr):
    """sum_sq + the squares of chunk k0's (even, odd) channels, [G] fp32."""
    pe = _chunk_in(kv_ptr, score_ptr, pooled_ptr, g64, ok, k0 + 2 * half, RATIO, D, INTERPRET)
    po = _chunk_in(kv_ptr, score_ptr, pooled_ptr, g64, ok, k0 + 2 * half + 1, RATIO, D,
                   INTERPRET)
    return sum_sq + (tl.sum(pe * pe, 1) + tl.sum(po * po, 1))


@triton.jit
def _latent_chunk(key_e, key_o, kv_ptr, score_ptr, pooled_ptr, norm_w_ptr, wk_ptr, rot_ptr,
                  row_ptr, g64, ok, rs, k0, half, out, RATIO: tl.constexpr, D: tl.constexpr,
                  ROPE: tl.constexpr, BLOCK_G: tl.constexpr, BK: tl.constexpr,
                  INTERPRET: tl.constexpr):
    """Chunk k0 of the latent: normalised, accumulated into latent . wk^T (key_e, key_o),
    rotated, packed and stored. Returns the updated (key_e, key_o)."""
    ch = k0 + 2 * half
    pe = _chunk_in(kv_ptr, score_ptr, pooled_ptr, g64, ok, ch, RATIO, D, INTERPRET)
    po = _chunk_in(kv_ptr, score_ptr, pooled_ptr, g64, ok, ch + 1, RATIO, D, INTERPRET)
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
def _norm_rope_pack_kernel(
        kv_ptr, score_ptr, pooled_ptr, norm_w_ptr, wk_ptr, k_norm_w_ptr, rot_ptr, rows_ptr,
        keys_ptr, page_ptr, slot_ptr, N, P, PAGE_ROWS, eps, inv_fp4_max,
        RATIO: tl.constexpr, D: tl.constexpr, DI: tl.constexpr, ROPE: tl.constexpr,
        BLOCK_G: tl.constexpr, BK: tl.constexpr, UNROLL: tl.constexpr,
        INTERPRET: tl.constexpr):
    """Stage 2. kv: [N, RATIO, D] fp32/bf16 (read at RATIO 1 only); score: unused; pooled:
    [N, D] fp32 from stage 1 (RATIO > 1; read for the groups written); norm_w: [D] bf16; wk:
    [DI, D] bf16; k_norm_w: [DI] bf16; rot: [N, ROPE/2, 2] fp32; rows: [P, PAGE_ROWS, D/2 +
    D/16] uint8; keys: [P, PAGE_ROWS, DI/2 + DI/32] uint8; page, slot: [N] int64. All
    contiguous. Grid (cdiv(N, BLOCK_G),). Groups whose (page, slot) is outside the pools are
    neither loaded nor stored. UNROLL: the chunk loops unrolled (the same operations in the
    same order, scheduled across chunks).
    """
    g = tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)
    g64 = g.to(tl.int64)
    page = tl.load(page_ptr + g64, mask=g < N, other=-1)
    slot = tl.load(slot_ptr + g64, mask=g < N, other=0)
    ok = (g < N) & (page >= 0) & (page < P) & (slot >= 0) & (slot < PAGE_ROWS)
    dest = page * PAGE_ROWS + slot  # int64 row of the pools
    half = tl.arange(0, BK // 2)  # pair numbers within a chunk

    sum_sq = tl.zeros([BLOCK_G], tl.float32)
    if UNROLL:
        for k0 in tl.static_range(0, D, BK):
            sum_sq = _sum_sq_chunk(sum_sq, kv_ptr, score_ptr, pooled_ptr, g64, ok, k0, half,
                                   RATIO, D, INTERPRET)
    else:
        for k0 in range(0, D, BK):
            sum_sq = _sum_sq_chunk(sum_sq, kv_ptr, score_ptr, pooled_ptr, g64, ok, k0, half,
                                   RATIO, D, INTERPRET)
    rs = rms_scale(sum_sq, eps, D)[:, None]

    out = tl.arange(0, DI // 2)  # index-key pairs
    key_e = tl.zeros([BLOCK_G, DI // 2], tl.float32)  # latent . wk^T, channels 2i and 2i+1
    key_o = tl.zeros([BLOCK_G, DI // 2], tl.float32)
    row_ptr = rows_ptr + dest[:, None] * (D // 2 + D // 16)
    if UNROLL:
        for k0 in tl.static_range(0, D, BK):
            key_e, key_o = _latent_chunk(key_e, key_o, kv_ptr, score_ptr, pooled_ptr,
                                         norm_w_ptr, wk_ptr, rot_ptr, row_ptr, g64, ok, rs, k0,
                                         half, out, RATIO, D, ROPE, BLOCK_G, BK, INTERPRET)
    else:
        for k0 in range(0, D, BK):
            key_e, key_o = _latent_chunk(key_e, key_o, kv_ptr, score_ptr, pooled_ptr,
                                         norm_w_ptr, wk_ptr, rot_ptr, row_ptr, g64, ok, rs, k0,
                                         half, out, RATIO, D, ROPE, BLOCK_G, BK, INTERPRET)

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
        _pool_kernel[(triton.cdiv(n, POOL_BLOCK_G), d_lat // block_c)](
            kv, score, pooled, page, slot, n, rows_pool.shape[0], rows_pool.shape[1],
            RATIO=r, D=d_lat, BLOCK_G=POOL_BLOCK_G, BLOCK_C=block_c, INTERPRET=interp,
            num_warps=4, enable_fp_fusion=False)  # as stage 2: no fused multiply-add
    _norm_rope_pack_kernel[(triton.cdiv(n, BLOCK_G),)](
        kv, kv, pooled, norm_weight.contiguous(), index_wk.contiguous(),
        index_k_norm.contiguous(), rot_cs, rows_pool, keys_pool, page, slot, n,
        rows_pool.shape[0], rows_pool.shape[1], float(eps), _INV_FP4_MAX,
        RATIO=r, D=d_lat, DI=index_wk.shape[0], ROPE=2 * rot.shape[1], BLOCK_G=BLOCK_G,
        BK=min(MAX_BK, d_lat), UNROLL=r > 1, INTERPRET=interp, num_warps=4,
        enable_fp_fusion=False)  # the reference rounds every product before its sum
