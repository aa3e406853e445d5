"""Layers 0..L-1 in order, and what sources publish for the layers after them (SPEC §1.2).

A ``Step`` is one forward call of the model over some sequences of a state: it fixes the
sequence rows, each one's start position and token count, and the index-key semantics; its
``Group``s (sequences at one position with one token count) carry what this step's sources
publish: the top-k of each index source and the candidate blocks.
Compressed rows and index keys are read from the source's caches in the state; which index
keys the shared slot holds is ``AttentionState.index_key_slot`` (it persists across steps,
which is exactly DeepSeek's stale-key behaviour in "reference" semantics, SPEC §10.1).
"""
from __future__ import annotations

from typing import Callable, Iterable, Mapping, Sequence

import torch

from .cache import AttentionState, StateError
from .checkpoint import LayerWeights
from .config import SEMANTICS, AttentionConfig, LayerSpec
from .decode import DecodePlan
from .layer import AttentionLayer


class Group:
    """Sequences of one step at the same start position with the same number of new tokens:
    the unit a layer computes batched. Holds what this step's sources publish for them."""

    def __init__(self, state: AttentionState, rows: torch.Tensor, start_pos: int | None, tokens: int,
                 token_index: torch.Tensor, semantics: str, starts: list[int] | None = None):
        self.state = state
        self.rows = rows  # [g] int64 state rows
        # start_pos None: the sequences are at their own positions, ``starts`` (a decode group
        # of a step) or on the device (a DecodePlan)
        self.start_pos, self.tokens, self.starts = start_pos, tokens, starts
        self.token_index = token_index  # [g * tokens] int64 rows of the packed x, sequence-major
        self.semantics = semantics
        self._topk: dict[int, torch.Tensor] = {}
        self._candidates: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None
        self.scan: dict[int, int] | None = None  # ratio -> rows an indexer scans (DecodePlan)

    def scan_rows(self, ratio: int) -> int:
        """Compressed rows per sequence an index source of ``ratio`` scores: those complete
        after this step's tokens, or the plan's fixed bound (rows beyond a query's visible
        ones are masked, so scanning more selects the same rows)."""
        if self.scan is not None:
            return self.scan[ratio]
        last = self.start_pos if self.start_pos is not None else max(self.starts)
        return (last + self.tokens) // ratio

    def positions(self) -> torch.Tensor:
        """[g] int64 on the device: each sequence's position before this step (built once
        per step, not once per layer)."""
        if self._positions is None:
            starts = self.starts if self.start_pos is None else [self.start_pos] * self.rows.numel()
            self._positions = torch.tensor(starts, dtype=torch.int64).to(self.rows.device)
        return self._positions

    def completes_group(self, ratio: int) -> bool:
        """Whether this step's tokens complete at least one compressor group (a DecodePlan's
        positions are on the device: it runs "fixed" semantics, where this is not asked)."""
        if self.start_pos is None:
            raise StateError("this group's sequences are at different positions; only 'fixed' "
                             "semantics runs them together")
        return (self.start_pos % ratio + self.tokens) // ratio > 0

    def publish_index_keys(self, layer: int, produced: bool) -> None:
        """A KV source publishes its index keys: always in "fixed" semantics, only when it
        produced a latent in "reference" semantics (DeepSeek's code)."""
        if produced or self.semantics == "fixed":
            self.state.index_key_slot = layer

    def index_key_layer(self, spec: LayerSpec) -> int:
        """The KV source whose index keys an index source scores against."""
        slot = self.state.index_key_slot
        if slot is None:
            raise StateError(f"layer {spec.layer}: no KV source has published index keys")
        return slot

    def publish_topk(self, layer: int, selected: torch.Tensor) -> None:
        self._topk[layer] = selected

    def topk(self, index_source: int) -> torch.Tensor:
        """[g, m, k] int32 compressed-row numbers (-1 pad) that ``index_source`` selected."""
        return self._topk[index_source]

    def publish_candidates(self, candidates: torch.Tensor) -> None:
        self._candidates = candidates

    def candidates(self, n_total: int) -> torch.Tensor:
        """[g, m, ceil(n_total / block)] bool: the blocks the candidate source kept."""
        c = self._candidates
        if c is None or c.shape[-1] != -(-n_total // self.state.config.candidate_block_size):
            raise StateError("no candidate mask of matching width was published in this step")
        return c


class Step:
    """One forward step: ``tokens[i]`` new tokens for the sequence in state row ``rows[i]``,
    starting at that sequence's position (0 tokens: idle). Inputs are packed sequence-major as
    [sum(tokens), dim] with offsets ``cu_seqlens`` (flash-attn style), or [b, m, dim] when
    every sequence is at the same position with the same m.

    Sequences sharing (start position, tokens) form one ``Group`` computed batched; in "fixed"
    semantics every decoding sequence (one token) joins one group whatever its position. Layers
    run in increasing order, each once, after the sources they read.
    """

    def __init__(self, cfg: AttentionConfig, state: AttentionState, rows: torch.Tensor,
                 starts: list[int], tokens: list[int], semantics: str):
        self.cfg, self.state, self.semantics = cfg, state, semantics
        self.rows, self.starts, self.tokens = rows, starts, tokens
        self.cu_seqlens = [0]
        for t in tokens:
            self.cu_seqlens.append(self.cu_seqlens[-1] + t)
        keyed: dict[tuple[int | None, int], list[int]] = {}
        decode = [i for i, t in enumerate(tokens) if t == 1]
        one_decode_group = semantics == "fixed" and len({starts[i] for i in decode}) > 1
        for i, (p, t) in enumerate(zip(starts, tokens)):
            if t > 0:
                keyed.setdefault((None if t == 1 and one_decode_group else p, t), []).append(i)
        dev = state.device
        self.groups = [
            Group(state, rows[members], p, t,
                  torch.cat([torch.arange(self.cu_seqlens[i], self.cu_seqlens[i + 1])
                             for i in members]).to(dev), semantics,
                  None if p is not None else [starts[i] for i in members])
            for (p, t), members in keyed.items()
        ]
        self._members = list(keyed.values())
        self._done: list[int] = []

    @property
    def total_tokens(self) -> int:
        return self.cu_seqlens[-1]

    @property
    def uniform(self) -> bool:
        """One group holding every sequence in order, at one position: x may be [b, m, dim]."""
        return len(self.groups) == 1 and len(self._members[0]) == len(self.tokens) \
            and self.groups[0].start_pos is not None

    @property
    def start_pos(self) -> int:
        if len(set(self.starts)) != 1:
            raise StateError(f"sequences are at different positions {self.starts}")
        return self.starts[0]

    def check_can_run(self, spec: LayerSpec) -> None:
        layer = spec.layer
        if spec.is_draft:
            if layer in self._done:
                raise StateError(f"draft layer {layer} already ran in this step")
            return
        last = max((d for d in self._done if d < self.cfg.n_layers), default=-1)
        if layer <= last:
            raise StateError(f"layer {layer} called after layer {last} in the same step: "
                             "layers run in increasing order, each once per step")
        needs = {spec.kv_source, spec.index_source}
        if spec.is_candidate_consumer:
            needs.add(self.cfg.candidate_source_layer)
        for src in sorted(needs - {None, layer}):
            if src not in self._done:
                raise StateError(f"layer {layer} ({spec.role.value}) reads what layer {src} "
                                 f"publishes, but layer {src} has not run in this step")

    def mark_done(self, layer: int) -> None:
        self._done.append(layer)

    @property
    def done(self) -> list[int]:
        return list(self._done)

    def topk(self, index_source: int) -> torch.Tensor:
        """[sum(tokens), kmax] int32: the compressed rows each token's query selected in
        ``index_source``, packed like x; each sequence's width is min(index_topk, its
        compressed rows), padded with -1 to the widest in the step."""
        parts = [g.topk(index_source) for g in self.groups]
        width = max((t.shape[-1] for t in parts), default=0)
        out = torch.full((self.total_tokens, width), -1, dtype=torch.int32, device=self.state.device)
        for g, t in zip(self.groups, parts):
            out[g.token_index, : t.shape[-1]] = t.flatten(0, 1)
        return out


class AttentionStack:
    """The attention layers of one model (any subset of its layers), run in layer order."""

    def __init__(self, cfg: AttentionConfig, weights: Mapping[int, LayerWeights],
                 backend: str = "reference"):
        self.cfg = cfg
        self.backend = backend
        self.layers = {layer: AttentionLayer(cfg, weights[layer], backend)
                       for layer in sorted(weights)}

    def new_state(self, batch_size: int, capacity: int | None = None,
                  device: str | torch.device | None = None, **kw) -> AttentionState:
        """Caches for this stack's layers (and the KV sources they read)."""
        if device is None:
            device = next(iter(self.layers.values())).device
        return AttentionState.allocate(self.cfg, batch_size, capacity, layers=list(self.layers),
                                       device=device, **kw)

    def plan_decode(self, state: AttentionState, rows: Sequence[int] | torch.Tensor | None = None,
                    steps: int = 1, layers: Iterable[int] | None = None) -> DecodePlan:
        """Plan ``steps`` decode steps (one token per sequence) of ``rows`` (default: all)
        through ``layers`` (default: this stack's layers in the state); see ``DecodePlan``."""
        return DecodePlan(self, state, rows, steps, None if layers is None else list(layers))

    def step(self, state: AttentionState, tokens: int | Sequence[int],
             rows: Sequence[int] | torch.Tensor | None = None,
             semantics: str | None = None, layers: Iterable[int] | None = None) -> Step:
        """Open a forward step: ``tokens`` new tokens (one int for all, or one per sequence,
        0 = idle) for the sequences in state rows ``rows`` (default: all), each continuing
        from its own position in ``layers`` (default: this stack's layers in the state)."""
        semantics = semantics or self.cfg.index_semantics
        if semantics not in SEMANTICS:
            raise ValueError(f"semantics must be one of {SEMANTICS}, got {semantics!r}")
        if rows is None:
            rows = torch.arange(state.batch_size, device=state.device)
        rows = torch.as_tensor(rows, dtype=torch.int64, device=state.device).reshape(-1)
        if rows.numel() == 0:
            raise ValueError("rows must name at least one sequence")
        if bool(((rows < 0) | (rows >= state.batch_size)).any()):
            raise IndexError(f"rows {rows.tolist()} out of range 0..{state.batch_size - 1}")
        if rows.unique().numel() != rows.numel():
            raise ValueError(f"rows {rows.tolist()} repeat a sequence")
        counts = [int(tokens)] * rows.numel() if isinstance(tokens, int) else [int(t) for t in tokens]
        if len(counts) != rows.numel():
            raise ValueError(f"{len(counts)} token counts for {rows.numel()} sequences")
        if any(t < 0 for t in counts) or not any(counts):
            raise ValueError(f"token counts {counts}: each must be >= 0 and one at least >= 1")
        state.check_active(rows.tolist())
        run = [L for L in (self.layers if layers is None else layers) if L in state.layers]
        if not run:
            raise StateError(f"none of the layers {sorted(self.layers if layers is None else layers)} "
                             f"has caches in this state (allocated for {sorted(state.layers)})")
        starts = state.layers[min(run)].positions[rows].tolist()
        for row, p, m in zip(rows.tolist(), starts, counts):
            if m > state.max_tokens_per_call:
                raise ValueError(f"sequence {row}: m={m} tokens outside "
                                 f"0..{state.max_tokens_per_call}")
            if p + m > state.capacity:
                raise StateError(f"sequence {row}: positions {p}..{p + m - 1} exceed the cache "
                                 f"capacity of {state.capacity} positions")
        step = Step(self.cfg, state, rows, starts, counts, semantics)
        if semantics == "reference" and len(step.groups) > 1:
            raise ValueError("reference semantics reproduces DeepSeek's schedule only: every "
                             "sequence at the same position with the same token count")
        state.reserve(rows.tolist(), [p + m for p, m in zip(starts, counts)])
        return step

    def forward(self, xs: Mapping[int, torch.Tensor] | Callable[[int], torch.Tensor],
                state: AttentionState, rows=None, semantics: str | None = None,
                layers: Iterable[int] | None = None) -> dict[int, torch.Tensor]:
        """Run one step through ``layers`` (default: every layer of the stack) in order.

        xs: layer -> [b, m, dim] bf16 input (or a function of the layer id). Returns
        layer -> [b, m, dim] bf16 output.
        """
        order = sorted(self.layers if layers is None else layers)
        get = xs if callable(xs) else xs.__getitem__
        first = get(order[0])
        for L in order:  # checked before the step opens (and reserves pages)
            x = get(L)
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"layer {L}: x must be a torch.Tensor, got {type(x).__name__}")
            if x.dtype != torch.bfloat16:
                raise TypeError(f"layer {L}: x must be bfloat16, got {x.dtype}")
            if x.dim() != 3 or x.shape != first.shape or x.shape[-1] != self.cfg.dim:
                raise ValueError(f"layer {L}: forward takes [b, m, dim={self.cfg.dim}] inputs of "
                                 f"one shape, got {list(x.shape)} and {list(first.shape)} "
                                 "(open a step for packed ones)")
        step = self.step(state, first.shape[1], rows, semantics, layers=order)
        return self.run(step, xs, layers=order)

    def run(self, step: Step, xs: Mapping[int, torch.Tensor] | Callable[[int], torch.Tensor],
            layers: Iterable[int] | None = None) -> dict[int, torch.Tensor]:
        """Run an opened step through ``layers`` (default: all) in order; xs as in forward,
        [b, m, dim] for a uniform step or packed [sum(tokens), dim]."""
        order = sorted(self.layers if layers is None else layers)
        get = xs if callable(xs) else xs.__getitem__
        missing = [L for L in order if L not in self.layers]
        if missing:
            raise KeyError(f"layers {missing} are not in this stack ({sorted(self.layers)})")
        inputs = {L: get(L) for L in order}
        for L in order:  # every input checked before the first layer writes anything
            self.layers[L].check_input(inputs[L], step)
        return {layer: self.layers[layer](inputs[layer], step.state, step) for layer in order}
