"""A look inside a forward: what each query of a traced step selected and where its attention
went, per layer and token.

Pass a ``Trace`` as the step's trace (``stack.step(state, tokens, rows, trace=Trace())``): every
layer of the step hands it its attention inputs after the sparse attention and before its output
projection and ring write (``AttentionLayer.run``). The trace keeps, on the CPU, per layer and
packed token of every step it saw:

- the token's position and state row, the positions of its window rows, and the compressed rows
  it selected (row numbers g, and the position g*r of each row's first token);
- per head, the attention mass on the sink, on the window rows and on the compressed rows: the
  softmax recomputed in float64 from the post-RoPE queries, the unpacked cached rows and the
  sink, over the same list and validity as the sparse attention (window entries, then the
  selected compressed rows; -1 entries skipped), so sink + window + compressed = 1;
- at index sources, the index scores (bf16, as the indexer computes them) of the selected rows;
- at the candidate source, the candidate blocks it kept.

It reads the record only (every op out of place) and copies what it keeps to the CPU, so a
traced step computes exactly what an untraced one does; an untraced step pays one ``None``
check per layer. ``Trace(probs=True)`` also keeps every entry's probability (for the figure of
``python -m dsv41attn inspect``); that is [tokens, heads, list width] floats per layer.

Under tensor parallelism (``AttentionLayer(tp_group=...)``) each rank's trace sees its own
heads: ``LayerRecord.heads`` is the global range its masses cover, and index scores are not
recorded (a rank holds only its index heads' partial sum; the all-reduced scores never leave
the indexer).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Iterable

import torch

from .ops.common.packing import (paged_index_keys, paged_rows, unpack_compressed_rows,
                                 unpack_window_rows)
from .ops.indexer.reference import index_scores, mask_invisible


@dataclass
class LayerRecord:
    """One layer's part of one traced step, on the CPU. T = the step's packed tokens, H heads,
    W window entries, k selected entries (-1 padded), nblk candidate blocks.

    ``mass_*`` [T, H] float64 sum to 1 per (token, head). ``probs_window`` [T, H, W] and
    ``probs_compressed`` [T, H, k] float32 (0 at skipped entries) only with ``probs``.
    ``index_scores`` [T, k] float32 (NaN at -1 entries) at index sources with compressed rows
    scanned, else None. ``candidates`` [T, nblk] bool at the candidate source, else None."""

    step: int
    layer: int
    role: str
    ratio: int
    index_source: int | None
    heads: range  # the global heads of the mass columns (all of them unless tensor-parallel)
    token_row: torch.Tensor  # [T] int64 state row of each token
    pos: torch.Tensor  # [T] int64
    window_pos: torch.Tensor  # [T, W] int64, -1 pad
    selected: torch.Tensor  # [T, k] int32 compressed row numbers g, -1 pad
    selected_pos: torch.Tensor  # [T, k] int64 g * ratio (the row's first token), -1 pad
    visible: torch.Tensor | None  # [T] int64 compressed rows the query may see
    mass_sink: torch.Tensor  # [T, H] float64
    mass_window: torch.Tensor  # [T, H] float64
    mass_compressed: torch.Tensor  # [T, H] float64
    index_scores: torch.Tensor | None = None
    candidates: torch.Tensor | None = None
    probs_window: torch.Tensor | None = None
    probs_compressed: torch.Tensor | None = None

    @property
    def tokens(self) -> int:
        return self.pos.numel()

    def n_selected(self) -> torch.Tensor:
        """[T] int64: compressed rows each query selected."""
        return (self.selected >= 0).sum(-1)


@dataclass
class Trace:
    """Records every traced step (module docstring). ``layers``: the layers to record (None:
    all); ``probs``: also keep every entry's probability (True, or the layers to keep them
    for). ``records[s][L]`` is layer L's ``LayerRecord`` of the s-th traced step."""

    layers: Iterable[int] | None = None
    probs: bool | Iterable[int] = False
    records: list[dict[int, LayerRecord]] = field(default_factory=list)
    chunk: int = 16  # queries per float64 softmax block (bounds memory at V4.1 widths)

    def __post_init__(self) -> None:
        self.layers = None if self.layers is None else frozenset(int(L) for L in self.layers)
        self.probs = self.probs if isinstance(self.probs, bool) else \
            frozenset(int(L) for L in self.probs)
        # the plan of the step being recorded (a new plan opens a new step); weak, so the
        # trace does not keep a finished step's device tensors alive
        self._plan = lambda: None

    # ---- the hook ----------------------------------------------------------------------------
    def __call__(self, layer, record: dict) -> None:
        spec = layer.spec
        plan = record["plan"]
        if plan is not self._plan():
            self._plan = weakref.ref(plan)
            self.records.append({})
        if self.layers is not None and spec.layer not in self.layers:
            return
        with torch.no_grad():
            self.records[-1][spec.layer] = self._record(layer, record)

    def _record(self, layer, rec: dict) -> LayerRecord:
        cfg, spec, w = layer.cfg, layer.spec, layer.weights
        plan, board, selected = rec["plan"], rec["board"], rec["selected"]
        keep_probs = self.probs is True or (self.probs is not False and spec.layer in self.probs)
        masses = attention_mass(rec["q"], w.attn_sink, cfg.softmax_scale, rec["window_ring"],
                                rec["new_rows"], plan.window_ids, rec["pool"],
                                rec["block_table"], plan.token_row, selected, keep_probs,
                                self.chunk)
        window_ids = plan.window_ids
        n_win = (window_ids >= 0).sum(-1, keepdim=True)  # the list: P-n+1 .. P, then -1
        j = torch.arange(window_ids.shape[1], device=window_ids.device)
        window_pos = torch.where(j < n_win, plan.pos.unsqueeze(-1) - n_win + 1 + j, -1)
        sel = selected.long()
        selected_pos = torch.where(sel >= 0, sel * max(spec.ratio, 1), -1)
        scores = candidates = visible = None
        if spec.ratio > 0:
            visible = plan.ratios[spec.ratio].visible.cpu()
            inputs = (board.index_inputs or {}).get(spec.layer)
            if inputs is not None and getattr(layer, "tp", None) is None:
                scores = selected_index_scores(*inputs, rec["block_table"], plan.token_row,
                                               selected).cpu()
            if spec.is_candidate_source:
                candidates = board.candidates().cpu().clone()
        tp = getattr(layer, "tp", None)
        heads = range(cfg.n_heads) if tp is None else \
            range(tp.shape.head_slice.start, tp.shape.head_slice.stop)
        return LayerRecord(
            step=len(self.records) - 1, layer=spec.layer, role=spec.role.value, ratio=spec.ratio,
            index_source=spec.index_source, heads=heads, token_row=plan.token_row.cpu().clone(),
            pos=plan.pos.cpu().clone(), window_pos=window_pos.cpu(),
            selected=selected.cpu().clone(), selected_pos=selected_pos.cpu(), visible=visible,
            mass_sink=masses[0], mass_window=masses[1], mass_compressed=masses[2],
            index_scores=scores, candidates=candidates,
            probs_window=masses[3], probs_compressed=masses[4])

    # ---- reading ----------------------------------------------------------------------------
    def layer(self, layer: int, step: int = -1) -> LayerRecord:
        """Layer ``layer``'s record of traced step ``step`` (default: the last)."""
        if not self.records:
            raise ValueError("nothing traced yet: pass this Trace to stack.step(..., trace=...)")
        steps = self.records[step]
        if layer not in steps:
            raise ValueError(f"layer {layer} was not traced in step {step} (traced: {sorted(steps)})")
        return steps[layer]

    def traced_layers(self) -> list[int]:
        return sorted({L for steps in self.records for L in steps})

    def summary(self) -> dict[int, dict[str, float | int | str | None]]:
        """Per layer, over every traced step and token: the mean attention mass on the sink,
        window and compressed rows (over tokens and heads), the mean compressed rows selected
        per query, and (candidate source) the mean candidate blocks kept per query."""
        out: dict[int, dict] = {}
        for L in self.traced_layers():
            recs = [steps[L] for steps in self.records if L in steps]
            first = recs[0]
            cat = lambda name: torch.cat([getattr(r, name).reshape(r.tokens, -1) for r in recs])
            row = {"role": first.role, "ratio": first.ratio, "tokens": sum(r.tokens for r in recs),
                   "sink": float(cat("mass_sink").mean()),
                   "window": float(cat("mass_window").mean()),
                   "compressed": float(cat("mass_compressed").mean()),
                   "selected": float(torch.cat([r.n_selected() for r in recs]).double().mean())
                   if first.ratio else None,
                   "candidate_blocks": float(torch.cat([r.candidates.sum(-1) for r in recs])
                                             .double().mean())
                   if first.candidates is not None else None}
            out[L] = row
        return out


def attention_mass(q: torch.Tensor, sink: torch.Tensor, scale: float, window_ring: torch.Tensor,
                   new_rows: torch.Tensor, window_ids: torch.Tensor,
                   compressed_pool: torch.Tensor | None, block_table: torch.Tensor | None,
                   token_row: torch.Tensor, compressed_idx: torch.Tensor,
                   keep_probs: bool = False, chunk: int = 16):
    """The sparse attention's softmax, in float64, split into its parts (CPU tensors):
    (sink [T, H], window [T, H], compressed [T, H], probs_window [T, H, W] or None,
    probs_compressed [T, H, k] or None). Arguments as ``ops/sparse_attn/reference.py``'s
    ``sparse_attn_paged``: the same list (window entries then compressed entries, -1 skipped),
    the same unpacked rows, logits ``scale * q.kv``, the sink in the denominator only."""
    t_all, h, d = q.shape
    ring = window_ring.reshape(-1, window_ring.shape[-1])
    n_ring, k = ring.shape[0], compressed_idx.shape[-1]
    sink64 = sink.double().view(1, h)
    parts = {n: [] for n in ("sink", "window", "compressed", "pw", "pc")}
    for t0 in range(0, t_all, chunk):
        t = slice(t0, t0 + chunk)
        ids = window_ids[t].long()  # [t, W]
        packed = torch.where((ids < n_ring).unsqueeze(-1), ring[ids.clamp(0, n_ring - 1)],
                             new_rows[(ids - n_ring).clamp(0, t_all - 1)])
        qs = q[t].double()  # [t, H, D]
        lw = scale * torch.einsum("thd,twd->thw", qs, unpack_window_rows(packed).double())
        lw = lw.masked_fill(~(ids >= 0).unsqueeze(1), float("-inf"))
        if k:
            g = compressed_idx[t].long()  # [t, k]
            rows = paged_rows(compressed_pool, block_table[token_row[t]], g.clamp_min(0))
            lc = scale * torch.einsum("thd,tkd->thk", qs, unpack_compressed_rows(rows).double())
            lc = lc.masked_fill(~(g >= 0).unsqueeze(1), float("-inf"))
        else:
            lc = lw.new_empty(lw.shape[0], h, 0)
        top = torch.maximum(torch.cat([lw, lc], -1).amax(-1), sink64)  # [t, H], finite
        ew, ec = torch.exp(lw - top.unsqueeze(-1)), torch.exp(lc - top.unsqueeze(-1))
        es = torch.exp(sink64 - top)
        denom = ew.sum(-1) + ec.sum(-1) + es
        parts["sink"].append((es / denom).cpu())
        parts["window"].append((ew.sum(-1) / denom).cpu())
        parts["compressed"].append((ec.sum(-1) / denom).cpu())
        if keep_probs:
            parts["pw"].append((ew / denom.unsqueeze(-1)).float().cpu())
            parts["pc"].append((ec / denom.unsqueeze(-1)).float().cpu())
    cat = {n: torch.cat(v) if v else None for n, v in parts.items()}
    return cat["sink"], cat["window"], cat["compressed"], cat["pw"], cat["pc"]


def selected_index_scores(q_index: torch.Tensor, head_weights: torch.Tensor,
                          key_pool: torch.Tensor, facts, block_table: torch.Tensor,
                          token_row: torch.Tensor, selected: torch.Tensor,
                          tile: int = 256) -> torch.Tensor:
    """[T, k] float32: the index score (bf16, ``ops/indexer/reference.index_scores`` over the
    unpacked paged keys, rows a query cannot see at -inf) of each selected row, NaN at -1.
    Arguments: what an index source scored (``board.index_inputs[L]``: index queries [T, I,
    d], head weights [T, I], the key pool, its RatioFacts) and the state's block table."""
    out = torch.full(selected.shape, float("nan"), dtype=torch.float32, device=selected.device)
    if selected.shape[-1] == 0 or facts.scan == 0:
        return out
    for row in torch.unique(token_row).tolist():
        tokens = (token_row == row).nonzero().squeeze(1)
        keys = paged_index_keys(key_pool, block_table[row:row + 1], facts.scan)  # [1, n, d]
        for i0 in range(0, tokens.numel(), tile):
            tk = tokens[i0:i0 + tile]
            s = index_scores(q_index[tk].unsqueeze(0), head_weights[tk].unsqueeze(0), keys)
            s = mask_invisible(s, facts.visible[tk].unsqueeze(0))[0]  # [m, n] bf16
            g = selected[tk].long()
            got = torch.gather(s.float(), 1, g.clamp(0, facts.scan - 1))
            out[tk] = torch.where(g >= 0, got, float("nan"))
    return out


# ---- running a traced forward ------------------------------------------------------------------

def trace_fixture(fixture, trace: Trace, semantics: str = "fixed", device="cpu",
                  backend: str = "reference",
                  batch_invariant: bool = False) -> dict[int, torch.Tensor]:
    """Replay ``fixture``'s own schedule (as ``fixtures.replay`` does: every sequence's chunk k
    in batch step k) through traced steps. Returns layer -> outputs [batch, tokens, hidden]."""
    cfg = fixture.config
    stack = fixture.stack(device, backend, batch_invariant=batch_invariant)
    state = stack.new_state(fixture.batch, capacity=cfg.max_seq_len, device=device)
    total = sum(t for _, t in fixture.schedule)
    outs = {L: torch.zeros(fixture.batch, total, cfg.dim, dtype=torch.bfloat16)
            for L in fixture.layers}
    for s, (start, tokens) in enumerate(fixture.schedule):
        step = stack.step(state, tokens, semantics=semantics, trace=trace)
        xs = fixture.inputs(s, device)
        for L in fixture.layers:
            outs[L][:, start:start + tokens] = stack.layers[L](xs[L], state, step).cpu()
    return outs


def trace_random(cfg, trace: Trace, tokens: int = 40, decode_steps: int = 4, batch: int = 1,
                 seed: int = 0, semantics: str = "fixed", device="cpu",
                 backend: str = "reference", batch_invariant: bool = False) -> None:
    """Random weights and unit-RMS random inputs (as ``demo``): a prefill of ``tokens`` tokens,
    then ``decode_steps`` one-token steps, through every backbone layer, traced."""
    from .checkpoint import random_layer_weights
    from .stack import AttentionStack

    weights = {L: random_layer_weights(cfg, L, seed=seed, device=device)
               for L in range(cfg.n_layers)}
    stack = AttentionStack(cfg, weights, backend=backend, batch_invariant=batch_invariant)
    state = stack.new_state(batch, capacity=tokens + decode_steps, device=device)
    gen = torch.Generator().manual_seed(seed)
    for m in [tokens] + [1] * decode_steps:
        step = stack.step(state, m, semantics=semantics, trace=trace)
        for L in stack.layers:
            x = torch.randn(batch, m, cfg.dim, generator=gen)
            x = x / x.pow(2).mean(-1, keepdim=True).sqrt()
            stack.layers[L](x.to(torch.bfloat16).to(device), state, step)


# ---- the figure ----------------------------------------------------------------------------------

def plot_trace(trace: Trace, layer: int, head: int, path: str, row: int | None = None,
               title: str = "") -> None:
    """Draw layer ``layer`` of ``trace`` (recorded with probs for it) to ``path``: left, the
    rows each query of sequence ``row`` (default: the first traced) attended by position, window
    rows as squares and selected compressed rows as bars over their r positions, coloured by
    head ``head``'s attention probability; right, the attention mass per head split into sink,
    window and compressed rows (mean over every traced token). Needs matplotlib (imported here,
    no pyplot: the caller's backend is left alone)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import LogNorm
    from matplotlib.figure import Figure

    recs = [steps[layer] for steps in trace.records if layer in steps]
    if not recs:
        raise ValueError(f"layer {layer} was not traced")
    if recs[0].probs_window is None:
        raise ValueError(f"layer {layer} was traced without probs (Trace(probs=...))")
    if row is None:
        row = int(recs[0].token_row[0])
    r = max(recs[0].ratio, 1)
    wx, wy, wp, cx, cy0, cp = [], [], [], [], [], []
    for rec in recs:
        mine = (rec.token_row == row).nonzero().squeeze(1)
        for t in mine.tolist():
            p = int(rec.pos[t])
            ok = rec.window_pos[t] >= 0
            wx += [p] * int(ok.sum())
            wy += rec.window_pos[t][ok].tolist()
            wp += rec.probs_window[t, head][ok].tolist()
            ok = rec.selected_pos[t] >= 0
            cx += [p] * int(ok.sum())
            cy0 += rec.selected_pos[t][ok].tolist()
            cp += rec.probs_compressed[t, head][ok].tolist()
    fig = Figure(figsize=(13, 5.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax, bx = fig.subplots(1, 2, width_ratios=[3, 2])
    probs = [v for v in wp + cp if v > 0]
    norm = LogNorm(vmin=max(min(probs, default=1e-4), 1e-6), vmax=max(max(probs, default=1.0), 1e-5))
    cmap = "viridis"
    # window rows as squares just left of the query's column, compressed rows as bars just
    # right of it (at ratio 1 a compressed row covers a position the window may hold too)
    sc = ax.scatter([x - 0.2 for x in wx], wy, c=[max(v, norm.vmin) for v in wp], cmap=cmap,
                    norm=norm, marker="s", s=9, linewidths=0, label="window row")
    if cx:
        colours = sc.cmap(norm([max(v, norm.vmin) for v in cp]))
        ax.vlines([x + 0.25 for x in cx], [y - 0.4 for y in cy0], [y + r - 0.6 for y in cy0],
                  colors=colours, linewidth=2.2,
                  label=f"selected compressed row (covers {r} position{'s' * (r > 1)})")
    lim = max(wx + [1])
    ax.plot([0, lim], [0, lim], color="0.85", linewidth=0.8, zorder=0)
    ax.set_xlabel("query position")
    ax.set_ylabel("key position")
    first = recs[0]
    ax.set_title(f"layer {layer} ({first.role}, ratio {first.ratio}), head {head}: rows each "
                 f"query attends (sequence row {row})", fontsize=10)
    ax.legend(loc="upper left", fontsize=8)
    fig.colorbar(sc, ax=ax, label=f"attention probability, head {head}")
    sink = torch.cat([x.mass_sink for x in recs]).mean(0)
    win = torch.cat([x.mass_window for x in recs]).mean(0)
    cmp = torch.cat([x.mass_compressed for x in recs]).mean(0)
    heads = list(first.heads)
    bx.bar(heads, sink.tolist(), label="sink", color="#d62728")
    bx.bar(heads, win.tolist(), bottom=sink.tolist(), label="window rows", color="#7f7f7f")
    bx.bar(heads, cmp.tolist(), bottom=(sink + win).tolist(), label="compressed rows",
           color="#1f77b4")
    bx.set_xlabel("head")
    bx.set_ylabel("attention mass (mean over traced tokens)")
    bx.set_ylim(0, 1)
    if len(heads) <= 16:
        bx.set_xticks(heads)
    bx.set_title(f"layer {layer}: attention mass per head", fontsize=10)
    bx.legend(fontsize=8, loc="lower right")
    if title:
        fig.suptitle(title, fontsize=11)
    fig.savefig(path, dpi=120)
