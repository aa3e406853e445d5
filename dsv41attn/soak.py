"""A randomized soak of the serving state: every output checked against an oracle, bit for bit.

A server's mix of calls on a small paged pool (fewer pages than the sequences could use):
ragged steps (prefill, chunks longer than the window, decode, idle rows), draft verification
followed by a truncate, deeper rollbacks, forks (shared and copied), releases and slot reuse,
decode plans, steps that fail in a layer, steps aborted midway, and calls that must be
refused (a stale step, a rollback past the kept history, running out of pages). Every output
of every accepted call is compared with the same tokens decoded one at a time on a fresh
state of the same backend (the oracle); a refused call must be refused for the reason the model
predicts. The oracle runs the backend under test because the triton backend agrees with the
reference within the fixtures' tolerances, not bit for bit (the role and fixture tests check
that). The triton backend runs in its batch-invariant mode here: its default mode lets a
row's last bits follow the call's row count where a fixed order costs (wo_a's batched GEMM:
a multi-token step's output can differ in its last bits from the same token alone, with
equal attention outputs), while in the invariant mode, as in the reference backend, a
token's outputs are the same bits whatever the batch, chunking or history: a state bug
shows as a mismatch, a last-bit difference between backends or call sizes does not.

``soak(seconds=..., seed=...)`` returns the figures; ``python -m dsv41attn soak`` runs it.
``inject="ring"`` flips one bit of a live ring row now and then: a soak that does not report
mismatches then is blind, which the tests check.
"""
from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass, field

import torch

from .cache import StateError
from .checkpoint import random_layer_weights
from .config import preset
from .stack import AttentionStack


@dataclass
class SoakFigures:
    steps: int = 0
    tokens: int = 0
    decode_plans: int = 0
    rollbacks: int = 0
    refused_rollbacks: int = 0
    forks: int = 0
    releases: int = 0
    page_reuses: int = 0
    out_of_pages: int = 0
    failed_steps: int = 0
    aborted_steps: int = 0
    stale_refused: int = 0
    mismatches: int = 0
    first_mismatch: str = ""
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def line(self) -> str:
        keys = ("steps", "tokens", "decode_plans", "rollbacks", "refused_rollbacks", "forks",
                "releases", "page_reuses", "out_of_pages", "failed_steps", "aborted_steps",
                "stale_refused", "mismatches")
        return ", ".join(f"{k} {getattr(self, k)}" for k in keys) + f" in {self.seconds:.0f} s"


class _Oracle:
    """One sequence decoded token by token on its own fresh one-slot state: outputs per
    position, and a snapshot of that state after every position (so a rollback or a fork
    costs nothing to follow)."""

    def __init__(self, stack: AttentionStack, capacity: int):
        self.stack, self.capacity = stack, capacity
        self.states = [stack.new_state(1, capacity=capacity, rollback=0)]
        self.inputs: list[dict[int, torch.Tensor]] = []  # per position: layer -> [dim]
        self.outputs: list[dict[int, torch.Tensor]] = []

    def copy(self) -> "_Oracle":
        other = _Oracle.__new__(_Oracle)
        other.stack, other.capacity = self.stack, self.capacity
        other.states, other.inputs, other.outputs = list(self.states), list(self.inputs), \
            list(self.outputs)
        return other

    def extend(self, xs: list[dict[int, torch.Tensor]]) -> None:
        for x in xs:
            state = self.states[-1].clone()
            y = self.stack.forward({L: v.view(1, 1, -1) for L, v in x.items()}, state)
            self.states.append(state)
            self.inputs.append(x)
            self.outputs.append({L: v.view(-1) for L, v in y.items()})

    def truncate(self, n: int) -> None:
        del self.states[n + 1:], self.inputs[n:], self.outputs[n:]


def soak(seconds: float = 10.0, seed: int = 0, backend: str = "reference",
         inject: str | None = None, max_steps: int | None = None, log=None) -> SoakFigures:
    """Run the soak for ``seconds`` (or ``max_steps`` calls) on the tiny preset."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    cfg = preset("tiny")
    layers = list(range(cfg.n_layers))
    weights = {L: random_layer_weights(cfg, L, seed=seed) for L in layers}
    stack = AttentionStack(cfg, weights, backend=backend, batch_invariant=backend == "triton")
    oracle_stack = stack  # the same backend: the soak checks the state, bit for bit
    slots, capacity, page_size, rollback = 4, 40, 4, 5
    state = stack.new_state(slots, capacity=capacity, page_size=page_size, num_pages=24,
                            rollback=rollback, max_tokens_per_call=14)
    oracles: dict[int, _Oracle] = {row: _Oracle(oracle_stack, capacity) for row in range(slots)}
    ever_used: set[int] = set()
    fig = SoakFigures()
    start = time.monotonic()

    def token(n: int) -> list[dict[int, torch.Tensor]]:
        x = torch.randn(n, len(layers), cfg.dim, generator=gen)
        x = x / x.pow(2).mean(-1, keepdim=True).sqrt()
        return [{L: x[i, j].bfloat16() for j, L in enumerate(layers)} for i in range(n)]

    def check(row: int, first: int, got: dict[int, torch.Tensor], what: str) -> None:
        want = oracles[row].outputs
        for L, y in got.items():
            for i in range(y.shape[0]):
                if not torch.equal(y[i], want[first + i][L]):
                    fig.mismatches += 1
                    if not fig.first_mismatch:
                        fig.first_mismatch = (f"{what}: sequence {row} position {first + i} "
                                              f"layer {L} (step {fig.steps})")
                    return

    def note_pages() -> None:
        used = {int(p) for p in state.block_table.flatten().tolist() if p >= 0}
        fig.page_reuses += len(used & ever_used - note_pages.last)
        note_pages.last = used
        ever_used.update(used)
    note_pages.last = set()

    def live() -> list[int]:
        return [r for r in range(slots) if state.active[r]]

    def or_out_of_pages(open_call):
        """``open_call()``, or None counted as an out-of-pages refusal (any other error raises)."""
        try:
            return open_call()
        except StateError as e:
            if "out of cache pages" not in str(e):
                raise
            fig.out_of_pages += 1
            return None

    def run_step(rows, counts, fail_at=None, abort_after=None):
        xs_per_row = {r: token(m) for r, m in zip(rows, counts)}
        packed = {L: torch.stack([x[L] for r in rows for x in xs_per_row[r]]) for L in layers}
        step = or_out_of_pages(lambda: stack.step(state, counts, rows=rows))
        if step is None:
            return
        note_pages()
        if fail_at is not None:
            good = stack.layers[fail_at].ops

            def boom(*a, **k):
                raise RuntimeError("injected")
            stack.layers[fail_at].ops = dataclasses.replace(good, output_projection=boom)
            try:
                stack.run(step, packed)
                raise AssertionError("the injected failure did not raise")
            except RuntimeError as e:
                if "injected" not in str(e):
                    raise
            finally:
                stack.layers[fail_at].ops = good
            fig.failed_steps += 1
            return
        if abort_after is not None:
            stack.run(step, packed, layers=layers[:abort_after])
            step.abort()
            fig.aborted_steps += 1
            return
        out = stack.run(step, packed)
        fig.steps += 1
        fig.tokens += sum(counts)
        at = 0
        for r, m in zip(rows, counts):
            first = len(oracles[r].outputs)
            oracles[r].extend(xs_per_row[r])
            check(r, first, {L: y[at:at + m] for L, y in out.items()}, "step")
            at += m
        return step

    while True:
        elapsed = time.monotonic() - start
        if (max_steps is not None and fig.steps >= max_steps) or \
                (max_steps is None and elapsed > seconds):
            break
        rows = live()
        if not rows:
            state.add_sequence()
            continue
        op = rng.random()
        if inject == "ring" and rng.random() < 0.2:
            row = rng.choice(rows)
            p = state.position_of(row)
            if p:
                slot = (p - 1) % state.ring_slots
                state.layers[rng.choice(layers)].window[row, slot, rng.randrange(cfg.head_dim)] ^= 1
        if op < 0.40:  # a ragged step: prefills, chunks past the window, decodes, idle rows
            pick = [r for r in rows if rng.random() < 0.8] or rows[:1]
            counts = [rng.choice([0, 1, 1, 1, 2, 3, 5, 9, 13]) for _ in pick]
            counts = [min(c, capacity - state.position_of(r)) for c, r in zip(counts, pick)]
            if any(counts):
                run_step(pick, counts)
        elif op < 0.55:  # verify drafts, accept some, roll back the rest
            row = rng.choice(rows)
            p = state.position_of(row)
            k = min(rng.randint(1, 4), capacity - p)
            if k and run_step([row], [k]) is not None:
                keep = p + rng.randint(0, k)
                back_to = keep - (rng.randint(0, 3) if rng.random() < 0.3 else 0)
                back_to = max(back_to, 0)
                allowed = state.written_end[row] - back_to <= rollback
                try:
                    state.truncate(row, back_to)
                    assert allowed, f"truncate to {back_to} should have been refused"
                    oracles[row].truncate(back_to)
                    fig.rollbacks += 1
                except StateError as e:
                    if "out of cache pages" in str(e):  # a shared page to copy, none free
                        assert allowed, e  # the history check comes first
                        fig.out_of_pages += 1
                    else:
                        assert not allowed and "rollback" in str(e), e
                        fig.refused_rollbacks += 1
        elif op < 0.65:  # a decode plan over some sequences
            pick = [r for r in rows if state.position_of(r) < capacity - 3] or None
            if pick:
                n = rng.randint(1, 3)
                plan = or_out_of_pages(lambda: stack.plan_decode(state, rows=pick, steps=n))
                if plan is None:
                    continue
                note_pages()
                fig.decode_plans += 1
                for _ in range(rng.randint(1, n)):
                    xs = {r: token(1)[0] for r in pick}
                    out = plan.run({L: torch.stack([xs[r][L] for r in pick]) for L in layers})
                    for i, r in enumerate(pick):
                        first = len(oracles[r].outputs)
                        oracles[r].extend([xs[r]])
                        check(r, first, {L: y[i:i + 1] for L, y in out.items()}, "plan")
                    fig.steps += 1
                    fig.tokens += len(pick)
        elif op < 0.72:  # fork (a full batch first frees a slot)
            row = rng.choice(rows)
            if all(state.active) and len(rows) > 1:
                other = rng.choice([r for r in rows if r != row])
                state.release(other)
                oracles[other] = _Oracle(oracle_stack, capacity)
                fig.releases += 1
            try:
                new = state.fork(row, share=rng.random() < 0.5)
            except StateError:
                continue
            oracles[new] = oracles[row].copy()
            fig.forks += 1
        elif op < 0.80:  # release (the longest sequence more often), maybe reuse the slot
            row = max(rows, key=state.position_of) if rng.random() < 0.5 else rng.choice(rows)
            state.release(row)
            oracles[row] = _Oracle(oracle_stack, capacity)
            fig.releases += 1
            if rng.random() < 0.5:
                oracles[state.add_sequence()] = _Oracle(oracle_stack, capacity)
        elif op < 0.87:  # a step that fails in a layer, or is aborted midway
            row = rng.choice(rows)
            m = min(rng.randint(1, 6), capacity - state.position_of(row))
            if m:
                if rng.random() < 0.5:
                    run_step([row], [m], fail_at=rng.choice(layers))
                else:
                    run_step([row], [m], abort_after=rng.randint(1, len(layers) - 1))
        else:  # a stale step: opened, then its sequence changes; running it must be refused
            row = rng.choice(rows)
            p = state.position_of(row)
            if p < capacity:
                step = or_out_of_pages(lambda: stack.step(state, [1], rows=[row]))
                if step is None:
                    continue
                state.truncate(row, p)
                try:
                    stack.run(step, {L: token(1)[0][L].view(1, -1) for L in layers})
                    raise AssertionError("a stale step ran")
                except StateError:
                    fig.stale_refused += 1
    fig.seconds = time.monotonic() - start
    if log:
        log(fig.line())
    return fig
