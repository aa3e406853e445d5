"""The kernels' inline PTX decodes (GPU only: under the interpreter the kernels
take plain-op branches instead): the sparse attention's fp8 and fp4 row decodes and the
indexer's key decode and per-head terms, run on the CPU by tests/ptx_asm.py, bit for bit
against the reference unpacking of packed rows (ops/common/packing.py) and the reference's
rounding points: every code in every position of an asm call, with every scale the quantisers
can write."""
import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from ptx_asm import _e4m3_to_f32, run  # noqa: E402

from dsv41attn.ops.common.packing import (unpack_compressed_rows,  # noqa: E402
                                          unpack_window_rows)
from dsv41attn.ops.sparse_attn import triton as tk  # noqa: E402

E4M3_SCALES = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint32)  # finite codes
E8M0 = np.arange(0, 255, dtype=np.uint32)  # ue8m0 exponents but NaN (255); 0 is scale 0 in both


def _bits(x: torch.Tensor) -> np.ndarray:
    return x.contiguous().view(torch.int16).numpy().view(np.uint16)


def _words(per_byte: int, seed: int) -> np.ndarray:
    """Words in which each byte position takes each of its 256 values, per_byte times (the
    other bytes random)."""
    g = np.random.default_rng(seed)
    w = g.integers(0, 1 << 32, (4, 256, per_byte), dtype=np.uint64)
    for pos in range(4):
        w[pos] = (w[pos] & ~np.uint64(0xFF << (8 * pos))) | (
            np.arange(256, dtype=np.uint64)[:, None] << np.uint64(8 * pos))
    return w.reshape(-1).astype(np.uint32)


def _compressed_ref(words: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Reference bf16 bits [N, 8] of the 8 e2m1 elements of each word at its e4m3 scale."""
    b = words.astype(np.uint32)
    row = np.stack([(b >> (8 * i)) & 0xFF for i in range(4)] + [np.zeros_like(b)] * 4
                   + [scale], -1).astype(np.uint8)  # D = 16: 8 pair bytes, 1 scale
    return _bits(unpack_compressed_rows(torch.from_numpy(row)))[:, :8]


def test_fp4_word_asm_equals_the_reference_unpacking():
    """_FP4_WORD_BF16_ASM (8 nibbles a call, the Triton and Gluon kernels' compressed rows): its
    operands as the kernels pass them (the word; the scale's e4m3 value in bf16)."""
    words = np.tile(_words(1, 0), len(E4M3_SCALES))
    scale = np.repeat(E4M3_SCALES, len(words) // len(E4M3_SCALES))
    scb = _bits(torch.from_numpy(_e4m3_to_f32(scale)).to(torch.bfloat16))
    got = np.stack(run(tk._FP4_WORD_BF16_ASM.value, {8: words, 9: scb}, 8), -1).astype(np.uint16)
    want = _compressed_ref(words, scale)
    assert np.array_equal(got, want), np.argwhere(got != want)[:5]


def _halves(regs: list[np.ndarray]) -> np.ndarray:
    """b32 results holding bf16 pairs (low half first) -> [N, 2 * len(regs)] bits."""
    return np.stack([h for r in regs for h in (r & 0xFFFF, r >> 16)], -1).astype(np.uint16)


def test_fp4_bytes_asm_equals_the_reference_unpacking():
    """_FP4_ASM (4 pair bytes a call, each byte with its own e4m3 scale): the 4 low nibbles'
    bf16 in $0, $1 and the 4 high nibbles' in $2, $3."""
    pairs = _words(16, 2)
    scales = np.random.default_rng(1).choice(E4M3_SCALES, (len(pairs), 4)).astype(np.uint32)
    sc = (scales << (np.arange(4, dtype=np.uint32) * 8)).sum(-1).astype(np.uint32)
    out = run(tk._FP4_ASM.value, {4: pairs, 5: sc}, 4)
    lo, hi = _halves(out[:2]), _halves(out[2:])
    for i in range(4):
        want = _compressed_ref((pairs >> np.uint32(8 * i)) & 0xFF, scales[:, i])
        assert np.array_equal(lo[:, i], want[:, 0]) and np.array_equal(hi[:, i], want[:, 1]), i


def test_fp8_word_asm_equals_the_reference_unpacking():
    """_FP8_WORD_ASM (4 e4m3 codes a call, the Triton kernel's window rows) with the block's
    fp32 scale 2^(e-127), for every finite code in every byte and every exponent (products
    past bf16's range are inf in both)."""
    words = _words(1, 3)
    nan = np.zeros(len(words), bool)
    for i in range(4):  # e4m3 NaN (0x7F, 0xFF): never written (codes saturate at +-448)
        nan |= ((words >> np.uint32(8 * i)) & 0x7F) == 0x7F
    words = np.tile(words[~nan], len(E8M0))
    e = np.repeat(E8M0, len(words) // len(E8M0))
    s = (e << np.uint32(23)).astype(np.uint32)  # fp32 bits of 2^(e-127)
    got = np.stack(run(tk._FP8_WORD_ASM.value, {4: words, 5: s}, 4), -1).astype(np.uint16)
    row = np.concatenate([np.stack([(words >> np.uint32(8 * i)) & 0xFF for i in range(4)], -1),
                          np.zeros((len(words), 28), np.uint32), e[:, None]], -1)
    want = _bits(unpack_window_rows(torch.from_numpy(row.astype(np.uint8))))[:, :4]
    assert np.array_equal(got, want), np.argwhere(got != want)[:5]


def test_fp8_bytes_asm_equals_the_reference_unpacking():
    """_FP8_ASM (4 e4m3 codes a call, each with its own fp32 scale; bf16 pairs in $0, $1)."""
    words = _words(4, 4)
    nan = np.zeros(len(words), bool)
    for i in range(4):
        nan |= ((words >> np.uint32(8 * i)) & 0x7F) == 0x7F
    words = words[~nan]
    e = np.random.default_rng(5).choice(E8M0, (len(words), 4)).astype(np.uint32)
    s = {3 + i: (e[:, i] << np.uint32(23)).astype(np.uint32) for i in range(4)}
    got = _halves(run(tk._FP8_ASM.value, {2: words, **s}, 2))
    for i in range(4):
        row = np.zeros((len(words), 33), np.uint32)
        row[:, 0], row[:, 32] = (words >> np.uint32(8 * i)) & 0xFF, e[:, i]
        want = _bits(unpack_window_rows(torch.from_numpy(row.astype(np.uint8))))[:, 0]
        assert np.array_equal(got[:, i], want), i


def test_indexer_nibbles_asm_equals_the_reference_unpacking():
    """The indexer's _NIBBLES_BF16 (its keys: 8 e2m1 nibbles a call through the bf16
    subnormals, times 2^126 and the block's 2^(E-127) in two bf16x2 multiplies; outputs in the
    order of nibbles 0, 4, 1, 5, 2, 6, 3, 7) against unpack_index_keys, for every byte in every
    position and every ue8m0 exponent (255: inf, and 0 x inf NaN in both)."""
    from dsv41attn.ops.common.packing import unpack_index_keys
    from dsv41attn.ops.indexer.triton import _NIBBLES_BF16
    e = np.arange(256, dtype=np.uint32)
    words = np.tile(_words(1, 7), len(e))
    ex = np.repeat(e, len(words) // len(e))
    got = np.stack(run(_NIBBLES_BF16.value, {8: words, 9: np.uint32(0x7E807E80),
                                              10: (ex << np.uint32(7)) | (ex << np.uint32(23))},
                       8), -1).astype(np.uint16)[:, [0, 2, 4, 6, 1, 3, 5, 7]]
    row = np.concatenate([np.stack([(words >> np.uint32(8 * i)) & 0xFF for i in range(4)], -1),
                          np.zeros((len(words), 12), np.uint32), ex[:, None]], -1)
    want = _bits(unpack_index_keys(torch.from_numpy(row.astype(np.uint8))))[:, :8]
    nan = lambda b: (b & 0x7FFF) > 0x7F80  # noqa: E731  (NaN payloads may differ)
    assert np.array_equal(nan(got), nan(want))
    assert np.array_equal(np.where(nan(got), 0, got), np.where(nan(want), 0, want))


def test_indexer_head_terms_asm_equals_the_reference_rounding():
    """The indexer's _HEAD_TERMS_ASM (two heads a call: the fp32 dot rounded to bf16, relu'd
    with NaN kept, times the bf16 head weight rounded to bf16, back as fp32) against the
    reference's rounding points in torch, on dots of every magnitude, signs, infinities and
    NaN. A dot of -0 is left out: PTX's max turns it into +0 where the reference keeps -0, and
    a tensor-core dot never is -0 (its accumulator starts at +0)."""
    from dsv41attn.ops.indexer.triton import _HEAD_TERMS_ASM
    g = torch.Generator().manual_seed(8)
    n = 1 << 16
    dots = torch.randn(n, 2, generator=g) * torch.exp2(torch.randint(-140, 128, (n, 2),
                                                                      generator=g).float())
    dots[:64] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0] * 32).view(64, 2)
    w = (torch.randn(n, 2, generator=g) * 4).bfloat16()
    s = dots.bfloat16()
    keep = ~((s == 0) & torch.signbit(s)).any(1)
    dots, w, s = dots[keep], w[keep], s[keep]
    relu = torch.where(s < 0, torch.zeros_like(s), s)  # NaN kept
    want = (relu.float() * w.float()).bfloat16().float()
    wbits = w.view(torch.int16).numpy().view(np.uint16).astype(np.uint32)
    got = run(_HEAD_TERMS_ASM.value, {2: dots[:, 0].numpy().view(np.uint32),
                                      3: dots[:, 1].numpy().view(np.uint32),
                                      4: wbits[:, 0] | (wbits[:, 1] << np.uint32(16))}, 2)
    got = torch.from_numpy(np.stack(got, -1).view(np.float32))
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(torch.nan_to_num(got).view(torch.int32),
                       torch.nan_to_num(want).view(torch.int32))


def test_e8m0x4_asm_bit_exact():
    """The fp8 decode GEMM's block-scale word decode (common.triton.E8M0X4_ASM): every byte in
    every position of a word gives torch's float8_e8m0fnu -> fp32 cast (0 -> 2^-127, 255 ->
    NaN, with e8m0_to_fp32's NaN bits 0x7FC00000)."""
    from dsv41attn.ops.common.triton import E8M0X4_ASM

    w = _words(8, 3)
    outs = run(E8M0X4_ASM.value, {4: w}, 4)
    for pos, got in enumerate(outs):
        b = (w >> np.uint32(8 * pos)) & 0xFF
        want = torch.from_numpy(b.astype(np.uint8)).view(torch.float8_e8m0fnu).float()
        want = want.numpy().view(np.uint32)
        want = np.where(b == 255, np.uint32(0x7FC00000), want)  # torch's NaN may carry a sign
        assert np.array_equal(got, want), pos
