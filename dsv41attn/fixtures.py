"""Golden fixtures (``dsv41-attn-fixture/1``, see ``shared/fixtures/README.md``): load one, replay
its schedule through the library, and compare with the recorded outputs.

A fixture holds the weights of a stack of layers, every layer's own input at every step, and
the outputs (and index-source top-k) of DeepSeek's reference under one or both semantics.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file

from .checkpoint import layer_weights_from_tensors
from .config import AttentionConfig
from .stack import AttentionStack
from .tp import shard_layer_weights

FORMAT = "dsv41-attn-fixture/1"


@dataclass
class Fixture:
    """A loaded fixture: config, schedule [(start_pos, tokens)], batch, tensors by name."""

    path: str
    config: AttentionConfig
    schedule: list[tuple[int, int]]
    batch: int
    semantics: list[str]
    tensors: dict[str, torch.Tensor]

    @classmethod
    def load(cls, path: str) -> "Fixture":
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}")
        cfg = AttentionConfig.from_hf(json.loads(meta["config"]))
        schedule = [(int(s["start_pos"]), int(s["tokens"])) for s in json.loads(meta["schedule"])]
        return cls(path, cfg, schedule, int(meta["batch"]), json.loads(meta["semantics"]),
                   load_file(path))

    @property
    def layers(self) -> list[int]:
        return list(range(self.config.n_layers))

    def stack(self, device: str | torch.device = "cpu", backend: str = "reference",
              tp_group=None, batch_invariant: bool = False) -> AttentionStack:
        """The fixture's layers; ``tp_group``: a process group to split the heads over, each
        rank holding its shard (``tp.py``); ``batch_invariant``: AttentionStack's."""
        world = 1 if tp_group is None else dist.get_world_size(tp_group)
        rank = 0 if tp_group is None else dist.get_rank(tp_group)
        weights = {L: shard_layer_weights(
            self.config, layer_weights_from_tensors(self.config, L, self.tensors), rank,
            world).to(device) for L in self.layers}
        return AttentionStack(self.config, weights, backend, tp_group=tp_group,
                              batch_invariant=batch_invariant)

    def inputs(self, step: int, device="cpu") -> dict[int, torch.Tensor]:
        return {L: self.tensors[f"x.s{step}.l{L}"].to(device) for L in self.layers}

    def expected(self, semantics: str, layer: int) -> torch.Tensor:
        """[batch, all tokens, hidden] bf16, the steps concatenated in position order."""
        return torch.cat([self.tensors[f"out.{semantics}.s{s}.l{layer}"]
                          for s in range(len(self.schedule))], dim=1)

    def expected_topk(self, semantics: str, layer: int) -> list[torch.Tensor | None]:
        """Per step: [batch, tokens, k] int32 compressed-row numbers g (-1 pad), or None if the
        layer selected nothing in that step. The fixture stores g + window offset."""
        out = []
        for s, (start, tokens) in enumerate(self.schedule):
            t = self.tensors.get(f"topk.{semantics}.s{s}.l{layer}")
            if t is None:
                out.append(None)
                continue
            offset = tokens if start == 0 else self.config.window_size
            out.append(torch.where(t >= 0, t - offset, -1))
        return out


def _latent_every_source(cfg: AttentionConfig, starts: list[int], tokens: list[int]) -> bool:
    """True if every KV source completes a group for every sequence in this step: then both
    semantics publish the same index keys and the states stay identical."""
    return all((p + t) // cfg.compress_ratios[s] > p // cfg.compress_ratios[s]
               for s in cfg.kv_source_layers for p, t in zip(starts, tokens))


def parse_schedule(text: str) -> list[list[int]]:
    """"13,1,1,4;7,6,1,1,1" -> [[13, 1, 1, 4], [7, 6, 1, 1, 1]]: per-sequence chunk lengths."""
    try:
        seqs = [[int(c) for c in part.split(",")] for part in text.split(";")]
    except ValueError:
        raise ValueError(f"schedule {text!r}: expected chunk lengths like '13,1,1,4;7,6,1,1,1'")
    if any(c < 1 for seq in seqs for c in seq):
        raise ValueError(f"schedule {text!r}: chunk lengths must be >= 1")
    return seqs


def replay(fixture: Fixture, semantics: Iterable[str] = ("fixed",), device="cpu",
           stack: AttentionStack | None = None, schedule: list[list[int]] | None = None,
           backend: str = "reference") -> dict[str, dict[str, torch.Tensor]]:
    """Run the fixture through the library under each of ``semantics``.

    ``schedule``: per-sequence chunk lengths (each list covers that sequence's tokens); batch
    step k runs every sequence's k-th chunk together (idle when it has none), so sequences sit
    at different positions in one call. Default: the fixture's own schedule.

    Returns {semantics: {"out.{sem}.l{L}": [batch, tokens, hidden] bf16 in position order,
    "topk.{sem}.l{L}": [batch, tokens, kmax] int32 compressed-row numbers right-padded with -1
    (index sources)}}. Leading steps on which the semantics provably agree run once.
    """
    semantics = list(semantics)
    cfg = fixture.config
    total = sum(t for _, t in fixture.schedule)
    own = schedule is None
    if own:
        schedule = [[t for _, t in fixture.schedule] for _ in range(fixture.batch)]
    if len(schedule) != fixture.batch or any(sum(seq) != total for seq in schedule):
        raise ValueError(f"schedule {schedule}: expected {fixture.batch} sequences of chunk "
                         f"lengths each summing to the fixture's {total} tokens")
    if "reference" in semantics and not own and any(
            seq != [t for _, t in fixture.schedule] for seq in schedule):
        raise ValueError("reference semantics replays the fixture's own schedule only")
    stack = stack or fixture.stack(device, backend)
    n_steps = max(len(seq) for seq in schedule)
    steps = [[seq[k] if k < len(seq) else 0 for seq in schedule] for k in range(n_steps)]
    # Every layer's input for every position: [batch, total, hidden].
    inputs = {L: torch.cat([fixture.tensors[f"x.s{s}.l{L}"] for s in range(len(fixture.schedule))],
                           dim=1).to(device) for L in fixture.layers}
    hidden = cfg.dim
    outs = {s: {L: torch.zeros(fixture.batch, total, hidden, dtype=torch.bfloat16)
                for L in fixture.layers} for s in semantics}
    index_layers = [L for L in fixture.layers if cfg.layer(L).is_index_source]
    topks: dict[str, dict[int, list]] = {s: {L: [[] for _ in range(fixture.batch)]
                                             for L in index_layers} for s in semantics}
    state = stack.new_state(fixture.batch, capacity=cfg.max_seq_len, device=device)
    states = {s: state for s in semantics}
    shared, pos = True, [0] * fixture.batch
    for counts in steps:
        shared = shared and _latent_every_source(cfg, pos, counts)
        if not shared and len(semantics) > 1 and len({id(v) for v in states.values()}) == 1:
            states = {s: state.clone() for s in semantics}
        for sem in ([semantics[0]] if shared else semantics):
            st = states[sem]
            step = stack.step(st, counts, semantics=sem)
            for L in fixture.layers:
                x = torch.cat([inputs[L][b, p:p + c] for b, (p, c) in enumerate(zip(pos, counts))])
                y = stack.layers[L](x, st, step).cpu()
                sel = step.topk(L).cpu() if L in topks[sem] else None
                for s in (semantics if shared else [sem]):
                    for b, (p, c) in enumerate(zip(pos, counts)):
                        a = step.cu_seqlens[b]
                        outs[s][L][b, p:p + c] = y[a:a + c]
                        if sel is not None:
                            topks[s][L][b].extend(sel[a:a + c])
        pos = [p + c for p, c in zip(pos, counts)]
    result = {}
    for sem in semantics:
        r = {f"out.{sem}.l{L}": outs[sem][L] for L in fixture.layers}
        for L in index_layers:
            rows = [t for seq in topks[sem][L] for t in seq]
            width = max(t.numel() for t in rows)
            r[f"topk.{sem}.l{L}"] = torch.stack(
                [torch.nn.functional.pad(t, (0, width - t.numel()), value=-1) for t in rows]
            ).view(fixture.batch, total, width)
        result[sem] = r
    return result


def rel_err(got: torch.Tensor, exp: torch.Tensor) -> float:
    """||got - exp||_F / ||exp||_F in float64."""
    g, e = got.double(), exp.double()
    return float((g - e).norm() / e.norm().clamp_min(1e-300))


def topk_row_mismatches(got: torch.Tensor, exp: torch.Tensor) -> torch.Tensor:
    """[batch, tokens] bool: rows whose selected sets differ (-1 entries ignored)."""
    width = max(got.shape[-1], exp.shape[-1])
    g = torch.nn.functional.pad(got, (0, width - got.shape[-1]), value=-1).sort(-1).values
    e = torch.nn.functional.pad(exp, (0, width - exp.shape[-1]), value=-1).sort(-1).values
    return (g != e).any(-1)


def compare(fixture: Fixture, result: dict[str, torch.Tensor], semantics: str) -> dict:
    """Errors of a replay against the fixture, in the terms of its README's tolerances.

    Returns {"topk_rows": (mismatching, total), "per_output": [(step, layer, err)],
    "per_layer": {L: err}}; token rows whose top-k differs (in the layer or its index source)
    are left out of the output errors, as the README recommends.
    """
    cfg = fixture.config
    bounds, pos = [], 0
    for start, tokens in fixture.schedule:
        bounds.append((pos, pos + tokens))
        pos += tokens
    bad_rows: dict[int, torch.Tensor] = {}
    mismatching = total = 0
    for L in fixture.layers:
        if not cfg.layer(L).is_index_source:
            continue
        got = result[f"topk.{semantics}.l{L}"]
        bad = torch.zeros(got.shape[:2], dtype=torch.bool)
        for s, exp in enumerate(fixture.expected_topk(semantics, L)):
            a, b = bounds[s]
            if exp is None:
                bad[:, a:b] = (got[:, a:b] >= 0).any(-1)
            else:
                bad[:, a:b] = topk_row_mismatches(got[:, a:b], exp)
        bad_rows[L] = bad
        mismatching += int(bad.sum())
        total += bad.numel()
    per_output, per_layer = [], {}
    for L in fixture.layers:
        src = cfg.layer(L).index_source
        keep = ~bad_rows[src] if src is not None else None
        full_got, full_exp = result[f"out.{semantics}.l{L}"], fixture.expected(semantics, L)
        got, exp = (full_got[keep], full_exp[keep]) if keep is not None else (full_got, full_exp)
        per_layer[L] = rel_err(got, exp)
        for s, (a, b) in enumerate(bounds):
            g, e = full_got[:, a:b], full_exp[:, a:b]
            if keep is not None:
                k = keep[:, a:b]
                g, e = g[k], e[k]
            if e.numel():
                per_output.append((s, L, rel_err(g, e)))
    return {"topk_rows": (mismatching, total), "per_output": per_output, "per_layer": per_layer}


def tolerances(cfg: AttentionConfig) -> dict[str, float]:
    """The fixtures README's bar for a config's geometry: tiny fixtures identical top-k sets,
    every (step, layer) output's relative error <= 1e-1, median <= 1e-2, per layer <= 1.5e-2;
    V4.1 geometry (head_dim >= 256) <= 1% of top-k rows differing (left out of the output
    errors), <= 2.5e-2 per output, median <= 1.5e-2, per layer <= 2e-2."""
    if cfg.head_dim >= 256:
        return {"topk_frac": 0.01, "output": 2.5e-2, "median": 1.5e-2, "layer": 2e-2}
    return {"topk_frac": 0.0, "output": 1e-1, "median": 1e-2, "layer": 1.5e-2}


def tolerance_problems(fixture: Fixture, c: dict, semantics: str) -> list[str]:
    """What a ``compare`` result breaks of ``tolerances(fixture.config)``, one line each (none:
    within them)."""
    tol, out = tolerances(fixture.config), []
    bad, total = c["topk_rows"]
    if bad > tol["topk_frac"] * total:
        out.append(f"{semantics}: {bad}/{total} top-k rows differ (at most "
                   f"{tol['topk_frac']:.0%} may)")
    errs = [e for *_, e in c["per_output"]]
    if max(errs) > tol["output"]:
        out.append(f"{semantics}: worst output error {max(errs):.3e} > {tol['output']:g}")
    if statistics.median(errs) > tol["median"]:
        out.append(f"{semantics}: median output error {statistics.median(errs):.3e} > "
                   f"{tol['median']:g}")
    worst = max(c["per_layer"].items(), key=lambda kv: kv[1])
    if worst[1] > tol["layer"]:
        out.append(f"{semantics}: layer {worst[0]}'s error {worst[1]:.3e} > {tol['layer']:g}")
    return out
