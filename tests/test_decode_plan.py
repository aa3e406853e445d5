"""DecodePlan: host plan once, GPU-only runs, CUDA-graph replay.

A plan decodes sequences at different positions in one batch, reading and advancing the
positions on the device and scanning a fixed number of compressed rows. It must give exactly
what stack.step gives token by token (every op is row-independent and rows beyond a query's
visible ones are masked), on both backends, across window, ratio-group and candidate-block
boundaries; and a captured graph must replay exactly what the eager run computes.
"""
import os


import pytest
import torch

from dsv41attn import AttentionStack, StateError, preset, random_layer_weights

TINY = preset("tiny")
# window 5, a ratio-2 group of 3 layers, 4 candidate blocks of 3, top-k 5: boundaries come fast
ODD = TINY.replace(window_size=5, compress_ratios=(0, 2, 2, 2, 1, 1, 1, 1, 0),
                   kv_source_layers=(1, 4), index_source_layers=(1, 3, 4, 6),
                   candidate_source_layer=4, candidate_topk_blocks=4, candidate_block_size=3,
                   index_topk=5)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _stack(cfg, backend="reference", device="cpu"):
    return AttentionStack(cfg, {L: random_layer_weights(cfg, L, seed=3).to(device)
                                for L in range(cfg.n_layers)}, backend)


def _prefilled(stack, lengths, capacity=64, device="cpu", seed=0):
    """A state whose sequence i holds lengths[i] tokens (one ragged prefill step)."""
    cfg = stack.cfg
    state = stack.new_state(len(lengths), capacity=capacity, device=device)
    g = torch.Generator().manual_seed(seed)
    step = stack.step(state, lengths)
    x = torch.randn(sum(lengths), cfg.dim, generator=g).bfloat16().to(device)
    for layer in stack.layers.values():
        layer(x, state, step)
    return state


def _tokens(cfg, n_steps, b, seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [{L: torch.randn(b, cfg.dim, generator=g).bfloat16().to(device)
             for L in range(cfg.n_layers)} for _ in range(n_steps)]


def _assert_same_state(a, b, exact_recent=True):
    """Equal caches. exact_recent=False: the fp32 open-group projections may differ by an ulp,
    as the CPU's fp32 GEMM rounds differently for 1-row and b-row batches; every packed row
    and key must still be equal."""
    for L in a.layers:
        assert torch.equal(a.layers[L].window, b.layers[L].window), f"layer {L} ring"
        assert torch.equal(a.layers[L].positions, b.layers[L].positions), f"layer {L} positions"
    for s in a.sources:
        assert torch.equal(a.sources[s].rows, b.sources[s].rows), f"source {s} rows"
        assert torch.equal(a.sources[s].index_keys, b.sources[s].index_keys), f"source {s} keys"
        if a.sources[s].recent_kv is not None:
            for t in ("recent_kv", "recent_score"):
                x, y = getattr(a.sources[s], t), getattr(b.sources[s], t)
                if exact_recent:
                    assert torch.equal(x, y), f"source {s} {t}"
                else:
                    torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cfg_name,lengths,n_steps", [
    ("odd", [1, 4, 5, 9], 8),  # straddles window 5, ratio-2 groups and 3-row candidate blocks
    ("odd", [3, 3, 3], 9),  # one position: the eager step runs one group of the same rows
    ("tiny", [3, 16, 30], 5),
])
def test_plan_equals_token_by_token_steps(cfg_name, lengths, n_steps):
    cfg = {"odd": ODD, "tiny": TINY}[cfg_name]
    stack = _stack(cfg)
    eager = _prefilled(stack, lengths)
    planned = eager.clone()
    xs = _tokens(cfg, n_steps, len(lengths))
    plan = stack.plan_decode(planned, steps=n_steps)
    for k in range(n_steps):
        step = stack.step(eager, 1)
        want = {L: layer(xs[k][L], eager, step) for L, layer in stack.layers.items()}  # packed
        got = plan.run(xs[k])
        for L in stack.layers:
            assert got[L].shape == xs[k][L].shape
            assert torch.equal(got[L], want[L]), f"step {k} layer {L}"
    _assert_same_state(eager, planned)
    assert plan.positions == [p + n_steps for p in lengths]


def test_derive_facts_alone_changes_nothing():
    """derive_facts (what bench times apart from the layers) writes only the plan's own
    buffers: deriving a step's facts again, any number of times, leaves the state and every
    later step's outputs as a plan that never called it gives them."""
    stack = _stack(ODD)
    a = _prefilled(stack, [1, 4, 5, 9])
    b = a.clone()
    xs = _tokens(ODD, 3, 4)
    plain, extra = stack.plan_decode(a, steps=3), stack.plan_decode(b, steps=3)
    for k in range(3):
        extra.derive_facts()
        extra.derive_facts()
        want, got = plain.run(xs[k]), extra.run(xs[k])
        for L in want:
            assert torch.equal(got[L], want[L]), f"step {k} layer {L}"
        extra.derive_facts()  # after the step: the next step derives its own
    _assert_same_state(a, b)


def test_plan_rows_subset_and_order():
    stack = _stack(ODD)
    eager = _prefilled(stack, [2, 6, 7, 11])
    planned = eager.clone()
    rows = [3, 1]
    xs = _tokens(ODD, 3, 2)
    plan = stack.plan_decode(planned, rows=rows, steps=3)
    for k in range(3):
        step = stack.step(eager, 1, rows=rows)
        want = {L: layer(xs[k][L], eager, step) for L, layer in stack.layers.items()}
        got = plan.run(xs[k])
        for L in want:
            assert torch.equal(got[L], want[L]), f"step {k} layer {L}"
    _assert_same_state(eager, planned)


def test_a_mixed_step_gives_what_each_sequence_gives_alone():
    """Decodes at different positions and a chunk run as one packed step (one weight read
    per layer) and give what each sequence gives alone."""
    stack = _stack(ODD)
    state = _prefilled(stack, [2, 5, 9, 4])
    alone = state.clone()
    step = stack.step(state, [1, 1, 3, 1])
    xs = _tokens(ODD, 1, 6)[0]
    ys = {L: layer(xs[L], state, step) for L, layer in stack.layers.items()}
    for i, (row, n) in enumerate([(0, 1), (1, 1), (2, 3), (3, 1)]):
        a = [0, 1, 2, 5][i]
        one = stack.step(alone, n, rows=[row])
        for L, layer in stack.layers.items():
            assert torch.equal(layer(xs[L][a:a + n], alone, one), ys[L][a:a + n]), (row, L)
    _assert_same_state(state, alone, exact_recent=False)
    with pytest.raises(ValueError, match="reference semantics"):
        stack.step(state, 1, semantics="reference")


def test_plan_triton_backend_matches_reference_exactly_under_interpreter():
    pytest.importorskip("triton")
    if DEV == "cuda":
        pytest.skip("bit-exactness holds under the interpreter; the GPU test is below")
    ref, tri = _stack(ODD), _stack(ODD, "triton")
    a = _prefilled(ref, [3, 8])
    b = a.clone()
    xs = _tokens(ODD, 3, 2)
    pa, pb = ref.plan_decode(a, steps=3), tri.plan_decode(b, steps=3)
    for k in range(3):
        ya, yb = pa.run(xs[k]), pb.run(xs[k])
        for L in ya:
            assert torch.equal(ya[L], yb[L]), f"step {k} layer {L}"
    _assert_same_state(a, b)


def test_plan_is_invalidated_and_checks_inputs():
    stack = _stack(ODD)
    state = _prefilled(stack, [4, 6])
    plan = stack.plan_decode(state, steps=2)
    xs = _tokens(ODD, 3, 2)
    bad = dict(xs[0])
    bad[0] = bad[0][:1]
    with pytest.raises(ValueError, match=r"layer 0: x must be \[b=2"):
        plan.run(bad)
    bad[0] = xs[0][0].float()
    with pytest.raises(TypeError, match="bfloat16"):
        plan.run(bad)
    plan.run(xs[0])
    plan.run(xs[1])
    with pytest.raises(StateError, match="used up"):
        plan.run(xs[2])
    plan = stack.plan_decode(state, steps=2)
    state.truncate(0, 5)
    with pytest.raises(StateError, match="changed since this plan"):
        plan.run(xs[0])
    with pytest.raises(StateError, match="capacity"):
        stack.plan_decode(state, steps=100)
    with pytest.raises(ValueError, match="fixed"):
        ref = _stack(ODD.replace(index_semantics="reference"))
        ref.plan_decode(ref.new_state(1, capacity=8))
    with pytest.raises(ValueError, match="steps"):
        stack.plan_decode(state, steps=0)


def test_plan_reserves_pages_up_front():
    stack = _stack(ODD)
    state = stack.new_state(2, capacity=64, page_size=4, num_pages=6)
    plan = stack.plan_decode(state, steps=12)  # 3 pages per sequence, all taken now
    assert state.free_pages == 0
    xs = _tokens(ODD, 1, 2)
    plan.run(xs[0])
    with pytest.raises(StateError, match="out of cache pages"):
        stack.plan_decode(state, steps=20)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replay_matches_eager():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("set TRITON_INTERPRET=0 to compile the kernels for the GPU")
    stack = _stack(ODD, "triton", device="cuda")
    eager = _prefilled(stack, [1, 4, 5, 9], device="cuda")
    graphed = eager.clone()
    n = 7
    xs = _tokens(ODD, n, 4, device="cuda")
    pe, pg = stack.plan_decode(eager, steps=n), stack.plan_decode(graphed, steps=n)
    graph = pg.capture(xs[0])
    want = pe.run(xs[0])
    for L in want:
        assert torch.equal(graph.warmup_outputs[L], want[L])
    for k in range(1, n):
        want = pe.run(xs[k])
        got = graph.replay(xs[k])
        for L in want:
            assert torch.equal(got[L], want[L]), f"step {k} layer {L}"
    torch.cuda.synchronize()
    _assert_same_state(eager, graphed)
    with pytest.raises(StateError, match="used up"):
        graph.replay(xs[0])
    with pytest.raises(ValueError, match="backend='triton'"):
        ref = _stack(ODD, device="cuda")
        ref.plan_decode(_prefilled(ref, [2, 3], device="cuda"), steps=3).capture(xs[0])


def test_weights_written_in_place_leave_the_prepared_copies():
    """A layer's prepared copies (the triton backend's wo_a codes) serve only the weights they
    were made from: written in place, eager calls read the new weights (the same output as a
    stack built on them: the batch-invariant mode, where the codes give the bf16 path's bits)
    until ``prepare`` rebuilds the copies."""
    L = 0

    def one_layer():
        return AttentionStack(ODD, {L: random_layer_weights(ODD, L, seed=3).to(DEV)}, "triton",
                              batch_invariant=True)
    stack, fresh = one_layer(), one_layer()
    layer = stack.layers[L]
    assert layer.stale_prepared() == [] and "codes" in layer.wo_a_kw
    codes = layer.wo_a_kw["codes"]
    stack.prepare()  # nothing written: the same copy, not rebuilt
    assert layer.wo_a_kw["codes"] is codes and codes.version == layer.weights.wo_a._version
    with torch.no_grad():
        layer.weights.wo_a.mul_(2)
        fresh.layers[L].weights.wo_a.mul_(2)
    fresh.layers[L].prepare()  # built on the doubled wo_a
    assert layer.stale_prepared() == ["wo_a"] and fresh.layers[L].stale_prepared() == []
    x = _tokens(ODD, 1, 3, device=DEV)[0][L]
    outs = []
    for s in (stack, fresh):
        state = s.new_state(3, capacity=16, device=DEV)
        outs.append(s.plan_decode(state, steps=1, layers=[L]).run({L: x})[L])
    assert torch.equal(outs[0], outs[1])  # the stale codes were not read
    codes = layer.wo_a_kw["codes"]
    reads = codes.reads
    stack.prepare()  # rewritten in place: the same copy, the doubled wo_a's exact codes
    assert layer.stale_prepared() == [] and layer.wo_a_kw["codes"] is codes
    assert codes.serves(layer.weights.wo_a)
    want = fresh.layers[L].wo_a_kw["codes"].fp8
    assert torch.equal(codes.fp8.weight.view(torch.uint8), want.weight.view(torch.uint8))
    assert torch.equal(codes.fp8.scale.view(torch.uint8), want.scale.view(torch.uint8))
    state = stack.new_state(3, capacity=16, device=DEV)
    assert torch.equal(stack.plan_decode(state, steps=1, layers=[L]).run({L: x})[L], outs[1])
    assert codes.reads == reads + 1  # this step read the codes
    with torch.no_grad():  # no exact fp8 form any more: the codes go, the op reads wo_a
        layer.weights.wo_a[0, 0] = 1.0 + 2.0 ** -7
    stack.prepare()
    assert "codes" not in layer.wo_a_kw and layer.stale_prepared() == []


def test_prepare_rewrites_the_compressor_copy_in_place():
    """The step-sized mode's float64 copy of a ratio > 1 compressor's wkv and wgate: after
    they are written in place, ``prepare`` rewrites the same copy with their new values."""
    L = next(L for L in range(ODD.n_layers)
             if ODD.layer(L).ratio > 1 and ODD.layer(L).is_kv_source)
    stack = AttentionStack(ODD, {L: random_layer_weights(ODD, L, seed=3).to(DEV)}, "triton")
    layer = stack.layers[L]
    copy = layer.compressor_kw["prepared"]
    with torch.no_grad():
        layer.weights.compressor_wkv.mul_(3)
    assert layer.stale_prepared() == ["compressor_wkv / compressor_wgate"]
    stack.prepare()
    assert layer.compressor_kw["prepared"] is copy and layer.stale_prepared() == []
    w = layer.weights
    assert torch.equal(copy.both, torch.cat([w.compressor_wkv, w.compressor_wgate]).double())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_refuses_to_replay_a_stale_prepared_copy():
    """A graph captured while wo_a's codes served reads those codes: after wo_a is written in
    place, replay raises (the state untouched) instead of giving the old weights' output;
    ``prepare`` rewrites the codes in place, and the same graph then gives the new weights'
    output; where the new wo_a has no fp8 form the codes go and replay raises until a graph is
    captured again. A graph of more rows than the codes serve never reads them: it replays the
    weights written in place as they are."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("set TRITON_INTERPRET=0 to compile the kernels for the GPU")
    stack = _stack(ODD, "triton", device="cuda")
    state = _prefilled(stack, [2, 5], device="cuda")
    xs = _tokens(ODD, 5, 2, device="cuda")
    plan = stack.plan_decode(state, steps=5)
    graph = plan.capture(xs[0])
    graph.replay(xs[1])
    with torch.no_grad():
        stack.layers[0].weights.wo_a.mul_(2)
    left = plan.steps_left
    with pytest.raises(StateError, match="layer 0: wo_a changed since this graph was captured"):
        graph.replay(xs[2])
    assert plan.steps_left == left
    stack.prepare()  # the codes rewritten in place: the graph reads the doubled wo_a's
    eager = state.clone()
    want = stack.plan_decode(eager, steps=1).run(xs[2])
    got = graph.replay(xs[2])
    for L in want:
        assert torch.equal(got[L], want[L]), f"layer {L}"
    with torch.no_grad():  # no fp8 form: prepare drops the codes the graph reads
        stack.layers[0].weights.wo_a[0, 0] = 1.0 + 2.0 ** -7
    stack.prepare()
    with pytest.raises(StateError, match="call stack.prepare"):
        graph.replay(xs[3])
    again = stack.plan_decode(state, steps=2).capture(xs[3])
    again.replay(xs[4])

    # 20 rows: past the codes' 16 (the default mode), so the graph reads wo_a itself
    wide = _prefilled(stack, [2] * 20, device="cuda")
    xw = _tokens(ODD, 3, 20, device="cuda")
    graph = stack.plan_decode(wide, steps=3).capture(xw[0])
    with torch.no_grad():
        stack.layers[0].weights.wo_a.mul_(2)  # not prepared: the graph does not need it
    eager = wide.clone()
    want = stack.plan_decode(eager, steps=1).run(xw[1])
    got = graph.replay(xw[1])
    for L in want:
        assert torch.equal(got[L], want[L]), f"layer {L}"
