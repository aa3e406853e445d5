"""The trace of a forward (dsv41attn/trace.py) and ``inspect``: tracing changes no output bit
and writes no tensor it is handed; the recorded selections are the step's top-k; the attention
masses sum to 1 and equal an independent recomputation from the state; the index scores are
the indexer's; ``inspect`` runs on a shipped fixture (and draws its figure) and on random input."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from conftest import assert_same, clone_state, make_x, snapshot
from dsv41attn import AttentionStack, preset, random_layer_weights
from dsv41attn.cli import main
from dsv41attn.ops.indexer.reference import index_scores
from dsv41attn.trace import Trace

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "tiny_long_prefill.safetensors"
HAVE_MPL = importlib.util.find_spec("matplotlib") is not None

# ragged steps on two sequences: prefills of different lengths (13 > window), a chunk beside a
# decode, then decode
SCHEDULE = [[13, 20], [5, 1], [1, 1]]


@pytest.fixture(scope="module")
def stack():
    cfg = preset("tiny")
    return AttentionStack(cfg, {L: random_layer_weights(cfg, L, seed=3) for L in range(cfg.n_layers)})


def _inputs(cfg, counts, k):
    return {L: torch.cat([make_x(cfg, 1, m, 100 * k + 10 * L + i)[0]
                          for i, m in enumerate(counts)]) for L in range(cfg.n_layers)}


class Guard:
    """A trace callback that hands the record to ``inner`` and checks that no tensor of the
    record, its plan and its board (index inputs, top-k, candidates) changed a bit."""

    def __init__(self, inner):
        self.inner = inner
        self.records: list[tuple[int, dict]] = []  # (layer, the record as handed over)

    @staticmethod
    def _tensors(record):
        out = {k: v for k, v in record.items() if isinstance(v, torch.Tensor)}
        plan, board = record["plan"], record["board"]
        out.update(pos=plan.pos, token_row=plan.token_row, window_ids=plan.window_ids)
        for L, (qi, hw, keys, facts) in (board.index_inputs or {}).items():
            out.update({f"idx{L}.q": qi, f"idx{L}.w": hw, f"idx{L}.keys": keys,
                        f"idx{L}.visible": facts.visible})
        out.update({f"topk{L}": t for L, t in board._topk.items()})
        if board._candidates is not None:
            out["candidates"] = board._candidates
        return out

    def __call__(self, layer, record):
        before = {k: v.clone() for k, v in self._tensors(record).items()}
        self.inner(layer, record)
        after = self._tensors(record)
        for k, v in before.items():
            assert torch.equal(v.reshape(-1).view(torch.uint8) if v.element_size() == 1 else v,
                               after[k].reshape(-1).view(torch.uint8) if v.element_size() == 1
                               else after[k]), f"the trace wrote into {k}"
        self.records.append((layer.spec.layer, {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                                                 for k, v in record.items()}))


def _run(stack, state, trace=None):
    """The schedule through every layer; per step: (step, {layer: output})."""
    cfg = stack.cfg
    out = []
    for k, counts in enumerate(SCHEDULE):
        step = stack.step(state, counts, trace=trace)
        xs = _inputs(cfg, counts, k)
        out.append((step, {L: stack.layers[L](xs[L], state, step) for L in stack.layers}))
    return out


@pytest.fixture(scope="module")
def traced(stack):
    """(trace, guard, steps and outputs of the traced run, of the untraced run, both states)."""
    state = stack.new_state(2, capacity=64)
    plain_state = clone_state(state)
    trace = Trace(probs=True)
    guard = Guard(trace)
    run = _run(stack, state, guard)
    plain = _run(stack, plain_state)
    return trace, guard, run, plain, state, plain_state


def test_tracing_changes_no_output_bit(traced):
    trace, guard, run, plain, state, plain_state = traced
    for (step, ys), (plain_step, plain_ys) in zip(run, plain):
        for L, y in ys.items():
            assert torch.equal(y, plain_ys[L]), L
        for L in step.layers:
            if step.cfg.layer(L).is_index_source:
                assert torch.equal(step.topk(L), plain_step.topk(L)), L
        assert plain_step.board.index_inputs is None  # off: nothing kept
    assert_same(snapshot(plain_state), snapshot(state))
    assert len(trace.records) == len(SCHEDULE)
    assert all(sorted(r) == run[0][0].layers for r in trace.records)


def test_recorded_selections_are_the_step_topk(traced):
    trace, _, run, *_ = traced
    for s, (step, _) in enumerate(run):
        cfg = step.cfg
        for L in step.layers:
            spec, rec = cfg.layer(L), trace.layer(L, s)
            assert torch.equal(rec.pos, step.plan.pos.cpu())
            assert rec.heads == range(cfg.n_heads) and rec.mass_sink.shape[1] == cfg.n_heads
            if spec.ratio == 0:
                assert rec.selected.numel() == 0 and rec.visible is None
                continue
            topk = step.topk(spec.index_source)
            assert torch.equal(rec.selected, topk.cpu()), (s, L)
            g = rec.selected.long()
            assert torch.equal(rec.selected_pos, torch.where(g >= 0, g * spec.ratio, -1))
            assert torch.equal(rec.visible, (rec.pos + 1) // spec.ratio)
            assert bool(((g < rec.visible.unsqueeze(1)) | (g < 0)).all())


def test_window_positions(traced):
    trace, _, run, *_ = traced
    w = run[0][0].cfg.window_size
    for s, (step, _) in enumerate(run):
        rec = trace.layer(0, s)
        for t, p in enumerate(rec.pos.tolist()):
            want = list(range(max(0, p - w + 1), p + 1))
            assert rec.window_pos[t].tolist() == want + [-1] * (w - len(want))


def test_masses_sum_to_one_and_match_the_probabilities(traced):
    trace, *_ = traced
    for steps in trace.records:
        for rec in steps.values():
            total = rec.mass_sink + rec.mass_window + rec.mass_compressed
            assert torch.allclose(total, torch.ones_like(total), rtol=0, atol=1e-12)
            assert bool((rec.mass_sink > 0).all())
            assert torch.allclose(rec.probs_window.double().sum(-1), rec.mass_window, atol=1e-6)
            assert torch.allclose(rec.probs_compressed.double().sum(-1), rec.mass_compressed,
                                  atol=1e-6)
            if rec.ratio == 0:
                assert bool((rec.mass_compressed == 0).all())


@pytest.mark.parametrize("layer", [0, 1, 2, 5])
def test_masses_equal_an_independent_recomputation(traced, stack, layer):
    """The last token of sequence 1 in the last step, from what the state holds after it: the
    ring's rows of its window positions and the source's compressed rows it selected."""
    trace, guard, run, _, state, _ = traced
    cfg, spec = stack.cfg, stack.cfg.layer(layer)
    rec = trace.layer(layer)  # last step: one token per sequence
    t = int((rec.token_row == 1).nonzero()[-1])
    q = [r for L, r in guard.records if L == layer][-1]["q"][t].double()  # [H, D]
    p = int(rec.pos[t])
    ring = state.layers[layer].read_window(torch.tensor([1]))[0]  # [S, D] bf16
    window = torch.stack([ring[pos % state.ring_slots] for pos in
                          range(max(0, p - cfg.window_size + 1), p + 1)]).double()
    logits = [cfg.softmax_scale * q @ window.T]
    if spec.ratio:
        g = rec.selected[t][rec.selected[t] >= 0].long()
        rows = state.read_compressed(spec.kv_source, torch.tensor([1]), int(g.max()) + 1)[0]
        logits.append(cfg.softmax_scale * q @ rows[g].double().T)
    sink = stack.layers[layer].weights.attn_sink.double()
    e = [torch.exp(x) for x in logits]
    denom = sum(x.sum(-1) for x in e) + torch.exp(sink)
    assert torch.allclose(rec.mass_sink[t], torch.exp(sink) / denom, rtol=1e-12, atol=0)
    assert torch.allclose(rec.mass_window[t], e[0].sum(-1) / denom, rtol=1e-12, atol=0)
    if spec.ratio:
        assert torch.allclose(rec.mass_compressed[t], e[1].sum(-1) / denom, rtol=1e-12, atol=0)


def test_index_scores_are_the_indexers(traced, stack):
    """At every index source, the recorded scores of the selected rows equal index_scores over
    the state's keys, and (but for candidate consumers, which score inside the kept blocks only)
    no visible row left out scores higher than a selected one."""
    trace, guard, run, _, state, _ = traced
    cfg = stack.cfg
    step = run[-1][0]
    for L in step.layers:
        spec = cfg.layer(L)
        rec = trace.layer(L)
        if not spec.is_index_source:
            assert rec.index_scores is None
            continue
        q_index, weights, keys, facts = step.board.index_inputs[L]
        # the keys that layer L scored are those of its index-key source
        for t in range(rec.tokens):
            row, vis = int(rec.token_row[t]), int(rec.visible[t])
            pool_owner = next(s for s, so in state.sources.items() if so.index_keys is keys)
            all_keys = state.read_index_keys(pool_owner, torch.tensor([row]), facts.scan)
            s = index_scores(q_index[t].view(1, 1, *q_index.shape[1:]), weights[t].view(1, 1, -1),
                             all_keys)[0, 0].float()
            g = rec.selected[t].long()
            ok = g >= 0
            assert torch.equal(rec.index_scores[t][ok], s[g[ok]]), (L, t)
            assert bool(rec.index_scores[t][~ok].isnan().all())
            if not spec.is_candidate_consumer:
                left_out = torch.ones(vis, dtype=torch.bool)
                left_out[g[ok]] = False
                if left_out.any() and ok.any():
                    assert float(s[:vis][left_out].max()) <= float(s[g[ok]].min()), (L, t)


def test_candidate_blocks_are_recorded_at_the_candidate_source(traced, stack):
    trace, guard, run, *_ = traced
    cfg = stack.cfg
    c = cfg.candidate_source_layer
    for s, (step, _) in enumerate(run):
        rec = trace.layer(c, s)
        assert rec.candidates is not None and rec.candidates.dtype == torch.bool
        newest = (rec.visible - 1) // cfg.candidate_block_size  # always kept
        assert bool(rec.candidates[torch.arange(rec.tokens), newest].all())
        assert bool((rec.candidates.sum(-1) <= cfg.candidate_topk_blocks).all())
        for L in step.layers:
            if L != c:
                assert trace.layer(L, s).candidates is None
    summary = trace.summary()
    assert summary[c]["candidate_blocks"] > 0
    assert all(summary[L]["candidate_blocks"] is None for L in summary if L != c)


def test_trace_of_some_layers_only(stack):
    state = stack.new_state(1, capacity=16)
    trace = Trace(layers=[1, 4])
    step = stack.step(state, 9, trace=trace)
    for L in stack.layers:
        stack.layers[L](make_x(stack.cfg, 1, 9, L), state, step)
    assert trace.traced_layers() == [1, 4] and trace.layer(1).probs_window is None
    with pytest.raises(ValueError, match="layer 2 was not traced"):
        trace.layer(2)


# ---- inspect -------------------------------------------------------------------------------

def _cli(capsys, argv):
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def _summary_rows(out: str) -> dict[int, list[str]]:
    rows = {}
    for line in out.splitlines():
        f = line.split()
        if len(f) == 8 and f[0].isdigit():
            rows[int(f[0])] = f
    return rows


def test_inspect_a_shipped_fixture(capsys, tmp_path):
    if not HAVE_MPL:
        pytest.skip("matplotlib is not installed: inspect --out cannot draw (pip install "
                    "'dsv41attn[plot]'); the summary is tested without a fixture")
    png = tmp_path / "inspect.png"
    code, out, err = _cli(capsys, ["inspect", str(FIXTURE), "--out", str(png), "--layer", "5",
                                   "--head", "3"])
    assert code == 0, err
    assert "bit for bit" in out, out  # traced outputs = the fixture's recorded outputs
    assert sorted(_summary_rows(out)) == list(range(8))
    assert "layer 5 (Reindex, ratio 1), head 3" in out and "index scores" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_inspect_random_input(capsys):
    code, out, err = _cli(capsys, ["inspect", "--tokens", "12", "--decode-steps", "1"])
    assert code == 0, err
    rows = _summary_rows(out)
    assert sorted(rows) == list(range(8))
    for f in rows.values():
        sink, window, compressed = map(float, f[3:6])
        assert abs(sink + window + compressed - 1) < 2e-3
    assert rows[0][6] == "-" and float(rows[3][7]) > 0  # SWA selects nothing; layer 3 keeps blocks
    assert "layer 3 (Full, ratio 1), head 0" in out


@pytest.mark.parametrize("argv,names", [
    (["inspect", "--layer", "8"], ["--layer 8", "0..7"]),
    (["inspect", "--head", "8"], ["--head 8", "0..7"]),
    (["inspect", str(FIXTURE), "--tokens", "3"], ["--tokens", "fixture"]),
    (["inspect", "nope.safetensors"], ["nope.safetensors"]),
    (["inspect", "--out", "/nonexistent-dir/x.png"], ["/nonexistent-dir"]),
])
def test_inspect_errors(capsys, argv, names):
    code, _, err = _cli(capsys, argv)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    for n in names:
        assert n in err, (n, err)


def test_inspect_without_matplotlib(capsys, monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    code, _, err = _cli(capsys, ["inspect", "--out", str(tmp_path / "x.png")])
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "matplotlib" in err and "pip install" in err
