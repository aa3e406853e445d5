"""Triton sparse attention with a per-head sink (docs/numerics.md §6), same numerics as
reference.py.

``sparse_attn`` (bf16 rows) and ``sparse_attn_paged`` (the packed caches: fp8 window rows,
read in place from the layer's ring or from the step's new rows, paged fp4 compressed rows,
decoded in registers). One program per query (b, i) or, paged, per packed token t of a step,
and head block [, split] walks the index list in blocks of 64 in list order, gathers the KV
rows (K = V, MQA) by pointer arithmetic, and runs the reference's online softmax: fp32 logits
from bf16 tl.dot, running max from -1e30 over logits only, p cast to bf16 before P.V, fp32
accumulator, sink added to the denominator after the last block. The paged op can split a list
over programs (flash-decoding) and merge their fp32 partials in a second kernel; by default in
splits of SPLIT_BLOCKS 64-blocks whatever the step's token count, so a token gets the same bits
alone, batched, chunked or token by token (docs/numerics.md §9).

The paged kernel at V4.1-Flash decode (64 heads x 512 per program, 8 warps, an SM each): the
list runs as three loops (window-only blocks, pipelined by the compiler; the block where the
window part ends; compressed-only blocks, prefetched by hand one block ahead, since the
compiler issues the index -> page -> row chain only after a block's work); rows are decoded by
inline PTX (hardware e4m3 -> f16, an e2m1 nibble re-encoded as an e4m3 byte, exact products),
as int32 words at D >= 128; the softmax sits in an always-true branch, so the two warp groups
split the logits instead of each computing all of them; the merge pipelines its loads. Under
the interpreter its output is bit-identical to the previous kernel's.

H200 (torch 2.11, Triton 3.6), bench shapes (128 fp8 + 512 paged fp4 rows per query), CUDA-graph
replay, batch 1 / 8 / 64 / 256: 21.7 / 23.3 / 53.9 / 176 us (batch-invariant mode 25.3 / 26.4 /
86.5 / 303), from 23.3 / 24.9 / 58.1 / 183 (28.8 / 29.5 / 92.9 / 323) before the compressed
rows' page and row were split by a shift instead of an int64 division (a ~80-instruction routine
that each thread ran for each of the 16 rows its loads touch: 34 call sites in the loop);
FlashMLA's sparse decode on the same GPU: 17.4 / 19.2 / 47.9 / 93.1. A 64-row block still takes
~9 us per SM against ~1.5 us of tensor work: ncu (b=256) shows one instruction issued every ~4.8
cycles per scheduler, with 2 warps a scheduler (one program an SM: 255 registers, ~190 KB of
shared memory), 3.6 of a warp's 9.7 cycles between issues long-scoreboard stalls (local-memory
spills: beside the [64, 512] fp32 accumulator, 128 registers a thread, the dots' hoisted shared-
memory descriptors spill, and with that much shared memory the spills are reloaded from L2),
~1.3 each barrier and fixed-latency waits; the dots, the decoding and the loads of one program
run one after another. Handling a tile in two column halves (d_chunks=2: the same bits) spills
more on Triton 3.6 (stack 570-740 bytes against 320-460) and ran 14-23% slower; two splits per
token at batch 256 ran 198 us.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.buffers import out_buffer
from ..common.triton import (cdiv, check_rot, cos_sin, e4m3_of_e2m1, e4m3_to_fp32, interpreting,
                             next_pow2, rope_heads, rope_rotate, sm_count, to_bf16)

BLOCK_N = 64  # index-list block, fixed by the rounding points (docs/numerics.md §6)
BLOCK_H = 16  # head tile: tl.dot needs every dim >= 16


@triton.jit
def _normalise(sink_ptr, offs_h, h_mask, m_i, l_i, acc, INTERPRET: tl.constexpr):
    """Add the sink to the denominator and divide: o [BLOCK_H, columns] bf16 values (in fp32
    under the interpreter). Empty row: l = 0, m = -1e30: o = 0 / inf = 0; with sink = -inf
    too, l = 0 and o = 0 / 1 (no NaN)."""
    sink = tl.load(sink_ptr + offs_h, mask=h_mask, other=0.0)
    l_i = l_i + tl.exp(sink - m_i)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    return to_bf16(o, INTERPRET)


@triton.jit
def _finish(o_ptr, sink_ptr, bi, offs_h, h_mask, offs_d, m_i, l_i, acc, H, D: tl.constexpr,
            INTERPRET: tl.constexpr):
    """_normalise, then store o[bi, offs_h, offs_d] bf16."""
    o = _normalise(sink_ptr, offs_h, h_mask, m_i, l_i, acc, INTERPRET).to(tl.bfloat16)
    tl.store(o_ptr + bi * H * D + offs_h[:, None] * D + offs_d[None, :], o, mask=h_mask[:, None])


@triton.jit
def _sparse_attn_kernel(q_ptr, kv_ptr, sink_ptr, idx_ptr, o_ptr, scale, M, H, N, W,
                        D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                        INTERPRET: tl.constexpr):
    """q, o: [B, M, H, D] bf16; kv: [B, N, D] bf16; sink: [H] fp32; idx: [B, M, W] int32.

    All tensors contiguous. Grid: (B * M, cdiv(H, BLOCK_H)). INTERPRET (CPU interpreter only)
    feeds tl.dot the same bf16 values widened to fp32, which is exact (see common.triton.to_bf16).
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
        pb = to_bf16(p, INTERPRET)  # the reference's rounding point before P.V
        acc = acc * alpha[:, None] + tl.dot(pb, kv)
        m_i = m_new

    _finish(o_ptr, sink_ptr, bi, offs_h, h_mask, offs_d, m_i, l_i, acc, H, D, INTERPRET)


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
    out = out_buffer(out, q.shape, torch.bfloat16, q.device)
    if out.numel() == 0:
        return out
    if idx.shape[2] == 0:  # no entries at all: every row is empty, o = 0 (as the reference)
        return out.zero_()
    q, kv, sink, idx = q.contiguous(), kv.contiguous(), sink.contiguous(), idx.contiguous()
    grid = (b * m, cdiv(h, BLOCK_H))
    _sparse_attn_kernel[grid](q, kv, sink, idx, out, float(scale), m, h, n, idx.shape[2],
                              D=d, BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, INTERPRET=interpreting(),
                              num_warps=4 if d <= 128 else 8)  # 8 warps: less spill at D=512
    return out


# ---- paged variant: rows decoded in registers from the packed caches --------------------------

BLOCK_H_MAX = 64  # paged head tile: up to 64 (rows decoded once per tile; H200 D=512: fastest)
SPLIT_BLOCKS = 2  # list blocks per split (flash-decoding), fixed: see _pick_splits
SHORT_LIST_BLOCKS = 2  # _wave_splits: lists this short split only for few programs


def _bf16_pair(f16x2: str, dst: str) -> str:
    """PTX: f16x2 register -> bf16x2 dst through f32 (exact for the values decoded here)."""
    return (f"mov.b32 {{xa, xb}}, {f16x2}; cvt.f32.f16 fa, xa; cvt.f32.f16 fb, xb; "
            f"cvt.rn.bf16x2.f32 {dst}, fb, fa;")


# 4 bytes of e2m1 pairs ($4) and their 4 e4m3 scales ($5) -> bf16 x4 of the low nibbles ($0, $1)
# and x4 of the high nibbles ($2, $3). A nibble s|e1 e0|m is re-encoded as the e4m3 byte
# s|0 0 e1 e0|m 0 0, worth its e2m1 value * 2^-6, for the hardware fp8 -> f16 conversion; the
# f16 product with scale * 64 is exact (<= 6 significant bits, within f16's normal range).
_FP4_ASM = tl.constexpr(
    "{ .reg .b32 t, u, l, h, s01, s23, k, x; .reg .b16 l01, l23, h01, h23, c01, c23, xa, xb;"
    " .reg .f32 fa, fb;"
    " shl.b32 t, $4, 2; and.b32 t, t, 0x1C1C1C1C; shl.b32 u, $4, 4; and.b32 u, u, 0x80808080;"
    " or.b32 l, t, u; shr.b32 t, $4, 2; and.b32 t, t, 0x1C1C1C1C; and.b32 u, $4, 0x80808080;"
    " or.b32 h, t, u; mov.b32 {l01, l23}, l; mov.b32 {h01, h23}, h; mov.b32 {c01, c23}, $5;"
    " mov.b32 k, 0x54005400; cvt.rn.f16x2.e4m3x2 s01, c01; mul.rn.f16x2 s01, s01, k;"
    " cvt.rn.f16x2.e4m3x2 s23, c23; mul.rn.f16x2 s23, s23, k;"
    + "".join(f" cvt.rn.f16x2.e4m3x2 x, {src}; mul.rn.f16x2 x, x, {sc}; " + _bf16_pair("x", dst)
              for src, sc, dst in (("l01", "s01", "$0"), ("l23", "s23", "$1"),
                                   ("h01", "s01", "$2"), ("h23", "s23", "$3"))) + " }")

# 4 e4m3 codes ($2) and their fp32 scales ($3..$6) -> bf16 x4 ($0, $1), exact.
_FP8_ASM = tl.constexpr(
    "{ .reg .b16 c01, c23, xa, xb; .reg .b32 x; .reg .f32 fa, fb; mov.b32 {c01, c23}, $2;"
    + "".join(f" cvt.rn.f16x2.e4m3x2 x, {src}; mov.b32 {{xa, xb}}, x; cvt.f32.f16 fa, xa;"
              f" cvt.f32.f16 fb, xb; mul.f32 fa, fa, {s0}; mul.f32 fb, fb, {s1};"
              f" cvt.rn.bf16x2.f32 {dst}, fb, fa;"
              for src, s0, s1, dst in (("c01", "$3", "$4", "$0"), ("c23", "$5", "$6", "$1")))
    + " }")


# Word-wide decoding (D >= 128, rows a multiple of 4 bytes): rows load as int32 words, which
# also keeps the prefetched bytes packed four to a register.

# A word of 4 e4m3 codes ($4) and their fp32 scale ($5) -> bf16 x4 ($0..$3), exact.
_FP8_WORD_ASM = tl.constexpr(
    "{ .reg .b16 c01, c23, xa, xb; .reg .b32 x, y; .reg .f32 fa, fb; mov.b32 {c01, c23}, $4;"
    + "".join(f" cvt.rn.f16x2.e4m3x2 x, {src}; mov.b32 {{xa, xb}}, x; cvt.f32.f16 fa, xa;"
              f" cvt.f32.f16 fb, xb; mul.f32 fa, fa, $5; mul.f32 fb, fb, $5;"
              f" cvt.rn.bf16x2.f32 y, fb, fa; mov.b32 {{{d0}, {d1}}}, y;"
              for src, d0, d1 in (("c01", "$0", "$1"), ("c23", "$2", "$3"))) + " }")

# A word of 8 e2m1 nibbles ($8, element t in bits 4t..4t+3) and their bf16 scale ($9) -> bf16
# x8 ($0..$7), exact, by table: prmt picks each nibble's low and high bf16 bytes from the eight
# e2m1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (two 8-byte tables), two more prmt a pair put them
# in element order, prmt's sign-replicate mode spreads each nibble's sign bit over its byte
# (the even nibbles' signs are byte sign bits of the word shifted left by 4, the odd ones' of
# the word), and one bf16x2 fma a pair applies the scale: e2m1 x e4m3 has <= 6 significant
# bits within bf16's normal range, so the product is exact, and the addend -0 keeps every
# product's sign of zero (sm_80's fma, not sm_90's bf16x2 mul).
_FP4_WORD_LO = 0xC0804000_C0800000  # the bf16 low bytes of magnitudes 7..0
_FP4_WORD_HI = 0x40404040_3F3F3F00  # and their high bytes
_FP4_WORD_BF16_ASM = tl.constexpr(
    "{ .reg .b32 m, n, w4, la, lb, ha, hb, z, s, l0, h0, l1, h1, p, g;"
    f" mov.b32 la, {_FP4_WORD_LO & 0xFFFFFFFF:#x}; mov.b32 lb, {_FP4_WORD_LO >> 32:#x};"
    f" mov.b32 ha, {_FP4_WORD_HI & 0xFFFFFFFF:#x}; mov.b32 hb, {_FP4_WORD_HI >> 32:#x};"
    " mov.b32 z, 0x80008000; mov.b32 s, {$9, $9};"
    " and.b32 m, $8, 0x77777777; shr.b32 n, m, 16; shl.b32 w4, $8, 4;"
    " prmt.b32 l0, la, lb, m; prmt.b32 h0, ha, hb, m;"  # nibbles 0..3: byte k of nibble k
    " prmt.b32 l1, la, lb, n; prmt.b32 h1, ha, hb, n;"  # nibbles 4..7
    + "".join(f" prmt.b32 p, {lo}, {hi}, {pick:#x}; prmt.b32 g, w4, $8, {sign:#x};"
              f" and.b32 g, g, z; or.b32 p, p, g; fma.rn.bf16x2 p, p, s, z;"
              f" mov.b32 {{${2 * j}, ${2 * j + 1}}}, p;"
              for j, lo, hi, pick in ((0, "l0", "h0", 0x5140), (1, "l0", "h0", 0x7362),
                                      (2, "l1", "h1", 0x5140), (3, "l1", "h1", 0x7362))
              # bytes 1 and 3 of pair j: the signs of nibbles 2j (w4's byte j) and 2j+1
              for sign in [((8 | (4 + j)) << 12) | ((8 | j) << 4)]) + " }")


@triton.jit
def _window_raw(row_ptr, ok, c, D: tl.constexpr, DC: tl.constexpr, WORDS: tl.constexpr):
    """Columns [c*DC, (c+1)*DC) of packed window rows at row_ptr [BLOCK_N] (rows ~ok load 0).
    WORDS (DC >= 128, rows 4-byte aligned): int32 words of 4 e4m3 codes [BLOCK_N, DC/128, 4, 8]
    (a 32-code block is 8 words) and of 4 ue8m0 exponents [BLOCK_N, DC/128, 1, 1]; else uint8
    codes [BLOCK_N, DC/32, 32] and exponents [BLOCK_N, DC/32, 1]. Either way the codes load as
    vectors, each exponent byte once."""
    if WORDS:
        ptr = row_ptr.to(tl.pointer_type(tl.int32))[:, None, None, None]
        ok4 = ok[:, None, None, None]
        xw = c * (DC // 128) + tl.arange(0, DC // 128)[None, :, None, None]
        blk = tl.arange(0, 4)[None, None, :, None]
        codes = tl.load(ptr + xw * 32 + blk * 8 + tl.arange(0, 8)[None, None, None, :],
                        mask=ok4, other=0)
        e = tl.load(ptr + D // 4 + xw, mask=ok4, other=0)
    else:
        ptr, ok3 = row_ptr[:, None, None], ok[:, None, None]
        blk = c * (DC // 32) + tl.arange(0, DC // 32)[None, :, None]
        codes = tl.load(ptr + blk * 32 + tl.arange(0, 32)[None, None, :], mask=ok3, other=0)
        e = tl.load(ptr + D + blk, mask=ok3, other=0)
    return codes, e


@triton.jit
def _window_tile(codes, e, D: tl.constexpr, BLOCK_N: tl.constexpr, WORDS: tl.constexpr,
                 INTERPRET: tl.constexpr):
    """_window_raw's codes and exponents -> [BLOCK_N, D] bf16 (fp32 holding the bf16 values
    under the interpreter): code * 2^(e-127), exact."""
    if WORDS:
        e = (e >> (8 * tl.arange(0, 4)[None, None, :, None])) & 0xFF  # [BLOCK_N, D/128, 4, 1]
    s = (e.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # 2^(e-127); byte 0 -> 0 (as ref)
    if not WORDS:
        if INTERPRET:
            v = e4m3_to_fp32(codes) * s
        else:  # 4 codes per asm call: e4m3 -> f16 -> f32, times the scale, -> bf16
            v = tl.inline_asm_elementwise(_FP8_ASM, "=r,=r,r,r,r,r,r", [codes, s],
                                          dtype=tl.bfloat16, is_pure=False, pack=4)
    else:
        if INTERPRET:
            c0, c1, c2, c3 = (e4m3_to_fp32(((codes >> (8 * t)) & 0xFF).to(tl.uint8)) * s
                              for t in tl.static_range(4))
        else:
            c0, c1, c2, c3 = tl.inline_asm_elementwise(
                _FP8_WORD_ASM, "=h,=h,=h,=h,r,r", [codes, s], dtype=(tl.bfloat16,) * 4,
                is_pure=False, pack=1)
        v = tl.join(tl.join(c0, c2), tl.join(c1, c3))  # code t of a word: element 4w + t
    return tl.reshape(v, (BLOCK_N, D))


@triton.jit
def _compressed_raw(row_ptr, ok, c, D: tl.constexpr, DC: tl.constexpr, WORDS: tl.constexpr):
    """Columns [c*DC, (c+1)*DC) of packed compressed rows at row_ptr [BLOCK_N] (rows ~ok load
    0). WORDS: int32 words of 8 e2m1 nibbles [BLOCK_N, DC/64, 4, 2] (a 16-element scale group
    is 2 words) and of 4 e4m3 scales [BLOCK_N, DC/64, 1, 1]; else uint8 pairs [BLOCK_N, DC/16,
    8] (element 2i in the low nibble) and scales [BLOCK_N, DC/16, 1]."""
    if WORDS:
        ptr = row_ptr.to(tl.pointer_type(tl.int32))[:, None, None, None]
        ok4 = ok[:, None, None, None]
        xw = c * (DC // 64) + tl.arange(0, DC // 64)[None, :, None, None]
        grp = tl.arange(0, 4)[None, None, :, None]
        pairs = tl.load(ptr + xw * 8 + grp * 2 + tl.arange(0, 2)[None, None, None, :], mask=ok4,
                        other=0)
        sc = tl.load(ptr + D // 8 + xw, mask=ok4, other=0)
    else:
        ptr, ok3 = row_ptr[:, None, None], ok[:, None, None]
        blk = c * (DC // 16) + tl.arange(0, DC // 16)[None, :, None]
        pairs = tl.load(ptr + blk * 8 + tl.arange(0, 8)[None, None, :], mask=ok3, other=0)
        sc = tl.load(ptr + D // 2 + blk, mask=ok3, other=0)
    return pairs, sc


@triton.jit
def _compressed_tile(pairs, sc, D: tl.constexpr, BLOCK_N: tl.constexpr, WORDS: tl.constexpr,
                     INTERPRET: tl.constexpr):
    """_compressed_raw's bytes -> [BLOCK_N, D] bf16 like _window_tile: e2m1 * scale, exact."""
    if WORDS:
        sc = ((sc >> (8 * tl.arange(0, 4)[None, None, :, None])) & 0xFF).to(tl.uint8)
    scf = e4m3_to_fp32(sc)  # the scales' values (exact in fp32 and in bf16)
    if not WORDS:
        if INTERPRET:  # the asm's re-encoding in plain ops (fp32 holding the bf16 values)
            e4 = tl.reshape(tl.join(e4m3_of_e2m1(pairs & 15), e4m3_of_e2m1(pairs >> 4)),
                            (BLOCK_N, D // 16, 16))  # element 2i: low nibble
            v = e4m3_to_fp32(e4) * (scf * 64.0)
        else:  # 4 bytes per asm call; its outputs are bf16 values, joined in element order
            lo, hi = tl.inline_asm_elementwise(_FP4_ASM, "=r,=r,=r,=r,r,r", [pairs, sc],
                                               dtype=(tl.bfloat16, tl.bfloat16), is_pure=False,
                                               pack=4)
            v = tl.join(lo, hi)
    else:
        if INTERPRET:
            s64 = scf * 64.0  # the re-encoded nibbles are worth their e2m1 value x 2^-6
            e0, e1, e2, e3, e4, e5, e6, e7 = (
                e4m3_to_fp32(e4m3_of_e2m1(((pairs >> (4 * t)) & 15).to(tl.uint8))) * s64
                for t in tl.static_range(8))
        else:
            e0, e1, e2, e3, e4, e5, e6, e7 = tl.inline_asm_elementwise(
                _FP4_WORD_BF16_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [pairs, scf.to(tl.bfloat16)],
                dtype=(tl.bfloat16,) * 8, is_pure=False, pack=1)
        # nibble t of a word: element 8w + t
        v = tl.join(tl.join(tl.join(e0, e4), tl.join(e2, e6)),
                    tl.join(tl.join(e1, e5), tl.join(e3, e7)))
    return tl.reshape(v, (BLOCK_N, D))


@triton.jit
def _page_lookup(bt_base, cr, PAGES, PAGE_ROWS, PAGE_SHIFT: tl.constexpr):
    """Issue the page-table loads for compressed rows cr [BLOCK_N] (-1 = none): (page, row in
    page, valid); _row_ptrs uses the pages (one loop iteration later when prefetching).
    The split of g into page and row is int32 (g < 2^31), by a shift and a mask when PAGE_ROWS
    = 2^PAGE_SHIFT (PAGE_SHIFT < 0: a division): int64 division is a ~80-instruction routine,
    and every thread computes it for each of the rows its loads touch."""
    ok = cr >= 0
    g = tl.where(ok, cr, 0)
    if PAGE_SHIFT >= 0:
        pg, row = g >> PAGE_SHIFT, g & ((1 << PAGE_SHIFT) - 1)
    else:
        pg, row = g // PAGE_ROWS, g % PAGE_ROWS
    return tl.load(bt_base + pg, mask=ok & (pg < PAGES), other=0), row, ok


@triton.jit
def _row_ptrs(pool_ptr, page, row, PAGE_ROWS, D: tl.constexpr):
    """Byte pointers of compressed rows pool[page, row]; page -1 (unallocated) reads page 0,
    like the reference's clamp."""
    return pool_ptr + (tl.maximum(page, 0) * PAGE_ROWS + row) * (D // 2 + D // 16)


@triton.jit
def _cat(x0, x1, R: tl.constexpr, C: tl.constexpr):
    """[R, C] halves -> [R, 2C] (x0's columns first): the interpreter's full-width logits dot."""
    return tl.reshape(tl.permute(tl.join(x0, x1), (0, 2, 1)), (R, 2 * C))


@triton.jit
def _attend(q0, q1, kv0, kv1, valid, scale, m_i, l_i, acc0, acc1, live, NH: tl.constexpr,
            INTERPRET: tl.constexpr):
    """One 64-entry block of the online softmax: logits s = q.kv^T, p rounded to bf16 before
    P.V, acc = acc * alpha + p.kv.

    NH = 2: q, kv and acc come as column halves (q0, kv0, acc0: columns [0, D/2)); the logits
    are one dot chained over the halves (the same k-steps in the same order as the full-width
    dot: on the GPU the same bits; the interpreter, whose tl.dot rounds once per call, takes the
    full-width dot), and P.V runs per half. A tile is then decoded, stored to shared memory and
    multiplied half by half, and fewer registers are live at once (NH = 1: q1, kv1 and acc1 are
    unused placeholders).

    live is always true: the softmax sits in a branch so that the compiler does not see the
    logits' dot feed the P.V dot; it then spreads both warp groups over the logits' columns
    instead of having each compute all of them.
    """
    if NH == 1:
        s = tl.dot(q0, tl.trans(kv0))
    elif INTERPRET:
        s = tl.dot(_cat(q0, q1, q0.shape[0], q0.shape[1]),
                   tl.trans(_cat(kv0, kv1, kv0.shape[0], kv0.shape[1])))
    else:
        s = tl.dot(q1, tl.trans(kv1), tl.dot(q0, tl.trans(kv0)))
    m_new, alpha, p, l_new = m_i, m_i, s, l_i
    if live:
        s = tl.where(valid[None, :], s, float("-inf")) * scale
        m_new = tl.maximum(m_i, tl.max(s, 1))  # >= -1e30, so never -inf: no inf - inf
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])  # invalid entries: exp(-inf) = 0
        l_new = l_i * alpha + tl.sum(p, 1)
    pb = to_bf16(p, INTERPRET)  # the reference's rounding point
    acc0 = tl.dot(pb, kv0, acc0 * alpha[:, None])
    if NH == 2:
        acc1 = tl.dot(pb, kv1, acc1 * alpha[:, None])
    return m_new, l_new, acc0, acc1


@triton.jit
def _window_kv(ptr, ok, D: tl.constexpr, DC: tl.constexpr, NH: tl.constexpr,
               BLOCK_N: tl.constexpr, WORDS: tl.constexpr, INTERPRET: tl.constexpr):
    """Window rows at ptr [BLOCK_N] -> their decoded column chunks (kv0, kv1; kv1 = kv0 when
    NH = 1), each loaded and decoded on its own."""
    codes, e = _window_raw(ptr, ok, 0, D, DC, WORDS)
    kv0 = _window_tile(codes, e, DC, BLOCK_N, WORDS, INTERPRET)
    kv1 = kv0
    if NH == 2:
        codes, e = _window_raw(ptr, ok, 1, D, DC, WORDS)
        kv1 = _window_tile(codes, e, DC, BLOCK_N, WORDS, INTERPRET)
    return kv0, kv1


@triton.jit
def _compressed_raw2(ptr, ok, D: tl.constexpr, DC: tl.constexpr, NH: tl.constexpr,
                     WORDS: tl.constexpr):
    """_compressed_raw of both column chunks (the second a 1-element placeholder if NH = 1)."""
    pairs0, sc0 = _compressed_raw(ptr, ok, 0, D, DC, WORDS)
    pairs1, sc1 = tl.zeros([1], tl.int32), tl.zeros([1], tl.int32)
    if NH == 2:
        pairs1, sc1 = _compressed_raw(ptr, ok, 1, D, DC, WORDS)
    return pairs0, sc0, pairs1, sc1


@triton.jit
def _window_ptrs(ring_ptr, new_ptr, wr, N_RING, N_NEW, D: tl.constexpr):
    """Byte pointers of window entries wr [BLOCK_N] and their validity. An id < N_RING is ring
    row id (the ring read in place, rows D + D/32 bytes apart), an id >= N_RING is new_rows[id -
    N_RING] (clamped to the last row, as the reference's gather), -1 skips: its pointer is ring
    row 0 or new row 0 and every load through it is masked."""
    ok = wr >= 0
    r = tl.where(ok, wr, 0).to(tl.int64)
    ptr = tl.where(r < N_RING, ring_ptr + r * (D + D // 32),
                   new_ptr + tl.minimum(r - N_RING, N_NEW - 1) * (D + D // 32))
    return ptr, ok


@triton.jit
def _sparse_attn_paged_kernel(
        q_ptr, sink_ptr, ring_ptr, new_ptr, widx_ptr, pool_ptr, bt_ptr, trow_ptr, cidx_ptr, o_ptr,
        ml_ptr, acc_ptr, scale, H, N_RING, N_NEW, WW, K, PAGES, PAGE_ROWS, BLOCKS_PER_SPLIT,
        sw_t, sc_t, bt_r, D: tl.constexpr, NH: tl.constexpr, PAGE_SHIFT: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, WORDS: tl.constexpr,
        INTERPRET: tl.constexpr):
    """One (token t, head block, split s) program over list blocks [s*BPS, (s+1)*BPS).

    The list of token t is window_ids[t, :WW] (ring rows or the step's new rows, see
    _window_ptrs) then compressed_idx[t, :K] (through block-table row token_row[t]), walked in
    three loops: window-only blocks, the block where the window part ends, compressed-only
    blocks (the last software-pipelined by hand). SPLIT: write fp32 partials m, l [T, S, H]
    (ml_ptr: m then l) and acc [T, S, H, D] for _combine_kernel; else finish with the sink and
    store o [T, H, D] bf16. WORDS: packed rows load as int32 words (D >= 128, bases 4-aligned).
    NH (1 or 2): the columns are handled in NH chunks of DC = D / NH (see _attend).
    """
    DC: tl.constexpr = D // NH
    bi = tl.program_id(0).to(tl.int64)  # the token t; int64 so offsets cannot overflow
    sp = tl.program_id(2)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    offs_c = tl.arange(0, DC)
    offs_n = tl.arange(0, BLOCK_N)
    # padded heads load q = 0: their logits are finite and their rows are never stored
    q_row = q_ptr + bi * H * D + offs_h[:, None] * D + offs_c[None, :]
    q0 = tl.load(q_row, mask=h_mask[:, None], other=0.0)
    q1 = q0
    if NH == 2:
        q1 = tl.load(q_row + DC, mask=h_mask[:, None], other=0.0)
    if INTERPRET:
        q0, q1 = q0.to(tl.float32), q1.to(tl.float32)
    live = H > 0  # always true (see _attend)

    m_i = tl.full([BLOCK_H], -1e30, tl.float32)  # literal: jit bodies read constexpr globals only
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, DC], tl.float32)
    acc1 = tl.zeros([BLOCK_H, DC if NH == 2 else 1], tl.float32)
    widx_base = widx_ptr + bi * sw_t
    cidx_base = cidx_ptr + bi * sc_t - WW  # entry j >= WW is compressed_idx[t, j - WW]
    bt_base = bt_ptr + tl.load(trow_ptr + bi) * bt_r  # the token's block-table row
    j_start = sp * BLOCKS_PER_SPLIT * BLOCK_N
    j_end = tl.minimum(j_start + BLOCKS_PER_SPLIT * BLOCK_N, WW + K)

    # window-only blocks [j_start, hi): the compiler's pipelining (async copies to shared memory)
    hi = tl.minimum(j_end, WW // BLOCK_N * BLOCK_N)
    for j0 in tl.range(j_start, hi, BLOCK_N, num_stages=2):
        ptr, ok = _window_ptrs(ring_ptr, new_ptr, tl.load(widx_base + j0 + offs_n), N_RING,
                               N_NEW, D)
        kv0, kv1 = _window_kv(ptr, ok, D, DC, NH, BLOCK_N, WORDS, INTERPRET)
        m_i, l_i, acc0, acc1 = _attend(q0, q1, kv0, kv1, ok, scale, m_i, l_i, acc0, acc1, live,
                                       NH, INTERPRET)

    # the block where the window part ends (if WW % BLOCK_N): each row is one or the other
    for j0 in range(tl.maximum(j_start, WW // BLOCK_N * BLOCK_N),
                    tl.minimum(j_end, tl.cdiv(WW, BLOCK_N) * BLOCK_N), BLOCK_N):
        wr = tl.load(widx_base + j0 + offs_n, mask=j0 + offs_n < WW, other=-1)
        cr = tl.load(cidx_base + j0 + offs_n, mask=(j0 + offs_n >= WW) & (j0 + offs_n < WW + K),
                     other=-1)
        ptr, ok_w = _window_ptrs(ring_ptr, new_ptr, wr, N_RING, N_NEW, D)
        kv0, kv1 = _window_kv(ptr, ok_w, D, DC, NH, BLOCK_N, WORDS, INTERPRET)
        page, row, ok_c = _page_lookup(bt_base, cr, PAGES, PAGE_ROWS, PAGE_SHIFT)
        pairs0, sc0, pairs1, sc1 = _compressed_raw2(
            _row_ptrs(pool_ptr, page, row, PAGE_ROWS, D), ok_c, D, DC, NH, WORDS)
        kv0 = kv0 + _compressed_tile(pairs0, sc0, DC, BLOCK_N, WORDS, INTERPRET)
        if NH == 2:
            kv1 = kv1 + _compressed_tile(pairs1, sc1, DC, BLOCK_N, WORDS, INTERPRET)
        m_i, l_i, acc0, acc1 = _attend(q0, q1, kv0, kv1, ok_w | ok_c, scale, m_i, l_i, acc0,
                                       acc1, live, NH, INTERPRET)

    # compressed-only blocks [lo, j_end), prefetched by hand: the bytes of block j+1 are in
    # flight to registers while block j is decoded and multiplied (the compiler's pipelining
    # issues them after block j's work: the two-level index -> page -> row chain), the indices
    # of block j+2 too
    lo = tl.maximum(j_start, tl.cdiv(WW, BLOCK_N) * BLOCK_N)
    cr = tl.load(cidx_base + lo + offs_n, mask=lo + offs_n < j_end, other=-1)
    page, row, ok = _page_lookup(bt_base, cr, PAGES, PAGE_ROWS, PAGE_SHIFT)
    pairs0, sc0, pairs1, sc1 = _compressed_raw2(_row_ptrs(pool_ptr, page, row, PAGE_ROWS, D), ok,
                                                D, DC, NH, WORDS)
    cr = tl.load(cidx_base + lo + BLOCK_N + offs_n, mask=lo + BLOCK_N + offs_n < j_end, other=-1)
    for j0 in tl.range(lo, j_end, BLOCK_N, num_stages=1):
        page, row, ok_next = _page_lookup(bt_base, cr, PAGES, PAGE_ROWS, PAGE_SHIFT)
        pairs0_next, sc0_next, pairs1_next, sc1_next = _compressed_raw2(
            _row_ptrs(pool_ptr, page, row, PAGE_ROWS, D), ok_next, D, DC, NH, WORDS)
        cr = tl.load(cidx_base + j0 + 2 * BLOCK_N + offs_n,
                     mask=j0 + 2 * BLOCK_N + offs_n < j_end, other=-1)
        kv0 = _compressed_tile(pairs0, sc0, DC, BLOCK_N, WORDS, INTERPRET)
        kv1 = kv0
        if NH == 2:
            kv1 = _compressed_tile(pairs1, sc1, DC, BLOCK_N, WORDS, INTERPRET)
        m_i, l_i, acc0, acc1 = _attend(q0, q1, kv0, kv1, ok, scale, m_i, l_i, acc0, acc1, live,
                                       NH, INTERPRET)
        pairs0, sc0, pairs1, sc1, ok = pairs0_next, sc0_next, pairs1_next, sc1_next, ok_next

    if SPLIT:
        ns = tl.num_programs(2)
        part = (bi * ns + sp) * H + offs_h  # [BLOCK_H] rows of the [T, S, H] partials
        tl.store(ml_ptr + part, m_i, mask=h_mask)
        tl.store(ml_ptr + tl.num_programs(0) * ns * H + part, l_i, mask=h_mask)
        tl.store(acc_ptr + part[:, None] * D + offs_c[None, :], acc0, mask=h_mask[:, None])
        if NH == 2:
            tl.store(acc_ptr + part[:, None] * D + DC + offs_c[None, :], acc1,
                     mask=h_mask[:, None])
    else:
        _finish(o_ptr, sink_ptr, bi, offs_h, h_mask, offs_c, m_i, l_i, acc0, H, D, INTERPRET)
        if NH == 2:
            _finish(o_ptr, sink_ptr, bi, offs_h, h_mask, DC + offs_c, m_i, l_i, acc1, H, D,
                    INTERPRET)


@triton.jit
def _combine_kernel(ml_ptr, acc_ptr, sink_ptr, o_ptr, cs_ptr, H, S, D: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, S_PAD: tl.constexpr,
                    R2: tl.constexpr, INTERPRET: tl.constexpr, STAGES: tl.constexpr = 3):
    """Merge S partials: M = max m_s, l = sum l_s e^(m_s-M), acc = sum acc_s e^(m_s-M), the
    sums in split order. Grid: (T, cdiv(H, BLOCK_H), D / BLOCK_D); then the sink and the
    division as unsplit. S_PAD >= S, a power of two: all m_s load at once, and the loop's
    loads are software-pipelined STAGES deep (a decode merge is a few latency-bound loads per
    split).
    R2 > 0: each head's last 2 R2 dims are then turned back by the conjugate rotation of the
    token's row of cs [T, R2, 2] (cos, sin), as rope_heads(inverse=True) turns them: the same
    products and roundings (rope_rotate), so the same bits, and no launch of its own.
    """
    bi, offs_h = tl.program_id(0).to(tl.int64), tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask, offs_d = offs_h < H, tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_s = tl.arange(0, S_PAD)
    m_all = tl.load(ml_ptr + (bi * S + offs_s[:, None]) * H + offs_h[None, :],
                    mask=(offs_s[:, None] < S) & h_mask[None, :], other=-1e30)
    m_max = tl.max(m_all, 0)  # [BLOCK_H], >= -1e30 as the running max from -1e30 was
    l_i, acc = tl.zeros([BLOCK_H], tl.float32), tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for s in tl.range(0, S, num_stages=STAGES):
        part = (bi * S + s) * H + offs_h
        w = tl.exp(tl.load(ml_ptr + part, mask=h_mask, other=-1e30) - m_max)
        l_i += tl.load(ml_ptr + tl.num_programs(0) * S * H + part, mask=h_mask, other=0.) * w
        acc += tl.load(acc_ptr + part[:, None] * D + offs_d[None, :], mask=h_mask[:, None],
                       other=0.0) * w[:, None]
    if R2 == 0:
        _finish(o_ptr, sink_ptr, bi, offs_h, h_mask, offs_d, m_max, l_i, acc, H, D, INTERPRET)
    else:
        o = _normalise(sink_ptr, offs_h, h_mask, m_max, l_i, acc, INTERPRET).to(tl.float32)
        even, odd = tl.split(tl.reshape(o, (BLOCK_H, BLOCK_D // 2, 2)))
        col = tl.program_id(2) * BLOCK_D + 2 * tl.arange(0, BLOCK_D // 2)  # the even members
        pair = col - (D - 2 * R2)  # 2 x the pair index in the tail (negative: not in it)
        tail = pair >= 0
        re, im = rope_rotate(even, odd, cs_ptr + bi * (2 * R2), tl.maximum(pair, 0) // 2,
                             tail[None, :], True, INTERPRET)
        o = tl.reshape(tl.join(tl.where(tail[None, :], re, even),
                               tl.where(tail[None, :], im, odd)), (BLOCK_H, BLOCK_D))
        tl.store(o_ptr + bi * H * D + offs_h[:, None] * D + offs_d[None, :],
                 o.to(tl.bfloat16), mask=h_mask[:, None])


# The split merge's tiles: BLOCK_H heads x MERGE_BLOCK_D columns a program (a power of two
# dividing D), its loop over the splits' partials pipelined MERGE_STAGES deep. At b = 1 over
# 640 rows (10 splits) that is 16 programs, each with 2 of its 10 loads of 8 KB in flight:
# 4.4 us of a decode layer (H100, the thirty-fourth session's timeline). Narrower tiles and a
# deeper pipeline put more of the 1.3 MB of partials in flight at once. Each output's
# arithmetic is the same at any tile or depth: no bit depends on them. Not yet timed:
# bench --part sparse_attn --variant base --variant
# m:ops.sparse_attn.triton.MERGE_BLOCK_D=32,ops.sparse_attn.triton.MERGE_STAGES=8
MERGE_BLOCK_D = 128
MERGE_STAGES = 3


def _pick_splits(n_blocks: int, split_blocks: int | None = None) -> tuple[int, int]:
    """(splits, list blocks per split) of a list of ``n_blocks`` 64-blocks: splits of a fixed
    ``split_blocks`` blocks (the last one shorter), whatever the step's token count. A token's
    list is cut at the same entries alone, in any batch and in any chunk, and its partials are
    merged in the same order, so its bits do not depend on the call; trailing splits of pads
    only (a batch-mate's longer list) merge as exact identities (m = -1e30, l = 0, acc = 0).
    None: SPLIT_BLOCKS."""
    split_blocks = SPLIT_BLOCKS if split_blocks is None else split_blocks
    return cdiv(n_blocks, split_blocks), split_blocks


def _wave_splits(programs: int, n_blocks: int, sms: int) -> int:
    """split_blocks=0: the step-sized split count (the previous default, not call-invariant):
    when few programs run (T x head blocks under half of ``sms``) fill one wave of ``sms``
    programs (at D=512 a program has an SM to itself: more waves measured slower on an H200);
    1 otherwise. A list of SHORT_LIST_BLOCKS blocks or fewer (a window alone: SWA's 128 rows)
    splits only while 4 x programs <= sms: a split then saves one block's work, while its fp32
    partials (H x D per program, written and read back) grow with the programs (H200, D = 512,
    64 heads, 128 rows: b = 1 and 8 gain 2 us from 2 splits, b = 64 loses 7 us). The cut then
    depends on how many tokens share the step."""
    if 2 * programs > sms or n_blocks <= 1 or (n_blocks <= SHORT_LIST_BLOCKS
                                               and 4 * programs > sms):
        return 1
    s = min(n_blocks, sms // programs)
    return cdiv(n_blocks, cdiv(n_blocks, s))  # no split left without a block


def plan_splits(programs: int, n_blocks: int, device: torch.device,
                num_splits: int | None = None, split_blocks: int | None = None
                ) -> tuple[int, int]:
    """(splits, 64-blocks per split) of lists of ``n_blocks`` blocks for ``programs``
    programs a split, as sparse_attn_paged's num_splits and split_blocks say."""
    if num_splits is None and split_blocks == 0:
        num_splits = _wave_splits(programs, n_blocks, sm_count(device))
    if num_splits is None:
        return _pick_splits(n_blocks, split_blocks or SPLIT_BLOCKS)
    return num_splits, cdiv(n_blocks, num_splits)


def paged_output(q: torch.Tensor, sink: torch.Tensor, out: torch.Tensor | None,
                 out_rot: torch.Tensor | None, entries: int) -> tuple[torch.Tensor, int, bool]:
    """The paged ops' output, once their inputs are checked: (out, out_rot's R/2 (checked; 0
    without it), done). done: nothing to launch, out holds the result: it has no elements, or
    no token has a list entry (``entries`` = Ww + K = 0), so every row is o = 0 turned back
    by out_rot as finish_paged turns any unsplit output (the reference's rotated zeros, their
    signs included), whichever kernel would have run."""
    r2 = 0 if out_rot is None else check_rot(out_rot, q.shape[0], q.shape[2])
    out = out_buffer(out, q.shape, torch.bfloat16, q.device)
    if out.numel() == 0:
        return out, r2, True
    if entries == 0:
        return finish_paged(out.zero_(), None, sink, out_rot, r2), r2, True
    return out, r2, False


def finish_paged(out: torch.Tensor, partials: tuple | None, sink: torch.Tensor,
                 out_rot: torch.Tensor | None, r2: int) -> torch.Tensor:
    """A paged kernel's output [T, H, D] bf16: with ``partials`` (split_partials' m then l [2,
    T, S, H] and acc [T, S, H, D], fp32, as the kernel left them) out = their merge with the
    sink by _combine_kernel, which also turns each head's last 2 r2 dims back by out_rot (r2 =
    0: none); unsplit (None), out as the kernel wrote it, turned back by rope_heads in place
    where out_rot is given."""
    if partials is None:
        return out if out_rot is None else rope_heads(out, out_rot, inverse=True, in_place=True)
    ml, acc = partials
    t_all, s, h, d = acc.shape
    bd = min(d, MERGE_BLOCK_D)  # small merge tiles: enough programs to read the partials fast
    _combine_kernel[(t_all, cdiv(h, BLOCK_H), d // bd)](
        ml, acc, sink, out, sink if out_rot is None else cos_sin(out_rot), h, s, D=d,
        BLOCK_H=BLOCK_H, BLOCK_D=bd, S_PAD=next_pow2(s), R2=r2,
        INTERPRET=interpreting(), STAGES=MERGE_STAGES)
    return out


def _check(name: str, t, shape: tuple, dtype: torch.dtype) -> None:
    """Raise unless t is a tensor of ``dtype`` shaped ``shape`` (a str entry: any size), naming
    the argument, its shape and dtype and what is wanted: ValueError for a rank or size,
    TypeError for a dtype."""
    def want() -> str:  # the message's parts, made only for a message (host time per call)
        return "[" + ", ".join(map(str, shape)) + "] " + str(dtype).removeprefix("torch.")

    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a {want()} tensor, got {type(t).__name__}")
    bad_shape = t.dim() != len(shape) or \
        any(isinstance(w, int) and n != w for n, w in zip(t.shape, shape))
    if bad_shape or t.dtype != dtype:
        got = f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
        raise (ValueError if bad_shape else TypeError)(f"{name} must be {want()}, got {got}")


def check_paged_inputs(q, sink, window_ring, new_rows, window_ids, compressed_pool,
                       block_table, token_row, compressed_idx) -> tuple[int, int, int, int, int]:
    """sparse_attn_paged's arguments checked as its docstring says (ValueError or TypeError
    naming the argument, what it is and what is wanted); (T, H, D, Ww, K)."""
    _check("q", q, ("T", "H", "D"), torch.bfloat16)
    t_all, h, d = q.shape
    rb = d + d // 32  # packed window row bytes
    if d < 32 or d & (d - 1):
        raise ValueError(f"q {tuple(q.shape)}: head dim D = {d} must be a power of two >= 32")
    _check("sink", sink, (h,), torch.float32)
    _check("window_ring", window_ring, ("B", "S", rb), torch.uint8)
    if not window_ring.is_contiguous():  # read in place as [B*S, D + D/32]: never copied
        raise ValueError(f"window_ring {tuple(window_ring.shape)} must be contiguous (it is read "
                         f"in place as [B*S, {rb}]), got strides {window_ring.stride()}")
    _check("new_rows", new_rows, (t_all, rb), torch.uint8)
    _check("window_ids", window_ids, (t_all, "Ww"), torch.int32)
    _check("token_row", token_row, (t_all,), torch.int64)
    _check("compressed_idx", compressed_idx, (t_all, "K"), torch.int32)
    ww, k = window_ids.shape[1], compressed_idx.shape[1]
    if k:
        for name, x in (("compressed_pool", compressed_pool), ("block_table", block_table)):
            if x is None:
                raise ValueError(f"{name} is None but compressed_idx "
                                 f"{tuple(compressed_idx.shape)} has K = {k} entries per token")
        _check("compressed_pool", compressed_pool, ("P", "page_rows", d // 2 + d // 16),
               torch.uint8)
        _check("block_table", block_table, ("B", "pages"), torch.int64)
    return t_all, h, d, ww, k


def check_split_args(num_splits: int | None, split_blocks: int | None) -> None:
    """sparse_attn_paged's num_splits (>= 1) and split_blocks (>= 0), or None."""
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if split_blocks is not None and split_blocks < 0:
        raise ValueError(f"split_blocks must be >= 0, got {split_blocks}")


def check_paged_devices(q, sink, window_ring, new_rows, window_ids, compressed_pool, block_table,
                        token_row, compressed_idx) -> None:
    """Every tensor sparse_attn_paged reads on one device (the pool and block table only where
    there are compressed entries), else ValueError naming where each is."""
    tensors = {"q": q, "sink": sink, "window_ring": window_ring, "new_rows": new_rows,
               "window_ids": window_ids, "token_row": token_row, "compressed_idx": compressed_idx}
    if compressed_idx.shape[1]:
        tensors.update(compressed_pool=compressed_pool, block_table=block_table)
    if len({x.device for x in tensors.values()}) != 1:
        raise ValueError("all tensors must be on one device, got " +
                         ", ".join(f"{n} on {x.device}" for n, x in tensors.items()))


def paged_operands(q, sink, window_ring, new_rows, window_ids, compressed_pool, block_table,
                   token_row, compressed_idx, align: int = 1) -> tuple:
    """The paged kernels' operands from checked inputs: (q, sink, ring, new_rows, widx,
    pool, table, token_row, cidx, n_ring, page_shift). The ring is read in place (new_rows
    stands in for an empty one: a valid pointer, never read); the index lists keep their
    token stride (the layer may pass an expanded window list); without compressed entries the
    pool and table are stand-ins never read (a view: no fill launch); new_rows is copied to a
    fresh buffer when it does not start ``align``-byte aligned; page_shift: log2 of the page
    rows, -1 when not a power of two."""
    q, sink, new_rows, token_row = (x.contiguous() for x in (q, sink, new_rows, token_row))
    if new_rows.data_ptr() % align:  # the step's few rows: a fresh (aligned) copy
        new_rows = new_rows.clone()
    n_ring = window_ring.shape[0] * window_ring.shape[1]
    ring = window_ring if n_ring else new_rows
    widx, cidx = (x if x.stride(1) == 1 or x.shape[1] <= 1 else x.contiguous()
                  for x in (window_ids, compressed_idx))
    pool, table = (compressed_pool.contiguous(), block_table.contiguous()) \
        if compressed_idx.shape[1] else (ring, token_row.view(1, -1))
    page_rows = pool.shape[1]
    page_shift = page_rows.bit_length() - 1 if page_rows & (page_rows - 1) == 0 else -1
    return q, sink, ring, new_rows, widx, pool, table, token_row, cidx, n_ring, page_shift


def split_partials(q: torch.Tensor, splits: int) -> tuple:
    """(ml, acc): the fp32 partials of a paged kernel cut into ``splits`` > 1 (m then l [2, T,
    S, H], acc [T, S, H, D]), for finish_paged."""
    t_all, h, d = q.shape
    return (q.new_empty(2, t_all, splits, h, dtype=torch.float32),
            q.new_empty(t_all, splits, h, d, dtype=torch.float32))


def sparse_attn_paged(q: torch.Tensor, sink: torch.Tensor, scale: float,
                      window_ring: torch.Tensor, new_rows: torch.Tensor, window_ids: torch.Tensor,
                      compressed_pool: torch.Tensor | None, block_table: torch.Tensor | None,
                      token_row: torch.Tensor, compressed_idx: torch.Tensor,
                      max_queries: int = 64, *, out: torch.Tensor | None = None,
                      num_splits: int | None = None, split_blocks: int | None = None,
                      block_h: int | None = None, num_warps: int | None = None,
                      d_chunks: int | None = None, out_rot: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """``reference.sparse_attn_paged`` in Triton: rows decoded in registers from the packed bytes,
    one query per packed token of a step; the window ring is read in place (never copied).

    q: [T, H, D] bf16; sink: [H] fp32; window_ring: [B, S, D + D/32] uint8, contiguous, the
    layer's ring (e4m3 codes, ue8m0 exponent per 32); new_rows: [T, D + D/32] uint8, the step's
    own packed window rows; window_ids: [T, Ww] int32, id < B*S: ring row
    ``window_ring.view(B*S, -1)[id]``, id >= B*S: ``new_rows[id - B*S]``, -1 skip;
    compressed_pool: [P, page_rows, D/2 + D/16] uint8 (e2m1 pairs, e4m3 scale per 16) or None;
    block_table: [B, pages] int64 page ids of every state row (or None); token_row: [T] int64
    state row (block-table row) of each token; compressed_idx: [T, K] int32 row numbers g (row
    g = pool[block_table[token_row[t], g // page_rows], g % page_rows]), -1 skip. Each token's
    list is its window entries then its compressed entries, walked in blocks of 64.
    max_queries: the reference's chunking, no effect here (one signature for both).
    Keyword-only: out, an optional contiguous [T, H, D] bf16 buffer; num_splits, programs per
    (token, head block) over the list (flash-decoding), None = splits of ``split_blocks``
    64-blocks each (None = SPLIT_BLOCKS), the same cut for every token count (_pick_splits);
    split_blocks=0 sizes the splits to the step instead (_wave_splits: faster at some batch
    sizes, but a token's bits then depend on the step); a forced num_splits cuts by the step's
    longest list; block_h, the head tile
    (power of two >= 16), None = H rounded up to a power of two in [16, 64], or 16 for a
    step of one token with split_blocks=0 (H100, V4.1-Flash, b=1: 18.9 against 22.2 us; from
    b=8 the 16-head tiles lose, 30.9 against 24.0: ``bench --part attn_variants``);
    num_warps, None = 4 (8 at D > 128); d_chunks, the column chunks a tile is decoded and
    multiplied in (1 or 2, see _attend; 2 needs D >= 64; the same bits either way), None = 1
    (2 measured slower on an H200 with Triton 3.6); out_rot, None or [T, R/2] complex64: the
    output's last R dims of each head turned back by its conjugate (the reference's out_rot),
    by the split merge where the list splits (no launch of its own), else by rope_heads in
    place after the kernel.
    Returns [T, H, D] bf16; a token without entries gives 0 (no NaN).
    """
    t_all, h, d, ww, k = check_paged_inputs(q, sink, window_ring, new_rows, window_ids,
                                            compressed_pool, block_table, token_row,
                                            compressed_idx)
    if block_h is None and split_blocks == 0 and t_all == 1:
        block_h = BLOCK_H  # one token, splits sized to the step: more, smaller programs
    block_h = block_h or min(BLOCK_H_MAX, max(BLOCK_H, next_pow2(h)))
    if block_h < 16 or block_h & (block_h - 1):
        raise ValueError(f"block_h must be a power of two >= 16, got {block_h}")
    if d_chunks not in (None, 1, 2) or (d_chunks == 2 and d < 64):
        raise ValueError(f"d_chunks must be 1 or 2 (2 at D >= 64), got {d_chunks} at D = {d}")
    check_split_args(num_splits, split_blocks)
    check_paged_devices(q, sink, window_ring, new_rows, window_ids, compressed_pool,
                        block_table, token_row, compressed_idx)
    out, r2, done = paged_output(q, sink, out, out_rot, ww + k)
    if done:
        return out
    q, sink, ring, new_rows, widx, pool, table, token_row, cidx, n_ring, page_shift = \
        paged_operands(q, sink, window_ring, new_rows, window_ids, compressed_pool, block_table,
                       token_row, compressed_idx)
    # D >= 128: rows load as int32 words when every base is 4-byte aligned (the row sizes are
    # multiples of 4 there); views that are not take the byte path instead of being copied
    nh = d_chunks or 1  # 2: fewer live registers per step, but more spills on Triton 3.6
    words = d // nh >= 128 and all(x.data_ptr() % 4 == 0 for x in (ring, new_rows, pool))
    h_blocks = cdiv(h, block_h)
    s, per_split = plan_splits(t_all * h_blocks, cdiv(ww + k, BLOCK_N), q.device,
                               num_splits, split_blocks)
    partials = split_partials(q, s) if s > 1 else None
    interp, warps = interpreting(), num_warps or (4 if d <= 128 else 8)
    _sparse_attn_paged_kernel[(t_all, h_blocks, s)](
        q, sink, ring, new_rows, widx, pool, table, token_row, cidx, out,
        *(partials or (sink, sink)), float(scale), h, n_ring, t_all, ww, k, table.shape[1],
        pool.shape[1], per_split, widx.stride(0), cidx.stride(0), table.stride(0), D=d, NH=nh,
        PAGE_SHIFT=page_shift,
        BLOCK_H=block_h,
        BLOCK_N=BLOCK_N,
        SPLIT=s > 1, WORDS=words, INTERPRET=interp, num_warps=warps)
    return finish_paged(out, partials, sink, out_rot, r2)
