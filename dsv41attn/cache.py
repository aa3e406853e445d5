"""The state the caller owns (SPEC §5), allocated once per batch of sequences.

Every cached value is stored exactly as the reference computes it (bf16 values already on the
fp8 / fp4 grids), with one position cursor per sequence and layer, so a rejected call leaves
everything unchanged and a call can be checked against what each sequence has seen.

| buffer | owner | shape | dtype | meaning |
|---|---|---|---|---|
| ``LayerState.window`` | every layer | [B, W, D] | bf16 | post-RoPE fp8-fake-quantised K=V of the last W positions; slot = position mod W |
| ``LayerState.positions`` | every layer | [B] | int64 | tokens this layer has processed per sequence (the next position) |
| ``SourceState.rows`` | KV sources | [B, C // r, D] | bf16 | compressed rows: post-RoPE fp4 (e2m1, e4m3 per 16) latents; row g = tokens g*r .. g*r+r-1 |
| ``SourceState.index_keys`` | KV sources | [B, C // r, d] | bf16 | post-RoPE fp4 (e2m1, ue8m0 per 32) index keys, aligned with ``rows`` |
| ``SourceState.open_kv`` / ``open_score`` | KV sources, r > 1 | [B, r, D] | fp32 | wkv / wgate outputs of the open group; slot = position mod r |
| ``AttentionState.index_key_slot`` | the stack | | int or None | KV source whose index keys the shared slot holds (matters in "reference" semantics, SPEC §10.1) |

B = batch_size (sequence slots), W = window_size, D = head_dim, d = index_head_dim, C =
capacity (positions per sequence), r = the source's compress ratio.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from .config import AttentionConfig

# Packed sizes per row (SPEC §0.4): fp8 + ue8m0/32, fp4 + e4m3/16, fp4 + ue8m0/32.


def window_row_bytes(cfg: AttentionConfig) -> int:
    return cfg.head_dim + cfg.head_dim // 32


def compressed_row_bytes(cfg: AttentionConfig) -> int:
    return cfg.head_dim // 2 + cfg.head_dim // 16


def index_key_bytes(cfg: AttentionConfig) -> int:
    return cfg.index_head_dim // 2 + cfg.index_head_dim // 32


class StateError(ValueError):
    """A call that does not fit the state (positions, capacity, batch rows, order)."""


@dataclass
class LayerState:
    """One layer's window ring and per-sequence position cursor."""

    window: torch.Tensor  # [B, W, D] bf16
    positions: torch.Tensor  # [B] int64


@dataclass
class SourceState:
    """One KV source's compressed rows, index keys and open compressor group."""

    ratio: int
    rows: torch.Tensor  # [B, C // r, D] bf16
    index_keys: torch.Tensor  # [B, C // r, d] bf16
    open_kv: torch.Tensor | None  # [B, r, D] fp32 (r > 1)
    open_score: torch.Tensor | None  # [B, r, D] fp32 (r > 1), starts at -inf


@dataclass
class AttentionState:
    """All caches of a stack of attention layers for ``batch_size`` sequence slots."""

    config: AttentionConfig
    batch_size: int
    capacity: int
    device: torch.device
    layers: dict[int, LayerState]
    sources: dict[int, SourceState]
    index_key_slot: int | None = None
    max_tokens_per_call: int = field(default=0)

    @classmethod
    def allocate(cls, cfg: AttentionConfig, batch_size: int, capacity: int | None = None,
                 layers: list[int] | None = None, device: str | torch.device = "cpu",
                 max_tokens_per_call: int | None = None) -> "AttentionState":
        """Zero-initialised caches for ``layers`` (default: every layer of the config, draft
        layers included) and every KV source they need. ``capacity``: positions per sequence
        (default cfg.max_seq_len); ``max_tokens_per_call`` bounds m (default capacity)."""
        capacity = cfg.max_seq_len if capacity is None else int(capacity)
        if batch_size < 1:
            raise StateError(f"batch_size must be >= 1, got {batch_size}")
        if not 1 <= capacity <= cfg.max_seq_len:
            raise StateError(f"capacity must be in 1..max_seq_len={cfg.max_seq_len}, got {capacity}")
        device = torch.device(device)
        ids = sorted(set(range(len(cfg.layer_specs)) if layers is None else layers))
        for layer in ids:
            cfg.layer(layer)
        d, w = cfg.head_dim, cfg.window_size
        layer_states = {
            layer: LayerState(
                window=torch.zeros(batch_size, w, d, dtype=torch.bfloat16, device=device),
                positions=torch.zeros(batch_size, dtype=torch.int64, device=device),
            )
            for layer in ids
        }
        needed = {cfg.layer(layer).kv_source for layer in ids} - {None}
        sources = {}
        for src in sorted(needed):
            r = cfg.compress_ratios[src]
            n_rows = capacity // r
            gated = r > 1
            sources[src] = SourceState(
                ratio=r,
                rows=torch.zeros(batch_size, n_rows, d, dtype=torch.bfloat16, device=device),
                index_keys=torch.zeros(batch_size, n_rows, cfg.index_head_dim,
                                       dtype=torch.bfloat16, device=device),
                open_kv=torch.zeros(batch_size, r, d, device=device) if gated else None,
                open_score=torch.full((batch_size, r, d), float("-inf"), device=device)
                if gated else None,
            )
        return cls(cfg, batch_size, capacity, device, layer_states, sources,
                   max_tokens_per_call=capacity if max_tokens_per_call is None else max_tokens_per_call)

    def clone(self) -> "AttentionState":
        """A deep copy of every cache (to fork a sequence batch or a replay)."""
        return copy.deepcopy(self)

    def positions(self, layer: int) -> torch.Tensor:
        """[B] int64: tokens layer ``layer`` has processed per sequence."""
        return self.layers[layer].positions

    def kv_bytes_per_token(self) -> dict[str, float]:
        """Cache bytes per token in the packed formats (SPEC §0.4), over this state's layers.

        "compressed": compressed rows + index keys of the KV sources (890 B for V4.1-Flash);
        "window_per_sequence": the rings, a fixed cost per sequence, not per token.
        """
        cfg = self.config
        per_token = sum((compressed_row_bytes(cfg) + index_key_bytes(cfg)) / s.ratio
                        for s in self.sources.values())
        window = len(self.layers) * cfg.window_size * window_row_bytes(cfg)
        return {"compressed": per_token, "window_per_sequence": float(window)}
