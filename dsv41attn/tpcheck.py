"""The tensor-parallel check, one process per rank (``python -m dsv41attn tpcheck`` under
torchrun, NCCL on GPUs or gloo on the CPU): the sharded layers against the unsharded ones, and
the golden fixtures replayed at the world size, within the fixtures' tolerances.

1. Roles: one layer of each role the config has (and the sources it reads), random weights of
   one seed on every rank, run twice on each rank through the same ragged schedule (a batch
   of two sequences: a prefill past the window and past ``index_topk`` complete compressed
   rows, decodes, a chunk, an idle sequence): whole, then sharded over the group. Top-k and
   candidate blocks are compared row by row. The index scores are summed per rank and
   all-reduced in bf16 (docs/numerics.md §10), so a row whose score is within a few bf16 ulps
   of a query's k-th may swap places with another: with random weights at V4.1 geometry,
   where a thousand rows share a few hundred bf16 values, that happens in about one query in
   ten. So every differing selection must be explained: each row in the difference scores (on
   one process, from the whole run's own index inputs) within what the ranks' sum can move
   a score of the query's k-th (``_scores``: two bf16 ulps of the largest rank's partial
   per rank, and two of the score), and each differing candidate block's maximum likewise
   of the last kept block's; a consumer whose candidate blocks differ that way is excused. The
   outputs of the rows whose selection agrees are held to the fixtures' ``output`` bound per
   (step, layer).
2. Fixtures: each replayed through a stack sharded over the group (``Fixture.stack``), held to
   its README's tolerances (``fixtures.tolerance_problems``).

Every rank computes the same report (the collectives make their outputs equal); the command
prints rank 0's and exits 1 on any problem.
"""
from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .checkpoint import random_layer_weights
from .config import AttentionConfig
from .fixtures import compare, rel_err, replay, tolerance_problems, tolerances, \
    topk_row_mismatches
from .ops.common.packing import paged_index_keys
from .ops.indexer.reference import index_scores, mask_invisible
from .stack import AttentionStack
from .tp import shard_layer_weights, tp_shape


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


def _run(stack: AttentionStack, cfg: AttentionConfig, steps, device, seed: int,
         keep_scores: list[slice] | None = None):
    """Outputs per (step, layer), top-k per (step, index source), kept candidate blocks per
    step, of ``steps`` through every layer of ``stack``: the same seeded inputs on every
    rank, made on the CPU. ``keep_scores`` (each rank's index heads): also each index
    source's scores per (step, layer) and how far the ranks' sum may move them (``_scores``,
    from the inputs it scored)."""
    gen = torch.Generator().manual_seed(seed)
    state = stack.new_state(2, capacity=sum(max(c) for c in steps) + 8,
                            max_tokens_per_call=max(max(c) for c in steps))
    outs, topk, cand, scores = {}, {}, {}, {}
    for s, counts in enumerate(steps):
        # a traced step keeps what each index source scored (the hook itself records nothing)
        step = stack.step(state, counts, trace=None if keep_scores is None
                          else (lambda layer, record: None))
        for L in sorted(stack.layers):
            spec = cfg.layer(L)
            x = torch.randn(sum(counts), cfg.dim, generator=gen).bfloat16().to(device)
            outs[s, L] = stack.layers[L](x, state, step).cpu()
            if spec.is_index_source:
                topk[s, L] = step.topk(L).cpu()
                if keep_scores is not None:
                    kept = step.board.candidates() if spec.is_candidate_consumer else None
                    scores[s, L] = _scores(step.board.index_inputs.get(L), state.block_table,
                                           step.plan.token_row, kept, cfg.candidate_block_size,
                                           topk[s, L].shape[0], keep_scores)
            if spec.is_candidate_source:
                cand[s] = step.board.candidates().cpu()
    return outs, topk, cand, scores


def _scores(inputs, block_table, token_row, kept, block_size: int, tokens: int,
            ranks: list[slice]) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores, slack), [T, scan] float32 on the CPU. scores: each query's bf16 index scores
    (the reference's ``index_scores`` over the paged keys), -inf where the query cannot see
    the row or (a consumer, ``kept`` [T, nblk]) its block was not kept. slack: how far
    the ranks (``ranks``: each one's index heads) may move a score: each rounds its partial
    (its heads' sum) to bf16 and their bf16 sum rounds once per addition, so 2 bf16 ulps of
    the largest partial per rank plus 2 of the score (about twice the worst case). [T, 0]
    when the layer
    scored nothing (``inputs`` None or no complete row)."""
    if inputs is None or inputs[3].scan == 0:
        return torch.empty(tokens, 0), torch.empty(tokens, 0)
    q, w, pool, facts = inputs
    out = torch.full((q.shape[0], facts.scan), float("-inf"))
    slack = torch.zeros(q.shape[0], facts.scan)
    for row in torch.unique(token_row).tolist():
        mine = (token_row == row).nonzero().squeeze(1)
        keys = paged_index_keys(pool, block_table[row:row + 1], facts.scan)
        qm, wm = q[mine].unsqueeze(0), w[mine].unsqueeze(0)
        sc = index_scores(qm, wm, keys)[0].float().cpu()
        part = torch.zeros_like(sc)
        for h in ranks:  # the largest rank's partial
            part = torch.maximum(part, index_scores(qm[:, :, h], wm[:, :, h], keys)[0]
                                 .float().abs().cpu())
        vis = mask_invisible(sc.unsqueeze(0), facts.visible[mine].cpu().unsqueeze(0))[0]
        out[mine.cpu()] = vis
        slack[mine.cpu()] = 2 * len(ranks) * _ulp(part) + 2 * _ulp(sc)
    if kept is not None:
        blocks = torch.arange(facts.scan) // block_size
        out = out.masked_fill(~kept.cpu()[:, blocks], float("-inf"))
    return out, slack


def _ulp(x: torch.Tensor) -> torch.Tensor:
    """The bf16 ulp of each |x| (float32 holding bf16 values; 0 -> the smallest normal's)."""
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(2.0 ** -126))) - 7)


def _explained(s: torch.Tensor, slack: torch.Tensor, rows: torch.Tensor, kth: int) -> bool:
    """Whether every entry ``rows`` of a query's scores ``s`` (its slack ``slack``) is within
    both slacks of the entry ``kth`` (the query's last selected): a near-tie."""
    inside = rows < s.numel()
    r = rows.clamp(max=s.numel() - 1)
    near = torch.isfinite(s[r]) & ((s[r] - s[kth]).abs() <= slack[r] + slack[kth])
    return bool((inside & near).all())


def unexplained_rows(scores: torch.Tensor, slack: torch.Tensor, got: torch.Tensor,
                     want: torch.Tensor, k: int) -> torch.Tensor:
    """[T] bool: queries whose selections ``got`` and ``want`` ([T, k] row numbers, -1 pads)
    differ in a row that is not a near-tie: every row in the difference must score, in
    ``scores`` [T, n] (one process's; -inf: not a candidate), within its and the k-th row's
    ``slack`` of the query's k-th largest score. A query with k or fewer candidate rows has
    no tie to explain a difference."""
    out = torch.zeros(got.shape[0], dtype=torch.bool)
    for t in topk_row_mismatches(got, want).nonzero().flatten().tolist():
        s = scores[t]
        if int(torch.isfinite(s).sum()) <= k:
            out[t] = True
            continue
        kth = int(torch.sort(s, descending=True, stable=True).indices[k - 1])
        diff = set(got[t][got[t] >= 0].tolist()) ^ set(want[t][want[t] >= 0].tolist())
        out[t] = not _explained(s, slack[t], torch.tensor(sorted(diff), dtype=torch.long), kth)
    return out


def unexplained_blocks(scores: torch.Tensor, slack: torch.Tensor, got: torch.Tensor,
                       want: torch.Tensor, visible: torch.Tensor, topk_blocks: int,
                       block_size: int) -> torch.Tensor:
    """[T] bool: queries whose kept candidate blocks ``got`` / ``want`` [T, nblk] differ in a
    block whose maximum score (``scores`` [T, n], one process's) is not within the slacks
    (the largest of each block's rows) of the last kept block's maximum; the newest visible
    block is pinned, as the indexer does."""
    t_all, n = scores.shape
    nblk = got.shape[1]
    padded = torch.full((t_all, nblk * block_size), float("-inf"))
    padded[:, :n] = scores
    block = padded.view(t_all, nblk, block_size).amax(-1)
    pad_slack = torch.zeros(t_all, nblk * block_size)
    pad_slack[:, :n] = slack
    block_slack = pad_slack.view(t_all, nblk, block_size).amax(-1)
    newest = (visible - 1).div(block_size, rounding_mode="floor")
    block = block.masked_fill(torch.arange(nblk) == newest.unsqueeze(-1), float("inf"))
    out = torch.zeros(t_all, dtype=torch.bool)
    for t in (got != want).any(-1).nonzero().flatten().tolist():
        if int((block[t] > float("-inf")).sum()) <= topk_blocks:
            out[t] = True
            continue
        kth = int(torch.sort(block[t], descending=True, stable=True).indices[topk_blocks - 1])
        d = (got[t] != want[t]).nonzero().flatten()
        out[t] = not _explained(block[t], block_slack[t], d, kth)
    return out


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
    ranks = [tp_shape(cfg, r, world).index_head_slice for r in range(world)]
    want = _run(AttentionStack(cfg, full, **kw), cfg, steps, device, seed + 1, keep_scores=ranks)
    del full
    got = _run(AttentionStack(cfg, shards, tp_group=group, **kw), cfg, steps, device, seed + 1)
    tol = tolerances(cfg)
    differ: dict[tuple[int, int], torch.Tensor] = {}  # (step, index source) -> rows differing
    for key, sel in want[1].items():
        differ[key] = topk_row_mismatches(got[1][key], sel)
    # candidate blocks: a differing block must be a near-tie at the last kept one; a
    # consumer's queries whose blocks differ so are excused from its own near-tie test
    excused: dict[int, torch.Tensor] = {}
    for s, kept in want[2].items():
        scores, slack = want[3][s, cfg.candidate_source_layer]
        bad_blocks = unexplained_blocks(scores, slack, got[2][s], kept,
                                        torch.isfinite(scores).sum(-1),
                                        cfg.candidate_topk_blocks, cfg.candidate_block_size)
        excused[s] = (got[2][s] != kept).any(-1) & ~bad_blocks
        if bad_blocks.any():
            report.problems.append(
                f"step {s}: the candidate blocks of {int(bad_blocks.sum())} of "
                f"{kept.shape[0]} queries differ from one process's beyond near-ties")
    for L in sorted(names):
        spec = cfg.layer(L)
        errs, bad, total, unexplained = [], 0, 0, 0
        if spec.is_index_source:
            for s in range(len(steps)):
                rows = unexplained_rows(*want[3][s, L], got[1][s, L], want[1][s, L],
                                        want[1][s, L].shape[-1])
                if spec.is_candidate_consumer and s in excused:
                    rows &= ~excused[s]
                unexplained += int(rows.sum())
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
        if unexplained:
            report.problems.append(f"layer {L} ({names[L]}): {unexplained} of the {bad}/{total} "
                                   "top-k rows that differ from one process's differ beyond "
                                   "near-ties (what the ranks' bf16 partial sums can move)")
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
            errs = [e for *_, e in c["per_output"]]
            problems = tolerance_problems(fx, c, sem)
            report.fixtures.append(  # the max and median that tolerance_problems holds
                f"{name} [{sem}]: top-k rows differing "
                f"{c['topk_rows'][0]}/{c['topk_rows'][1]}, output error max {max(errs):.3e}, "
                f"median {statistics.median(errs):.3e}, per layer max "
                f"{max(c['per_layer'].values()):.3e}: "
                + ("within the fixture's tolerances" if not problems else "OUTSIDE them"))
            report.problems += [f"{name} {p}" for p in problems]
    return report
