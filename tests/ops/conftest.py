"""Oracles shared by the op tests (tests/ops): the e4m3 value table with nearest rounding, exact
power-of-two ceilings, the fp8 activation quantiser (SPEC §2.2), block dequantisation and an
exact float64 comparison.

Every oracle is written differently from the implementation: the quantiser enumerates the
representable e4m3 values and picks the nearest one (ties to the even code, decided with exact
fractions), and power-of-two scales come from ``math.frexp`` on Python floats.
"""
from __future__ import annotations

import bisect
import math
from fractions import Fraction

import numpy as np
import torch

BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64
f32 = np.float32


def _e4m3_table() -> list[tuple[float, int]]:
    """(value, code) of every non-negative finite e4m3fn value: code = eeee mmm, bias 7,
    e=0 subnormal m*2^-9, code 0x7F is NaN (so the largest is 0x7E = 448)."""
    out = []
    for code in range(0x7F):
        e, m = code >> 3, code & 7
        out.append((m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7), code))
    return out


E4M3 = _e4m3_table()


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


def ceil_pow2(t: float) -> float:
    """2^ceil(log2 t) for a positive float, exactly (frexp: t = m * 2^e, 0.5 <= m < 1)."""
    m, e = math.frexp(t)
    return 2.0 ** (e - 1) if m == 0.5 else 2.0 ** e


INV448 = f32(1) / f32(448)  # fp32(1/448), correctly rounded fp32 division


def blocks_py(x: torch.Tensor, block: int) -> list[list[float]]:
    """x's values as Python floats, one list per quantisation block of the last dim."""
    return x.detach().to(F64).reshape(-1, block).tolist()


def fp8_oracle(x: torch.Tensor, block: int = 32):
    """SPEC §2.2: per 32 block a = max(|x|, 1e-4) (fp32), s = 2^ceil(log2(fp32(a * fp32(1/448)))),
    q = e4m3(clamp(x/s)). Returns (q, s) as float64 tensors shaped like act_quant's."""
    qs, ss = [], []
    for blk in blocks_py(x, block):
        a = max(max(abs(v) for v in blk), float(f32(1e-4)))
        t = float(f32(a) * INV448)
        s = ceil_pow2(t)
        qs.extend(e4m3_oracle(v / s) for v in blk)  # v/s exact: s is a power of two
        ss.append(s)
    return (torch.tensor(qs, dtype=F64).reshape(x.shape),
            torch.tensor(ss, dtype=F64).reshape(*x.shape[:-1], x.shape[-1] // block))


def dequant(q: torch.Tensor, s: torch.Tensor, block: int) -> torch.Tensor:
    """float64 q * s with one scale per ``block`` elements of the last dim."""
    return (q.to(F64).unflatten(-1, (-1, block)) * s.to(F64).unsqueeze(-1)).flatten(-2)


def assert_exact(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Same shape and the same values (compared in float64), naming the first mismatch."""
    a, e = actual.to(F64), expected.to(F64)
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    bad = (a != e).nonzero()
    assert bad.numel() == 0, (
        f"{what}: {bad.shape[0]} mismatches, first at {bad[0].tolist()}: "
        f"got {a[tuple(bad[0])].item()!r}, expected {e[tuple(bad[0])].item()!r}")
