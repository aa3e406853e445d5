"""Serving state: ragged batches, chunked prefill, multi-token decode, packed paged caches,
rollback, fork and release.

Every op of the reference path is row-independent and the window list only changes layout
across 64-entry blocks, so with windows <= 64 any schedule reproduces token-by-token decode
bit for bit: these tests demand exact equality.
"""
import random

import pytest
import torch

from conftest import fixture_files
from dsv41attn import AttentionStack, StateError, preset, random_layer_weights
from dsv41attn.fixtures import Fixture, compare, parse_schedule, replay

TINY = preset("tiny")
# A second geometry: window 5, ratio-2 group of 3 layers, 4 candidate blocks of 3, top-k 5.
ODD = TINY.replace(window_size=5, compress_ratios=(0, 2, 2, 2, 1, 1, 1, 1, 0),
                   kv_source_layers=(1, 4), index_source_layers=(1, 3, 4, 6),
                   candidate_source_layer=4, candidate_topk_blocks=4, candidate_block_size=3,
                   index_topk=5)
CONFIGS = {"tiny": TINY, "odd": ODD}
_STACKS: dict = {}


def _stack(name: str) -> AttentionStack:
    if name not in _STACKS:
        cfg = CONFIGS[name]
        _STACKS[name] = AttentionStack(cfg, {L: random_layer_weights(cfg, L, seed=7)
                                             for L in range(cfg.n_layers)})
    return _STACKS[name]


def _inputs(cfg, n_seq: int, length: int, seed: int) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {L: torch.randn(n_seq, length, cfg.dim, generator=g).bfloat16()
            for L in range(cfg.n_layers)}


def _run(stack, xs, schedule, **state_kw):
    """schedule: per sequence, its chunk lengths; batch step k runs every sequence's k-th chunk.
    Returns per layer [n_seq, length, dim] outputs and per index source per-token top-k sets."""
    n_seq = len(schedule)
    length = sum(schedule[0])
    state = stack.new_state(n_seq, capacity=64, **state_kw)
    outs = {L: torch.zeros(n_seq, length, stack.cfg.dim, dtype=torch.bfloat16) for L in stack.layers}
    tops = {L: [[None] * length for _ in range(n_seq)] for L in stack.layers
            if stack.cfg.layer(L).is_index_source}
    pos = [0] * n_seq
    for k in range(max(len(s) for s in schedule)):
        counts = [s[k] if k < len(s) else 0 for s in schedule]
        step = stack.step(state, counts)
        for L, layer in stack.layers.items():
            x = torch.cat([xs[L][b, p:p + c] for b, (p, c) in enumerate(zip(pos, counts))])
            y = layer(x, state, step)
            for b, (p, c) in enumerate(zip(pos, counts)):
                a = step.cu_seqlens[b]
                outs[L][b, p:p + c] = y[a:a + c]
                if L in tops:
                    for i in range(c):
                        row = step.topk(L)[a + i]
                        tops[L][b][p + i] = sorted(row[row >= 0].tolist())
        pos = [p + c for p, c in zip(pos, counts)]
    return outs, tops, state


def _random_chunks(rng: random.Random, length: int) -> list[int]:
    out = []
    while sum(out) < length:
        out.append(min(rng.choice([1, 1, 2, 3, 4, 5, 7, 9, 13]), length - sum(out)))
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_equals_chunked_equals_decode_in_ragged_batches(name):
    stack = _stack(name)
    cfg = stack.cfg
    length = 31
    xs = _inputs(cfg, 4, length, seed=11)
    rng = random.Random(5)
    # Boundaries: window (5 / 8), ratio groups, index_topk x ratio (8-10), candidate blocks.
    schedules = {
        "prefill": [[length]] * 4,
        "decode": [[1] * length] * 4,
        "ragged": [[length], [1] * length, [4, 1, 4, 9, 13], _random_chunks(rng, length)],
        "straddle": [[cfg.window_size - 1, 2, cfg.window_size + 1, length - 2 * cfg.window_size - 2],
                     [cfg.index_topk * 2 - 1, 1, 1, length - cfg.index_topk * 2 - 1],
                     [3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 1], [2 * cfg.window_size + 3, 1, length - 2 * cfg.window_size - 4]],
    }
    results = {k: _run(stack, xs, s) for k, s in schedules.items()}
    ref_out, ref_top, _ = results["decode"]
    for key, (out, top, _) in results.items():
        for L in stack.layers:
            assert torch.equal(out[L], ref_out[L]), f"{key}: layer {L} differs from decode"
        assert top == ref_top, f"{key}: top-k differs"
    # The test can fail: another sequence's inputs give other outputs.
    assert not torch.equal(ref_out[1][0], ref_out[1][1])


def test_idle_slots_and_sequences_alone_match_the_batch():
    stack = _stack("tiny")
    xs = _inputs(stack.cfg, 3, 20, seed=3)
    together, _, _ = _run(stack, xs, [[5, 15], [1] * 20, [20]])
    for b in range(3):
        alone, _, _ = _run(stack, {L: v[b:b + 1] for L, v in xs.items()}, [[7, 13]])
        for L in stack.layers:
            assert torch.equal(together[L][b], alone[L][0])


def test_paged_pool_small_pages_share_and_reuse():
    stack = _stack("tiny")
    xs = _inputs(stack.cfg, 3, 26, seed=4)
    big, _, _ = _run(stack, xs, [[26], [13, 13], [1] * 26])
    small, _, state = _run(stack, xs, [[26], [13, 13], [1] * 26], page_size=4, num_pages=21)
    for L in stack.layers:
        assert torch.equal(big[L], small[L])
    assert state.free_pages == 0  # 3 sequences x ceil(26 / 4) pages
    state.release(1)
    assert state.free_pages == 7
    row = state.add_sequence()
    assert row == 1 and state.position_of(1) == 0


def _snapshot(state):
    tensors = [t.clone() for ls in state.layers.values() for t in (ls.window, ls.positions)]
    for s in state.sources.values():
        tensors += [s.rows.clone(), s.index_keys.clone()]
        if s.recent_kv is not None:
            tensors += [s.recent_kv.clone(), s.recent_score.clone()]
    return tensors, state.block_table.clone(), list(state.page_refs), list(state.active)


def _assert_unchanged(state, snap):
    tensors, table, refs, active = _snapshot(state)
    assert all(torch.equal(a, b) for a, b in zip(tensors, snap[0]))
    assert torch.equal(table, snap[1]) and refs == snap[2] and active == snap[3]


def test_out_of_pages_raises_before_any_write():
    stack = _stack("tiny")
    cfg = stack.cfg
    state = stack.new_state(2, capacity=64, page_size=4, num_pages=5)
    x = torch.randn(2, 8, cfg.dim).bfloat16()
    stack.forward({L: x for L in stack.layers}, state)  # 2 pages each
    snap = _snapshot(state)
    with pytest.raises(StateError, match="out of cache pages"):
        stack.step(state, [5, 5])  # needs 2 + 2 pages, 1 free
    _assert_unchanged(state, snap)


def test_rollback_equals_decoding_without_rejected_tokens():
    stack = _stack("tiny")
    cfg = stack.cfg
    xs = _inputs(cfg, 1, 30, seed=9)
    draft = _inputs(cfg, 1, 5, seed=10)
    expected, _, _ = _run(stack, xs, [[17, 1, 1, 11]])
    state = stack.new_state(1, capacity=64, rollback=6)
    stack.forward({L: xs[L][:, :17] for L in stack.layers}, state)
    # Verify 5 draft tokens at once (position 17..21), accept the first one only.
    stack.forward({L: torch.cat([xs[L][:, 17:18], draft[L][:, 1:]], 1) for L in stack.layers},
                  state)
    state.truncate(0, 18)
    outs = [stack.forward({L: xs[L][:, 18:19] for L in stack.layers}, state),
            stack.forward({L: xs[L][:, 19:30] for L in stack.layers}, state)]
    for L in stack.layers:
        got = torch.cat([o[L] for o in outs], 1)
        assert torch.equal(got, expected[L][:, 18:30]), f"layer {L}"


def test_fork_shares_prefix_and_copies_on_write():
    stack = _stack("tiny")
    cfg = stack.cfg
    xs = _inputs(cfg, 2, 24, seed=12)
    for share in (True, False):
        state = stack.new_state(2, capacity=64, page_size=4, rollback=4)
        prefix = {L: xs[L][0:1, :10] for L in stack.layers}
        stack.forward(prefix, state, rows=[0])
        state.release(1)
        new = state.fork(0, share=share)
        assert new == 1
        # Continue both with different tokens; each must equal an independent run.
        a = stack.forward({L: xs[L][0:1, 10:24] for L in stack.layers}, state, rows=[0])
        state.truncate(1, 8)  # inside a shared page: must copy it, not write through
        b = stack.forward({L: xs[L][1:2, 8:24] for L in stack.layers}, state, rows=[1])
        ref_a, _, _ = _run(stack, {L: v[0:1] for L, v in xs.items()}, [[10, 14]])
        ref_b_in = {L: torch.cat([xs[L][0:1, :8], xs[L][1:2, 8:24]], 1) for L in stack.layers}
        ref_b, _, _ = _run(stack, ref_b_in, [[8, 16]])
        for L in stack.layers:
            assert torch.equal(a[L], ref_a[L][:, 10:24]), (share, L)
            assert torch.equal(b[L], ref_b[L][:, 8:24]), (share, L)


def test_rollback_into_a_shared_page_with_the_pool_full():
    """Rolling back into a page shared with a fork needs a page for the copy. The pages the
    rollback itself frees count (before, it was refused whenever the pool was empty); with
    none at all it is refused, naming the sequence and page, and nothing changes."""
    stack = _stack("tiny")
    cfg = stack.cfg
    xs = _inputs(cfg, 2, 24, seed=14)
    # 10 tokens: pages [0-3], [4-7] shared by the fork, [8-11] copied; 5 pages in all
    state = stack.new_state(2, capacity=64, page_size=4, rollback=8, num_pages=5)
    stack.forward({L: xs[L][0:1, :10] for L in stack.layers}, state, rows=[0])
    state.release(1)
    assert state.fork(0, share=True) == 1
    stack.forward({L: xs[L][1:2, 10:13] for L in stack.layers}, state, rows=[1])  # + [12-15]
    assert state.free_pages == 0
    state.truncate(1, 6)  # drops its own 2 pages, copies [4-7] into one of them
    assert state.free_pages == 1
    b = stack.forward({L: xs[L][1:2, 6:12] for L in stack.layers}, state, rows=[1])
    ref_in = {L: torch.cat([xs[L][0:1, :6], xs[L][1:2, 6:12]], 1) for L in stack.layers}
    ref, _, _ = _run(stack, ref_in, [[6, 6]])
    for L in stack.layers:
        assert torch.equal(b[L], ref[L][:, 6:12]), L
    a = stack.forward({L: xs[L][0:1, 10:12] for L in stack.layers}, state, rows=[0])
    ref, _, _ = _run(stack, {L: v[0:1, :12] for L, v in xs.items()}, [[10, 2]])
    for L in stack.layers:  # the fork's source kept its own [4-7]
        assert torch.equal(a[L], ref[L][:, 10:12]), L

    # nothing to free: a fork at a page boundary shares every page; the pool is then filled
    state = stack.new_state(2, capacity=64, page_size=4, rollback=8, num_pages=4)
    stack.forward({L: xs[L][0:1, :8] for L in stack.layers}, state, rows=[0])
    state.release(1)
    assert state.fork(0, share=True) == 1
    stack.forward({L: xs[L][0:1, 8:16] for L in stack.layers}, state, rows=[0])
    assert state.free_pages == 0
    snap = _snapshot(state)
    with pytest.raises(StateError, match=r"roll sequence 1 back to 6: out of cache pages for "
                                         r"the copy-on-write of its page \d+"):
        state.truncate(1, 6)
    _assert_unchanged(state, snap)
    state.release(0)  # its pages past the shared ones go back to the pool
    state.truncate(1, 6)
    b = stack.forward({L: xs[L][1:2, 6:12] for L in stack.layers}, state, rows=[1])
    ref_in = {L: torch.cat([xs[L][0:1, :6], xs[L][1:2, 6:12]], 1) for L in stack.layers}
    ref, _, _ = _run(stack, ref_in, [[6, 6]])
    for L in stack.layers:
        assert torch.equal(b[L], ref[L][:, 6:12]), L


def test_bad_serving_calls_change_nothing():
    stack = _stack("tiny")
    cfg = stack.cfg
    state = stack.new_state(3, capacity=20, rollback=2, max_tokens_per_call=12)
    x = torch.randn(3, 6, cfg.dim).bfloat16()
    stack.forward({L: x for L in stack.layers}, state)
    state.release(2)
    snap = _snapshot(state)
    with pytest.raises(ValueError, match="13 tokens"):
        stack.step(state, [13, 0], rows=[0, 1])
    with pytest.raises(StateError, match="released"):
        stack.step(state, 1, rows=[2])
    with pytest.raises(StateError, match="roll sequence 0 back to 7"):
        state.truncate(0, 7)
    with pytest.raises(StateError, match="rollback=2 tokens"):
        state.truncate(0, 3)
    with pytest.raises(StateError, match="released"):
        state.truncate(2, 0)
    with pytest.raises(ValueError, match="tokens must be >= 0, got -1"):
        stack.step(state, [-1, 2], rows=[0, 1])
    _assert_unchanged(state, snap)
    step = stack.step(state, [1, 1], rows=[0, 1])
    state.truncate(1, 5)  # the unstarted step is undone: its rows changed
    with pytest.raises(StateError, match="aborted"):
        stack.layers[0](torch.randn(2, cfg.dim).bfloat16(), state, step)


def test_exceeding_capacity_changes_nothing():
    stack = _stack("tiny")
    state = stack.new_state(2, capacity=20)
    x = torch.randn(2, 6, stack.cfg.dim).bfloat16()
    stack.forward({L: x for L in stack.layers}, state)
    snap = _snapshot(state)
    with pytest.raises(StateError, match="exceed the cache capacity"):
        stack.step(state, [15, 1])
    _assert_unchanged(state, snap)


@pytest.mark.parametrize("schedule", ["13,1,1,4,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1;"
                                      "1,12,6,27", "46;5,5,5,5,5,5,5,5,6"])
def test_ragged_fixture_schedules_reproduce_official_decode(schedule):
    path = next(f for f in fixture_files() if f.stem == "tiny_roles")
    fx = Fixture.load(str(path))
    res = replay(fx, ["fixed"], schedule=parse_schedule(schedule))["fixed"]
    c = compare(fx, res, "fixed")
    assert c["topk_rows"][0] == 0
    for L in fx.layers:
        assert torch.equal(res[f"out.fixed.l{L}"], fx.expected("fixed", L)), L


@pytest.mark.slow
def test_v41_geometry_chunks_and_decodes_straddling_topk_times_ratio():
    """V4.1 head geometry (window 128, index_topk 512, ratios 2 and 1): uneven chunks longer
    and shorter than the window, and single decodes at positions 511/512 (index_topk x 1) and
    1023/1024 (index_topk x 2), against the official outputs: bit for bit (the fixtures' CPU
    kernels, docs/numerics.md §8), and within the fixture's tolerances."""
    from test_fixtures import check_within_tolerances

    fx = Fixture.load(str(next(f for f in fixture_files() if f.stem == "v41_geometry")))
    res = replay(fx, ["fixed"], schedule=[[511, 1, 1, 510, 1, 1, 79]])["fixed"]
    c = compare(fx, res, "fixed")
    check_within_tolerances(fx, c, "fixed")
    assert c["topk_rows"][0] == 0
    for L in fx.layers:
        assert torch.equal(res[f"out.fixed.l{L}"], fx.expected("fixed", L)), L


def test_kv_bytes_per_token_v41_flash():
    cfg = preset("v41-flash")
    from dsv41attn import AttentionState
    state = AttentionState.allocate(cfg, 1, capacity=512, layers=list(range(40)))
    b = state.kv_bytes_per_token()
    assert b["compressed"] == 890
    assert b["window_per_sequence"] == 40 * 128 * 528


def test_rows_select_and_reorder_sequences():
    stack = _stack("tiny")
    cfg = stack.cfg
    xs = _inputs(cfg, 3, 9, seed=21)
    a = stack.new_state(3, capacity=64)
    b = stack.new_state(3, capacity=64)
    ya = stack.forward({L: xs[L] for L in stack.layers}, a, rows=[0, 1, 2])
    order = [2, 0, 1]
    yb = stack.forward({L: xs[L][order] for L in stack.layers}, b, rows=order)
    for L in stack.layers:
        assert torch.equal(ya[L][order], yb[L])
    sub = stack.forward({L: xs[L][1:2, :4] for L in stack.layers}, stack.new_state(3, capacity=64),
                        rows=[1])
    for L in stack.layers:
        assert torch.equal(sub[L][0], ya[L][1, :4])  # causal: a prefix of the same sequence


def test_rollback_before_the_start_is_rejected():
    stack = _stack("tiny")
    state = stack.new_state(1, capacity=32, rollback=4)
    stack.forward({L: torch.randn(1, 3, stack.cfg.dim).bfloat16() for L in stack.layers}, state)
    with pytest.raises(StateError, match="back to -1"):
        state.truncate(0, -1)
    state.truncate(0, 0)
    assert state.position_of(0) == 0
