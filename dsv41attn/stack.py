"""Layers 0..L-1 in order, and the step: one forward call over some sequences of a state.

A ``Step`` fixes the sequences (state rows), each one's start position and token count, the
index-key semantics and the layers it runs. Opening it checks everything checkable, reserves
the pages its tokens write and builds its ``StepPlan`` (``plan.py``) once for all its layers.
A step is a transaction: every write saves what it overwrites, so if a layer raises (or the
caller calls ``step.abort()``), every sequence of the step returns exactly to where it was
before the step: rings, open compressor groups, compressed rows and index keys, the pages the
step reserved and the shared index-key slot. It commits when its last layer has run.
Which index keys the shared slot holds is ``AttentionState.index_key_slot``: it persists
across steps, which is DeepSeek's stale-key behaviour in "reference" semantics
(docs/numerics.md §7).
"""
from __future__ import annotations

from typing import Callable, Iterable, Mapping, Sequence

import torch

from .cache import AttentionState, StateError, _int_arg
from .checkpoint import LayerWeights
from .config import SEMANTICS, AttentionConfig
from .decode import DecodePlan
from .layer import AttentionLayer
from .plan import Board, StepPlan, UndoLog, rope_variant

Inputs = Mapping[int, torch.Tensor] | Callable[[int], torch.Tensor]


def check_layer_order(cfg: AttentionConfig, layers: list[int]) -> None:
    """``layers`` (increasing) can run as one step: every layer's sources run before it."""
    for i, layer in enumerate(layers):
        spec = cfg.layer(layer)
        for src in spec.reads:
            if src not in layers[:i]:
                raise StateError(f"layer {layer} ({spec.role.value}) reads what layer {src} "
                                 f"publishes in the same step, but layer {src} is not among the "
                                 f"step's layers before it ({layers})")


class Step:
    """One forward step: ``tokens[i]`` new tokens for the sequence in state row ``rows[i]``
    (0 = idle), each continuing from its own position, through ``layers`` in increasing order.
    Inputs are packed sequence-major as [sum(tokens), dim] with offsets ``cu_seqlens``
    (flash-attn style), or [b, m, dim] when every sequence has m tokens. Open it with
    ``AttentionStack.step``."""

    def __init__(self, stack: "AttentionStack", state: AttentionState, rows: list[int],
                 starts: list[int], tokens: list[int], semantics: str, layers: list[int],
                 trace=None):
        self.cfg, self.state, self.semantics = stack.cfg, state, semantics
        self.trace = trace  # None, or a callable (layer, record): see AttentionLayer.run
        self.rows, self.starts, self.tokens, self.layers = rows, starts, tokens, layers
        self.cu_seqlens = [0]
        for t in tokens:
            self.cu_seqlens.append(self.cu_seqlens[-1] + t)
        self.plan: StepPlan | None = None
        self.board = Board(keep_index_inputs=trace is not None)
        self.undo = UndoLog()
        self._done: list[int] = []
        self.status = "open"
        self._pages: list = []
        self.generations = [state.generation[r] for r in rows]

    # ---- lifecycle -------------------------------------------------------------------------
    def _open(self, stack: "AttentionStack") -> None:
        """Reserve the pages, build the plan, take the rows (everything else was checked)."""
        st = self.state
        ends = [p + m for p, m in zip(self.starts, self.tokens)]
        self._pages = st.reserve(self.rows, ends)
        busy = [i for i, t in enumerate(self.tokens) if t > 0]
        try:
            self.plan = StepPlan.build(
                self.cfg, st, [self.rows[i] for i in busy], [self.starts[i] for i in busy],
                [self.tokens[i] for i in busy], stack.freqs_for(self.layers),
                stack.ratios_for(self.layers))
        except BaseException:
            st.unreserve(self._pages)
            raise
        for row in self.rows:
            st.open_step[row] = self

    @property
    def started(self) -> bool:
        return bool(self._done)

    @property
    def done(self) -> list[int]:
        """The layers that have run in this step, in order."""
        return list(self._done)

    def abort(self) -> None:
        """Undo the step: every sequence back to where it was before it was opened (its
        caches, the pages it reserved, the index-key slot). A finished step cannot be undone
        (truncate does that); aborting twice does nothing."""
        if self.status != "open":
            return
        self.undo.undo()
        self.state.unreserve(self._pages)
        self._release_rows()
        self.status = "aborted"

    def _release_rows(self) -> None:
        for row in self.rows:
            if self.state.open_step[row] is self:
                self.state.open_step[row] = None

    def _commit(self) -> None:
        st = self.state
        for row, p, m in zip(self.rows, self.starts, self.tokens):
            st.advance(row, self.layers, p + m)
        self.undo.clear()
        self._release_rows()
        self.status = "done"

    # ---- running layers ------------------------------------------------------------------
    def check_live(self) -> None:
        """Raise unless the step can still run (open, and its sequences untouched since)."""
        if self.status != "open":
            raise StateError(f"this step is {self.status}: open a new one")
        st = self.state
        for row, gen in zip(self.rows, self.generations):
            if st.generation[row] != gen or st.open_step[row] is not self:
                self.abort()
                raise StateError(f"sequence {row} changed since this step was opened (released, "
                                 "truncated, re-added or taken by another step or plan): the "
                                 "step was undone; open a new one")

    def begin_layer(self, layer: AttentionLayer, x: torch.Tensor, state: AttentionState) -> None:
        """Every check of one layer call, before it writes anything."""
        if state is not self.state:
            raise StateError("the step was opened on a different state")
        layer.check_state(state)
        self.check_live()
        L = layer.spec.layer
        if L not in self.layers:
            raise StateError(f"layer {L} is not one of this step's layers {self.layers}")
        expected = self.layers[len(self._done)]
        if L != expected:
            raise StateError(f"layer {L} called out of order: this step runs {self.layers} in "
                             f"order, each once, and layer {expected} is next (done: {self._done})")
        layer.check_input(x, self)
        if not self._done:  # the step starts changing its sequences: older plans are stale
            for row in self.rows:
                state.generation[row] += 1
            self.generations = [state.generation[r] for r in self.rows]

    def end_layer(self, layer: int) -> None:
        self._done.append(layer)
        if len(self._done) == len(self.layers):
            self._commit()

    # ---- the packed layout -------------------------------------------------------------------
    @property
    def total_tokens(self) -> int:
        return self.cu_seqlens[-1]

    @property
    def uniform(self) -> bool:
        """Every sequence has the same (non-zero) token count: x may be [b, m, dim]."""
        return len(set(self.tokens)) == 1 and self.tokens[0] > 0

    def topk(self, index_source: int) -> torch.Tensor:
        """[sum(tokens), k] int32: the compressed rows each token's query selected in
        ``index_source`` this step, packed like x; k = min(index_topk, the rows the step's
        indexer scanned), each row ascending and padded with -1."""
        return self.board.topk(index_source)


class AttentionStack:
    """The attention layers of one model (any subset of its layers), run in layer order."""

    def __init__(self, cfg: AttentionConfig, weights: Mapping[int, LayerWeights],
                 backend: str = "reference", tp_group=None, batch_invariant: bool = False):
        """``tp_group``: None, or the process group the layers' heads are split over
        (``AttentionLayer``); ``weights`` then hold this rank's shards. ``batch_invariant``
        (backend "triton"): a sequence gets the same bits alone, in any batch, in any chunking
        and token by token, at a cost measured in docs/benchmarks.md (``ops.backends``)."""
        if not isinstance(cfg, AttentionConfig):
            raise TypeError(f"cfg must be an AttentionConfig, got {type(cfg).__name__}")
        for key, w in weights.items():
            if not isinstance(w, LayerWeights):
                raise TypeError(f"weights[{key!r}] must be LayerWeights, got {type(w).__name__}")
            if _int_arg("weights key", key, 0) != w.layer:
                raise ValueError(f"weights[{key}] holds the weights of layer {w.layer}: key each "
                                 "layer's weights by its own id")
        if not weights:
            raise ValueError("weights must hold at least one layer")
        self.cfg = cfg
        self.backend = backend
        self.tp_group = tp_group
        self.batch_invariant = batch_invariant
        self.layers = {layer: AttentionLayer(cfg, weights[layer], backend, tp_group,
                                             batch_invariant)
                       for layer in sorted(weights)}
        devices = {layer.device for layer in self.layers.values()}
        if len(devices) != 1:
            raise ValueError(f"the layers' weights are on several devices {sorted(map(str, devices))}")
        self.device = devices.pop()
        # one RoPE frequency table per variant (window-only / compressed layers), on the device
        self._freqs = {}
        for layer in self.layers.values():
            self._freqs.setdefault(rope_variant(layer.spec), layer.freqs)

    @property
    def prepared_nbytes(self) -> int:
        """Bytes the layers keep beside their weights (``AttentionLayer.prepared_nbytes``)."""
        return sum(layer.prepared_nbytes for layer in self.layers.values())

    def prepare(self) -> None:
        """Rebuild every layer's prepared weight copies (``AttentionLayer.prepare``) after
        writing weights in place: copies made from the same tensors are rewritten in place,
        so decode graphs that read them replay the new weights."""
        for layer in self.layers.values():
            layer.prepare()

    def freqs_for(self, layers: list[int]) -> dict:
        return {rope_variant(self.cfg.layer(L)): self._freqs[rope_variant(self.cfg.layer(L))]
                for L in layers}

    def ratios_for(self, layers: list[int]) -> dict[int, tuple | None]:
        """Compress ratios the layers use -> the RoPE variant of a KV source among them."""
        out: dict[int, tuple | None] = {}
        for L in layers:
            spec = self.cfg.layer(L)
            if spec.ratio > 0:
                out.setdefault(spec.ratio, None)
                if spec.is_kv_source:
                    out[spec.ratio] = rope_variant(spec)
        return out

    def new_state(self, batch_size: int, capacity: int | None = None,
                  device: str | torch.device | None = None, **kw) -> AttentionState:
        """Caches for this stack's layers (and the KV sources they read)."""
        return AttentionState.allocate(self.cfg, batch_size, capacity, layers=list(self.layers),
                                       device=self.device if device is None else device, **kw)

    # ---- checks shared by steps and plans ----------------------------------------------------
    def _check_state(self, state) -> None:
        if not isinstance(state, AttentionState):
            raise TypeError(f"state must be an AttentionState, got {type(state).__name__}")
        state.check_config(self.cfg)
        if state.device != self.device:
            raise ValueError(f"the state is on {state.device}, the weights on {self.device}")

    def _rows(self, state: AttentionState, rows) -> list[int]:
        if rows is None:
            rows = list(range(state.batch_size))
            state.check_active(rows)
            return rows
        if isinstance(rows, torch.Tensor):
            if rows.dtype.is_floating_point or rows.dtype == torch.bool:
                raise TypeError(f"rows must be integers, got a {rows.dtype} tensor")
            rows = rows.reshape(-1).tolist()
        elif isinstance(rows, (str, bytes)) or not isinstance(rows, Iterable):
            raise TypeError(f"rows must be a sequence of slot numbers, got {rows!r}")
        rows = [_int_arg("rows", r) for r in rows]
        if not rows:
            raise ValueError("rows must name at least one sequence")
        if any(not 0 <= r < state.batch_size for r in rows):
            raise IndexError(f"rows {rows} out of range 0..{state.batch_size - 1}")
        if len(set(rows)) != len(rows):
            raise ValueError(f"rows {rows} repeat a sequence")
        state.check_active(rows)
        return rows

    def _layers(self, state: AttentionState, layers) -> list[int]:
        """The layers a step or plan runs: ``layers`` (default: this stack's layers in the
        state), each in this stack and in the state, in an order that can run."""
        if layers is None:
            order = sorted(L for L in self.layers if L in state.layers)
        else:
            if isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable):
                raise TypeError(f"layers must be a sequence of layer ids, got {layers!r}")
            order = sorted({_int_arg("layers", L, 0) for L in layers})
            missing = [L for L in order if L not in self.layers]
            if missing:
                raise KeyError(f"layers {missing} are not in this stack ({sorted(self.layers)})")
        if not order:
            raise StateError(f"none of the layers has caches in this state (allocated for "
                             f"{sorted(state.layers)})")
        for L in order:
            self.layers[L].check_state(state)
        check_layer_order(self.cfg, order)
        return order

    # ---- steps -----------------------------------------------------------------------------
    def plan_decode(self, state: AttentionState, rows: Sequence[int] | torch.Tensor | None = None,
                    steps: int = 1, layers: Iterable[int] | None = None) -> DecodePlan:
        """Plan ``steps`` decode steps (one token per sequence) of ``rows`` (default: all)
        through ``layers`` (default: this stack's layers in the state); see ``DecodePlan``."""
        self._check_state(state)
        rows = self._rows(state, rows)
        return DecodePlan(self, state, rows, steps, self._layers(state, layers))

    def step(self, state: AttentionState, tokens: int | Sequence[int],
             rows: Sequence[int] | torch.Tensor | None = None,
             semantics: str | None = None, layers: Iterable[int] | None = None,
             trace=None) -> Step:
        """Open a forward step: ``tokens`` new tokens (one int for all, or one per sequence,
        0 = idle) for the sequences in state rows ``rows`` (default: all), each continuing
        from its own position, through ``layers`` (default: this stack's layers in the state).
        Everything is checked before anything changes; then the step reserves its pages.
        ``trace``: an optional callable given (layer, record) inside every layer call."""
        self._check_state(state)
        semantics = semantics or self.cfg.index_semantics
        if semantics not in SEMANTICS:
            raise ValueError(f"semantics must be one of {SEMANTICS}, got {semantics!r}")
        rows = self._rows(state, rows)
        if isinstance(tokens, (str, bytes)) or not (hasattr(tokens, "__index__")
                                                    or isinstance(tokens, Iterable)):
            raise TypeError(f"tokens must be an int or a sequence of ints, got {tokens!r}")
        counts = [_int_arg("tokens", tokens, 0)] * len(rows) if hasattr(tokens, "__index__") \
            else [_int_arg("tokens", t, 0) for t in tokens]
        if len(counts) != len(rows):
            raise ValueError(f"{len(counts)} token counts for {len(rows)} sequences")
        if not any(counts):
            raise ValueError(f"token counts {counts}: at least one must be >= 1")
        order = self._layers(state, layers)
        state.check_not_mid_step(rows, "open a step")
        starts = [state.position_of(r, order) for r in rows]
        for row, p, m in zip(rows, starts, counts):
            if m > state.max_tokens_per_call:
                raise ValueError(f"sequence {row}: {m} tokens in one step, more than the "
                                 f"state's max_tokens_per_call={state.max_tokens_per_call}")
            if p + m > state.capacity:
                raise StateError(f"sequence {row}: positions {p}..{p + m - 1} exceed the cache "
                                 f"capacity of {state.capacity} positions")
        busy = {(p, m) for p, m in zip(starts, counts) if m}
        if semantics == "reference" and (len(busy) > 1 or 0 in counts):
            raise ValueError("reference semantics reproduces DeepSeek's schedule only: every "
                             "sequence at the same position with the same token count")
        step = Step(self, state, rows, starts, counts, semantics, order, trace)
        state._drop_unstarted_steps(rows)
        step._open(self)
        return step

    def forward(self, xs: Inputs, state: AttentionState, rows=None, semantics: str | None = None,
                layers: Iterable[int] | None = None) -> dict[int, torch.Tensor]:
        """Run one step through ``layers`` (default: every layer of the stack) in order.

        xs: layer -> [b, m, dim] bf16 input (or a function of the layer id), one shape for
        all. Returns layer -> [b, m, dim] bf16 output. Every input is checked before the step
        opens; if a layer raises, the step is undone.
        """
        self._check_state(state)
        order = self._layers(state, layers)
        inputs = self._inputs(xs, order)
        first = inputs[order[0]]
        for L in order:
            x = inputs[L]
            if x.dim() != 3 or x.shape != first.shape or x.shape[-1] != self.cfg.dim:
                raise ValueError(f"layer {L}: forward takes [b, m, dim={self.cfg.dim}] inputs of "
                                 f"one shape, got {list(x.shape)} and {list(first.shape)} "
                                 "(open a step for packed ones)")
        step = self.step(state, first.shape[1], rows, semantics, layers=order)
        try:
            return self.run(step, inputs)
        except BaseException:
            step.abort()
            raise

    def run(self, step: Step, xs: Inputs, layers: Iterable[int] | None = None
            ) -> dict[int, torch.Tensor]:
        """Run an open step's remaining layers (or ``layers`` of them) in order; xs as in
        ``forward``, [b, m, dim] for a uniform step or packed [sum(tokens), dim]. Every input
        is checked before the first layer writes anything."""
        if not isinstance(step, Step):
            raise TypeError(f"step must be a Step (from stack.step), got {type(step).__name__}")
        step.check_live()
        todo = [L for L in step.layers if L not in step.done]
        if layers is not None:
            want = sorted({_int_arg("layers", L, 0) for L in layers})
            extra = [L for L in want if L not in todo]
            if extra:
                raise StateError(f"layers {extra} are not left to run in this step (its layers "
                                 f"{step.layers}, done {step.done})")
            todo = [L for L in todo if L in want]
        inputs = self._inputs(xs, todo)
        for L in todo:
            self.layers[L].check_input(inputs[L], step)
        return {L: self.layers[L](inputs[L], step.state, step) for L in todo}

    def _inputs(self, xs: Inputs, order: list[int]) -> dict[int, torch.Tensor]:
        if callable(xs):
            get = xs
        elif isinstance(xs, Mapping):
            missing = [L for L in order if L not in xs]
            if missing:
                raise KeyError(f"xs has no input for layers {missing} (it has {sorted(xs)})")
            get = xs.__getitem__
        else:
            raise TypeError(f"xs must map layer ids to inputs (or be a function of the layer), "
                            f"got {type(xs).__name__}")
        out = {}
        for L in order:
            x = get(L)
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"layer {L}: x must be a torch.Tensor, got {type(x).__name__}")
            if x.dtype != torch.bfloat16:
                raise TypeError(f"layer {L}: x must be bfloat16, got {x.dtype}")
            out[L] = x
        return out
