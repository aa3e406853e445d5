"""The Gluon square tiles of fp8_linear (ops/linear/gluon.py) and their folded weight operand.

The fold (e4m3_to_bf16 with the block scales) and its guard (foldable_scales) run under the
interpreter; the Gluon kernel, which does not run there, is compiled for sm_90a on the CPU
(the stand-in driver of sm90_compile.py) and, on a Hopper GPU, checked bit for bit against the
Triton square tiles it replaces."""
import os

import pytest
import torch

pytest.importorskip("triton")

import dsv41attn.ops.linear.triton as T  # noqa: E402
import sm90_compile  # noqa: E402
from conftest import poison_empty  # noqa: E402
from dsv41attn.checkpoint import Fp8Weight, quantize_fp8  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
GPU = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9 \
    and os.environ.get("TRITON_INTERPRET", "0") != "1"


def _e8m0(e: torch.Tensor) -> torch.Tensor:
    return e.to(torch.uint8).view(torch.float8_e8m0fnu)


def test_fold_is_each_value_times_its_block_scale():
    """Every e4m3 code (NaN included) in a 70 x 96 weight, each 32 x 32 block with its own
    scale (2^-63 .. 1, the foldable range, and the edge bytes), the last row block cut short:
    exactly the code's value times 2^(e-127), in bf16; without scales, the plain values."""
    g = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 256, (70, 96), generator=g, dtype=torch.int32).to(torch.uint8)
    codes[0, :4] = torch.tensor([0x00, 0x80, 0x01, 0x7E], dtype=torch.uint8)  # +-0, min, max
    w = codes.view(torch.float8_e4m3fn)
    e = torch.tensor([[T.FOLD_MIN_E, 127, 100], [120, T.FOLD_MAX_E, 64], [90, 110, 126]],
                     dtype=torch.int32)
    got = T.e4m3_to_bf16(w.to(DEV), _e8m0(e).to(DEV)).cpu()
    scale = torch.pow(2.0, (e - 127).double()).repeat_interleave(32, 0)[:70]
    want = (w.double() * scale.repeat_interleave(32, 1)).to(torch.bfloat16)
    nan = torch.isnan(want)
    assert nan.any() and torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))
    assert torch.equal(T.e4m3_to_bf16(w.to(DEV)).cpu().view(torch.int16)[~nan],
                       w.to(torch.bfloat16).view(torch.int16)[~nan])
    with pytest.raises(ValueError, match=r"scale \(3, 2\) does not match weight \(70, 96\)"):
        T.e4m3_to_bf16(w.to(DEV), _e8m0(e[:, :2]).to(DEV))


def test_foldable_scales_range_and_cache():
    """The guard: every byte within FOLD_MIN_E..FOLD_MAX_E; one byte outside either end, or
    a NaN scale, says no; an answer is cached per tensor and dropped when the tensor is
    written in place."""
    s = _e8m0(torch.full((4, 8), 120))
    assert T.foldable_scales(s)
    for bad in (T.FOLD_MIN_E - 1, T.FOLD_MAX_E + 1, 0, 255):
        t = _e8m0(torch.full((4, 8), 120))
        t.view(torch.uint8)[3, 7] = bad
        assert not T.foldable_scales(t), bad
    t = _e8m0(torch.full((2, 2), T.FOLD_MIN_E))
    assert T.foldable_scales(t)
    t.view(torch.uint8)[1, 1] = 200  # an in-place write: the cached verdict must not stand
    assert not T.foldable_scales(t)
    t.view(torch.uint8)[1, 1] = 127
    assert T.foldable_scales(t)


def test_nan_free_codes_and_cache():
    """The decode tiles' guard for reading codes by their bits: any e4m3 NaN code (0x7f,
    0xff) says no, every other byte yes; cached per tensor, dropped when it is written."""
    w = torch.arange(256, dtype=torch.uint8)
    w = w[(w & 0x7F) != 0x7F].repeat(3, 1).view(torch.float8_e4m3fn)
    assert T.nan_free_codes(w)
    for nan in (0x7F, 0xFF):
        t = w.clone()
        t.view(torch.uint8)[2, 5] = nan
        assert not T.nan_free_codes(t), nan
    w.view(torch.uint8)[0, 0] = 0xFF  # an in-place write: the cached verdict must not stand
    assert not T.nan_free_codes(w)
    w.view(torch.uint8)[0, 0] = 0x7E
    assert T.nan_free_codes(w)


def _bits_recipe(pairs: torch.Tensor) -> torch.Tensor:
    """E4M3_BF16_BITS_ASM's steps, read from its PTX and carried out on the CPU: pairs [n]
    int64 (two code bytes in the low 16 bits, as cvt.u32.u16 gives them) -> [n, 2] the bf16
    bits of its two results."""
    import re
    from dsv41attn.ops.common.triton import E4M3_BF16_BITS_ASM as asm
    sel = int(re.search(r"prmt\.b32 t, t, 0, (0x[0-9A-Fa-f]+);", asm)[1], 16)
    shift = int(re.search(r"shl\.b32 t, t, (\d+);", asm)[1])
    mask = int(re.search(r"and\.b32 t, t, (0x[0-9A-Fa-f]+);", asm)[1], 16)
    k = int(re.search(r"mov\.b32 k, (0x[0-9A-Fa-f]+);", asm)[1], 16)
    z = int(re.search(r"mov\.b32 z, (0x[0-9A-Fa-f]+);", asm)[1], 16)
    assert "fma.rn.bf16x2 $0, t, k, z;" in asm
    src = [(pairs >> (8 * i)) & 0xFF for i in range(4)] + [torch.zeros_like(pairs)] * 4
    t = torch.zeros_like(pairs)
    for i in range(4):  # prmt: byte i from its selector nibble (bit 3: the byte's sign, spread)
        nib = (sel >> (4 * i)) & 0xF
        b = src[nib & 7]
        if nib & 8:
            b = torch.where(b & 0x80 != 0, 0xFF, 0)
        t |= b << (8 * i)
    t = ((t << shift) & 0xFFFFFFFF) & mask
    out = []
    for h in range(2):  # each half: bf16 t * k + z, rounded once (the product is exact here)
        def bf(bits):
            return (bits & 0xFFFF).to(torch.int16).view(torch.bfloat16).double()
        v = bf(t >> (16 * h)) * bf(torch.tensor(k >> (16 * h))) + bf(torch.tensor(z >> (16 * h)))
        out.append(v.to(torch.bfloat16).view(torch.int16).long() & 0xFFFF)
    return torch.stack(out, 1)


def test_code_bits_recipe_gives_every_codes_bf16_bits():
    """E4M3_BF16_BITS_ASM (the decode tiles' e4m3 -> bf16 by bits), its PTX's constants run on
    the CPU over every pair of codes: each result is torch's e4m3 -> bf16 of its byte, bit for
    bit (zeros of both signs and the subnormals included), the high byte's result unmoved by
    the low byte's spilled sign bits; only the NaN codes (0x7f, 0xff) differ, read as +-480,
    which is why nan_free_codes guards it."""
    pairs = torch.arange(1 << 16, dtype=torch.int64)
    got = _bits_recipe(pairs)
    codes = torch.arange(256, dtype=torch.uint8)
    want = codes.view(torch.float8_e4m3fn).to(torch.bfloat16).view(torch.int16).long() & 0xFFFF
    for h in range(2):
        byte = (pairs >> (8 * h)) & 0xFF
        nan = (byte & 0x7F) == 0x7F
        assert torch.equal(got[~nan, h], want[byte[~nan]]), h
        val = got[nan, h].to(torch.int16).view(torch.bfloat16).float()
        assert torch.equal(val.abs(), torch.full_like(val, 480.0))


def test_square_tiles_from_fewer_rows_only_with_the_fold_in_the_ring(monkeypatch):
    """The plan takes the square tiles from SQUARE_WS_MIN_M rows instead of PRESCALE_MIN_M only
    where the Gluon tiles fold the weight in their ring (both flags, a Hopper GPU): with either
    flag off, or on the CPU, 256 rows of wq_b's shape keep the wide tiles."""
    n, kb, sms = 32768, 40, 132
    default = T._linear_shape_plan(256, n, kb, sms, None, True, True)
    assert default.swap and default.prescaled  # the wide decode-kernel tiles
    square = T._linear_shape_plan(256, n, kb, sms, None, True, True, square_min_m=128)
    assert not square.swap and square.prescaled  # the square tiles on bf16 values
    assert square.order == default.order  # the same K order: the same bits
    monkeypatch.setattr(T, "SQUARE_WS", True)
    monkeypatch.setattr(T, "SQUARE_WS_CODES", True)
    assert T._square_min_m(torch.device("cpu")) == T.PRESCALE_MIN_M
    if GPU:
        assert T._square_min_m(torch.device("cuda")) == T.SQUARE_WS_MIN_M
        monkeypatch.setattr(T, "SQUARE_WS_CODES", False)  # the fold pass: not below 512 rows
        assert T._square_min_m(torch.device("cuda")) == T.PRESCALE_MIN_M


def _compile(bk: int, stages: int, split: bool = False, codes: bool = False,
             triton_dir: str | None = None, persist: bool = False) -> dict:
    """Compile _fp8_values_ws_kernel for sm_90a (sm90_compile.compile_probe): shared memory,
    (registers, stack, local ld/st, loop), and what its PTX holds."""
    import sm90_compile
    return sm90_compile.compile_probe(f"""
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
import dsv41attn.ops.linear.gluon as g
al = gl.NVMMASharedLayout.get_default_for([g.BLOCK_M, {bk}], gl.bfloat16)
bl = gl.NVMMASharedLayout.get_default_for([g.BLOCK_N, {bk}], gl.bfloat16)
wl = gl.NVMMASharedLayout.get_default_for([g.BLOCK_N, {bk}], gl.float8e4nv) if {codes} else bl
ad = TensorDescriptor(M(torch.bfloat16), [8192, 8192], [8192, 1], [g.BLOCK_M, {bk}], al)
bd = TensorDescriptor(M(torch.float8_e4m3fn if {codes} else torch.bfloat16), [5120, 8192],
                      [8192, 1], [g.BLOCK_N, {bk}], wl)
k = g._fp8_values_ws_kernel.warmup(ad, bd, M(torch.bfloat16), M(torch.uint8), 8192, 5120, 256,
    160, 8192 // {bk}, *((256, 100) if {split} else (32, 5)), GRANULE=1 if {split} else 8,
    STAGES={stages}, SPLIT={split}, CODES={codes}, B_LAYOUT=bl, OUT_BF16=not {split},
    PERSIST={persist},
    CONSUMER_REGS=g.CODES_CONSUMER_REGS if {codes} else g.CONSUMER_REGS,
    PRODUCER_REGS=g.PRODUCER_REGS, CONVERTER_REGS=g.CONVERTER_REGS, num_warps=4, grid=(1,))
ptx = k.asm["ptx"]
print(json.dumps({{"shared": int(k.metadata.shared), "res": s._resources(k.asm["cubin"], True),
                  "wgmma": ptx.count("wgmma.mma_async"), "setmaxnreg": ptx.count("setmaxnreg"),
                  "tma": ptx.count("cp.async.bulk.tensor"),
                  "neg_zero": ptx.count("0f80000000"), "pos_zero": ptx.count("0f00000000")}}))
""", triton_dir)


@pytest.mark.parametrize("triton_dir", sm90_compile.TRITONS,
                         ids=lambda d: "this" if d is None else os.path.basename(d))
@pytest.mark.parametrize("ring, split", [
    (ring, split) for ring in ("values", "values-wide", "codes")
    for split in (False, True, "persistent", "split-persistent")
    if not (ring == "codes" and split in ("persistent", "split-persistent"))],  # (see below)
    ids=lambda v: {False: "ranges-in-program", True: "split-ranges",
                   "persistent": "tiles-in-turn", "split-persistent": "split-in-turn"}.get(v, v))
def test_compiles_warp_specialized_for_sm90(ring, split, triton_dir):
    """The kernel lowers for an H100/H200 with K cut in ranges, at each ring form (folded bf16
    values in 64- or 128-wide stages; e4m3 codes folded by the converter), the ranges summed in
    the program, one a program (split, ranges ending inside ring stages), or (the folded
    values) items taken in turn by persistent programs, output tiles or (split) a tile's
    range: each 32-block's wgmma (two or four per ring stage), register budgets per
    partition, the TMA ring in shared memory, no spills. (The codes' converter spills in the
    item loop, so fp8_values_gemm_ws runs those launches one program an item, and this does
    not compile that pair.)"""
    pytest.importorskip("triton.experimental.gluon")
    from dsv41attn.ops.linear import gluon as G
    bk, stages = {"values": (G.BLOCK_K, G.STAGES), "values-wide": (G.WIDE_K, G.WIDE_STAGES),
                  "codes": (G.BLOCK_K, G.CODES_STAGES)}[ring]
    r = _compile(bk, stages, split in (True, "split-persistent"), ring == "codes", triton_dir,
                 persist=split in ("persistent", "split-persistent"))
    assert r["wgmma"] > 0 and r["setmaxnreg"] > 0 and r["tma"] > 0, r
    assert r["shared"] <= 232448, r
    regs, stack, local, _ = r["res"]
    assert stack == 0 and local == 0, r  # no spills
    assert r["neg_zero"] > 0, r  # the sums start from -0 (_neg_zeros)


def _against_triton_tiles(monkeypatch, flag: str, x, w, splits, out_dtype):
    """fp8_linear with the Gluon tiles (``flag`` on) against the Triton tiles (off), every
    buffer the op makes starting NaN: the same bits in every output."""
    poison_empty(monkeypatch, T)
    got = T.fp8_linear(x, w.weight, w.scale, num_splits=splits, out_dtype=out_dtype)
    monkeypatch.setattr(T, flag, False)
    want = T.fp8_linear(x, w.weight, w.scale, num_splits=splits, out_dtype=out_dtype)
    assert not want.isnan().any()
    bits = torch.int16 if out_dtype == torch.bfloat16 else torch.int32
    diff = (got.view(bits) != want.view(bits)).sum().item()
    assert diff == 0, f"{diff} of {got.numel()} outputs differ"


def _rope_case(m: int, n: int, k: int, seed: int):
    """(generator, weight, x [m, k] bf16, rot [m, 32]) on the GPU for the RoPE'd-output tests
    (heads of 512 columns, 64 of them turned)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = quantize_fp8(torch.randn(n, k, device="cuda", generator=g) / k ** 0.5)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    ang = torch.rand(m, 32, device="cuda", generator=g) * 50
    return g, w, x, torch.polar(torch.ones_like(ang), ang)


def _rope_against_triton_tiles(monkeypatch, flag: str, w, x, rot):
    """fp8_linear with the query's RoPE, the Gluon tiles (``flag`` on: rope_heads after them)
    against the Triton tiles (off: turned as they store): the same bits."""
    got = T.fp8_linear(x, w.weight, w.scale, rope=(rot, 512))
    monkeypatch.setattr(T, flag, False)
    want = T.fp8_linear(x, w.weight, w.scale, rope=(rot, 512))
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


# (M, N, K, num_splits, split): the square tiles' rows; N off the 128-wide tile; ranges as
# k_order cuts them, run as separate programs (split) or summed in each tile's program
WS_CASES = {
    "m512-n1280-k1280-auto": (512, 1280, 1280, None, True),
    "m700-n200-k5120-r20": (700, 200, 5120, 20, True),  # ragged last row and column tiles
    "m1000-n512-k8192-r5": (1000, 512, 8192, 5, True),  # ragged ranges; 128-wide ring stages
    "m512-n128-k2048-r40": (512, 128, 2048, 40, True),  # 1-block chunks: ranges end mid-stage
    "m600-n256-k4096-r50": (600, 256, 4096, 50, True),  # the same in 128-wide stages
    "m2048-n1024-k5120-r4": (2048, 1024, 5120, 4, False),  # 4 ranges summed in each program
    "m640-n4096-k1024-r1": (640, 4096, 1024, 1, False),  # one range: the reference's K order
}


@pytest.mark.skipif(not GPU, reason="needs a Hopper GPU (Gluon does not run under the interpreter)")
@pytest.mark.parametrize("case", list(WS_CASES), ids=list(WS_CASES))
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("codes", [False, True], ids=["fold-pass", "fold-in-ring"])
def test_gluon_tiles_equal_triton_tiles(case, out_dtype, codes, monkeypatch):
    """fp8_linear with the Gluon tiles on the folded weight (folded by a pass over it, or by
    the kernel's converter from the e4m3 codes) against fp8_linear with the Triton tiles on the
    unfolded one: the same bits, every output written (NaN-poisoned buffers), on wide-range
    rows (a zero row, a zero block) and scales across the foldable range."""
    monkeypatch.setattr(T, "SQUARE_WS", True)
    monkeypatch.setattr(T, "SQUARE_WS_CODES", codes)
    m, n, k, splits, split = WS_CASES[case]
    g = torch.Generator(device="cuda").manual_seed(m + n)
    w = quantize_fp8(torch.randn(n, k, device="cuda", generator=g)
                     * torch.logspace(-4, 1, k, device="cuda") / k ** 0.5)
    w.weight[:32, :64] = 0
    x = (torch.randn(m, k, device="cuda", generator=g)
         * torch.logspace(3, -3, k, device="cuda")).to(torch.bfloat16)
    x[1] = 0
    x[2, :32] = 0
    assert T.foldable_scales(w.scale)
    plan = T._linear_plan(m, w.weight, splits, True, x.device)
    assert plan.workspace == split
    assert T._square_ws(plan, x, w.weight, w.scale, torch.empty(1, 1, device="cuda"))
    _against_triton_tiles(monkeypatch, "SQUARE_WS", x, w, splits, out_dtype)


# (kind, M, N, K, ranges): more items than a few programs, ragged row and column tiles, ranges
# summed in each tile or (split) items of their own; the square tiles at 64- and 128-wide ring
# stages, the swapped tiles at 128- and 64-row token tiles
TURN_CASES = {"square-m640-n4096-k1024-r1": ("square", 640, 4096, 1024, 1),
              "square-m300-n1000-k1280-r1": ("square", 300, 1000, 1280, 1),
              "square-m520-n640-k5120-r4": ("square", 520, 640, 5120, 4),
              "swap-m256-n32768-k1280-r1": ("swap", 256, 32768, 1280, 1),
              "swap-m100-n8200-k2048-r4": ("swap", 100, 8200, 2048, 4)}


@pytest.mark.skipif(not GPU, reason="needs a Hopper GPU (Gluon does not run under the interpreter)")
@pytest.mark.parametrize("case", list(TURN_CASES), ids=list(TURN_CASES))
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32, "split"])
def test_programs_take_items_in_turn_with_the_same_bits(case, out_dtype):
    """Persistent programs of the square and the swapped Gluon tiles (each taking items p, p
    + G, ... in turn, its ring running on across them: output tiles, or with split each
    tile's K ranges, their fp32 partials) give the bits of one program an item, for G = 1,
    2, 3, 7 and the default (one an SM), every output written (NaN-filled buffers); a bad
    program count is refused."""
    from dsv41attn.ops.linear import gluon as G
    kind, m, n, k, ranges = TURN_CASES[case]
    split = out_dtype == "split"
    if split and ranges == 1:
        pytest.skip("one range: nothing to split")
    out_dtype = torch.float32 if split else out_dtype
    g = torch.Generator(device="cuda").manual_seed(m + k)
    w = quantize_fp8(torch.randn(n, k, device="cuda", generator=g) / k ** 0.5)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    x[3] = 0
    order = T.k_order(1, k // 32, 1, ranges=ranges)
    if kind == "square":
        folded = T.e4m3_to_bf16(w.weight, w.scale)
        tiles = -(-m // G.BLOCK_M) * -(-n // G.BLOCK_N)
    else:
        tiles = -(-n // G.SWAP_BN) * -(-m // G.swap_tile(m)[0])
    assert tiles > 7

    def run(programs):
        out = torch.full((ranges, m, n) if split else (m, n), float("nan"), dtype=out_dtype,
                         device="cuda")
        if kind == "square":
            return G.fp8_values_gemm_ws(x, folded, out, order.chunks, order.ranges,
                                        order.granule, split=split, programs=programs)
        return G.fp8_swap_gemm_ws(x, w.weight, w.scale, out, order.chunks, order.ranges,
                                  order.granule, split=split, programs=programs)

    want = run(10 ** 6)  # one an item
    assert not want.isnan().any()
    bits = torch.int16 if out_dtype == torch.bfloat16 else torch.int32
    for programs in (1, 2, 3, 7, None):
        got = run(programs)
        diff = (got.view(bits) != want.view(bits)).sum().item()
        assert diff == 0, f"programs {programs}: {diff} of {got.numel()} outputs differ"
    with pytest.raises(ValueError, match="programs must be a positive int"):
        run(0)


@pytest.mark.skipif(not GPU, reason="needs a Hopper GPU (Gluon does not run under the interpreter)")
def test_gluon_tiles_with_rope_and_unfoldable_scales(monkeypatch):
    """The query's RoPE on the output (the Triton tiles turn it as they store; after the Gluon
    tiles rope_heads does): the same bits. A weight with one scale byte outside the foldable
    range runs the Triton tiles (and gives their bits)."""
    monkeypatch.setattr(T, "SQUARE_WS", True)
    m = 600
    _, w, x, rot = _rope_case(m, 1024, 1280, 9)
    _rope_against_triton_tiles(monkeypatch, "SQUARE_WS", w, x, rot)
    monkeypatch.setattr(T, "SQUARE_WS", True)
    bad = w.scale.clone()
    bad.view(torch.uint8)[0, 0] = T.FOLD_MAX_E + 1
    plan = T._linear_plan(m, w.weight, None, True, x.device)
    assert not T._square_ws(plan, x, w.weight, bad, torch.empty(1, 1, device="cuda"))
    y = T.fp8_linear(x, w.weight, bad)
    monkeypatch.setattr(T, "SQUARE_WS", False)
    assert torch.equal(y.view(torch.int16), T.fp8_linear(x, w.weight, bad).view(torch.int16))


def _compile_swap(bt: int, ranges: str, inflight: bool, triton_dir: str | None = None,
                  persist: bool = False, bits: bool = True) -> dict:
    """Compile _fp8_swap_ws_kernel for sm_90a at BT token rows a tile (as _compile), K in
    ranges run as programs of their own (split), summed in the program (in-program) or one
    range (one); block dots one at a time or (inflight) several per wait; one tile a program
    or (persist) tiles in turn; the weight's codes to bf16 by their bits or (not bits) by the
    conversion units; by this Triton or the one in triton_dir."""
    split = ranges == "split"
    chunks, nr, granule = {"split": (256, 100, 1), "in-program": (32, 5, 8),
                           "one": (32, 1, 8)}[ranges]
    import sm90_compile
    return sm90_compile.compile_probe(f"""
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
import dsv41attn.ops.linear.gluon as g
bt, stages = g.swap_tile({bt})
xl = gl.NVMMASharedLayout.get_default_for([bt, g.SWAP_BK], gl.bfloat16)
wl = gl.NVMMASharedLayout.get_default_for([g.SWAP_BN, g.SWAP_BK], gl.float8e4nv)
xd = TensorDescriptor(M(torch.bfloat16), [256, 8192], [8192, 1], [bt, g.SWAP_BK], xl)
wd = TensorDescriptor(M(torch.float8_e4m3fn), [5120, 8192], [8192, 1], [g.SWAP_BN, g.SWAP_BK],
                      wl)
k = g._fp8_swap_ws_kernel.warmup(wd, xd, M(torch.bfloat16), M(torch.uint8), 256, 5120, 256,
    160, 8192 // g.SWAP_BK, {chunks}, {nr}, GRANULE={granule}, STAGES=stages, SPLIT={split},
    INFLIGHT={inflight}, OUT_BF16=not {split}, PERSIST={persist}, BITS={bits},
    CONSUMER_REGS=g.CONSUMER_REGS,
    PRODUCER_REGS=g.PRODUCER_REGS, num_warps=4, grid=(1,))
ptx = k.asm["ptx"]
print(json.dumps({{"shared": int(k.metadata.shared), "res": s._resources(k.asm["cubin"], True),
                  "wgmma": ptx.count("wgmma.mma_async"), "setmaxnreg": ptx.count("setmaxnreg"),
                  "tma": ptx.count("cp.async.bulk.tensor"),
                  "neg_zero": ptx.count("0f80000000")}}))
""", triton_dir)


@pytest.mark.parametrize("triton_dir", sm90_compile.TRITONS,
                         ids=lambda d: "this" if d is None else os.path.basename(d))
@pytest.mark.parametrize("inflight", [False, True], ids=["one-dot", "inflight"])
@pytest.mark.parametrize("ranges", ["in-program", "split", "one"])
@pytest.mark.parametrize("bt", [16, 32, 64, 128])
def test_swap_tiles_compile_warp_specialized_for_sm90(bt, ranges, inflight, triton_dir):
    """The swapped decode tiles lower for an H100/H200 at each token-tile width, the ranges
    summed in the program, one a program, or one range, block dots one per wait or several
    in flight (SWAP_INFLIGHT): four wgmmas a ring stage (the weight's codes as the register
    operand), register budgets per partition, the ring within shared memory, no spills, sums
    from -0; by this Triton and by the GPU image's (its Gluon rejected a layout taken from a
    tensor, which this one took)."""
    pytest.importorskip("triton.experimental.gluon")
    r = _compile_swap(bt, ranges, inflight, triton_dir)
    assert r["wgmma"] > 0 and r["setmaxnreg"] > 0 and r["tma"] > 0, r
    assert r["shared"] <= 232448, r
    regs, stack, local, _ = r["res"]
    # (RANGES is never specialised: folded at 1, Triton 3.9's ptxas spilled 72 bytes at BT 128)
    assert stack == 0 and local == 0, r  # no spills
    assert r["neg_zero"] > 0, r


@pytest.mark.parametrize("triton_dir", sm90_compile.TRITONS,
                         ids=lambda d: "this" if d is None else os.path.basename(d))
@pytest.mark.parametrize("ranges", ["in-program", "one", "split"])
@pytest.mark.parametrize("bt", [64, 128])
def test_swap_tiles_in_turn_compile_for_sm90(bt, ranges, triton_dir):
    """Programs taking the swapped tiles in turn (64- and 128-row token tiles), or (split)
    each tile's K ranges as items of their own, lower for an H100/H200 with no spills: the
    item loop's live values fit beside the accumulators."""
    pytest.importorskip("triton.experimental.gluon")
    r = _compile_swap(bt, ranges, True, triton_dir, persist=True)
    assert r["wgmma"] > 0 and r["setmaxnreg"] > 0 and r["tma"] > 0, r
    assert r["shared"] <= 232448, r
    regs, stack, local, _ = r["res"]
    assert stack == 0 and local == 0, r  # no spills


# (M, N, K, num_splits): token rows past 16 that the decode kernel's VALUES tiles take (the
# wide tiles of a large weight, the 17-64-row tiles, the small weights' wide tiles); ranges
# as programs of their own where the swapped tiles leave SMs idle, else summed in the program
SWAP_CASES = {
    "m1-n1280-k5120-auto": (1, 1280, 5120, None),  # 1-16 rows: x's bf16 values, not fp16
    "m5-n32768-k1280-auto": (5, 32768, 1280, None),
    "m16-n5120-k8192-auto": (16, 5120, 8192, None),
    "m17-n4096-k4096-auto": (17, 4096, 4096, None),
    "m33-n1280-k5120-auto": (33, 1280, 5120, None),  # wq_a's shape: split ranges
    "m64-n5120-k8192-auto": (64, 5120, 8192, None),  # wo_b's
    "m100-n8200-k2048-r7": (100, 8200, 2048, 7),  # ragged N (and its last scale row), ranges
    "m40-n512-k2048-r40": (40, 512, 2048, 40),  # 1-block chunks: ranges end inside a stage
    "m128-n32768-k1280-auto": (128, 32768, 1280, None),  # wq_b's: one range
    "m256-n16384-k2048-r4": (256, 16384, 2048, 4),  # 4 ranges summed in each program
    "m200-n5120-k8192-auto": (200, 5120, 8192, None),  # two token tiles, the last ragged
}


@pytest.mark.skipif(not GPU, reason="needs a Hopper GPU (Gluon does not run under the interpreter)")
@pytest.mark.parametrize("case", list(SWAP_CASES), ids=list(SWAP_CASES))
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("variant", ["default", "narrowed-inflight", "split-rounds",
                                     "rounds-off"])
def test_swap_tiles_equal_triton_tiles(case, out_dtype, variant, monkeypatch):
    """fp8_linear with the Gluon swapped tiles against the Triton decode kernel's tiles they
    replace (at 1-16 rows those read x's fp16 values, these its bf16 values): the same bits,
    every output written (NaN-poisoned buffers), on wide-range rows (a zero row, a zero
    block), weight scales over a wide range. The default tiles (the widest token tile, one
    block dot per wait), the variants SWAP_NARROW (narrower token tiles where the widest
    would leave SMs idle: other cases sum K's ranges in the program) with SWAP_INFLIGHT
    (several block dots per wait), and SWAP_SPLIT_ROUNDS on a 64-SM count, on (m200's 80 tiles
    then split their 3 ranges as items) and off (they sum them in the program)."""
    from dsv41attn.ops.linear import gluon as G
    m, n, k, splits = SWAP_CASES[case]
    if variant in ("split-rounds", "rounds-off"):
        monkeypatch.setattr(T, "SWAP_SPLIT_ROUNDS", variant == "split-rounds")
        monkeypatch.setattr(T, "sm_count", lambda device: 64)
    monkeypatch.setattr(T, "SWAP_WS_MIN_M", 1)  # every case on them, whatever the default
    monkeypatch.setattr(T, "SWAP_WS_LONG_MIN_M", 1)
    monkeypatch.setattr(T, "SWAP_WS_MIN_BYTES", 0)
    monkeypatch.setattr(G, "SWAP_NARROW", variant != "default")
    monkeypatch.setattr(G, "SWAP_INFLIGHT", variant != "default")
    g = torch.Generator(device="cuda").manual_seed(m + n)
    w = quantize_fp8(torch.randn(n, k, device="cuda", generator=g)
                     * torch.logspace(-8, 8, k, device="cuda") / k ** 0.5)
    w.weight[:32, :64] = 0
    x = (torch.randn(m, k, device="cuda", generator=g)
         * torch.logspace(3, -3, k, device="cuda")).to(torch.bfloat16)
    x[1:2] = 0  # (rows past M: nothing)
    x[2:3, :32] = 0
    monkeypatch.setattr(T, "SWAP_WS", True)
    plan = T._linear_plan(m, w.weight, splits, True, x.device)
    assert plan.swap and plan.prescaled, plan
    assert T._swap_ws(plan, x, w.weight, torch.empty(1, 1, device="cuda"))
    _against_triton_tiles(monkeypatch, "SWAP_WS", x, w, splits, out_dtype)


@pytest.mark.skipif(not GPU, reason="needs a Hopper GPU (Gluon does not run under the interpreter)")
@pytest.mark.parametrize("m", [40, 256])
def test_codes_by_their_bits_give_the_conversion_units_bits(m, monkeypatch):
    """A weight holding every e4m3 code but the NaNs (zeros of both signs, subnormals, the
    largest), under scales over a wide range: the swapped Gluon tiles and the Triton decode
    kernel's VALUES tiles, each reading the codes by their bits (SWAP_CODE_BITS,
    VALUES_CODE_BITS) and by the conversion units, all give the same bits; a weight with a
    NaN code never takes the bits (NaN outputs, the conversion units' bits)."""
    from dsv41attn.ops.linear import gluon as G
    n, k = 4096, 1280
    monkeypatch.setattr(T, "SWAP_WS_MIN_M", 1)
    monkeypatch.setattr(T, "SWAP_WS_LONG_MIN_M", 1)
    monkeypatch.setattr(T, "SWAP_WS_MIN_BYTES", 0)
    g = torch.Generator(device="cuda").manual_seed(m)
    codes = torch.arange(256, dtype=torch.uint8, device="cuda")
    codes = codes[(codes & 0x7F) != 0x7F]
    weight = codes[torch.randint(0, codes.numel(), (n, k), device="cuda", generator=g)]
    weight[0, :codes.numel()] = codes  # each code at least once in one row
    weight = weight.view(torch.float8_e4m3fn)
    scale = _e8m0(torch.randint(100, 140, (n // 32, k // 32), device="cuda", generator=g))
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    x[1] = 0

    def run(w, swap, bits):
        monkeypatch.setattr(T, "SWAP_WS", swap)
        monkeypatch.setattr(G, "SWAP_CODE_BITS", bits)
        monkeypatch.setattr(T, "VALUES_CODE_BITS", bits)
        plan = T._linear_plan(m, w, None, True, x.device)
        assert plan.swap and plan.prescaled, plan
        assert T._swap_ws(plan, x, w, torch.empty(1, 1, device="cuda")) == \
            (swap and (not bits or T.nan_free_codes(w)))
        assert T._values_code_bits(plan, w) == (bits and T.nan_free_codes(w))
        return T.fp8_linear(x, w, scale).view(torch.int16)

    want = run(weight, False, False)
    for swap, bits in ((False, True), (True, False), (True, True)):
        assert torch.equal(run(weight, swap, bits), want), (swap, bits)
    bad = weight.clone()
    bad.view(torch.uint8)[7, 100] = 0xFF
    want = run(bad, False, False)
    assert want.view(torch.bfloat16)[:, 7].isnan().all()
    assert not want.view(torch.bfloat16)[:, 8].isnan().any()
    for swap in (False, True):
        assert torch.equal(run(bad, swap, True), want), swap


@pytest.mark.skipif(not GPU, reason="needs a Hopper GPU (Gluon does not run under the interpreter)")
def test_swap_tiles_with_rope_and_in_a_graph(monkeypatch):
    """The query's RoPE on the swapped tiles' output (rope_heads after them; the Triton tiles
    turn it as they store): the same bits; and the same call captured in a CUDA graph replays
    new inputs to the bits of an eager call."""
    m, k = 48, 1280
    g, w, x, rot = _rope_case(m, 4096, k, 11)
    monkeypatch.setattr(T, "SWAP_WS", True)
    monkeypatch.setattr(T, "SWAP_WS_MIN_M", 1)
    monkeypatch.setattr(T, "SWAP_WS_LONG_MIN_M", 1)
    monkeypatch.setattr(T, "SWAP_WS_MIN_BYTES", 0)
    _rope_against_triton_tiles(monkeypatch, "SWAP_WS", w, x, rot)
    monkeypatch.setattr(T, "SWAP_WS", True)
    xs = x.clone()
    graph = torch.cuda.CUDAGraph()
    T.fp8_linear(xs, w.weight, w.scale)  # compiled and planned before the capture
    with torch.cuda.graph(graph):
        ys = T.fp8_linear(xs, w.weight, w.scale)
    x2 = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    xs.copy_(x2)
    graph.replay()
    assert torch.equal(ys.view(torch.int16), T.fp8_linear(x2, w.weight, w.scale).view(torch.int16))


def test_swap_tiles_only_for_the_large_weights(monkeypatch):
    """On a Hopper GPU (stood in for) the Gluon swapped tiles take the weights of at least
    SWAP_WS_MIN_BYTES (wq_b's and wo_b's 42 MB) and leave the small ones (the indexer's wq_b,
    where they lost to the Triton wide tiles) to the Triton tiles, and nothing when SWAP_WS
    is off or K is not whole ring stages; from 65 rows, 33 where K is long."""
    if T.fp8_swap_gemm_ws is None:
        pytest.skip("this Triton has no Gluon")
    monkeypatch.setattr(T, "is_hopper", lambda device: True)
    monkeypatch.setattr(T, "interpreting", lambda: False)
    dev = torch.device("cpu")
    assert T._swap_tiles(dev, 32768, 1280) and T._swap_tiles(dev, 5120, 8192)
    assert not T._swap_tiles(dev, 4096, 1280) and not T._swap_tiles(dev, 1280, 5120)
    assert not T._swap_tiles(dev, 32768, 1280 + 32)  # K off the 128-wide stages
    # from 65 rows, or 33 for a long K (wo_b's 8192, not wq_b's 1280)
    assert T._swap_min_m(1280) == 65 and T._swap_min_m(5120) == T._swap_min_m(8192) == 33
    monkeypatch.setattr(T, "SWAP_WS_MIN_BYTES", 0)
    assert T._swap_tiles(dev, 4096, 1280)
    monkeypatch.setattr(T, "SWAP_WS", False)
    assert not T._swap_tiles(dev, 32768, 1280)


def test_swap_plan_and_tiles():
    """The plan's side of the swapped tiles (no GPU needed): below SWAP_WS_MIN_M nothing
    changes; given narrow_values, 1-16 rows read x's bf16 values on the same swapped tiles and
    K order (the same bits); the token tile is the narrowest power of two from 16 holding M,
    at most 128, narrowed (SWAP_NARROW) to no less than 32 while the tiles leave SMs idle;
    the ring fits shared memory; on the CPU the Gluon tiles never run."""
    from dsv41attn.ops.linear import gluon as G
    n, kb, sms = 32768, 40, 132
    for m in (1, 5, 16):
        plain = T._linear_shape_plan(m, n, kb, sms, None, True, True)
        vals = T._linear_shape_plan(m, n, kb, sms, None, True, True, narrow_values=True)
        assert plain.swap and not plain.prescaled and T._x_form(plain) != "values"
        assert vals.swap and vals.prescaled and T._x_form(vals) == "values"
        assert vals.order == plain.order
    assert [G.swap_tile(m)[0] for m in (1, 16, 17, 33, 64, 65, 128, 129, 511)] == \
        [16, 16, 32, 64, 64, 128, 128, 128, 128]
    for bt in (16, 32, 64, 128):
        stages = G.swap_tile(bt)[1]
        assert 2 <= stages <= 8
        assert stages * (G.SWAP_BN * G.SWAP_BK + bt * G.SWAP_BK * 2) <= G.SWAP_SMEM
    assert G.swap_tile(256, 32768, sms)[0] == 128  # 512 tiles: no need to narrow
    narrow = G.SWAP_NARROW
    try:
        G.SWAP_NARROW = True
        assert G.swap_tile(256, 5120, sms)[0] == 64  # 40 x 2 tiles -> 40 x 4
        assert G.swap_tile(128, 1280, sms)[0] == 32  # never below 32
    finally:
        G.SWAP_NARROW = narrow
    x = torch.zeros(256, 1280, dtype=torch.bfloat16)
    w = torch.zeros(32768, 1280, dtype=torch.float8_e4m3fn)
    plan = T._linear_shape_plan(256, n, kb, sms, None, True, True)
    assert plan.swap and plan.prescaled
    assert not T._swap_ws(plan, x, w, torch.empty(1, 1))  # CPU: the Triton tiles
