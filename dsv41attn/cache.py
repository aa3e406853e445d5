"""The state the caller owns (SPEC §5), stored packed (SPEC §0.4) and paged.

Every cached value is already on the fp8 / fp4 grid, so it is stored as the quantiser's codes
and scales and unpacked bit for bit (``ops/common/packing.py``). Compressed rows and index keys
live in fixed-size pages of one shared pool: a page covers ``page_size`` token positions of one
sequence, i.e. ``page_size // r`` rows of each KV source of ratio r, and every sequence has a
block table of page ids. Rings keep ``window + rollback`` slots and the open compressor group
keeps the fp32 projections of the last ``r + rollback`` tokens, so a sequence can be truncated
by up to ``rollback`` tokens after speculative decoding.

| buffer | owner | shape | dtype | meaning |
|---|---|---|---|---|
| ``LayerState.window`` | every layer | [B, W + R, D + D/32] | uint8 | post-RoPE K=V rows, fp8 e4m3 + ue8m0 per 32 (528 B); slot = position mod (W + R) |
| ``LayerState.positions`` | every layer | [B] | int64 | tokens this layer has processed per sequence (the next position) |
| ``SourceState.rows`` | KV sources | [P, page_size // r, D/2 + D/16] | uint8 | compressed rows: post-RoPE latents, fp4 e2m1 + e4m3 per 16 (288 B); row g = tokens g*r .. g*r+r-1 |
| ``SourceState.index_keys`` | KV sources | [P, page_size // r, d/2 + d/32] | uint8 | post-RoPE index keys, fp4 e2m1 + ue8m0 per 32 (68 B), aligned with ``rows`` |
| ``SourceState.recent_kv`` / ``recent_score`` | KV sources, r > 1 | [B, r + R, D] | fp32 | wkv / wgate outputs of the latest tokens (the open group); slot = position mod (r + R) |
| ``AttentionState.block_table`` | all sources | [B, ceil(C / page_size)] | int64 | page ids of each sequence, -1 = none |
| ``AttentionState.index_key_slot`` | the stack | | int or None | KV source whose index keys the shared slot holds ("reference" semantics, SPEC §10.1) |

B = sequence slots, W = window_size, R = rollback, D = head_dim, d = index_head_dim, C =
capacity (positions per sequence), P = pages in the pool.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from .config import AttentionConfig
from .ops.common.packing import (paged_rows, unpack_compressed_rows, unpack_index_keys,
                                 unpack_window_rows)


def window_row_bytes(cfg: AttentionConfig) -> int:
    return cfg.head_dim + cfg.head_dim // 32


def compressed_row_bytes(cfg: AttentionConfig) -> int:
    return cfg.head_dim // 2 + cfg.head_dim // 16


def index_key_bytes(cfg: AttentionConfig) -> int:
    return cfg.index_head_dim // 2 + cfg.index_head_dim // 32


class StateError(ValueError):
    """A call that does not fit the state (positions, capacity, sequences, pages, order)."""


@dataclass
class LayerState:
    """One layer's window ring (packed) and per-sequence position cursor."""

    window: torch.Tensor  # [B, W + R, D + D/32] uint8
    positions: torch.Tensor  # [B] int64

    def read_window(self, rows: torch.Tensor) -> torch.Tensor:
        """[b, W + R, D] bf16 ring rows of the sequences ``rows`` (for inspection)."""
        return unpack_window_rows(self.window[rows])


@dataclass
class SourceState:
    """One KV source's paged compressed rows and index keys, and its recent fp32 projections."""

    ratio: int
    page_rows: int
    rows: torch.Tensor  # [P, page_rows, D/2 + D/16] uint8
    index_keys: torch.Tensor  # [P, page_rows, d/2 + d/32] uint8
    recent_kv: torch.Tensor | None  # [B, r + R, D] fp32 (r > 1)
    recent_score: torch.Tensor | None  # [B, r + R, D] fp32 (r > 1)


@dataclass
class AttentionState:
    """All caches of a stack of attention layers for ``batch_size`` sequence slots."""

    config: AttentionConfig
    batch_size: int
    capacity: int
    device: torch.device
    layers: dict[int, LayerState]
    sources: dict[int, SourceState]
    page_size: int
    rollback: int
    block_table: torch.Tensor  # [B, max_pages] int64, -1 = unallocated
    page_refs: list[int]  # per page: sequences holding it (0 = free)
    active: list[bool]  # per slot: holds a sequence
    index_key_slot: int | None = None
    max_tokens_per_call: int = field(default=0)
    epoch: int = 0  # bumped by every host-side change (steps, pages, sequences): plans check it

    @classmethod
    def allocate(cls, cfg: AttentionConfig, batch_size: int, capacity: int | None = None,
                 layers: list[int] | None = None, device: str | torch.device = "cpu",
                 max_tokens_per_call: int | None = None, page_size: int = 256,
                 num_pages: int | None = None, rollback: int = 16) -> "AttentionState":
        """Caches for ``layers`` (default: every layer, draft layers included) and every KV
        source they need. ``capacity``: positions per sequence (default cfg.max_seq_len);
        ``page_size``: token positions per page (a multiple of every ratio); ``num_pages``:
        pool size (default: enough for every slot at full capacity); ``rollback``: how many
        tokens a sequence can be truncated by. Every slot starts active at position 0."""
        capacity = cfg.max_seq_len if capacity is None else int(capacity)
        if batch_size < 1:
            raise StateError(f"batch_size must be >= 1, got {batch_size}")
        if not 1 <= capacity <= cfg.max_seq_len:
            raise StateError(f"capacity must be in 1..max_seq_len={cfg.max_seq_len}, got {capacity}")
        if rollback < 0:
            raise StateError(f"rollback must be >= 0, got {rollback}")
        device = torch.empty(0, device=device).device  # "cuda" -> "cuda:0", as tensors report
        ids = sorted(set(range(len(cfg.layer_specs)) if layers is None else layers))
        for layer in ids:
            cfg.layer(layer)
        needed = sorted({cfg.layer(layer).kv_source for layer in ids} - {None})
        for src in needed:
            if page_size < 1 or page_size % cfg.compress_ratios[src]:
                raise StateError(f"page_size={page_size} must be a positive multiple of every "
                                 f"compress ratio (layer {src} has {cfg.compress_ratios[src]})")
        max_pages = -(-capacity // page_size)
        num_pages = batch_size * max_pages if num_pages is None else int(num_pages)
        d, slots = cfg.head_dim, cfg.window_size + rollback
        layer_states = {
            layer: LayerState(
                window=torch.zeros(batch_size, slots, window_row_bytes(cfg), dtype=torch.uint8,
                                   device=device),
                positions=torch.zeros(batch_size, dtype=torch.int64, device=device))
            for layer in ids
        }
        sources = {}
        for src in needed:
            r = cfg.compress_ratios[src]
            page_rows = page_size // r
            recent = (batch_size, r + rollback, d)
            sources[src] = SourceState(
                ratio=r, page_rows=page_rows,
                rows=torch.zeros(num_pages, page_rows, compressed_row_bytes(cfg),
                                 dtype=torch.uint8, device=device),
                index_keys=torch.zeros(num_pages, page_rows, index_key_bytes(cfg),
                                       dtype=torch.uint8, device=device),
                recent_kv=torch.zeros(recent, device=device) if r > 1 else None,
                recent_score=torch.full(recent, float("-inf"), device=device) if r > 1 else None,
            )
        return cls(cfg, batch_size, capacity, device, layer_states, sources, page_size, rollback,
                   torch.full((batch_size, max_pages), -1, dtype=torch.int64, device=device),
                   [0] * num_pages, [True] * batch_size,
                   max_tokens_per_call=capacity if max_tokens_per_call is None else max_tokens_per_call)

    # ---- reading ---------------------------------------------------------------------------
    def positions(self, layer: int) -> torch.Tensor:
        """[B] int64: tokens layer ``layer`` has processed per sequence."""
        return self.layers[layer].positions

    def read_compressed(self, source: int, rows: torch.Tensor, n: int) -> torch.Tensor:
        """[b, n, D] bf16: compressed rows 0..n-1 of the sequences ``rows``."""
        g = torch.arange(n, device=self.device)
        return unpack_compressed_rows(paged_rows(self.sources[source].rows, self.block_table[rows], g))

    def read_index_keys(self, source: int, rows: torch.Tensor, n: int) -> torch.Tensor:
        """[b, n, d] bf16: index keys 0..n-1 of the sequences ``rows`` (rows never written
        read as zeros, as the reference's zero-initialised cache)."""
        table = self.block_table[rows]
        g = torch.arange(n, device=self.device)
        keys = unpack_index_keys(paged_rows(self.sources[source].index_keys, table, g))
        unallocated = torch.gather(table, 1, (g // self.sources[source].page_rows).expand(len(rows), -1)) < 0
        return keys.masked_fill(unallocated.unsqueeze(-1), 0)

    def write_compressed(self, source: int, rows: torch.Tensor, g: torch.Tensor,
                         packed_rows: torch.Tensor, packed_keys: torch.Tensor) -> None:
        """Store packed compressed rows / index keys [b, n, bytes] at row numbers ``g`` [n]."""
        src = self.sources[source]
        pages = self.block_table[rows][:, g // src.page_rows]
        src.rows[pages, g % src.page_rows] = packed_rows
        src.index_keys[pages, g % src.page_rows] = packed_keys

    # ---- pages and sequences ---------------------------------------------------------------
    @property
    def free_pages(self) -> int:
        return sum(1 for r in self.page_refs if r == 0)

    def pages_needed(self, rows: list[int], ends: list[int]) -> list[int]:
        """Pages each sequence must gain to hold positions < ends[i]."""
        held = (self.block_table >= 0).sum(1).tolist()
        return [max(0, -(-e // self.page_size) - held[r]) for r, e in zip(rows, ends)]

    def reserve(self, rows: list[int], ends: list[int]) -> None:
        """Give each sequence the pages for positions < ends[i]; raises before allocating
        anything if the pool runs out."""
        if not self.sources:
            return
        need = self.pages_needed(rows, ends)
        if sum(need) > self.free_pages:
            raise StateError(f"out of cache pages: this step needs {sum(need)} more pages "
                             f"({self.page_size} positions each), the pool has {self.free_pages} "
                             f"free of {len(self.page_refs)}")
        if sum(need):
            self.epoch += 1
        free = (p for p, r in enumerate(self.page_refs) if r == 0)
        for row, n in zip(rows, need):
            held = int((self.block_table[row] >= 0).sum())
            for k in range(held, held + n):
                page = next(free)
                self.page_refs[page] = 1
                self.block_table[row, k] = page

    def _check_row(self, row: int) -> None:
        if not 0 <= row < self.batch_size:
            raise IndexError(f"sequence slot {row} out of range 0..{self.batch_size - 1}")

    def check_active(self, rows: list[int]) -> None:
        for row in rows:
            self._check_row(row)
            if not self.active[row]:
                raise StateError(f"sequence slot {row} was released; add_sequence() reuses it")

    def position_of(self, row: int) -> int:
        """The sequence's position; every layer of the state must agree."""
        ps = {int(s.positions[row]) for s in self.layers.values()}
        if len(ps) != 1:
            raise StateError(f"sequence slot {row} is mid-step: its layers are at positions "
                             f"{sorted(ps)}")
        return ps.pop()

    def add_sequence(self) -> int:
        """Claim a released slot for a new sequence at position 0; returns its row."""
        for row, on in enumerate(self.active):
            if not on:
                self.epoch += 1
                self.active[row] = True
                return row
        raise StateError(f"all {self.batch_size} sequence slots are in use; release one first")

    def release(self, row: int) -> None:
        """Free a sequence's pages and slot; its row can no longer be used until re-added."""
        self.check_active([row])
        self.position_of(row)
        self.epoch += 1
        self._drop_pages(row, 0)
        for layer in self.layers.values():
            layer.positions[row] = 0
        self.active[row] = False

    def _drop_pages(self, row: int, keep: int) -> None:
        for k in range(keep, self.block_table.shape[1]):
            page = int(self.block_table[row, k])
            if page >= 0:
                self.page_refs[page] -= 1
                self.block_table[row, k] = -1

    def truncate(self, row: int, position: int) -> None:
        """Roll a sequence back to ``position`` (it will continue from there), e.g. after
        rejected draft tokens; at most ``rollback`` tokens back."""
        self.check_active([row])
        now = self.position_of(row)
        if not 0 <= position <= now:
            raise StateError(f"cannot roll sequence {row} back to {position}: it is at {now} "
                             "(the target must be in 0..current position)")
        if now - position > self.rollback:
            raise StateError(f"cannot roll sequence {row} back by {now - position} tokens: the "
                             f"state keeps history for {self.rollback} (allocate rollback=...)")
        keep = -(-position // self.page_size)
        self.epoch += 1
        self._drop_pages(row, keep)
        if keep and position % self.page_size:
            self._own_page(row, keep - 1)
        for layer in self.layers.values():
            layer.positions[row] = position

    def _own_page(self, row: int, k: int) -> None:
        """Copy-on-write: a page shared with a fork becomes this sequence's own before it is
        written again."""
        page = int(self.block_table[row, k])
        if self.page_refs[page] <= 1:
            return
        try:
            new = self.page_refs.index(0)
        except ValueError:
            raise StateError("out of cache pages for a copy-on-write of a shared page")
        for src in self.sources.values():
            src.rows[new] = src.rows[page]
            src.index_keys[new] = src.index_keys[page]
        self.page_refs[page] -= 1
        self.page_refs[new] = 1
        self.block_table[row, k] = new

    def fork(self, row: int, share: bool = True) -> int:
        """A new sequence (returned slot) continuing from ``row``'s state: its ring, open group
        and compressed rows. ``share``: full pages are shared (copy-on-write) rather than
        copied; a partially filled last page is always copied."""
        self.check_active([row])
        position = self.position_of(row)
        held = -(-position // self.page_size)  # pages holding written rows (not reserved ones)
        partial = 1 if position % self.page_size else 0
        copies = held if not share else partial
        if copies > self.free_pages or all(self.active):
            raise StateError(f"cannot fork sequence {row}: needs a free slot and {copies} free "
                             f"pages ({self.free_pages} free)")
        new = self.add_sequence()  # bumps the epoch
        for layer in self.layers.values():
            layer.window[new] = layer.window[row]
            layer.positions[new] = position
        for src in self.sources.values():
            if src.recent_kv is not None:
                src.recent_kv[new] = src.recent_kv[row]
                src.recent_score[new] = src.recent_score[row]
        self.block_table[new, :held] = self.block_table[row, :held]
        for k in range(held):
            self.page_refs[int(self.block_table[row, k])] += 1
        for k in range(held - copies, held):
            self._own_page(new, k)
        return new

    # ---- bookkeeping -----------------------------------------------------------------------
    def clone(self) -> "AttentionState":
        """A deep copy of every cache."""
        return copy.deepcopy(self)

    def kv_bytes_per_token(self) -> dict[str, float]:
        """Cache bytes per token in the packed formats (SPEC §0.4), over this state's layers.

        "compressed": compressed rows + index keys of the KV sources (890 B for V4.1-Flash);
        "window_per_sequence": the rings' W rows, a fixed cost per sequence, not per token.
        """
        cfg = self.config
        per_token = sum((compressed_row_bytes(cfg) + index_key_bytes(cfg)) / s.ratio
                        for s in self.sources.values())
        window = len(self.layers) * cfg.window_size * window_row_bytes(cfg)
        return {"compressed": per_token, "window_per_sequence": float(window)}
