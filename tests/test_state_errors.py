"""Bad calls get a clear error and leave every cache unchanged (cache.py: "a rejected call leaves
everything unchanged"; layer.py: "Bad input raises before any state changes").

All cases start from one valid, ragged, non-trivial state of the tiny stack (every role):
a prefill of 11 tokens on rows 0..2 (window ring wrapped, ratio-2 groups left half open), then
one decode on row 0 only. So row 0 is at position 12 and rows 1, 2 at 11; capacity is 16.
"""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from dsv41attn.cache import AttentionState, StateError
from dsv41attn.checkpoint import random_layer_weights
from dsv41attn.config import ConfigError, preset
from dsv41attn.layer import AttentionLayer
from dsv41attn.stack import AttentionStack

from conftest import (bytes_of, assert_same, assert_unchanged, clone_state, make_x, make_xs, rejected,
                      run_valid, snapshot)

B, CAP = 3, 16
PREP = [((0, 1, 2), 11, 1), ((0,), 1, 2)]  # (rows, tokens, seed): the valid calls of the base
BF16 = torch.bfloat16


# ---- fixtures -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cfg():
    return preset("tiny")


@pytest.fixture(scope="module")
def weights(cfg):
    return {L: random_layer_weights(cfg, L, seed=0) for L in range(cfg.n_layers + cfg.n_mtp_layers)}


@pytest.fixture(scope="module")
def stack(cfg, weights):
    return AttentionStack(cfg, {L: weights[L] for L in range(cfg.n_layers)})


@pytest.fixture(scope="module")
def base(stack):
    s = stack.new_state(batch_size=B, capacity=CAP)
    run_valid(stack, s, PREP)
    return s


@pytest.fixture
def state(base):
    return clone_state(base)


def test_base_state_is_non_trivial(base, cfg):
    for L in range(cfg.n_layers):
        assert base.layers[L].positions.tolist() == [12, 11, 11]
    assert sorted(base.sources) == [1, 3]
    rows = torch.arange(B)
    for src, n in ((1, 5), (3, 11)):
        assert bool(base.read_compressed(src, rows, n).ne(0).any(-1).all()), src
        assert bool(base.read_index_keys(src, rows, n).ne(0).any(-1).all()), src
    for L in range(cfg.n_layers):  # ring wrapped: every window slot of the last W positions written
        ring = base.layers[L].read_window(rows)
        assert int(ring.ne(0).any(-1).sum(-1).min()) >= cfg.window_size, L
    assert base.index_key_slot == 3


def test_base_is_reproducible(stack, base):
    fresh = stack.new_state(batch_size=B, capacity=CAP)
    run_valid(stack, fresh, PREP)
    assert_same(snapshot(base), snapshot(fresh))


def _layer0(stack, cfg, s, x, tokens=1, rows=(1, 2)):
    return stack.layers[0](x, s, stack.step(s, tokens=tokens, rows=list(rows)))


BAD_CALLS = [
    ("zero_tokens_forward",
     lambda st, cfg, s: st.forward(lambda L: make_x(cfg, 2, 0, L), s, rows=[1, 2]),
     ValueError, r"token counts \[0, 0\]: at least one must be >= 1"),
    ("zero_tokens_x",
     lambda st, cfg, s: _layer0(st, cfg, s, make_x(cfg, 2, 0, 0)),
     ValueError, r"x has shape \[2, 0, 64\]; a \[b, m, dim\] input needs .*\[2, 1, 64\]"),
    ("negative_tokens",
     lambda st, cfg, s: st.step(s, [-1, 2], rows=[1, 2]),
     ValueError, r"tokens must be >= 0, got -1"),
    ("token_counts_not_rows",
     lambda st, cfg, s: st.step(s, [1, 1, 1], rows=[1, 2]),
     ValueError, r"3 token counts for 2 sequences"),
    ("past_capacity",
     lambda st, cfg, s: st.forward(lambda L: make_x(cfg, 2, 6, L), s, rows=[1, 2]),
     StateError, r"sequence 1: positions 11\.\.16 exceed the cache capacity of 16 positions"),
    ("past_capacity_row0",
     lambda st, cfg, s: st.forward(lambda L: make_x(cfg, 1, 5, L), s, rows=[0]),
     StateError, r"sequence 0: positions 12\.\.16 exceed the cache capacity of 16"),
    ("past_capacity_ragged",
     lambda st, cfg, s: st.step(s, [1, 2, 6]),
     StateError, r"sequence 2: positions 11\.\.16 exceed the cache capacity of 16"),
    ("float32",
     lambda st, cfg, s: st.forward(lambda L: make_x(cfg, 2, 1, L).float(), s, rows=[1, 2]),
     TypeError, r"x must be bfloat16, got torch\.float32"),
    ("float16",
     lambda st, cfg, s: _layer0(st, cfg, s, make_x(cfg, 2, 1, 0).half()),
     TypeError, r"x must be bfloat16, got torch\.float16"),
    ("not_a_tensor",
     lambda st, cfg, s: _layer0(st, cfg, s, make_x(cfg, 2, 1, 0).float().tolist()),
     TypeError, r"x must be a torch\.Tensor, got list"),
    ("hidden_size",
     lambda st, cfg, s: st.forward(lambda L: torch.zeros(2, 1, 96, dtype=BF16), s, rows=[1, 2]),
     ValueError, r"forward takes \[b, m, dim=64\] inputs of one shape, got \[2, 1, 96\]"),
    ("hidden_size_packed",
     lambda st, cfg, s: _layer0(st, cfg, s, torch.zeros(2, 96, dtype=BF16)),
     ValueError, r"x must have shape \[sum\(tokens\)=2, dim=64\] \(or \[b, m, dim\] when every "
                 r"sequence has m tokens\), got \[2, 96\]"),
    ("packed_token_count",
     lambda st, cfg, s: _layer0(st, cfg, s, torch.zeros(3, 64, dtype=BF16)),
     ValueError, r"x must have shape \[sum\(tokens\)=2, dim=64\] .*got \[3, 64\]"),
    ("ndim_1",
     lambda st, cfg, s: _layer0(st, cfg, s, torch.zeros(64, dtype=BF16), rows=[1]),
     ValueError, r"x must have shape \[sum\(tokens\)=1, dim=64\] .*got \[64\]"),
    ("ndim_4",
     lambda st, cfg, s: _layer0(st, cfg, s, torch.zeros(2, 1, 1, 64, dtype=BF16)),
     ValueError, r"x must have shape \[sum\(tokens\)=2, dim=64\] .*got \[2, 1, 1, 64\]"),
    ("batch_not_rows",
     lambda st, cfg, s: st.forward(lambda L: make_x(cfg, 3, 1, L), s, rows=[1, 2]),
     ValueError, r"x has shape \[3, 1, 64\]; a \[b, m, dim\] input needs .*\[2, 1, 64\]"),
    ("meta_device",
     lambda st, cfg, s: st.forward(lambda L: torch.empty(2, 1, 64, dtype=BF16, device="meta"), s,
                                   rows=[1, 2]),
     ValueError, r"x is on meta, the state on cpu and the weights on cpu: they must agree"),
    ("rows_negative",
     lambda st, cfg, s: st.forward(lambda L: make_x(cfg, 1, 1, L), s, rows=[-1]),
     IndexError, r"rows \[-1\] out of range 0\.\.2"),
    ("rows_too_large",
     lambda st, cfg, s: st.forward(lambda L: make_x(cfg, 2, 1, L), s, rows=[1, 3]),
     IndexError, r"rows \[1, 3\] out of range 0\.\.2"),
    ("rows_repeated",
     lambda st, cfg, s: st.forward(lambda L: make_x(cfg, 2, 1, L), s, rows=[1, 1]),
     ValueError, r"rows \[1, 1\] repeat a sequence"),
    ("rows_empty",
     lambda st, cfg, s: st.step(s, tokens=1, rows=[]),
     ValueError, r"rows must name at least one sequence"),
    # ... and DeepSeek's own schedule ("reference" semantics) has no ragged steps at all.
    ("rows_at_different_positions_reference",
     lambda st, cfg, s: st.step(s, 1, rows=[0, 1], semantics="reference"),
     ValueError, r"reference semantics reproduces DeepSeek's schedule only"),
    ("step_tokens_differ_from_x",
     lambda st, cfg, s: _layer0(st, cfg, s, make_x(cfg, 2, 1, 0), tokens=2),
     ValueError, r"x has shape \[2, 1, 64\]; .*i\.e\. \[2, 2, 64\]"),
    ("reuse_before_its_source",
     lambda st, cfg, s: st.layers[2](make_x(cfg, 2, 1, 2), s, st.step(s, 1, rows=[1, 2])),
     StateError, r"layer 2 called out of order: this step runs \[0, 1, 2, .*\] in order, each once, "
                 r"and layer 0 is next"),
    ("reindex_before_its_sources",
     lambda st, cfg, s: st.layers[5](make_x(cfg, 2, 1, 5), s, st.step(s, 1, rows=[1, 2])),
     StateError, r"layer 5 called out of order: .*layer 0 is next"),
    ("step_of_another_state",
     lambda st, cfg, s: st.layers[0](make_x(cfg, 1, 1, 0), s, st.step(st.new_state(1, CAP), 1)),
     StateError, r"the step was opened on a different state"),
    ("unknown_semantics_step",
     lambda st, cfg, s: st.step(s, 1, rows=[1, 2], semantics="exact"),
     ValueError, r"semantics must be one of \('fixed', 'reference'\), got 'exact'"),
    ("unknown_semantics_forward",
     lambda st, cfg, s: st.forward(lambda L: make_x(cfg, 2, 1, L), s, rows=[1, 2], semantics="Fixed"),
     ValueError, r"semantics must be one of .*got 'Fixed'"),
]


@pytest.mark.parametrize("call,exc,match", [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_bad_call_rejected_without_trace(stack, cfg, state, call, exc, match):
    with rejected(state, exc, match):
        call(stack, cfg, state)


def test_error_types():
    assert issubclass(StateError, ValueError)


def test_too_many_tokens(cfg, weights):
    stack = AttentionStack(cfg, {L: weights[L] for L in (0, 1, 2)})  # SWA, Full, Reuse: fast
    s = stack.new_state(batch_size=2, capacity=CAP, max_tokens_per_call=4)
    run_valid(stack, s, [((0, 1), 3, 5)])
    with rejected(s, ValueError, r"sequence 0: 5 tokens in one step, more than the state's max_tokens_per_call=4"):
        stack.forward(make_xs(cfg, 2, 5, 6, stack.layers), s)
    with rejected(s, ValueError, r"sequence 1: 5 tokens in one step"):
        stack.step(s, [4, 5])
    with rejected(s, ValueError, r"token counts \[0, 0\]"):
        stack.forward(make_xs(cfg, 2, 0, 6, stack.layers), s)


def test_past_capacity_small_state(cfg, weights):
    stack = AttentionStack(cfg, {L: weights[L] for L in (0, 1, 2)})
    s = stack.new_state(batch_size=1, capacity=4)
    run_valid(stack, s, [((0,), 3, 7)])
    with rejected(s, StateError, r"sequence 0: positions 3\.\.4 exceed the cache capacity of 4 positions"):
        stack.forward(make_xs(cfg, 1, 2, 8, stack.layers), s)
    run_valid(stack, s, [((0,), 1, 8)])  # the last position still fits
    with rejected(s, StateError, r"sequence 0: positions 4\.\.4 exceed the cache capacity of 4 positions"):
        stack.forward(make_xs(cfg, 1, 1, 9, stack.layers), s)


def test_released_sequence(stack, cfg, state):
    state.release(2)
    with rejected(state, StateError, r"sequence slot 2 was released; add_sequence\(\) reuses it"):
        stack.forward(make_xs(cfg, 1, 1, 13), state, rows=[2])
    with rejected(state, StateError, r"sequence slot 2 was released"):
        stack.step(state, 1)  # default rows: every slot, the released one too


def test_allocation_errors(cfg):
    with pytest.raises(StateError, match=r"capacity must be in 1\.\.max_seq_len=4096, got 4097"):
        AttentionState.allocate(cfg, 1, capacity=4097)
    with pytest.raises(StateError, match=r"capacity must be in 1\.\.max_seq_len=4096, got 0"):
        AttentionState.allocate(cfg, 1, capacity=0)
    with pytest.raises(StateError, match=r"batch_size must be >= 1, got 0"):
        AttentionState.allocate(cfg, 0, capacity=8)
    with pytest.raises(StateError, match=r"rollback must be >= 0, got -1"):
        AttentionState.allocate(cfg, 1, capacity=8, rollback=-1)
    with pytest.raises(StateError, match=r"page_size=3 must be a positive multiple of every compress "
                                         r"ratio \(layer 1 has 2\)"):
        AttentionState.allocate(cfg, 1, capacity=8, page_size=3)
    with pytest.raises(ConfigError, match=r"layer 9 out of range"):
        AttentionState.allocate(cfg, 1, capacity=8, layers=[0, 9])


# ---- ordering within a step ---------------------------------------------------------------------

def test_layer_twice_in_one_step(stack, cfg, state):
    step = stack.step(state, 1, rows=[1, 2])
    stack.layers[0](make_x(cfg, 2, 1, 0), state, step)
    assert state.layers[0].positions.tolist() == [12, 12, 12]
    with rejected(state, StateError, r"layer 0 called out of order: .*layer 1 is next \(done: \[0\]\)"):
        stack.layers[0](make_x(cfg, 2, 1, 0), state, step)
    stack.layers[1](make_x(cfg, 2, 1, 1), state, step)  # a KV source too
    with rejected(state, StateError, r"layer 1 called out of order: .*layer 2 is next"):
        stack.layers[1](make_x(cfg, 2, 1, 1), state, step)


def test_layer_after_a_later_layer(stack, cfg, state):
    step = stack.step(state, 1, rows=[1, 2], layers=[0, 3])  # Full r=1: needs nothing earlier
    stack.layers[0](make_x(cfg, 2, 1, 0), state, step)
    with rejected(state, StateError, r"layer 1 is not one of this step's layers \[0, 3\]"):
        stack.layers[1](make_x(cfg, 2, 1, 1), state, step)
    stack.layers[3](make_x(cfg, 2, 1, 3), state, step)
    with rejected(state, StateError, r"this step is done"):
        stack.layers[3](make_x(cfg, 2, 1, 3), state, step)


def test_reindex_when_candidate_source_has_not_run(stack, cfg, state):
    with rejected(state, StateError, r"layer 5 \(Reindex\) reads what layer 3 publishes in the same "
                                     r"step, but layer 3 is not among the step's layers before it"):
        stack.step(state, 1, rows=[1, 2], layers=[0, 1, 2, 5])


def test_candidate_consumer_needs_candidate_source(cfg, weights):
    # Candidate source 5 (a Reindex layer), so consumer 7's only unmet need is the candidates.
    cfg5 = cfg.replace(candidate_source_layer=5)
    assert cfg5.layer(7).is_candidate_consumer and cfg5.layer(7).kv_source == 3
    stack5 = AttentionStack(cfg5, {L: weights[L] for L in range(8)})
    s = stack5.new_state(batch_size=1, capacity=CAP)
    run_valid(stack5, s, [((0,), 3, 9)])
    with rejected(s, StateError, r"layer 7 \(Reindex\) reads what layer 5 publishes in the same "
                                 r"step, but layer 5 is not among"):
        stack5.step(s, 1, layers=[0, 1, 2, 3, 4, 7])


# ---- states that do not fit the layer -----------------------------------------------------------

def test_state_without_the_layer(stack, cfg):
    s = AttentionState.allocate(cfg, 2, capacity=CAP, layers=[0, 1])
    stack.forward(make_xs(cfg, 2, 3, 10), s, layers=[0, 1])
    step = stack.step(s, 1)
    stack.layers[0](make_x(cfg, 2, 1, 0), s, step)
    stack.layers[1](make_x(cfg, 2, 1, 1), s, step)
    with rejected(s, StateError, r"layer 2 has no caches in this state \(allocated for layers \[0, 1\]\)"):
        stack.layers[2](make_x(cfg, 2, 1, 2), s, step)


def test_state_without_the_kv_source(stack, cfg, state):
    del state.sources[1]
    with rejected(state, StateError, r"layer 1 needs KV source 1, which has no caches in this state"):
        stack.step(state, 1, rows=[1, 2])


def test_state_of_another_config(stack, cfg):
    other = AttentionState.allocate(cfg.replace(window_size=16), 2, capacity=CAP)
    with rejected(other, StateError, r"the state was allocated for a different AttentionConfig"):
        stack.step(other, 1)
    with rejected(other, StateError, r"the state was allocated for a different AttentionConfig"):
        stack.plan_decode(other)


def test_step_of_another_state_changes_neither(stack, cfg, base):
    a, b = clone_state(base), clone_state(base)
    a.index_key_slot = b.index_key_slot = None
    step = stack.step(a, 1, rows=[1, 2])
    snap_a = snapshot(a)
    with rejected(b, StateError, r"the step was opened on a different state"):
        stack.layers[1](make_x(cfg, 2, 1, 1), b, step)  # a KV source: would publish index keys
    assert_unchanged(a, snap_a)


# ---- weights that do not fit the config ---------------------------------------------------------

def test_weights_of_another_config(cfg, weights):
    wide = cfg.replace(dim=96)
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.wq_a\.weight: the config expects shape "
                                         r"\[32, 96\], the weights have \[32, 64\]"):
        AttentionLayer(wide, weights[0])
    with pytest.raises(ValueError, match=r"layers\.1\.attn\.wq_a\.weight: the config expects shape \[32, 96\]"):
        AttentionStack(wide, {1: weights[1]})
    # a config where layer 7 is Reuse (not an index source): Reindex weights have an extra tensor
    no7 = cfg.replace(index_source_layers=(1, 3, 5))
    with pytest.raises(ValueError, match=r"layers\.7\.attn\.indexer\.wq_b\.weight: the config gives layer 7 "
                                         r"no such tensor \(role Reuse\), but the weights have one"):
        AttentionLayer(no7, weights[7])
    # and the other way round: Reuse weights for a Reindex layer lack the indexer
    with pytest.raises(ValueError, match=r"layers\.7\.attn\.indexer\.wq_b\.weight: missing for layer 7"):
        AttentionLayer(cfg, random_layer_weights(no7, 7, seed=0))
    # more heads: wq_b's output grows
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.wq_b\.weight: the config expects shape \[512, 32\], "
                                         r"the weights have \[256, 32\]"):
        AttentionLayer(cfg.replace(n_heads=16), weights[0])


@pytest.mark.parametrize("layer,field,shape,name", [
    (0, "q_norm", (33,), "q_norm.weight"),
    (0, "kv_norm", (31,), "kv_norm.weight"),
    (0, "attn_sink", (9,), "attn_sink"),
    (0, "wo_a", (32, 129), "wo_a.weight"),
    (1, "index_wk", (32, 48), "indexer.wk.weight"),
    (1, "compressor_wgate", (32, 63), "compressor.wgate.weight"),
    (5, "index_weights_proj", (5, 64), "indexer.weights_proj.weight"),
])
def test_layer_weights_with_a_wrong_shape(cfg, weights, layer, field, shape, name):
    w = weights[layer]
    old = getattr(w, field)
    bad = dataclasses.replace(w, **{field: torch.zeros(shape, dtype=old.dtype)})
    msg = (f"layers.{layer}.attn.{name}: the config expects shape {[int(v) for v in old.shape]}, "
           f"the weights have {list(shape)}")
    with pytest.raises(ValueError, match=re.escape(msg)):
        AttentionLayer(cfg, bad)


def test_layer_weights_of_another_layer(cfg, weights):
    # layer 1's (Full, ratio 2) weights claiming to be layer 2 (Reuse)
    with pytest.raises(ValueError, match=r"layers\.2\.attn\.compressor\.wkv\.weight: the config gives layer 2 "
                                         r"no such tensor \(role Reuse\)"):
        AttentionLayer(cfg, dataclasses.replace(weights[1], layer=2))
    # layer 3's (Full, ratio 1, no gate) weights claiming to be layer 1 (Full, ratio 2, gated)
    with pytest.raises(ValueError, match=r"layers\.1\.attn\.compressor\.wgate\.weight: missing for layer 1"):
        AttentionLayer(cfg, dataclasses.replace(weights[3], layer=1))
    with pytest.raises(ConfigError, match=r"layer 9 out of range"):
        AttentionLayer(cfg, dataclasses.replace(weights[0], layer=9))


# ---- nothing was corrupted ----------------------------------------------------------------------

def test_rejections_leave_no_trace_in_later_outputs(stack, cfg, base):
    """All the rejected calls above on one state, some in the middle of a valid step; the state
    then gives bit-identical outputs and caches to a fresh state fed only the valid calls."""
    s = clone_state(base)
    for name, call, exc, match in BAD_CALLS:
        with rejected(s, exc, match):
            call(stack, cfg, s)

    d_xs = make_xs(cfg, 2, 1, 3)  # valid step D: decode rows 1, 2 at 11 (row 0 idle)
    e_xs = make_xs(cfg, 3, 2, 4)  # valid step E: all rows, 2 tokens at 12
    f_xs = {L: make_x(cfg, 1, 3, 5000 + L)[0] for L in range(cfg.n_layers)}  # packed [1+0+2]
    step = stack.step(s, 1, rows=[1, 2])
    out_d = {0: stack.layers[0](d_xs[0], s, step)}
    with rejected(s, StateError, r"layer 0 called out of order"):
        stack.layers[0](d_xs[0], s, step)
    with rejected(s, StateError, r"layer 2 called out of order: .*layer 1 is next"):
        stack.layers[2](d_xs[2], s, step)
    with rejected(s, TypeError, r"x must be bfloat16"):
        stack.layers[1](d_xs[1].float(), s, step)
    with rejected(s, ValueError, r"x has shape \[2, 2, 64\]"):
        stack.layers[1](d_xs[1].repeat(1, 2, 1), s, step)
    for L in (1, 2, 3):
        out_d[L] = stack.layers[L](d_xs[L], s, step)
    with rejected(s, StateError, r"layer 3 called out of order"):
        stack.layers[3](d_xs[3], s, step)
    with rejected(s, ValueError, r"x has shape \[1, 1, 64\]"):
        stack.layers[4](d_xs[4][:1], s, step)
    for L in (4, 5, 6, 7):
        out_d[L] = stack.layers[L](d_xs[L], s, step)
    with rejected(s, StateError, r"this step is done"):
        stack.layers[7](d_xs[7], s, step)
    with rejected(s, StateError, r"positions 12\.\.16 exceed the cache capacity"):
        stack.forward(make_xs(cfg, 3, 5, 5), s)
    out_e = stack.forward(e_xs, s)
    f_step = stack.step(s, [1, 0, 2])  # ragged: rows 0 and 2 at 14, row 1 idle
    with rejected(s, ValueError, r"x must have shape \[sum\(tokens\)=3, dim=64\]"):
        stack.layers[0](f_xs[0][:2], s, f_step)
    out_f = stack.run(f_step, f_xs)

    # The base state has seen only the valid calls PREP (test_base_is_reproducible).
    fresh = clone_state(base)
    ref_d = stack.forward(d_xs, fresh, rows=[1, 2])
    ref_e = stack.forward(e_xs, fresh)
    ref_f = stack.run(stack.step(fresh, [1, 0, 2]), f_xs)

    for L in range(cfg.n_layers):
        assert torch.equal(bytes_of(out_d[L]), bytes_of(ref_d[L])), f"step D, layer {L}"
        assert torch.equal(bytes_of(out_e[L]), bytes_of(ref_e[L])), f"step E, layer {L}"
        assert torch.equal(bytes_of(out_f[L]), bytes_of(ref_f[L])), f"step F, layer {L}"
    assert_same(snapshot(fresh), snapshot(s))
    assert s.layers[0].positions.tolist() == [15, 14, 16]


# ---- regressions of bugs found in review -------------------------------------------------------------------------------

def test_forward_over_a_later_subset_of_layers(cfg, weights):
    stack = AttentionStack(cfg, {0: weights[0], 8: weights[8]})
    x0, x8 = make_x(cfg, 1, 3, 20), make_x(cfg, 1, 3, 28)
    together = stack.new_state(batch_size=1, capacity=CAP)
    want = stack.forward({0: x0, 8: x8}, together)
    split = stack.new_state(batch_size=1, capacity=CAP)
    got0 = stack.forward({0: x0}, split, layers=[0])
    got8 = stack.forward({8: x8}, split, layers=[8])
    assert torch.equal(got0[0], want[0]) and torch.equal(got8[8], want[8])
    assert_same(snapshot(together), snapshot(split))


def test_stack_forward_is_all_or_nothing(stack, cfg, state):
    xs = make_xs(cfg, 2, 1, 12)
    xs[4] = xs[4].float()
    with rejected(state, TypeError, r"x must be bfloat16"):
        stack.forward(xs, state, rows=[1, 2])


def test_rejected_call_then_fork_does_not_corrupt(stack, cfg):
    pre = make_xs(cfg, 1, 4, 30)
    nxt = make_xs(cfg, 2, 1, 31)

    def run(with_rejected_call: bool):
        s = stack.new_state(batch_size=2, capacity=CAP, page_size=4)
        s.release(1)
        stack.forward(pre, s, rows=[0])  # position 4: exactly one full page
        if with_rejected_call:
            step = stack.step(s, 1, rows=[0])
            with pytest.raises(TypeError, match="bfloat16"):
                stack.layers[0](nxt[0][:1].float(), s, step)
        new = s.fork(0)
        return s, stack.forward(nxt, s, rows=[0, new])

    (want_s, want), (got_s, got) = run(False), run(True)
    rows = torch.arange(2)
    # parent (row 0) and fork (row 1) each keep their own compressed row 4 and index key 4
    assert torch.equal(got_s.read_compressed(3, rows, 5), want_s.read_compressed(3, rows, 5))
    assert torch.equal(got_s.read_index_keys(3, rows, 5), want_s.read_index_keys(3, rows, 5))
    for L in range(cfg.n_layers):
        assert torch.equal(got[L], want[L]), f"layer {L}"
