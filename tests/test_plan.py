"""A step's plan (dsv41attn/plan.py): the per-token window list, ring writes and compressor
grouping of ``StepPlan.derive``, read through the public API, against a plain-Python oracle."""
import torch

from conftest import make_x, make_xs
from dsv41attn import AttentionStack, preset, random_layer_weights


def _check_plan(cfg, state, step, ring, pos, rows, tokens):
    """Every token of ``step`` (``tokens[i]`` for state row ``rows[i]``, 0 = idle) against the
    oracle. ``pos``: row -> position before the step; ``ring``: flat ring slot -> (row,
    position) it holds. Both are advanced to after the step."""
    W, S, B = cfg.window_size, state.ring_slots, state.batch_size
    n_ring = B * S
    plan = step.plan
    busy = [(r, m) for r, m in zip(rows, tokens) if m]
    assert plan.rows == [r for r, _ in busy] and plan.tokens == [m for _, m in busy]
    packed = [(r, pos[r], p) for r, m in busy for p in range(pos[r], pos[r] + m)]  # (row, start, P)
    first = {}
    for t, (r, _, _) in enumerate(packed):
        first.setdefault(r, t)
    T = len(packed)
    assert plan.pos.tolist() == [p for _, _, p in packed]
    assert plan.token_row.tolist() == [r for r, _, _ in packed]
    assert plan.window_ids.dtype == torch.int32 and plan.window_ids.shape == (T, W)

    for t, (r, s, P) in enumerate(packed):
        want = list(range(max(0, P - W + 1), P + 1))
        ids = plan.window_ids[t].tolist()
        assert ids[len(want):] == [-1] * (W - len(want)), (t, ids)
        for p, i in zip(want, ids):
            if p < s:  # written by an earlier step: ring row row*S + p % S, holding p
                assert i == r * S + p % S, (t, p, ids)
                assert ring[i] == (r, p), (t, p, i, ring.get(i))
            else:  # this step's packed token of position p
                assert i >= n_ring and i - n_ring == first[r] + p - s, (t, p, ids)

    # the ring keeps exactly the last S tokens of each sequence, at slot row*S + P % S
    tok, slot = plan.ring_write
    got = sorted(zip(tok.tolist(), slot.tolist()))
    want_w = sorted((t, r * S + P % S) for t, (r, s, P) in enumerate(packed)
                    if P >= pos[r] + dict(busy)[r] - S)
    assert got == want_w
    assert len({sl for _, sl in got}) == len(got)

    kv_ratios = {cfg.layer(L).ratio for L in range(cfg.n_layers) if cfg.layer(L).is_kv_source}
    assert kv_ratios and kv_ratios <= set(plan.ratios)
    ps = state.page_size
    for r, facts in plan.ratios.items():
        assert facts.visible.tolist() == [(P + 1) // r for _, _, P in packed], r
        if r not in kv_ratios:
            continue
        closing = [t for t, (_, _, P) in enumerate(packed) if (P + 1) % r == 0]
        assert facts.close_tokens.tolist() == closing, r
        where = [(int(state.block_table[packed[t][0], (packed[t][2] // r) // (ps // r)]),
                  (packed[t][2] // r) % (ps // r)) for t in closing]
        assert list(zip(facts.close_page.tolist(), facts.close_slot.tolist())) == where, r
        assert all(pg >= 0 for pg, _ in where)  # reserved by the step

    for r, s, P in packed:  # advance the oracle
        ring[r * S + P % S] = (r, P)
    for r, m in busy:
        pos[r] += m
    return T


def test_plan_window_list_ring_writes_and_groups():
    cfg = preset("tiny")
    assert cfg.window_size == 8
    stack = AttentionStack(cfg, {L: random_layer_weights(cfg, L, seed=0)
                                 for L in range(cfg.n_layers)})
    state = stack.new_state(3, capacity=64, page_size=4)
    S = state.ring_slots
    assert S == 24 and state.batch_size == 3
    ring: dict[int, tuple[int, int]] = {}
    pos = {0: 0, 1: 0, 2: 0}

    def forward(rows, m, seed):
        stack.forward(make_xs(cfg, len(rows), m, seed), state, rows=rows)
        for r in rows:
            for p in range(pos[r], pos[r] + m):
                ring[r * S + p % S] = (r, p)
            pos[r] += m

    forward([0, 1, 2], 5, seed=1)
    forward([1], 3, seed=2)  # rows at 5, 8, 5
    calls = [
        # row 0: 13 tokens (> W) from 5; row 1: decode at 8; row 2 idle
        ([0, 1, 2], [13, 1, 0]),
        # row 2: 30 tokens (> S) from 5; row 0: decode at 18; row 1: 4 tokens mid-ring; rows
        # out of order
        ([2, 0, 1], [30, 1, 4]),
        # row 0: 13 tokens from 19, its window reads wrap the ring (slots 23, 0, ...); row 1: 20
        # tokens from 13; row 2: decode at 35
        ([0, 1, 2], [13, 20, 1]),
    ]
    for seed, (rows, tokens) in enumerate(calls, 3):
        step = stack.step(state, tokens=tokens, rows=rows)
        T = _check_plan(cfg, state, step, ring, pos, rows, tokens)
        out = stack.run(step, {L: make_x(cfg, 1, T, 100 * seed + L)[0] for L in stack.layers})
        assert step.status == "done"
        assert all(o.shape == (T, cfg.dim) and torch.isfinite(o.float()).all()
                   for o in out.values())
        assert all(state.position_of(r) == pos[r] for r in range(3))
    assert pos == {0: 32, 1: 33, 2: 36}
