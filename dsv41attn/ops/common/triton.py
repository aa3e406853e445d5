"""What the Triton ops share: host queries and checks, and the jit helpers of the rounding points
and number formats that several kernels reproduce (docs/numerics.md §2, §4).

Host: ``cdiv`` and ``next_pow2`` (plain integer helpers for launch planning), ``interpreting``
(is Triton running the CPU interpreter), ``check_device``, ``sm_count``,
``cos_sin`` (complex64 rotations as the fp32 (cos, sin) pairs the kernels read), ``check_rot``,
``require`` (a ValueError unless a condition holds), ``rms_norm`` (the row RMSNorm op).
Jit helpers, inlined into their callers (they change no rounding): bf16 rounding
(``to_bf16``, ``round_bf16``), fp8 encode/decode (``ue8m0_exponent``, ``pow2_ceil_exponent``,
``e4m3_code``, ``e4m3_of_e2m1``, ``e4m3_to_fp32``, ``e8m0_to_fp32``), the RMSNorm scale
(``rms_scale``) and the RoPE pair rotation (``rope_rotate``). ``rope_heads`` (per-head RoPE)
is a whole op that both the window K=V path (its public home, ``window_kv.triton``) and the
output projection use.

Every jit helper that can round takes ``INTERPRET`` (constexpr, ``interpreting()``): under
the interpreter the bf16 cast truncates and tl.dot misreads bf16 (triton#11584), so bf16
values are rounded by bits and kept in fp32 there.
"""
from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from .quant import FP8_BLOCK, FP8_MAX

__all__ = ["DEFAULT_SM_COUNT", "FP8_BLOCK", "INV_FP8_MAX", "check_device", "check_rot", "any_nan",
           "cdiv", "cos_sin", "e4m3_code", "e4m3_of_e2m1", "e4m3_to_fp32", "e8m0_to_fp32",
           "interpreting", "is_hopper", "neg", "neg_zeros", "next_pow2", "pow2_ceil_exponent",
           "require", "rms_norm", "rms_scale", "rope_heads", "rope_rotate", "round_bf16",
           "sm_count", "to_bf16", "ue8m0_exponent"]

INV_FP8_MAX = torch.tensor(1.0 / FP8_MAX, dtype=torch.float32).item()  # fp32(1/448), as quant.py
DEFAULT_SM_COUNT = 132  # an H200's, for planning off the GPU (the CPU interpreter)


# ---- host ------------------------------------------------------------------------------------

def cdiv(x: int, y: int) -> int:
    """ceil(x / y) on the host: triton.cdiv's arithmetic as a plain function (triton.cdiv is a
    constexpr_function, a few microseconds of Python a call, and a layer step's host code
    plans its launches with dozens of such calls)."""
    return (x + (y - 1)) // y


def next_pow2(n: int) -> int:
    """The least power of two >= n (0 for 0), triton.next_power_of_2's arithmetic on the host
    (a plain function: see cdiv)."""
    n -= 1
    for shift in (1, 2, 4, 8, 16, 32):
        n |= n >> shift
    return n + 1


def interpreting() -> bool:
    """True when Triton runs its CPU interpreter (TRITON_INTERPRET=1 when triton was imported).

    triton.jit picks the interpreter when a kernel is defined, so this asks a jit function of
    this module rather than the environment (which may have changed since)."""
    return type(to_bf16).__name__ == "InterpretedFunction"


def check_device(*ts: torch.Tensor) -> None:
    """Raise ValueError unless the tensors share one device that the kernels can run on: CUDA,
    or the CPU under the interpreter."""
    if len({t.device for t in ts}) != 1:
        raise ValueError(f"tensors on several devices: {[str(t.device) for t in ts]}")
    if not ts[0].is_cuda and not interpreting():
        raise ValueError(f"compiled Triton needs CUDA tensors, got {ts[0].device} "
                         "(set TRITON_INTERPRET=1 before importing triton for the CPU)")


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device, DEFAULT_SM_COUNT elsewhere: the kernels'
    split-K planning sizes one wave of programs with it."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_SM_COUNT


@lru_cache(maxsize=None)
def is_hopper(device: torch.device) -> bool:
    """An sm_90 GPU: the Gluon kernels' wgmma exists there only."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def cos_sin(rot: torch.Tensor) -> torch.Tensor:
    """complex64 rotations [..., R/2] -> contiguous fp32 [..., R/2, 2] (cos, sin), the layout
    ``rope_rotate`` reads (a conjugate view is resolved first)."""
    return torch.view_as_real(rot.resolve_conj().contiguous())


def require(ok: bool, message: str) -> None:
    """Raise ValueError(message) unless ok: the argument checks of the host wrappers."""
    if not ok:
        raise ValueError(message)


def check_rot(rot: torch.Tensor, n: int, d: int) -> int:
    """Validate rot [n, R/2] complex64 with R <= d (ValueError naming what is wrong); returns
    R/2."""
    require(isinstance(rot, torch.Tensor) and rot.dtype == torch.complex64 and rot.dim() == 2,
          f"rot must be a 2-D complex64 [N, R/2] tensor, got "
          f"{getattr(rot, 'dtype', type(rot))} {tuple(getattr(rot, 'shape', ()))}")
    r2 = rot.shape[1]
    require(rot.shape[0] == n and 1 <= r2 and 2 * r2 <= d,
          f"rot shape {tuple(rot.shape)} does not match N = {n} rows with 1 <= R/2 <= D/2 = "
          f"{d // 2}")
    return r2


# ---- jit helpers: signed zeros ----------------------------------------------------------------

@triton.jit
def neg_zeros(shape: tl.constexpr, dtype: tl.constexpr):
    """A tensor of -0.0 (fp32, or fp64): the start of a sum that must give p for every p
    (-0 + p == p, also for p = -0). Built from its bits: Triton 3.6 compiles
    ``tl.full(shape, -0.0, ...)`` to +0 (its constant -0.0 is 0 - 0.0), so a sum of -0 terms
    came out +0 on the GPU where the reference gives -0."""
    if dtype == tl.float64:
        z = (tl.full(shape, 1, tl.int64) << 63).to(tl.float64, bitcast=True)
    else:
        z = (tl.full(shape, 1, tl.int32) << 31).to(tl.float32, bitcast=True)
    return z


@triton.jit
def neg(x):
    """-x with the sign of zero (-(+0) = -0, as torch's): x times -1, exact. Triton 3.6 compiles
    the unary ``-x`` of a float tensor to 0 - x, which gives +0 for +0."""
    return x * -1.0


# ---- jit helpers: bf16 -----------------------------------------------------------------------

@triton.jit
def to_bf16(x, INTERPRET: tl.constexpr):
    """fp32 -> bf16 with round-to-nearest-even (the hardware cast, as torch's .bfloat16()).

    Under the interpreter its cast truncates and its tl.dot reads bf16 bit patterns as integers
    (triton#11584), so there we round by bits and keep the (exact) value in fp32.
    """
    if INTERPRET:
        u = x.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000  # finite x only: all we round here
        y = u.to(tl.float32, bitcast=True)
    else:
        y = x.to(tl.bfloat16)
    return y


@triton.jit
def round_bf16(x, INTERPRET: tl.constexpr):
    """fp32 -> the nearest bf16 value (RNE), kept in fp32."""
    return to_bf16(x, INTERPRET).to(tl.float32)


# ---- jit helpers: fp8 formats ----------------------------------------------------------------

@triton.jit
def pow2_ceil_exponent(t):
    """Biased fp32 exponent e of 2^ceil(log2(t)) for a positive normal fp32 t, from the bits (as
    quant.pow2_ceil_scale): the ue8m0 byte of that power of two, which is (e << 23) as fp32."""
    u = t.to(tl.int32, bitcast=True)
    return ((u >> 23) & 0xFF) + ((u & 0x7FFFFF) != 0).to(tl.int32)  # ceil: +1 unless 2^k


@triton.jit
def ue8m0_exponent(amax, inv_max):
    """Biased exponent e of the act_quant block scale s = 2^ceil(log2(max(amax, 1e-4) *
    inv_max)), an int32 in [1, 254] (amax >= 0 finite): s = e << 23 and 1/s = (254 - e) << 23
    as fp32 bits."""
    return pow2_ceil_exponent(tl.maximum(amax, 1e-4) * inv_max)  # normal: >= 1e-4/448


@triton.jit
def e4m3_code(v):
    """fp32 v -> e4m3 byte as int32 (0..255): clamp to +-448, round to nearest even in software
    (subnormals step 2^-9), sign bit kept for -0 as torch's cast does. Finite v only. (The
    interpreter's fp8 cast is not RNE, hence the bits.)"""
    v = tl.minimum(tl.maximum(v, -448.0), 448.0)
    sign = (v.to(tl.int32, bitcast=True) >> 24) & 0x80
    a = tl.abs(v)
    # normal e4m3 (a >= 2^-6): round the fp32 mantissa to 3 bits, ties to even (carry is fine)
    u = a.to(tl.int32, bitcast=True)
    u = (u + 0x7FFFF + ((u >> 20) & 1)) >> 20  # (fp32 exponent << 3) | 3-bit mantissa
    code_n = u - (120 << 3)  # rebias the exponent 127 -> 7
    # subnormal (a < 2^-6): multiples of 2^-9, ties to even; 8 steps = 2^-6 = code 8
    w = a * 512.0  # exact, < 8
    i = w.to(tl.int32)  # truncation
    f = w - i.to(tl.float32)  # exact
    code_s = i + ((f > 0.5) | ((f == 0.5) & ((i & 1) == 1))).to(tl.int32)
    return tl.where(a >= 0.015625, code_n, code_s) | sign


INTERPRETER = tl.constexpr(interpreting())  # for jit bodies: the interpreter runs them


@triton.jit
def any_nan(x, axis: tl.constexpr, INF: tl.constexpr = False):
    """Whether x holds a NaN (INF: or an infinity) along ``axis``, tested element by element
    (the GPU's max drops a NaN, the interpreter's keeps it): a quantiser's block that must
    decode as the reference's does."""
    bad = x != x
    if INF:
        bad = bad | (tl.abs(x) == float("inf"))
    return tl.max(bad.to(tl.int32), axis) > 0


@triton.jit
def e4m3_to_fp32(codes):
    """e4m3 bytes (uint8) -> their fp32 values, exactly (the hardware conversion on the GPU),
    NaN codes (0x7F, 0xFF) to NaN: the interpreter's widening makes them 480, so there they
    are set apart (no instruction on the GPU)."""
    v = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    if INTERPRETER:
        v = tl.where((codes & 0x7F) == 0x7F, float("nan"), v)
    return v


# Two e4m3 codes ($1: a 16-bit pair) -> two bf16 ($0) on a GPU by their bits, where the
# hardware's path is an e4m3 -> f16 unpack a pair then an f16 -> bf16 conversion an element,
# both on the conversion units (16 results a clock an SM): each byte sign-extended (prmt), shifted
# left 4 and masked to s 0000 eeee mmm 0000, which as bf16 is the code's value times 2^-120
# (e4m3 subnormals become bf16 subnormals), then times 2^120 (0x7B80) by a bf16 FMA with -0
# (which keeps every product's sign of zero). Exact for every code but the NaNs (0x7F, 0xFF),
# which it reads as +-480: callers run it only on weights without them (linear.triton's
# nan_free_codes). For tl.inline_asm_elementwise / gl.inline_asm_elementwise, "=r,h", pack=2.
E4M3_BF16_BITS_ASM = (
    "{ .reg .b32 t, k, z; mov.b32 k, 0x7B807B80; mov.b32 z, 0x80008000;"
    " cvt.u32.u16 t, $1; prmt.b32 t, t, 0, 0x9180; shl.b32 t, t, 4;"
    " and.b32 t, t, 0x87F087F0; fma.rn.bf16x2 $0, t, k, z; }")


@triton.jit
def e4m3_of_e2m1(nib):
    """e2m1 nibbles (uint8 0..15, sign << 3 | e1 e0 m) -> the e4m3 bytes s|0 0 e1 e0|m 0 0,
    worth exactly the e2m1 value * 2^-6 (the packed fp4 caches decode through fp8 this way)."""
    return ((nib & 7) << 2) | ((nib & 8) << 4)


@triton.jit
def e8m0_to_fp32(e):
    """float8_e8m0fnu bytes as int32 -> fp32 2^(e-127), as torch's cast: 0 -> 2^-127 (fp32
    subnormal), 255 -> NaN. (The packed caches' ue8m0 bytes are read as e << 23 instead.)"""
    s = tl.where(e == 0, 0x400000, tl.where(e == 255, 0x7FC00000, e << 23))
    return s.to(tl.float32, bitcast=True)


# ---- jit helpers: RMSNorm and RoPE -----------------------------------------------------------

@triton.jit
def rms_scale(sum_sq, eps, DIM: tl.constexpr):
    """RMSNorm's 1 / sqrt(sum_sq / DIM + eps) (docs/numerics.md §4), each step correctly
    rounded (div_rn, sqrt_rn; the reference's rsqrt may differ by an ulp)."""
    return tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(sum_sq, DIM * 1.0) + eps))


# e8m0x4_to_fp32's PTX: the four bytes b of word $4 -> fp32 2^(b-127) in $0 .. $3, as
# e8m0_to_fp32: bits (b << 23) | (b in {0, 255}) << 22, so 0 -> 0x00400000 (2^-127) and 255 ->
# 0x7FC00000 (NaN). A byte is 0 or 255 when its bits all equal their neighbours' (y's byte 0,
# found for the four bytes at once: z's bit 7 is set where y's byte is 0); prmt then lays
# [z, b, z, z]'s bytes so that one shift puts b at bits 23..30 and z's bit 7 at bit 22.
E8M0X4_ASM = tl.constexpr("""{
.reg .b32 y, z, t;
shr.b32 y, $4, 1;
xor.b32 y, y, $4;
and.b32 y, y, 0x7F7F7F7F;
add.u32 z, y, 0x7F7F7F7F;
not.b32 z, z;
and.b32 z, z, 0x80808080;
prmt.b32 t, z, $4, 0x0040;
shl.b32 $0, t, 15;
prmt.b32 t, z, $4, 0x1151;
shl.b32 $1, t, 15;
prmt.b32 t, z, $4, 0x2262;
shl.b32 $2, t, 15;
prmt.b32 t, z, $4, 0x3373;
shl.b32 $3, t, 15;
}""")


@triton.jit
def e8m0x4_to_fp32(word, INTERPRET: tl.constexpr):
    """int32 words of four float8_e8m0fnu bytes (little-endian) -> their four fp32 values (byte
    0 first), each as e8m0_to_fp32 gives it, in 14 instructions a word (E8M0X4_ASM) instead of
    5 a byte."""
    if INTERPRET:
        return (e8m0_to_fp32(word & 0xFF), e8m0_to_fp32((word >> 8) & 0xFF),
                e8m0_to_fp32((word >> 16) & 0xFF), e8m0_to_fp32((word >> 24) & 0xFF))
    else:
        return tl.inline_asm_elementwise(E8M0X4_ASM, "=r,=r,=r,=r,r", [word],
                                         dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
                                         is_pure=True, pack=1)


@triton.jit
def mul_rn(a, b, INTERPRET: tl.constexpr):
    """fp32 a * b rounded to fp32 (PTX mul.rn.f32 on the GPU): never contracted with a later
    add into a fused multiply-add, whatever the launch's enable_fp_fusion."""
    if INTERPRET:
        return a * b
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .f32 x, y; mov.b32 x, $1; mov.b32 y, $2; mul.rn.f32 x, x, y; mov.b32 $0, x; }",
            "=r,r,r", [a, b], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def rope_rotate(even, odd, cs_ptr, pair, mask, INVERSE: tl.constexpr, INTERPRET: tl.constexpr):
    """(even + i odd) * (cos + i sin) at the rotation pairs ``pair`` (cs_ptr: the row's [R/2, 2]
    fp32 from cos_sin; masked pairs turn by 1), conjugate if INVERSE. Each product is rounded
    to fp32 (mul_rn: in any launch) and the sums then to bf16, as torch's CPU complex64
    multiply. Returns the bf16 values in fp32."""
    c = tl.load(cs_ptr + 2 * pair, mask=mask, other=1.0)
    s = tl.load(cs_ptr + 2 * pair + 1, mask=mask, other=0.0)
    if INVERSE:
        s = neg(s)
    re = mul_rn(even, c, INTERPRET) - mul_rn(odd, s, INTERPRET)
    im = mul_rn(even, s, INTERPRET) + mul_rn(odd, c, INTERPRET)
    return round_bf16(re, INTERPRET), round_bf16(im, INTERPRET)


# ---- per-head RoPE ---------------------------------------------------------------------------

@triton.jit
def _rope_heads_kernel(x_ptr, cs_ptr, out_ptr, H, D: tl.constexpr, R2: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_NOPE: tl.constexpr, BLOCK_R2: tl.constexpr,
                       INVERSE: tl.constexpr, COPY_NOPE: tl.constexpr,
                       INTERPRET: tl.constexpr):
    """x, out: [N, H, D] bf16 (out may be x: COPY_NOPE false; a tail value is stored only after
    both members of its pair were loaded, as it is computed from them); cs: [N, R2, 2] fp32;
    all contiguous. Grid (N, cdiv(H, BLOCK_H))."""
    n = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h[:, None] < H
    row = n * H * D + offs_h[:, None] * D  # [BLOCK_H, 1]
    if COPY_NOPE:
        offs_nope = tl.arange(0, BLOCK_NOPE)[None, :]
        nope_mask = h_mask & (offs_nope < D - 2 * R2)
        tl.store(out_ptr + row + offs_nope, tl.load(x_ptr + row + offs_nope, mask=nope_mask),
                 mask=nope_mask)
    # the tail as one contiguous [BLOCK_H, 2 R2] load per head (coalesced), split into pairs
    offs_t = tl.arange(0, 2 * BLOCK_R2)[None, :]
    t_mask = h_mask & (offs_t < 2 * R2)
    tail = row + (D - 2 * R2) + offs_t  # [BLOCK_H, 2 BLOCK_R2] offsets
    x_even, x_odd = tl.split(tl.reshape(
        tl.load(x_ptr + tail, mask=t_mask, other=0.0).to(tl.float32), (BLOCK_H, BLOCK_R2, 2)))
    pair = tl.arange(0, BLOCK_R2)[None, :]
    y_even, y_odd = rope_rotate(x_even, x_odd, cs_ptr + n * (2 * R2), pair, pair < R2, INVERSE,
                                INTERPRET)
    y = tl.reshape(tl.join(y_even, y_odd), (BLOCK_H, 2 * BLOCK_R2))
    tl.store(out_ptr + tail, y.to(tl.bfloat16), mask=t_mask)  # exact: already bf16


def rope_heads(x: torch.Tensor, rot: torch.Tensor, inverse: bool = False, *,
               in_place: bool = False) -> torch.Tensor:
    """RoPE on the last R dims of every head: ``apply_rope(x, rot.unsqueeze(1), inverse)``.

    x: [N, H, D] bf16; rot: [N, R/2] complex64, one row per position; inverse multiplies by
    the conjugate. Returns a new [N, H, D] bf16 tensor (x is not modified) or, in_place with
    a contiguous x, x itself with its tail pairs rotated (the nope dims neither read nor
    written: 2R of each head's D dims move instead of all of them). One program per (row,
    head block) copies the nope dims and rotates the tail pairs (rope_rotate).
    """
    require(isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16 and x.dim() == 3,
          f"x must be a 3-D bf16 [N, H, D] tensor, got {getattr(x, 'dtype', type(x))} "
          f"{tuple(getattr(x, 'shape', ()))}")
    n, h, d = x.shape
    r2 = check_rot(rot, n, d)
    check_device(x, rot)
    in_place = in_place and x.is_contiguous()
    out = x if in_place else torch.empty_like(x, memory_format=torch.contiguous_format)
    if out.numel() == 0:
        return out
    # in place, a program turns up to 32 heads' tails (64 B-256 B each): few, longer programs
    block_h = min(next_pow2(h), 32 if in_place else 8)
    _rope_heads_kernel[(n, cdiv(h, block_h))](
        x.contiguous(), cos_sin(rot), out, h, D=d, R2=r2, BLOCK_H=block_h,
        BLOCK_NOPE=next_pow2(max(d - 2 * r2, 1)),
        BLOCK_R2=next_pow2(r2), INVERSE=bool(inverse), COPY_NOPE=not in_place,
        INTERPRET=interpreting(), num_warps=4, enable_fp_fusion=False)
    return out


# ---- RMSNorm of whole rows -------------------------------------------------------------------

@triton.jit
def rms_row_scale(x_ptr, row, N: tl.constexpr, eps, BLOCK: tl.constexpr):
    """RMSNorm's r of row ``row`` of x [R, N] bf16 (BLOCK = next_power_of_2(N)): its squares
    (exact in fp32) summed in one fixed tree, the row's [BLOCK] load and ``rms_norm_warps``
    warps deciding it, so every kernel that calls this in a launch of that many warps gets
    the same r (rms_norm's; fp8_linear's fused norm)."""
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * N + offs, mask=offs < N, other=0.0).to(tl.float32)
    return rms_scale(tl.sum(x * x, 0), eps, N)


def rms_norm_warps(n: int) -> int:
    """Warps of a launch that calls rms_row_scale over rows of n."""
    return 4 if n <= 2048 else 8


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, N: tl.constexpr, eps, BLOCK: tl.constexpr,
                     INTERPRET: tl.constexpr):
    """x, out: [R, N] bf16; w: [N] bf16. Grid (R,): one row per program, its sum of squares
    in one fixed tree (so the same bits whatever R is)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    r = rms_row_scale(x_ptr, row, N, eps, BLOCK)
    x = tl.load(x_ptr + row * N + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = to_bf16(w * (x * r), INTERPRET)
    tl.store(out_ptr + row * N + offs, y.to(tl.bfloat16), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``norm.rms_norm`` (docs/numerics.md §4) as a kernel: ``bf16(w * (x * r))`` with r =
    1 / sqrt(mean(x^2) + eps) correctly rounded step by step (``rms_scale``), over the last dim.

    x: [..., N] bf16; weight: [N] bf16. Returns a new bf16 tensor shaped like x. One program per
    row sums its squares in one fixed order: torch's reduction on a GPU picks its order (and
    so its last bit) by the tensor's shape, i.e. by how many rows share the call."""
    require(isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16 and x.dim() >= 1,
            f"x must be a bf16 tensor, got {getattr(x, 'dtype', type(x))}")
    n = x.shape[-1]
    require(isinstance(weight, torch.Tensor) and weight.dtype == torch.bfloat16
            and tuple(weight.shape) == (n,),
            f"weight must be bf16 [{n}], got {getattr(weight, 'dtype', type(weight))} "
            f"{tuple(getattr(weight, 'shape', ()))}")
    check_device(x, weight)
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    rows = out.numel() // max(n, 1)
    if out.numel() == 0:
        return out
    _rms_norm_kernel[(rows,)](x.contiguous(), weight.contiguous(), out, N=n, eps=float(eps),
                              BLOCK=next_pow2(n), INTERPRET=interpreting(),
                              num_warps=rms_norm_warps(n), enable_fp_fusion=False)
    return out
