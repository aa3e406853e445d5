"""The tensor-parallel check, one process per rank (``python -m dsv41attn tpcheck`` under
torchrun, NCCL on GPUs or gloo on the CPU): the sharded layers against the unsharded ones, and
the golden fixtures replayed at the world size, within the fixtures' tolerances.

1. Roles: one layer of each role the config has (and the sources it reads), random weights of
   one seed on every rank, run twice on each rank through the same ragged schedule (a batch
   of two sequences: a prefill past the window and past ``index_topk`` complete compressed
   rows, decodes, a chunk, an idle sequence): whole, then sharded over the group. Top-k and
   candidate blocks are compared row by row; a near-tie at the k-th row may select another
   row (the index scores are summed per rank and all-reduced in bf16, docs/numerics.md §10),
   so the fixtures' bar applies: at most ``topk_frac`` of the rows differ, and the outputs of
   the rows whose selection agrees are within ``output`` per (step, layer).
2. Fixtures: each replayed through a stack sharded over the group (``Fixture.stack``), held to
   its README's tolerances (``fixtures.tolerance_problems``).

Every rank computes the same report (the collectives make their outputs equal); the command
prints rank 0's and exits 1 on any problem.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .checkpoint import random_layer_weights
from .config import AttentionConfig
from .fixtures import compare, rel_err, replay, tolerance_problems, tolerances, \
    topk_row_mismatches
from .stack import AttentionStack
from .tp import shard_layer_weights


@dataclass
class TPReport:
    """What ``check_tp`` found: per checked layer (role name, worst output error over the
    steps, selection rows differing / compared), per fixture and semantics a line, and every
    problem (empty: the check passed)."""

    roles: list[tuple[int, str, float, int, int]] = field(default_factory=list)
    fixtures: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def check_layers(cfg: AttentionConfig) -> tuple[dict[int, str], list[int]]:
    """({layer: role name} for the first backbone layer of each role, the layers to build:
    those and the sources they read)."""
    first: dict[tuple, int] = {}
    for L in range(cfg.n_layers):
        s = cfg.layer(L)
        if not s.is_draft:
            first.setdefault((s.role, s.ratio, s.is_candidate_source, s.is_candidate_consumer), L)
    names = {}
    for (role, ratio, cand_src, cand_use), L in first.items():
        names[L] = (role.name if ratio == 0 else f"{role.name.capitalize()} r={ratio}") \
            + (", candidate source" if cand_src else "") + (", candidate consumer" if cand_use else "")
    return names, sorted(set(names) | {s for L in names for s in cfg.layer(L).reads})


def role_schedule(cfg: AttentionConfig) -> list[list[int]]:
    """Per-step token counts of two sequences: a prefill past the window and past index_topk
    complete rows at the largest ratio (the second sequence shorter, into the window), a
    decode, a chunk beside a decode, a decode, one sequence idle."""
    r = max([cfg.layer(L).ratio for L in range(cfg.n_layers)] + [1])
    w = cfg.window_size
    longest = min(cfg.max_seq_len - 32, cfg.index_topk * r + w + 5)
    return [[longest, min(longest, w + 3)], [1, 1], [7, 2], [1, 1], [2, 0]]


def _run(stack: AttentionStack, cfg: AttentionConfig, steps, device, seed: int):
    """Outputs per (step, layer), top-k per (step, index source), kept candidate blocks per
    step, of ``steps`` through every layer of ``stack``: the same seeded inputs on every
    rank, made on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    state = stack.new_state(2, capacity=sum(max(c) for c in steps) + 8,
                            max_tokens_per_call=max(max(c) for c in steps))
    outs, topk, cand = {}, {}, {}
    for s, counts in enumerate(steps):
        step = stack.step(state, counts)
        for L in sorted(stack.layers):
            x = torch.randn(sum(counts), cfg.dim, generator=gen).bfloat16().to(device)
            outs[s, L] = stack.layers[L](x, state, step).cpu()
            if cfg.layer(L).is_index_source:
                topk[s, L] = step.topk(L).cpu()
            if cfg.layer(L).is_candidate_source:
                cand[s] = step.board.candidates().cpu()
    return outs, topk, cand


def check_roles(cfg: AttentionConfig, group, device, backend: str = "reference",
                batch_invariant: bool = False, seed: int = 0,
                report: TPReport | None = None) -> TPReport:
    """Part 1 of the module doc, on this rank of ``group``."""
    report = report if report is not None else TPReport()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    names, layers = check_layers(cfg)
    full = {L: random_layer_weights(cfg, L, seed=seed + L, device=device) for L in layers}
    shards = {L: shard_layer_weights(cfg, w, rank, world) for L, w in full.items()}
    steps = role_schedule(cfg)
    kw = dict(backend=backend, batch_invariant=batch_invariant)
    want = _run(AttentionStack(cfg, full, **kw), cfg, steps, device, seed + 1)
    del full
    got = _run(AttentionStack(cfg, shards, tp_group=group, **kw), cfg, steps, device, seed + 1)
    tol = tolerances(cfg)
    differ: dict[tuple[int, int], torch.Tensor] = {}  # (step, index source) -> rows differing
    for key, sel in want[1].items():
        differ[key] = topk_row_mismatches(got[1][key], sel)
    for s, kept in want[2].items():  # candidate blocks, under the same bar as the top-k
        rows = (got[2][s] != kept).any(-1)
        if int(rows.sum()) > tol["topk_frac"] * rows.numel():
            report.problems.append(f"step {s}: the candidate blocks of {int(rows.sum())} of "
                                   f"{rows.numel()} rows differ from one process's")
    for L in sorted(names):
        spec = cfg.layer(L)
        errs, bad, total = [], 0, 0
        if spec.is_index_source:
            bad = sum(int(differ[s, L].sum()) for s in range(len(steps)))
            total = sum(differ[s, L].numel() for s in range(len(steps)))
        for s in range(len(steps)):
            keep = ~differ[s, spec.index_source] if spec.index_source is not None else None
            g, e = got[0][s, L], want[0][s, L]
            if keep is not None:
                g, e = g[keep], e[keep]
            if e.numel():
                errs.append(rel_err(g, e))
        worst = max(errs, default=0.0)
        report.roles.append((L, names[L], worst, bad, total))
        if bad > tol["topk_frac"] * total:
            report.problems.append(f"layer {L} ({names[L]}): {bad}/{total} top-k rows differ "
                                   f"from one process's (at most {tol['topk_frac']:.0%} may)")
        if worst > tol["output"]:
            report.problems.append(f"layer {L} ({names[L]}): output error {worst:.3e} against "
                                   f"one process's > {tol['output']:g}")
    return report


def check_fixtures(fixtures, group, device, backend: str = "reference",
                   batch_invariant: bool = False, report: TPReport | None = None) -> TPReport:
    """Part 2 of the module doc: each loaded ``Fixture`` replayed sharded over ``group``."""
    report = report if report is not None else TPReport()
    for fx in fixtures:
        name = os.path.basename(fx.path)
        res = replay(fx, fx.semantics, device=device,
                     stack=fx.stack(device, backend, group, batch_invariant))
        for sem in fx.semantics:
            c = compare(fx, {k: v.cpu() for k, v in res[sem].items()}, sem)
            errs = sorted(e for *_, e in c["per_output"])
            problems = tolerance_problems(fx, c, sem)
            report.fixtures.append(
                f"{name} [{sem}]: top-k rows differing "
                f"{c['topk_rows'][0]}/{c['topk_rows'][1]}, output error max {errs[-1]:.3e}, "
                f"median {errs[len(errs) // 2]:.3e}, per layer max "
                f"{max(c['per_layer'].values()):.3e}: "
                + ("within the fixture's tolerances" if not problems else "OUTSIDE them"))
            report.problems += [f"{name} {p}" for p in problems]
    return report
