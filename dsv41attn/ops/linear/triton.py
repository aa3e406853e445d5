"""Triton linears (docs/numerics.md §2, §4): the fp8 linear, same numerics as reference.py and
quant.py, and the bf16 / fp32 linears with a fixed summation order.

act_quant: one program per (row, 16 blocks of 32); amax in fp32 floored at 1e-4, the ue8m0
scale built from exponent bits, x * (1/s) (exact: s is a power of two) clamped to +-448 and
rounded to e4m3 in software (ties to even, subnormals step 2^-9); the code byte is built from
the bits, so no fp8 cast is used (the interpreter's is not RNE). fp8_gemm: one program per
BLOCK_M x BLOCK_N tile walks K in blocks of 32: partial = a_fp8 . b_fp8 in fp32, scaled by the
row scale then the e8m0 column-block scale, accumulated in fp32 in K order (the reference's
rounding points; the GPU mma's internal 32-term sum may round differently: tolerance only;
see fp8_gemm's precise_dot). Under TRITON_INTERPRET the block sums are exact (fp64), so all is
bit-exact.

One summation order per weight, whatever the number of rows M (docs/numerics.md §9): a row's
output never depends on which other rows share its call (a batch, a chunk, a decode step).
K is cut into ``ranges`` contiguous ranges (``k_order``: chosen from N, K and the SM count
only, never from M), each summed in K order from -0, then added in range order. Small M runs
the ranges as separate programs (split-K, to fill the SMs: fp32 partials [S, M, N] that
_split_sum_kernel adds in range order); larger M has each tile's program sum its ranges one
after another with a second accumulator, the same fp32 operations in the same order. Decode
sizes (M <= SPLIT_MAX_M) run _fp8_decode_kernel, the same K walk with the operands swapped
(weight rows on the wgmma's 64-row side, 16 or 64 token rows on its narrow side, so 1-16 rows
no longer pay for a 64-row tile), and split whenever the tiles leave SMs idle (at <= 16 rows
the last program of a tile adds the partials in range order itself: no split-sum launch;
fp8_linear then also feeds it fp16 token values and takes its bf16 output; and the weight
tiles come through TMA descriptors, several K iterations in flight per program, wherever the
weight allows one: _tma_weight). Past 16 rows fp8_linear feeds the decode kernel bf16 token
values (the row scale inside each block dot); a large weight there, and 65-511 rows of a
smaller one whose square tiles would idle most SMs unsplit, run its wide TMA tiles
(_FP8_WIDE_TILES, _wide_swap). Larger M runs _fp8_gemm_kernel's MMA tiles, from
PRESCALE_MIN_M rows (fp8_linear) on bf16 values: x's codes times their power-of-two scales and
the weight's codes, so each block's dot comes out already scaled by the row scale, exactly,
and no fp8 tile is widened in registers; both read through TMA descriptors, and the tiles
write the bf16 output (with the query's RoPE) themselves wherever K's ranges are summed in
one program. Tile sizes and
operand roles change with M; the K walk, the mma instruction (wgmma: every tile has >= 64 rows
on its weight or token side) and every rounding do not (bit-identical on an H200 at every M
tried). One range keeps the reference's order (num_splits=1).

dense_linear: the same scheme for a bf16 weight (bf16 tl.dot, fp32 accumulator chained through
the K steps in order, bf16 out) and for an fp32 weight (each 32-wide K step one fp32 sum: on
bf16 x three bf16 tensor-core dots, the weight cut exactly into three bf16 parts; on other x
an fp32 FMA chain in K order; the steps summed in fp64, rounded once to fp32: within about an
fp32 ulp of the reference's correctly rounded product), optionally block-diagonal over groups
(the output projection's wo_a). On the triton backend it replaces torch's F.linear / einsum,
whose cuBLAS kernels are picked by shape, so that their last bits depend on M.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

try:  # Triton >= 3.4 (the decode kernel's TMA weight loads)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: plain loads
    TensorDescriptor = None

from .reference import check_rope
try:  # the Gluon square and swapped tiles (Hopper): a Triton with Gluon
    from . import gluon as _gluon  # (its settings read at each call: bench --variant flips them)
    from .gluon import (SWAP_BK, SWAP_BN, fp8_swap_gemm_ws, fp8_values_gemm_ws, swap_tile,
                        unsupported as _ws_unsupported)
except (ImportError, AttributeError):  # pragma: no cover - no usable Gluon
    _gluon = fp8_values_gemm_ws = fp8_swap_gemm_ws = None
from ..common.buffers import out_buffer
from ..common.triton import (E4M3_BF16_BITS_ASM, FP8_BLOCK, INV_FP8_MAX, any_nan, cdiv,
                             check_device, cos_sin, e4m3_code, e4m3_to_fp32, e8m0_to_fp32,
                             e8m0x4_to_fp32, interpreting, is_hopper, neg_zeros, next_pow2,
                             require, rms_norm_warps, rms_row_scale, rope_heads, rope_rotate,
                             round_bf16, sm_count, to_bf16, ue8m0_exponent)

QUANT_BLOCKS = 16  # act_quant: scale blocks per program (512 elements of a row)
QUANT_WIDE_MIN_M = 512  # from this many rows a program takes up to QUANT_BLOCKS_WIDE blocks
QUANT_BLOCKS_WIDE = 64  # (fewer, longer programs; one per row at K <= 2048: the RMSNorm'd
# rows' sum of squares read once, not once per 512 elements)
SPLIT_MAX_M = 64  # decode-sized M: narrow tiles, long K steps (weight-bandwidth bound)
SPLIT_PROGRAMS_PER_SM = 3  # K ranges: ~2 resident programs per SM at M = 1, plus slack
SPLIT_TRAFFIC_SHARE = 4  # split-K partials (written + read) <= 1/4 of the weight bytes,
# or for fp8 weights at most SPLIT_PARTIAL_BYTES (H200, fp8_linear on the five V4.1 fp8 weights
# together, e4m3 codes: M = 65 629 -> 240 us, 128: 797 -> 282, 256: 849 -> 497). 64 -> 96 MB
# (H100, act_quant + GEMM, the same bits): wkv's 40 ranges split on the square tiles up to
# 614 rows instead of 409, 448 / 511 rows 94.6 / 107.5 (the wide tiles, split) -> 53.0 /
# 59.7 us, 512 rows 62.9 -> 60.6; wq_a's 20 also at 328-384 rows, 384 rows 82.2 -> 72.4. Past
# 96 MB the split lost: wq_a at 512 / 768 rows 65.2 / 69.0 -> 86.8 / 121.7 us, wkv at 768 /
# 1024 65.4 / 68.2 -> 87.1 / 109.8 (256 MB)
SPLIT_PARTIAL_BYTES = 96 << 20
SPLIT_SUM_BLOCK = 256  # outputs per program of the split-sum kernel (2 warps, 16 B each)
# fp8_linear: bf16 values into _fp8_gemm_kernel from this many rows (H200, the five V4.1 fp8
# weights together: 1029 us against 1277 with e4m3 codes at M = 512, 653 against 497 at 256)
PRESCALE_MIN_M = 512
GEMM_GROUP = tl.constexpr(8)  # _fp8_gemm_kernel: row tiles per group of programs along N


@triton.jit
def _e4m3_value(code):
    """e4m3 bytes (int32 0..254, never NaN) -> their values in fp32, exactly, from the bits."""
    mag = code & 0x7F
    v = tl.where(mag >= 8, ((mag << 20) + (120 << 23)).to(tl.float32, bitcast=True),
                 mag.to(tl.float32) * 0.001953125)  # normal: 2^(e-7) (1 + m/8); else m 2^-9
    sign = (code & 0x80) << 24  # the sign bit set by bits: -0 kept (Triton's -v is 0 - v)
    return (v.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_to_bf16_kernel(w_ptr, s_ptr, out_ptr, NUMEL, K, KB, BLOCK: tl.constexpr,
                         FOLD: tl.constexpr):
    """w: NUMEL e4m3 bytes (uint8, rows of K); out: their values as bf16 (exact: 4 significant
    bits and exponents 2^-9 .. 2^8; NaN stays NaN). FOLD: times their 32 x 32 block's scale
    2^(e-127) (s: e8m0 bytes [cdiv(N, 32), KB]), exact where the product is a normal bf16
    (foldable_scales). Grid (cdiv(NUMEL, BLOCK),)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < NUMEL
    v = e4m3_to_fp32(tl.load(w_ptr + offs, mask=mask, other=0))
    if FOLD:
        row = offs // K
        e = tl.load(s_ptr + (row // 32) * KB + (offs - row * K) // 32, mask=mask, other=127)
        v = v * e8m0_to_fp32(e.to(tl.int32))
    tl.store(out_ptr + offs, v.to(tl.bfloat16), mask=mask)


def e4m3_to_bf16(weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """float8_e4m3fn -> bf16, the same values as torch's ``weight.to(torch.bfloat16)`` (every
    e4m3 value is a bf16 value) in one streaming pass: the square tiles' weight operand, made
    per call. torch's elementwise cast ran at ~31% of the copy bandwidth on an H100. scale
    (e8m0 [cdiv(N, 32), K / 32]): each value times its block's scale, the Gluon tiles' folded
    operand (exact for scales that pass foldable_scales)."""
    if weight.dtype != torch.float8_e4m3fn:
        raise TypeError(f"e4m3_to_bf16 wants float8_e4m3fn, got {weight.dtype}")
    check_device(weight)
    w = weight.contiguous()
    out = torch.empty(w.shape, dtype=torch.bfloat16, device=w.device)
    if w.numel():
        k = w.shape[-1]
        if scale is not None:
            check_device(weight, scale)
            want = (cdiv(w.numel() // k, FP8_BLOCK), cdiv(k, FP8_BLOCK))
            if w.dim() != 2 or tuple(scale.shape) != want:
                raise ValueError(f"scale {tuple(scale.shape)} does not match weight "
                                 f"{tuple(w.shape)}: {want} wanted")
        sb = scale.contiguous().view(torch.uint8) if scale is not None else w.view(torch.uint8)
        block = 8192
        _e4m3_to_bf16_kernel[(cdiv(w.numel(), block),)](
            w.view(torch.uint8), sb, out, w.numel(), k, cdiv(k, FP8_BLOCK), BLOCK=block,
            FOLD=scale is not None, num_warps=8)
    return out


# foldable_scales: e8m0 bytes whose 2^(e-127) the Gluon square tiles may fold into the weight's
# bf16 values. >= 2^-63: every nonzero e4m3 value times it is a normal bf16, and so is every
# nonzero product and block sum with act_quant's values (a block's sum is a multiple of its
# smallest product's unit, >= 2^-9 * 2^-9 * 2^-22 * 2^-63 = 2^-103). <= 1: no product or sum
# leaves fp32's range folded that does not unfolded (the reverse, an activation block whose
# unfolded sum overflows at |x| >= ~2^113, gives inf there and a finite sum folded).
FOLD_MIN_E, FOLD_MAX_E = 127 - 63, 127
# id(tensor) -> (weakref, _version, data_ptr, verdict): per question (foldable_scales,
# nan_free_codes), answered once while the tensor lives and is not written
_FOLDABLE: dict[int, tuple] = {}
_NAN_FREE: dict[int, tuple] = {}


def _weight_verdict(cache: dict, t: torch.Tensor, question) -> bool:
    """question(t) (a bool, a host sync), cached in ``cache`` while t lives, is not written in
    place and keeps its storage; during CUDA-graph capture an unasked tensor answers False
    (no sync may run: the caller takes its other path, which gives the same bits)."""
    key = id(t)
    hit = cache.get(key)
    if hit is not None and hit[0]() is t and hit[1] == t._version and hit[2] == t.data_ptr():
        return hit[3]
    if t.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False
    verdict = bool(question(t))
    for dead in [k for k, v in cache.items() if v[0]() is None]:
        del cache[dead]
    cache[key] = (weakref.ref(t), t._version, t.data_ptr(), verdict)
    return verdict


def foldable_scales(scale: torch.Tensor) -> bool:
    """Whether every e8m0 byte of ``scale`` is in FOLD_MIN_E..FOLD_MAX_E (2^-63 .. 1), so that
    folding it into the weight's bf16 values keeps the square tiles' bits. A host sync the
    first time a tensor is asked (then cached while the tensor lives and is not written);
    during CUDA-graph capture an unasked tensor answers False (the Triton tiles run: the
    same bits)."""
    def question(t):
        e = t.view(torch.uint8)
        return ((e >= FOLD_MIN_E) & (e <= FOLD_MAX_E)).all()
    return _weight_verdict(_FOLDABLE, scale, question)


def nan_free_codes(weight: torch.Tensor) -> bool:
    """Whether no e4m3 code of ``weight`` is a NaN (0x7f or 0xff), so that the decode tiles may
    turn its codes into bf16 by their bits (``gluon.SWAP_CODE_BITS``, ``VALUES_CODE_BITS``:
    common.triton's E4M3_BF16_BITS_ASM reads a NaN code as +-480). Cached and capture-safe
    as ``foldable_scales``."""
    return _weight_verdict(_NAN_FREE, weight,
                           lambda t: ((t.view(torch.uint8) & 0x7F) != 0x7F).all())


@triton.jit
def _quant_blocks(x, inv_max):
    """act_quant's rounding of 32-blocks: x [R, 32] fp32 (bf16 values) -> (their e4m3 codes
    [R, 32] as int32, the blocks' scales [R] fp32): s = 2^ceil(log2(max|x| / 448)) (ue8m0),
    codes = x / s rounded to e4m3. A block holding a NaN or an infinity gets a NaN scale (and
    NaN values), so that every output it feeds is NaN, as the reference's (its codes hold the
    NaN), never finite."""
    e = ue8m0_exponent(tl.max(tl.abs(x), 1), inv_max)
    s = (e << 23).to(tl.float32, bitcast=True)
    inv_s = ((254 - e) << 23).to(tl.float32, bitcast=True)  # 1/s, exact and normal
    code = e4m3_code(x * inv_s[:, None])  # x * (1/s) == x / s exactly
    return code, tl.where(any_nan(x, 1, INF=True), float("nan"), s)


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, nw_ptr, K, KB, inv_max, eps, QB: tl.constexpr,
                      F16: tl.constexpr = False, DEQUANT: tl.constexpr = False,
                      NORM_K: tl.constexpr = 0, NORM_BLOCK: tl.constexpr = 1,
                      INTERPRET: tl.constexpr = False):
    """x: [M, K] bf16; q: [M, K] uint8 (e4m3 bytes), or fp16 (F16: the codes' values, exact:
    the decode GEMM's fp16 token operand), or bf16 (DEQUANT: the codes' values times their
    scale, exact: the large-M GEMM's operand); s: [M, KB] fp32. NORM_K (= K): the rows are
    RMSNorm'd first (nw: [K] bf16 weight, eps; NORM_BLOCK = next_power_of_2(K)), as
    common.triton.rms_norm rounds them (its row sum, rms_row_scale, in a launch of
    rms_norm_warps(K) warps; compiled without FMA
    contraction, which changes none of the quantisation's exact steps). Grid (M, cdiv(KB,
    QB))."""
    row = tl.program_id(0).to(tl.int64)
    offs_b = tl.program_id(1) * QB + tl.arange(0, QB)  # scale blocks of this program
    b_mask = offs_b < KB
    offs_k = offs_b[:, None] * 32 + tl.arange(0, 32)[None, :]  # [QB, 32]
    offs = row * K + offs_k
    x = tl.load(x_ptr + offs, mask=b_mask[:, None], other=0.0).to(tl.float32)
    if NORM_K > 0:  # bf16(w * (x * r)), r from the whole row
        r = rms_row_scale(x_ptr, row, NORM_K, eps, NORM_BLOCK)
        nw = tl.load(nw_ptr + offs_k, mask=b_mask[:, None], other=0.0).to(tl.float32)
        x = round_bf16(nw * (x * r), INTERPRET)
    code, s = _quant_blocks(x, inv_max)
    if F16:
        tl.store(q_ptr + offs, _e4m3_value(code).to(tl.float16), mask=b_mask[:, None])
    elif DEQUANT:  # 4 significant bits times a power of two >= 2^-23: exact in bf16
        v = _e4m3_value(code) * s[:, None]
        tl.store(q_ptr + offs, to_bf16(v, INTERPRET).to(tl.bfloat16), mask=b_mask[:, None])
    else:
        tl.store(q_ptr + offs, code.to(tl.uint8), mask=b_mask[:, None])
    tl.store(s_ptr + row * KB + offs_b, s, mask=b_mask)


@triton.jit
def _next_range(nxt, r_end, r, total, acc, CHUNKS, RANGES, GRANULE: tl.constexpr):
    """ALL_RANGES' bookkeeping after a K iteration ending before step nxt: where range r ends
    there, its sum acc is added into total and range r + 1 starts from -0. Returns (total, acc,
    r, r_end)."""
    if nxt == r_end:
        total += acc
        acc = neg_zeros(acc.shape, tl.float32)
        r += 1
        r_end = (r + 1) * CHUNKS // RANGES * GRANULE
    return total, acc, r, r_end


@triton.jit
def _fp8_gemm_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, a_desc, b_desc, cs_ptr, M, N, K, KB,
                     CHUNKS, RANGES, GRANULE: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, KSUB: tl.constexpr, DOT_F16: tl.constexpr,
                     ALL_RANGES: tl.constexpr, PRESCALED: tl.constexpr,
                     INTERPRET: tl.constexpr, TMA: tl.constexpr = False,
                     OUT_BF16: tl.constexpr = False, ROPE_D: tl.constexpr = 0,
                     ROPE_R2: tl.constexpr = 0):
    """a: [M, K] e4m3; sa: [M, KB] fp32; b: [N, K] e4m3; sb: [cdiv(N, 32), KB] uint8 (e8m0
    bytes); c: [S, M, N] fp32 (S = 1: the output). All contiguous.
    PRESCALED: a holds the activations' values (codes times their power-of-two row scales,
    act_quant(dequant=True)) and b the weight's values, both bf16 (exact), and sa is not read:
    each 32-block's bf16 dot is then the e4m3 dot times the row scale, exactly (the same
    products scaled by one power of two, far from the subnormals: act_quant's scales are >=
    2^-23), so ``part * sb`` is the reference's ``part * sa * sb`` bit for bit (an H200's bf16
    wgmma sums them as its fp16 one: 0 differing outputs on the V4.1 shapes at M = 65-8192,
    wide-range data too), with no conversion of fp8 tiles in registers and one multiply fewer per element
    (H200, M = 4096, wq_b: 2317 -> 1574 us).
    K is CHUNKS = KB / GRANULE chunks of GRANULE 32-blocks cut into RANGES ranges: range r is
    chunks [r * CHUNKS // RANGES, (r + 1) * CHUNKS // RANGES), summed in K order from -0 (KSUB
    divides GRANULE, so no K step straddles two ranges). Grid (cdiv(M, BLOCK_M) * cdiv(N,
    BLOCK_N), S), the tiles taken GEMM_GROUP row tiles at a time along N (a group shares its
    weight tiles in L2): ALL_RANGES (S = 1) sums every range in turn and adds them in range
    order into a second accumulator; otherwise program z sums range z alone (S = RANGES
    partials for _split_sum_kernel, which adds them in the same order; S = RANGES = 1: all of K
    in order). INTERPRET (CPU only) sums each 32-block in fp64, exactly, then rounds once, as
    the reference.
    TMA (PRESCALED): the [BLOCK_M, 32] and [BLOCK_N, 32] bf16 tiles come through the tensor
    descriptors a_desc and b_desc (rows past M or N read as 0; a_ptr and b_ptr unused), bulk
    copies the loop's software pipeline issues num_stages - 1 iterations ahead, with no
    per-element addresses. OUT_BF16 (S = 1): c is the [M, N] bf16 output, the fp32 result
    rounded once (RNE, torch's cast), and ROPE_D > 0 then stores each head's RoPE'd tail as
    _fp8_decode_kernel does (_store_rope_out; cs_ptr [M, ROPE_R2, 2] fp32, else unused).
    """
    tl.static_assert(ROPE_D == 0 or (OUT_BF16 and BLOCK_N % 2 == 0 and ROPE_D % 2 == 0))
    tl.static_assert(PRESCALED or not TMA)
    tiles_m = tl.cdiv(M, BLOCK_M)
    width = GEMM_GROUP * tl.cdiv(N, BLOCK_N)  # programs per group of GEMM_GROUP row tiles
    pid = tl.program_id(0)
    first_m = pid // width * GEMM_GROUP
    rows = tl.minimum(tiles_m - first_m, GEMM_GROUP)
    pid_m = first_m + (pid % width) % rows
    pid_n = (pid % width) // rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    if ALL_RANGES:
        kb_lo = 0
        kb_hi = KB
        r = 0
        r_end = CHUNKS // RANGES * GRANULE  # where range 0 ends
        total = neg_zeros([BLOCK_M, BLOCK_N], tl.float32)
    else:
        kb_lo = split * CHUNKS // RANGES * GRANULE
        kb_hi = (split + 1) * CHUNKS // RANGES * GRANULE
    m_mask = offs_m < M
    n_mask = offs_n < N
    offs_m64 = offs_m.to(tl.int64)
    offs_n64 = offs_n.to(tl.int64)
    offs_k = kb_lo * 32 + tl.arange(0, 32)
    a_ptrs = a_ptr + offs_m64[:, None] * K + offs_k[None, :]  # [BLOCK_M, 32]
    b_ptrs = b_ptr + offs_n64[None, :] * K + offs_k[:, None]  # [32, BLOCK_N], K-major
    sa_ptrs = sa_ptr + offs_m64 * KB
    sb_ptrs = sb_ptr + (offs_n // 32) * KB
    acc = neg_zeros([BLOCK_M, BLOCK_N], tl.float32)  # -0 + p == p for every p, as copy_
    for kb0 in range(kb_lo, kb_hi, KSUB):  # consecutive 32-blocks, in K order
        for j in tl.static_range(KSUB):  # KSUB loads per row in flight: KSUB * 32 bytes of K
            if TMA:
                a = a_desc.load([pid_m * BLOCK_M, (kb0 + j) * 32])
                b = tl.trans(b_desc.load([pid_n * BLOCK_N, (kb0 + j) * 32]))
            else:
                a = tl.load(a_ptrs + j * 32, mask=m_mask[:, None], other=0.0)
                b = tl.load(b_ptrs + j * 32, mask=n_mask[None, :], other=0.0)
            if INTERPRET:
                a64 = a.to(tl.float32).to(tl.float64)  # its fp8 -> fp64 cast breaks on zeros
                b64 = b.to(tl.float32).to(tl.float64)
                part = tl.dot(a64, b64, out_dtype=tl.float64).to(tl.float32)  # numpy: RNE
            elif DOT_F16 and not PRESCALED:  # e4m3 -> fp16 is exact; fp16 mma: more precise
                part = tl.dot(a.to(tl.float16), b.to(tl.float16), out_dtype=tl.float32)
            else:  # e4m3 codes, or PRESCALED's bf16 values
                part = tl.dot(a, b, out_dtype=tl.float32)
            e = tl.load(sb_ptrs + kb0 + j, mask=n_mask, other=127).to(tl.int32)
            sb = e8m0_to_fp32(e)  # 2^(e-127); 0 -> 2^-127, 255 -> NaN
            if PRESCALED:  # part is already the block dot times the row scale
                acc += part * sb[None, :]
            else:
                sa = tl.load(sa_ptrs + kb0 + j, mask=m_mask, other=1.0)
                acc += part * sa[:, None] * sb[None, :]  # powers of two: exact, reference order
        a_ptrs += 32 * KSUB
        b_ptrs += 32 * KSUB
        if ALL_RANGES:
            total, acc, r, r_end = _next_range(kb0 + KSUB, r_end, r, total, acc, CHUNKS, RANGES,
                                               GRANULE)
    if ALL_RANGES:
        acc = total
    if _has_tail(pid_n * BLOCK_N, BLOCK_N, ROPE_D, ROPE_R2):  # the store of _fp8_decode_kernel
        mn = offs_m64[None, :] * N + offs_n64[:, None]  # [BLOCK_N, BLOCK_M]
        _store_rope_out(c_ptr + mn, tl.trans(acc), n_mask[:, None] & m_mask[None, :],
                        pid_n * BLOCK_N, offs_m, m_mask, cs_ptr, ROPE_D, ROPE_R2, INTERPRET)
    else:
        c_ptrs = c_ptr + split.to(tl.int64) * M * N + offs_m64[:, None] * N + offs_n64[None, :]
        _store_out(c_ptrs, acc, m_mask[:, None] & n_mask[None, :], OUT_BF16, INTERPRET)


_E4M3_BF16_ASM = tl.constexpr(E4M3_BF16_BITS_ASM)


@triton.jit
def _dot32(b, a, DOT_F16: tl.constexpr, INTERPRET: tl.constexpr, VALUES: tl.constexpr = False,
           CODE_BITS: tl.constexpr = False):
    """One 32-block's w . x^T: b [BLOCK_N, 32] e4m3 weight, a [BLOCK_M, 32] token rows (e4m3
    codes, their fp16 values, or VALUES: their bf16 values times the row scale): [BLOCK_N,
    BLOCK_M] fp32, rounded once (exact fp64 under the interpreter; wgmma on the GPU).
    CODE_BITS (VALUES, a weight without NaN codes): e4m3 -> bf16 by the codes' bits."""
    if INTERPRET:
        a64 = a.to(tl.float32).to(tl.float64)
        b64 = b.to(tl.float32).to(tl.float64)
        part = tl.dot(b64, tl.trans(a64), out_dtype=tl.float64).to(tl.float32)
    elif VALUES and CODE_BITS:  # exact but for NaN codes (none: the caller checked)
        w = tl.inline_asm_elementwise(_E4M3_BF16_ASM, "=r,h", [b.to(tl.uint8, bitcast=True)],
                                      dtype=tl.bfloat16, is_pure=True, pack=2)
        part = tl.dot(w, tl.trans(a), out_dtype=tl.float32)
    elif VALUES:  # e4m3 -> bf16 is exact
        part = tl.dot(b.to(tl.bfloat16), tl.trans(a), out_dtype=tl.float32)
    elif DOT_F16:  # e4m3 -> fp16 is exact (a no-op for fp16 token rows)
        part = tl.dot(b.to(tl.float16), tl.trans(a.to(tl.float16)), out_dtype=tl.float32)
    else:
        part = tl.dot(b, tl.trans(a), out_dtype=tl.float32)
    return part


@triton.jit
def _block_scales(sa_ptrs, sb_ptrs, kb, m_mask, n_mask, VALUES: tl.constexpr = False):
    """32-block kb's row scales [BLOCK_M] (fp32; VALUES: not read, a [1] placeholder) and
    weight scales [BLOCK_N] (e8m0 -> fp32)."""
    if VALUES:
        sa = tl.full([1], 1.0, tl.float32)
    else:
        sa = tl.load(sa_ptrs + kb, mask=m_mask, other=1.0)
    sb = e8m0_to_fp32(tl.load(sb_ptrs + kb, mask=n_mask, other=127).to(tl.int32))
    return sa, sb


@triton.jit
def _scaled(part, sa, sb, VALUES: tl.constexpr = False):
    """A block dot [BLOCK_N, BLOCK_M] times its row and weight scales, the reference's order
    (powers of two: exact); VALUES: the row scale is already in the dot."""
    if VALUES:
        return part * sb[:, None]
    else:
        return part * sa[None, :] * sb[:, None]


@triton.jit
def _tiles(ptrs, mask, KSUB: tl.constexpr):
    """The KSUB consecutive [rows, 32] tiles at ptrs, ptrs + 32, .. (masked rows 0), issued
    together; unused slots repeat the first (KSUB < 4): an iteration's weight tiles or token
    rows."""
    t0 = tl.load(ptrs, mask=mask, other=0.0)
    t1 = t0
    t2 = t0
    t3 = t0
    if KSUB > 1:
        t1 = tl.load(ptrs + 32, mask=mask, other=0.0)
    if KSUB > 2:
        t2 = tl.load(ptrs + 64, mask=mask, other=0.0)
        t3 = tl.load(ptrs + 96, mask=mask, other=0.0)
    return t0, t1, t2, t3


@triton.jit
def _desc_tiles(w_desc, n0, k0, KSUB: tl.constexpr):
    """_tiles through the tensor descriptor w_desc: rows n0.., K columns k0, k0 + 32, .. (rows
    past N read as 0); bulk copies into shared memory that the loop's software pipeline issues
    num_stages - 1 iterations ahead."""
    t0 = w_desc.load([n0, k0])
    t1 = t0
    t2 = t0
    t3 = t0
    if KSUB > 1:
        t1 = w_desc.load([n0, k0 + 32])
    if KSUB > 2:
        t2 = w_desc.load([n0, k0 + 64])
        t3 = w_desc.load([n0, k0 + 96])
    return t0, t1, t2, t3


@triton.jit
def _store_out(ptrs, y, mask, OUT_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """Store fp32 y, or y rounded to bf16 (RNE, as torch's cast) when OUT_BF16."""
    if OUT_BF16:
        tl.store(ptrs, to_bf16(y, INTERPRET).to(tl.bfloat16), mask=mask)
    else:
        tl.store(ptrs, y, mask=mask)


@triton.jit
def _has_tail(n0, BN: tl.constexpr, ROPE_D: tl.constexpr, ROPE_R2: tl.constexpr):
    """Whether output columns n0 .. n0 + BN - 1 hold a RoPE'd column (ROPE_D > 0): the last
    2 ROPE_R2 of a head of ROPE_D (a tile reaching past its first head's end holds that
    head's tail)."""
    if ROPE_D == 0:
        return False
    else:
        return n0 % ROPE_D + BN > ROPE_D - 2 * ROPE_R2


@triton.jit
def _store_rope_out(ptrs, y, mask, n0, offs_m, m_mask, cs_ptr, ROPE_D: tl.constexpr,
                    ROPE_R2: tl.constexpr, INTERPRET: tl.constexpr):
    """Store y [BLOCK_N, BLOCK_M] (columns n0.. of the output, one per row, tokens offs_m) as
    bf16 with each head's last 2 ROPE_R2 columns (heads of ROPE_D columns) turned by its
    token's rotation: cs [M, ROPE_R2, 2] fp32 (cos, sin). The rounding of rope_heads on the
    stored bf16 output: y rounded to bf16 first, then each pair through rope_rotate."""
    BN: tl.constexpr = y.shape[0]
    BM: tl.constexpr = y.shape[1]
    yb = round_bf16(y, INTERPRET)
    # the (even, odd) column pairs: adjacent rows of the tile (n0 is even, so is ROPE_D)
    even, odd = tl.split(tl.permute(tl.reshape(yb, (BN // 2, 2, BM)), (0, 2, 1)))
    col = n0 + 2 * tl.arange(0, BN // 2)  # [BN / 2]: each pair's even column
    pair = (col % ROPE_D - (ROPE_D - 2 * ROPE_R2)) // 2  # its pair in the head's tail (< 0: none)
    tail = (pair >= 0)[:, None] & m_mask[None, :]
    re, im = rope_rotate(even, odd, cs_ptr + offs_m.to(tl.int64)[None, :] * (2 * ROPE_R2),
                         tl.maximum(pair, 0)[:, None], tail, False, INTERPRET)
    out = tl.reshape(tl.permute(tl.join(tl.where(tail, re, even), tl.where(tail, im, odd)),
                                (0, 2, 1)), (BN, BM))
    tl.store(ptrs, out.to(tl.bfloat16), mask=mask)  # exact: bf16 values already


@triton.jit
def _last_range_sum(part_ptr, acc, mn, mask, split, plane, cnt, SPLITS: tl.constexpr):
    """Split-K in one launch: store this program's range partial acc (fp32, at mn within its
    range's plane of part, ranges ``plane`` elements apart) and bump the tile's counter cnt
    (int32, zero). Returns (last, y): whether this program finished last and, if it did, the
    partials added in range order (as _split_sum_kernel would; else y is acc), the counter then
    reset to 0 for the next launch."""
    tl.store(part_ptr + split.to(tl.int64) * plane + mn, acc, mask=mask)
    tl.debug_barrier()  # every thread's partial is stored before the counter moves
    last = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == SPLITS - 1
    y = acc
    if last:
        y = tl.load(part_ptr + mn, mask=mask, other=0.0, cache_modifier=".cg")
        for z in tl.static_range(1, SPLITS):  # range order
            y += tl.load(part_ptr + z * plane + mn, mask=mask, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")  # ready for the next launch
    return last, y


@triton.jit
def _diag_tokens(a_ptr, row0, M, K, k0, MP: tl.constexpr, G: tl.constexpr):
    """The token operand of G consecutive 32-blocks from column k0, laid block-diagonally for one
    tl.dot: [32 G, 16] (a_ptr's dtype), each column holding one token row's block (rows 32 g ..
    32 g + 31 of block g) and zeros elsewhere (and in unused columns, or rows past M). Column
    c = 8 j + 2 q + i (the wgmma accumulator's: q is the thread's lane in its quad, j and i its
    registers) holds slot s = 2 j + i of token row row0 + q + 4 (s // G), block s % G: so every
    block dot of a token row lands in the same thread (_diag_slots), for MP <= 8 rows and G <= 4
    // cdiv(MP, 4) blocks."""
    kk = tl.arange(0, 32 * G)
    c = tl.arange(0, 16)
    slot = (c // 8) * 2 + c % 2
    m = (c // 2) % 4 + 4 * (slot // G)
    row = row0 + m
    mask = ((kk // 32)[:, None] == (slot % G)[None, :]) & ((m < MP) & (row < M))[None, :]
    return tl.load(a_ptr + row.to(tl.int64)[None, :] * K + (k0 + kk)[:, None], mask=mask,
                   other=0.0)


@triton.jit
def _diag_slots(part):
    """The four slots of a block-diagonal dot [BLOCK_N, 16] (_diag_tokens' columns), each
    [BLOCK_N, 4] with the token rows' lane q as its column: part[:, 8 j + 2 q + i] is slot
    2 j + i. A split of the accumulator's own registers: no data leaves its thread."""
    bn: tl.constexpr = part.shape[0]
    p_i0, p_i1 = tl.split(tl.reshape(part, (bn, 2, 4, 2)))  # [BLOCK_N, j, q] each
    s0, s2 = tl.split(tl.permute(p_i0, (0, 2, 1)))
    s1, s3 = tl.split(tl.permute(p_i1, (0, 2, 1)))
    return s0, s1, s2, s3


@triton.jit
def _diag_scales(sb_ptr, sa0_ptrs, sa1_ptrs, kb0, kb_hi, KB, N, n0, mk0, mk1,
                 BLOCK_N: tl.constexpr, C: tl.constexpr, NH: tl.constexpr,
                 SB_WORDS: tl.constexpr, INTERPRET: tl.constexpr):
    """The block scales of the C 32-blocks from kb0 (those past kb_hi masked) for DIAG's tiles:
    the weight's [BLOCK_N, C] (e8m0 -> fp32) of rows n0.., loaded as the tile's [BLOCK_N / 32,
    C] (few enough for Triton to load them in the layout that uses them: no shared-memory round
    trip; SB_WORDS: C = 4 and the bytes 4-aligned, each group's four as one word, decoded by
    e8m0x4_to_fp32), and the token rows' [4, C] of each lane's first and (NH = 2) second row."""
    kbs = kb0 + tl.arange(0, C)
    k_mask = kbs < kb_hi
    grp = n0 // 32 + tl.arange(0, BLOCK_N // 32)
    if SB_WORDS:
        tl.static_assert(C == 4)
        words = tl.load((sb_ptr + grp * KB + kb0).to(tl.pointer_type(tl.int32)),
                        mask=(grp * 32 < N) & (grp * 0 + kb0 < kb_hi), other=0x7F7F7F7F)
        s0, s1, s2, s3 = e8m0x4_to_fp32(words, INTERPRET)
        sbg = tl.reshape(tl.join(tl.join(s0, s2), tl.join(s1, s3)), (BLOCK_N // 32, 4))
    else:
        sbg = tl.load(sb_ptr + grp[:, None] * KB + kbs[None, :],
                      mask=(grp * 32 < N)[:, None] & k_mask[None, :], other=127)
        sbg = e8m0_to_fp32(sbg.to(tl.int32))
    sb = tl.reshape(tl.broadcast_to(sbg[:, None, :], (BLOCK_N // 32, 32, C)), (BLOCK_N, C))
    sa0 = tl.load(sa0_ptrs[:, None] + kbs[None, :], mask=mk0[:, None] & k_mask[None, :],
                  other=1.0)
    sa1 = sa0
    if NH > 1:
        sa1 = tl.load(sa1_ptrs[:, None] + kbs[None, :], mask=mk1[:, None] & k_mask[None, :],
                      other=1.0)
    return sb, sa0, sa1


@triton.jit
def _col4(t, IDX: tl.constexpr):
    """Column IDX of t [R, 4], by splits."""
    even, odd = tl.split(tl.reshape(t, (t.shape[0], 2, 2)))  # columns 0, 2 and 1, 3
    if IDX % 2 == 0:
        lo, hi = tl.split(even)
    else:
        lo, hi = tl.split(odd)
    if IDX // 2 == 0:
        return lo
    else:
        return hi


@triton.jit
def _col(t, IDX: tl.constexpr):
    """Column IDX of t [R, C] (C = 1, 2, 4 or 8), by splits (a register pick where C is in
    each thread)."""
    R: tl.constexpr = t.shape[0]
    C: tl.constexpr = t.shape[1]
    if C == 1:
        return tl.reshape(t, (R,))
    elif C == 2:
        c0, c1 = tl.split(t)
        if IDX == 0:
            return c0
        else:
            return c1
    elif C == 4:
        return _col4(t, IDX)
    else:
        even, odd = tl.split(tl.reshape(t, (R, 4, 2)))  # columns 0, 2, 4, 6 and 1, 3, 5, 7
        if IDX % 2 == 0:
            return _col4(even, IDX // 2)
        else:
            return _col4(odd, IDX // 2)


@triton.jit
def _fp8_decode_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, out_ptr, cnt_ptr, w_desc, cs_ptr, M,
                       N, K, KB, CHUNKS, RANGES, GRANULE: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, KSUB: tl.constexpr, DOT_F16: tl.constexpr,
                       ALL_RANGES: tl.constexpr, PARTIALS: tl.constexpr,
                       SPLITS: tl.constexpr, PREFETCH: tl.constexpr, TMA: tl.constexpr,
                       OUT_BF16: tl.constexpr, INTERPRET: tl.constexpr,
                       VALUES: tl.constexpr = False, ROPE_D: tl.constexpr = 0,
                       ROPE_R2: tl.constexpr = 0, DIAG: tl.constexpr = 0,
                       SB_WORDS: tl.constexpr = False, CODE_BITS: tl.constexpr = False):
    """_fp8_gemm_kernel for decode-sized M with the operands swapped: each 32-block's tl.dot is
    w [BLOCK_N, 32] . x^T [32, BLOCK_M] (weight rows on the MMA's 64-row side, the few token
    rows its narrow side), so a BLOCK_N x BLOCK_M tile of y^T per program; every output element
    gets the same fp32 operations in the same order as in _fp8_gemm_kernel (the block dot, times
    the row scale, times the column-block scale, added into the range's accumulator from -0 in
    K order, the ranges added in order). a: [M, K] e4m3 codes, or their fp16 values (exact;
    then no per-block widening and shared-memory round trip of the token rows); the other
    operands as _fp8_gemm_kernel's; out: [M, N] fp32, or bf16 (OUT_BF16). Grid (cdiv(N,
    BLOCK_N), S, cdiv(M, BLOCK_M)): program (n, z, m) sums range z (S = SPLITS = RANGES), or
    every range in turn (ALL_RANGES, S = 1). PARTIALS: each program writes its range's fp32
    partial into c [S, M, N] for _split_sum_kernel; SPLITS (= S > 1) also, then bumps the
    tile's counter in cnt (int32, zero): the one that finds SPLITS - 1 (the last to finish)
    adds the partials in range order, as _split_sum_kernel would, writes out and resets the
    counter to 0 (one launch, not two; 16-row tiles: a 64-row tile's sum would spill). PREFETCH
    (16-row tiles) loads the block scales one K iteration ahead, off the dot's critical path,
    and issues the iteration's KSUB weight tiles and token rows together before its dots, then
    adds the dots in K order (64-row tiles load scales and tiles in each block's step: their
    [64] row scales, twice over, would spill). TMA (with PREFETCH): the weight tiles come
    through w_desc, a tensor descriptor of b with [BLOCK_N, 32] boxes (else w_desc is unused),
    so the loop's software pipeline keeps num_stages - 1 iterations of weight bytes in flight
    per program instead of one. VALUES: a holds act_quant's bf16 values (codes times their
    power-of-two row scales, exact) and sa is not read: each block dot of the weight's values
    (e4m3 -> bf16, exact) comes out times the row scale, exactly, as in _fp8_gemm_kernel's
    PRESCALED, so no row scales live in registers (what lets tiles past 16 token rows hold
    without spilling). Tiles past 16 token rows add each block dot as soon as it is made (four
    live [BLOCK_N, BLOCK_M] dots would spill). Bit-identical to _fp8_gemm_kernel at every M, on
    an H200 too (the same wgmma instruction, f16, bf16 or e4m3 operands; only its 64-row side
    now holds the weight). ROPE_D > 0 (OUT_BF16, the kernel writing out itself): the output
    is stored with the query's RoPE applied (_store_rope_out; cs_ptr [M, ROPE_R2, 2] fp32,
    else unused), the bits of rope_heads on the stored output. DIAG > 0 (TMA, not VALUES;
    BLOCK_M a power of two <= 8, DIAG * cdiv(BLOCK_M, 4) <= 4, DIAG dividing KSUB; w_desc's
    boxes [BLOCK_N, 32 DIAG]): each iteration's KSUB blocks (up to 8) as KSUB / DIAG dots of
    DIAG blocks, each against the token rows laid block-diagonally (_diag_tokens) so that each
    thread's accumulator registers hold every block dot of its lane's token rows (_diag_slots):
    those are scaled and added in K order as above into [BLOCK_N, 4] accumulators (one per 4
    token rows) without leaving the thread. The next iteration's block scales are loaded an
    iteration ahead, the weight's as the tile's [BLOCK_N / 32, KSUB] bytes (loaded where they
    are used: no shared-memory round trip; SB_WORDS: a word a 32-row group, KSUB = 4). One
    wgmma wait per DIAG blocks. CODE_BITS (VALUES, on a GPU, a weight without NaN codes): the
    weight's codes become bf16 by their bits (_dot32), not by the conversion units."""
    tl.static_assert(ROPE_D == 0 or (OUT_BF16 and BLOCK_N % 2 == 0 and ROPE_D % 2 == 0))
    tl.static_assert(KSUB == 1 or KSUB == 2 or KSUB == 4 or DIAG > 0)  # DIAG: up to 8
    tl.static_assert(PREFETCH or not TMA)
    tl.static_assert(DIAG == 0 or (TMA and not VALUES and BLOCK_M <= 8
                                   and DIAG * ((BLOCK_M + 3) // 4) <= 4 and KSUB % DIAG == 0))
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if ALL_RANGES:
        kb_lo = 0
        kb_hi = KB
        r = 0
        r_end = CHUNKS // RANGES * GRANULE  # where range 0 ends
        total = neg_zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        kb_lo = split * CHUNKS // RANGES * GRANULE
        kb_hi = (split + 1) * CHUNKS // RANGES * GRANULE
    m_mask = offs_m < M
    n_mask = offs_n < N
    offs_m64 = offs_m.to(tl.int64)
    offs_n64 = offs_n.to(tl.int64)
    offs_k = kb_lo * 32 + tl.arange(0, 32)
    a_ptrs = a_ptr + offs_m64[:, None] * K + offs_k[None, :]  # [BLOCK_M, 32]
    b_ptrs = b_ptr + offs_n64[:, None] * K + offs_k[None, :]  # [BLOCK_N, 32]: 32 bytes a row
    sa_ptrs = sa_ptr + offs_m64 * KB
    sb_ptrs = sb_ptr + (offs_n // 32) * KB
    acc = neg_zeros([BLOCK_N, BLOCK_M], tl.float32)
    if DIAG > 0:  # DIAG block dots at a time in one tl.dot, each token row's in one thread
        NH: tl.constexpr = (BLOCK_M + 3) // 4  # token rows a lane holds: 1 or 2
        q4 = tl.arange(0, 4)
        rows0 = pid_m * BLOCK_M + q4  # the lanes' token rows (and those 4 further: NH = 2)
        mk0 = (q4 < BLOCK_M) & (rows0 < M)
        mk1 = (q4 + 4 < BLOCK_M) & (rows0 + 4 < M)
        sa0_ptrs = sa_ptr + rows0.to(tl.int64) * KB
        sa1_ptrs = sa0_ptrs + 4 * KB
        acc0 = neg_zeros([BLOCK_N, 4], tl.float32)
        acc1 = acc0
        total0 = acc0
        total1 = acc0
        # each iteration's block scales, loaded an iteration ahead: [BLOCK_N, KSUB] weight,
        # [4, KSUB] token rows
        sbk, sak0, sak1 = _diag_scales(sb_ptr, sa0_ptrs, sa1_ptrs, kb_lo, kb_hi, KB, N,
                                       pid_n * BLOCK_N, mk0, mk1, BLOCK_N, KSUB, NH, SB_WORDS,
                                       INTERPRET)
        for kb0 in range(kb_lo, kb_hi, KSUB):  # KSUB / DIAG dots of DIAG blocks an iteration
            nxt = kb0 + KSUB
            n_sbk, n_sak0, n_sak1 = _diag_scales(sb_ptr, sa0_ptrs, sa1_ptrs, nxt, kb_hi, KB, N,
                                                 pid_n * BLOCK_N, mk0, mk1, BLOCK_N, KSUB, NH,
                                                 SB_WORDS, INTERPRET)
            for d in tl.static_range(0, KSUB, DIAG):
                w = w_desc.load([pid_n * BLOCK_N, (kb0 + d) * 32])  # [BLOCK_N, 32 DIAG]
                xt = _diag_tokens(a_ptr, pid_m * BLOCK_M, M, K, (kb0 + d) * 32, BLOCK_M, DIAG)
                if INTERPRET:  # each column's one nonzero block summed exactly, as _dot32's
                    part = tl.dot(w.to(tl.float32).to(tl.float64),
                                  xt.to(tl.float32).to(tl.float64),
                                  out_dtype=tl.float64).to(tl.float32)
                else:
                    part = tl.dot(w.to(tl.float16), xt.to(tl.float16), out_dtype=tl.float32)
                slots = _diag_slots(part)
                for g in tl.static_range(DIAG):
                    sb = _col(sbk, d + g)
                    acc0 = acc0 + _scaled(slots[g], _col(sak0, d + g), sb)
                    if NH > 1:
                        acc1 = acc1 + _scaled(slots[DIAG + g], _col(sak1, d + g), sb)
            sbk = n_sbk
            sak0 = n_sak0
            sak1 = n_sak1
            if ALL_RANGES:  # both accumulators at the same range end
                total1, acc1, _, _ = _next_range(nxt, r_end, r, total1, acc1, CHUNKS, RANGES,
                                                 GRANULE)
                total0, acc0, r, r_end = _next_range(nxt, r_end, r, total0, acc0, CHUNKS,
                                                     RANGES, GRANULE)
        if ALL_RANGES:
            acc0 = total0
            acc1 = total1
        if NH > 1:  # token rows 4 h + q
            acc = tl.reshape(tl.permute(tl.join(acc0, acc1), (0, 2, 1)), (BLOCK_N, 8))
            cols = tl.arange(0, 8)
        else:
            acc = acc0
            cols = q4
        offs_m = pid_m * BLOCK_M + cols
        m_mask = (cols < BLOCK_M) & (offs_m < M)
        offs_m64 = offs_m.to(tl.int64)
    elif PREFETCH:
        sa0, sb0 = _block_scales(sa_ptrs, sb_ptrs, kb_lo, m_mask, n_mask, VALUES)
        sa1 = sa0
        sb1 = sb0
        sa2 = sa0
        sb2 = sb0
        sa3 = sa0
        sb3 = sb0
        if KSUB > 1:
            sa1, sb1 = _block_scales(sa_ptrs, sb_ptrs, kb_lo + 1, m_mask, n_mask, VALUES)
        if KSUB > 2:
            sa2, sb2 = _block_scales(sa_ptrs, sb_ptrs, kb_lo + 2, m_mask, n_mask, VALUES)
            sa3, sb3 = _block_scales(sa_ptrs, sb_ptrs, kb_lo + 3, m_mask, n_mask, VALUES)
        for kb0 in range(kb_lo, kb_hi, KSUB):  # KSUB consecutive 32-blocks, in K order
            nxt = kb0 + KSUB  # the next iteration's scales, loaded now (masked past the end)
            more_m = m_mask & (tl.zeros([BLOCK_M], tl.int32) + nxt < kb_hi)
            more_n = n_mask & (tl.zeros([BLOCK_N], tl.int32) + nxt < kb_hi)
            # this iteration's weight tiles and token rows
            if TMA:
                w0, w1, w2, w3 = _desc_tiles(w_desc, pid_n * BLOCK_N, kb0 * 32, KSUB)
            else:
                w0, w1, w2, w3 = _tiles(b_ptrs, n_mask[:, None], KSUB)
            x0, x1, x2, x3 = _tiles(a_ptrs, m_mask[:, None], KSUB)
            na0, nb0 = _block_scales(sa_ptrs, sb_ptrs, nxt, more_m, more_n, VALUES)
            na1 = na0
            nb1 = nb0
            na2 = na0
            nb2 = nb0
            na3 = na0
            nb3 = nb0
            if KSUB > 1:
                na1, nb1 = _block_scales(sa_ptrs, sb_ptrs, nxt + 1, more_m, more_n,
                                           VALUES)
            if KSUB > 2:
                na2, nb2 = _block_scales(sa_ptrs, sb_ptrs, nxt + 2, more_m, more_n,
                                           VALUES)
                na3, nb3 = _block_scales(sa_ptrs, sb_ptrs, nxt + 3, more_m, more_n,
                                           VALUES)
            if BLOCK_M <= 16:  # the block dots, then each added in K order
                p0 = _dot32(w0, x0, DOT_F16, INTERPRET, VALUES, CODE_BITS)
                p1 = p0
                p2 = p0
                p3 = p0
                if KSUB > 1:
                    p1 = _dot32(w1, x1, DOT_F16, INTERPRET, VALUES, CODE_BITS)
                if KSUB > 2:
                    p2 = _dot32(w2, x2, DOT_F16, INTERPRET, VALUES, CODE_BITS)
                    p3 = _dot32(w3, x3, DOT_F16, INTERPRET, VALUES, CODE_BITS)
                acc = acc + _scaled(p0, sa0, sb0, VALUES)
                if KSUB > 1:
                    acc = acc + _scaled(p1, sa1, sb1, VALUES)
                if KSUB > 2:
                    acc = acc + _scaled(p2, sa2, sb2, VALUES)
                    acc = acc + _scaled(p3, sa3, sb3, VALUES)
            else:  # wider tiles: one block dot live at a time (four would spill)
                acc = acc + _scaled(_dot32(w0, x0, DOT_F16, INTERPRET, VALUES, CODE_BITS),
                                        sa0, sb0, VALUES)
                if KSUB > 1:
                    acc = acc + _scaled(_dot32(w1, x1, DOT_F16, INTERPRET, VALUES, CODE_BITS),
                                        sa1, sb1, VALUES)
                if KSUB > 2:
                    acc = acc + _scaled(_dot32(w2, x2, DOT_F16, INTERPRET, VALUES, CODE_BITS),
                                        sa2, sb2, VALUES)
                    acc = acc + _scaled(_dot32(w3, x3, DOT_F16, INTERPRET, VALUES, CODE_BITS),
                                        sa3, sb3, VALUES)
            sa0 = na0
            sb0 = nb0
            sa1 = na1
            sb1 = nb1
            sa2 = na2
            sb2 = nb2
            sa3 = na3
            sb3 = nb3
            a_ptrs += 32 * KSUB
            b_ptrs += 32 * KSUB
            if ALL_RANGES:
                total, acc, r, r_end = _next_range(nxt, r_end, r, total, acc, CHUNKS, RANGES,
                                                   GRANULE)
    else:  # the scales of each block in its step, as _fp8_gemm_kernel
        for kb0 in range(kb_lo, kb_hi, KSUB):
            nxt = kb0 + KSUB
            for j in tl.static_range(KSUB):  # the scales after the dot (fewer live registers)
                b = tl.load(b_ptrs + j * 32, mask=n_mask[:, None], other=0.0)
                a = tl.load(a_ptrs + j * 32, mask=m_mask[:, None], other=0.0)
                part = _dot32(b, a, DOT_F16, INTERPRET, VALUES, CODE_BITS)
                sa, sb = _block_scales(sa_ptrs, sb_ptrs, kb0 + j, m_mask, n_mask, VALUES)
                acc += _scaled(part, sa, sb, VALUES)
            a_ptrs += 32 * KSUB
            b_ptrs += 32 * KSUB
            if ALL_RANGES:
                total, acc, r, r_end = _next_range(nxt, r_end, r, total, acc, CHUNKS, RANGES,
                                                   GRANULE)
    if ALL_RANGES and DIAG == 0:
        acc = total
    mn = offs_m64[None, :] * N + offs_n64[:, None]  # [BLOCK_N, BLOCK_M], N contiguous
    mask = n_mask[:, None] & m_mask[None, :]
    if SPLITS > 1:
        last, y = _last_range_sum(c_ptr, acc, mn, mask, split, M * N,
                                  cnt_ptr + pid_m * tl.num_programs(0) + pid_n, SPLITS)
        if last:
            if _has_tail(pid_n * BLOCK_N, BLOCK_N, ROPE_D, ROPE_R2):
                _store_rope_out(out_ptr + mn, y, mask, pid_n * BLOCK_N, offs_m, m_mask, cs_ptr,
                                ROPE_D, ROPE_R2, INTERPRET)
            else:
                _store_out(out_ptr + mn, y, mask, OUT_BF16, INTERPRET)
    elif PARTIALS:
        tl.store(c_ptr + split.to(tl.int64) * M * N + mn, acc, mask=mask)
    elif _has_tail(pid_n * BLOCK_N, BLOCK_N, ROPE_D, ROPE_R2):
        _store_rope_out(out_ptr + mn, acc, mask, pid_n * BLOCK_N, offs_m, m_mask, cs_ptr,
                        ROPE_D, ROPE_R2, INTERPRET)
    else:
        _store_out(out_ptr + mn, acc, mask, OUT_BF16, INTERPRET)


@triton.jit
def _split_sum_kernel(part_ptr, c_ptr, MN, SPLITS: tl.constexpr, BLOCK: tl.constexpr,
                      OUT_BF16: tl.constexpr = False, INTERPRET: tl.constexpr = False):
    """part: [SPLITS, M, N] fp32 split-K partials; c: [M, N] fp32 (or bf16: OUT_BF16, the sum
    rounded once), MN = M * N. Grid (cdiv(MN, BLOCK),). c = (part[0] + part[1]) + ... in split
    order, fp32: deterministic."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    part_ptrs = part_ptr + offs
    acc = tl.load(part_ptrs, mask=mask, other=0.0)
    for _ in tl.static_range(1, SPLITS):  # unrolled: the SPLITS loads are independent
        part_ptrs += MN
        acc += tl.load(part_ptrs, mask=mask, other=0.0)
    _store_out(c_ptr + offs, acc, mask, OUT_BF16, INTERPRET)


@dataclass(frozen=True)
class KOrder:
    """The K summation order of one GEMM weight shape: K is ``chunks`` chunks of ``granule``
    K steps (32-blocks for fp8, BLOCK_K columns for the dense linears), cut into ``ranges``
    contiguous ranges (range r: chunks [r * chunks // ranges, (r + 1) * chunks // ranges)),
    each summed in K order from -0, then added in range order. A function of the weight's shape
    and the SM count only: every M gets the same bits."""

    granule: int
    chunks: int
    ranges: int

    def bounds(self, r: int) -> tuple[int, int]:
        """Range r's K steps [lo, hi)."""
        return (r * self.chunks // self.ranges * self.granule,
                (r + 1) * self.chunks // self.ranges * self.granule)


def k_order(n_tiles: int, steps: int, sms: int, granules: tuple[int, ...] = (8, 4, 2, 1),
            ranges: int | None = None) -> KOrder:
    """The split-K order for a weight of ``steps`` K steps whose output columns make
    ``n_tiles`` tiles of 64: enough ranges for ~SPLIT_PROGRAMS_PER_SM programs per SM at M = 1
    (decode is weight-bandwidth bound; a large N needs none), each a whole number of chunks;
    the chunk is the largest of ``granules`` dividing ``steps``, or the next one down when that
    leaves fewer chunks than wanted ranges. ``ranges`` forces the count (1 <= it <= steps); the
    chunk then shrinks, if need be, to give every range at least one."""
    if ranges is None:
        want = cdiv(SPLIT_PROGRAMS_PER_SM * sms, max(n_tiles, 1))
        fits = [d for d in granules if steps % d == 0]
        g = fits[0]
        if len(fits) > 1 and steps // g < want:  # more, shorter ranges (wkv)
            g = fits[1]
        return KOrder(g, steps // g, max(1, min(want, steps // g)))
    g = next(d for d in granules if steps % d == 0 and steps // d >= ranges)
    return KOrder(g, steps // g, ranges)


@dataclass(frozen=True)
class _GemmPlan:
    """Launch parameters of one fp8 GEMM shape: ``order`` from (N, KB, SM count) alone, the
    kernel, tiles and where the ranges run from M."""

    block_m: int  # token rows per tile
    block_n: int  # weight rows (output columns) per tile
    num_warps: int
    num_stages: int
    ksub: int  # 32-blocks per K iteration: each weight row is read ksub * 32 bytes at a time
    dot_f16: bool  # fp8_gemm's precise_dot: e4m3 operands widened to fp16 for tl.dot
    order: KOrder
    workspace: bool  # the ranges run as separate programs into fp32 partials (split-K)
    swap: bool = False  # _fp8_decode_kernel (weight rows on the MMA's 64-row side)
    prescaled: bool = False  # _fp8_gemm_kernel's PRESCALED: bf16 values of x and the weight
    diag: int = 0  # _fp8_decode_kernel's DIAG: block_m (a power of two) token rows, this
    # many block dots at a time in one tl.dot against a block-diagonal token operand
    tma: bool = False  # TMA loads: _fp8_decode_kernel's 16-row and wide tiles read the weight
    # by descriptor, _fp8_gemm_kernel's PRESCALED tiles both bf16 operands (only for a weight
    # _tma_weight accepts: the plan's maker checks it)

    @property
    def splits(self) -> int:
        """Programs per output tile over K (the grid's third dimension)."""
        return self.order.ranges if self.workspace else 1

    @property
    def granule(self) -> int:
        return self.order.granule

    @property
    def writes_out(self) -> bool:
        """Whether the GEMM kernel writes the output itself (bf16 or fp32; RoPE'd where
        asked): K unsplit (or its ranges summed in one program), or, in the decode kernel,
        split with the sum in its last program (16-row and TMA tiles); else _split_sum_kernel
        does (bf16 or fp32, no RoPE)."""
        return self.splits == 1 or (self.swap and (self.block_m <= 16 or self.tma))


# (largest M, BLOCK_M, BLOCK_N, warps, stages, most 32-blocks per K iteration), by M, for
# _fp8_gemm_kernel (M > SPLIT_MAX_M). Every tile has >= 64 rows per warp group, so tl.dot is
# the Hopper wgmma at every M: an H200's mma.sync (16- or 32-row tiles) sums the fp16 products
# of a 32-block differently from wgmma (0.3% to 40% of outputs, by the data, an fp32 ulp or so
# apart), which would make a decode row differ from its prefill.
# e4m3 codes (fp8_gemm; fp8_linear below PRESCALE_MIN_M): 128 x 128, 8 warps; 4 stages and
# the tiles in groups of GEMM_GROUP row tiles (H200, M = 4096, wq_b: 2007 -> 1975 us).
_FP8_TILES = ((None, 128, 128, 8, 4, 1),)
# PRESCALED (fp8_linear from PRESCALE_MIN_M rows): 128 x 64, 4 warps (several programs per SM,
# so one's block sums overlap another's MMAs): H200, fp8_linear at M = 4096, wq_a / wq_b / wo_b
# 335 / 1841 / 1532 us at 128 x 128 -> 314 / 1473 / 1417 (64 x 128: 303 / 1615 / 1370; 2
# blocks per K iteration, 64 x 256: slower); 4 stages and the groups: wq_b 1782 -> 1574 us,
# wo_b 1703 -> 1312 (128 x 128). Both operands through TMA (SQUARE_TMA), 2 blocks per K
# iteration, 3 stages (H100, M = 8192, the GEMM alone, wq_a / wq_b / wkv / index wq_b / wo_b:
# 398 / 2128 / 179 / 328 / 2289 us -> 335 / 1976 / 142 / 279 / 1984; the same bits; of 48
# tables timed (128 x 128 and 256 x 64 on 8 warps, 64 x 128, 3 or 4 stages, 1 or 2 blocks,
# with and without TMA, the weight's e4m3 codes widened in registers instead of its bf16 copy)
# the fastest in all; the widened codes were 1.3-1.8x slower). 300-350 TFLOP/s, where cuBLAS's
# bf16 GEMM of the same values, its fp32 sum chained through K (not the reference's rounding
# points), runs 720-850: the per-32-block rounding costs ~2.4x at these shapes.
_FP8_VALUE_TILES = ((None, 128, 64, 4, 3, 2),)
SQUARE_TMA = True  # PRESCALED square tiles read x's and the weight's bf16 values through TMA
# PRESCALED square tiles on a Hopper GPU: gluon.fp8_values_gemm_ws, on the weight's bf16 values
# with its block scales folded in, where the scales allow (foldable_scales): the same bits (H100,
# M = 8192, the GEMM alone, us: wq_b 1994 -> 1614, wo_b 1997 -> 1495, wq_a 335 -> 258, wkv 141
# -> 117; in the same run the Triton tiles on the folded weight were no faster, and the Gluon
# tiles loading the scale bytes as these do ran 317-332 TFLOP/s: the loads were the wait).
# On by default since its GPU tests passed (H100, thirty-ninth session: every case of
# tests/test_fp8_linear_gluon.py, both fold forms, ranges summed in the program and as
# separate programs, 0 differing bits; the roles', fixtures', invariance and decode-plan tests
# with it on). fp8_linear at M = 8192, act_quant and the fold pass included, Triton tiles ->
# Gluon: wq_b 2061 -> 1697 us, wo_b 2159 -> 1590, wq_a 436 -> 415.
SQUARE_WS = True
# The fold in the ring (the converter warp group folds the weight's e4m3 codes into the stage's
# bf16 tile; no pass over the weight per call): the same bits, but slower where timed (H100,
# M = 8192: wq_b 2643 us against the fold pass's 1697, wo_b 2300 against 1590, wq_a 470
# against 415; its converter spends ~3 instructions a weight element, not yet profiled). Off.
SQUARE_WS_CODES = False
# With the fold in the ring (no pass over the weight per call) the square tiles replace the wide
# decode-kernel tiles from this many rows
SQUARE_WS_MIN_M = 128


# The decode kernel's VALUES tiles (x's bf16 values: its wide tiles, and at SWAP_WS_MIN_M < 17
# the 1-64-row ones too) on a Hopper GPU: gluon.fp8_swap_gemm_ws, warp-specialized (a TMA
# producer warp group, two consumer warp groups each on 64 weight rows, the weight's e4m3
# codes widened in registers as the wgmma's register operand), the same bits. Timed at
# 322bbca (forty-third session, H100, fp8_linear in a CUDA graph, Triton -> Gluon, 0
# differing bits in every case; `bench --part gemm --variant`): wq_b 48.6 -> 42.1 us at 96
# rows, 52.0 -> 43.5 at 128, 94.2 -> 80.0 at 256; wo_b 64.8 -> 55.0, 69.0 -> 56.1, 131.9 ->
# 102.1, level at 384 (132.8 -> 134.9); the layer at b = 256: SWA 387 -> 345 us, Full r=2
# 599 -> 564, Reuse 453 -> 413, at b = 128 -5 to -10%. On the small weights it lost where
# the Triton wide tiles fill the SMs unsplit (indexer.wq_b, 4096 x 1280: 20.4 -> 30.0-33.6
# us at 192-256 rows) and won on wq_a at 384 rows (82.2 -> 55.4): they run for weights of at
# least SWAP_WS_MIN_BYTES only (wq_b, wo_b). SWAP_NARROW (gluon.py, with SWAP_INFLIGHT,
# which changes nothing on 128-row token tiles) lost 5-98% on wo_b in the same runs: off.
SWAP_WS = True
# The decode kernel's VALUES tiles (17-64 rows, and the small weights' past them) turn the
# weight's codes into bf16 by their bits, as the swapped tiles' SWAP_CODE_BITS (on weights
# without NaN codes)
VALUES_CODE_BITS = True
SWAP_WS_MIN_M = 65  # the token rows from which they run
SWAP_WS_MIN_BYTES = 16 << 20  # the weights (e4m3 bytes) they run for
# ... and from SWAP_WS_LONG_MIN_M rows for a K of at least SWAP_WS_LONG_K (wo_b), on 64-row
# token tiles with two block dots in flight (gluon.SWAP_INFLIGHT). H100, da1c096, fp8_linear
# in a CUDA graph, Triton -> Gluon with two in flight: wo_b 46.2 -> 41.3 us at 48 rows, 49.4 ->
# 41.6 at 64, but 34.8 -> 38.2 at 32 (32-row tiles); wq_b (K = 1280) lost 13-14% at 17-64.
SWAP_WS_LONG_K = 4096
SWAP_WS_LONG_MIN_M = 33
# The swapped tiles run K's ranges as programs of their own where the tiles leave SMs idle;
# also where the tiles take more rounds of the SMs than their ranges as items would
# (SWAP_SPLIT_ROUNDS, _swap_split). wo_b at 448-511 rows is the case: 160 tiles of 128 token
# rows on 132 SMs ran unsplit in 2 rounds of its whole K, where its 5 ranges as 800 items take
# 7 rounds of a fifth of K, plus the partials' sum. The same bits either way. H100, 51fc670's
# tree, act_quant + GEMM in a CUDA graph (`bench --part gemm --rows 448,480,511 --variant base
# --variant r:ops.linear.triton.SWAP_SPLIT_ROUNDS=1`): wo_b 180.3 / 184.8 / 187.3 -> 147.0 /
# 152.1 / 151.2 us; the layer at b = 480: SWA 540 -> 507 us, Full r=2 964 -> 936
SWAP_SPLIT_ROUNDS = True


def _swap_split(tiles: int, ranges: int, sms: int) -> bool:
    """Whether the swapped tiles run K's ``ranges`` as programs of their own (fp32 partials,
    summed after): where the ``tiles`` leave SMs idle, or (SWAP_SPLIT_ROUNDS) where the tiles
    times the ranges as items fill the SMs in fewer rounds, counted in whole-K tiles, than the
    tiles alone."""
    if ranges <= 1:
        return False
    return tiles < sms or bool(SWAP_SPLIT_ROUNDS) and \
        cdiv(tiles * ranges, sms) < ranges * cdiv(tiles, sms)


def _swap_tiles(device: torch.device, n: int, k: int) -> bool:
    """Whether the swapped tiles may run as the Gluon ones on this device for an [n, k] weight
    (SWAP_WS, at least SWAP_WS_MIN_BYTES, a Triton with Gluon, a Hopper GPU, no interpreter,
    whole ring stages); _swap_ws adds what the operands need."""
    return bool(SWAP_WS and n * k >= SWAP_WS_MIN_BYTES and fp8_swap_gemm_ws is not None
                and not interpreting() and is_hopper(device) and k % SWAP_BK == 0)


def _swap_min_m(k: int) -> int:
    """The token rows from which the Gluon swapped tiles take a weight of K columns."""
    return SWAP_WS_LONG_MIN_M if k >= SWAP_WS_LONG_K else SWAP_WS_MIN_M


def _values_code_bits(plan: _GemmPlan, weight: torch.Tensor) -> bool:
    """Whether the decode kernel's VALUES tiles turn this weight's codes into bf16 by their
    bits (VALUES_CODE_BITS, on a GPU, no NaN code in the weight): the same bits either way."""
    return bool(VALUES_CODE_BITS and plan.prescaled and plan.swap and not interpreting()
                and weight.device.type == "cuda" and weight.dtype == torch.float8_e4m3fn
                and nan_free_codes(weight))


def _swap_ws(plan: _GemmPlan, x, weight, out) -> bool:
    """Whether the decode kernel's VALUES tiles run as gluon.fp8_swap_gemm_ws on these
    operands: _swap_tiles, the weight and x's values readable by TMA, out bf16 or fp32, and
    (SWAP_CODE_BITS) no NaN code in the weight."""
    return bool(plan.swap and plan.prescaled and x.shape[0] >= _swap_min_m(x.shape[1])
                and _swap_tiles(x.device, *weight.shape)
                and weight.dtype == torch.float8_e4m3fn and x.dtype == torch.bfloat16
                and _ws_unsupported(x.shape[1], x.device, out, SWAP_BK) is None
                and _tma_weight(weight) and x.is_contiguous() and x.data_ptr() % 16 == 0
                and (not _gluon.SWAP_CODE_BITS or nan_free_codes(weight)))  # last: a sync


def _gluon_tiles(device: torch.device) -> bool:
    """Whether the square tiles may run as the Gluon ones on this device (SQUARE_WS, a Triton
    with Gluon, a Hopper GPU, no interpreter); _square_ws adds what the operands need."""
    return bool(SQUARE_WS and fp8_values_gemm_ws is not None and not interpreting()
                and is_hopper(device))


def _square_min_m(device: torch.device) -> int:
    """The rows from which fp8_linear's plan takes the square tiles on x's bf16 values:
    PRESCALE_MIN_M, or SQUARE_WS_MIN_M where the Gluon tiles fold the weight in their ring. (A
    weight the Gluon tiles then refuse, _square_ws, runs the Triton square tiles at those rows:
    the same bits, slower than the wide tiles would be.)"""
    if SQUARE_WS_CODES and _gluon_tiles(device):
        return min(SQUARE_WS_MIN_M, PRESCALE_MIN_M)
    return PRESCALE_MIN_M
# Decode (M <= SPLIT_MAX_M): _fp8_decode_kernel, whose 64-row MMA side is BLOCK_N weight rows
# and whose narrow side is BLOCK_M (>= 16) token rows: the same wgmma, the same bits (checked on
# an H200 against _fp8_gemm_kernel at M = 1, 2, 7, 8, 64 on the V4.1 shapes, f16 and e4m3
# operands). (largest M, BLOCK_M, BLOCK_N, warps, stages, most 32-blocks per K iteration): the
# fastest of the tables timed there (CUDA-graph replay; more stages or KSUB 2 were slower at
# M <= 16, 2 stages ~10% faster at M = 64; with the scales prefetched, BLOCK_N 64 beat 128 at
# M = 1 on wq_b 20.9 / 22.9 us and wo_b 29.2 / 30.4, 256 rows and 8 warps lost; same bits).
# The 16-row tiles run PREFETCH (the next K iteration's block scales loaded ahead, and each
# iteration's KSUB weight tiles issued together before its dots: H200, M = 1, wq_b 24.5 ->
# 21.4 us, wo_b 30.6 -> 28.4, wq_a 11.9 -> 10.9; loading the next iteration's weight tiles
# ahead as well was slower at every M, 64-row tiles 2-4x: bench --part gemm).
_FP8_DECODE_TILES = ((16, 16, 64, 4, 3, 4), (SPLIT_MAX_M, 64, 128, 4, 2, 4))
# The same with the 16-row tiles' weight read through TMA (_tma_weight): 128 weight rows, 3
# stages. H200, the five V4.1 fp8 weights at M = 1 / 8 / 16, act_quant and GEMM, CUDA graphs:
# 80.1 / 93.6 / 102.1 us -> 70.2 / 78.3 / 85.8 (64 weight rows: 69.2 / 85.5 / 92.8; 4 stages
# slower; the scales loaded in each block's step instead of an iteration ahead: wq_b and wo_b
# 2-3 us slower). At 32 and 64 rows TMA was 1.1-2.1x slower on four of the five weights
# (wo_b 0.94-1.02x), so the 64-row tiles keep plain loads.
_FP8_DECODE_TMA_TILES = ((16, 16, 128, 4, 3, 4),) + _FP8_DECODE_TILES[1:]
# DIAG (_fp8_decode_kernel): at M <= DIAG_MAX_M rows the TMA tiles take M's next power of two
# token rows, and one tl.dot makes several block dots (as many as a lane's 4 accumulator slots
# hold: 4 up to 4 rows, 2 at 5-8; at most the iteration's KSUB): the token operand is laid
# block-diagonally (_diag_tokens), so each column sums one block's 32 products and zeros, and
# in the accumulator's own layout, so each token row's block dots land in the thread that adds
# them in K order (_diag_slots); one wgmma wait per dot instead of one per 32-block. Its bits
# equal the other tiles' wherever the wgmma adds zero products exactly: on an H100, 0 of the
# fp32 outputs differed on the five V4.1 fp8 weights at M = 1, 2, 4, 8 (wide-range rows, a
# zero block), nor in the decode/tile test with a zero row (signed zeros). H100, act_quant and
# GEMM, CUDA graphs, us at M = 1 / 8, 16-row tiles -> DIAG: wq_a 9.9 / 11.6 -> 9.1 / 10.6,
# wq_b 22.1 / 23.3 -> 21.6 / 22.9, wkv 8.1 / 10.1 -> 6.4 / 8.7, index wq_b 9.2 / 10.1 -> 8.5 /
# 9.4, wo_b 26.2 / 27.7 -> 24.8 / 26.9; the layer's decode step SWA 107.9 -> 98.1 at b = 1, 110.2
# -> 104.1 at b = 8, Full r=2 145.3 -> 139.0 and 161.4 -> 157.0. The block dots taken out in
# their own threads (they were reduced over the 16 columns: 32 SHFL, 32 FSEL and 40 FADD a
# 4-block step) and the weight's scales loaded an iteration ahead as the tile's few group bytes
# (they went through shared memory, 8 barriers a step): 450 -> 326 sm_90a instructions a step
# at one token (wkv's launch), the same bits; H100, M = 1 / 2 / 4: wq_b 21.0 / 21.6 / 21.9 ->
# 19.8 / 19.9 / 20.2 us, wo_b 23.9 / 25.7 / 25.2 -> 22.4 / 22.7 / 23.0, wq_a 8.7 / 9.4 / 9.4 ->
# 8.4 / 8.4 / 8.7. (weight rows, warps, stages, most 32-blocks per K iteration):
_FP8_DIAG_TILES = (128, 4, 3, 4)
DIAG_MAX_M = 8
# Past the 16-row tiles, fp8_linear feeds the decode kernel bf16 token values (VALUES: each
# code times its row scale, exact; each block dot then comes out times the row scale, so no
# row scales are held in registers) and the wide tiles add one block dot at a time. H200,
# act_quant and GEMM, CUDA graphs, us, e4m3-code kernels -> VALUES tiles, the same bits in every
# case (wide-range data too; an A/B of the five V4.1 weights at M = 1-511):
# - the 64-row plain tiles at 17-64 rows: wq_a 18.1 -> 16.8 at M = 64, wkv 14.3 -> 13.7,
#   index wq_b 16.5 -> 15.1 (at 1-16 rows VALUES is slower: its e4m3 -> bf16 weight
#   conversion costs more than the row-scale multiply saves: wq_b 18.1 -> 26.1 at M = 1);
# - a large weight (WIDE_MIN_BYTES: wq_b, wo_b) through TMA, _FP8_WIDE_TILES: wq_b 44.2 ->
#   28.5 at M = 32, 46.5 -> 35.9 at 64, 166.2 -> 95.6 at 256, 342.2 -> 185.7 at 511; wo_b
#   63.9 -> 36.6, 72.7 -> 48.6, 199.7 -> 151.4, 538.5 -> 272.7 (128 weight rows by 128 token
#   rows and 8 warps: within 12% either way; 64-row token tiles 1.04-1.3x slower at 65-511);
# - a smaller weight at 65-511 rows whose square tiles would leave SMs idle with K unsplit
#   (_wide_swap), _FP8_WIDE_SMALL_TILES: wq_a 183.3 -> 70.9 at 384, 177.8 -> 67.8 at 511; wkv
#   193.2 -> 70.1 at 511; index wq_b 48.8 -> 37.2 at 384, 50.4 -> 37.9 at 511. Elsewhere the
#   square tiles won (wkv 30.2 against 43.9 at 256) and keep the e4m3 codes.
# From 65 rows 2 blocks per K iteration (H100, act_quant and GEMM, wq_b / wo_b at M = 128:
# 53.6 / 72.3 -> 51.2 / 66.7 us, at 256: 96.3 / 153.0 -> 91.7 / 132.1; 128 weight rows on 8
# warps 49.3 / 75.1 and 94.3 / 131.0, 1 block per iteration with 4 stages 88.3 at 256 for
# wq_b but 140.7 for wo_b). The same bits.
_FP8_WIDE_TILES = ((32, 32, 128, 4, 3, 4), (SPLIT_MAX_M, 64, 64, 4, 3, 4), (None, 128, 64, 4, 3, 2))
# 33-64 rows of a large weight whose 128-row tiles alone fill the SMs (wq_b, not wo_b): 128
# weight rows on 8 warps, 2 blocks per K iteration. H100, act_quant and GEMM at M = 64, CUDA
# graphs: wq_b 37.4 -> 30.3 us (64 x 64 tiles with 1 block per iteration 35.6, 4 stages 34.2);
# wo_b, 40 such tiles, 46.4 -> 55.1, so it keeps _FP8_WIDE_TILES. The same bits.
_FP8_WIDE_TALL_TILES = ((SPLIT_MAX_M, 64, 128, 8, 3, 2),)
_FP8_WIDE_SMALL_TILES = ((None, 64, 64, 4, 3, 4),)
WIDE_MIN_BYTES = 16 << 20  # fp8 weights this large take _FP8_WIDE_TILES past 16 rows

def _tile_row(table, m: int):
    return next(row[1:] for row in table if row[0] is None or m <= row[0])


def _use_workspace(order: KOrder, tiles: int, m: int, n: int, weight_bytes: int, sms: int,
                   partial_bytes: int = 8, budget: int = 0) -> bool:
    """Run the ranges as separate programs (fp32 partials written and read back, 8 B per
    output and range) when the tiles alone leave SMs idle and the partials stay within
    ``weight_bytes`` / SPLIT_TRAFFIC_SHARE or ``budget`` bytes; otherwise every tile's
    program sums its ranges itself. Either way the same bits."""
    traffic = order.ranges * m * n * partial_bytes
    return order.ranges > 1 and tiles < sms and \
        traffic <= max(weight_bytes // SPLIT_TRAFFIC_SHARE, budget)


def _gemm_plan(m: int, n: int, kb: int, sms: int, num_splits: int | None = None,
               precise_dot: bool = True, workspace: bool | None = None,
               values: bool = False, tma: bool = False,
               square_min_m: int | None = None) -> _GemmPlan:
    """The K order from (N, KB, SM count) (``k_order``; num_splits, 1 <= it <= KB, forces the
    range count), then the kernel and tiles by M: decode (M <= SPLIT_MAX_M) is
    weight-bandwidth bound: _fp8_decode_kernel, BLOCK_N weight rows by 16-64 token rows,
    reading 128 contiguous bytes per weight row per iteration (KSUB 32-blocks, several loads in
    flight); larger M square MMA tiles (_fp8_gemm_kernel), or the decode kernel's wide tiles
    where they win (``_FP8_WIDE_TILES``). The ranges run as separate programs (the kernel's
    last program or _split_sum_kernel adds their partials): in the decode kernel whenever the
    tiles leave SMs idle, in the square tiles while that costs little traffic
    (``_use_workspace``); ``workspace`` forces it either way. sms: the device's SM count
    (sm_count); precise_dot: see fp8_gemm. values: the caller has act_quant's bf16 values of x
    (dequant; precise_dot only): the plan reads them (``prescaled``), the square tiles also the
    weight's bf16 values (PRESCALED), the decode kernel its e4m3 codes (VALUES), which past 16
    rows of a large weight, or 65 to square_min_m - 1 rows (PRESCALE_MIN_M, or fewer: see
    _square_min_m) where the square tiles would idle most SMs unsplit (``_wide_swap``), run
    the wide tiles through TMA. tma: the weight may be
    read through a TMA descriptor (``_tma_weight``): the 16-row decode tiles then do, and so do
    the wide tiles, which need it. Every choice gives the same bits. square_min_m None:
    PRESCALE_MIN_M."""
    square_min_m = PRESCALE_MIN_M if square_min_m is None else square_min_m
    order = k_order(cdiv(n, 64), kb, sms, ranges=num_splits)
    prescaled = bool(values and precise_dot)
    large = n * kb * FP8_BLOCK >= WIDE_MIN_BYTES
    narrow = m <= _FP8_DECODE_TILES[0][0]
    wide = bool(tma and prescaled and not narrow and m < square_min_m
                and (large or m > SPLIT_MAX_M and _wide_swap(m, n, kb, sms, order)))
    swap = m <= SPLIT_MAX_M or wide
    if wide:
        table = _FP8_WIDE_TILES if large else _FP8_WIDE_SMALL_TILES
        _, tall_m, tall_n = _FP8_WIDE_TALL_TILES[0][:3]
        if large and _FP8_WIDE_TILES[0][0] < m <= SPLIT_MAX_M \
                and cdiv(n, tall_n) * cdiv(m, tall_m) >= sms:
            table = _FP8_WIDE_TALL_TILES
    elif swap:
        tma = bool(tma and narrow)
        table = _FP8_DECODE_TMA_TILES if tma else _FP8_DECODE_TILES
    else:  # the square tiles: TMA for the bf16 values (PRESCALED) only
        tma = bool(tma and prescaled and SQUARE_TMA)
        table = _FP8_VALUE_TILES if prescaled else _FP8_TILES
    bm, bn, warps, stages, ksub_max = _tile_row(table, m)
    diag_rows = swap and tma and narrow and precise_dot and not prescaled and m <= DIAG_MAX_M
    if diag_rows:
        bm = next_pow2(max(m, 1))
        bn, warps, stages, ksub_max = _FP8_DIAG_TILES
    ksub = next(d for d in (8, 4, 2, 1) if d <= ksub_max and order.granule % d == 0)
    # blocks a dot: as many as a lane's 4 accumulator slots hold (_diag_tokens)
    diag = min(ksub, 16 // max(bm, 4)) if diag_rows else 0
    if workspace is None:
        tiles = cdiv(m, bm) * cdiv(n, bn)
        # the decode kernel: split whenever the tiles leave SMs idle (one program per tile
        # summing 20-40 ranges would stream at a tenth of the rate)
        workspace = order.ranges > 1 and tiles < sms if swap else \
            _use_workspace(order, tiles, m, n, n * kb * FP8_BLOCK, sms,
                           budget=SPLIT_PARTIAL_BYTES)
    workspace = bool(workspace) and order.ranges > 1
    return _GemmPlan(bm, bn, warps, stages, ksub, bool(precise_dot), order, workspace, swap,
                     prescaled=prescaled, diag=diag, tma=bool(tma))


def _wide_swap(m: int, n: int, kb: int, sms: int, order: KOrder) -> bool:
    """Whether 65 .. PRESCALE_MIN_M - 1 rows of a smaller [N, 32 KB] fp8 weight (below
    WIDE_MIN_BYTES) run the decode kernel's wide tiles (_FP8_WIDE_SMALL_TILES) rather than
    _fp8_gemm_kernel's square ones: where those would leave SMs idle, and either could not
    run K's ranges as programs (their partials past the traffic cap) or the wide tiles alone
    fill the SMs (no split either way): wq_a from 385 rows, the index wq_b from 129, wkv at
    no M (V4.1-Flash, 132 SMs; H100, act_quant and GEMM at 192 / 256 rows: the square tiles'
    7 ranges split 38.0 / 43.9 us, 192 / 256 wide tiles 21.0 / 21.4; at 128 rows, 128 wide
    tiles split: 29.0 against 24.1, and wq_a's and wkv's wide tiles lost at every M below
    their switch, 1.1-2.9x; wkv's split wide tiles at 448-511 rows took 95-108 us against
    53-60 for its split square tiles, see SPLIT_PARTIAL_BYTES)."""
    bm, bn = _FP8_TILES[0][1:3]
    tiles = cdiv(m, bm) * cdiv(n, bn)
    split = _use_workspace(order, tiles, m, n, n * kb * FP8_BLOCK, sms,
                           budget=SPLIT_PARTIAL_BYTES)
    wbm, wbn = _FP8_WIDE_SMALL_TILES[0][1:3]
    wide_tiles = cdiv(m, wbm) * cdiv(n, wbn)
    return order.ranges > 1 and tiles < sms and (not split or wide_tiles >= sms)


def _tma_weight(weight: torch.Tensor) -> bool:
    """Whether the decode kernel may read ``weight`` ([N, K] e4m3, K a multiple of 32) through
    a TMA descriptor: this Triton has them, the tensor is contiguous from a 16-byte-aligned
    address (TMA's rule), and it lives on a Hopper or newer GPU (or the interpreter runs)."""
    if TensorDescriptor is None or not weight.is_contiguous() or weight.data_ptr() % 16:
        return False
    if weight.is_cuda:
        return torch.cuda.get_device_capability(weight.device)[0] >= 9
    return interpreting()


def act_quant(x: torch.Tensor, *, f16: bool = False, dequant: bool = False,
              norm: tuple[torch.Tensor, float] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 activation quantisation (docs/numerics.md §2), bit-exact with common.quant.act_quant.

    x: [M, K] bf16, K a multiple of 32. Returns (codes [M, K] float8_e4m3fn, scales [M, K/32]
    fp32 powers of two) with x ~= codes * scales per block of 32. A block holding a NaN or an
    infinity gets a NaN scale (dequant: NaN values), so the linears it feeds give NaN rows, as
    the reference's do (its e4m3 codes carry the NaN; the scales differ). f16: the
    codes' values as fp16 instead (exact: what the decode GEMM's wgmma reads, so it skips the
    widening; fp8_gemm takes either). dequant: the codes' values times their scales, as bf16
    (exact: x fake-quantised; what fp8_linear's large-M GEMM reads). norm: (weight [K] bf16,
    eps): quantise ``common.triton.rms_norm(x, weight, eps)`` instead, in the same launch and
    with its bits (the normalised rows are never written).
    """
    if f16 and dequant:
        raise ValueError("act_quant: f16 and dequant are exclusive (fp16 codes or bf16 values)")
    if x.dim() != 2:
        raise ValueError(f"act_quant wants a 2-D [M, K] tensor, got shape {tuple(x.shape)}")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"act_quant wants bf16, got {x.dtype}")
    check_device(x)
    m, k = x.shape
    if k % FP8_BLOCK:
        raise ValueError(f"K = {k} is not a multiple of the quant block {FP8_BLOCK}")
    kb = k // FP8_BLOCK
    nw, eps = (x, 0.0) if norm is None else norm  # nw: never read without a norm
    if norm is not None:
        require(isinstance(nw, torch.Tensor) and nw.dtype == torch.bfloat16
                and tuple(nw.shape) == (k,),
                f"act_quant's norm weight must be bf16 [{k}], got "
                f"{getattr(nw, 'dtype', type(nw))} {tuple(getattr(nw, 'shape', ()))}")
        check_device(x, nw)
    dtype = torch.float16 if f16 else torch.bfloat16 if dequant else torch.float8_e4m3fn
    q = torch.empty(m, k, dtype=dtype, device=x.device)
    s = torch.empty(m, kb, dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return q, s
    qb = QUANT_BLOCKS if m < QUANT_WIDE_MIN_M else \
        min(QUANT_BLOCKS_WIDE, max(QUANT_BLOCKS, next_pow2(kb)))
    grid = (m, cdiv(kb, qb))
    norm_kw = {} if norm is None else dict(
        NORM_K=k, NORM_BLOCK=next_pow2(k), enable_fp_fusion=False)
    _act_quant_kernel[grid](x.contiguous(), q if f16 or dequant else q.view(torch.uint8), s,
                            nw.contiguous(), k, kb, INV_FP8_MAX, float(eps), QB=qb,
                            F16=f16, DEQUANT=dequant, INTERPRET=interpreting(),
                            num_warps=4 if norm is None else rms_norm_warps(k), **norm_kw)
    return q, s


def _check_gemm(x_codes, x_scales, weight, weight_scale, num_splits, precise_dot,
                values=False):
    """fp8_gemm's argument checks (values: x_codes may also be act_quant's bf16 values);
    returns (M, N, K/32)."""
    if x_codes.dim() != 2 or weight.dim() != 2 or x_scales.dim() != 2 or weight_scale.dim() != 2:
        raise ValueError("fp8_gemm wants 2-D x_codes, x_scales, weight, weight_scale")
    if x_codes.dtype not in (torch.float8_e4m3fn, torch.float16) + ((torch.bfloat16,) * values) \
            or weight.dtype != torch.float8_e4m3fn:
        raise TypeError(f"x_codes and weight must be float8_e4m3fn (x_codes: or act_quant's "
                        f"fp16 values), got {x_codes.dtype}, {weight.dtype}")
    if x_codes.dtype == torch.float16 and not precise_dot:
        raise ValueError("fp16 x_codes (act_quant(f16=True)) need precise_dot=True")
    if x_scales.dtype != torch.float32 or weight_scale.dtype != torch.float8_e8m0fnu:
        raise TypeError(f"x_scales must be fp32 and weight_scale float8_e8m0fnu, got "
                        f"{x_scales.dtype}, {weight_scale.dtype}")
    m, k = x_codes.shape
    n = weight.shape[0]
    if k % FP8_BLOCK:
        raise ValueError(f"K = {k} is not a multiple of the quant block {FP8_BLOCK}")
    kb = k // FP8_BLOCK
    if weight.shape[1] != k:
        raise ValueError(f"weight {tuple(weight.shape)} does not match K = {k}")
    if tuple(x_scales.shape) != (m, kb):
        raise ValueError(f"x_scales {tuple(x_scales.shape)} != {(m, kb)}")
    if tuple(weight_scale.shape) != (cdiv(n, FP8_BLOCK), kb):
        raise ValueError(f"weight_scale {tuple(weight_scale.shape)} != "
                         f"{(cdiv(n, FP8_BLOCK), kb)}")
    if num_splits is not None and not 1 <= num_splits <= max(kb, 1):
        raise ValueError(f"num_splits = {num_splits} is not in [1, K/32 = {kb}]")
    check_device(x_codes, x_scales, weight, weight_scale)
    return m, n, kb


def fp8_gemm(x_codes: torch.Tensor, x_scales: torch.Tensor, weight: torch.Tensor,
             weight_scale: torch.Tensor, out: torch.Tensor | None = None,
             num_splits: int | None = None, *, precise_dot: bool = True,
             workspace: bool | None = None) -> torch.Tensor:
    """Blockwise-scaled fp8 GEMM: y[m, n] = sum_kb (x[m, kb] . w[n, kb]) sx[m, kb] sw[n//32, kb].

    x_codes: [M, K] float8_e4m3fn (or their fp16 values, act_quant(f16=True): the same
    result); x_scales: [M, K/32] fp32; weight: [N, K] float8_e4m3fn;
    weight_scale: [ceil(N/32), K/32] float8_e8m0fnu; out: optional contiguous [M, N] fp32
    buffer. Returns [M, N] fp32. K must be a multiple of 32.

    The summation order depends on (N, K, the SM count) only (``k_order``), so a row's result
    is the same whatever M is. num_splits: the K range count S, 1 <= S <= K/32 (None: chosen
    from N, K and the SM count). S = 1 accumulates all of K in order (the reference's
    rounding); S > 1 sums S contiguous K ranges separately, each in K order, then adds them in
    range order: deterministic, but not the reference's fp32 association. workspace: where
    the ranges run (None: by shape, ``_use_workspace``; True: separate programs and an fp32
    [S, M, N] workspace; False: one program per tile sums them in turn); the same bits.

    precise_dot (GPU only; the interpreter sums each 32-block exactly either way): True (the
    default) widens the e4m3 operands to fp16 (exact) before tl.dot. The fp8 wgmma (BLOCK_M >=
    64) sums its 32 products less precisely (seen on an H200: ~5e-5 of max|y| off the exact
    fp32 block sums, ~1e-7 with fp16) but is ~1.4x faster at large M; small M is ~1e-7 either
    way. With the fp8 sums the index q/k flip fp4 roundings and v41_geometry's top-k rows drift
    past the fixture tolerance (194 of 3312 rows on an H200, limit 1%), hence the default.
    Either way every tile runs wgmma, so either is M-invariant (_FP8_TILES,
    _FP8_VALUE_TILES, _FP8_DECODE_TILES).
    """
    m, n, kb = _check_gemm(x_codes, x_scales, weight, weight_scale, num_splits, precise_dot)
    out = out_buffer(out, (m, n), torch.float32, x_codes.device)
    return _gemm_into(out, kb, x_codes, x_scales, weight, weight_scale, num_splits,
                      precise_dot, workspace)


def _gemm_into(out, kb, x, x_scales, weight, weight_scale, num_splits, precise_dot,
               workspace=None, values=False):
    """fp8_gemm's work on checked operands into ``out`` ([M, N] fp32): nothing to compute
    (M or N zero), zeros (K zero), else the plan launched. values: x holds act_quant's bf16
    values (the square tiles' bf16 weight is made by _run_fp8_gemm, only when there is work)."""
    if out.numel() == 0:
        return out
    if kb == 0:
        return out.zero_()
    plan = _gemm_plan(out.shape[0], out.shape[1], kb, sm_count(out.device), num_splits,
                      precise_dot, workspace, values=values, tma=_tma_weight(weight))
    assert plan.prescaled == values
    return _run_fp8_gemm(plan, x, x_scales, weight, weight_scale, out)


_COUNTERS: dict = {}  # (device, stream) -> int32 tile counters of the fused split-K sum
CAPTURE_COUNTER_INTS = 1 << 20  # per device: counters handed to captured launches (4 MB)


class _CounterPool:
    """Zeroed int32 counters for launches captured into CUDA graphs, one slice per launch,
    never handed out twice: a captured launch leaves its counters zero again, as every launch
    does, so the slice is ready for the next replay without a memset node in the graph (one
    per fused GEMM, on the critical path of a decode step), and no two launches that may run
    at once (a branch stream beside the query path, graphs replayed side by side) share one.
    Buffers of ``ints`` counters are allocated outside any capture: ``top_up`` (every eager
    launch on the device, so the warm-up step before a capture) starts a new one when less
    than half of the current one is left. Every buffer is kept for the life of the process:
    a captured graph holds only the raw addresses of its slices (a freed buffer's memory,
    reused by another tensor, would be its counters). A capture that finds the buffer spent
    zeroes a buffer of its own, as before (the graph's memory pool keeps that one)."""

    def __init__(self, device: torch.device | str, ints: int):
        self.device, self.ints = device, ints
        self.buffers: list[torch.Tensor] = []  # every buffer made, never freed
        self.at = 0  # the current (last) buffer's counters handed out
        self.used = 0  # every buffer's

    @property
    def buffer(self) -> torch.Tensor | None:
        return self.buffers[-1] if self.buffers else None

    def top_up(self) -> None:
        if not self.buffers or self.ints - self.at < self.ints // 2:
            self.buffers.append(torch.zeros(self.ints, dtype=torch.int32, device=self.device))
            self.at = 0

    def take(self, n: int) -> torch.Tensor | None:
        if self.buffer is None or self.at + n > self.ints:
            return None
        self.at += n
        self.used += n
        return self.buffer[self.at - n:self.at]


_CAPTURE_COUNTERS: dict = {}  # device -> _CounterPool


def _tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed int32 counters, one per output tile, for _fp8_decode_kernel's last-program sum;
    each launch leaves them zero again. Eager: one buffer per (device, stream), since launches
    on one stream run in order and so never share counters at the same time. Under CUDA-graph
    capture: a slice of the device's _CounterPool of the launch's own (every graph torch
    captures shares one capture stream and graphs may replay side by side on different
    streams), else a buffer of the graph's own, zeroed by a memset node at each replay."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        pool = _CAPTURE_COUNTERS.get(str(device))
        buf = pool.take(tiles) if pool is not None else None
        return buf if buf is not None else torch.zeros(tiles, dtype=torch.int32, device=device)
    if device.type == "cuda":
        pool = _CAPTURE_COUNTERS.get(str(device))
        if pool is None:
            pool = _CAPTURE_COUNTERS[str(device)] = _CounterPool(device, CAPTURE_COUNTER_INTS)
        pool.top_up()
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < tiles:
        buf = torch.zeros(max(tiles, 1024), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


def _scale_words(plan: _GemmPlan, weight_scale: torch.Tensor) -> bool:
    """Whether DIAG's tiles may read the weight's block scales a word (four blocks) at a time:
    4-block iterations on 4-aligned bytes (_diag_scales)."""
    kb = weight_scale.shape[1]
    return bool(plan.diag and plan.ksub == 4 and kb % 4 == 0
                and weight_scale.data_ptr() % 4 == 0)


def _square_ws(plan: _GemmPlan, x, weight, weight_scale, out) -> bool:
    """Whether the square tiles run as gluon.fp8_values_gemm_ws on these operands: a Hopper
    GPU, K a multiple of 64, a weight TMA can read where the kernel reads its codes
    (SQUARE_WS_CODES), and whose scales fold
    exactly (the same bits as the Triton tiles; checked last: a host sync per new weight)."""
    return bool(_gluon_tiles(x.device) and plan.prescaled and not plan.swap
                and weight.dtype == torch.float8_e4m3fn and x.dtype == torch.bfloat16
                and _ws_unsupported(x.shape[1], x.device, out) is None
                and (not SQUARE_WS_CODES or _tma_weight(weight))  # TMA reads the codes
                and foldable_scales(weight_scale))


def _run_fp8_gemm(plan: _GemmPlan, x_codes, x_scales, weight, weight_scale, out, cs=None,
                  rope_d: int = 0):
    """Launch ``plan`` on checked operands (fp8_gemm's; x_codes e4m3 or fp16 values; for a
    ``prescaled`` plan x's bf16 values, and in the square tiles the weight's too, made here
    from its e4m3 codes when given those: one pass over the weight, ~1% of the GEMM at those
    M), into ``out`` ([M, N] fp32, or bf16: the fp32 result rounded once, by the kernel or
    the split-K sum). rope_d > 0 (a plan that ``writes_out`` bf16): the kernel stores the output with
    the RoPE of cs [M, R/2, 2] fp32 on each head of rope_d columns."""
    m, k = x_codes.shape
    n, kb = weight.shape[0], k // FP8_BLOCK
    s = plan.splits
    order = plan.order
    if _swap_ws(plan, x_codes, weight, out):
        assert not rope_d  # (_linear_from_quant turns the heads after)
        sms = sm_count(out.device)
        bt = swap_tile(m, n, sms)[0]
        split = _swap_split(cdiv(n, SWAP_BN) * cdiv(m, bt), order.ranges, sms)
        parts = torch.empty(order.ranges, m, n, dtype=torch.float32, device=out.device) \
            if split else out
        fp8_swap_gemm_ws(x_codes, weight, weight_scale, parts, order.chunks, order.ranges,
                         order.granule, split=split, bt=bt)
        if split:
            _split_sum(parts, out)
        return out
    partials = out if s == 1 else torch.empty(s, m, n, dtype=torch.float32, device=out.device)
    if plan.prescaled and not plan.swap and weight.dtype == torch.float8_e4m3fn:
        if _square_ws(plan, x_codes, weight, weight_scale, out):
            assert not rope_d  # (_linear_from_quant turns the heads after)
            # the codes, folded in the kernel's ring; else the folded values, by a pass
            w, ws = (weight, weight_scale) if SQUARE_WS_CODES else \
                (e4m3_to_bf16(weight, weight_scale), None)
            fp8_values_gemm_ws(x_codes, w, partials, order.chunks, order.ranges, order.granule,
                               split=s > 1, w_scale=ws)
            if s > 1:
                _split_sum(partials, out)
            return out
        weight = e4m3_to_bf16(weight)  # the square tiles' PRESCALED operand (exact)
    args = (x_codes.contiguous(), x_scales.contiguous(), weight.contiguous(),
            weight_scale.contiguous().view(torch.uint8))
    all_ranges = order.ranges > 1 and not plan.workspace
    if plan.swap:
        grid = (cdiv(n, plan.block_n), s, cdiv(m, plan.block_m))
        # 16-row and TMA tiles: PREFETCH, the split-K sum in the kernel
        prefetch = plan.block_m <= 16 or plan.tma
        fused = s > 1 and plan.writes_out  # the split-K sum in the kernel's last program
        assert not rope_d or (plan.writes_out and out.dtype == torch.bfloat16)
        counters = _tile_counters(out.device, grid[0] * grid[2]) if fused else partials
        assert (x_codes.dtype == torch.bfloat16) == plan.prescaled
        assert weight.dtype == torch.float8_e4m3fn
        tma = plan.tma  # the planner's caller checked the weight (_tma_weight)
        # the weight's descriptor (TMA), else its pointer again (the argument is not read)
        box = [plan.block_n, 32 * max(plan.diag, 1)]
        w_desc = TensorDescriptor.from_tensor(args[2], box) if tma else args[2]
        _fp8_decode_kernel[grid](*args, partials, out, counters, w_desc,
                                 cs if rope_d else args[1], m, n, k, kb,
                                 order.chunks, order.ranges, GRANULE=order.granule,
                                 BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, KSUB=plan.ksub,
                                 DOT_F16=plan.dot_f16, ALL_RANGES=all_ranges, PARTIALS=s > 1,
                                 SPLITS=s if fused else 1, PREFETCH=prefetch, TMA=tma,
                                 OUT_BF16=out.dtype == torch.bfloat16,
                                 INTERPRET=interpreting(), VALUES=plan.prescaled,
                                 ROPE_D=rope_d, ROPE_R2=cs.shape[1] if rope_d else 0,
                                 DIAG=plan.diag, SB_WORDS=_scale_words(plan, args[3]),
                                 CODE_BITS=_values_code_bits(plan, weight),
                                 num_warps=plan.num_warps,
                                 num_stages=plan.num_stages)
        if s > 1 and not fused:
            _split_sum(partials, out)
        return out
    assert out.dtype == torch.float32 or out.dtype == torch.bfloat16
    assert not rope_d or (s == 1 and out.dtype == torch.bfloat16)
    assert (x_codes.dtype == torch.bfloat16) == plan.prescaled == (weight.dtype == torch.bfloat16)
    grid = (cdiv(m, plan.block_m) * cdiv(n, plan.block_n), s)
    # TMA: descriptors of the bf16 values (else the pointers again: the arguments are not read)
    descs = (TensorDescriptor.from_tensor(args[0], [plan.block_m, FP8_BLOCK]),
             TensorDescriptor.from_tensor(args[2], [plan.block_n, FP8_BLOCK])) \
        if plan.tma else (args[0], args[2])
    _fp8_gemm_kernel[grid](*args, partials, *descs, cs if rope_d else args[1], m, n, k, kb,
                           order.chunks, order.ranges, GRANULE=order.granule,
                           BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, KSUB=plan.ksub,
                           DOT_F16=plan.dot_f16, ALL_RANGES=all_ranges,
                           PRESCALED=plan.prescaled, INTERPRET=interpreting(), TMA=plan.tma,
                           OUT_BF16=s == 1 and out.dtype == torch.bfloat16, ROPE_D=rope_d,
                           ROPE_R2=cs.shape[1] if rope_d else 0, num_warps=plan.num_warps,
                           num_stages=plan.num_stages)
    if s > 1:
        _split_sum(partials, out)
    return out


def _split_sum(partials: torch.Tensor, out: torch.Tensor) -> None:
    """out [M, N] = the fp32 partials [S, M, N] added in range order (_split_sum_kernel)."""
    s, m, n = partials.shape
    _split_sum_kernel[(cdiv(m * n, SPLIT_SUM_BLOCK),)](
        partials, out, m * n, SPLITS=s, BLOCK=SPLIT_SUM_BLOCK,
        OUT_BF16=out.dtype == torch.bfloat16, INTERPRET=interpreting(), num_warps=2)


def _check_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> None:
    if x.dim() == 0 or weight.dim() != 2 or x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"x {tuple(x.shape)} does not match weight {tuple(weight.shape)}")


def _linear_plan(m: int, weight: torch.Tensor, num_splits, precise_dot, device) -> _GemmPlan:
    """The plan fp8_linear runs for M rows of ``weight`` (e4m3 codes): ``_linear_shape_plan``
    of its shape, the device's SM count and whether TMA can read it."""
    device = torch.device(device)
    tma = _tma_weight(weight)
    return _linear_shape_plan(m, weight.shape[0], weight.shape[1] // FP8_BLOCK,
                              sm_count(device), num_splits, precise_dot, tma,
                              _square_min_m(device),
                              narrow_values=tma and m >= _swap_min_m(weight.shape[1])
                              and _swap_tiles(device, *weight.shape))


def _linear_shape_plan(m: int, n: int, kb: int, sms: int, num_splits, precise_dot,
                       tma: bool, square_min_m: int | None = None,
                       narrow_values: bool = False) -> _GemmPlan:
    """fp8_linear's plan for M rows of an [N, 32 KB] weight: act_quant's bf16 values past the
    16-row tiles (_gemm_plan's ``values``) wherever the plan reads them without a copy of the
    weight, i.e. in the decode kernel, or from square_min_m rows (where the square tiles'
    bf16 weight copy costs ~1%, or the Gluon tiles fold it in their ring); at 1-16 rows too
    where narrow_values (the Gluon swapped tiles take them: _swap_tiles); else the e4m3
    codes (fp16 values at <= 16 rows: ``_x_form``). square_min_m None: PRESCALE_MIN_M."""
    square_min_m = PRESCALE_MIN_M if square_min_m is None else square_min_m
    plan = _gemm_plan(m, n, kb, sms, num_splits, precise_dot,
                      values=m > _FP8_DECODE_TILES[0][0] or narrow_values, tma=tma,
                      square_min_m=square_min_m)
    if plan.prescaled and not plan.swap and m < square_min_m:
        plan = _gemm_plan(m, n, kb, sms, num_splits, precise_dot, tma=tma)
    return plan


def _x_form(plan: _GemmPlan) -> str:
    """The form of x a plan reads: act_quant's bf16 ``values`` (prescaled), ``f16`` values for
    the decode kernel's 16-row tiles (precise_dot: no per-block widening of the token rows),
    else the e4m3 ``codes``. The same bits from each."""
    if plan.prescaled:
        return "values"
    return "f16" if plan.swap and plan.dot_f16 and plan.block_m <= 16 else "codes"


def _act_operands(x2: torch.Tensor, plans, norm=None) -> dict:
    """act_quant of fp8_linear's rows (RMSNorm'd first with ``norm``) once per form its
    ``plans`` read: {form: (x, scales)}."""
    return {form: act_quant(x2, f16=form == "f16", dequant=form == "values", norm=norm)
            for form in dict.fromkeys(map(_x_form, plans))}


def _linear_from_quant(x_q, s, plan, weight, weight_scale, num_splits, precise_dot, out_dtype,
                       rope=None):
    """``plan`` on act_quant's output (its ``_x_form``), [M, N] in out_dtype (bf16 or fp32;
    another dtype is cast from fp32): the GEMM (or its split-K sum) rounds its fp32 result
    once, as torch's cast would. rope: (rot, head_dim, R/2), checked: the kernel turns the
    heads' tails as it stores them where it writes the output itself (``writes_out``), else
    rope_heads turns them in place after (the same bits)."""
    m, n, kb = _check_gemm(x_q, s, weight, weight_scale, num_splits, precise_dot,
                           values=plan.prescaled)
    if m * n == 0 or kb == 0:
        y = torch.zeros(m, n, dtype=out_dtype, device=x_q.device)
    else:
        direct = out_dtype in (torch.bfloat16, torch.float32)
        out = torch.empty(m, n, dtype=out_dtype if direct else torch.float32,
                          device=x_q.device)
        if rope is not None and plan.writes_out and \
                not _square_ws(plan, x_q, weight, weight_scale, out) and \
                not _swap_ws(plan, x_q, weight, out):
            return _run_fp8_gemm(plan, x_q, s, weight, weight_scale, out, cos_sin(rope[0]),
                                 rope[1])
        y = _run_fp8_gemm(plan, x_q, s, weight, weight_scale, out)
        y = y if direct else y.to(out_dtype)
    if rope is not None and y.numel():
        rope_heads(y.view(m, n // rope[1], rope[1]), rope[0], in_place=True)
    return y


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, *,
               num_splits: int | None = None, precise_dot: bool = True,
               out_dtype: torch.dtype = torch.bfloat16,
               norm: tuple[torch.Tensor, float] | None = None,
               rope: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """y = x W^T for an fp8 weight: act_quant(x) then the blockwise fp8 GEMM (docs/numerics.md §4).
    norm: (weight, eps): y = rms_norm(x, weight, eps) W^T, the norm inside act_quant's launch
    (the same bits as common.triton.rms_norm, then this).

    x: [..., K] bf16; weight [N, K] float8_e4m3fn; weight_scale [ceil(N/32), K/32]
    float8_e8m0fnu; num_splits: fp8_gemm's K ranges (None: from N, K and the SM count);
    precise_dot: fp8_gemm's
    (default True: fp16 operands to the GPU's tl.dot). Returns [..., N] in ``out_dtype``
    (bf16, or torch.float32: the GEMM's fp32 result, as a tensor-parallel wo_b partial needs).
    Decode sizes (M <= SPLIT_MAX_M) have the GEMM write out_dtype itself (no cast launch);
    M <= 16 (precise_dot) also quantises x to fp16 values and sums the split-K partials in the
    GEMM's last program: two launches in all (act_quant, the GEMM), the same bits. From
    PRESCALE_MIN_M rows (precise_dot) act_quant writes x's bf16 values and the GEMM reads them
    and the weight's bf16 values (a copy made per call), the same bits again. rope: (rot [M,
    R/2] complex64, head_dim): the query's RoPE on the output's heads, as the reference's
    (applied as the decode kernel stores the output where it writes it itself: no launch of
    its own; else by rope_heads in place after).
    """
    _check_linear(x, weight, weight_scale)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if rope is not None:
        rope = check_rope(rope, x2.shape[0], weight.shape[0], out_dtype)
        check_device(x, rope[0])
    plan = _linear_plan(x2.shape[0], weight, num_splits, precise_dot, x.device)
    x_q, s = _act_operands(x2, [plan], norm)[_x_form(plan)]
    y = _linear_from_quant(x_q, s, plan, weight, weight_scale, num_splits, precise_dot,
                           out_dtype, rope)
    return y.reshape(*lead, weight.shape[0])


def fp8_input_form(m: int, weight: torch.Tensor) -> str:
    """The form fp8_linear quantises an [m, K] input of ``weight`` to (its plan's _x_form):
    "f16" (act_quant's f16 codes: the decode tiles up to 16 rows), "codes" or "values"."""
    return _x_form(_linear_plan(m, weight, None, True, weight.device))


def fp8_linear_quantized(x_q: torch.Tensor, s: torch.Tensor, weight: torch.Tensor,
                         weight_scale: torch.Tensor) -> torch.Tensor:
    """fp8_linear's GEMM on an input quantised already: x_q [M, K], s [M, K / 32] as
    act_quant(x, f16=True) makes them, where fp8_input_form(M, weight) is "f16" (elsewhere a
    ValueError): fp8_linear(x, weight, weight_scale)'s bf16 [M, N], bit for bit, one launch
    fewer."""
    _check_linear(x_q, weight, weight_scale)
    require(x_q.dim() == 2, f"x_q must be [M, K], got {tuple(x_q.shape)}")
    plan = _linear_plan(x_q.shape[0], weight, None, True, x_q.device)
    form = _x_form(plan)
    require(form == "f16", f"fp8_linear_quantized runs act_quant's f16 form, but {x_q.shape[0]} "
            f"rows of a {tuple(weight.shape)} weight read its {form!r} form")
    return _linear_from_quant(x_q, s, plan, weight, weight_scale, None, True, torch.bfloat16)


def fp8_linear_pair(x: torch.Tensor, w1: torch.Tensor, s1: torch.Tensor, w2: torch.Tensor,
                    s2: torch.Tensor, *, precise_dot: bool = True,
                    out_dtype: torch.dtype = torch.bfloat16,
                    norm: tuple[torch.Tensor, float] | None = None,
                    rope: tuple[torch.Tensor, int] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8_linear(x, w1, s1, norm=norm, rope=rope), fp8_linear(x, w2, s2, norm=norm)) with one
    act_quant of x (wq_b and the index wq_b share the query's qr): the same bits as the two
    calls, one launch fewer. rope turns the first output only (the query's heads)."""
    _check_linear(x, w1, s1)
    _check_linear(x, w2, s2)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if rope is not None:
        rope = check_rope(rope, x2.shape[0], w1.shape[0], out_dtype)
        check_device(x, rope[0])
    plans = [_linear_plan(x2.shape[0], w, None, precise_dot, x.device) for w in (w1, w2)]
    xs = _act_operands(x2, plans, norm)
    y1, y2 = (_linear_from_quant(*xs[_x_form(p)], p, w, sc, None, precise_dot, out_dtype, r)
              for p, w, sc, r in zip(plans, (w1, w2), (s1, s2), (rope, None)))
    return y1.reshape(*lead, w1.shape[0]), y2.reshape(*lead, w2.shape[0])


# ---- bf16 / fp32 weights: dense_linear -------------------------------------------------------

DENSE_BLOCK_K = {torch.bfloat16: 64, torch.float32: 32}  # K step per weight dtype (fixed)
# (largest M, BLOCK_M, BLOCK_N, warps, stages) by M, per weight dtype: bf16 on wgmma at every M
# (as _FP8_TILES); fp32 runs tl.dot's IEEE fp32 path (FMAs in K order, any tile)
_DENSE_TILES = {torch.bfloat16: ((SPLIT_MAX_M, 64, 64, 4, 4), (None, 128, 128, 8, 3)),
                torch.float32: ((16, 16, 64, 4, 3), (None, 64, 64, 4, 3))}
# an fp32 weight on bf16 x (PIECES: three bf16 dots a K step): wgmma at every M, as bf16's
_DENSE_PIECES_TILES = ((None, 64, 64, 4, 3),)


@triton.jit
def _pieces_dot(a, w, INTERPRET: tl.constexpr):
    """a [BM, BK] bf16 times w [BK, BN] fp32 as one fp32 [BM, BN]: w cut exactly into three
    parts of at most 8 significant bits each (hi: w truncated to bf16; mid: the rest truncated
    to bf16; lo: what remains, which bf16 holds), so every product a * part is exact in fp32
    and a bf16 tensor-core dot takes it; lo's dot first, mid's and hi's each into the fp32
    accumulator of the one before. Non-finite w gives NaN (inf - inf). Under the interpreter
    (whose tl.dot misreads bf16) each dot is summed in fp64 from the exact products and
    rounded to fp32."""
    hi = (w.to(tl.uint32, bitcast=True) & 0xFFFF0000).to(tl.float32, bitcast=True)
    rest = w - hi  # exact: the bits of w below hi's
    mid = (rest.to(tl.uint32, bitcast=True) & 0xFFFF0000).to(tl.float32, bitcast=True)
    lo = rest - mid  # exact, and within bf16's 8 bits
    if INTERPRET:
        a64 = a.to(tl.float32).to(tl.float64)
        p = tl.dot(a64, lo.to(tl.float64), out_dtype=tl.float64).to(tl.float32)
        p = (p.to(tl.float64) + tl.dot(a64, mid.to(tl.float64), out_dtype=tl.float64)
             ).to(tl.float32)
        p = (p.to(tl.float64) + tl.dot(a64, hi.to(tl.float64), out_dtype=tl.float64)
             ).to(tl.float32)
    else:
        p = tl.dot(a, lo.to(tl.bfloat16))
        p = tl.dot(a, mid.to(tl.bfloat16), p)
        p = tl.dot(a, hi.to(tl.bfloat16), p)
    return p


@triton.jit
def _dense_gemm_kernel(x_ptr, w_ptr, c_ptr, M, NG, KG, XK, CN, CHUNKS, RANGES,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       FP64: tl.constexpr, ALL_RANGES: tl.constexpr, FINAL: tl.constexpr,
                       INTERPRET: tl.constexpr, PIECES: tl.constexpr = False):
    """c[m, g*NG + n] = sum_k x[m, g*KG + k] w[g*NG + n, k]: x [M, XK] (group g reads its
    columns g*KG ..), w [G*NG, KG], both bf16 (fp32 accumulator) or w fp32 (FP64: each K step
    one fp32 sum, the steps added in an fp64 accumulator; Triton 3.6 has no fp64 tl.dot):
    PIECES, x bf16: _pieces_dot's three bf16 tensor-core dots; else x fp32 too, one IEEE fp32
    FMA chain in K order (under the interpreter, whose fp32 matmul rounds by shape, an fp64
    dot). All contiguous. Grid (cdiv(M, BLOCK_M), G * cdiv(NG, BLOCK_N),
    S). K is CHUNKS = cdiv(KG, BLOCK_K) steps in RANGES ranges (range r: steps [r * CHUNKS //
    RANGES, (r + 1) * CHUNKS // RANGES)), each chained through one accumulator in K order from
    0; ALL_RANGES (S = 1) adds the ranges in order into a second one, else program z makes
    range z. FINAL: c is the output [M, CN] (bf16; fp32 rounded once from fp64 when FP64),
    else [S, M, CN] partials in the accumulator's dtype for _dense_sum_kernel."""
    n_tiles = tl.cdiv(NG, BLOCK_N)
    g = tl.program_id(1) // n_tiles
    offs_n = (tl.program_id(1) % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < NG
    cols = (g * NG + offs_n).to(tl.int64)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    rows = offs_m.to(tl.int64)
    split = tl.program_id(2)
    acc_ty = tl.float64 if FP64 else tl.float32
    if ALL_RANGES:
        lo = 0
        hi = CHUNKS
        r = 0
        r_end = CHUNKS // RANGES
        total = neg_zeros([BLOCK_M, BLOCK_N], acc_ty)  # -0 + p == p: as a partial's copy
    else:
        lo = split * CHUNKS // RANGES
        hi = (split + 1) * CHUNKS // RANGES
    offs_k = tl.arange(0, BLOCK_K)
    x_row = x_ptr + rows[:, None] * XK + g * KG
    w_col = w_ptr + cols[None, :] * KG
    acc = tl.zeros([BLOCK_M, BLOCK_N], acc_ty)
    for step in range(lo, hi):
        k = step * BLOCK_K + offs_k
        k_mask = k < KG
        a = tl.load(x_row + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(w_col + k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if PIECES:  # x's bf16 values times the fp32 weight's three bf16 parts
            acc += _pieces_dot(a, b, INTERPRET).to(tl.float64)
        elif FP64 and INTERPRET:  # numpy's fp32 matmul rounds by shape; fp64 products are exact
            acc += tl.dot(a.to(tl.float64), b.to(tl.float64), out_dtype=tl.float64)
        elif FP64:  # one fp32 FMA chain per K step (IEEE, in K order), the steps summed in fp64
            acc += tl.dot(a, b, input_precision="ieee").to(tl.float64)
        elif INTERPRET:  # its tl.dot misreads bf16 (common.triton.to_bf16), and its fp32 matmul
            # rounds by shape: each step's sum of (exact) products in fp64, rounded to fp32
            a64 = a.to(tl.float32).to(tl.float64)
            b64 = b.to(tl.float32).to(tl.float64)
            acc += tl.dot(a64, b64, out_dtype=tl.float64).to(tl.float32)
        else:
            acc = tl.dot(a, b, acc)
        if ALL_RANGES:
            if step + 1 == r_end:  # range r is complete: add it, start range r + 1 from 0
                total += acc
                acc = tl.zeros([BLOCK_M, BLOCK_N], acc_ty)
                r += 1
                r_end = (r + 1) * CHUNKS // RANGES
    if ALL_RANGES:
        acc = total
    mask = m_mask[:, None] & n_mask[None, :]
    if FINAL:
        if FP64:
            y = acc.to(tl.float32)
        else:
            y = to_bf16(acc, INTERPRET).to(tl.bfloat16)
        tl.store(c_ptr + rows[:, None] * CN + cols[None, :], y, mask=mask)
    else:
        tl.store(c_ptr + (split * M + rows)[:, None] * CN + cols[None, :], acc, mask=mask)


@triton.jit
def _dense_sum_kernel(part_ptr, out_ptr, NUMEL, S, FP64: tl.constexpr, BLOCK: tl.constexpr,
                      INTERPRET: tl.constexpr):
    """out[i] = round(sum_s part[s, i]), s in order: part [S, NUMEL] fp32 -> bf16 out, or fp64
    -> fp32 out when FP64."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < NUMEL
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for s in range(1, S):
        acc += tl.load(part_ptr + s * NUMEL + offs, mask=mask, other=0.0)
    if FP64:
        y = acc.to(tl.float32)
    else:
        y = to_bf16(acc, INTERPRET).to(tl.bfloat16)
    tl.store(out_ptr + offs, y, mask=mask)


@triton.jit
def _pow2(d):
    """2^d as fp32 for int32 d in -126..127 (an exponent field 1..254: exact, normal)."""
    return ((d + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _rescaled_steps(acc, w_desc, x_row, s_row, row0, lo, hi, KG, n_mask, m_mask, offs_n,
                    INTERPRET: tl.constexpr, CODE_BITS: tl.constexpr = False):
    """K steps lo .. hi - 1 of _dense_fp8_kernel (RESCALED: one range; acc: [BLOCK_N,
    BLOCK_M] fp32 zeros) from the weight's unscaled e4m3 values: each 32-block's dot runs on
    the codes as they are, and the accumulator holds the sum so far times 2^-s (s: the scale
    exponent of the row's current block), brought to the next block's scale by one power of two
    before its dot and to 1 after the last. Scaling every addend and the sum by one power of
    two changes no bit of the hardware's fp32 sum while all stay in fp32's normal range, and
    the factors are exact (the caller checked the scale bytes: rescalable_scales); so the same
    bits as the scaled operands' chain. Why: the operand then reaches the wgmma straight from
    its shared-memory load, with no per-element scale select and no layout change through shared
    memory (H100, V4.1-Flash wo_a at 1-16 rows: 20.5 -> 18.2 us). w_desc: [BLOCK_N, 32] boxes.
    CODE_BITS (a weight without NaN codes: the caller checked): the codes become bf16 by their
    bits (E4M3_BF16_BITS_ASM: integer ops and one bf16 FMA a pair) instead of through the
    conversion units (an e4m3 -> f16 unpack a pair and an f16 -> bf16 conversion an element,
    16 results a clock an SM, which bound this kernel at 1-16 rows): the same bf16 values.
    Under the interpreter: each step's exact sum in fp64 of the scaled values, as the other
    branch makes it."""
    half = tl.arange(0, 32)
    e_prev = tl.load(s_row + 2 * lo, mask=n_mask, other=127).to(tl.int32)
    for step in range(lo, hi):
        if INTERPRET:
            step_sum = tl.zeros(acc.shape, tl.float64)
        for h in tl.static_range(2):
            kb = 2 * step + h
            e = tl.load(s_row + kb, mask=n_mask & (offs_n * 0 + kb * 32 < KG),
                        other=127).to(tl.int32)
            codes = w_desc.load([row0, kb * 32])
            kk = kb * 32 + half
            x = tl.load(x_row + kk[None, :], mask=m_mask[:, None] & (kk < KG)[None, :],
                        other=0.0)
            if INTERPRET:
                w = e4m3_to_fp32(codes) * e8m0_to_fp32(e)[:, None]
                step_sum += tl.dot(w.to(tl.float64), tl.trans(x.to(tl.float32).to(tl.float64)),
                                   out_dtype=tl.float64)
            else:
                acc = acc * _pow2(e_prev - e)[:, None]
                if CODE_BITS:  # exact but for NaN codes (none: the caller checked)
                    w = tl.inline_asm_elementwise(_E4M3_BF16_ASM, "=r,h", [codes],
                                                  dtype=tl.bfloat16, is_pure=True, pack=2)
                else:
                    w = e4m3_to_fp32(codes).to(tl.bfloat16)
                acc = tl.dot(w, tl.trans(x), acc)
            e_prev = e
        if INTERPRET:
            acc += step_sum.to(tl.float32)
    if not INTERPRET:
        acc = acc * _pow2(e_prev - 127)[:, None]
    return acc


@triton.jit
def _store_out_tile(out_ptr, q_ptr, qs_ptr, y, mn, mask, rows, m_mask, col0, cols_left, CN,
                    inv_max, QUANT: tl.constexpr, INTERPRET: tl.constexpr):
    """_dense_fp8_kernel's output tile y [BLOCK_N columns, BLOCK_M rows] fp32 (at mn, masked)
    rounded to bf16 into out [M, CN]; QUANT: also act_quant's F16 form of those bf16 values
    (_quant_blocks on each row's 32-column blocks: their e4m3 codes' values as fp16 into q
    [M, CN], their scales into qs [M, CN / 32]), the input of the fp8 linear that reads out
    next, with act_quant's bits. The tile's first column col0 and its blocks are 32-aligned
    (the caller checked); cols_left: its columns in range."""
    yb = to_bf16(y, INTERPRET)
    tl.store(out_ptr + mn, yb.to(tl.bfloat16), mask=mask)
    if QUANT:
        bn: tl.constexpr = y.shape[0]
        bm: tl.constexpr = y.shape[1]
        v = tl.reshape(tl.trans(yb.to(tl.float32)), (bm * bn // 32, 32))  # a row's blocks
        code, sc = _quant_blocks(v, inv_max)
        tl.store(q_ptr + tl.trans(mn), tl.reshape(_e4m3_value(code), (bm, bn)).to(tl.float16),
                 mask=tl.trans(mask))
        blk = tl.arange(0, bn // 32)
        tl.store(qs_ptr + rows[:, None] * (CN // 32) + (col0 // 32 + blk)[None, :],
                 tl.reshape(sc, (bm, bn // 32)),
                 mask=m_mask[:, None] & (blk * 32 < cols_left)[None, :])


@triton.jit
def _dense_fp8_kernel(x_ptr, w_ptr, s_ptr, w_desc, out_ptr, part_ptr, cnt_ptr, M, NG, KG, XK,
                      CN, SK, CHUNKS, RANGES, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      SPLITS: tl.constexpr, ALL_RANGES: tl.constexpr, TMA: tl.constexpr,
                      RESCALED: tl.constexpr, INTERPRET: tl.constexpr,
                      CODE_BITS: tl.constexpr = False, q_ptr=None, qs_ptr=None, inv_max=1.0,
                      QUANT: tl.constexpr = False):
    """_dense_gemm_kernel's bf16 GEMM (the same K steps of 64, the same fp32 chain, the same
    ranges) for a weight held as e4m3 codes with e8m0 32x32 block scales, read as its bytes:
    each step's [BLOCK_N, 64] codes times their two block scales are the weight's bf16 values
    exactly (what Fp8Weight.dequantize makes), fed to the wgmma from registers on its 64-row
    side, the BLOCK_M token rows on its narrow side (the operands swapped, as _fp8_decode_kernel:
    the same products in the same K order, so dense_linear's bits on the dequantised weight).
    x: [M, XK] bf16 (group g reads its columns g*KG ..); w: [G*NG, KG] uint8 codes, or w_desc
    (TMA) its descriptor with [BLOCK_N, 64] boxes; s: [cdiv(G*NG, 32), SK] uint8 e8m0; out:
    [M, CN] bf16. Grid (G * cdiv(NG, BLOCK_N), S, cdiv(M, BLOCK_M)): program (n, z, m) makes
    range z (S = SPLITS = RANGES: its fp32 partial into part [S, M, CN], and the tile's last
    program to finish, by the counter in cnt, adds them in range order, writes out and resets
    the counter) or every range in turn (ALL_RANGES, S = 1). RESCALED (TMA with [BLOCK_N, 32]
    boxes, not ALL_RANGES): the steps as _rescaled_steps runs them, CODE_BITS its codes by
    their bits. QUANT: the output also act-quantised for the next fp8 linear (_store_out_tile:
    q [M, CN] fp16, qs [M, CN / 32] fp32, inv_max 1/448)."""
    BLOCK_K: tl.constexpr = 64
    n_tiles = tl.cdiv(NG, BLOCK_N)
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    pid_m = tl.program_id(2)
    g = pid_n // n_tiles
    n0 = (pid_n % n_tiles) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < NG
    wrows = (g * NG + offs_n).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    rows = offs_m.to(tl.int64)
    if ALL_RANGES:
        lo = 0
        hi = CHUNKS
        r = 0
        r_end = CHUNKS // RANGES
        total = neg_zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        lo = split * CHUNKS // RANGES
        hi = (split + 1) * CHUNKS // RANGES
    offs_k = tl.arange(0, BLOCK_K)
    second = (offs_k >= 32)[None, :]  # the step's second 32-block
    x_row = x_ptr + rows[:, None] * XK + g * KG
    w_row = w_ptr + wrows[:, None] * KG
    s_row = s_ptr + (wrows // 32) * SK
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    if RESCALED:
        acc = _rescaled_steps(acc, w_desc, x_row, s_row, g * NG + n0, lo, hi, KG, n_mask,
                              m_mask, offs_n, INTERPRET, CODE_BITS)
    else:
        for step in range(lo, hi):
            k = step * BLOCK_K + offs_k
            k_mask = k < KG
            if TMA:
                codes = w_desc.load([g * NG + n0, step * BLOCK_K])
            else:
                codes = tl.load(w_row + k[None, :], mask=n_mask[:, None] & k_mask[None, :],
                                other=0)
            s0 = e8m0_to_fp32(tl.load(s_row + 2 * step, mask=n_mask, other=127).to(tl.int32))
            s1 = e8m0_to_fp32(tl.load(s_row + 2 * step + 1,
                                      mask=n_mask & (offs_n * 0 + (2 * step + 1) * 32 < KG),
                                      other=127)
                              .to(tl.int32))
            w = e4m3_to_fp32(codes) * tl.where(second, s1[:, None], s0[:, None])  # exact
            x = tl.load(x_row + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            if INTERPRET:  # as _dense_gemm_kernel's: each step's exact sum in fp64, to fp32
                a64 = x.to(tl.float32).to(tl.float64)
                acc += tl.dot(w.to(tl.float64), tl.trans(a64), out_dtype=tl.float64).to(tl.float32)
            else:
                acc = tl.dot(w.to(tl.bfloat16), tl.trans(x), acc)
            if ALL_RANGES:
                if step + 1 == r_end:  # range r is complete: add it, start range r + 1 from 0
                    total += acc
                    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
                    r += 1
                    r_end = (r + 1) * CHUNKS // RANGES
    if ALL_RANGES:
        acc = total
    mn = rows[None, :] * CN + wrows[:, None]  # [BLOCK_N, BLOCK_M]
    mask = n_mask[:, None] & m_mask[None, :]
    if SPLITS > 1:
        last, y = _last_range_sum(part_ptr, acc, mn, mask, split, M * CN,
                                  cnt_ptr + pid_m * tl.num_programs(0) + pid_n, SPLITS)
        if last:  # the ranges in order, as _dense_sum_kernel
            _store_out_tile(out_ptr, q_ptr, qs_ptr, y, mn, mask, rows, m_mask, g * NG + n0,
                            NG - n0, CN, inv_max, QUANT, INTERPRET)
    else:
        _store_out_tile(out_ptr, q_ptr, qs_ptr, acc, mn, mask, rows, m_mask, g * NG + n0,
                        NG - n0, CN, inv_max, QUANT, INTERPRET)


@dataclass(frozen=True)
class _DensePlan:
    """Launch parameters of one dense_linear shape: ``order`` from the weight's shape and the
    SM count alone, the tiles and where the ranges run from M."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    order: KOrder
    workspace: bool
    pieces: bool = False  # an fp32 weight on bf16 x: _pieces_dot's three bf16 dots a K step

    @property
    def splits(self) -> int:
        return self.order.ranges if self.workspace else 1


def _dense_order(n_group: int, k_group: int, groups: int, dtype: torch.dtype, sms: int,
                 num_splits: int | None = None) -> KOrder:
    """dense_linear's K order for a [groups * n_group, k_group] weight: steps of
    DENSE_BLOCK_K[dtype] in ``k_order`` ranges, from the weight's shape and the SM count alone
    (num_splits forces the range count)."""
    return k_order(groups * cdiv(n_group, 64), cdiv(k_group, DENSE_BLOCK_K[dtype]),
                   sms, granules=(1,), ranges=num_splits)


def _dense_plan(m: int, n_group: int, k_group: int, groups: int, dtype: torch.dtype, sms: int,
                num_splits: int | None = None, workspace: bool | None = None,
                pieces: bool = False) -> _DensePlan:
    """K steps of DENSE_BLOCK_K[dtype] in ``k_order`` ranges (from the weight's shape and the
    SM count; num_splits forces the count, 1 <= it <= the K steps), tiles by M (pieces: an
    fp32 weight on bf16 x, _DENSE_PIECES_TILES), ranges as separate programs while that fills
    idle SMs at a small traffic cost (``_use_workspace``; ``workspace`` forces it either way)."""
    bk = DENSE_BLOCK_K[dtype]
    order = _dense_order(n_group, k_group, groups, dtype, sms, num_splits)
    table = _DENSE_PIECES_TILES if pieces else _DENSE_TILES[dtype]
    bm, bn, warps, stages = _tile_row(table, m)
    if workspace is None:
        tiles = cdiv(m, bm) * groups * cdiv(n_group, bn)
        if dtype == torch.float32:  # FMA-bound, not weight-bound: split K while SMs idle
            workspace = tiles < sms  # (H200, 512 x 5120, M = 8: 8 tiles alone ran ~1 ms)
        else:
            workspace = _use_workspace(order, tiles, m, groups * n_group,
                                       groups * n_group * k_group * 2, sms)
    return _DensePlan(bm, bn, bk, warps, stages, order, bool(workspace) and order.ranges > 1,
                      pieces)


def _grouped_input(x: torch.Tensor, shape: tuple[int, int], groups, dtype: torch.dtype):
    """dense_linear's and dense_fp8_linear's input checks for a weight of ``shape`` [groups *
    Ng, Kg]: (leading dims of x, x as a contiguous [rows, groups * Kg] ``dtype`` tensor, Ng).
    Raises ValueError naming the bad value."""
    require(isinstance(groups, int) and not isinstance(groups, bool) and groups >= 1
            and shape[0] % groups == 0,
            f"groups must be a positive int dividing {shape[0]} rows, got {groups!r}")
    kg = shape[1]
    require(isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[-1] == groups * kg
            and x.is_floating_point(),
            f"x {tuple(getattr(x, 'shape', ()))} does not match weight {tuple(shape)} "
            f"in {groups} groups (want [..., {groups * kg}])")
    lead = x.shape[:-1]
    return lead, x.reshape(lead.numel(), x.shape[-1]).to(dtype).contiguous(), shape[0] // groups


def _check_splits(num_splits, k_group: int, dtype: torch.dtype) -> None:
    steps = cdiv(k_group, DENSE_BLOCK_K[dtype])
    require(num_splits is None or 1 <= num_splits <= steps,
            f"num_splits = {num_splits} is not in [1, {steps}] (K steps)")


def dense_linear(x: torch.Tensor, weight: torch.Tensor, groups: int = 1, *,
                 num_splits: int | None = None, workspace: bool | None = None) -> torch.Tensor:
    """y = x W^T for a bf16 or fp32 weight, block-diagonal over ``groups``, in a summation
    order fixed by the weight's shape (never by the row count).

    x: [..., groups * Kg], cast to the weight's dtype (as reference.linear); weight:
    [groups * Ng, Kg] bf16 or fp32, contiguous; y[..., g*Ng + n] = sum_k x[..., g*Kg + k]
    w[g*Ng + n, k]. bf16: bf16 products (tl.dot), fp32 accumulation, bf16 out (torch's
    F.linear up to the fp32 summation order). fp32: each 32-wide K step summed in fp32 (for a
    bf16 x by three bf16 tensor-core dots on the weight cut exactly into three bf16 parts,
    every product exact: _pieces_dot; else by fp32 FMAs in K order), the steps in fp64,
    rounded once to fp32 (within about an fp32 ulp of reference.linear's correctly rounded
    product). num_splits,
    workspace: the K ranges and where they run, as fp8_gemm's (None: by shape; the same bits
    either way). Returns [..., groups * Ng] in the weight's dtype.
    """
    require(isinstance(weight, torch.Tensor) and weight.dim() == 2
            and weight.dtype in DENSE_BLOCK_K,
            f"weight must be a 2-D bf16 or fp32 tensor, got {getattr(weight, 'dtype', None)} "
            f"{tuple(getattr(weight, 'shape', ()))}")
    # an fp32 weight on bf16 x: x's values as they are, the weight's in three bf16 parts
    pieces = weight.dtype == torch.float32 and getattr(x, "dtype", None) == torch.bfloat16
    lead, x2, ng = _grouped_input(x, tuple(weight.shape), groups,
                                  torch.bfloat16 if pieces else weight.dtype)  # K = 0 too
    kg = weight.shape[1]
    check_device(x, weight)
    m = x2.shape[0]
    out = torch.empty(m, groups * ng, dtype=weight.dtype, device=x.device)
    if out.numel() == 0:
        return out.reshape(*lead, groups * ng)
    if kg == 0:
        return out.zero_().reshape(*lead, groups * ng)
    _check_splits(num_splits, kg, weight.dtype)
    plan = _dense_plan(m, ng, kg, groups, weight.dtype, sm_count(x.device), num_splits,
                       workspace, pieces)
    return _run_dense(plan, x2, weight.contiguous(), groups, out).reshape(*lead, groups * ng)


def _run_dense(plan: _DensePlan, x: torch.Tensor, weight: torch.Tensor, groups: int,
               out: torch.Tensor) -> torch.Tensor:
    """Launch ``plan`` on dense_linear's checked, contiguous operands, into ``out``."""
    m = x.shape[0]
    kg, ng = weight.shape[1], weight.shape[0] // groups
    fp64 = weight.dtype == torch.float32
    assert plan.pieces == (fp64 and x.dtype == torch.bfloat16)
    s = plan.splits
    target = out if s == 1 else torch.empty(
        s, m, groups * ng, dtype=torch.float64 if fp64 else torch.float32, device=out.device)
    order, interp = plan.order, interpreting()
    grid = (cdiv(m, plan.block_m), groups * cdiv(ng, plan.block_n), s)
    _dense_gemm_kernel[grid](x, weight, target, m, ng, kg, x.shape[1], groups * ng,
                             order.chunks, order.ranges, BLOCK_M=plan.block_m,
                             BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, FP64=fp64,
                             ALL_RANGES=order.ranges > 1 and s == 1, FINAL=s == 1,
                             INTERPRET=interp, PIECES=plan.pieces, num_warps=plan.num_warps,
                             num_stages=plan.num_stages)
    if s > 1:
        block = 1024
        _dense_sum_kernel[(cdiv(out.numel(), block),)](
            target, out, out.numel(), s, FP64=fp64, BLOCK=block, INTERPRET=interp)
    return out


# dense_fp8_linear's tiles by M: (largest M, BLOCK_M, BLOCK_N, warps, stages); the codes through
# TMA (where the weight allows it) up to DENSE_FP8_TMA_MAX_M rows, which also lets the rescaled
# tiles (and so DENSE_CODE_BITS) run. H100, V4.1-Flash wo_a ([8192, 4096], 8 groups), CUDA
# graphs, us at M = 1 / 16 (64): 16 x 64 tiles, 3 stages, TMA 19.8 / 20.5 (2 stages 25.7 / 26.7
# without TMA, 4 20.6 / 21.0, 6 21.8 / 22.0; 128 weight rows 21.4-23.1); at M = 64, 64 x 64
# tiles, plain loads 28.2 (TMA 35.1, before the rescaled tiles; 128 weight rows on 8 warps,
# TMA, 29.3). The same bits in every one. Past 16 rows the step-sized mode runs torch's bf16
# GEMM instead (WO_A_STEP_CODES_MAX_ROWS: 25.5-28 us at 17-64 rows on the H100); the rescaled
# tiles by their bits at 64 rows are not yet timed (bench --part gemm's wo_a rows with
# ops.linear.triton.DENSE_FP8_TMA_MAX_M=64,ops.linear.triton.DENSE_CODE_BITS=1).
DENSE_FP8_TILES = ((16, 16, 64, 4, 3), (None, 64, 64, 4, 3))
DENSE_FP8_TMA_MAX_M = 16
# The rescaled tiles turn the codes into bf16 by their bits (_rescaled_steps' CODE_BITS) on a
# weight without NaN codes (nan_free_codes): the same bf16 values, with integer ops and one bf16
# FMA a pair instead of the conversion units, which bound wo_a's codes at 1-16 rows (about 19
# us on an H100 or an H200 for 34 MB, 11 us of bytes). Compiled, not yet timed: off until a GPU
# times it (bench --part gemm --rows 1,8,16 --variant base --variant
# bits:ops.linear.triton.DENSE_CODE_BITS=1) and its GPU test passes.
DENSE_CODE_BITS = False


def _dense_code_bits(rescaled: bool, weight: torch.Tensor) -> bool:
    """Whether dense_fp8_linear's tiles turn this weight's codes into bf16 by their bits: its
    rescaled tiles run, DENSE_CODE_BITS, on a GPU, no NaN code in the weight (nan_free_codes:
    a host sync the first time a weight is asked). The same bits either way."""
    return bool(rescaled and DENSE_CODE_BITS and not interpreting()
                and weight.device.type == "cuda" and nan_free_codes(weight))


def rescalable_scales(scale: torch.Tensor) -> bool:
    """Whether dense_fp8_linear(..., rescaled=True) may run on these e8m0 block scales [.., KB]
    (its accumulator steps from one block's scale to the next by exact powers of two): every
    byte in 1..254 (no 2^-127, no NaN) and neighbours along K at most 126 apart. A host sync:
    check once per weight (prepare_wo_a does)."""
    e = scale.view(torch.uint8).to(torch.int16)
    return bool(((e >= 1) & (e <= 254)).all()) and \
        bool(((e[:, 1:] - e[:, :-1]).abs() <= 126).all())


def dense_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                     groups: int = 1, *, num_splits: int | None = None,
                     tiles: tuple | None = None, tma: bool | None = None,
                     rescaled: bool = False,
                     out: torch.Tensor | None = None,
                     quant_out: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``dense_linear(x, Fp8Weight(weight, scale).dequantize(), groups)``, the same bits,
    reading the weight's e4m3 bytes and e8m0 block scales instead of its bf16 copy: half the
    weight bytes, for the sizes a weight's bytes bound (decode). The K steps, ranges and fp32
    chain are dense_linear's; only the operands' roles in the MMA differ (_dense_fp8_kernel).

    x: [..., groups * Kg] (cast to bf16); weight: float8_e4m3fn [groups * Ng, Kg]; scale:
    float8_e8m0fnu [cdiv(groups * Ng, 32), cdiv(Kg, 32)]. num_splits: dense_linear's. tiles:
    (BLOCK_M, BLOCK_N, warps, stages), None = DENSE_FP8_TILES by M (for tuning; the same bits
    at any); tma: read the codes through a TMA descriptor (None: up to DENSE_FP8_TMA_MAX_M
    rows, where _tma_weight allows); rescaled: the caller checked the scales (rescalable_scales),
    so TMA tiles whose ranges run as separate programs take the weight's unscaled codes and
    keep their accumulator in the current block's scale (_rescaled_steps: the same bits while
    every product and partial sum stays in fp32's normal range, about 11% faster at 1-16 rows
    on wo_a; with DENSE_CODE_BITS, on a GPU and a weight without NaN codes, they turn the
    codes into bf16 by their bits); out: a contiguous bf16 [rows of x, groups * Ng] to write into;
    quant_out: (q, s), contiguous fp16 [rows of x, groups * Ng] and fp32 [rows of x, groups *
    Ng / 32] (Ng a multiple of 32): the kernel also writes act_quant(output, f16=True) into
    them, act_quant's bits, so the fp8 linear that reads this output next needs no launch to
    quantise it.
    The ranges run as separate programs while the tiles leave SMs idle, the last to finish
    adding them. Returns [..., groups * Ng] bf16.
    """
    require(isinstance(weight, torch.Tensor) and weight.dim() == 2
            and weight.dtype == torch.float8_e4m3fn,
            f"weight must be a 2-D float8_e4m3fn tensor, got {getattr(weight, 'dtype', None)} "
            f"{tuple(getattr(weight, 'shape', ()))}")
    rows, kg = weight.shape
    want = (cdiv(rows, FP8_BLOCK), cdiv(kg, FP8_BLOCK))
    require(isinstance(scale, torch.Tensor) and scale.dtype == torch.float8_e8m0fnu
            and tuple(scale.shape) == want,
            f"scale must be float8_e8m0fnu {list(want)} for a weight {[rows, kg]}, got "
            f"{getattr(scale, 'dtype', None)} {tuple(getattr(scale, 'shape', ()))}")
    lead, x2, ng = _grouped_input(x, (rows, kg), groups, torch.bfloat16)
    check_device(x, weight, scale)
    m = x2.shape[0]
    out = out_buffer(out, (m, rows), torch.bfloat16, x.device)
    q, qs = (out, out) if quant_out is None else _check_quant_out(quant_out, m, rows, ng, out)
    if out.numel() == 0:
        return out.reshape(*lead, rows)
    if kg == 0:  # zeros, and their quantisation where asked
        out.zero_()
        if quant_out is not None:
            for buf, made in zip(quant_out, act_quant(out, f16=True)):
                buf.copy_(made)
        return out.reshape(*lead, rows)
    _check_splits(num_splits, kg, torch.bfloat16)
    sms = sm_count(x.device)
    order = _dense_order(ng, kg, groups, torch.bfloat16, sms, num_splits)
    bm, bn, warps, stages = _tile_row(DENSE_FP8_TILES, m)
    tma_tile = m <= DENSE_FP8_TMA_MAX_M
    if tiles is not None:
        bm, bn, warps, stages = tiles
    grid_n, grid_m = groups * cdiv(ng, bn), cdiv(m, bm)
    split = order.ranges > 1 and grid_n * grid_m < sms
    s = order.ranges if split else 1
    w = weight.contiguous()
    tma_ok = _tma_weight(w) and kg % 16 == 0  # TMA: 16-byte row strides
    require(not tma or tma_ok, f"tma=True, but this weight {[rows, kg]} cannot be read through "
            f"a TMA descriptor (it needs a contiguous, 16-byte-aligned tensor, Kg a multiple "
            f"of 16 and a Hopper or newer GPU)")
    tma = tma_ok and tma_tile if tma is None else tma
    w8 = w.view(torch.uint8)
    resc = bool(rescaled) and bool(tma) and (split or order.ranges == 1)
    bits = _dense_code_bits(resc, w)
    w_desc = TensorDescriptor.from_tensor(w8, [bn, 32 if resc else 64]) if tma else w8
    part = torch.empty(s, m, rows, dtype=torch.float32, device=x.device) if split else out
    counters = _tile_counters(out.device, grid_n * grid_m) if split else out
    _dense_fp8_kernel[(grid_n, s, grid_m)](
        x2, w8, scale.contiguous().view(torch.uint8), w_desc, out, part, counters, m, ng, kg,
        x2.shape[1], rows, want[1], order.chunks, order.ranges, BLOCK_M=bm, BLOCK_N=bn,
        SPLITS=s, ALL_RANGES=order.ranges > 1 and not split, TMA=bool(tma), RESCALED=resc,
        INTERPRET=interpreting(), CODE_BITS=bits, q_ptr=q, qs_ptr=qs, inv_max=INV_FP8_MAX,
        QUANT=quant_out is not None, num_warps=warps, num_stages=stages)
    return out.reshape(*lead, rows)


def _check_quant_out(quant_out, m: int, n: int, ng: int, out: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """dense_fp8_linear's quant_out, checked: (q fp16 [m, n], s fp32 [m, n / 32]), both
    contiguous on out's device, for groups of ng (a multiple of 32) output columns."""
    require(isinstance(quant_out, tuple) and len(quant_out) == 2
            and all(isinstance(t, torch.Tensor) for t in quant_out),
            f"quant_out must be a (q, s) pair of tensors, got {type(quant_out).__name__}")
    q, s = quant_out
    require(ng % FP8_BLOCK == 0, f"quant_out needs output groups of a multiple of "
            f"{FP8_BLOCK} columns, got {ng}")
    for name, t, dtype, shape in (("q", q, torch.float16, (m, n)),
                                  ("s", s, torch.float32, (m, n // FP8_BLOCK))):
        require(t.dtype == dtype and tuple(t.shape) == shape and t.is_contiguous()
                and t.device == out.device,
                f"quant_out's {name} must be a contiguous {dtype} {list(shape)} on "
                f"{out.device}, got {t.dtype} {tuple(t.shape)} on {t.device}")
    return q, s


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``reference.linear`` on the triton backend: dense_linear (one summation order for every
    row count). x: [..., K]; weight: [N, K] bf16 or fp32. Returns [..., N] in the weight's
    dtype."""
    return dense_linear(x, weight)
