"""The layer's branch stream (streams.py): on a CUDA device the window K/V path and the
compressor run beside the query path. Running them side by side must change no bit of any
output or of the state, eager, captured in a CUDA graph, and when a step is undone; on the
CPU the fork is one stream."""
import dataclasses
import os

import pytest
import torch

from dsv41attn import AttentionStack, preset, random_layer_weights
from dsv41attn import layer as layer_module
from dsv41attn.streams import Fork

from conftest import assert_same, clone_state, snapshot

GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
needs_gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU with compiled Triton kernels")

# window 5, a ratio-2 group of 3 layers, 4 candidate blocks of 3, top-k 5 (test_decode_plan's)
ODD = preset("tiny").replace(window_size=5, compress_ratios=(0, 2, 2, 2, 1, 1, 1, 1, 0),
                             kv_source_layers=(1, 4), index_source_layers=(1, 3, 4, 6),
                             candidate_source_layer=4, candidate_topk_blocks=4,
                             candidate_block_size=3, index_topk=5)


def test_fork_on_the_cpu_is_one_stream():
    with Fork(torch.device("cpu"), branches=2) as fork:
        assert fork.streams == [] and fork.main is None
        with fork.branch():
            x = torch.ones(3) * 2
        with fork.branch(1):
            x = x + 1
    assert x.sum() == 9
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="branches"):
            Fork(torch.device("cpu"), branches=bad)
    with pytest.raises(ValueError, match="branch 1 of a fork of 1"):
        Fork(torch.device("cpu")).branch(1)
    with pytest.raises(RuntimeError, match="inside"):
        with Fork(torch.device("cpu")) as fork:
            with fork.branch():
                raise RuntimeError("inside")


def _both_ways(monkeypatch, run):
    """{"branch": run(), "one stream": run() with every layer's Fork disabled}."""
    got = {"branch": run()}
    with monkeypatch.context() as m:
        m.setattr(layer_module, "Fork",
                  lambda device, enabled=True, branches=1:
                  Fork(device, False, branches))
        got["one stream"] = run()
    return got


def _run(stack, state, calls):
    """Each call (rows, tokens per row, seed) as one step through every layer: outputs."""
    outs = []
    for rows, m, seed in calls:
        g = torch.Generator().manual_seed(seed)
        xs = {L: torch.randn(len(rows), m, stack.cfg.dim, generator=g).bfloat16().cuda()
              for L in stack.layers}
        outs.append(stack.forward(xs, state, rows=list(rows)))
    return outs


@needs_gpu
def test_branch_changes_no_bit_eager_graphed_and_undone(monkeypatch):
    stack = AttentionStack(ODD, {L: random_layer_weights(ODD, L, seed=3).to("cuda")
                                 for L in range(ODD.n_layers)}, "triton")
    calls = [([0, 1, 2, 3], 9, 1), ([0, 1, 2, 3], 1, 2), ([1, 3], 4, 3), ([0, 1, 2, 3], 1, 4)]
    base = stack.new_state(4, capacity=64, device="cuda")

    def run():
        state = clone_state(base)
        outs = _run(stack, state, calls)
        plan = stack.plan_decode(state, steps=4)
        xs = [{L: torch.randn(4, ODD.dim, generator=torch.Generator().manual_seed(9 + k))
               .bfloat16().cuda() for L in range(ODD.n_layers)} for k in range(4)]
        graph = plan.capture(xs[0])
        outs.append(graph.warmup_outputs)
        for k in range(1, 4):
            outs.append({L: y.clone() for L, y in graph.replay(xs[k]).items()})
        torch.cuda.synchronize()
        return outs, snapshot(state)

    runs = _both_ways(monkeypatch, run)
    (a, sa), (b, sb) = runs["branch"], runs["one stream"]
    for i, (oa, ob) in enumerate(zip(a, b)):
        for L in oa:
            assert torch.equal(oa[L], ob[L]), f"call {i} layer {L}"
    assert_same(sa, sb)

    # a step that fails in a layer after the branch wrote the ring and the pools is undone
    state = clone_state(base)
    _run(stack, state, calls[:1])
    before = snapshot(state)
    layer = stack.layers[4]  # a KV source and candidate source: its branch writes the pool
    good = layer.ops

    def boom(*a, **k):
        raise RuntimeError("boom after the branch")

    layer.ops = dataclasses.replace(good, sparse_attn_paged=boom)
    try:
        with pytest.raises(RuntimeError, match="boom after the branch"):
            _run(stack, state, calls[1:2])
    finally:
        layer.ops = good
    torch.cuda.synchronize()
    assert_same(before, snapshot(state))


@needs_gpu
@pytest.mark.parametrize("role", ["SWA", "Full r=2", "Full r=1 cand", "Reindex", "Reuse"])
def test_branch_changes_no_bit_at_flash_shapes(monkeypatch, role):
    from dsv41attn.bench import fill_context, role_layers

    cfg = preset("v41-flash")
    layers = role_layers(cfg, role)
    weights = {L: random_layer_weights(cfg, L, seed=L).to("cuda") for L in layers}
    stack = AttentionStack(cfg, weights, "triton")
    g = torch.Generator(device="cuda").manual_seed(0)
    batch, ctx = 8, 2500
    x = {L: torch.randn(batch, 1, cfg.dim, device="cuda", generator=g).bfloat16() for L in layers}
    base = stack.new_state(batch, capacity=ctx + 1)
    fill_context(base, ctx, seed=1)

    def run():
        state = clone_state(base)
        step = stack.step(state, 1)
        out = {L: stack.layers[L](x[L], state, step) for L in layers}
        torch.cuda.synchronize()
        return out, snapshot(state)

    got = _both_ways(monkeypatch, run)
    for L in layers:
        assert torch.equal(got["branch"][0][L], got["one stream"][0][L]), f"layer {L}"
    assert_same(got["branch"][1], got["one stream"][1])
