"""RMSNorm (ops/common/norm.py, SPEC §2.4) and RoPE with its YaRN frequencies
(ops/common/rope.py, SPEC §2.5) against float64 formulas."""
from __future__ import annotations

import math

import pytest
import torch

from dsv41attn.config import preset, yarn_correction_range
from dsv41attn.ops.common.norm import rms_norm
from dsv41attn.ops.common.rope import apply_rope, rope_frequencies, rope_rotations

from .conftest import BF16, F32, F64, f32


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
    # the library's multipliers are the ones SPEC §1.1 quotes: 0.906, 0.8125, ..., 0.156
    f = rope_frequencies(FLASH, FLASH.layer(2)).to(F64)[[16, 17, 24]]
    base = torch.tensor([160000.0 ** (-2 * j / 64) for j in (16, 17, 24)], dtype=F64)
    assert torch.allclose(f / base, torch.tensor([0.90625, 0.8125, 0.15625], dtype=F64),
                          rtol=0, atol=1e-6)


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
