"""Triton inverse RoPE + block-diagonal wo_a (docs/numerics.md §5, step 6), same math as
reference.py: by default the rotation kernel then dense_linear's grouped GEMM (below), or one
fused kernel.

The fused kernel: a program owns a [BLOCK_M rows, BLOCK_N columns of one group g] output tile
and walks (its split of) group g's K = H*D/G dims in BLOCK_K steps. The o tile is
inverse-rotated as it is loaded: on the last R dims of each head, (x_e, x_o) * conj(cos + i
sin) with the fp32 cos/sin of view_as_real(rot), products and sum rounded as torch's CPU
complex64 multiply (no FMA: the kernel is compiled with enable_fp_fusion=False), then rounded
to bf16 as the reference. The weight tile is bf16, or e4m3 codes times their e8m0 32x32 block
scale (exact in bf16, so the fp8 path is the bf16 path on half the bytes). bf16 tl.dot, fp32
accumulator, bf16 output. The sums run in another order than torch's einsum: tolerance
against an fp64 oracle, not bits.

The op's default path, on a GPU and under the interpreter alike, is the rotation kernel
(common.triton.rope_heads, the reference's bits) then the grouped GEMM of
linear.triton.dense_linear, whose summation order is fixed by wo_a's shape: a row's output
never depends on how many rows share the call (torch's einsum runs cuBLAS kernels picked by
shape, whose last bits depend on N). Decode-sized calls (WO_A_CODES_MAX_ROWS) read
wo_a's e4m3 codes instead of its bf16 copy where the op has them (prepare_wo_a, or an
Fp8Weight wo_a): linear.triton.dense_fp8_linear, dense_linear's bits on half the bytes.
The fused kernel runs when ``num_splits`` is given or N <= ``fused_max_rows`` (for tuning
it; its split-K count follows N, so it is not N-invariant). Fused, a decode (N <= 256)
reads all of wo_a to make few rows: weight-bandwidth bound. Tiles of 16 (N <= 16) or 64 rows
x 64 columns x 128 K: for V4.1-Flash's 8x1024 columns that is 128 programs at N <= 64, under
one wave of 132 SMs, so split-K gives each SM 2-3 programs to hide load latency (fp8, N <=
17: 3 splits of 11 K blocks); the fp32 partials [S, N, G*Rk] are summed in split order by a
second kernel (deterministic), and S is capped so that partial traffic stays under 1/8 of the
weight bytes (fp8: no split from N = 64 on). On an H200 the fused kernel lost to cuBLAS at
every size measured.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...checkpoint import Fp8Weight, exact_fp8
from ..common.buffers import out_buffer
from ..common.triton import (FP8_BLOCK, cdiv, check_device, cos_sin, e4m3_to_fp32, e8m0_to_fp32,
                             interpreting, neg, require, rope_heads, sm_count, to_bf16)
from ..linear.triton import (dense_fp8_linear, dense_linear, fp8_input_form, fp8_linear,
                             fp8_linear_quantized, rescalable_scales)
from .reference import check_inputs

# Calls of up to this many rows read wo_a's e4m3 codes (dense_fp8_linear) where the op has
# them (an Fp8Weight wo_a, or ``codes`` from prepare_wo_a): dense_linear's bits on half the
# weight bytes; in the fixed order (the batch-invariant mode) up to WO_A_CODES_MAX_ROWS, in the
# step-sized mode, whose bf16 GEMM is torch's, up to WO_A_STEP_CODES_MAX_ROWS. V4.1-Flash wo_a
# ([8192, 4096], 8 groups), CUDA graphs, us at M = 1 / 16 / 64 / 128 / 256:
# - H100: the codes 19.8 / 20.5 / 28.2 / 47.2 / 74.7, torch's bf16 batched GEMM on the bf16
#   copy 25.5 / 26.1 / 27.8 / 30.2 / 34.9, dense_linear 31.5 / 32.8 / 36.9 / 44.2 / 46.6;
# - H200: the codes 19.4 / 19.8 / 26.0 / 47.6 / 76.3, torch 18.7 / 19.4 / 21.0 / 22.5 / 27.2,
#   dense_linear 25.8 / 26.6 / 29.9 / 41.5 / 44.5.
# The codes' kernel takes ~19.5 us on either card (its e4m3 -> bf16 conversion and MMA chain,
# not the bytes, bound it: more stages, 128-column steps or the scales loaded ahead did not
# help), so in the step-sized mode they win on an H100 and tie on an H200 at up to 16 rows.
WO_A_CODES_MAX_ROWS = 64
WO_A_STEP_CODES_MAX_ROWS = 16
# output_projection: where wo_a runs from its codes and wo_b's fp8_linear reads act_quant's f16
# form (up to 16 rows), wo_a's kernel also quantises its output for wo_b (dense_fp8_linear's
# quant_out): one launch of a decode step fewer (act_quant, 1.3 us of Full r=2's b = 1 step on
# the H100 timeline), the same bits. Not yet timed: bench --part layers --decode 1x4096,16x4096
# --variant base --variant q:ops.output.triton.QUANT_IN_WO_A=1
QUANT_IN_WO_A = False


@triton.jit
def _rotated_o_tile(o_ptr, cs_ptr, rows, row_mask, flat, k_mask, HD, D, ROT_START, R,
                    INTERPRET: tl.constexpr):
    """[BLOCK_M, BLOCK_K] of o[rows, flat], inverse-rotated on head dims >= ROT_START.

    o: [N, H*D] bf16; cs: [N, R/2, 2] fp32 (cos, sin) per pair; rows: [BLOCK_M] int64;
    flat: [BLOCK_K] indices into a row's H*D. Returns bf16 (fp32 holding bf16 when INTERPRET).
    The per-element form of common.triton.rope_rotate(INVERSE=True) for a flat K tile (each
    element with its pair partner): the same products and sums, so the same bits.
    """
    d = flat % D
    rope = k_mask & (d >= ROT_START)
    second = (d - ROT_START) & 1  # 1 for the odd member of an interleaved pair
    row_off = rows[:, None] * HD
    mask = row_mask[:, None] & k_mask[None, :]
    rmask = row_mask[:, None] & rope[None, :]
    x = tl.load(o_ptr + row_off + flat[None, :], mask=mask, other=0.0).to(tl.float32)
    partner = tl.load(o_ptr + row_off + (flat + 1 - 2 * second)[None, :], mask=rmask,
                      other=0.0).to(tl.float32)
    cs_off = rows[:, None] * R + (d - ROT_START - second)[None, :]  # 2 * pair index
    cos = tl.load(cs_ptr + cs_off, mask=rmask, other=1.0)
    sin = tl.load(cs_ptr + cs_off + 1, mask=rmask, other=0.0)
    # (e + i o)(c - i s) = (e c + o s) + i (o c - e s): each member is x c + partner (+-s)
    sin = tl.where(second[None, :] == 1, neg(sin), sin)
    y = tl.where(rope[None, :], x * cos + partner * sin, x)
    return to_bf16(y, INTERPRET)  # x is bf16 already: only rotated values round


@triton.jit
def _fp8_weight_tile(w_ptr, ws_ptr, w_rows, r_mask, k0, KG, KB, BLOCK_K: tl.constexpr,
                     BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr):
    """[BLOCK_K, BLOCK_N] of wo_a^T rows w_rows, dims k0.. (k0 a multiple of 32): e4m3 codes
    times their e8m0 block scale, rounded to bf16 as Fp8Weight.dequantize (fp32 when
    INTERPRET). w: [G*Rk, KG] uint8; ws: [ceil(G*Rk/32), KB] uint8 e8m0 bytes.
    Loaded as [BLOCK_K/32, 32, BLOCK_N] so each scale byte is loaded once per 32 codes.
    """
    kb = k0 // 32 + tl.arange(0, BLOCK_K // 32)[:, None, None]  # [KBLK, 1, 1]
    kk = kb * 32 + tl.arange(0, 32)[None, :, None]  # [KBLK, 32, 1]
    rows3, rmask3 = w_rows[None, None, :], r_mask[None, None, :]
    codes = tl.load(w_ptr + rows3 * KG + kk, mask=(kk < KG) & rmask3, other=0)
    e = tl.load(ws_ptr + (rows3 // 32) * KB + kb, mask=(kb < KB) & rmask3, other=127)
    s = e8m0_to_fp32(e.to(tl.int32))  # 2^(e-127); 0 -> 2^-127, 255 -> NaN (as torch)
    v = e4m3_to_fp32(codes) * s  # [KBLK, 32, BLOCK_N]
    return to_bf16(tl.reshape(v, (BLOCK_K, BLOCK_N)), INTERPRET)


@triton.jit
def _inverse_rope_wo_a_kernel(o_ptr, cs_ptr, w_ptr, ws_ptr, out_ptr, part_ptr,
                              N, HD, D, ROT_START, R, KG, RK, GR, KB, K_PER_SPLIT,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr, FP8: tl.constexpr, SPLIT: tl.constexpr,
                              INTERPRET: tl.constexpr):
    """o: [N, HD] bf16; cs: [N, R/2, 2] fp32; w: [GR, KG] bf16 (or uint8 e4m3 codes with
    ws [ceil(GR/32), KB] uint8 e8m0 when FP8); out: [N, GR] bf16; part: [S, N, GR] fp32
    partials when SPLIT. GR = G*Rk, KG = HD/G. Grid (cdiv(N, BLOCK_M), G * cdiv(RK, BLOCK_N), S):
    program (m, g * tiles + t, s) makes rows m, columns t of group g from dims
    [s * K_PER_SPLIT, (s + 1) * K_PER_SPLIT) of the group (K_PER_SPLIT a multiple of BLOCK_K).
    """
    n_tiles = tl.cdiv(RK, BLOCK_N)
    g = tl.program_id(1) // n_tiles
    offs_r = (tl.program_id(1) % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)  # within group g
    r_mask = offs_r < RK
    cols = (g * RK + offs_r).to(tl.int64)  # wo_a rows = output columns
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < N
    rows = rows.to(tl.int64)
    split = tl.program_id(2)
    k_start = split * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, KG)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < KG
        a = _rotated_o_tile(o_ptr, cs_ptr, rows, row_mask, g * KG + offs_k, k_mask, HD, D,
                            ROT_START, R, INTERPRET)
        if FP8:
            w = _fp8_weight_tile(w_ptr, ws_ptr, cols, r_mask, k0, KG, KB, BLOCK_K, BLOCK_N,
                                 INTERPRET)
        else:
            w = tl.load(w_ptr + cols[None, :] * KG + offs_k[:, None],
                        mask=k_mask[:, None] & r_mask[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
            if INTERPRET:  # its tl.dot misreads bf16 (see to_bf16): exact fp32 widening
                w = w.to(tl.float32)
        acc = tl.dot(a, w, acc)
    mask = row_mask[:, None] & r_mask[None, :]
    if SPLIT:
        tl.store(part_ptr + (split * N + rows)[:, None] * GR + cols[None, :], acc, mask=mask)
    else:
        tl.store(out_ptr + rows[:, None] * GR + cols[None, :],
                 to_bf16(acc, INTERPRET).to(tl.bfloat16), mask=mask)


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, NUMEL, S, BLOCK: tl.constexpr,
                       INTERPRET: tl.constexpr):
    """out[i] = bf16(sum_s part[s, i]), s in order (deterministic). part: [S, NUMEL] fp32."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < NUMEL
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for s in range(1, S):
        acc += tl.load(part_ptr + s * NUMEL + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, to_bf16(acc, INTERPRET).to(tl.bfloat16), mask=mask)


def _tiles(n: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) by row count. Decode: the smallest
    row tile tl.dot takes and long K steps (weight streaming); prefill: square MMA tiles."""
    if n <= 16:
        return 16, 64, 128, 4, 3
    # still near the bandwidth floor: narrow column tiles, more programs (3 stages of
    # 64x64x128 need more than the H200's 227 KB of shared memory with the fp8 dequant)
    return 64, 64, 64, 4, 3


def _pick_splits(programs: int, k_blocks: int, partial_row_bytes: int, weight_bytes: int,
                 sms: int) -> int:
    """Split-K factor: about two programs per SM when the tiles alone leave SMs idle, with the
    fp32 partials' traffic (written and read back: ``partial_row_bytes`` per split) kept under
    1/8 of the weight bytes; 1 when the tiles fill the machine."""
    if programs >= sms:
        return 1
    s = min(k_blocks, cdiv(2 * sms, programs), weight_bytes // (8 * partial_row_bytes))
    return max(1, s)


@dataclass(eq=False)
class WoACodes:
    """A bf16 wo_a's exact e4m3 form (``checkpoint.exact_fp8``: what the checkpoint stored, 34
    MB per V4.1-Flash layer beside the 67 MB bf16 copy), for decode-sized calls to read half
    the bytes. Built once per layer by ``prepare_wo_a``; it serves only the tensor it was made
    from, unchanged since (``serves``: a wo_a written in place, or another tensor, runs the
    bf16 path) or since ``prepare_wo_a`` refreshed it in place. ``reads``: the calls that read
    it (a captured decode graph notes which copies its launches read). ``rescaled``: its
    scales passed ``rescalable_scales``, so decode calls run dense_fp8_linear's rescaled
    tiles."""

    fp8: Fp8Weight
    source: torch.Tensor
    version: int
    reads: int = 0
    rescaled: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes held beside the weights (the codes and their block scales)."""
        return self.fp8.nbytes

    def serves(self, wo_a) -> bool:
        """True for the very tensor it was made from, not written in place since (host check)."""
        return wo_a is self.source and wo_a._version == self.version


def prepare_wo_a(wo_a: torch.Tensor | Fp8Weight, previous: WoACodes | None = None) -> dict:
    """Extra arguments of ``inverse_rope_wo_a`` for one layer, built once: ``codes``, a bf16
    wo_a's ``WoACodes``; {} when wo_a has no exact e4m3 form or is an Fp8Weight already (the
    op reads that one as it is). ``previous``: the layer's codes so far; when they were made
    from this very tensor (since written in place), they are rewritten in place and returned,
    so that a decode graph that captured them reads the new codes; unless the new scales
    change ``rescaled`` (a captured kernel of the one form must not read scales made for the
    other): then new codes, and such a graph refuses to replay."""
    if isinstance(previous, WoACodes) and previous.serves(wo_a):
        return {"codes": previous}  # unchanged: nothing to rebuild
    if isinstance(wo_a, torch.Tensor) and wo_a.dtype == torch.bfloat16 and wo_a.dim() == 2:
        fp8 = exact_fp8(wo_a)
        if fp8 is not None:
            rescaled = rescalable_scales(fp8.scale)
            if isinstance(previous, WoACodes) and previous.source is wo_a \
                    and previous.fp8.weight.shape == fp8.weight.shape \
                    and previous.rescaled == rescaled:  # not resized, the same kernel form
                previous.fp8.weight.copy_(fp8.weight)
                previous.fp8.scale.copy_(fp8.scale)
                previous.version = wo_a._version
                return {"codes": previous}
            return {"codes": WoACodes(fp8, wo_a, wo_a._version, rescaled=rescaled)}
    return {}


def _codes_form(n: int, rot, wo_a, codes, fixed_order: bool, num_splits, fused_max_rows: int
                ) -> Fp8Weight | None:
    """The fp8 form of wo_a that inverse_rope_wo_a's call of n rows runs dense_fp8_linear on
    (the Fp8Weight wo_a, or the prepared codes where they serve it), or None where the call
    runs another kernel: the unfused path (the fused kernel only where num_splits is given or n
    <= fused_max_rows, and never without rot), up to WO_A_CODES_MAX_ROWS rows
    (WO_A_STEP_CODES_MAX_ROWS unless fixed_order)."""
    fp8_form = wo_a if isinstance(wo_a, Fp8Weight) else \
        codes.fp8 if codes is not None and codes.serves(wo_a) else None
    unfused = (n > fused_max_rows and num_splits is None) or rot is None
    limit = WO_A_CODES_MAX_ROWS if fixed_order else WO_A_STEP_CODES_MAX_ROWS
    return fp8_form if unfused and n <= limit else None


def output_projection(o: torch.Tensor, rot: torch.Tensor | None,
                      wo_a: torch.Tensor | Fp8Weight, groups: int, wo_b: torch.Tensor,
                      wo_b_scale: torch.Tensor, **wo_a_kw) -> torch.Tensor:
    """``reference.output_projection`` on the triton backend: fp8_linear(inverse_rope_wo_a(o,
    rot, wo_a, groups, **wo_a_kw), wo_b, wo_b_scale), [N, dim] bf16. With QUANT_IN_WO_A, where
    the call runs wo_a's codes kernel and wo_b reads act_quant's f16 form, that kernel
    quantises its output for wo_b itself: the same bits, one launch fewer."""
    n = o.shape[0] if isinstance(o, torch.Tensor) and o.dim() == 3 else -1
    quant = None
    if QUANT_IN_WO_A and n > 0 and isinstance(wo_b, torch.Tensor) and wo_b.dim() == 2 \
            and wo_b.dtype == torch.float8_e4m3fn and \
            _codes_form(n, rot, wo_a, wo_a_kw.get("codes"), wo_a_kw.get("fixed_order", True),
                        wo_a_kw.get("num_splits"), wo_a_kw.get("fused_max_rows", 0)) is not None:
        gr = (wo_a.weight if isinstance(wo_a, Fp8Weight) else wo_a).shape[0]  # wo_a's outputs
        fits = wo_b.shape[1] == gr and isinstance(groups, int) and groups > 0 \
            and gr % groups == 0 and (gr // groups) % 32 == 0  # else the two ops (and errors)
        if fits and fp8_input_form(n, wo_b) == "f16":
            quant = (torch.empty(n, gr, dtype=torch.float16, device=o.device),
                     torch.empty(n, gr // 32, dtype=torch.float32, device=o.device))
    u = inverse_rope_wo_a(o, rot, wo_a, groups, quant_out=quant, **wo_a_kw)
    if quant is not None:
        return fp8_linear_quantized(*quant, wo_b, wo_b_scale)
    return fp8_linear(u, wo_b, wo_b_scale)


def inverse_rope_wo_a(o: torch.Tensor, rot: torch.Tensor | None, wo_a: torch.Tensor | Fp8Weight,
                      groups: int, *, out: torch.Tensor | None = None,
                      num_splits: int | None = None, fused_max_rows: int = 0,
                      fixed_order: bool = True, in_place: bool = False,
                      codes: WoACodes | None = None,
                      quant_out: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``reference.inverse_rope_wo_a`` as one Triton kernel (plus a split-K sum for decode).

    o: [N, H, D] bf16; rot: [N, R/2] complex64 (the last R dims of each head are rotated by
    its conjugate), or None (o is turned back already: wo_a only, never the fused kernel);
    wo_a: [groups*Rk, H*D/groups] bf16, or an Fp8Weight (e4m3 [groups*Rk,
    H*D/groups] + float8_e8m0fnu scales [ceil(groups*Rk/32), ceil(H*D/groups/32)]),
    dequantised in registers; out: optional contiguous bf16 [N, groups*Rk]; num_splits: K
    splits (>= 1; None = heuristic; given, the fused kernel runs at any N). Returns
    [N, groups*Rk] bf16: u[n, g*Rk + r].

    fused_max_rows: N above it runs rope_heads + dense_linear's grouped GEMM (N-invariant
    bits), N at or below it the fused kernel. Default 0: the fused kernel only when num_splits
    is given. Measured on an H200 (V4.1-Flash, fp8 weights) it took 171 us at N = 1 and 880 us
    at N = 64 against ~20-30 us for rope_heads + cuBLAS, and tens of ms at 8K rows; it stays
    the tested fused form. fixed_order=False (the backend's default mode, not batch-invariant)
    runs torch's bf16 batched GEMM (into out, no copy) instead of dense_linear there (cuBLAS: its blocking, and
    so a row's last bits, may follow N). in_place: the caller no longer needs o: the rotation
    kernel turns o's tail pairs in place instead of copying all of o. codes: the bf16 wo_a's
    WoACodes (prepare_wo_a; ignored unless it ``serves`` this wo_a). Unfused, a call of at
    most WO_A_CODES_MAX_ROWS rows (WO_A_STEP_CODES_MAX_ROWS unless fixed_order) with codes,
    or with an Fp8Weight wo_a, runs dense_fp8_linear on the e4m3 codes: dense_linear's bits,
    on half the weight bytes. quant_out: dense_fp8_linear's (the output's act_quant for wo_b,
    in the same launch), only for a call that runs it (``_codes_form``; else a ValueError).
    """
    kg, rk = check_inputs(o, rot, wo_a, groups)
    n, h, d = o.shape
    gr = groups * rk
    fp8 = isinstance(wo_a, Fp8Weight)
    weight = wo_a.weight if fp8 else wo_a
    check_device(o, *((rot,) if rot is not None else ()), weight,
                 *((wo_a.scale,) if fp8 else ()))
    if num_splits is not None and (isinstance(num_splits, bool) or
                                   not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits must be an int >= 1 or None, got {num_splits!r}")
    if isinstance(fused_max_rows, bool) or not isinstance(fused_max_rows, int):
        raise ValueError(f"fused_max_rows must be an int, got {fused_max_rows!r}")
    if codes is not None and not isinstance(codes, WoACodes):
        raise TypeError(f"codes must be a WoACodes (prepare_wo_a) or None, got "
                        f"{type(codes).__name__}")
    fp8_form = _codes_form(n, rot, wo_a, codes, fixed_order, num_splits, fused_max_rows)
    require(quant_out is None or fp8_form is not None,
            f"quant_out: this call ({n} rows) does not run wo_a's codes kernel")
    out = out_buffer(out, (n, gr), torch.bfloat16, o.device)
    if out.numel() == 0:
        return out
    if (n > fused_max_rows and num_splits is None) or rot is None:
        # the rotation kernel, then the grouped GEMM (in its fixed summation order)
        rotated = (o.contiguous() if rot is None else
                   rope_heads(o, rot, inverse=True, in_place=in_place)).view(n, h * d)
        if fp8_form is not None:  # dense_linear's bits on the fp8 bytes
            if not fp8:
                codes.reads += 1
            return dense_fp8_linear(rotated, fp8_form.weight, fp8_form.scale, groups, out=out,
                                    rescaled=not fp8 and codes.rescaled, quant_out=quant_out)
        w16 = wo_a.dequantize() if fp8 else weight
        if not fixed_order:  # torch's batched GEMM writes straight into out's [G, N, Rk] view
            torch.bmm(rotated.view(n, groups, kg).transpose(0, 1),
                      w16.view(groups, rk, kg).transpose(1, 2),
                      out=out.view(n, groups, rk).transpose(0, 1))
            return out
        return out.copy_(dense_linear(rotated, w16, groups))
    o = o.contiguous()
    cs = cos_sin(rot)  # [N, R/2, 2] fp32 cos, sin
    weight = weight.contiguous()
    if fp8:
        weight, scale = weight.view(torch.uint8), wo_a.scale.contiguous().view(torch.uint8)
    else:
        scale = weight  # never read
    bm, bn, bk, warps, stages = _tiles(n)
    k_blocks = cdiv(kg, bk)
    programs = cdiv(n, bm) * groups * cdiv(rk, bn)
    if num_splits is None:
        num_splits = _pick_splits(programs, k_blocks, 8 * n * gr,
                                  weight.numel() * weight.element_size(), sm_count(o.device))
    per_split = cdiv(k_blocks, min(num_splits, k_blocks))  # K blocks per split
    s = cdiv(k_blocks, per_split)  # no split left without a block
    part = o.new_empty(s, n, gr, dtype=torch.float32) if s > 1 else out
    interp = interpreting()
    _inverse_rope_wo_a_kernel[(cdiv(n, bm), groups * cdiv(rk, bn), s)](
        o, cs, weight, scale, out, part, n, h * d, d, d - 2 * rot.shape[1], 2 * rot.shape[1],
        kg, rk, gr, cdiv(kg, FP8_BLOCK), per_split * bk,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, FP8=fp8, SPLIT=s > 1, INTERPRET=interp,
        num_warps=warps, num_stages=stages, enable_fp_fusion=False)
    if s > 1:
        block = 1024
        _sum_splits_kernel[(cdiv(n * gr, block),)](part, out, n * gr, s, BLOCK=block,
                                                          INTERPRET=interp)
    return out

