"""Triton fp8 linear against the reference (SPEC §2.1-2.2); runs under TRITON_INTERPRET=1 on CPU."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest
import torch

pytest.importorskip("triton")

import dsv41attn.ops.linear.triton as T
from dsv41attn.checkpoint import quantize_fp8
from dsv41attn.ops.common.quant import act_quant as ref_act_quant
from dsv41attn.ops.linear.reference import fp8_gemm as ref_gemm
from dsv41attn.ops.linear.reference import fp8_linear as ref_linear
from dsv41attn.ops.linear.triton import _interpreting, act_quant, fp8_gemm, fp8_linear

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _e4m3_grid() -> torch.Tensor:
    """Every finite non-negative e4m3 value, ascending (fp32)."""
    v = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return v.sort().values


def _check_quant(x: torch.Tensor) -> None:
    q, s = act_quant(x.to(DEV))
    rq, rs = ref_act_quant(x.cpu())
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert torch.equal(s.cpu(), rs)  # exact, powers of two
    assert torch.equal(q.cpu().float(), rq)  # exact e4m3 values (+0 == -0)
    # bytes too: the reference's e4m3 is torch's saturating RNE cast of the clamped quotient
    ref_bytes = rq.to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(q.cpu().view(torch.uint8), ref_bytes)


@pytest.mark.parametrize("seed", [0, 1])
def test_act_quant_random(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(7, 32 * 37, generator=g) * torch.logspace(-6, 6, 7)[:, None]
    _check_quant(x.bfloat16())


def test_act_quant_every_bf16():
    bits = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16)
    x = x[torch.isfinite(x)]
    g = torch.Generator().manual_seed(3)
    x = x[torch.randperm(x.numel(), generator=g)]  # every finite bf16 value, in mixed blocks
    _check_quant(x[: x.numel() // 1024 * 1024].view(-1, 1024))
    _check_quant(x.sort().values[: x.numel() // 1024 * 1024].view(-1, 1024))  # similar blocks


def test_act_quant_edges():
    g = torch.Generator().manual_seed(2)
    grid = _e4m3_grid()
    mids = (grid[1:] + grid[:-1]) / 2  # exact midpoints (ties), incl. subnormal ones
    rows = []
    for e in (-3, 0, 5):  # block amax = 448 * 2^e so the scale is exactly 2^e
        t = torch.cat([mids, grid, -mids, -grid])
        t = t[torch.randperm(t.numel(), generator=g)]
        t = t[: t.numel() // 32 * 32].view(-1, 32).clone()
        t[:, 0] = 448.0
        rows.append((t * 2.0 ** e).reshape(-1))
    ties = torch.cat(rows)
    ties = ties[: ties.numel() // 1024 * 1024].view(-1, 1024)
    assert torch.equal(ties.bfloat16().float(), ties)  # midpoints need <= 5 bits: bf16 exact
    _check_quant(ties.bfloat16())
    z = torch.zeros(6, 64)
    z[1] = 3e-5 * torch.randn(64, generator=g)  # amax < 1e-4: scale from the floor
    z[2] = 2.0 ** torch.randint(-20, 20, (64,), generator=g).float()  # exact powers of two
    z[3] = 1e30 * torch.randn(64, generator=g)  # huge
    z[4, :32] = 448.0 * 2.0 ** -10  # amax/448 a power of two: no round-up
    z[4, 32:] = -1e-38  # subnormal-ish bf16 inputs under the floor
    z[5] = torch.randn(64, generator=g) * 1e-3
    z[5, 7] = -0.0
    _check_quant(z.bfloat16())  # row 0: zeros


def _quantized(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    w = quantize_fp8(torch.randn(n, k, generator=g) / k ** 0.5)
    return w.weight, w.scale


@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("n", [37, 64, 96])
@pytest.mark.parametrize("k", [32, 96, 160])
def test_fp8_linear_vs_reference(m, n, k):
    w, ws = _quantized(n, k, seed=m * 1000 + n * 10 + k)
    g = torch.Generator().manual_seed(k)
    x = (torch.randn(m, k, generator=g) * 3).bfloat16()
    ref = ref_linear(x, w, ws)
    y = fp8_linear(x.to(DEV), w.to(DEV), ws.to(DEV)).cpu()
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    err = (y.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)
    assert err <= 1e-2
    if _interpreting():  # fp64 block sums on the CPU: the reference's rounding points exactly
        assert torch.equal(y, ref)


@pytest.mark.parametrize("precise", [False, True])
def test_fp8_linear_batched_and_gemm_exact(precise, monkeypatch):
    monkeypatch.setattr(T, "PRECISE_DOT", precise)  # GPU only: fp16 operands to tl.dot
    w, ws = _quantized(70, 128, seed=3)
    x = torch.randn(2, 3, 128).bfloat16()
    y = fp8_linear(x.to(DEV), w.to(DEV), ws.to(DEV)).cpu()
    ref = ref_linear(x, w, ws)
    assert y.shape == (2, 3, 70)
    assert (y.float() - ref.float()).abs().max() <= 1e-2 * ref.float().abs().max()
    q, s = act_quant(x.reshape(-1, 128).to(DEV))
    out = torch.full((6, 70), float("nan"), device=DEV)  # poisoned: every element is written
    got = fp8_gemm(q, s, w.to(DEV), ws.to(DEV), out=out)
    assert got.data_ptr() == out.data_ptr() and not torch.isnan(out).any()
    ref32 = ref_gemm(q.cpu().float(), s.cpu(), w, ws)
    if _interpreting():
        assert torch.equal(out.cpu(), ref32)
    else:
        tol = (1e-6 if precise else 1e-4) * ref32.abs().max()  # fp8 wgmma sums less precisely
        assert (out.cpu() - ref32).abs().max() <= tol


def test_bad_inputs():
    w, ws = _quantized(64, 96, seed=4)
    w, ws = w.to(DEV), ws.to(DEV)
    x = torch.randn(3, 96).bfloat16().to(DEV)
    q, s = act_quant(x)
    with pytest.raises(TypeError):
        act_quant(x.float())
    with pytest.raises(ValueError):
        act_quant(torch.randn(3, 40).bfloat16().to(DEV))  # K not a multiple of 32
    with pytest.raises(ValueError):
        fp8_linear(torch.randn(3, 64).bfloat16().to(DEV), w, ws)  # K mismatch
    with pytest.raises(TypeError):
        fp8_gemm(q.float(), s, w, ws)
    with pytest.raises(TypeError):
        fp8_gemm(q, s, w, ws.float())
    with pytest.raises(ValueError):
        fp8_gemm(q, s[:, :2], w, ws)
    with pytest.raises(ValueError):
        fp8_gemm(q, s, w, ws[:1])
    with pytest.raises(ValueError):
        fp8_gemm(q, s, w, ws, out=torch.empty(3, 63, device=DEV))
