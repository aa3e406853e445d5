"""Decoding without host syncs: plan once on the host, run on the GPU only, replay a CUDA graph.

FlashInfer's split. ``DecodePlan`` (host, once per batch of sequences): checks the
sequences, reads their positions once, reserves every page the next ``steps`` tokens write,
and fixes every shape, including the compressed rows each indexer scans (enough for the last
of those steps; rows a query cannot see yet are masked, so scanning more selects the same
rows). ``DecodePlan.run`` then decodes one token per sequence through the layers with the
positions read and advanced on the device: no host sync and no data-dependent shape, so it
can run inside ``torch.cuda.graph``. ``DecodePlan.capture`` does that: one eager warm-up step
(it compiles the kernels), then a graph of the next step, replayed by ``DecodeGraph.replay``.

A plan is valid until ``steps`` tokens are decoded or its sequences are changed by anything
else (a step, another plan, truncate, fork, release, add_sequence): each slot's
``AttentionState.generation`` tells.
Plans use "fixed" index-key semantics (every KV source publishes its keys every step);
"reference" semantics depends on each step's position, so it runs through ``stack.step``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Mapping

import torch

from .cache import AttentionState, StateError
from .plan import Board, StepPlan, UndoLog

if TYPE_CHECKING:
    from .stack import AttentionStack

Inputs = Mapping[int, torch.Tensor] | Callable[[int], torch.Tensor]


class DecodePlan:
    """``steps`` decode steps (one token per sequence) of the sequences in state rows ``rows``
    through ``layers`` (``AttentionStack.plan_decode`` checks both and builds it)."""

    def __init__(self, stack: "AttentionStack", state: AttentionState, rows: list[int],
                 steps: int, layers: list[int]):
        cfg = stack.cfg
        if cfg.index_semantics != "fixed":
            raise ValueError(f"a DecodePlan runs 'fixed' index-key semantics; this config has "
                             f"{cfg.index_semantics!r} (use stack.step for it)")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be an int >= 1, got {steps!r}")
        state.check_not_mid_step(rows, "plan decoding")
        positions = [state.position_of(r, layers) for r in rows]
        for row, p in zip(rows, positions):
            if p + steps > state.capacity:
                raise StateError(f"sequence {row}: {steps} steps from position {p} exceed the "
                                 f"cache capacity of {state.capacity} positions")
        if sum(state.pages_needed(rows, [p + steps for p in positions])) > state.free_pages:
            state.reserve(rows, [p + steps for p in positions])  # raises: out of pages
        state._drop_unstarted_steps(rows)
        state.reserve(rows, [p + steps for p in positions])  # the plan's pages stay with them
        for row in rows:
            state.generation[row] += 1  # an older plan or step on these rows is now stale
        self.stack, self.state, self.layers, self.rows = stack, state, layers, rows
        self.generations = [state.generation[r] for r in rows]
        self.steps_left = steps
        self.positions = positions  # host mirror, advanced by each run
        dev = state.device
        b = len(rows)
        dev_rows = torch.tensor(rows, dtype=torch.int64).to(dev)
        self.plan = StepPlan(cfg, state, rows, [1] * b, list(range(b + 1)), dev_rows,
                             stack.freqs_for(layers), stack.ratios_for(layers), compact=False,
                             kernels=stack.layers[layers[0]].ops.capturable)
        self.plan.seq_rows = dev_rows
        self.plan.token_groups = [(1, torch.arange(b, device=dev))]
        self._first = torch.arange(b, device=dev)
        # rows each indexer scans: enough for the last planned step
        self._scans = {r: (max(positions) + steps) // r for r in self.plan.ratios_used}

    @property
    def batch_size(self) -> int:
        return len(self.positions)

    def run(self, xs: Inputs) -> dict[int, torch.Tensor]:
        """Decode one token per sequence: xs maps layer -> [b, dim] (or [b, 1, dim]) bf16
        (or is a function of the layer). Returns layer -> output in x's layout. No host sync
        on a capturable backend. If a layer raises, every sequence is left as before."""
        return dict(self.iter_run(xs))

    def iter_run(self, xs: Inputs, runners: Mapping[int, Callable] | None = None):
        """``run`` one layer at a time: yields (layer, output) after each layer (to time or
        inspect them); the step counts once the last layer has run. Closing the generator
        early, or an exception in a layer, undoes the step. ``runners``: layer -> a callable
        with ``AttentionLayer.run``'s signature to use instead (e.g. a compiled one)."""
        self._check_live()
        inputs = self._inputs(xs)
        undo = UndoLog()
        finished = False
        try:
            for L, y in self._launch(inputs, undo, runners or {}):
                yield L, y
            finished = True
        finally:
            if not finished:
                undo.undo()
        self._advance()

    def capture(self, xs: Inputs) -> "DecodeGraph":
        """Run one step eagerly on a side stream (the warm-up: kernels compile, workspaces
        are allocated), then capture the next step in a CUDA graph. Takes two of the plan's
        steps; the warm-up's outputs are ``DecodeGraph.warmup_outputs``."""
        if self.state.device.type != "cuda":
            raise ValueError(f"CUDA-graph capture needs a CUDA state, this one is on "
                             f"{self.state.device}")
        ops = self.stack.layers[self.layers[0]].ops
        if not ops.capturable:
            raise ValueError(f"the {ops.name!r} backend's ops read the host (boolean-mask "
                             "writes), which a CUDA graph cannot record: use backend='triton'")
        if self.steps_left < 2:
            raise StateError(f"capture needs 2 steps left in the plan (warm-up + captured), "
                             f"it has {self.steps_left}")
        return DecodeGraph(self, xs)

    def derive_facts(self) -> None:
        """The step's facts on the device from the sequences' current positions (RoPE
        rotations, window lists, ring and page slots, compressor groups, visibility): what
        every layer of a step shares, derived once before the first layer. Writes only the
        plan's own buffers, so calling it again for the same positions changes nothing (the
        bench times it alone, to tell a layer's cost from the step's)."""
        plan = self.plan
        pos = self.state.layers[self.layers[0]].positions[plan.seq_rows]  # [b] int64
        plan.derive(pos, pos, self._first, pos, self._scans)

    # ---- internals -------------------------------------------------------------------------
    def _check_live(self) -> None:
        st = self.state
        for row, gen in zip(self.rows, self.generations):
            if st.generation[row] != gen:
                raise StateError(f"sequence {row} changed since this plan was made (a step, "
                                 "another plan, truncate, fork, release or add_sequence): "
                                 "plan again")
        if self.steps_left < 1:
            raise StateError("this plan's steps are used up (its pages were reserved for them): "
                             "plan again")

    def _inputs(self, xs: Inputs) -> dict[int, torch.Tensor]:
        get = xs if callable(xs) else xs.__getitem__
        cfg, b, out = self.stack.cfg, self.batch_size, {}
        for L in self.layers:
            try:
                x = get(L)
            except KeyError:
                raise KeyError(f"xs has no input for layer {L} (the plan runs {self.layers})")
            if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16:
                raise TypeError(f"layer {L}: x must be a bfloat16 torch.Tensor, got "
                                f"{getattr(x, 'dtype', type(x).__name__)}")
            if tuple(x.shape) not in ((b, cfg.dim), (b, 1, cfg.dim)):
                raise ValueError(f"layer {L}: x must be [b={b}, dim={cfg.dim}] or [b, 1, dim], "
                                 f"got {list(x.shape)}")
            if x.device != self.state.device:
                raise ValueError(f"layer {L}: x is on {x.device}, the state on {self.state.device}")
            out[L] = x
        return out

    def _launch(self, inputs: dict[int, torch.Tensor], undo: UndoLog,
                runners: Mapping[int, Callable] | None = None):
        """The GPU-only part: the plan's facts derived from the positions on the device,
        then every layer over the b tokens; yields (layer, output)."""
        plan, runners = self.plan, runners or {}
        self.derive_facts()
        board = Board()
        for L in self.layers:
            x = inputs[L]
            run = runners.get(L, self.stack.layers[L].run)
            with torch.no_grad():
                y = run(x.reshape(-1, x.shape[-1]), self.state, plan, board, undo, "fixed")
            yield L, y.view(x.shape)

    def _advance(self) -> None:
        self.steps_left -= 1
        self.positions = [p + 1 for p in self.positions]
        st = self.state
        for row, p in zip(self.rows, self.positions):
            st.advance(row, self.layers, p)


class DecodeGraph:
    """A decode step of a ``DecodePlan`` captured in a CUDA graph. ``replay(xs)`` copies xs
    into the static inputs, replays, and returns the static outputs (overwritten by the next
    replay: copy what you keep)."""

    def __init__(self, plan: DecodePlan, xs: Inputs):
        plan._check_live()
        self.plan = plan
        self.inputs = {L: x.detach().clone() for L, x in plan._inputs(xs).items()}
        side = torch.cuda.Stream(device=plan.state.device)
        side.wait_stream(torch.cuda.current_stream(plan.state.device))
        with torch.cuda.stream(side):
            warm = plan.run(self.inputs)
        torch.cuda.current_stream(plan.state.device).wait_stream(side)
        self.warmup_outputs = {L: y.clone() for L, y in warm.items()}
        # the layers' prepared weight copies the captured kernels read (those whose ops noted
        # a read while capturing): each must still serve its weights at every replay (a weight
        # written in place would leave the graph reading the old copy: a wrong answer, raised
        # instead); copies the graph does not read may come and go
        copies = {L: plan.stack.layers[L].serving_copies() for L in plan.layers}
        reads = {L: {k: c.reads for k, c in held.items()} for L, held in copies.items()}
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = dict(plan._launch(self.inputs, UndoLog(enabled=False)))
        self.serving = {L: {k: c for k, c in held.items() if c.reads != reads[L][k]}
                        for L, held in copies.items()}

    def replay(self, xs: Inputs | None = None) -> dict[int, torch.Tensor]:
        """One decode step (xs: as ``DecodePlan.run``; None reuses the static inputs). Raises
        StateError, changing nothing, where a weight whose prepared copy the graph reads was
        written in place since the capture and not prepared again (``AttentionStack.prepare``
        rewrites the copy in place, and the graph reads the new values), or its copy was
        dropped or replaced (capture again)."""
        self.plan._check_live()
        layers = self.plan.stack.layers
        for L, held in self.serving.items():
            if not held:
                continue
            now = layers[L].serving_copies()  # the very copies captured, still serving
            gone = [k for k, copy in held.items() if now.get(k) is not copy]
            if gone:
                raise StateError(f"layer {L}: {', '.join(gone)} changed since this graph was "
                                 "captured, and the graph reads the copy the backend prepared "
                                 "before: call stack.prepare() (which rewrites the copy in "
                                 "place where the new weights have one), or capture again")
        if xs is not None:
            for L, x in self.plan._inputs(xs).items():
                self.inputs[L].copy_(x.view(self.inputs[L].shape))
        self.graph.replay()
        self.plan._advance()
        return self.outputs
