"""Triton window K=V rows (norm + RoPE + fp8 pack + ring write) and per-head RoPE against the
reference (SPEC §2.4, §2.5, §4.1-4.2); runs under TRITON_INTERPRET=1 on CPU."""
import pytest
import torch

pytest.importorskip("triton")

import dsv41attn.ops.common.triton as C
import dsv41attn.ops.window_kv.triton as T
from dsv41attn.config import preset
from dsv41attn.ops.common.packing import unpack_window_rows
from dsv41attn.ops.common.rope import rope_frequencies, rope_rotations
from dsv41attn.ops.window_kv import reference as R

DEV = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-20  # SPEC §2.4: every norm in the layer
POISON_BYTE = 0xFF  # -NaN as an e4m3 code, NaN as a ue8m0 byte: the kernels never produce it

# (D, R/2, heads, rope frequencies of a YaRN layer) of the tiny preset and of V4.1-Flash
DIMS = {}
for _name in ("tiny", "v41-flash"):
    _cfg = preset(_name)
    _layer = next(i for i in range(_cfg.n_layers) if _cfg.layer(i).ratio > 0)
    DIMS[_name] = (_cfg.head_dim, _cfg.rope_head_dim // 2, rope_frequencies(_cfg, _cfg.layer(_layer)))


class _PoisonedTorch:
    """The torch module for T and C (rope_heads' home), except that new tensors come filled with
    a pattern (NaN for floats, POISON_BYTE for bytes), so an output element the kernel does not
    write fails."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def _poison(t):
        return t.fill_(POISON_BYTE) if t.dtype == torch.uint8 else t.fill_(float("nan"))

    def empty(self, *args, **kwargs):
        return self._poison(torch.empty(*args, **kwargs))

    def empty_like(self, *args, **kwargs):
        return self._poison(torch.empty_like(*args, **kwargs))


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    monkeypatch.setattr(T, "torch", _PoisonedTorch())
    monkeypatch.setattr(C, "torch", _PoisonedTorch())


def _positions(n: int, g: torch.Generator) -> torch.Tensor:
    """n positions including 0 and 1 << 20 (the largest angles) where n allows."""
    p = torch.randint(0, 1 << 20, (n,), generator=g)
    p[0] = 0
    if n > 1:
        p[-1] = 1 << 20
    return p


def _case(dims: str, n: int, seed: int, exact_sum: bool = False):
    """(kv [n, D] bf16, weight [D] bf16, rot [n, R/2] complex64) on the CPU.

    exact_sum: kv = k * 2^e with integer |k| <= 127 and one e per row, so every partial sum of
    squares is a multiple of 2^(2e) below 2^24 * 2^(2e): exact in fp32 in any order (plus an
    all-zero row). Otherwise Gaussian rows with scales from 1e-3 to 1e3.
    """
    d, _, freqs = DIMS[dims]
    g = torch.Generator().manual_seed(seed)
    if exact_sum:
        k = torch.randint(-127, 128, (n, d), generator=g).float()
        kv = k * 2.0 ** torch.randint(-60, 40, (n, 1), generator=g).float()
        kv[n // 2] = 0.0
    else:
        kv = torch.randn(n, d, generator=g) * torch.logspace(-3, 3, n)[:, None]
    weight = (1 + 0.2 * torch.randn(d, generator=g)).bfloat16()
    return kv.bfloat16(), weight, rope_rotations(freqs, _positions(n, g))


def _signed_rank(codes: torch.Tensor) -> torch.Tensor:
    """e4m3 bytes -> position on the ordered e4m3 grid (adjacent values differ by 1, +-0 -> 0)."""
    c = codes.to(torch.int32)
    return torch.where(c >= 0x80, -(c & 0x7F), c)


def _assert_packed_close(got: torch.Tensor, want: torch.Tensor, d: int) -> None:
    """Packed window rows [N, D + D/32] that agree up to the sum-of-squares order.

    The kernel sums the squares of the RMSNorm mean in its reduction tree's order, torch in
    its own; the fp32 mean (so rsqrt) can differ by an ulp, which moves a normed bf16 value by
    one ulp only when it lies at a rounding boundary, and an e4m3 code only if that crosses a
    code boundary too. Measured with a different summation order over 20000 x 512 Gaussian
    rows: 1 to 2 code bytes of 1e7 moved, by one code step, no scale byte. So: scale bytes equal
    except in at most 1e-3 of blocks, where they differ by one (the amax crossed a power of
    two); code bytes in blocks of equal scale equal except at most 1e-3 of them, which are one
    step apart on the e4m3 grid; decoded values of the other blocks within one coarse step.
    """
    assert got.shape == want.shape and got.dtype == want.dtype == torch.uint8
    got, want = got.cpu(), want.cpu()
    scale_diff = got[:, d:].to(torch.int32) - want[:, d:].to(torch.int32)
    assert scale_diff.abs().max().item() <= 1
    assert (scale_diff != 0).float().mean().item() <= 1e-3
    same_scale = (scale_diff == 0).repeat_interleave(32, 1)  # [N, D]
    step = (_signed_rank(got[:, :d]) - _signed_rank(want[:, :d]))[same_scale]
    assert step.numel() == 0 or step.abs().max().item() <= 1
    assert (step != 0).float().mean().item() <= 1e-3
    moved = ~same_scale
    if moved.any():
        a, b = unpack_window_rows(got).float()[moved], unpack_window_rows(want).float()[moved]
        coarse = torch.maximum(got[:, d:], want[:, d:]).repeat_interleave(32, 1)[moved]
        coarse = (coarse.to(torch.float32) - 127).exp2()  # the larger scale of the two
        assert ((a - b).abs() <= 0.125 * torch.maximum(a.abs(), b.abs()) + 2.0 ** -9 * coarse).all()


def _oracle_close(packed: torch.Tensor, kv, weight, rot) -> None:
    """Decoded rows against fp64 norm + RoPE: within e4m3 rounding (half a step: 2^-4 relative,
    2^-10 s for subnormal codes) plus the bf16 roundings before it (2^-9 relative to the
    element for the norm; 2^-9 of the pair's magnitude, twice, through the rotation)."""
    d = kv.shape[1]
    x = kv.double()
    y = x / (x.pow(2).mean(-1, keepdim=True) + EPS).sqrt() * weight.double()
    r2 = rot.shape[1]
    z = torch.view_as_complex(y[:, d - 2 * r2:].unflatten(-1, (-1, 2)).contiguous())
    y[:, d - 2 * r2:] = torch.view_as_real(z * rot.to(torch.complex128)).flatten(-2)
    s = (packed[:, d:].cpu().to(torch.int64) - 127).double().exp2().repeat_interleave(32, 1)
    pair = y.unflatten(-1, (-1, 2)).norm(dim=-1).repeat_interleave(2, 1)  # |(y_2j, y_2j+1)|
    err = (unpack_window_rows(packed.cpu()).double() - y).abs()
    assert (err <= 2.0 ** -4 * y.abs() + 2.0 ** -6 * pair + 2.0 ** -10 * s).all()


@pytest.mark.parametrize("n", [1, 3, 37])
@pytest.mark.parametrize("dims", list(DIMS))
def test_norm_rope_pack_random(dims, n):
    kv, weight, rot = _case(dims, n, seed=n)
    got = T.norm_rope_pack(kv.to(DEV), weight.to(DEV), EPS, rot.to(DEV))
    want = R.norm_rope_pack(kv, weight, EPS, rot)
    _assert_packed_close(got, want, kv.shape[1])
    _oracle_close(got, kv, weight, rot)


@pytest.mark.parametrize("n", [1, 3, 37])
@pytest.mark.parametrize("dims", list(DIMS))
def test_norm_rope_pack_exact_sum(dims, n):
    """With a sum of squares exact in every order the rest is rounding for rounding: bit-exact."""
    kv, weight, rot = _case(dims, n, seed=100 + n, exact_sum=True)
    got = T.norm_rope_pack(kv.to(DEV), weight.to(DEV), EPS, rot.to(DEV))
    assert torch.equal(got.cpu(), R.norm_rope_pack(kv, weight, EPS, rot))


@pytest.mark.parametrize("strided", [False, True], ids=["ring", "ring_slice"])
@pytest.mark.parametrize("dims", list(DIMS))
def test_norm_rope_pack_ring(dims, strided):
    """Rows go to the chosen (row, slot); slot -1 rows and every other ring byte stay as they
    were (a random byte pattern); a ring that is a slice of a larger buffer keeps its strides."""
    n, batch, slots = 7, 3, 5
    kv, weight, rot = _case(dims, n, seed=7, exact_sum=True)
    row_bytes = kv.shape[1] + kv.shape[1] // 32
    g = torch.Generator().manual_seed(8)
    pattern = torch.randint(0, 256, (batch, slots + 3, row_bytes), generator=g, dtype=torch.uint8)
    ring_row = torch.tensor([2, 0, 1, 2, 0, 1, 1])
    ring_slot = torch.tensor([4, -1, 0, 0, 3, -1, 2])

    def ring_of(buffer):
        return buffer[:, 1:slots + 1] if strided else buffer[:, :slots].contiguous()

    ring_ref = ring_of(pattern.clone())
    want = R.norm_rope_pack(kv, weight, EPS, rot, ring_ref, ring_row, ring_slot)
    buffer = pattern.clone().to(DEV)
    ring = ring_of(buffer)
    got = T.norm_rope_pack(kv.to(DEV), weight.to(DEV), EPS, rot.to(DEV), ring,
                           ring_row.to(DEV), ring_slot.to(DEV))
    assert torch.equal(got.cpu(), want)
    assert torch.equal(ring.cpu(), ring_ref)
    if strided:  # the bytes outside the slice too
        assert torch.equal(buffer.cpu()[:, 0], pattern[:, 0])
        assert torch.equal(buffer.cpu()[:, slots + 1:], pattern[:, slots + 1:])
    written = ring_slot >= 0
    assert torch.equal(ring_ref[ring_row[written], ring_slot[written]], want[written])
    assert not torch.equal(ring_ref, ring_of(pattern))  # something was written


@pytest.mark.parametrize("dims", list(DIMS))
def test_norm_rope_pack_flat_slots_and_positions(dims):
    """A decode plan's form: flat slots row * S + slot (no ring_row) write what the (row, slot)
    form writes, and each written row's sequence position is set (a row with slot -1 and its
    sequence's position are left alone), as the reference does."""
    batch, slots = 4, 5
    ring_row = torch.tensor([2, 0, 3, 1])
    ring_slot = torch.tensor([4, 0, -1, 2])
    flat = torch.where(ring_slot >= 0, ring_row * slots + ring_slot, -1)
    kv, weight, rot = _case(dims, 4, seed=11, exact_sum=True)
    row_bytes = kv.shape[1] + kv.shape[1] // 32
    g = torch.Generator().manual_seed(12)
    pattern = torch.randint(0, 256, (batch, slots, row_bytes), generator=g, dtype=torch.uint8)
    pos0 = torch.tensor([7, 8, 9, 10])
    position = torch.tensor([31, 32, 33, 34])
    by_row = pattern.clone()
    R.norm_rope_pack(kv, weight, EPS, rot, by_row, ring_row, ring_slot)
    ring_ref, pos_ref = pattern.clone(), pos0.clone()
    want = R.norm_rope_pack(kv, weight, EPS, rot, ring_ref, None, flat, positions=pos_ref,
                            position=position)
    assert torch.equal(ring_ref, by_row)
    assert pos_ref.tolist() == [32, 34, 31, 10]  # rows 0, 1, 2 written; row 3's slot is -1
    ring, pos = pattern.clone().to(DEV), pos0.clone().to(DEV)
    got = T.norm_rope_pack(kv.to(DEV), weight.to(DEV), EPS, rot.to(DEV), ring, None,
                           flat.to(DEV), positions=pos, position=position.to(DEV))
    assert torch.equal(got.cpu(), want)
    assert torch.equal(ring.cpu(), ring_ref)
    assert torch.equal(pos.cpu(), pos_ref)


@pytest.mark.parametrize("n", [1, 3, 37])
@pytest.mark.parametrize("dims,heads,inverse", [
    ("tiny", 8, False), ("tiny", 3, True), ("v41-flash", 3, False), ("v41-flash", 3, True),
    ("v41-flash", 40, True),  # in place: a full 32-head block and a masked one
], ids=["tiny-8heads", "tiny-3heads-inverse", "v41-flash-3heads", "v41-flash-3heads-inverse",
        "v41-flash-40heads-inverse"])
def test_rope_heads(dims, heads, inverse, n):
    d, _, freqs = DIMS[dims]
    g = torch.Generator().manual_seed(n * heads)
    x = (torch.randn(n, heads, d, generator=g) * 10.0 ** torch.randint(-4, 4, (n, heads, 1),
                                                                       generator=g)).bfloat16()
    rot = rope_rotations(freqs, _positions(n, g))
    x_dev = x.clone().to(DEV)
    got = T.rope_heads(x_dev, rot.to(DEV), inverse)
    want = R.rope_heads(x, rot, inverse)
    assert torch.equal(got.cpu().view(torch.int16), want.view(torch.int16))  # bits, -0 included
    assert torch.equal(x_dev.cpu().view(torch.int16), x.view(torch.int16))  # x untouched
    # in place: x itself turns, its nope dims never written (the same bits)
    same = T.rope_heads(x_dev, rot.to(DEV), inverse, in_place=True)
    assert same.data_ptr() == x_dev.data_ptr()
    assert torch.equal(x_dev.cpu().view(torch.int16), want.view(torch.int16))
    assert torch.equal(R.rope_heads(x, rot, inverse, in_place=True).view(torch.int16),
                       want.view(torch.int16))


def test_norm_rope_pack_ring_out_of_range():
    """Entries outside the ring are caller errors the host cannot see without a sync: the
    kernel skips them rather than write out of bounds (the reference would raise)."""
    kv, weight, rot = _case("tiny", 3, seed=9, exact_sum=True)
    ring = torch.full((2, 4, 33), 7, dtype=torch.uint8, device=DEV)
    ring_row = torch.tensor([0, 2, -1], device=DEV)
    ring_slot = torch.tensor([4, 0, 1], device=DEV)
    got = T.norm_rope_pack(kv.to(DEV), weight.to(DEV), EPS, rot.to(DEV), ring, ring_row, ring_slot)
    assert torch.equal(got.cpu(), R.norm_rope_pack(kv, weight, EPS, rot))
    assert (ring == 7).all()


def test_rope_heads_strided_input():
    d, _, freqs = DIMS["v41-flash"]
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 5, d, generator=g).bfloat16().transpose(0, 1)  # [5, 3, D], not contiguous
    rot = rope_rotations(freqs, _positions(5, g))
    got = T.rope_heads(x.to(DEV), rot.to(DEV))
    assert torch.equal(got.cpu().view(torch.int16), R.rope_heads(x, rot).view(torch.int16))
    x_dev = x.to(DEV)  # a strided view of a contiguous tensor: in_place cannot turn it
    before = x_dev.clone()
    got = T.rope_heads(x_dev, rot.to(DEV), in_place=True)
    assert got.data_ptr() != x_dev.data_ptr() and torch.equal(x_dev, before)
    assert torch.equal(got.cpu().view(torch.int16), R.rope_heads(x, rot).view(torch.int16))


def _pack_args(**changes):
    kv, weight, rot = _case("tiny", 3, seed=0)
    args = {"kv": kv, "weight": weight, "eps": EPS, "rot": rot,
            "ring": torch.zeros(2, 4, 33, dtype=torch.uint8),
            "ring_row": torch.zeros(3, dtype=torch.int64), "ring_slot": torch.arange(3)}
    args.update(changes)
    return {k: v.to(DEV) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


PACK_ERRORS = {
    "kv_fp32": ({"kv": torch.zeros(3, 32)}, "kv must be a 2-D bf16"),
    "kv_3d": ({"kv": torch.zeros(1, 3, 32, dtype=torch.bfloat16)}, "kv must be a 2-D bf16"),
    "kv_d48": ({"kv": torch.zeros(3, 48, dtype=torch.bfloat16),
                "weight": torch.ones(48, dtype=torch.bfloat16)}, "D = 48 must be a positive"),
    "weight_shape": ({"weight": torch.ones(31, dtype=torch.bfloat16)}, r"weight must be a bf16 \[32\]"),
    "weight_fp32": ({"weight": torch.ones(32)}, r"weight must be a bf16 \[32\]"),
    "rot_c128": ({"rot": torch.ones(3, 4, dtype=torch.complex128)}, "rot must be a 2-D complex64"),
    "rot_rows": ({"rot": torch.ones(4, 4, dtype=torch.complex64)}, r"rot shape \(4, 4\)"),
    "rot_too_wide": ({"rot": torch.ones(3, 17, dtype=torch.complex64)}, r"rot shape \(3, 17\)"),
    "ring_int8": ({"ring": torch.zeros(2, 4, 33, dtype=torch.int8)}, r"ring must be a uint8 \[B, S, 33\]"),
    "ring_bytes": ({"ring": torch.zeros(2, 4, 32, dtype=torch.uint8)}, r"ring must be a uint8 \[B, S, 33\]"),
    "ring_row_int32": ({"ring_row": torch.zeros(3, dtype=torch.int32)}, r"ring_row must be an int64 \[3\]"),
    "flat_slot_int32": ({"ring_row": None, "ring_slot": torch.arange(3, dtype=torch.int32)},
                        r"ring_slot must be an int64 \[3\]"),
    "positions_without_ring": ({"ring": None, "ring_row": None, "ring_slot": None,
                                "positions": torch.zeros(2, dtype=torch.int64),
                                "position": torch.ones(3, dtype=torch.int64)},
                               "positions were given without a ring"),
    "position_without_positions": ({"position": torch.ones(3, dtype=torch.int64)},
                                   "position was given without positions"),
    "positions_shape": ({"positions": torch.zeros(3, dtype=torch.int64),
                         "position": torch.ones(3, dtype=torch.int64)},
                        r"positions must be a contiguous int64 \[2\]"),
    "position_missing": ({"positions": torch.zeros(2, dtype=torch.int64)},
                         r"position must be an int64 \[3\] tensor with positions"),
    "ring_slot_int32": ({"ring_slot": torch.arange(3, dtype=torch.int32)}, r"ring_slot must be an int64 \[3\]"),
    "ring_slot_shape": ({"ring_slot": torch.arange(4)}, r"ring_slot must be an int64 \[3\]"),
    "index_without_ring": ({"ring": None}, "ring_row and ring_slot were given without a ring"),
}


@pytest.mark.parametrize("case", list(PACK_ERRORS))
def test_norm_rope_pack_errors(case):
    changes, message = PACK_ERRORS[case]
    args = _pack_args(**changes)
    ring_before = args["ring"].clone() if isinstance(args["ring"], torch.Tensor) else None
    pos_before = args["positions"].clone() if isinstance(args.get("positions"), torch.Tensor) \
        else None
    with pytest.raises(ValueError, match=message):
        T.norm_rope_pack(**args)
    if ring_before is not None:  # rejected before anything is written
        assert torch.equal(args["ring"], ring_before)
    if pos_before is not None:
        assert torch.equal(args["positions"], pos_before)


ROPE_ERRORS = {
    "x_2d": (torch.zeros(3, 32, dtype=torch.bfloat16), torch.ones(3, 4, dtype=torch.complex64),
             "x must be a 3-D bf16"),
    "x_fp16": (torch.zeros(3, 2, 32, dtype=torch.float16), torch.ones(3, 4, dtype=torch.complex64),
               "x must be a 3-D bf16"),
    "rot_real": (torch.zeros(3, 2, 32, dtype=torch.bfloat16), torch.ones(3, 4),
                 "rot must be a 2-D complex64"),
    "rot_rows": (torch.zeros(3, 2, 32, dtype=torch.bfloat16), torch.ones(2, 4, dtype=torch.complex64),
                 r"rot shape \(2, 4\) does not match N = 3"),
}


@pytest.mark.parametrize("case", list(ROPE_ERRORS))
def test_rope_heads_errors(case):
    x, rot, message = ROPE_ERRORS[case]
    with pytest.raises(ValueError, match=message):
        T.rope_heads(x.to(DEV), rot.to(DEV))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device")
def test_device_mismatch():
    args = _pack_args()
    args["ring"] = args["ring"].cpu()
    with pytest.raises(ValueError, match="several devices"):
        T.norm_rope_pack(**args)


def test_empty_rows():
    kv, weight, rot = _case("tiny", 1, seed=0)
    out = T.norm_rope_pack(kv[:0].to(DEV), weight.to(DEV), EPS, rot[:0].to(DEV))
    assert out.shape == (0, 33) and out.dtype == torch.uint8
