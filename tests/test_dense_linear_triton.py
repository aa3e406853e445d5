"""Triton bf16 / fp32 linears (ops/linear/triton.dense_linear) and the row RMSNorm kernel
(ops/common/triton.rms_norm) against the reference ops and an fp64 oracle; a row's bits never
depend on how many rows share the call. Runs under TRITON_INTERPRET=1 on the CPU, and on a GPU
when there is one."""
import os

import pytest
import torch

pytest.importorskip("triton")

import sm90_compile  # noqa: E402

import dsv41attn.ops.linear.triton as T
from dsv41attn.ops.common.norm import rms_norm as ref_rms_norm
from dsv41attn.ops.common.triton import DEFAULT_SM_COUNT, rms_norm
from dsv41attn.ops.linear.reference import linear as ref_linear
from dsv41attn.ops.linear.triton import dense_linear, linear

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BITS = {torch.bfloat16: torch.int16, torch.float32: torch.int32}


def _operands(m, n, k, groups, dtype, seed):
    """x [m, groups*k] and w [groups*n, k] with column scales spread over 2^+-8 (so fp32 sums
    round unevenly), in ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.exp2(torch.randint(-8, 8, (1, k), generator=g).float())
    x = torch.randn(m, groups, k, generator=g) / spread
    w = torch.randn(groups * n, k, generator=g) * spread / k ** 0.5
    return x.reshape(m, groups * k).to(dtype), w.to(dtype)


def _oracle(x, w, groups):
    m, n, k = x.shape[0], w.shape[0] // groups, w.shape[1]
    return torch.einsum("mgk,gnk->mgn", x.double().view(m, groups, k),
                        w.double().view(groups, n, k)).reshape(m, groups * n)


def _same(a, b):
    return torch.equal(a.view(BITS[a.dtype]), b.view(BITS[b.dtype]))


# (M, N per group, K per group, groups): K off the 64 step, N off the 64 tile, M across tiles
CASES = [(1, 37, 200, 1), (5, 16, 128, 2), (70, 40, 96, 1), (17, 8, 320, 3)]


# (weight dtype, x dtype): an fp32 weight on bf16 x (the compressor's projections) runs the
# three-part bf16 dots (_pieces_dot), on fp32 x the FMA chains
DTYPES = [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
          (torch.float32, torch.bfloat16)]
DTYPE_IDS = ["bf16", "fp32", "fp32-bf16x"]


@pytest.mark.parametrize("dtype,xdtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("m,n,k,groups", CASES)
def test_vs_oracle_and_reference(m, n, k, groups, dtype, xdtype):
    """Within one bf16 rounding (bf16 weights) or about an fp32 ulp (fp32 weights) of the
    fp64 oracle: an fp32 weight's three bf16 parts lose no bit (a lost part would be off by
    2^-16 of a product or more)."""
    x, w = _operands(m, n, k, groups, dtype, seed=m + n + k)
    x = x.to(xdtype)
    got = dense_linear(x.to(DEV), w.to(DEV), groups).cpu()
    assert got.dtype == dtype and got.shape == (m, groups * n)
    oracle = _oracle(x, w, groups)
    scale = (x.double().abs().view(m, groups, k).unsqueeze(2)
             * w.double().abs().view(groups, n, k)).sum(-1).reshape(m, groups * n)
    if dtype == torch.bfloat16:  # one bf16 rounding of an fp32 sum of bf16 products
        assert ((got.double() - oracle).abs() <= 2 ** -8 * oracle.abs() + 1e-5 * scale).all()
    else:  # an fp32 sum of 32 (x 3) exact products a step, fp64 across them, fp32 once
        assert ((got.double() - oracle).abs() <= 2 ** -24 * oracle.abs() + 2e-6 * scale).all()
    if groups == 1:  # and reference.linear, up to its summation order
        ref = ref_linear(x, w)
        assert ref.dtype == dtype
        tol = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
        assert ((got.double() - ref.double()).abs() <= tol * ref.double().abs()
                + 1e-5 * scale).all()


@pytest.mark.parametrize("dtype,xdtype", DTYPES, ids=DTYPE_IDS)
def test_rows_alone_equal_rows_in_any_batch(dtype, xdtype):
    """One summation order whatever M: split-K programs (M = 1), one program summing its K
    ranges (M = 5), 64- and 128-row tiles (M = 40, 130); forced ranges either way."""
    n, k = 40, 640
    x, w = _operands(130, n, k, 1, dtype, seed=3)
    x, w = x.to(xdtype).to(DEV), w.to(DEV)
    pieces = dtype != xdtype
    plans = {m: T._dense_plan(m, n, k, 1, dtype, DEFAULT_SM_COUNT, pieces=pieces)
             for m in (1, 5, 40, 130)}
    assert all(p.pieces == pieces for p in plans.values())
    if pieces:  # the tensor cores' one instruction shape at every M
        assert {p.block_m for p in plans.values()} == {64}
    assert len({p.order for p in plans.values()}) == 1 and plans[1].order.ranges > 1
    assert plans[1].workspace
    if dtype == torch.bfloat16:  # weight-bound: the partials' traffic decides
        assert not plans[130].workspace
    else:  # FMA-bound: split while the tiles leave SMs idle, not once they fill them
        assert plans[130].workspace
        big = 128 * DEFAULT_SM_COUNT
        assert not T._dense_plan(big, n, k, 1, dtype, DEFAULT_SM_COUNT, pieces=pieces).workspace
    full = dense_linear(x, w)
    for m in (1, 5, 40):
        for r0 in (0, 130 - m):
            assert _same(dense_linear(x[r0:r0 + m], w), full[r0:r0 + m]), (m, r0)
    for splits in (1, 3):
        a = dense_linear(x[:7], w, num_splits=splits, workspace=True)
        b = dense_linear(x[:7], w, num_splits=splits, workspace=False)
        assert _same(a, b)
    assert _same(linear(x[:3], w), full[:3])


def test_leading_dims_and_bad_inputs():
    x, w = _operands(6, 24, 64, 1, torch.bfloat16, seed=4)
    x, w = x.to(DEV), w.to(DEV)
    assert _same(dense_linear(x.view(2, 3, 64), w).reshape(6, 24), dense_linear(x, w))
    assert dense_linear(x[:0], w).shape == (0, 24)
    zero = dense_linear(x.view(2, 3, 64)[..., :0], w[:, :0])  # K = 0: zeros, leading dims kept
    assert zero.shape == (2, 3, 24) and not zero.any()
    with pytest.raises(ValueError, match="weight"):
        dense_linear(x, w.to(torch.float16))
    with pytest.raises(ValueError, match="groups"):
        dense_linear(x, w, 5)
    with pytest.raises(ValueError, match="does not match"):
        dense_linear(x[:, :32], w)
    with pytest.raises(ValueError, match="num_splits"):
        dense_linear(x, w, num_splits=2)  # K = 64: one step


def _fp8_operands(m, n, k, groups, seed):
    """x [m, groups*k] bf16 and an fp8 w [groups*n, k] whose 32x32 blocks span 2^-12 .. 2^5
    (many scale exponents, so a wrong block's scale shows)."""
    from dsv41attn.checkpoint import quantize_fp8
    x, w = _operands(m, n, k, groups, torch.float32, seed)
    g = torch.Generator().manual_seed(seed + 1)
    blocks = torch.exp2(torch.randint(-12, 6, (-(-w.shape[0] // 32), -(-k // 32)),
                                      generator=g).float())
    w = w * blocks.repeat_interleave(32, 0).repeat_interleave(32, 1)[:w.shape[0], :k]
    return x.bfloat16(), quantize_fp8(w)


# (M, N per group, K per group, groups, num_splits, tiles, tma): K off the 64 step and off
# the 32-block (200: one 32-block past the last whole step's first half; 208: TMA-readable),
# N off the tile and under one scale block (8 rows a group: groups share scale rows), M across
# 16- and 64-row tiles, the split ranges and the one-program sum, TMA boxes and plain loads
FP8_CASES = [(1, 37, 200, 1, None, None, None), (5, 16, 128, 2, 2, None, False),
             (70, 40, 96, 1, None, None, None), (17, 8, 320, 3, 3, (16, 64, 4, 3), True),
             (3, 64, 208, 2, None, (16, 128, 4, 2), True), (33, 24, 256, 2, 4, None, True)]


@pytest.mark.parametrize("rescaled", [False, True], ids=["scaled", "rescaled"])
@pytest.mark.parametrize("m,n,k,groups,splits,tiles,tma", FP8_CASES)
def test_fp8_codes_give_dense_linear_bits(m, n, k, groups, splits, tiles, tma, rescaled):
    """dense_fp8_linear on an fp8 weight's codes and block scales = dense_linear on its bf16
    values, bit for bit, every output written (a NaN-poisoned out); also with ``rescaled``
    (the split TMA tiles on the unscaled codes, the accumulator stepped from block scale to
    block scale: its own branch of the kernel, on the GPU and under the interpreter)."""
    x, w = _fp8_operands(m, n, k, groups, seed=m + n + k)
    x, w8, s8 = x.to(DEV), w.weight.to(DEV), w.scale.to(DEV)
    assert T.rescalable_scales(s8)
    want = dense_linear(x, w.dequantize().to(DEV), groups, num_splits=splits)
    out = torch.full((m, groups * n), float("nan"), dtype=torch.bfloat16, device=DEV)
    got = T.dense_fp8_linear(x, w8, s8, groups, num_splits=splits, tiles=tiles, tma=tma,
                             rescaled=rescaled, out=out)
    assert got.data_ptr() == out.data_ptr() and not torch.isnan(out).any()
    assert _same(got, want)
    assert _same(T.dense_fp8_linear(x[-1:], w8, s8, groups, num_splits=splits, tiles=tiles,
                                    tma=tma, rescaled=rescaled),
                 want[-1:])  # a row alone: the same bits


def test_rescalable_scales():
    """rescaled needs every scale byte in 1..254 and K neighbours at most 126 apart (the
    accumulator's steps and its last factor are then normal fp32 powers of two)."""
    e = torch.full((3, 5), 120, dtype=torch.uint8)
    assert T.rescalable_scales(e.view(torch.float8_e8m0fnu))
    for row, col, value, ok in ((1, 2, 246, True), (1, 2, 247, False), (0, 0, 0, False),
                                (2, 4, 255, False), (2, 0, 1, True)):
        bad = e.clone()
        bad[row, col] = value
        assert T.rescalable_scales(bad.view(torch.float8_e8m0fnu)) == ok, (row, col, value)
    apart = e.clone()
    apart[0, 1:] = torch.tensor([247, 121, 247, 121], dtype=torch.uint8)
    assert not T.rescalable_scales(apart.view(torch.float8_e8m0fnu))
    apart[0, 1:] = 120
    apart[1] = 240  # rows apart (not K neighbours): fine
    assert T.rescalable_scales(apart.view(torch.float8_e8m0fnu))


def test_fp8_codes_one_program_sums_the_ranges(monkeypatch):
    """With the tiles filling the SMs (one here), each tile's program sums its K ranges in
    turn: the split programs' bits still."""
    x, w = _fp8_operands(9, 40, 320, 2, seed=6)
    x, w8, s8 = x.to(DEV), w.weight.to(DEV), w.scale.to(DEV)
    want = T.dense_fp8_linear(x, w8, s8, 2, num_splits=3)  # split: tiles < SMs
    monkeypatch.setattr(T, "sm_count", lambda device: 1)
    assert _same(T.dense_fp8_linear(x, w8, s8, 2, num_splits=3), want)
    assert _same(want, dense_linear(x, w.dequantize().to(DEV), 2, num_splits=3))


def test_fp8_codes_bad_inputs():
    x, w = _fp8_operands(4, 32, 200, 1, seed=7)
    x, w8, s8 = x.to(DEV), w.weight.to(DEV), w.scale.to(DEV)
    assert T.dense_fp8_linear(x.view(2, 2, 200), w8, s8).shape == (2, 2, 32)
    assert T.dense_fp8_linear(x[:0], w8, s8).shape == (0, 32)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        T.dense_fp8_linear(x, w.dequantize().to(DEV), s8)
    with pytest.raises(ValueError, match=r"scale must be float8_e8m0fnu \[1, 7\]"):
        T.dense_fp8_linear(x, w8, s8[:, :6])
    with pytest.raises(ValueError, match="groups"):
        T.dense_fp8_linear(x, w8, s8, 3)
    with pytest.raises(ValueError, match="does not match"):
        T.dense_fp8_linear(x[:, :64], w8, s8)
    with pytest.raises(ValueError, match="num_splits"):
        T.dense_fp8_linear(x, w8, s8, num_splits=5)  # K = 200: four steps
    with pytest.raises(ValueError, match="TMA"):
        T.dense_fp8_linear(x, w8, s8, tma=True)  # 200-byte rows
    with pytest.raises(ValueError, match="out must be"):
        T.dense_fp8_linear(x, w8, s8, out=torch.empty(4, 31, dtype=torch.bfloat16, device=DEV))
    q = torch.empty(4, 32, dtype=torch.float16, device=DEV)
    qs = torch.empty(4, 1, device=DEV)
    for bad, match in (((q.float(), qs), "quant_out's q"), ((q, qs[:3]), "quant_out's s"),
                       ((q,), "pair")):
        with pytest.raises(ValueError, match=match):
            T.dense_fp8_linear(x, w8, s8, quant_out=bad)
    with pytest.raises(ValueError, match="multiple of 32"):  # 16 columns a group
        T.dense_fp8_linear(x.repeat(1, 2), w8, s8, 2, quant_out=(q, qs))
    empty_k = torch.empty(32, 0, dtype=torch.float8_e4m3fn, device=DEV)
    empty_s = torch.empty(1, 0, dtype=torch.float8_e8m0fnu, device=DEV)
    q.fill_(float("nan"))
    qs.fill_(float("nan"))
    assert not T.dense_fp8_linear(x[:, :0], empty_k, empty_s, quant_out=(q, qs)).any()
    want_q, want_s = T.act_quant(torch.zeros(4, 32, dtype=torch.bfloat16, device=DEV), f16=True)
    assert torch.equal(q, want_q) and torch.equal(qs, want_s)  # K = 0: zeros, quantised


def test_rms_norm_vs_reference():
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(9, 320, generator=g) * torch.logspace(-3, 3, 9)[:, None]).bfloat16()
    w = torch.randn(320, generator=g).bfloat16()
    ref = ref_rms_norm(x, w, 1e-6)
    got = rms_norm(x.to(DEV), w.to(DEV), 1e-6).cpu()
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    # the same products; only the sum of squares' order and 1/sqrt vs rsqrt may differ (an
    # fp32 ulp or so before the bf16 rounding)
    assert ((got.float() - ref.float()).abs() <= 2 ** -8 * ref.float().abs()).all()
    assert (got != ref).float().mean() <= 0.05
    for i in (0, 8):
        assert torch.equal(rms_norm(x[i:i + 1].to(DEV), w.to(DEV), 1e-6).cpu(), got[i:i + 1])
    assert torch.equal(rms_norm(x.view(3, 3, 320).to(DEV), w.to(DEV), 1e-6).cpu().view(9, 320),
                       got)
    with pytest.raises(ValueError):
        rms_norm(x.float().to(DEV), w.to(DEV), 1e-6)
    with pytest.raises(ValueError):
        rms_norm(x.to(DEV), w[:10].to(DEV), 1e-6)


@pytest.mark.parametrize("m", [1, 16, 40])
def test_codes_by_their_bits_give_the_conversion_units_bits(m, monkeypatch):
    """A weight holding every e4m3 code but the NaNs (zeros of both signs, subnormals, +-448)
    under block scales 2^-27 .. 2^12: dense_fp8_linear's rescaled tiles (16 token rows, and 64
    where DENSE_FP8_TMA_MAX_M lets them read through TMA) reading the codes by their bits
    (DENSE_CODE_BITS; on a GPU E4M3_BF16_BITS_ASM, under the interpreter its exact path) give
    dense_linear's bits on the dequantised weight, as the conversion units do; a weight with a
    NaN code never takes the bits (its column NaN, the others unchanged)."""
    monkeypatch.setattr(T, "DENSE_FP8_TMA_MAX_M", 64)
    from dsv41attn.checkpoint import Fp8Weight
    n, k, groups = 64, 256, 2
    g = torch.Generator().manual_seed(40 + m)
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]
    weight = codes[torch.randint(0, codes.numel(), (groups * n, k), generator=g)]
    weight[0, :codes.numel()] = codes  # each code at least once in one row
    scale = torch.randint(100, 140, (groups * n // 32, k // 32), generator=g).to(torch.uint8)
    w = Fp8Weight(weight.view(torch.float8_e4m3fn), scale.view(torch.float8_e8m0fnu))
    x = torch.randn(m, groups * k, generator=g).bfloat16().to(DEV)
    x[-1, :7] = 0

    def run(w8, bits):
        monkeypatch.setattr(T, "DENSE_CODE_BITS", bits)
        assert T._dense_code_bits(True, w8) == (bits and DEV == "cuda" and T.nan_free_codes(w8))
        assert not T._dense_code_bits(False, w8)  # the scaled tiles never take them
        s8 = w.scale.to(DEV)
        assert T.rescalable_scales(s8)
        out = torch.full((m, groups * n), float("nan"), dtype=torch.bfloat16, device=DEV)
        seen = []  # the kernel's form: its rescaled tiles, as the call asked
        monkeypatch.setattr(T, "_dense_code_bits", lambda r, w_: seen.append(r) or real(r, w_))
        got = T.dense_fp8_linear(x, w8, s8, groups, num_splits=2, rescaled=True, out=out)
        monkeypatch.setattr(T, "_dense_code_bits", real)
        assert got.data_ptr() == out.data_ptr() and seen == [True]
        return got

    real = T._dense_code_bits

    w8 = w.weight.to(DEV)
    want = dense_linear(x, w.dequantize().to(DEV), groups, num_splits=2)
    assert not torch.isnan(want).any()
    for bits in (False, True):
        assert _same(run(w8, bits), want), bits
    bad = w8.clone()
    bad.view(torch.uint8)[7, 100] = 0xFF
    bad_w = Fp8Weight(bad.cpu(), w.scale)
    want = dense_linear(x, bad_w.dequantize().to(DEV), groups, num_splits=2)
    assert want[:, 7].isnan().all() and not want[:, 8].isnan().any()
    for bits in (False, True):  # NaN where dense_linear has NaN (its payload aside)
        got = run(bad, bits)
        assert torch.equal(got.isnan(), want.isnan()), bits
        assert _same(got.nan_to_num(0.0), want.nan_to_num(0.0)), bits


def _compile_wo_a_codes(bits: bool, triton_dir: str | None) -> dict:
    """Compile _dense_fp8_kernel as V4.1-Flash's wo_a runs it at one decode row (8 groups of
    [1024, 4096] e4m3 codes through [64, 32] TMA boxes, 4 K ranges as programs, rescaled)
    for sm_90a: (registers, stack, local ld/st, main loop) and its SASS's opcode counts."""
    return sm90_compile.compile_probe(rf"""
import re, collections
import dsv41attn.ops.linear.triton as T
d = s._argument({{"descriptor": "uint8", "shape": [8192, 4096], "strides": [4096, 1],
                 "block": [64, 32], "padding": "zero"}})
k = T._dense_fp8_kernel.warmup(M(torch.bfloat16), M(torch.uint8), M(torch.uint8), d,
    M(torch.bfloat16), M(torch.float32), M(torch.int32), 1, 1024, 4096, 32768, 8192, 128, 64,
    4, BLOCK_M=16, BLOCK_N=64, SPLITS=4, ALL_RANGES=False, TMA=True, RESCALED=True,
    INTERPRET=False, CODE_BITS={bits}, num_warps=4, num_stages=3, grid=(1,))
sass = s._sass(k.asm["cubin"])
ops = collections.Counter(re.findall(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", sass))
print(json.dumps({{"res": s._resources(k.asm["cubin"], True), "ops": ops}}))
""", triton_dir)


@pytest.mark.parametrize("triton_dir", sm90_compile.TRITONS,
                         ids=lambda d: "this" if d is None else os.path.basename(d))
def test_codes_by_their_bits_compile_for_sm90(triton_dir):
    """wo_a's decode tiles with CODE_BITS lower for an H100/H200 without spills and without
    the conversion units in their K steps (no e4m3 unpack, no f16 -> bf16 conversion, no bf16
    packs but the output's: bf16 FMAs instead), in no more instructions a K step than the
    conversions' form. (Without a GPU the suite's own launches never take CODE_BITS, so this
    is what compiles that branch.)"""
    off, on = (_compile_wo_a_codes(b, triton_dir) for b in (False, True))
    if off["res"] is None:
        pytest.skip("this Triton's wheel has no cuobjdump")
    regs, stack, local, loop = on["res"]
    assert stack == 0 and local == 0 and regs <= 255, on["res"]
    unpack, pack = "F2FP.F16.E4M3.UNPACK_B", "F2FP.BF16.F32.PACK_AB"
    assert off["ops"].get(unpack, 0) > 0  # what the bits replace
    assert not on["ops"].get(unpack) and not [op for op in on["ops"] if op.startswith("F2F.")]
    assert on["ops"].get(pack, 0) <= off["ops"][pack] - off["ops"][unpack], (on["ops"], off["ops"])
    assert on["ops"].get("HMUL2.BF16_V2", 0) + on["ops"].get("HFMA2.BF16_V2", 0) > 0
    assert 0 < loop <= off["res"][3], (on["res"], off["res"])
