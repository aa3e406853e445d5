"""Triton fp8 linear (docs/numerics.md §2, §4), same numerics as reference.py and quant.py.

act_quant: one program per (row, 16 blocks of 32); amax in fp32 floored at 1e-4, the ue8m0
scale built from exponent bits, x * (1/s) (exact: s is a power of two) clamped to +-448 and
rounded to e4m3 in software (ties to even, subnormals step 2^-9); the code byte is built from
the bits, so no fp8 cast is used (the interpreter's is not RNE). fp8_gemm: one program per
BLOCK_M x BLOCK_N tile walks K in blocks of 32: partial = a_fp8 . b_fp8 in fp32, scaled by the
row scale then the e8m0 column-block scale, accumulated in fp32 in K order (the reference's
rounding points; the GPU mma's internal 32-term sum may round differently: tolerance only;
see fp8_gemm's precise_dot). Under TRITON_INTERPRET the block sums are exact (fp64), so all is
bit-exact.
Split-K (decode-sized M, when the tile grid leaves SMs idle; _gemm_plan): each program sums one
contiguous K range the same way into an fp32 [S, M, N] workspace and _split_sum_kernel adds
the S ranges in split order: deterministic, but a different fp32 association than the
reference's (num_splits=1 keeps its order; the tests bound the difference).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..common.triton import (FP8_BLOCK, INV_FP8_MAX, check_device, e4m3_code, e8m0_to_fp32,
                             interpreting, sm_count, ue8m0_exponent)

QUANT_BLOCKS = 16  # act_quant: scale blocks per program (512 elements of a row)
SPLIT_MAX_M = 64  # split-K for decode-sized M only: larger M fills the SMs with tiles
SPLIT_PROGRAMS_PER_SM = 3  # ~2 resident programs per SM plus slack for the last wave
SPLIT_TRAFFIC_SHARE = 4  # fp32 partials (written + read) <= 1/4 of the weight bytes
SPLIT_SUM_BLOCK = 256  # outputs per program of the split-sum kernel (2 warps, 16 B each)


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, K, KB, inv_max, QB: tl.constexpr):
    """x: [M, K] bf16; q: [M, K] uint8 (e4m3 bytes); s: [M, KB] fp32. Grid (M, cdiv(KB, QB))."""
    row = tl.program_id(0).to(tl.int64)
    offs_b = tl.program_id(1) * QB + tl.arange(0, QB)  # scale blocks of this program
    b_mask = offs_b < KB
    offs = row * K + offs_b[:, None] * 32 + tl.arange(0, 32)[None, :]  # [QB, 32]
    x = tl.load(x_ptr + offs, mask=b_mask[:, None], other=0.0).to(tl.float32)
    e = ue8m0_exponent(tl.max(tl.abs(x), 1), inv_max)
    s = (e << 23).to(tl.float32, bitcast=True)
    inv_s = ((254 - e) << 23).to(tl.float32, bitcast=True)  # 1/s, exact and normal
    code = e4m3_code(x * inv_s[:, None])  # x * (1/s) == x / s exactly
    tl.store(q_ptr + offs, code.to(tl.uint8), mask=b_mask[:, None])
    tl.store(s_ptr + row * KB + offs_b, s, mask=b_mask)


@triton.jit
def _fp8_gemm_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, M, N, K, KB, CHUNKS, SPLITS,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KSUB: tl.constexpr,
                     DOT_F16: tl.constexpr, INTERPRET: tl.constexpr):
    """a: [M, K] e4m3; sa: [M, KB] fp32; b: [N, K] e4m3; sb: [cdiv(N, 32), KB] uint8 (e8m0
    bytes); c: [SPLITS, M, N] fp32 (SPLITS = 1: the output). All contiguous.
    Grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), SPLITS). K is CHUNKS = KB / KSUB chunks of KSUB
    32-blocks; split s sums chunks [s * CHUNKS // SPLITS, (s + 1) * CHUNKS // SPLITS) in K order.
    INTERPRET (CPU only) sums each 32-block in fp64, exactly, then rounds once, as the reference.
    """
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    kb_lo = split * CHUNKS // SPLITS * KSUB
    kb_hi = (split + 1) * CHUNKS // SPLITS * KSUB
    m_mask = offs_m < M
    n_mask = offs_n < N
    offs_m64 = offs_m.to(tl.int64)
    offs_n64 = offs_n.to(tl.int64)
    offs_k = kb_lo * 32 + tl.arange(0, 32)
    a_ptrs = a_ptr + offs_m64[:, None] * K + offs_k[None, :]  # [BLOCK_M, 32]
    b_ptrs = b_ptr + offs_n64[None, :] * K + offs_k[:, None]  # [32, BLOCK_N], K-major
    sa_ptrs = sa_ptr + offs_m64 * KB
    sb_ptrs = sb_ptr + (offs_n // 32) * KB
    acc = tl.full([BLOCK_M, BLOCK_N], -0.0, tl.float32)  # -0 + p == p for every p, as copy_
    for kb0 in range(kb_lo, kb_hi, KSUB):  # consecutive 32-blocks, in K order
        for j in tl.static_range(KSUB):  # KSUB loads per row in flight: KSUB * 32 bytes of K
            a = tl.load(a_ptrs + j * 32, mask=m_mask[:, None], other=0.0)
            b = tl.load(b_ptrs + j * 32, mask=n_mask[None, :], other=0.0)
            if INTERPRET:
                a64 = a.to(tl.float32).to(tl.float64)  # its fp8 -> fp64 cast breaks on zeros
                b64 = b.to(tl.float32).to(tl.float64)
                part = tl.dot(a64, b64, out_dtype=tl.float64).to(tl.float32)  # numpy: RNE
            elif DOT_F16:  # e4m3 -> fp16 is exact; fp16 mma accumulates more precisely
                part = tl.dot(a.to(tl.float16), b.to(tl.float16), out_dtype=tl.float32)
            else:
                part = tl.dot(a, b, out_dtype=tl.float32)
            sa = tl.load(sa_ptrs + kb0 + j, mask=m_mask, other=1.0)
            e = tl.load(sb_ptrs + kb0 + j, mask=n_mask, other=127).to(tl.int32)
            sb = e8m0_to_fp32(e)  # 2^(e-127); 0 -> 2^-127, 255 -> NaN
            acc += part * sa[:, None] * sb[None, :]  # powers of two: exact, reference order
        a_ptrs += 32 * KSUB
        b_ptrs += 32 * KSUB
    c_ptrs = c_ptr + split.to(tl.int64) * M * N + offs_m64[:, None] * N + offs_n64[None, :]
    tl.store(c_ptrs, acc, mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _split_sum_kernel(part_ptr, c_ptr, MN, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """part: [SPLITS, M, N] fp32 split-K partials; c: [M, N] fp32, MN = M * N. Grid
    (cdiv(MN, BLOCK),). c = (part[0] + part[1]) + ... in split order, fp32: deterministic."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    part_ptrs = part_ptr + offs
    acc = tl.load(part_ptrs, mask=mask, other=0.0)
    for _ in tl.static_range(1, SPLITS):  # unrolled: the SPLITS loads are independent
        part_ptrs += MN
        acc += tl.load(part_ptrs, mask=mask, other=0.0)
    tl.store(c_ptr + offs, acc, mask=mask)


@dataclass(frozen=True)
class _GemmPlan:
    """Launch parameters of one fp8 GEMM shape, chosen on the host from (M, N, KB, SM count)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    ksub: int  # 32-blocks per K iteration: each weight row is read ksub * 32 bytes at a time
    dot_f16: bool  # fp8_gemm's precise_dot: e4m3 operands widened to fp16 for tl.dot
    splits: int  # split-K ranges; 1: each tile's program writes the output directly


def _gemm_plan(m: int, n: int, kb: int, sms: int, num_splits: int | None = None,
               precise_dot: bool = True) -> _GemmPlan:
    """Tiles by M, then split-K for small M. Decode (M <= 64) is weight-bandwidth bound: 64-row
    weight tiles read 128-256 contiguous bytes per row per iteration (KSUB 32-blocks, several
    loads in flight), and when the tile grid is small next to the SMs (wq_a, wkv: 8-20 tiles)
    K is split so that there are ~SPLIT_PROGRAMS_PER_SM programs per SM, as long as the fp32
    partials stay a small share of the weight bytes. num_splits (1 <= it <= KB) forces S; KSUB
    then shrinks, if need be, so that every split has at least one K iteration. sms: the
    device's SM count (sm_count); precise_dot: see fp8_gemm."""
    if m <= 16:
        bm, bn, warps, stages, ksub_max = 16, 64, 4, 4, 8
    elif m <= SPLIT_MAX_M:
        bm, bn, warps, stages, ksub_max = 64, 64, 4, 4, 4
    else:
        bm, bn, warps, stages, ksub_max = 128, 128, 8, 3, 1
    ksub = next(d for d in (8, 4, 2, 1) if d <= ksub_max and kb % d == 0)
    if num_splits is not None:
        splits = num_splits
        ksub = next(d for d in (8, 4, 2, 1) if d <= ksub and kb % d == 0 and kb // d >= splits)
    elif m <= SPLIT_MAX_M:
        tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
        want = triton.cdiv(SPLIT_PROGRAMS_PER_SM * sms, tiles)
        if ksub == 8 and kb // 8 < want and kb % 4 == 0:  # more, shorter splits (wkv)
            ksub = 4
        # partials written and read, 8 B per split per output, <= weight bytes (N * KB * 32) / 4
        cap = kb * FP8_BLOCK // (SPLIT_TRAFFIC_SHARE * 8 * m)
        splits = max(1, min(want, cap, kb // ksub))
    else:
        splits = 1
    return _GemmPlan(bm, bn, warps, stages, ksub, bool(precise_dot), splits)


def act_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 activation quantisation (docs/numerics.md §2), bit-exact with common.quant.act_quant.

    x: [M, K] bf16, K a multiple of 32. Returns (codes [M, K] float8_e4m3fn, scales [M, K/32]
    fp32 powers of two) with x ~= codes * scales per block of 32. Finite inputs only.
    """
    if x.dim() != 2:
        raise ValueError(f"act_quant wants a 2-D [M, K] tensor, got shape {tuple(x.shape)}")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"act_quant wants bf16, got {x.dtype}")
    check_device(x)
    m, k = x.shape
    if k % FP8_BLOCK:
        raise ValueError(f"K = {k} is not a multiple of the quant block {FP8_BLOCK}")
    kb = k // FP8_BLOCK
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, kb, dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return q, s
    grid = (m, triton.cdiv(kb, QUANT_BLOCKS))
    _act_quant_kernel[grid](x.contiguous(), q.view(torch.uint8), s, k, kb, INV_FP8_MAX,
                            QB=QUANT_BLOCKS, num_warps=4)
    return q, s


def fp8_gemm(x_codes: torch.Tensor, x_scales: torch.Tensor, weight: torch.Tensor,
             weight_scale: torch.Tensor, out: torch.Tensor | None = None,
             num_splits: int | None = None, *, precise_dot: bool = True) -> torch.Tensor:
    """Blockwise-scaled fp8 GEMM: y[m, n] = sum_kb (x[m, kb] . w[n, kb]) sx[m, kb] sw[n//32, kb].

    x_codes: [M, K] float8_e4m3fn; x_scales: [M, K/32] fp32; weight: [N, K] float8_e4m3fn;
    weight_scale: [ceil(N/32), K/32] float8_e8m0fnu; out: optional contiguous [M, N] fp32
    buffer. Returns [M, N] fp32. K must be a multiple of 32.

    num_splits: split-K ranges S, 1 <= S <= K/32 (None: chosen from the shape and SM count).
    S = 1 accumulates all of K in order (the reference's rounding); S > 1 sums S contiguous K
    ranges separately, each in K order, into an fp32 [S, M, N] workspace, then adds them in
    split order: deterministic, but not the reference's fp32 summation order.

    precise_dot (GPU only; the interpreter sums each 32-block exactly either way): True (the
    default) widens the e4m3 operands to fp16 (exact) before tl.dot. The fp8 wgmma (BLOCK_M >=
    64) sums its 32 products less precisely (seen on an H200: ~5e-5 of max|y| off the exact
    fp32 block sums, ~1e-7 with fp16) but is ~1.4x faster at large M; small M is ~1e-7 either
    way. With the fp8 sums the index q/k flip fp4 roundings and v41_geometry's top-k rows drift
    past the fixture tolerance (194 of 3312 rows on an H200, limit 1%), hence the default.
    """
    if x_codes.dim() != 2 or weight.dim() != 2 or x_scales.dim() != 2 or weight_scale.dim() != 2:
        raise ValueError("fp8_gemm wants 2-D x_codes, x_scales, weight, weight_scale")
    if x_codes.dtype != torch.float8_e4m3fn or weight.dtype != torch.float8_e4m3fn:
        raise TypeError(f"x_codes and weight must be float8_e4m3fn, got {x_codes.dtype}, "
                        f"{weight.dtype}")
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
    if tuple(weight_scale.shape) != (triton.cdiv(n, FP8_BLOCK), kb):
        raise ValueError(f"weight_scale {tuple(weight_scale.shape)} != "
                         f"{(triton.cdiv(n, FP8_BLOCK), kb)}")
    if num_splits is not None and not 1 <= num_splits <= max(kb, 1):
        raise ValueError(f"num_splits = {num_splits} is not in [1, K/32 = {kb}]")
    check_device(x_codes, x_scales, weight, weight_scale)
    if out is None:
        out = torch.empty(m, n, dtype=torch.float32, device=x_codes.device)
    elif tuple(out.shape) != (m, n) or out.dtype != torch.float32 \
            or out.device != x_codes.device or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous fp32 [{m}, {n}] tensor on x's device")
    if out.numel() == 0:
        return out
    if kb == 0:
        return out.zero_()
    plan = _gemm_plan(m, n, kb, sm_count(out.device), num_splits, precise_dot)
    partials = out if plan.splits == 1 else \
        torch.empty(plan.splits, m, n, dtype=torch.float32, device=out.device)
    grid = (triton.cdiv(m, plan.block_m), triton.cdiv(n, plan.block_n), plan.splits)
    _fp8_gemm_kernel[grid](x_codes.contiguous(), x_scales.contiguous(), weight.contiguous(),
                           weight_scale.contiguous().view(torch.uint8), partials, m, n, k, kb,
                           kb // plan.ksub, plan.splits, BLOCK_M=plan.block_m,
                           BLOCK_N=plan.block_n, KSUB=plan.ksub, DOT_F16=plan.dot_f16,
                           INTERPRET=interpreting(), num_warps=plan.num_warps,
                           num_stages=plan.num_stages)
    if plan.splits > 1:
        _split_sum_kernel[(triton.cdiv(m * n, SPLIT_SUM_BLOCK),)](
            partials, out, m * n, SPLITS=plan.splits, BLOCK=SPLIT_SUM_BLOCK, num_warps=2)
    return out


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, *,
               num_splits: int | None = None, precise_dot: bool = True,
               out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """y = x W^T for an fp8 weight: act_quant(x) then the blockwise fp8 GEMM (docs/numerics.md §4).

    x: [..., K] bf16; weight [N, K] float8_e4m3fn; weight_scale [ceil(N/32), K/32]
    float8_e8m0fnu; num_splits: fp8_gemm's split-K (None: by shape); precise_dot: fp8_gemm's
    (default True: fp16 operands to the GPU's tl.dot). Returns [..., N] in ``out_dtype``
    (bf16, or torch.float32: the GEMM's fp32 result, as a tensor-parallel wo_b partial needs).
    """
    if x.dim() == 0 or weight.dim() != 2 or x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"x {tuple(x.shape)} does not match weight {tuple(weight.shape)}")
    lead = x.shape[:-1]
    x_q, s = act_quant(x.reshape(-1, x.shape[-1]))
    y = fp8_gemm(x_q, s, weight, weight_scale, num_splits=num_splits,
                 precise_dot=precise_dot)
    return y.to(out_dtype).reshape(*lead, weight.shape[0])
