"""The numeric building blocks of the layer (SPEC §0, §2, §4, §6) against independent oracles.

Every oracle here is written differently from the implementation: quantisers enumerate the
representable e4m3 / e2m1 values and pick the nearest one (ties to the even code, decided with
exact fractions), power-of-two scales come from ``math.frexp`` on Python floats, the fp8 GEMM is
a pure-Python loop with explicit fp32 rounding points, attention / RoPE / norm / index scores
are float64 formulas, window layouts are checked by mapping every entry back to the position it
stands for, and top-k / candidate selection are plain sorted() calls on (score, index) keys.
"""
from __future__ import annotations

import bisect
import math
import random
from fractions import Fraction

import numpy as np
import pytest
import torch

from dsv41attn.checkpoint import quantize_fp8
from dsv41attn.config import preset, yarn_correction_range
from dsv41attn.ops.common.norm import rms_norm
from dsv41attn.ops.common.quant import (
    act_quant, fp4_quant, fp8_fake_quant, index_fp4_fake_quant,
    latent_fp4_fake_quant, pow2_ceil_scale, round_e2m1, round_e4m3,
)
from dsv41attn.ops.common.rope import apply_rope, rope_frequencies, rope_rotations
from dsv41attn.ops.common.window import (
    ring_write, window_indices_chunk, window_indices_decode, window_indices_prefill,
)
from dsv41attn.ops.compressor.reference import compress
from dsv41attn.ops.indexer.reference import (
    index_scores, mask_invisible, select_candidate_blocks, select_topk, top_indices,
)
from dsv41attn.ops.linear.reference import fp8_gemm, fp8_linear
from dsv41attn.ops.sparse_attn.reference import sparse_attn

BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64
NINF = float("-inf")
f32 = np.float32


# =============================================================================================
# Oracles: representable values, nearest rounding, power-of-two ceilings
# =============================================================================================

def _e4m3_table() -> list[tuple[float, int]]:
    """(value, code) of every non-negative finite e4m3fn value: code = eeee mmm, bias 7,
    e=0 subnormal m*2^-9, code 0x7F is NaN (so the largest is 0x7E = 448)."""
    out = []
    for code in range(0x7F):
        e, m = code >> 3, code & 7
        out.append((m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7), code))
    return out


E4M3 = _e4m3_table()
E2M1 = [(0.0, 0), (0.5, 1), (1.0, 2), (1.5, 3), (2.0, 4), (3.0, 5), (4.0, 6), (6.0, 7)]
E4M3_VALUES = {v for v, _ in E4M3}
E2M1_VALUES = {v for v, _ in E2M1}
assert E4M3[-1][0] == 448.0 and len(E4M3_VALUES) == 127


def nearest(table: list[tuple[float, int]], v: float) -> float:
    """Nearest table value to v with saturation at the largest, ties to the even code, sign kept."""
    a = abs(v)
    vals = [t[0] for t in table]
    if a >= vals[-1]:
        return math.copysign(vals[-1], v)
    i = bisect.bisect_left(vals, a)
    if vals[i] == a:
        return math.copysign(a, v)
    (lo, clo), (hi, _) = table[i - 1], table[i]
    dlo, dhi = Fraction(a) - Fraction(lo), Fraction(hi) - Fraction(a)
    if dlo < dhi or (dlo == dhi and clo % 2 == 0):
        return math.copysign(lo, v)
    return math.copysign(hi, v)


def e4m3_oracle(v: float) -> float:
    return nearest(E4M3, v)


def e2m1_oracle(v: float) -> float:
    return nearest(E2M1, v)


def ceil_pow2(t: float) -> float:
    """2^ceil(log2 t) for a positive float, exactly (frexp: t = m * 2^e, 0.5 <= m < 1)."""
    m, e = math.frexp(t)
    return 2.0 ** (e - 1) if m == 0.5 else 2.0 ** e


INV448 = f32(1) / f32(448)  # fp32(1/448), correctly rounded fp32 division
INV6 = f32(1) / f32(6)


def _blocks_py(x: torch.Tensor, block: int) -> list[list[float]]:
    flat = x.detach().to(F64).reshape(-1, block).tolist()
    return flat


def fp8_oracle(x: torch.Tensor, block: int = 32):
    """SPEC §2.2: per 32 block a = max(|x|, 1e-4) (fp32), s = 2^ceil(log2(fp32(a * fp32(1/448)))),
    q = e4m3(clamp(x/s)). Returns (q, s) as float64 tensors shaped like act_quant's."""
    qs, ss = [], []
    for blk in _blocks_py(x, block):
        a = max(max(abs(v) for v in blk), float(f32(1e-4)))
        t = float(f32(a) * INV448)
        s = ceil_pow2(t)
        qs.extend(e4m3_oracle(v / s) for v in blk)  # v/s exact: s is a power of two
        ss.append(s)
    return (torch.tensor(qs, dtype=F64).reshape(x.shape),
            torch.tensor(ss, dtype=F64).reshape(*x.shape[:-1], x.shape[-1] // block))


def fp4_ue8m0_oracle(x: torch.Tensor, block: int = 32):
    """SPEC §2.3 index variant: a = max(amax, 6*2^-126), s = 2^ceil(log2(fp32(a*fp32(1/6))))."""
    qs, ss = [], []
    for blk in _blocks_py(x, block):
        a = max(max(abs(v) for v in blk), 6 * 2.0 ** -126)
        s = ceil_pow2(float(f32(a) * INV6))
        qs.extend(e2m1_oracle(min(max(v / s, -6.0), 6.0)) for v in blk)
        ss.append(s)
    return (torch.tensor(qs, dtype=F64).reshape(x.shape),
            torch.tensor(ss, dtype=F64).reshape(*x.shape[:-1], x.shape[-1] // block))


def fp4_e4m3_oracle(x: torch.Tensor, block: int = 16):
    """SPEC §2.3 latent variant: a = max(amax, 6*2^-9), s = e4m3_satfinite(fp32(a/6)),
    v = fp32(x / s) (a true fp32 division), q = e2m1(clamp(v, +-6))."""
    qs, ss = [], []
    for blk in _blocks_py(x, block):
        a = max(max(abs(v) for v in blk), 6 * 2.0 ** -9)
        s = e4m3_oracle(float(f32(a) / f32(6)))
        qs.extend(e2m1_oracle(min(max(float(f32(v) / f32(s)), -6.0), 6.0)) for v in blk)
        ss.append(s)
    return (torch.tensor(qs, dtype=F64).reshape(x.shape),
            torch.tensor(ss, dtype=F64).reshape(*x.shape[:-1], x.shape[-1] // block))


def dequant(q: torch.Tensor, s: torch.Tensor, block: int) -> torch.Tensor:
    return (q.to(F64).unflatten(-1, (-1, block)) * s.to(F64).unsqueeze(-1)).flatten(-2)


def bf16_grid(shape, seed: int, block: int, lo: float = -6, hi: float = 4) -> torch.Tensor:
    """Normal bf16 values whose magnitude varies per quant block over 10^lo..10^hi, with an
    outlier in some blocks, so scales span many binades."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=F64)
    nb = shape[-1] // block
    mag = 10.0 ** (torch.rand(*shape[:-1], nb, generator=g, dtype=F64) * (hi - lo) + lo)
    x = (x.unflatten(-1, (nb, block)) * mag.unsqueeze(-1))
    spike = torch.rand(*shape[:-1], nb, generator=g) < 0.3
    x[..., 0] = torch.where(spike, x[..., 0] * 37.0, x[..., 0])
    return x.flatten(-2).to(BF16)


QUANTISERS = {
    # name: (library (q, s) function, oracle, block, fake-quant function)
    "fp8_e4m3_ue8m0_b32": (lambda x: act_quant(x), fp8_oracle, 32, fp8_fake_quant),
    "fp4_e2m1_ue8m0_b32": (lambda x: fp4_quant(x, 32, "ue8m0"), fp4_ue8m0_oracle, 32,
                           index_fp4_fake_quant),
    "fp4_e2m1_e4m3_b16": (lambda x: fp4_quant(x, 16, "e4m3"), fp4_e4m3_oracle, 16,
                          latent_fp4_fake_quant),
}


def assert_same(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    a, e = actual.to(F64), expected.to(F64)
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    bad = (a != e).nonzero()
    assert bad.numel() == 0, (
        f"{what}: {bad.shape[0]} mismatches, first at {bad[0].tolist()}: "
        f"got {a[tuple(bad[0])].item()!r}, expected {e[tuple(bad[0])].item()!r}")


# =============================================================================================
# 1. Quantisers
# =============================================================================================

def test_oracle_tables_sanity():
    # The oracle's own tables: e4m3 max 448, min subnormal 2^-9, e2m1 codes as SPEC §2.3.
    assert sorted(E4M3_VALUES)[1] == 2.0 ** -9 and max(E4M3_VALUES) == 448.0
    assert [v for v, _ in E2M1] == [0, .5, 1, 1.5, 2, 3, 4, 6]
    assert float(INV448) == float(torch.tensor(1 / 448, dtype=F32))


E2M1_EDGES = [
    # SPEC §2.3 midpoints: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4, above 5->6
    (0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0),
    (5.0001, 6.0), (5.5, 6.0), (6.0, 6.0), (7.0, 6.0), (1e30, 6.0),
    (0.2499, 0.0), (0.2501, 0.5), (0.7499, 0.5), (1.2501, 1.5), (1.7499, 1.5), (2.5001, 3.0),
    (3.4999, 3.0), (4.9999, 4.0), (0.0, 0.0), (-0.0, 0.0), (0.5, 0.5), (3.0, 3.0),
]


@pytest.mark.parametrize("v,expected", E2M1_EDGES + [(-a, -b) for a, b in E2M1_EDGES if a > 0],
                         ids=lambda p: repr(p))
def test_round_e2m1_edges(v, expected):
    got = round_e2m1(torch.tensor([v], dtype=F32)).item()
    assert got == expected
    assert e2m1_oracle(float(f32(v))) == expected  # the oracle agrees with SPEC's table


def test_round_e2m1_dense_sweep_matches_oracle():
    # every fp32 value on a fine grid of [-7, 7] plus each midpoint +- 1 ulp
    grid = [i / 64 for i in range(-448, 449)]
    mids = [(a + b) / 2 for (a, _), (b, _) in zip(E2M1, E2M1[1:])]
    extra = [float(np.nextafter(f32(m), f32(d))) for m in mids for d in (0, 10)]
    vals = grid + mids + extra + [-m for m in mids + extra]
    got = round_e2m1(torch.tensor(vals, dtype=F32)).tolist()
    exp = [e2m1_oracle(float(f32(v))) for v in vals]
    assert got == exp


def _e4m3_edge_values() -> list[float]:
    vals = []
    pos = [v for v, _ in E4M3]
    for a, b in zip(pos, pos[1:]):
        m = (a + b) / 2  # exact in fp32: e4m3 values have 4 significant bits
        vals += [m, float(np.nextafter(f32(m), f32(0))), float(np.nextafter(f32(m), f32(1e9)))]
    vals += pos + [448.0, 450.0, 464.0, 480.0, 1e6, 3e38, float("inf"), 2.0 ** -10, 2.0 ** -11, 1e-30]
    return vals + [-v for v in vals]


def test_round_e4m3_every_midpoint_ties_to_even_and_saturates():
    vals = _e4m3_edge_values()
    got = round_e4m3(torch.tensor(vals, dtype=F32)).tolist()
    exp = [e4m3_oracle(float(f32(v))) for v in vals]
    bad = [(v, g, e) for v, g, e in zip(vals, got, exp) if g != e]
    assert not bad, bad[:5]


@pytest.mark.parametrize("v,expected", [
    (1.0625, 1.0),           # between 1 (code 0x38, even) and 1.125: tie -> 1
    (1.1875, 1.25),          # between 1.125 (0x39) and 1.25 (0x3A): tie -> 1.25
    (2.0 ** -10, 0.0),       # half the smallest subnormal: tie -> 0 (code 0)
    (3 * 2.0 ** -10, 2.0 ** -8),  # between 2^-9 (code 1) and 2^-8 (code 2) -> 2^-8
    (432.0, 448.0),          # between 416 (0x7D) and 448 (0x7E) -> 448
    (464.0, 448.0), (1e30, 448.0), (float("inf"), 448.0),  # saturate (satfinite)
    (-1.0625, -1.0), (-464.0, -448.0), (float("-inf"), -448.0),
], ids=lambda p: repr(p))
def test_round_e4m3_named_cases(v, expected):
    assert round_e4m3(torch.tensor([v], dtype=F32)).item() == expected


def test_pow2_ceil_scale_exact_powers_and_neighbours():
    ts = []
    for e in range(-126, 127):
        p = 2.0 ** e
        ts += [p, float(np.nextafter(f32(p), f32(np.inf))), float(np.nextafter(f32(p), f32(0)))]
    ts = [t for t in ts if 2.0 ** -126 <= t <= 2.0 ** 126]
    rng = random.Random(5)
    ts += [float(f32(rng.uniform(0.5, 2) * 2.0 ** rng.randint(-120, 120))) for _ in range(500)]
    got = pow2_ceil_scale(torch.tensor(ts, dtype=F32)).tolist()
    exp = [ceil_pow2(t) for t in ts]
    bad = [(t, g, e) for t, g, e in zip(ts, got, exp) if g != e]
    assert not bad, bad[:5]


@pytest.mark.parametrize("name", list(QUANTISERS))
@pytest.mark.parametrize("shape,seed", [((3, 96), 1), ((2, 5, 64), 2), ((1, 1, 7, 32), 3)],
                         ids=["3x96", "2x5x64", "1x1x7x32"])
def test_quantiser_random_matches_oracle(name, shape, seed):
    fn, oracle, block, fake = QUANTISERS[name]
    x = bf16_grid(shape, seed, block)
    q, s = fn(x)
    q_exp, s_exp = oracle(x)
    assert q.dtype == F32 and s.dtype == F32
    assert_same(s, s_exp, "scales")
    assert_same(q, q_exp, "codes")
    # fake quant = bf16(q * s), which is exact (so compare in float64 without tolerance)
    y = fake(x)
    assert y.dtype == BF16 and y.shape == x.shape
    assert_same(y, dequant(q_exp, s_exp, block), "fake quant")


def _one_block(vals: list[float], block: int, fill: float = 0.0) -> torch.Tensor:
    return torch.tensor(vals + [fill] * (block - len(vals)), dtype=F32).to(BF16).reshape(1, block)


# (values in a single block, expected scale, expected codes of those values)
FP8_CASES = {
    "zeros_floor_1e-4": ([0.0, -0.0], 2.0 ** -22, [0.0, 0.0]),   # a=1e-4 -> 2^ceil(log2(2.2e-7))
    "amax_448_exact_pow2": ([448.0, -1.0], 1.0, [448.0, -1.0]),   # t = 448*fp32(1/448) = 1 exactly
    "amax_448x2^-10": ([448 * 2.0 ** -10, 2.0 ** -10], 2.0 ** -10, [448.0, 1.0]),
    "amax_just_above_448": ([450.0, 3.0], 2.0, [224.0, 1.5]),    # next bf16: scale doubles, 225 -> 224
    "amax_1": ([1.0, 0.5], 2.0 ** -8, [256.0, 128.0]),
    "tiny_below_floor": ([1e-6, -3e-7], 2.0 ** -22, [4.0, -1.25]),  # 1e-6*2^22=4.19->4; 1.258->1.25
    "subnormal_codes": ([448.0, 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -10], 1.0,
                        [448.0, 2.0 ** -9, 0.0, 2.0 ** -8]),   # ties to even in the subnormals
}


@pytest.mark.parametrize("case", list(FP8_CASES))
def test_act_quant_edge_blocks(case):
    vals, s_exp, q_head = FP8_CASES[case]
    x = _one_block(vals, 32)
    q, s = act_quant(x)
    assert s.tolist() == [[s_exp]]
    assert q[0, :len(vals)].tolist() == q_head
    q2, s2 = fp8_oracle(x)  # the generic oracle agrees with the hand-derived numbers
    assert s2.tolist() == [[s_exp]] and q2[0, :len(vals)].tolist() == q_head
    assert_same(fp8_fake_quant(x), dequant(q2, s2, 32))


FP4_UE8M0_CASES = {
    "zeros_floor_6x2^-126": ([0.0], 2.0 ** -126, [0.0]),
    "amax_6_exact": ([6.0, -0.75, 1.25, 2.5], 1.0, [6.0, -1.0, 1.0, 2.0]),
    "amax_6x2^20_exact": ([6 * 2.0 ** 20, 2.0 ** 20 * 3.5], 2.0 ** 20, [6.0, 4.0]),
    "amax_just_above_6": ([6.03125, 5.0], 2.0, [3.0, 2.0]),  # scale doubles: 3.016->3, 2.5->2
    "amax_pow2_4": ([4.0, 1.0], 1.0, [4.0, 1.0]),  # t = 4*fp32(1/6) = 0.667 -> 1
    "tiny_1e-38": ([1e-38, -5e-39], 2.0 ** -126, [1.0, -0.5]),  # 0.85->1, 0.425->0.5
    "huge_1e38": ([1e38, -3e37], 2.0 ** 124, [4.0, -1.5]),  # 1e38/2^124 = 4.70 -> 4; 1.41 -> 1.5
}


@pytest.mark.parametrize("case", list(FP4_UE8M0_CASES))
def test_fp4_ue8m0_edge_blocks(case):
    vals, s_exp, q_head = FP4_UE8M0_CASES[case]
    x = _one_block(vals, 32)
    q, s = fp4_quant(x, 32, "ue8m0")
    q2, s2 = fp4_ue8m0_oracle(x)
    assert s2.tolist() == [[s_exp]] and q2[0, :len(vals)].tolist() == q_head
    assert s.tolist() == [[s_exp]]
    assert q[0, :len(vals)].tolist() == q_head
    assert_same(index_fp4_fake_quant(x), dequant(q2, s2, 32))


FP4_E4M3_CASES = {
    "zeros_floor_6x2^-9": ([0.0], 2.0 ** -9, [0.0]),
    "amax_6": ([6.0, 3.5], 1.0, [6.0, 4.0]),
    # a/6 = 1.0625: e4m3 tie 1 vs 1.125 -> 1 (even code), so s < a/6 and x/s = 6.375 saturates
    "scale_below_a_over_6_saturates": ([6.375, -6.375], 1.0, [6.0, -6.0]),
    # a/6 = 1.1875 -> e4m3 1.25 (even code): x/s = 5.7 -> 6
    "scale_rounds_up": ([7.125, 1.25], 1.25, [6.0, 1.0]),
    # huge: a/6 beyond 448 saturates the scale at 448, x/s beyond 6 saturates the code
    "scale_saturates_448": ([3e38, -1e5, 1000.0], 448.0, [6.0, -6.0, 2.0]),
    # tiny: a below 6*2^-9 keeps the floor 2^-9; 0.003*512 = 1.536 -> 1.5
    "below_floor": ([0.003, -0.001], 2.0 ** -9, [1.5, -0.5]),
    # scale in the e4m3 subnormals: a/6 = 0.0083 -> 4*2^-9
    "subnormal_scale": ([0.05, 0.01], 4 * 2.0 ** -9, [6.0, 1.5]),  # 6.4 -> 6; 1.28 -> 1.5
    # s = 1.875*2^-6 (not a power of two): x/s lands exactly on the e2m1 midpoints 1.25, 2.5, 5
    # under a true fp32 division (ties to even: 1, 2, 4); x * fp32(1/s) would land just above
    # them (1.5, 3, 6). SPEC §2.3 says division ([UNCERTAIN] in §11).
    "division_not_reciprocal": ([0.17578125, 0.03662109375, 0.0732421875, -0.146484375],
                                0.029296875, [6.0, 1.0, 2.0, -4.0]),
}


@pytest.mark.parametrize("case", list(FP4_E4M3_CASES))
def test_fp4_e4m3_edge_blocks(case):
    vals, s_exp, q_head = FP4_E4M3_CASES[case]
    x = _one_block(vals, 16)
    q2, s2 = fp4_e4m3_oracle(x)
    assert s2.tolist() == [[s_exp]] and q2[0, :len(vals)].tolist() == q_head
    q, s = fp4_quant(x, 16, "e4m3")
    assert s.tolist() == [[s_exp]]
    assert q[0, :len(vals)].tolist() == q_head
    assert_same(latent_fp4_fake_quant(x), dequant(q2, s2, 16))


@pytest.mark.parametrize("name", list(QUANTISERS))
def test_fake_quant_is_representable_and_idempotent(name):
    fn, _, block, fake = QUANTISERS[name]
    # magnitudes 1..1e3: for the e4m3-scale variant that keeps the scales normal (see the
    # subnormal-scale test below for the one place where idempotence does not hold).
    x = bf16_grid((4, 6 * 32), 11, block, lo=0, hi=3)
    y = fake(x)
    _, s = fn(x)
    ratio = (y.to(F64).unflatten(-1, (-1, block)) / s.to(F64).unsqueeze(-1)).flatten()
    allowed = E4M3_VALUES if name.startswith("fp8") else E2M1_VALUES
    assert set(ratio.abs().tolist()) <= allowed
    assert torch.equal(fake(y), y)
    # and the non-in-place form of y reproduces y exactly
    q, s = fn(y)
    assert torch.equal(dequant(q, s, block).to(BF16), y)


def test_latent_fp4_not_idempotent_with_subnormal_scale():
    """Spec consequence (not a library bug): a = 9*2^-9 gives a/6 = 1.5*2^-9, an e4m3 tie that
    rounds up to s = 2^-8 (even code 2), so the max element quantises to 4.5 -> 4, i.e. 2^-6.
    Re-quantising 2^-6 gives s = e4m3(2^-6/6) = 2^-9 and 8 -> clamp 6: 6*2^-9. A packer that
    re-derives the scale from cached bf16 values would therefore not be lossless (SPEC §0.4)."""
    x = _one_block([9 * 2.0 ** -9], 16)
    q, s = fp4_quant(x, 16, "e4m3")
    assert s.item() == 2.0 ** -8 and q[0, 0].item() == 4.0
    y = latent_fp4_fake_quant(x)
    assert y[0, 0].item() == 2.0 ** -6
    assert latent_fp4_fake_quant(y)[0, 0].item() == 6 * 2.0 ** -9


def test_quantisers_reject_partial_blocks():
    with pytest.raises(ValueError):
        act_quant(torch.zeros(2, 48, dtype=BF16))
    with pytest.raises(ValueError):
        fp4_quant(torch.zeros(2, 24, dtype=BF16), 16, "e4m3")


# =============================================================================================
# 2. RMSNorm
# =============================================================================================

def test_rms_norm_matches_float64():
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(6, 77, generator=g) * torch.tensor([1e-8, 1e-3, 1, 30, 1e4, 2.0])[:, None]).to(BF16)
    w = (0.7 + 0.6 * torch.rand(77, generator=g)).to(BF16)
    y = rms_norm(x, w, 1e-20)
    assert y.dtype == BF16
    xd, wd = x.to(F64), w.to(F64)
    ref = wd * xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + 1e-20)
    err = (y.to(F64) - ref).abs()
    assert (err <= 1e-2 * ref.abs() + 1e-30).all(), err.max()
    # output is bf16 of an fp32 product: at most half a bf16 ulp plus fp32 noise
    assert (err <= ref.abs() * (2.0 ** -8 + 1e-5)).all()


def test_rms_norm_zero_row_and_eps():
    x = torch.zeros(2, 33, dtype=BF16)
    x[1] = 1e-8  # with eps 1e-6 this would shrink to ~1e-5; with 1e-20 it normalises to 1
    w = torch.full((33,), 1.5, dtype=BF16)
    y = rms_norm(x, w, preset("v41-flash").norm_eps)
    assert not torch.isnan(y).any()
    assert (y[0] == 0).all()
    assert torch.allclose(y[1].float(), torch.full((33,), 1.5), rtol=1e-2)


# =============================================================================================
# 3. RoPE
# =============================================================================================

def yarn_multiplier(j: int) -> float:
    if j <= 15:
        return 1.0
    if j >= 25:
        return 1 / 16
    return 1 - 15 / 16 * (j - 15) / 10


FLASH = preset("v41-flash")


@pytest.mark.parametrize("layer", [2, 3, 8, 19, 20, 24, 39], ids=lambda L: f"layer{L}")
def test_v41_flash_yarn_frequencies(layer):
    spec = FLASH.layer(layer)
    assert spec.ratio > 0 and spec.yarn and spec.rope_base == 160000
    f = rope_frequencies(FLASH, spec)
    assert f.dtype == F32 and f.shape == (32,)
    ref = torch.tensor([160000.0 ** (-2 * j / 64) * yarn_multiplier(j) for j in range(32)], dtype=F64)
    rel = ((f.to(F64) - ref) / ref).abs()
    assert rel.max() < 1e-6, rel.max()


def test_v41_flash_yarn_range_is_15_25():
    assert yarn_correction_range(FLASH, 160000.0) == (15, 25)
    # the multipliers quoted by SPEC §1.1: 0.906, 0.8125, ..., 0.156
    assert [round(yarn_multiplier(j), 4) for j in (16, 17, 24)] == [0.9062, 0.8125, 0.1562]


@pytest.mark.parametrize("layer", [0, 1, 40, 41, 42], ids=lambda L: f"layer{L}")
def test_swa_layers_use_base_10000_without_yarn(layer):
    spec = FLASH.layer(layer)
    assert spec.ratio == 0 and not spec.yarn
    f = rope_frequencies(FLASH, spec)
    ref = torch.tensor([10000.0 ** (-2 * j / 64) for j in range(32)], dtype=F64)
    assert ((f.to(F64) - ref) / ref).abs().max() < 1e-6


def rope_oracle(x: torch.Tensor, freqs: torch.Tensor, positions: list[int], inverse=False):
    """float64 rotation of interleaved pairs (x[D-R+2j], x[D-R+2j+1]) by the fp32 angle
    fp32(p)*f_j; x [M, ..., D] with positions per leading index."""
    xd = x.to(F64).clone()
    R = freqs.numel()
    D = x.shape[-1]
    fj = [f32(v) for v in freqs.tolist()]
    for i, p in enumerate(positions):
        for j in range(R):
            ang = float(f32(p) * fj[j])
            c, s = math.cos(ang), math.sin(ang) * (-1 if inverse else 1)
            a = xd[i, ..., D - 2 * R + 2 * j].clone()
            b = xd[i, ..., D - 2 * R + 2 * j + 1].clone()
            xd[i, ..., D - 2 * R + 2 * j] = a * c - b * s
            xd[i, ..., D - 2 * R + 2 * j + 1] = a * s + b * c
    return xd


ROPE_CASES = {
    # name: (cfg, layer, head dim, heads, positions)
    "flash_attn_yarn": (FLASH, 2, 512, 3, [0, 1, 7, 1000, 65537, 1048575]),
    "flash_attn_swa": (FLASH, 0, 512, 2, [0, 5, 127, 4095]),
    "flash_index_yarn": (FLASH, 20, 128, 5, [3, 200, 99999]),
    "tiny_r2": (preset("tiny"), 1, 32, 3, [0, 1, 2, 13, 45]),
}


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_apply_rope_matches_float64_pairs(case):
    cfg, layer, dim, heads, positions = ROPE_CASES[case]
    spec = cfg.layer(layer)
    freqs = rope_frequencies(cfg, spec)
    R = freqs.numel()
    g = torch.Generator().manual_seed(len(positions) + dim)
    x = torch.randn(len(positions), heads, dim, generator=g).to(BF16)
    rot = rope_rotations(freqs, torch.tensor(positions))
    assert rot.shape == (len(positions), R) and rot.dtype == torch.complex64
    y = apply_rope(x, rot.unsqueeze(-2))
    assert y.dtype == BF16 and y.shape == x.shape
    # the nope dims are untouched, bit for bit
    assert torch.equal(y[..., :dim - 2 * R], x[..., :dim - 2 * R])
    ref = rope_oracle(x, freqs, positions)
    pair = x.to(F64)[..., dim - 2 * R:].unflatten(-1, (R, 2)).norm(dim=-1).repeat_interleave(2, -1)
    err = (y.to(F64)[..., dim - 2 * R:] - ref[..., dim - 2 * R:]).abs()
    tol = 2.0 ** -8 * ref[..., dim - 2 * R:].abs() + 1e-5 * pair
    assert (err <= tol).all(), (err - tol).max()
    # position 0 is the identity, exactly
    if positions[0] == 0:
        assert torch.equal(y[0], x[0])
    # inverse RoPE undoes RoPE up to the two bf16 roundings
    back = apply_rope(y, rot.unsqueeze(-2), inverse=True)
    assert torch.equal(back[..., :dim - 2 * R], x[..., :dim - 2 * R])
    assert ((back.to(F64) - x.to(F64)).abs()[..., dim - 2 * R:] <= 2.0 ** -7 * pair + 1e-6).all()
    inv_ref = rope_oracle(y, freqs, positions, inverse=True)
    assert ((back.to(F64) - inv_ref).abs()[..., dim - 2 * R:]
            <= 2.0 ** -8 * inv_ref.abs()[..., dim - 2 * R:] + 1e-5 * pair).all()


def test_rope_layout_is_interleaved_on_last_dims():
    """A unit vector on pair 1's real slot (dim D-64+2) must rotate into dim D-64+3 only."""
    spec = FLASH.layer(2)
    freqs = rope_frequencies(FLASH, spec)
    x = torch.zeros(1, 512, dtype=BF16)
    x[0, 448 + 2] = 1.0
    y = apply_rope(x, rope_rotations(freqs, torch.tensor([10])))
    nz = y[0].nonzero().flatten().tolist()
    ang = float(f32(10) * f32(freqs[1].item()))
    assert nz == [450, 451]
    assert abs(y[0, 450].item() - math.cos(ang)) < 2 ** -8
    assert abs(y[0, 451].item() - math.sin(ang)) < 2 ** -8


# =============================================================================================
# 4. fp8 GEMM / linear
# =============================================================================================

def gemm_oracle(x: torch.Tensor, w) -> torch.Tensor:
    """Pure Python: act-quant x with the oracle, then per 32-block exact sum (fsum of exact
    products) -> fp32 -> * s_x -> * s_w (fp32) -> fp32 accumulation in K order. Returns fp32."""
    xq, sx = fp8_oracle(x)
    xq, sx = xq.tolist(), sx.tolist()
    W = w.weight.float().tolist()
    SW = w.scale.float().tolist()
    M, K, N = len(xq), len(xq[0]), len(W)
    out = [[0.0] * N for _ in range(M)]
    for m in range(M):
        for n in range(N):
            acc = None
            for kb in range(K // 32):
                exact = math.fsum(xq[m][k] * W[n][k] for k in range(32 * kb, 32 * kb + 32))
                part = f32(f32(f32(exact) * f32(sx[m][kb])) * f32(SW[n // 32][kb]))
                acc = part if acc is None else f32(acc + part)
            out[m][n] = float(acc)
    return torch.tensor(out, dtype=F32)


@pytest.mark.parametrize("M,N,K,seed", [(3, 37, 96, 0), (2, 70, 64, 1), (66, 5, 64, 2)],
                         ids=["M3_N37_K96", "M2_N70_K64", "M66_N5_K64"])
def test_fp8_gemm_exact_rounding_points(M, N, K, seed):
    g = torch.Generator().manual_seed(seed)
    w = quantize_fp8(torch.randn(N, K, generator=g) * K ** -0.5 * torch.logspace(-2, 1, N)[:, None])
    x = (torch.randn(M, K, generator=g) * torch.logspace(-3, 2, K)).to(BF16)
    ref = gemm_oracle(x, w)
    xq, sx = act_quant(x)
    y32 = fp8_gemm(xq, sx, w.weight, w.scale)
    assert y32.dtype == F32 and y32.shape == (M, N)
    assert_same(y32, ref, "fp8_gemm fp32")
    y = fp8_linear(x, w.weight, w.scale)
    assert y.dtype == BF16
    assert_same(y, ref.to(BF16), "fp8_linear bf16")
    # and close to the float64 product of the dequantised operands
    xq64, sx64 = fp8_oracle(x)
    wd = dequant(w.weight.float().to(F64), w.scale.float().to(F64).repeat_interleave(32, 0)[:N], 32)
    exact = dequant(xq64, sx64, 32) @ wd.T
    assert (y.to(F64) - exact).abs().max() <= 1e-2 * exact.abs().max()
    # rows are independent of how many rows are in the call (no M-dependent accumulation)
    assert torch.equal(fp8_linear(x[-1:], w.weight, w.scale), y[-1:])


def test_fp8_linear_leading_dims_and_accuracy():
    g = torch.Generator().manual_seed(4)
    w_f = torch.randn(45, 160, generator=g) / 160 ** 0.5
    w = quantize_fp8(w_f)
    x = torch.randn(2, 3, 160, generator=g).to(BF16)
    y = fp8_linear(x, w.weight, w.scale)
    assert y.shape == (2, 3, 45) and y.dtype == BF16
    assert torch.equal(y.reshape(6, 45), fp8_linear(x.reshape(6, 160), w.weight, w.scale))
    exact = x.to(F64) @ w_f.to(F64).T  # unquantised: fp8 error only (~2^-4 per element, averaged)
    assert (y.to(F64) - exact).norm() / exact.norm() < 5e-2


# =============================================================================================
# 5. Sparse attention with sink
# =============================================================================================

def attn_oracle(q, kv, sink, idx, scale):
    """float64: o = sum_t e^{l_t} v_t / (sum_t e^{l_t} + e^{sink_h}); empty rows -> 0."""
    B, M, H, D = q.shape
    out = torch.zeros(B, M, H, D, dtype=F64)
    qd, kvd, sd = q.to(F64), kv.to(F64), sink.to(F64)
    for b in range(B):
        for i in range(M):
            ids = [t for t in idx[b, i].tolist() if t != -1]
            if not ids:
                continue
            rows = kvd[b, ids]  # [T, D]
            logits = scale * qd[b, i] @ rows.T  # [H, T]
            mx = torch.maximum(logits.max(-1).values, sd)
            e = torch.exp(logits - mx[:, None])
            out[b, i] = (e @ rows) / (e.sum(-1) + torch.exp(sd - mx))[:, None]
    return out


def rel_err(o: torch.Tensor, ref: torch.Tensor) -> float:
    """max |o - ref| over max |ref| per (b, i, h) vector; rows whose oracle is 0 must be 0."""
    num = (o.to(F64) - ref).abs().amax(-1)
    den = ref.abs().amax(-1)
    assert ((den > 0) | (num == 0)).all()
    return (num / den.clamp_min(1e-300)).max().item()


def make_attn(B, M, H, D, N, width, seed, sink_scale=1.0, q_scale=3.0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, M, H, D, generator=g) * q_scale).to(BF16)
    kv = torch.randn(B, N, D, generator=g).to(BF16)
    sink = torch.randn(H, generator=g) * sink_scale
    idx = torch.stack([torch.stack([torch.randperm(N, generator=g)[:width] for _ in range(M)])
                       for _ in range(B)]).to(torch.int32)
    return q, kv, sink, idx


ATTN_SHAPES = {
    "H5_D32_w20": (2, 3, 5, 32, 40, 20),
    "H7_D64_w150_crosses_two_blocks": (1, 2, 7, 64, 200, 150),
    "H3_D512_w64": (1, 2, 3, 512, 70, 64),
    "M70_more_than_64_queries": (1, 70, 3, 32, 30, 9),
}


@pytest.mark.parametrize("case", list(ATTN_SHAPES))
def test_sparse_attn_matches_softmax_with_sink(case):
    B, M, H, D, N, width = ATTN_SHAPES[case]
    q, kv, sink, idx = make_attn(B, M, H, D, N, width, seed=width)
    # punch -1 holes (not only at the end) into some rows
    g = torch.Generator().manual_seed(9)
    holes = torch.rand(idx.shape, generator=g) < 0.25
    idx = torch.where(holes, -1, idx)
    scale = D ** -0.5
    o = sparse_attn(q, kv, sink, idx, scale)
    assert o.dtype == BF16 and o.shape == q.shape
    assert rel_err(o, attn_oracle(q, kv, sink, idx, scale)) < 2e-2


def test_sparse_attn_empty_rows_give_exact_zero():
    q, kv, sink, idx = make_attn(1, 4, 5, 32, 16, 10, seed=1)
    idx[0, 1] = -1
    idx[0, 3] = -1
    sink = torch.tensor([-1e4, -50.0, 0.0, 50.0, 1e4])
    o = sparse_attn(q, kv, sink, idx, 32 ** -0.5)
    assert not torch.isnan(o).any()
    assert (o[0, 1] == 0).all() and (o[0, 3] == 0).all()
    assert rel_err(o[:, [0, 2]], attn_oracle(q, kv, sink, idx, 32 ** -0.5)[:, [0, 2]]) < 2e-2


@pytest.mark.parametrize("sink_value", [-1e4, -30.0, 0.0, 5.0, 30.0, 1e4],
                         ids=lambda s: f"sink{s:g}")
def test_sparse_attn_extreme_sinks(sink_value):
    q, kv, _, idx = make_attn(1, 3, 3, 64, 50, 40, seed=7)
    sink = torch.full((3,), sink_value)
    o = sparse_attn(q, kv, sink, idx, 64 ** -0.5)
    ref = attn_oracle(q, kv, sink, idx, 64 ** -0.5)
    assert not torch.isnan(o).any()
    if sink_value >= 1e3:  # e^{sink} swamps everything: the output is 0 in any precision
        assert (o == 0).all() and ref.abs().max() == 0
    else:
        assert rel_err(o, ref) < 2e-2


def test_sparse_attn_sink_is_unscaled_and_denominator_only():
    """One key with logit l and sink s: o = v * e^l / (e^l + e^s) — the sink is not multiplied by
    the softmax scale and adds no value. Choose l = 0 (q = 0): o = v / (1 + e^s)."""
    kv = torch.randn(1, 3, 32, generator=torch.Generator().manual_seed(6)).to(BF16)
    q = torch.zeros(1, 1, 2, 32, dtype=BF16)
    sink = torch.tensor([math.log(3.0), -100.0])
    idx = torch.tensor([[[2, -1, -1]]], dtype=torch.int32)
    o = sparse_attn(q, kv, sink, idx, 0.125)
    v = kv[0, 2].to(F64)
    assert ((o[0, 0, 0].to(F64) - v / 4).abs() <= 2.0 ** -8 * v.abs()).all()
    assert torch.equal(o[0, 0, 1], kv[0, 2])


def _bf16(v: float) -> float:
    return torch.tensor(v, dtype=F64).to(BF16).item()


def test_sparse_attn_rounding_points_exact():
    """Three keys, hand-simulated kernel (SPEC §4.5): fp32 logits, running max over logits only
    (not the sink), p = exp(l - M) in fp32, p rounded to bf16 for P.V but summed in fp32, the sink
    term added at the end, bf16 output. K = V, so the value of key t is its own row."""
    D = 32
    kv = torch.zeros(1, 3, D, dtype=BF16)
    kv[0, 1, 0], kv[0, 1, 1] = -0.1, 1.0   # l1 = bf16(-0.1) = -0.10009765625
    kv[0, 2, 0], kv[0, 2, 2] = -0.7, 1.0   # l2 = bf16(-0.69921875)
    q = torch.zeros(1, 1, 1, D, dtype=BF16)
    q[0, 0, 0, 0] = 1.0
    sink_v = 0.3
    o = sparse_attn(q, kv, torch.tensor([sink_v]), torch.tensor([[[0, 1, 2]]], dtype=torch.int32), 1.0)

    l = [0.0, kv[0, 1, 0].item(), kv[0, 2, 0].item()]

    def simulate(round_p: bool, sink_in_max: bool) -> list[float]:
        M = max(l + ([sink_v] if sink_in_max else []))
        p = [float(f32(math.exp(float(f32(t - M))))) for t in l]
        pv = [_bf16(x) if round_p else x for x in p]
        den = float(f32(f32(f32(p[0] + p[1]) + p[2]) + f32(math.exp(float(f32(sink_v - M))))))
        acc = [float(f32(pv[1] * 1.0)), float(f32(pv[2] * 1.0))]  # dims 1 and 2; dim 0 mixes
        return [_bf16(float(f32(a / den))) for a in acc]

    spec = simulate(True, False)
    assert spec != simulate(False, False)  # the case separates bf16 P from fp32 P...
    assert spec != simulate(True, True)  # ...and a running max that includes the sink
    assert [o[0, 0, 0, 1].item(), o[0, 0, 0, 2].item()] == spec


def kernel_sim(q_h: list[float], rows: list[list[float]], sink: float, scale: float,
               block: int) -> list[float]:
    """Scalar re-enactment of SPEC §4.5's kernel for one (query, head): blocks of ``block``
    entries in list order, fp32 logits, running max from -1e30 over logits, fp32 p summed in fp32,
    bf16(p) times V summed exactly then rounded to fp32 per block, fp32 rescaling, sink last."""
    run_max, run_sum, acc = f32(-1e30), f32(0), [f32(0)] * len(q_h)
    for j0 in range(0, len(rows), block):
        blk = rows[j0:j0 + block]
        logits = [f32(f32(math.fsum(a * b for a, b in zip(q_h, r))) * f32(scale)) for r in blk]
        new_max = max(run_max, max(logits))
        alpha = f32(math.exp(float(f32(run_max - new_max))))
        p = [f32(math.exp(float(f32(lg - new_max)))) for lg in logits]
        run_sum = f32(f32(run_sum * alpha) + f32(math.fsum(float(x) for x in p)))
        pb = [_bf16(float(x)) for x in p]
        for d in range(len(acc)):
            pv = f32(math.fsum(pb[t] * blk[t][d] for t in range(len(blk))))
            acc[d] = f32(f32(acc[d] * alpha) + pv)
        run_max = new_max
    run_sum = f32(run_sum + f32(math.exp(float(f32(f32(sink) - run_max)))))
    return [_bf16(float(f32(a / run_sum))) for a in acc]


def test_sparse_attn_64_blocks_exact():
    """150 entries (blocks 0-63, 64-127, 128-149) with the largest logits late in the list, so the
    running max moves between blocks and the bf16 rounding of p depends on the 64-blocking."""
    g = torch.Generator().manual_seed(8)
    D, N, H = 4, 160, 2
    q = (torch.randint(-8, 9, (1, 1, H, D), generator=g).float() / 4).to(BF16)  # exact dots
    kv = (torch.randint(-8, 9, (1, N, D), generator=g).float() / 8).to(BF16)
    q[..., 0] = 2.0
    kv[0, :, 0] = (torch.linspace(-1, 1, N) * 8).round() / 8  # logits grow along the list ...
    idx = torch.arange(N - 150, N, dtype=torch.int32).view(1, 1, 150)  # ... and are visited late
    sink = torch.tensor([0.7, -2.0])
    o = sparse_attn(q, kv, sink, idx, 0.5)
    rows = kv[0, N - 150:].to(F64).tolist()
    for h in range(H):
        qh = q[0, 0, h].to(F64).tolist()
        exp64 = kernel_sim(qh, rows, sink[h].item(), 0.5, 64)
        assert o[0, 0, h].tolist() == exp64, h
    alt = [kernel_sim(q[0, 0, h].to(F64).tolist(), rows, sink[h].item(), 0.5, 32) for h in range(H)]
    assert alt != [kernel_sim(q[0, 0, h].to(F64).tolist(), rows, sink[h].item(), 0.5, 64)
                   for h in range(H)]  # the case does separate 64-blocking from 32-blocking


def test_sparse_attn_permutation_and_duplicates():
    q, kv, sink, idx = make_attn(1, 4, 5, 64, 120, 100, seed=3)
    scale = 64 ** -0.5
    o = sparse_attn(q, kv, sink, idx, scale)
    g = torch.Generator().manual_seed(1)
    perm = torch.stack([torch.randperm(100, generator=g) for _ in range(4)])
    idx_p = torch.gather(idx[0], 1, perm).unsqueeze(0)
    o_p = sparse_attn(q, kv, sink, idx_p, scale)
    ref = attn_oracle(q, kv, sink, idx, scale)
    assert rel_err(o_p, ref) < 2e-2
    diff = (o_p.to(F64) - o.to(F64)).abs().amax(-1) / o.to(F64).abs().amax(-1)
    assert diff.max() < 2e-2
    # a duplicated index counts twice
    idx_d = idx.clone()
    idx_d[..., 90:] = idx_d[..., :10]
    o_d = sparse_attn(q, kv, sink, idx_d, scale)
    assert rel_err(o_d, attn_oracle(q, kv, sink, idx_d, scale)) < 2e-2


def test_sparse_attn_duplicate_counts_twice_exact_case():
    """All logits 0 (q = 0), sink -100: idx [a, b, b] gives (v_a + 2 v_b) / 3, not (v_a + v_b) / 2."""
    g = torch.Generator().manual_seed(2)
    kv = torch.randn(1, 4, 32, generator=g).to(BF16)
    q = torch.zeros(1, 1, 1, 32, dtype=BF16)
    idx = torch.tensor([[[1, 3, -1, 3]]], dtype=torch.int32)
    o = sparse_attn(q, kv, torch.tensor([-100.0]), idx, 0.1)[0, 0, 0].to(F64)
    ref = (kv[0, 1].to(F64) + 2 * kv[0, 3].to(F64)) / 3
    assert ((o - ref).abs() <= 2.0 ** -7 * ref.abs() + 1e-3).all()


# =============================================================================================
# 6. Window indices and the ring
# =============================================================================================

W8 = 8


@pytest.mark.parametrize("m", [1, 7, 8, 9, 13, 17], ids=lambda m: f"m{m}")
def test_window_indices_prefill(m):
    idx = window_indices_prefill(m, W8)
    assert idx.dtype == torch.int32 and idx.shape == (m, min(m, W8))
    for i, row in enumerate(idx.tolist()):
        expected = list(range(max(0, i - W8 + 1), i + 1))
        assert row == expected + [-1] * (len(row) - len(expected)), (i, row)


def ring_positions(start: int, size: int) -> list[int]:
    """Position held by each slot of a ring of ``size`` slots after positions 0..start-1 were
    written at slot t mod size (-1 = never written)."""
    out = []
    for s in range(size):
        cands = [t for t in range(start) if t % size == s]
        out.append(max(cands) if cands else -1)
    return out


DECODE_POS = [0, 1, 3, 6, 7, 8, 9, 15, 23, 31, 37, 1000]


@pytest.mark.parametrize("slots", [None, 11], ids=["ring_W", "ring_W_plus_3_history"])
def test_window_indices_decode_every_branch(slots):
    pos = torch.tensor(DECODE_POS)
    idx = window_indices_decode(pos, W8) if slots is None else window_indices_decode(pos, W8, slots)
    size = slots or W8
    assert idx.dtype == torch.int32 and idx.shape == (len(DECODE_POS), W8)
    for p, row in zip(DECODE_POS, idx.tolist()):
        held = ring_positions(p + 1, size)  # the ring after writing p
        valid = [s for s in row if s != -1]
        assert set(valid) == {t % size for t in range(max(0, p - W8 + 1), p + 1)}
        n_pad = W8 - len(valid)
        assert row[:n_pad] == [-1] * n_pad  # -1s first while the ring fills
        assert [held[s] for s in valid] == list(range(max(0, p - W8 + 1), p + 1))  # oldest first


@pytest.mark.parametrize("slots", [None, 11], ids=["ring_W", "ring_11"])
@pytest.mark.parametrize("start,m", [(1, 2), (3, 4), (5, 3), (7, 2), (8, 5), (11, 3), (1, 9),
                                     (4, 13), (20, 17), (13, 8), (2, 30)],
                         ids=lambda v: str(v))
def test_window_indices_chunk(start, m, slots):
    if slots is None:
        idx = window_indices_chunk(start, m, W8)
    else:
        idx = window_indices_chunk(start, m, W8, slots)
    size = slots or W8
    width = min(W8, start + m)
    assert idx.dtype == torch.int32 and idx.shape == (m, width)
    ring = ring_positions(start, size)  # the ring before the chunk is written
    for i, row in enumerate(idx.tolist()):
        P = start + i
        mapped = []
        for e in row:  # rows of cat([ring before the write, chunk])
            if e == -1:
                mapped.append(-1)
            elif e < size:
                assert ring[e] >= 0, f"row {i} points at ring slot {e} that was never written"
                mapped.append(ring[e])
            else:
                assert e - size < m
                mapped.append(start + e - size)
        expected = list(range(max(0, P - W8 + 1), P + 1))
        assert mapped == expected + [-1] * (width - len(expected)), (i, row, mapped)


@pytest.mark.parametrize("size", [W8, 11], ids=["ring8", "ring11"])
@pytest.mark.parametrize("start,m", [(0, 3), (0, 8), (0, 11), (5, 1), (5, 8), (5, 20),
                                     (13, 7), (7, 1)], ids=lambda v: str(v))
def test_ring_write(start, m, size):
    ring = torch.tensor(ring_positions(start, size), dtype=F32).reshape(1, size, 1).repeat(2, 1, 3)
    kv = torch.arange(start, start + m, dtype=F32).reshape(1, m, 1).repeat(2, 1, 3)
    before = ring.clone()
    out = ring_write(ring, kv, start)
    assert torch.equal(ring, before)  # a new ring
    expected = torch.tensor(ring_positions(start + m, size), dtype=F32)
    assert torch.equal(out[..., 0], expected.expand(2, size))
    assert torch.equal(out[..., 2], out[..., 0])


# =============================================================================================
# 7. Compressor
# =============================================================================================

def exact_weights(D, X, seed, ratio):
    """Integer-grid data: x in k/8 (|x|<=1), w in k/256 (|w|<=1/4): every product is a multiple
    of 2^-11 and every partial sum of X <= 200 terms stays below 2^6, so the fp32 GEMM is exact in
    any summation order — the test then isolates the grouping / carry logic, bit for bit."""
    g = torch.Generator().manual_seed(seed)
    wkv = torch.randint(-64, 65, (D, X), generator=g).float() / 256
    wgate = torch.randint(-64, 65, (D, X), generator=g).float() / 256 if ratio > 1 else None
    if ratio == 1:
        wkv = wkv.to(BF16)
    norm_w = (0.7 + 0.6 * torch.rand(D, generator=g)).to(BF16)
    return wkv, wgate, norm_w


def exact_x(B, T, X, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-8, 9, (B, T, X), generator=g).float() / 8).to(BF16)


def run_chunks(x, chunks, ratio, wkv, wgate, norm_w, D):
    """Feed x [B, T, X] in the given chunks as a caller does: before each call hand over the
    wkv/wgate outputs of the still-open group's tokens (positions pos - pos % r .. pos - 1),
    taken from the per-token outputs the earlier calls returned. Returns the concatenated
    latents and the concatenated per-token (kv, score) outputs (None at ratio 1)."""
    B = x.shape[0]
    kv_hist = torch.zeros(B, 0, D)
    sc_hist = torch.zeros(B, 0, D)
    lat, pos = [], 0
    for c in chunks:
        okv = osc = None
        if ratio > 1:
            okv, osc = kv_hist[:, pos - pos % ratio:pos], sc_hist[:, pos - pos % ratio:pos]
        latent, kv, sc = compress(x[:, pos:pos + c], pos, ratio, wkv, wgate, norm_w, 1e-20,
                                  okv, osc)
        n_done = (pos + c) // ratio - pos // ratio
        if n_done == 0:
            assert latent is None
        else:
            assert latent.shape == (B, n_done, D) and latent.dtype == BF16
            lat.append(latent)
        if ratio > 1:
            assert kv.shape == sc.shape == (B, c, D) and kv.dtype == sc.dtype == F32
            kv_hist, sc_hist = torch.cat([kv_hist, kv], 1), torch.cat([sc_hist, sc], 1)
        else:
            assert kv is None and sc is None
        pos += c
    return (torch.cat(lat, 1) if lat else None), (kv_hist, sc_hist) if ratio > 1 else None


def compress_oracle(x, ratio, wkv, wgate, norm_w):
    """fp32 numpy: exact K, G (float64 products, exact by construction), per-channel softmax over
    the r tokens of each group, pooled in token order, bf16, then the (separately tested) norm."""
    xd = x.to(F64).numpy()
    K = (xd @ wkv.to(F64).numpy().T).astype(f32)
    if ratio == 1:
        return rms_norm(torch.from_numpy(K).to(BF16), norm_w, 1e-20)
    G = (xd @ wgate.to(F64).numpy().T).astype(f32)
    B, T, D = K.shape
    n = T // ratio
    pooled = np.zeros((B, n, D), dtype=f32)
    for gi in range(n):
        kk, gg = K[:, gi * ratio:(gi + 1) * ratio], G[:, gi * ratio:(gi + 1) * ratio]
        mx = gg.max(axis=1, keepdims=True)
        e = np.exp(gg - mx).astype(f32)
        den = e[:, 0]
        for t in range(1, ratio):
            den = (den + e[:, t]).astype(f32)
        acc = np.zeros((B, D), dtype=f32)
        for t in range(ratio):
            acc = (acc + kk[:, t] * (e[:, t] / den).astype(f32)).astype(f32)
        pooled[:, gi] = acc
    return rms_norm(torch.from_numpy(pooled).to(BF16), norm_w, 1e-20), K, G


CHUNKINGS = {
    "all_at_once": lambda T, rng: [T],
    "token_by_token": lambda T, rng: [1] * T,
    "odd_start_then_big": lambda T, rng: [3, T - 3],
    "random": lambda T, rng: _random_chunks(T, rng),
}


def _random_chunks(T, rng):
    out = []
    while T:
        c = min(T, rng.randint(1, 6))
        out.append(c)
        T -= c
    return out


@pytest.mark.parametrize("ratio", [1, 2, 3], ids=lambda r: f"r{r}")
def test_compressor_chunking_invariance_and_oracle(ratio):
    B, T, X, D = 2, 23, 96, 48
    wkv, wgate, norm_w = exact_weights(D, X, seed=ratio, ratio=ratio)
    x = exact_x(B, T, X, seed=10 + ratio)
    ref_all = compress_oracle(x, ratio, wkv, wgate, norm_w)
    ref = ref_all if ratio == 1 else ref_all[0]
    rng = random.Random(ratio)
    results = {}
    for name, make in CHUNKINGS.items():
        chunks = make(T, rng)
        lat, hist = run_chunks(x, chunks, ratio, wkv, wgate, norm_w, D)
        results[name] = lat
        assert lat.shape == (B, T // ratio, D)
        if ratio > 1:  # the state the caller carries: exactly each token's wkv / wgate output
            K, G = ref_all[1], ref_all[2]
            assert torch.equal(hist[0], torch.from_numpy(K)), name
            assert torch.equal(hist[1], torch.from_numpy(G)), name
    for name, lat in results.items():
        assert torch.equal(lat, results["all_at_once"]), name
    assert_same(results["all_at_once"], ref, "latents vs oracle")


def _empty(D):
    return torch.zeros(1, 0, D), torch.zeros(1, 0, D)


def test_compressor_incomplete_group_returns_none():
    D, X = 32, 64
    wkv, wgate, norm_w = exact_weights(D, X, seed=0, ratio=3)
    x = exact_x(1, 3, X, seed=0)
    lat, kv, sc = compress(x[:, :2], 0, 3, wkv, wgate, norm_w, 1e-20, *_empty(D))
    assert lat is None and kv.shape == (1, 2, D)
    lat1, kv1, sc1 = compress(x[:, 2:3], 2, 3, wkv, wgate, norm_w, 1e-20, kv, sc)
    assert lat1.shape == (1, 1, D)
    ref = compress_oracle(x, 3, wkv, wgate, norm_w)[0]
    assert torch.equal(lat1, ref)
    # m < r at an odd start that does not complete the group
    _, kv, sc = compress(x[:, :1], 0, 3, wkv, wgate, norm_w, 1e-20, *_empty(D))
    lat, _, _ = compress(x[:, 1:2], 1, 3, wkv, wgate, norm_w, 1e-20, kv, sc)
    assert lat is None
    # ratio 1: one latent per token, even for a single token at any position
    wkv1, _, nw1 = exact_weights(D, X, seed=1, ratio=1)
    lat, s1, s2 = compress(x[:, :1], 5, 1, wkv1, None, nw1, 1e-20, None, None)
    assert lat.shape == (1, 1, D) and s1 is None and s2 is None
    assert torch.equal(lat, compress_oracle(x[:, :1], 1, wkv1, None, nw1))


def test_compressor_gate_softmax_is_per_channel():
    """Two channels with opposite gate preferences: channel 0 takes token 0's K, channel 1 token
    1's K (gate logits +-40 make the softmax one-hot in fp32)."""
    X, D = 32, 2
    wkv = torch.zeros(D, X)
    wkv[0, 0] = 1.0
    wkv[1, 0] = 1.0
    wgate = torch.zeros(D, X)
    wgate[0, 1] = 40.0
    wgate[1, 1] = -40.0
    x = torch.zeros(1, 2, X)
    x[0, 0, 0], x[0, 1, 0] = 3.0, -5.0  # K[t] = (3, 3) then (-5, -5)
    x[0, 0, 1], x[0, 1, 1] = 1.0, -1.0  # G: token 0 -> (40, -40), token 1 -> (-40, 40)
    lat, _, _ = compress(x.to(BF16), 0, 2, wkv, wgate, torch.ones(D, dtype=BF16), 1e-20,
                         *_empty(D))
    # pooled = (3, -5) -> rms = sqrt(17): (3/sqrt17, -5/sqrt17)
    exp = torch.tensor([3 / 17 ** 0.5, -5 / 17 ** 0.5])
    assert torch.allclose(lat[0, 0].float(), exp, rtol=1e-2)


def test_compressor_chunking_invariance_generic_weights_v41_dim():
    """At the V4.1 hidden size the fp32 GEMM of the CPU BLAS may block differently for a
    different row count (SPEC §6: bit equality with decode is not guaranteed): chunking moves
    the carried fp32 projections by a few ulps and a latent by at most one bf16 ulp."""
    B, T, X, D, ratio = 1, 17, 5120, 128, 2
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, T, X, generator=g).to(BF16)
    wkv = (torch.randn(D, X, generator=g) * X ** -0.5).to(BF16).float()
    wgate = (torch.randn(D, X, generator=g) * X ** -0.5).to(BF16).float()
    norm_w = torch.ones(D, dtype=BF16)
    lat_a, hist_a = run_chunks(x, [T], ratio, wkv, wgate, norm_w, D)
    lat_b, hist_b = run_chunks(x, [1] * T, ratio, wkv, wgate, norm_w, D)
    assert torch.allclose(hist_a[0], hist_b[0], rtol=1e-5, atol=1e-6)
    ulp = (lat_a.float().abs() * 2.0 ** -7).clamp_min(2.0 ** -126)
    assert ((lat_a.float() - lat_b.float()).abs() <= ulp).all()
    assert lat_a.shape == lat_b.shape == (B, T // ratio, D)


# =============================================================================================
# 8. Indexer
# =============================================================================================

@pytest.mark.parametrize("r", [1, 2], ids=lambda r: f"r{r}")
def test_mask_invisible_spec_rule(r):
    positions = list(range(0, 19))
    N = 19 // r + 1
    scores = torch.randn(2, len(positions), N, generator=torch.Generator().manual_seed(r)).to(BF16)
    visible = torch.tensor([[(P + 1) // r for P in positions]] * 2)
    out = mask_invisible(scores, visible)
    for i, P in enumerate(positions):
        L = (P + 1) // r  # SPEC §0.5: row e visible iff e < (P+1)//r
        assert torch.equal(out[:, i, :L], scores[:, i, :L])
        assert (out[:, i, L:] == NINF).all()


def topk_oracle(scores: torch.Tensor, visible: torch.Tensor, topk: int) -> torch.Tensor:
    B, M, N = scores.shape
    k = min(topk, N)
    out = []
    for b in range(B):
        rows = []
        for i in range(M):
            s = scores[b, i].tolist()
            best = sorted(range(N), key=lambda t: (-s[t], t))[:k]  # higher score, then lower t
            sel = sorted(best)
            L = int(visible[b, i])
            rows.append([t if t < L else -1 for t in sel])
        out.append(rows)
    return torch.tensor(out, dtype=torch.int32)


@pytest.mark.parametrize("topk,N", [(5, 13), (20, 13), (4, 4), (3, 29)],
                         ids=lambda v: str(v))
def test_select_topk_matches_oracle_with_ties(topk, N):
    g = torch.Generator().manual_seed(topk * 100 + N)
    B, M = 2, 9
    scores = torch.randint(0, 3, (B, M, N), generator=g).to(BF16)  # many exact ties
    visible = torch.randint(0, N + 1, (B, M), generator=g)
    visible[0, 0] = 0
    visible[0, 1] = N
    masked = mask_invisible(scores, visible)
    out = select_topk(masked, visible, topk)
    assert out.dtype == torch.int32 and out.shape == (B, M, min(topk, N))
    assert torch.equal(out, topk_oracle(masked, visible, topk))
    for row, L in zip(out.reshape(-1, out.shape[-1]).tolist(), visible.flatten().tolist()):
        valid = [t for t in row if t != -1]
        assert valid == sorted(valid) and all(t < L for t in valid)
        assert row == valid + [-1] * (len(row) - len(valid))  # -1s last
        assert len(valid) == min(L, len(row))


def test_select_topk_tie_prefers_lower_index():
    s = torch.tensor([[[1.0, 2.0, 2.0, 0.0, 2.0, 2.0]]], dtype=BF16)
    out = select_topk(s, torch.tensor([[6]]), 3)
    assert out.tolist() == [[[1, 2, 4]]]
    assert top_indices(s, 3).tolist() == [[[1, 2, 4]]]  # score order, ties to lower index


def candidates_oracle(scores, visible, topk_blocks, bs):
    B, M, N = scores.shape
    nblk = -(-N // bs)
    out = torch.zeros(B, M, N, dtype=torch.bool)
    for b in range(B):
        for i in range(M):
            s = scores[b, i].float().tolist() + [NINF] * (nblk * bs - N)
            bsc = [max(s[k * bs:(k + 1) * bs]) for k in range(nblk)]
            L = int(visible[b, i])
            if L > 0:
                bsc[(L - 1) // bs] = float("inf")
            picked = sorted(range(nblk), key=lambda k: (-bsc[k], k))[:min(topk_blocks, nblk)]
            for k in picked:
                if bsc[k] > NINF:
                    out[b, i, k * bs:min((k + 1) * bs, N)] = True
    return out


@pytest.mark.parametrize("N,bs,topk_blocks", [(29, 4, 3), (16, 8, 1), (40, 8, 2), (7, 3, 10)],
                         ids=lambda v: str(v))
def test_select_candidate_blocks_matches_oracle(N, bs, topk_blocks):
    g = torch.Generator().manual_seed(N * bs)
    B, M = 2, 11
    scores = torch.randint(-2, 3, (B, M, N), generator=g).to(BF16)
    visible = torch.randint(0, N + 1, (B, M), generator=g)
    visible[0, :4] = torch.tensor([0, 1, N, bs])
    masked = mask_invisible(scores, visible)
    c = select_candidate_blocks(masked, visible, topk_blocks, bs)
    assert c.dtype == torch.bool and c.shape == (B, M, N)
    assert torch.equal(c, candidates_oracle(masked, visible, topk_blocks, bs))


def test_candidate_blocks_named_cases():
    bs = 4
    # 3 full blocks + a partial block of 2 (N = 14); the newest visible block scores lowest
    s = torch.tensor([[5, 5, 5, 5, 9, 0, 0, 0, 7, 7, 7, 7, -3, -3]], dtype=F32)
    vis = torch.tensor([[14]])
    c = select_candidate_blocks(s.unsqueeze(0).to(BF16), vis, 2, bs)[0, 0].tolist()
    # pinned block 3 (rows 12-13) + best other block (block 1: max 9)
    assert c == [False] * 4 + [True] * 4 + [False] * 4 + [True] * 2
    # ties between blocks 0 and 2 (both max 5) -> the lower block id wins
    s2 = torch.tensor([[5, 0, 0, 0, 1, 1, 1, 1, 0, 5, 0, 0, 0, 0]], dtype=F32)
    c2 = select_candidate_blocks(s2.unsqueeze(0).to(BF16), vis, 2, bs)[0, 0].tolist()
    assert c2 == [True] * 4 + [False] * 8 + [True] * 2
    # visible = 0: nothing pinned, everything -inf -> nothing kept
    s3 = mask_invisible(torch.zeros(1, 1, 14, dtype=BF16), torch.tensor([[0]]))
    assert not select_candidate_blocks(s3, torch.tensor([[0]]), 4, bs).any()
    # visible = 5: blocks 2 and 3 are all -inf and must not be kept even with room for them
    s4 = mask_invisible(torch.ones(1, 1, 14, dtype=BF16), torch.tensor([[5]]))
    c4 = select_candidate_blocks(s4, torch.tensor([[5]]), 10, bs)[0, 0].tolist()
    assert c4 == [True] * 8 + [False] * 6


def index_scores_oracle(q, w, k):
    d = torch.einsum("bshd,btd->bsht", q.to(F64), k.to(F64))
    return (d.clamp_min(0) * w.to(F64).unsqueeze(-1)).sum(2)


@pytest.mark.parametrize("B,M,I,d,N", [(1, 3, 32, 128, 17), (2, 5, 4, 32, 9), (1, 2, 3, 64, 1)],
                         ids=["flash_heads", "tiny", "I3_N1"])
def test_index_scores_matches_float64(B, M, I, d, N):
    g = torch.Generator().manual_seed(I + N)
    q = index_fp4_fake_quant(torch.randn(B, M, I, d, generator=g).to(BF16))
    k = index_fp4_fake_quant(torch.randn(B, N, d, generator=g).to(BF16))
    w = (torch.randn(B, M, I, generator=g) / 64).to(BF16)  # signed head weights
    s = index_scores(q, w, k)
    assert s.dtype == BF16 and s.shape == (B, M, N)
    ref = index_scores_oracle(q, w, k)
    # each term carries ~2 bf16 roundings; scale the bound by the sum of |terms|
    mag = index_scores_oracle(q, w.abs(), k)
    assert ((s.to(F64) - ref).abs() <= 2e-2 * mag + 1e-6).all()


def test_index_scores_relu_per_head_before_weighting():
    d = 32
    k = torch.zeros(1, 1, d, dtype=BF16)
    k[0, 0, 0] = 1.0
    q = torch.zeros(1, 1, 3, d, dtype=BF16)
    q[0, 0, 0, 0] = -3.0  # dot -3: relu -> 0, even though its weight is negative
    q[0, 0, 1, 0] = 2.0   # dot 2, weight 1 -> 2
    q[0, 0, 2, 0] = -1.0  # dot -1, weight 1 -> 0 (summing before relu would give 2 - 1 - ...)
    w = torch.tensor([[[-1.0, 1.0, 1.0]]], dtype=BF16)
    assert index_scores(q, w, k).item() == 2.0
    w2 = torch.tensor([[[1.0, -0.5, 1.0]]], dtype=BF16)  # negative weight on a positive dot
    assert index_scores(q, w2, k).item() == -1.0
