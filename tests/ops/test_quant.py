"""The quantisers (ops/common/quant.py, SPEC §2.2-2.3) against oracles that enumerate the
representable e4m3 / e2m1 values and pick the nearest one (ties to the even code, decided with
exact fractions), with power-of-two scales from ``math.frexp`` on Python floats."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from dsv41attn.ops.common.quant import (
    act_quant, fp4_quant, fp8_fake_quant, index_fp4_fake_quant,
    latent_fp4_fake_quant, pow2_ceil_scale, round_e2m1, round_e4m3,
)

from .conftest import (BF16, E4M3, F32, F64, assert_exact, blocks_py, ceil_pow2, dequant,
                       e4m3_oracle, f32, fp8_oracle, nearest)

E2M1 = [(0.0, 0), (0.5, 1), (1.0, 2), (1.5, 3), (2.0, 4), (3.0, 5), (4.0, 6), (6.0, 7)]
E4M3_VALUES = {v for v, _ in E4M3}
E2M1_VALUES = {v for v, _ in E2M1}
INV6 = f32(1) / f32(6)


def e2m1_oracle(v: float) -> float:
    return nearest(E2M1, v)


def fp4_ue8m0_oracle(x: torch.Tensor, block: int = 32):
    """SPEC §2.3 index variant: a = max(amax, 6*2^-126), s = 2^ceil(log2(fp32(a*fp32(1/6))))."""
    qs, ss = [], []
    for blk in blocks_py(x, block):
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
    for blk in blocks_py(x, block):
        a = max(max(abs(v) for v in blk), 6 * 2.0 ** -9)
        s = e4m3_oracle(float(f32(a) / f32(6)))
        qs.extend(e2m1_oracle(min(max(float(f32(v) / f32(s)), -6.0), 6.0)) for v in blk)
        ss.append(s)
    return (torch.tensor(qs, dtype=F64).reshape(x.shape),
            torch.tensor(ss, dtype=F64).reshape(*x.shape[:-1], x.shape[-1] // block))


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
    assert_exact(s, s_exp, "scales")
    assert_exact(q, q_exp, "codes")
    # fake quant = bf16(q * s), which is exact (so compare in float64 without tolerance)
    y = fake(x)
    assert y.dtype == BF16 and y.shape == x.shape
    assert_exact(y, dequant(q_exp, s_exp, block), "fake quant")


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
    assert_exact(fp8_fake_quant(x), dequant(q2, s2, 32))


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
    assert_exact(index_fp4_fake_quant(x), dequant(q2, s2, 32))


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
    assert_exact(latent_fp4_fake_quant(x), dequant(q2, s2, 16))


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



def test_out_buffer_names_what_it_got():
    """The ops' ``out`` check: a new tensor for None, the given one when it fits, else a
    ValueError naming the wanted and the given dtype, shape, device and layout."""
    from dsv41attn.ops.common.buffers import out_buffer
    cpu = torch.device("cpu")
    new = out_buffer(None, (2, 3), torch.bfloat16, cpu)
    assert new.shape == (2, 3) and new.dtype == torch.bfloat16
    assert out_buffer(new, (2, 3), torch.bfloat16, cpu) is new
    want = "out must be a contiguous torch.bfloat16 [2, 3] tensor on cpu, got "
    for bad, got in ((torch.empty(3, 2, dtype=torch.bfloat16), "torch.bfloat16 [3, 2] on cpu"),
                     (torch.empty(2, 3), "torch.float32 [2, 3] on cpu"),
                     (torch.empty(3, 2, dtype=torch.bfloat16).t(),
                      "torch.bfloat16 [2, 3] on cpu, not contiguous"),
                     ([[0.0] * 3] * 2, "list")):
        with pytest.raises(ValueError) as e:
            out_buffer(bad, (2, 3), torch.bfloat16, cpu)
        assert str(e.value) == want + got
