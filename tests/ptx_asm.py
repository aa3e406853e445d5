"""Run the kernels' inline PTX on the CPU: a small interpreter for the instructions their
``inline_asm_elementwise`` strings use, vectorised over numpy arrays, so that CPU tests can
check GPU-only asm bit for bit against the reference ops (the interpreter's kernels take their
``INTERPRET`` branches instead).

Values are register bits: uint32 arrays for .b32, uint16 for .b16 and .f16 / .bf16 halves.
Operands are registers (``$n`` or names declared with ``.reg``) or integer immediates.
Supported: shl / shr / and / or / xor / not .b32, add.u32, prmt.b32 (default mode, with the
sign-replicate selector bit), mov.b32 (a copy, or packing and unpacking two halves), cvt.rn.f16x2.e4m3x2, cvt.f32.f16,
cvt.rn.bf16x2.f32, mul.f32, mul.rn.f16x2 and mul.rn.bf16x2 (round to nearest even: the 16-bit
products are exact in fp32 before the one rounding), fma.rn.bf16x2 with a +-0 addend (the
same, the sum of the product and a signed zero as IEEE adds them), max.NaN.bf16x2 (PTX's
a > b ? a : b, so max(-0, +0) is +0). Anything else raises.
"""
from __future__ import annotations

import re

import numpy as np
import torch


def _f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits, round to nearest even (no NaN in these tests)."""
    b = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    b = b + 0x7FFF + ((b >> 16) & 1)
    return (b >> 16).astype(np.uint16)


def _bf16_bits_to_f32(h: np.ndarray) -> np.ndarray:
    return (h.astype(np.uint32) << 16).view(np.float32)


def _e4m3_to_f32(b: np.ndarray) -> np.ndarray:
    """e4m3 (fn) bytes -> float32 values, by torch's float8_e4m3fn (as packing.py reads them;
    0x7F / 0xFF are NaN)."""
    codes = torch.from_numpy(np.ascontiguousarray(b, dtype=np.uint8))
    return codes.view(torch.float8_e4m3fn).float().numpy()


def _lo(x):
    return (x & 0xFFFF).astype(np.uint16)


def _hi(x):
    return (x >> 16).astype(np.uint16)


def _pack(lo, hi):
    return lo.astype(np.uint32) | (hi.astype(np.uint32) << 16)


def _prmt(a, b, c):
    pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = np.zeros(np.broadcast(a, b, c).shape, np.uint32)
    for i in range(4):
        sel = (c >> (4 * i)) & 15
        byte = np.zeros_like(out)
        for k in range(8):
            byte = np.where((sel & 7) == k, pool[k], byte)
        byte = np.where(sel & 8, np.where(byte & 0x80, 0xFF, 0), byte)
        out |= byte.astype(np.uint32) << (8 * i)
    return out


def run(asm: str, inputs: dict[int, np.ndarray], n_out: int) -> list[np.ndarray]:
    """Execute ``asm`` with its input operands given by ``inputs`` ({operand number: bits});
    returns the bits of $0 .. $(n_out - 1) as uint32 arrays (a 16-bit output in the low
    half)."""
    body = asm.strip()
    assert body.startswith("{") and body.endswith("}"), asm[:40]
    regs: dict[str, np.ndarray] = {f"${k}": np.asarray(v) for k, v in inputs.items()}

    def val(tok: str) -> np.ndarray:
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", tok):
            return np.uint32(int(tok, 0) & 0xFFFFFFFF)
        raise KeyError(f"{tok!r} read before it is written")

    for stmt in body[1:-1].split(";"):
        stmt = stmt.strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, _, rest = stmt.partition(" ")
        m = re.fullmatch(r"\{\s*([^,]+),\s*([^}]+)\}\s*,\s*(\S+)", rest.strip())
        if op == "mov.b32" and m:  # unpack: {lo, hi}, r
            x = val(m[3]).astype(np.uint32)
            regs[m[1].strip()], regs[m[2].strip()] = _lo(x), _hi(x)
            continue
        m = re.fullmatch(r"(\S+)\s*,\s*\{\s*([^,]+),\s*([^}]+)\}", rest.strip())
        if op == "mov.b32" and m:  # pack: r, {lo, hi}
            regs[m[1]] = _pack(val(m[2]), val(m[3]))
            continue
        args = [t.strip() for t in rest.split(",")]
        d, src = args[0], [val(t) for t in args[1:]]
        if op == "mov.b32":
            regs[d] = np.asarray(src[0], dtype=np.uint32)
        elif op == "mul.f32":  # round to nearest even, as numpy's float32 product
            a, b = (np.asarray(x, dtype=np.uint32).view(np.float32) for x in src)
            with np.errstate(over="ignore"):
                regs[d] = (a * b).astype(np.float32).view(np.uint32)
        elif op in ("shl.b32", "shr.b32", "and.b32", "or.b32", "xor.b32", "add.u32"):
            a, b = (np.asarray(s, dtype=np.uint64) for s in src)
            r = {"shl.b32": lambda: a << b, "shr.b32": lambda: a >> b,
                 "and.b32": lambda: a & b, "or.b32": lambda: a | b,
                 "xor.b32": lambda: a ^ b, "add.u32": lambda: a + b}[op]()
            regs[d] = (r & 0xFFFFFFFF).astype(np.uint32)
        elif op == "not.b32":
            regs[d] = ~np.asarray(src[0], dtype=np.uint32)
        elif op == "prmt.b32":
            regs[d] = _prmt(*(np.asarray(s, dtype=np.uint32) for s in src))
        elif op == "cvt.rn.f16x2.e4m3x2":
            x = src[0].astype(np.uint32)
            lo, hi = (_e4m3_to_f32(x & 0xFF), _e4m3_to_f32((x >> 8) & 0xFF))
            regs[d] = _pack(lo.astype(np.float16).view(np.uint16),
                            hi.astype(np.float16).view(np.uint16))
        elif op == "cvt.f32.f16":
            regs[d] = src[0].astype(np.uint16).view(np.float16).astype(np.float32).view(np.uint32)
        elif op == "cvt.rn.bf16x2.f32":  # d = {cvt(a) upper, cvt(b) lower}
            a, b = (s.astype(np.uint32).view(np.float32) for s in src)
            regs[d] = _pack(_f32_to_bf16_bits(b), _f32_to_bf16_bits(a))
        elif op == "max.NaN.bf16x2":  # per half: NaN (canonical) if either is, else a > b ? a : b
            a, b = (np.asarray(x, dtype=np.uint32) for x in src)
            halves = []
            for h in (_lo, _hi):
                x, y = h(a), h(b)
                fx, fy = _bf16_bits_to_f32(x), _bf16_bits_to_f32(y)
                m = np.where(fx > fy, x, y)
                halves.append(np.where(np.isnan(fx) | np.isnan(fy), 0x7FFF, m).astype(np.uint16))
            regs[d] = _pack(*halves)
        elif op in ("mul.rn.f16x2", "mul.rn.bf16x2"):
            a, b = (np.asarray(s, dtype=np.uint32) for s in src)
            if op == "mul.rn.f16x2":
                f = lambda h: h.view(np.float16).astype(np.float32)  # noqa: E731
                g = lambda x: x.astype(np.float16).view(np.uint16)  # noqa: E731
            else:
                f, g = _bf16_bits_to_f32, _f32_to_bf16_bits
            with np.errstate(over="ignore", invalid="ignore"):  # inf, and 0 x inf = NaN
                regs[d] = _pack(g(f(_lo(a)) * f(_lo(b))), g(f(_hi(a)) * f(_hi(b))))
        elif op == "fma.rn.bf16x2":  # only with a +-0 addend: then a * b + c is exact in fp32
            a, b, c = (np.asarray(x, dtype=np.uint32) for x in src)  # and rounds once
            if np.any((np.asarray(c) & 0x7FFF7FFF) != 0):
                raise NotImplementedError("ptx_asm: fma.rn.bf16x2 with an addend other than +-0")
            f = _bf16_bits_to_f32
            with np.errstate(over="ignore", invalid="ignore"):
                regs[d] = _pack(*(_f32_to_bf16_bits(f(h(a)) * f(h(b)) + f(h(c)))
                                  for h in (_lo, _hi)))
        else:
            raise NotImplementedError(f"ptx_asm: {op}")
    return [np.asarray(regs[f"${k}"]).astype(np.uint32) for k in range(n_out)]
