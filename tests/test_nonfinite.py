"""A NaN or an infinity in a layer's input is never turned into a finite output by the triton
backend where the reference gives NaN: the quantisers mark such a block so that it decodes as
the reference's bytes do (NaN, or zeros where the reference's own scale collapses to -0), and
the GPU's max (which drops NaN) never decides it. Runs under TRITON_INTERPRET=1 on the CPU."""
import pytest
import torch

pytest.importorskip("triton")

from dsv41attn import AttentionStack, preset, random_layer_weights
from dsv41attn.checkpoint import quantize_fp8
from dsv41attn.ops.common.packing import unpack_window_rows
from dsv41attn.ops.linear import reference as ref_linear
from dsv41attn.ops.linear import triton as tri_linear

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _poisoned(m: int, k: int, seed: int) -> torch.Tensor:
    """[m, k] bf16 rows: row 0 a NaN, row 1 +inf, row 2 -inf, the rest finite."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).bfloat16()
    x[0, 3], x[1, k - 1], x[2, k // 2] = float("nan"), float("inf"), float("-inf")
    return x


def test_act_quant_marks_a_nonfinite_block_with_a_nan_scale():
    x = _poisoned(4, 96, 0)
    for kw in ({}, {"f16": True}, {"dequant": True}):
        q, s = tri_linear.act_quant(x.to(DEV), **kw)
        q, s = q.cpu(), s.cpu()
        bad = torch.tensor([[1, 0, 0], [0, 0, 1], [0, 1, 0], [0, 0, 0]], dtype=torch.bool)
        assert torch.equal(torch.isnan(s), bad), kw
        _, rs = tri_linear.act_quant(x[3:].to(DEV), **kw)  # a clean row: its own bits
        assert torch.equal(s[3:], rs.cpu())
        if kw:  # values: NaN across the bad block, the clean blocks untouched
            v = q.float().unflatten(1, (3, 32))
            assert torch.isnan(v[bad]).all() == bool(kw.get("dequant"))


@pytest.mark.parametrize("m", [4, 20, 70], ids=["m4-decode-f16", "m20-decode-values",
                                                  "m70-square-tiles"])
def test_fp8_linear_gives_nan_rows_where_the_reference_does(m):
    w = quantize_fp8(torch.randn(64, 96, generator=torch.Generator().manual_seed(m)))
    x = _poisoned(m, 96, m)
    got = tri_linear.fp8_linear(x.to(DEV), w.weight.to(DEV), w.scale.to(DEV)).cpu()
    want = ref_linear.fp8_linear(x, w.weight, w.scale)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.isnan(want[:3]).all() and not torch.isnan(want[3:]).any()
    assert torch.isfinite(got[3:]).all()


def test_window_rows_of_a_nonfinite_block_decode_to_nan():
    """norm_rope_pack's bytes for a block holding a NaN or an infinity: zero codes under scale
    byte 255, so every element decodes to NaN (the reference's bytes decode to NaN somewhere
    in the block); the clean rows are the reference's bytes."""
    from dsv41attn.ops.window_kv.reference import norm_rope_pack as ref_pack
    from dsv41attn.ops.window_kv.triton import norm_rope_pack as tri_pack

    d, r = 64, 16
    x = _poisoned(5, d, 1)
    w = torch.ones(d).bfloat16()
    rot = torch.polar(torch.ones(5, r // 2), torch.rand(5, r // 2))
    got = tri_pack(x.to(DEV), w.to(DEV), 1e-6, rot.to(DEV)).cpu()
    want = ref_pack(x, w, 1e-6, rot)
    assert torch.equal(got[3:], want[3:])
    for packed in (got, want):
        v = unpack_window_rows(packed[:3]).float()
        assert torch.isnan(v).any(-1).all()  # every poisoned row decodes to NaN
    assert (got[:3, d:] == 255).any(-1).all()


LAYERS = [0, 1, 2, 3, 5]  # SWA; r=2 source and its reuser; r=1 candidate source; re-indexer


def test_a_poisoned_token_poisons_what_reads_it_as_in_the_reference():
    """A prefill of two sequences, one with a NaN token, the other with an infinity, then a
    decode step: on every role the triton backend's outputs are NaN exactly where the
    reference backend's are (the token itself, the later tokens whose window or selected
    compressed rows hold it), and finite elsewhere."""
    cfg = preset("tiny").replace(dim=128)
    weights = {L: random_layer_weights(cfg, L, seed=11).to(DEV) for L in LAYERS}
    g = torch.Generator().manual_seed(12)
    xs = {L: torch.randn(2, 12, cfg.dim, generator=g).bfloat16() for L in LAYERS}
    for L in LAYERS:
        xs[L][0, 3, 7] = float("nan")
        xs[L][1, 5, 9] = float("inf")
    nan = {}
    for backend in ("reference", "triton"):
        stack = AttentionStack(cfg, weights, backend)
        state = stack.new_state(2, capacity=20)
        ys = stack.forward({L: xs[L][:, :10].to(DEV) for L in LAYERS}, state)
        ys2 = stack.forward({L: xs[L][:, 10:].to(DEV) for L in LAYERS}, state)
        nan[backend] = {L: torch.cat([ys[L], ys2[L]], 1).float().isnan().any(-1).cpu()
                        for L in LAYERS}
    for L in LAYERS:
        assert torch.equal(nan["triton"][L], nan["reference"][L]), L
        ref = nan["reference"][L]  # the token and its window's next ones, nothing before
        assert ref[0, 3:6].all() and not ref[0, :3].any(), L
        assert ref[1, 5:8].all() and not ref[1, :5].any(), L
