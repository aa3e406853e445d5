"""The fp8 GEMM and linear (ops/linear/reference.py, SPEC §2.2) against a pure-Python loop with
explicit fp32 rounding points."""
from __future__ import annotations

import math

import pytest
import torch

from dsv41attn.checkpoint import quantize_fp8
from dsv41attn.ops.common.quant import act_quant
from dsv41attn.ops.linear.reference import fp8_gemm, fp8_linear

from .conftest import BF16, F32, F64, assert_exact, dequant, f32, fp8_oracle


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
    assert_exact(y32, ref, "fp8_gemm fp32")
    y = fp8_linear(x, w.weight, w.scale)
    assert y.dtype == BF16
    assert_exact(y, ref.to(BF16), "fp8_linear bf16")
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
