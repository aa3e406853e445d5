"""Steps are transactions, and a serving state never gives a wrong answer silently.

An exception inside any layer of a step (or ``step.abort()``) leaves every tensor and host
list of the state as before the step and the sequences usable; stale steps and plans,
foreign states and rollbacks past the kept history raise. Each issue-9 reproduction is a test.
"""
import dataclasses

import pytest
import torch

from conftest import assert_same, clone_state, make_xs, snapshot
from dsv41attn import AttentionStack, StateError, preset, random_layer_weights
from dsv41attn.cache import AttentionState



@pytest.fixture(scope="module")
def cfg():
    return preset("tiny")


@pytest.fixture(scope="module")
def weights(cfg):
    return {L: random_layer_weights(cfg, L, seed=0) for L in range(cfg.n_layers + cfg.n_mtp_layers)}


def _stack(cfg, weights, backend="reference", layers=None):
    layers = range(cfg.n_layers + cfg.n_mtp_layers) if layers is None else layers
    return AttentionStack(cfg, {L: weights[L] for L in layers}, backend=backend)


def _packed(cfg, tokens, seed):
    """Per-layer packed inputs [sum(tokens), dim]."""
    return {L: x.reshape(-1, cfg.dim)[: sum(tokens)]
            for L, x in make_xs(cfg, 1, sum(tokens), seed, range(cfg.n_layers + 1)).items()}


def _run(stack, state, tokens, rows, seed):
    step = stack.step(state, tokens, rows=rows)
    return stack.run(step, _packed(stack.cfg, tokens, seed))


class Boom(RuntimeError):
    pass


def _raising(ops, op_name):
    def boom(*a, **k):
        raise Boom(op_name)
    return dataclasses.replace(ops, **{op_name: boom})


def _prepared(stack):
    state = stack.new_state(2, capacity=40, page_size=4, rollback=4)
    _run(stack, state, [7, 3], [0, 1], seed=1)
    return state


def _stack_and_base(cfg, weights, backend):
    """The stack under test and a prepared state for it. Every layer on the reference backend;
    under the interpreter (slow) layers 0-5, one of every role (SWA, the r = 2 source and its
    reuser, the r = 1 candidate source and its reuser, Reindex), on a state the reference
    prepared (the state's layout does not depend on the backend: any valid state serves)."""
    if backend == "reference":
        stack = _stack(cfg, weights)
        return stack, _prepared(stack)
    layers = range(6)
    return _stack(cfg, weights, backend, layers), _prepared(_stack(cfg, weights, layers=layers))


@pytest.mark.parametrize("backend,op_name", [
    ("reference", "sparse_attn_paged"), ("reference", "output_projection"),
    pytest.param("triton", "output_projection", marks=[pytest.mark.triton, pytest.mark.skipif(
        torch.cuda.is_available(), reason="CPU tensors: runs under the interpreter only")])])
def test_a_layer_that_raises_undoes_the_whole_step(cfg, weights, backend, op_name):
    """At every layer of a mixed step (a chunk across a group and page boundary, and a decode):
    the state is bit for bit as before, and the same step then gives what an untouched state
    gives."""
    stack, base = _stack_and_base(cfg, weights, backend)
    # the interpreter is slow: failing at 5 undoes the writes of every role before it
    layers = list(stack.layers) if backend == "reference" else [5]
    want = _run(stack, clone_state(base), [5, 1], [0, 1], seed=2)
    for L in layers:
        state = clone_state(base)
        before = snapshot(state)
        good = stack.layers[L].ops
        stack.layers[L].ops = _raising(good, op_name)
        try:
            with pytest.raises(Boom):
                _run(stack, state, [5, 1], [0, 1], seed=2)
        finally:
            stack.layers[L].ops = good
        assert_same(before, snapshot(state))
        got = _run(stack, state, [5, 1], [0, 1], seed=2)
        for layer in want:
            assert torch.equal(got[layer], want[layer]), (L, layer)


@pytest.mark.parametrize("backend,op_name", [
    ("reference", "sparse_attn_paged"), ("reference", "index_topk"),
    pytest.param("triton", "output_projection", marks=[pytest.mark.triton, pytest.mark.skipif(
        torch.cuda.is_available(), reason="CPU tensors: runs under the interpreter only")])])
def test_a_decode_plan_layer_that_raises_undoes_the_step(cfg, weights, backend, op_name):
    """A decode plan writes a layer's ring rows and positions, and a ratio > 1 source's recent
    ring, before the attention: an op raising after them (attention, indexer, output) leaves
    the state bit for bit as before, and the plan's same step then gives what an untouched
    state gives."""
    stack, base = _stack_and_base(cfg, weights, backend)
    xs = {L: x.reshape(-1, cfg.dim)[:2] for L, x in make_xs(cfg, 1, 2, 5, stack.layers).items()}
    want = stack.plan_decode(clone_state(base), steps=1).run(xs)
    # the interpreter is slow: failing at 5 (Reindex) undoes the early writes of every role
    # before it (SWA, the r = 2 and r = 1 sources) and its own
    layers = [5] if backend == "triton" else \
        [L for L in stack.layers if op_name != "index_topk" or cfg.layer(L).is_index_source]
    for L in layers:
        state = clone_state(base)
        before = snapshot(state)
        plan = stack.plan_decode(state, steps=1)
        good = stack.layers[L].ops
        stack.layers[L].ops = _raising(good, op_name)
        try:
            with pytest.raises(Boom):
                plan.run(xs)
        finally:
            stack.layers[L].ops = good
        assert_same(before, snapshot(state))
        got = plan.run(xs)
        for layer in want:
            assert torch.equal(got[layer], want[layer]), (L, layer)


def test_abort_mid_step_and_release_always_work(cfg, weights):
    stack = _stack(cfg, weights)
    state = _prepared(stack)
    before = snapshot(state)
    step = stack.step(state, [2, 2])
    xs = _packed(cfg, [2, 2], seed=3)
    stack.run(step, xs, layers=[0, 1, 2])
    with pytest.raises(StateError, match="mid-step"):
        state.truncate(0, 5)
    with pytest.raises(StateError, match="mid-step"):
        stack.step(state, 1, rows=[0])
    step.abort()
    assert_same(before, snapshot(state))
    with pytest.raises(StateError, match="aborted"):
        stack.run(step, xs)
    step = stack.step(state, [2, 2])
    stack.run(step, xs, layers=[0, 1])
    state.release(1)  # aborts the step it was in: the other sequence is back as before too
    assert state.position_of(0) == 7 and step.status == "aborted"
    assert state.open_step == [None, None]


def test_a_layer_without_its_source_is_rejected_before_anything_changes(cfg, weights):
    """stack.forward(xs, state, layers=[0, 2]) on the tiny preset: layer 2 reuses layer 1."""
    stack = _stack(cfg, weights)
    state = _prepared(stack)
    before = snapshot(state)
    xs = make_xs(cfg, 2, 1, seed=4)
    with pytest.raises(StateError, match="layer 2 .* reads what layer 1 publishes"):
        stack.forward(xs, state, layers=[0, 2])
    assert_same(before, snapshot(state))
    state.release(0)
    _run(stack, state, [2], [1], seed=5)


# ---- issue 9: the reproductions -------------------------------------------------------------

def test_two_rollbacks_count_together(cfg, weights):
    stack = _stack(cfg, weights, layers=range(cfg.n_layers))
    s = stack.new_state(1, capacity=32, rollback=4)
    _run(stack, s, [10], [0], seed=1)
    _run(stack, s, [4], [0], seed=2)  # 4 drafts, rejected
    s.truncate(0, 10)
    with pytest.raises(StateError, match="rollback=4"):
        s.truncate(0, 8)  # the drafts overwrote the ring slots positions 8-9 need
    assert s.position_of(0) == 10


def test_a_step_opened_before_release_never_runs(cfg, weights):
    stack = _stack(cfg, weights, layers=range(cfg.n_layers))
    s = stack.new_state(2, capacity=16, page_size=4, num_pages=3)
    _run(stack, s, [4], [0], seed=1)
    _run(stack, s, [8], [1], seed=2)
    s.release(0)
    assert s.add_sequence() == 0
    step = stack.step(s, [3], rows=[0])
    s.release(0)
    s.add_sequence()
    table = s.block_table.clone()
    with pytest.raises(StateError, match="aborted"):
        stack.run(step, _packed(cfg, [3], seed=3))
    assert torch.equal(s.block_table, table)


def test_truncate_on_an_open_step_takes_its_pages_back_safely(cfg, weights):
    stack = _stack(cfg, weights, layers=range(cfg.n_layers))
    s = stack.new_state(1, capacity=16, page_size=4, num_pages=3)
    _run(stack, s, [4], [0], seed=1)
    step = stack.step(s, [2])
    s.truncate(0, 4)
    assert s.free_pages == 2  # the step's page is back
    with pytest.raises(StateError, match="aborted"):
        stack.run(step, _packed(cfg, [2], seed=2))


def test_an_older_decode_plan_is_stale_after_a_newer_one(cfg, weights):
    stack = _stack(cfg, weights, layers=range(cfg.n_layers))
    s = stack.new_state(1, capacity=32, page_size=4)
    _run(stack, s, [8], [0], seed=1)
    xs = {L: x[:, 0] for L, x in make_xs(cfg, 1, 1, seed=2).items()}
    a = stack.plan_decode(s, steps=6)
    a.run(xs)
    b = stack.plan_decode(s, steps=3)
    for _ in range(3):
        b.run(xs)
    with pytest.raises(StateError, match="changed since this plan"):
        a.run(xs)


def test_a_state_of_another_config_is_refused(cfg, weights):
    stack = _stack(cfg, weights, layers=range(cfg.n_layers))
    other = AttentionState.allocate(cfg.replace(window_size=16), 1, capacity=16, page_size=4)
    before = snapshot(other)
    with pytest.raises(StateError, match="different AttentionConfig"):
        stack.plan_decode(other)
    with pytest.raises(StateError, match="different AttentionConfig"):
        stack.step(other, [1])
    assert_same(before, snapshot(other))


def test_rejected_calls_change_nothing(cfg, weights):
    stack = _stack(cfg, weights, layers=range(cfg.n_layers))
    few = AttentionState.allocate(cfg, 1, capacity=16, page_size=4, layers=[0, 1])
    before = snapshot(few)
    with pytest.raises(StateError, match="layer 2 has no caches"):
        stack.forward(make_xs(cfg, 1, 2, seed=1), few, layers=[0, 1, 2])
    assert_same(before, snapshot(few))
    s = stack.new_state(3, capacity=16, page_size=4, num_pages=4)
    s.release(2)
    _run(stack, s, [4, 0], [0, 1], seed=1)
    s.fork(0)  # slot 2 shares the full page
    before = snapshot(s)
    with pytest.raises(KeyError):
        stack.forward(make_xs(cfg, 2, 1, seed=2), s, layers=[0, 99])
    assert_same(before, snapshot(s))


def test_one_list_layout_for_every_call_kind(cfg, weights):
    """A 6-token prefill, 6 single decodes and chunks 2+1+3 give the same bits."""
    stack = _stack(cfg, weights, layers=range(cfg.n_layers))
    xs = _packed(cfg, [6], seed=7)
    outs = []
    for chunks in ([6], [1] * 6, [2, 1, 3]):
        s = stack.new_state(1, capacity=16)
        got, at = {L: [] for L in range(cfg.n_layers)}, 0
        for m in chunks:
            y = stack.run(stack.step(s, [m]), {L: x[at:at + m] for L, x in xs.items()})
            for L in got:
                got[L].append(y[L])
            at += m
        outs.append({L: torch.cat(v) for L, v in got.items()})
    for other in outs[1:]:
        for L in outs[0]:
            assert torch.equal(outs[0][L], other[L]), L


def test_inputs_are_not_coerced(cfg, weights):
    stack = _stack(cfg, weights, layers=range(cfg.n_layers))
    s = stack.new_state(2, capacity=16)
    before = snapshot(s)
    for kwargs, exc in [({"tokens": [1], "rows": [0.9]}, TypeError),
                        ({"tokens": "12"}, TypeError),
                        ({"tokens": [1.5, 1]}, TypeError),
                        ({"tokens": 2.5}, TypeError),
                        ({"tokens": None}, TypeError),
                        ({"tokens": 1, "rows": [10 ** 20]}, IndexError),
                        ({"tokens": 1, "rows": "0"}, TypeError)]:
        with pytest.raises(exc) as e:
            stack.step(s, **kwargs)
        bad = kwargs.get("rows", kwargs["tokens"])
        assert repr(bad if not isinstance(bad, list) else bad[0])[:6] in str(e.value), (kwargs, e)
    with pytest.raises(TypeError, match="rows"):
        stack.plan_decode(s, rows=[0.5, 1])
    with pytest.raises(TypeError, match="state must be an AttentionState"):
        stack.step(None, 1)
    with pytest.raises(TypeError, match="step must be a Step"):
        stack.run(None, {})
    assert_same(before, snapshot(s))
    import numpy as np
    _run(stack, s, [np.int64(2), 0], [0, 1], seed=1)  # numpy integers are integers
    xs = {L: v[0].requires_grad_() for L, v in make_xs(cfg, 1, 1, seed=2).items()}
    out = _run(stack, s, [1, 0], [0, 1], seed=3) and stack.run(stack.step(s, [1, 0]), xs)
    assert not any(y.requires_grad for y in out.values())
    assert not any(src.recent_kv.requires_grad for src in s.sources.values()
                   if src.recent_kv is not None)
    with pytest.raises(ValueError, match="weights of layer 1"):
        AttentionStack(cfg, {0: weights[1], 1: weights[0]})


@pytest.mark.parametrize("call,exc,match", [
    (lambda st, s: s.truncate(0, 2.5), TypeError, r"position must be an int, got 2\.5"),
    (lambda st, s: s.truncate(0, "1"), TypeError, r"position must be an int, got '1'"),
    (lambda st, s: s.truncate("0", 1), TypeError, r"row must be an int, got '0'"),
    (lambda st, s: s.fork(0.0), TypeError, r"row must be an int, got 0\.0"),
    (lambda st, s: s.fork(0, share="yes"), TypeError, r"share must be a bool, got 'yes'"),
    (lambda st, s: s.release(7), IndexError, r"sequence slot 7 out of range 0\.\.1"),
    (lambda st, s: st.plan_decode(s, layers=[99]), KeyError, r"layers \[99\] are not in this stack"),
    (lambda st, s: st.plan_decode(s, steps=2.5), ValueError, r"steps must be an int >= 1, got 2\.5"),
    (lambda st, s: st.forward({0: torch.zeros(2, 1, 64, dtype=torch.bfloat16)}, s),
     KeyError, r"xs has no input for layers \[1, 2"),
    (lambda st, s: st.step(s, 1, layers="0"), TypeError, r"layers must be a sequence"),
], ids=["truncate-float", "truncate-str", "truncate-row-str", "fork-float", "fork-share",
        "release-range", "plan-layer", "plan-steps", "forward-missing-layer", "step-layers-str"])
def test_public_entry_points_name_the_bad_argument(cfg, weights, call, exc, match):
    stack = _stack(cfg, weights, layers=range(cfg.n_layers))
    s = stack.new_state(2, capacity=16, page_size=4)
    _run(stack, s, [3, 2], [0, 1], seed=1)
    before = snapshot(s)
    with pytest.raises(exc, match=match):
        call(stack, s)
    assert_same(before, snapshot(s))


@pytest.mark.parametrize("kwargs,exc,match", [
    ({"batch_size": 2.5}, TypeError, r"batch_size must be an int, got 2\.5"),
    ({"rollback": 2.5}, TypeError, r"rollback must be an int, got 2\.5"),
    ({"num_pages": -1}, StateError, r"num_pages must be >= 0, got -1"),
    ({"page_size": 0}, StateError, r"page_size must be >= 1, got 0"),
    ({"max_tokens_per_call": 0}, StateError, r"max_tokens_per_call must be >= 1, got 0"),
], ids=["batch-float", "rollback-float", "pages-negative", "page-size-0", "max-tokens-0"])
def test_allocation_names_the_bad_argument(cfg, kwargs, exc, match):
    args = {"batch_size": 1, **kwargs}
    with pytest.raises(exc, match=match):  # a window-only stack too (page_size was / 0)
        AttentionState.allocate(cfg, layers=[0], capacity=8, **args)
