"""Triton inverse RoPE + grouped wo_a (SPEC §4.6) against the reference and an fp64 oracle;
runs under TRITON_INTERPRET=1 on the CPU, and on a GPU when there is one."""
import pytest
import torch

pytest.importorskip("triton")

from dsv41attn import preset
from dsv41attn.checkpoint import Fp8Weight, quantize_fp8
from dsv41attn.ops.common.rope import apply_rope, rope_frequencies, rope_rotations
from dsv41attn.ops.common.triton import rope_heads
from dsv41attn.ops.linear.triton import dense_linear
from dsv41attn.ops.output import reference as R
from dsv41attn.ops.output import triton as T

DEV = "cuda" if torch.cuda.is_available() else "cpu"

# (H, D, rope dims, groups, Rk, rope config): V4.1's 64 rope dims on small heads; the tiny
# preset's dims; odd sizes (K per group 240 and Rk 37: partial K tiles and 32-blocks, and
# scale blocks shared by two groups' rows).
SHAPES = {
    "rope64": (4, 128, 64, 2, 40, "v41-flash"),
    "tiny": (8, 32, 8, 2, 16, "tiny"),
    "odd": (6, 80, 64, 2, 37, "v41-flash"),
    "rk64": (4, 128, 64, 2, 64, "v41-flash"),  # Rk a multiple of 32: wo_b's blocks in a group
}


def _inputs(shape: str, n: int, seed: int):
    """o [n, H, D] bf16 and rot [n, R/2] complex64 at scattered positions (YaRN layer freqs)."""
    h, d, r, groups, rk, cfg_name = SHAPES[shape]
    cfg = preset(cfg_name)
    assert cfg.rope_head_dim == r
    g = torch.Generator().manual_seed(seed)
    o = (torch.randn(n, h, d, generator=g) * 2).bfloat16()
    positions = torch.randint(0, 100_000, (n,), generator=g)
    freqs = rope_frequencies(cfg, cfg.layer(1))
    return o, rope_rotations(freqs, positions), groups, rk


def _weight(shape: str, kind: str, seed: int) -> torch.Tensor | Fp8Weight:
    """wo_a [G*Rk, H*D/G]: the checkpoint's fp8 form (blocks of scattered magnitude, so many
    scale exponents), or a general bf16 matrix (values no fp8 holds)."""
    h, d, _, groups, rk, _ = SHAPES[shape]
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(groups * rk, h * d // groups, generator=g) / (h * d // groups) ** 0.5
    if kind == "bf16":
        return w.bfloat16()
    blocks = 2.0 ** torch.randint(-12, 6, (-(-w.shape[0] // 32), -(-w.shape[1] // 32)),
                                  generator=g)
    return quantize_fp8(w * blocks.repeat_interleave(32, 0).repeat_interleave(32, 1)
                        [:w.shape[0], :w.shape[1]])


def _dense(w) -> torch.Tensor:
    return w.dequantize() if isinstance(w, Fp8Weight) else w


def _run_triton(o, rot, w, groups, rk, **kw) -> torch.Tensor:
    """The kernel into a NaN-poisoned output, checked fully written; returns it on the CPU."""
    out = torch.full((o.shape[0], groups * rk), float("nan"), dtype=torch.bfloat16, device=DEV)
    got = T.inverse_rope_wo_a(o.to(DEV), rot.to(DEV), w.to(DEV), groups, out=out, **kw)
    assert got.data_ptr() == out.data_ptr() and not torch.isnan(out).any()
    return out.cpu()


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The bf16 spacing at |x| (fp64), normal range."""
    _, e = torch.frexp(x.abs().clamp_min(2.0 ** -126))
    return torch.ldexp(torch.ones_like(x), e - 8)


@pytest.mark.parametrize("kind", ["fp8", "bf16"])
@pytest.mark.parametrize("n", [1, 3, 17])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_vs_fp64_oracle(shape, n, kind):
    o, rot, groups, rk = _inputs(shape, n, seed=n)
    w = _weight(shape, kind, seed=n + 100)
    ref = R.inverse_rope_wo_a(o, rot, w, groups)
    got = _run_triton(o, rot, w, groups, rk)
    assert got.dtype == torch.bfloat16 and got.shape == ref.shape == (n, groups * rk)
    # the oracle: the same bf16 operands (rotated o, dequantised wo_a), summed in fp64
    a = apply_rope(o, rot.unsqueeze(1), inverse=True).double().reshape(n, groups, -1)
    oracle = torch.einsum("ngk,grk->ngr", a, _dense(w).double().view(groups, rk, -1)).flatten(1)
    ref_err = (ref.double() - oracle).abs()
    err = (got.double() - oracle).abs()
    assert (err <= ref_err + _bf16_ulp(oracle)).all(), (err - ref_err).max()
    # both round nearly the same fp32 sums: a truncating or misplaced rounding shows up here
    assert (got != ref).float().mean() <= 0.02


@pytest.mark.parametrize("shape, kind, splits", [("rope64", "fp8", 1), ("rope64", "bf16", 2),
                                                ("odd", "fp8", 2)])
def test_inverse_rope_bit_exact(shape, kind, splits):
    """With wo_a a scaled permutation per group, u is the rotated o itself (times 2^-3): every
    rotated value the kernel fed to its GEMM must equal the reference's, bit for bit."""
    n = 17
    o, rot, groups, _ = _inputs(shape, n, seed=7)
    k = o.shape[1] * o.shape[2] // groups
    g = torch.Generator().manual_seed(8)
    perms = [torch.randperm(k, generator=g) for _ in range(groups)]
    w32 = torch.zeros(groups * k, k)
    for gi, p in enumerate(perms):
        w32[gi * k + torch.arange(k), p] = 0.125
    w = quantize_fp8(w32) if kind == "fp8" else w32.bfloat16()
    assert torch.equal(_dense(w).float(), w32)  # the weight is exactly the scaled permutation
    got = _run_triton(o, rot, w, groups, k, num_splits=splits)
    rotated = apply_rope(o, rot.unsqueeze(1), inverse=True).reshape(n, groups, k)
    want = torch.stack([rotated[:, gi, p] for gi, p in enumerate(perms)], 1).flatten(1) / 8
    assert torch.equal(got, want)
    assert not torch.equal(rotated, o.reshape(n, groups, k))  # the rotation did something
    assert torch.equal(got, R.inverse_rope_wo_a(o, rot, w, groups))


@pytest.mark.parametrize("shape, splits", [("rope64", None), ("odd", 2)])
def test_fp8_and_bf16_paths_identical(shape, splits):
    o, rot, groups, rk = _inputs(shape, 17, seed=11)
    w8 = _weight(shape, "fp8", seed=12)
    a = _run_triton(o, rot, w8, groups, rk, num_splits=splits)
    b = _run_triton(o, rot, w8.dequantize(), groups, rk, num_splits=splits)
    assert torch.equal(a, b)


def test_fused_max_rows():
    """fused_max_rows picks the path: N above it runs rope_heads + dense_linear's grouped GEMM
    (the default 0: always, unless num_splits is given), N at or below it the fused kernel.
    Either path stays as close to the reference as test_vs_fp64_oracle's inputs do; the
    default is exactly rope_heads then dense_linear, whatever N."""
    n = 3
    o, rot, groups, rk = _inputs("rope64", n, seed=n)
    w = _weight("rope64", "fp8", seed=n + 100)
    ref = R.inverse_rope_wo_a(o, rot, w, groups)
    default = _run_triton(o, rot, w, groups, rk)
    fused = _run_triton(o, rot, w, groups, rk, fused_max_rows=n)
    for got in (default, fused):
        assert (got != ref).float().mean() <= 0.02
    rotated = rope_heads(o.to(DEV), rot.to(DEV), inverse=True).view(n, -1)
    assert torch.equal(default, dense_linear(rotated, w.dequantize().to(DEV), groups).cpu())
    assert torch.equal(_run_triton(o[1:2], rot[1:2], w, groups, rk), default[1:2])  # N-invariant


def test_prepare_wo_a_keeps_the_exact_codes():
    """prepare_wo_a: a bf16 wo_a that an fp8 checkpoint's weight dequantises to gets its codes
    back (their dequantisation is wo_a, bit for bit); one with values no block-scaled e4m3
    holds, or a NaN, gets none; an Fp8Weight needs none; the reference prepares nothing."""
    w8 = _weight("odd", "fp8", seed=21)
    w16 = w8.dequantize()
    codes = T.prepare_wo_a(w16)["codes"]
    assert codes.serves(w16) and codes.nbytes == w8.weight.numel() + w8.scale.numel()
    assert torch.equal(codes.fp8.dequantize().view(torch.int16), w16.view(torch.int16))
    assert T.prepare_wo_a(_weight("odd", "bf16", seed=21)) == {}
    poisoned = w16.clone()
    poisoned[3, 5] = float("nan")
    assert T.prepare_wo_a(poisoned) == {}
    assert T.prepare_wo_a(w8) == {} and R.prepare_wo_a(w16) == {}


def test_prepared_codes_say_whether_they_run_rescaled(monkeypatch):
    """prepare_wo_a notes whether the codes' scales allow dense_fp8_linear's rescaled tiles
    (rescalable_scales), and the op passes that on. Weights prepared again in place keep their
    WoACodes only while that holds the same: a block at 2^-100 beside one at 2^27 (scale bytes
    19 and 146, 127 apart along K) gives new codes, which a graph that captured the old ones
    refuses (it replays only the copies it read)."""
    g = torch.Generator().manual_seed(31)
    w16 = quantize_fp8(torch.randn(64, 96, generator=g)).dequantize().to(DEV)
    kw = T.prepare_wo_a(w16)
    first = kw["codes"]
    assert first.rescaled
    seen = []
    real = T.dense_fp8_linear
    monkeypatch.setattr(T, "dense_fp8_linear",
                        lambda *a, **k: seen.append(k.get("rescaled")) or real(*a, **k))
    o = torch.randn(2, 2, 96, generator=g).bfloat16().to(DEV)
    T.inverse_rope_wo_a(o, None, w16, 2, codes=first)
    assert seen == [True]
    wide = w16.clone()
    wide[:32, :32] = 2.0 ** -100
    wide[:32, 32:64] = 2.0 ** 27
    w16.copy_(wide)  # in place
    again = T.prepare_wo_a(w16, previous=first)["codes"]
    assert again is not first and not again.rescaled and again.serves(w16)
    assert torch.equal(again.fp8.dequantize().view(torch.int16), w16.view(torch.int16))
    T.inverse_rope_wo_a(o, None, w16, 2, codes=again)
    assert seen == [True, False]
    w16.copy_(quantize_fp8(torch.randn(64, 96, generator=g)).dequantize().to(DEV))
    third = T.prepare_wo_a(w16, previous=again)["codes"]
    assert third is not again and third.rescaled


@pytest.mark.parametrize("fixed_order", [True, False], ids=["fixed", "step-sized"])
def test_codes_path_gives_the_bf16_paths_bits(fixed_order, monkeypatch):
    """Up to the mode's WO_A_(STEP_)CODES_MAX_ROWS rows with the prepared codes the op runs
    dense_fp8_linear on them (spied), with the fixed-order bf16 path's bits; past it the bf16
    path; codes that no longer serve wo_a (written in place) are ignored, so the new weight's
    output comes out."""
    calls = []
    real = T.dense_fp8_linear
    monkeypatch.setattr(T, "dense_fp8_linear", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(T, "WO_A_CODES_MAX_ROWS" if fixed_order else "WO_A_STEP_CODES_MAX_ROWS",
                        4)
    o, rot, groups, rk = _inputs("odd", 6, seed=23)
    w16 = _weight("odd", "fp8", seed=24).dequantize().to(DEV)
    kw = T.prepare_wo_a(w16)
    for n in (1, 4, 6):
        want = _run_triton(o[:n], rot[:n], w16, groups, rk)  # fixed order, bf16
        before = len(calls)
        got = _run_triton(o[:n], rot[:n], w16, groups, rk, fixed_order=fixed_order, **kw)
        assert len(calls) - before == (n <= 4), n
        if n <= 4 or fixed_order:
            assert torch.equal(got, want), n
    w16.mul_(2)  # in place: the codes are stale
    assert not kw["codes"].serves(w16)
    before = len(calls)
    got = _run_triton(o[:2], rot[:2], w16, groups, rk, **kw)
    assert len(calls) == before and torch.equal(got, _run_triton(o[:2], rot[:2], w16, groups, rk))
    with pytest.raises(TypeError, match="WoACodes"):
        T.inverse_rope_wo_a(o.to(DEV), rot.to(DEV), w16, groups, codes=kw["codes"].fp8)


@pytest.mark.parametrize("fixed_order", [True, False], ids=["fixed", "step-sized"])
def test_in_place_turns_o_and_gives_the_same_bits(fixed_order):
    """in_place (the layer's o is its own): the same output as the copying form, o itself left
    holding its inverse rotation (nope dims untouched); the reference takes the flag and
    leaves o alone."""
    n = 5
    o, rot, groups, rk = _inputs("rope64", n, seed=7)
    w = _weight("rope64", "fp8", seed=8)
    want = _run_triton(o, rot, w, groups, rk, fixed_order=fixed_order)
    o_dev = o.clone().to(DEV)
    out = torch.empty(n, groups * rk, dtype=torch.bfloat16, device=DEV)
    T.inverse_rope_wo_a(o_dev, rot.to(DEV), w.to(DEV), groups, out=out,
                        fixed_order=fixed_order, in_place=True)
    assert torch.equal(out.cpu(), want)
    turned = rope_heads(o.clone().to(DEV), rot.to(DEV), inverse=True)
    assert torch.equal(o_dev.view(torch.int16), turned.view(torch.int16))
    assert not torch.equal(o_dev.cpu(), o)
    o_ref = o.clone()
    assert torch.equal(R.inverse_rope_wo_a(o_ref, rot, w, groups, in_place=True),
                       R.inverse_rope_wo_a(o, rot, w, groups))
    assert torch.equal(o_ref, o)


@pytest.mark.parametrize("fixed_order", [True, False], ids=["fixed", "step-sized"])
def test_rot_none_projects_an_o_turned_back_already(fixed_order):
    """rot None (the attention turned o back itself: sparse_attn_paged's out_rot): wo_a alone,
    the same bits as the op given the unturned o and rot, on both backends; with num_splits
    (the fused kernel's form) too, which then leaves the fused kernel."""
    n = 5
    o, rot, groups, rk = _inputs("rope64", n, seed=9)
    w = _weight("rope64", "fp8", seed=10)
    turned = rope_heads(o.to(DEV), rot.to(DEV), inverse=True)
    want = _run_triton(o, rot, w, groups, rk, fixed_order=fixed_order)
    got = T.inverse_rope_wo_a(turned, None, w.to(DEV), groups, fixed_order=fixed_order)
    assert torch.equal(got.cpu(), want)
    assert torch.equal(T.inverse_rope_wo_a(turned, None, w.to(DEV), groups, num_splits=2,
                                           fixed_order=fixed_order).cpu(), want)
    assert torch.equal(R.inverse_rope_wo_a(turned.cpu(), None, w, groups),
                       R.inverse_rope_wo_a(o, rot, w, groups))
    with pytest.raises(ValueError, match="rot must be None or"):
        R.inverse_rope_wo_a(o, rot.real, w, groups)


def test_reference_is_the_layer_lines():
    """reference(o flattened over (b, m)) is §4.6's lines in the layer, on [b, m, ...]."""
    b, m = 2, 3
    o, rot, groups, rk = _inputs("tiny", m, seed=3)
    o = torch.stack([o, o.flip(0)])  # [b, m, H, D]
    w = _weight("tiny", "fp8", seed=4)
    rot4 = rot.unsqueeze(1)  # [m, 1, R/2]
    lines = apply_rope(o, rot4, inverse=True)
    lines = torch.einsum("bmgd,grd->bmgr", lines.reshape(b, m, groups, -1),
                         w.dequantize().view(groups, rk, -1)).flatten(2)
    got = R.inverse_rope_wo_a(o.flatten(0, 1), rot.repeat(b, 1), w, groups)
    assert torch.equal(got, lines.flatten(0, 1))


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_bad_inputs(impl):
    fn = R.inverse_rope_wo_a if impl == "reference" else T.inverse_rope_wo_a
    o, rot, groups, rk = _inputs("tiny", 3, seed=5)
    w = _weight("tiny", "fp8", seed=6)
    o, rot, w = o.to(DEV), rot.to(DEV), w.to(DEV)
    wd = w.dequantize()
    bad = [
        {"o": o.float()}, {"o": o[0]}, {"rot": rot.to(torch.complex128)}, {"rot": rot[:2]},
        {"rot": torch.ones(3, 17, dtype=torch.complex64, device=DEV)},  # R/2 > D/2
        {"groups": 3}, {"groups": 0}, {"groups": 2.0}, {"wo_a": wd.float()},
        {"wo_a": wd[:, :-1]}, {"wo_a": wd[:-1]},
        {"out": torch.empty(3, groups * rk + 1, dtype=torch.bfloat16, device=DEV)},
        {"out": torch.empty(3, groups * rk, device=DEV)},
    ]
    if impl == "triton":
        bad += [{"num_splits": 0}, {"fused_max_rows": 1.5}, {"fused_max_rows": None}]
    good = {"o": o, "rot": rot, "wo_a": w, "groups": groups}
    for change in bad:
        with pytest.raises(ValueError):
            fn(**(good | change))
    if DEV == "cuda":
        with pytest.raises(ValueError):
            fn(o, rot.cpu(), w, groups)


@pytest.mark.parametrize("fixed_order", [True, False], ids=["fixed", "step-sized"])
def test_output_projection_quantises_for_wo_b_inside_wo_a(fixed_order, monkeypatch):
    """output_projection = fp8_linear(inverse_rope_wo_a(...), wo_b), bit for bit, with
    QUANT_IN_WO_A on and off, and as the reference composes it. On: where wo_a runs from its
    codes and wo_b reads act_quant's f16 form, wo_a's kernel hands wo_b its input quantised
    (fp8_linear never runs; spied), including a row whose wo_a output holds an infinity (its
    wo_b row NaN, as fp8_linear's); past the codes' rows (or with the fused kernel) the two
    ops as before. inverse_rope_wo_a refuses quant_out where it would not fill it."""
    from dsv41attn.ops.linear import reference as LR
    from dsv41attn.ops.linear import triton as LT
    o, rot, groups, rk = _inputs("rk64", 7, seed=31)
    o[6, 0, :4] = 3e38  # its wo_a outputs overflow to infinities: a NaN scale for wo_b
    g = torch.Generator().manual_seed(32)
    w16 = _weight("rk64", "fp8", seed=33).dequantize()
    wo_b = quantize_fp8(torch.randn(96, groups * rk, generator=g))
    o, rot, w16 = o.to(DEV), rot.to(DEV), w16.to(DEV)
    wb, sb = wo_b.weight.to(DEV), wo_b.scale.to(DEV)
    kw = dict(T.prepare_wo_a(w16), fixed_order=fixed_order)
    limit = T.WO_A_CODES_MAX_ROWS if fixed_order else T.WO_A_STEP_CODES_MAX_ROWS
    plain = []
    real = T.fp8_linear
    monkeypatch.setattr(T, "fp8_linear", lambda *a, **k: plain.append(1) or real(*a, **k))
    for n in (1, 5, 7):
        u = T.inverse_rope_wo_a(o[:n], rot[:n], w16, groups, **kw)
        want = LT.fp8_linear(u, wb, sb)
        assert LT.fp8_input_form(n, wb) == "f16" and n <= limit
        for on in (False, True):
            monkeypatch.setattr(T, "QUANT_IN_WO_A", on)
            before = len(plain)
            got = T.output_projection(o[:n], rot[:n], w16, groups, wb, sb, **kw)
            assert len(plain) - before == (0 if on else 1), (n, on)
            assert torch.equal(got.isnan(), want.isnan()), (n, on)
            assert torch.equal(got.nan_to_num().view(torch.int16),
                               want.nan_to_num().view(torch.int16)), (n, on)
        if n == 7:
            assert want[6].isnan().all() and not want[:6].isnan().any()
    ref = R.output_projection(o[:5].cpu(), rot[:5].cpu(), w16.cpu(), groups, wo_b.weight,
                              wo_b.scale)
    assert torch.equal(ref, LR.fp8_linear(R.inverse_rope_wo_a(o[:5].cpu(), rot[:5].cpu(),
                                                               w16.cpu(), groups),
                                           wo_b.weight, wo_b.scale))
    monkeypatch.setattr(T, "QUANT_IN_WO_A", True)
    monkeypatch.setattr(T, "WO_A_CODES_MAX_ROWS" if fixed_order else "WO_A_STEP_CODES_MAX_ROWS",
                        4)
    before = len(plain)
    got = T.output_projection(o[:5], rot[:5], w16, groups, wb, sb, **kw)  # past the codes
    assert len(plain) - before == 1
    assert torch.equal(got, LT.fp8_linear(T.inverse_rope_wo_a(o[:5], rot[:5], w16, groups,
                                                               **kw), wb, sb))
    q = (torch.empty(5, groups * rk, dtype=torch.float16, device=DEV),
         torch.empty(5, groups * rk // 32, device=DEV))
    with pytest.raises(ValueError, match="quant_out"):
        T.inverse_rope_wo_a(o[:5], rot[:5], w16, groups, quant_out=q, **kw)


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["step-sized", "invariant"])
def test_layers_quantise_wo_bs_input_inside_wo_a_with_the_same_bits(batch_invariant,
                                                                    monkeypatch):
    """A triton-backend stack of tiny layers (wo_a's 32-row groups, so wo_b's 32-blocks fit a
    group) through a prefill and decode steps: with QUANT_IN_WO_A every output and every cache
    byte is the bits of the two-op path, and the fused path ran (spied) in the decode steps
    only (the prefill's 21 rows are past wo_b's f16 form, and in the step-sized mode past
    wo_a's codes)."""
    from dsv41attn import AttentionStack, random_layer_weights
    from dsv41attn.ops.linear import triton as LT
    cfg = preset("tiny").replace(o_lora_rank=32)
    layers = [0, 1, 2]  # SWA, the r = 2 source and its reuser
    weights = {L: random_layer_weights(cfg, L, seed=41).to(DEV) for L in layers}
    stack = AttentionStack(cfg, weights, "triton", batch_invariant=batch_invariant)
    g = torch.Generator().manual_seed(42)
    xs = [{L: torch.randn(3, m, cfg.dim, generator=g).bfloat16().to(DEV) for L in layers}
          for m in (7, 1, 1)]
    fused = []
    real = LT.fp8_linear_quantized
    monkeypatch.setattr(T, "fp8_linear_quantized", lambda *a: fused.append(1) or real(*a))

    def go(on):
        monkeypatch.setattr(T, "QUANT_IN_WO_A", on)
        state = stack.new_state(3, capacity=16)
        outs = [stack.forward(x, state) for x in xs]
        return outs, state

    want, s0 = go(False)
    assert not fused
    got, s1 = go(True)
    assert len(fused) == 2 * len(layers)
    for w, o in zip(want, got):
        for L in layers:
            assert torch.equal(w[L].view(torch.int16), o[L].view(torch.int16)), L
    for L in layers:
        assert torch.equal(s0.layers[L].window.view(torch.uint8),
                           s1.layers[L].window.view(torch.uint8))
