"""A sequence gets the same bits in any call (docs/numerics.md §9): on the triton backend with
batch_invariant=True its outputs, at a layer of every role, are bit-identical alone, inside a
ragged batch of 8, in two chunks and token by token, and every index source selects the same
rows for it.

Tiny shapes under the interpreter, with dim widened to 128 so that the fp8 linears' K is cut
into ranges of several blocks (summed by split-K programs at decode sizes, inside each tile
for a prefill) and the batch's prefill crosses the GEMM tile sizes (M > 64). The kernels' own
tests cover the orders themselves (tests/test_fp8_linear_triton.py, test_dense_linear_triton.py,
test_sparse_attn_triton.py); the layer test shows that no op between them depends on the call.
"""
import pytest
import torch

pytest.importorskip("triton")

from dsv41attn import AttentionLayer, AttentionStack, preset, random_layer_weights

CFG = preset("tiny").replace(dim=128)
LAYERS = [0, 1, 2, 3, 5]  # one of every role: SWA 0; r=2 source 1 and its reuser 2; r=1
# candidate source 3 and the re-indexing layer 5 (the interpreter is slow: no second reuser)
P, D, TARGET = 10, 2, 3
OTHERS = [8, 7, 10, None, 6, 8, 7, 9]  # the batch's other prompts (55 tokens: a prefill of 65)


@pytest.fixture(scope="module")
def run():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    weights = {L: random_layer_weights(CFG, L, seed=11).to(dev) for L in LAYERS}
    stack = AttentionStack(CFG, weights, "triton", batch_invariant=True)
    g = torch.Generator().manual_seed(12)
    xs = {L: torch.randn(8, P + D, CFG.dim, generator=g).bfloat16().to(dev) for L in LAYERS}
    sources = [L for L in LAYERS if CFG.layer(L).is_index_source]

    def go(schedules):
        """schedules: per state row, its chunk sizes (step k runs every row's k-th chunk).
        Returns the TARGET row's outputs per layer and its selected rows per index source."""
        state = stack.new_state(len(schedules), capacity=P + D + 4)
        pos = [0] * len(schedules)
        out, top = {L: [] for L in LAYERS}, {L: [] for L in sources}
        for k in range(max(map(len, schedules))):
            counts = [s[k] if k < len(s) else 0 for s in schedules]
            step = stack.step(state, counts)
            data = {L: torch.cat([xs[L][r if len(schedules) > 1 else TARGET, p:p + c]
                                  for r, (p, c) in enumerate(zip(pos, counts))]) for L in LAYERS}
            ys = stack.run(step, data)
            b = TARGET if len(schedules) > 1 else 0
            a, c = step.cu_seqlens[b], counts[b]
            for L in LAYERS:
                out[L].append(ys[L][a:a + c])
            for L in sources:
                top[L] += [sorted(r[r >= 0].tolist()) for r in step.topk(L)[a:a + c]]
            pos = [p + c for p, c in zip(pos, counts)]
        return {L: torch.cat(v).cpu() for L, v in out.items()}, top

    return go


@pytest.mark.slow  # ~2 minutes of interpreter on 2 cores
def test_alone_batched_chunked_and_token_by_token_give_the_same_bits(run):
    tail = [1] * D
    alone, top = run([[P] + tail])
    batch = [[P] + tail if r == TARGET else [n] + tail for r, n in enumerate(OTHERS)]
    modes = {"batch of 8": batch, "two chunks": [[4, P - 4] + tail],
             "token by token": [[1] * (P + D)]}
    for name, schedule in modes.items():
        out, sel = run(schedule)
        for L in LAYERS:
            assert torch.equal(out[L].view(torch.int16), alone[L].view(torch.int16)), (name, L)
        assert sel == top, name
    assert all(any(r) for L in top for r in top[L][CFG.index_topk * 2:])  # rows were selected


def test_the_mode_is_chosen_per_stack_and_checked():
    from dsv41attn.ops.backends import get_ops
    from dsv41attn.ops.compressor import triton as compressor
    from dsv41attn.ops.linear import reference as torch_linears
    from dsv41attn.ops.linear import triton as fixed_linears

    fast, fixed = get_ops("triton"), get_ops("triton", batch_invariant=True)
    assert not fast.batch_invariant and fixed.batch_invariant
    assert fast.linear is torch_linears.linear and fixed.linear is fixed_linears.linear
    assert fast.sparse_attn_paged.keywords == {"split_blocks": 0}  # splits sized to the step
    assert fixed.fp8_linear is fast.fp8_linear  # fixed order in both modes
    assert fixed.fp8_linear_pair is fast.fp8_linear_pair
    # r > 1 compressor projections: dense_linear's one order, or project_rows / torch by size
    assert fast.compressor_project.keywords == {"fixed_order": False}
    assert fixed.compressor_project is compressor.project  # fixed_order=True by default
    # the step-sized mode's float64 copy of the weights, built per layer; none otherwise
    assert fast.compressor_prepare is compressor.prepare_project
    assert fixed.compressor_prepare is get_ops("reference").compressor_prepare
    r2 = next(L for L in CFG.kv_source_layers if CFG.layer(L).ratio > 1)
    w2 = random_layer_weights(CFG, r2, seed=2)
    layer = AttentionLayer(CFG, w2, "triton")
    assert layer.compressor_kw["prepared"].serves(w2.compressor_wkv, w2.compressor_wgate)
    # both modes: wo_a's e4m3 codes (the random weights are an fp8 checkpoint's, dequantised)
    codes = layer.wo_a_kw["codes"]
    assert codes.serves(w2.wo_a) and torch.equal(codes.fp8.dequantize(), w2.wo_a)
    assert layer.prepared_nbytes == 2 * 8 * w2.compressor_wkv.numel() + codes.fp8.nbytes
    invariant = AttentionLayer(CFG, w2, "triton", batch_invariant=True)
    assert invariant.compressor_kw == {} and invariant.prepared_nbytes == codes.fp8.nbytes
    assert AttentionLayer(CFG, w2, "reference").compressor_kw == {}
    assert AttentionLayer(CFG, w2, "reference").wo_a_kw == {}
    assert AttentionStack(CFG, {r2: w2}, "reference").prepared_nbytes == 0
    assert AttentionStack(CFG, {r2: w2}, "triton").prepared_nbytes == layer.prepared_nbytes
    r1 = next((L for L in CFG.kv_source_layers if CFG.layer(L).ratio == 1), None)
    if r1 is not None:
        assert AttentionLayer(CFG, random_layer_weights(CFG, r1, seed=3), "triton").compressor_kw == {}
    with pytest.raises(ValueError, match="batch_invariant=True needs backend 'triton'"):
        get_ops("reference", batch_invariant=True)
    with pytest.raises(TypeError, match="batch_invariant must be a bool, got 1"):
        get_ops("triton", batch_invariant=1)
    w = {0: random_layer_weights(CFG, 0, seed=1)}
    stack = AttentionStack(CFG, w, "triton", batch_invariant=True)
    assert stack.batch_invariant and stack.layers[0].ops.batch_invariant
    with pytest.raises(ValueError, match="needs backend 'triton'"):
        AttentionStack(CFG, w, "reference", batch_invariant=True)
