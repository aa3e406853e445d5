"""Layers 0..L-1 in order, and what sources publish for the layers after them (SPEC §1.2).

A ``Step`` is one forward call of the model over some sequences of a state: it fixes the
sequence rows, their start position and token count, the index-key semantics, and carries
what this step's sources publish: the top-k of each index source and the candidate blocks.
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
from .layer import AttentionLayer


class Step:
    """One forward step over ``rows`` of a state: ``tokens`` new tokens per sequence."""

    def __init__(self, cfg: AttentionConfig, state: AttentionState, rows: torch.Tensor,
                 start_pos: int, tokens: int, semantics: str):
        self.cfg, self.state = cfg, state
        self.rows, self.start_pos, self.tokens = rows, start_pos, tokens
        self.semantics = semantics
        self._topk: dict[int, torch.Tensor] = {}
        self._candidates: torch.Tensor | None = None
        self._done: list[int] = []

    # ---- ordering ---------------------------------------------------------------------
    def check_can_run(self, spec: LayerSpec) -> None:
        """Backbone layers run in increasing order, each once, after the sources they read."""
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

    # ---- publication ------------------------------------------------------------------
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
        """[b, m, k] int32 compressed-row numbers (-1 pad) that ``index_source`` selected."""
        return self._topk[index_source]

    def publish_candidates(self, candidates: torch.Tensor) -> None:
        self._candidates = candidates

    def candidates(self, n_total: int) -> torch.Tensor:
        """[b, m, n_total] bool candidate mask of the candidate source."""
        c = self._candidates
        if c is None or c.shape[-1] != n_total:
            raise StateError("no candidate mask of matching width was published in this step")
        return c

    @property
    def done(self) -> list[int]:
        return list(self._done)


class AttentionStack:
    """The attention layers of one model (any subset of its layers), run in layer order."""

    def __init__(self, cfg: AttentionConfig, weights: Mapping[int, LayerWeights]):
        self.cfg = cfg
        self.layers = {layer: AttentionLayer(cfg, weights[layer]) for layer in sorted(weights)}

    def new_state(self, batch_size: int, capacity: int | None = None,
                  device: str | torch.device | None = None, **kw) -> AttentionState:
        """Caches for this stack's layers (and the KV sources they read)."""
        if device is None:
            device = next(iter(self.layers.values())).device
        return AttentionState.allocate(self.cfg, batch_size, capacity, layers=list(self.layers),
                                       device=device, **kw)

    def step(self, state: AttentionState, tokens: int, rows: Sequence[int] | torch.Tensor | None = None,
             semantics: str | None = None) -> Step:
        """Open a forward step of ``tokens`` tokens for the sequences ``rows`` (default: all
        rows of the state), which must all be at the same position."""
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
        first = min(state.layers)
        start = state.layers[first].positions[rows]
        if bool((start != start[0]).any()):
            raise StateError(f"sequences {rows.tolist()} are at different positions "
                             f"{start.tolist()}; one step needs equal positions")
        return Step(self.cfg, state, rows, int(start[0]), int(tokens), semantics)

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
        step = self.step(state, first.shape[1], rows, semantics)
        return {layer: self.layers[layer](get(layer), state, step) for layer in order}
