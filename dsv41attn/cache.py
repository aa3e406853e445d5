"""The state the caller owns, stored packed (docs/numerics.md §3) and paged.

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
| ``AttentionState.index_key_slot`` | the stack | | int or None | KV source whose index keys the shared slot holds ("reference" semantics, docs/numerics.md §7) |

B = sequence slots, W = window_size, R = rollback, D = head_dim, d = index_head_dim, C =
capacity (positions per sequence), P = pages in the pool.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from .config import AttentionConfig
from .ops.common.packing import (compressed_row_bytes, index_key_bytes, paged_index_keys,
                                 paged_rows, unpack_compressed_rows, unpack_window_rows,
                                 window_row_bytes)
from .ops.compressor.reference import recent_group


class StateError(ValueError):
    """A call that does not fit the state (positions, capacity, sequences, pages, order)."""


def _int_arg(name: str, value, minimum: int | None = None, error=ValueError) -> int:
    """``value`` as an int (Python or numpy/torch integer; not bool, float or str), or an
    error naming the argument and the value."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    value = int(value.__index__())
    if minimum is not None and value < minimum:
        raise error(f"{name} must be >= {minimum}, got {value}")
    return value


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
    """All caches of a stack of attention layers for ``batch_size`` sequence slots.

    Host-side, per slot: ``position`` (committed tokens), ``written_end`` (one past the highest
    position the rings have held since the slot started: what a rollback can restore),
    ``generation`` (bumped by every change of the slot: steps and plans made before a change
    refuse to run after it) and ``open_step`` (the step holding the slot until it finishes)."""

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
    position: dict[int, list[int]] = field(default_factory=dict)  # layer -> per slot
    written_end: list[int] = field(default_factory=list)
    generation: list[int] = field(default_factory=list)
    open_step: list = field(default_factory=list)

    def __post_init__(self):
        b = self.batch_size
        self.position = self.position or {layer: [0] * b for layer in self.layers}
        self.written_end = self.written_end or [0] * b
        self.generation = self.generation or [0] * b
        self.open_step = self.open_step or [None] * b

    @classmethod
    def allocate(cls, cfg: AttentionConfig, batch_size: int, capacity: int | None = None,
                 layers: list[int] | None = None, device: str | torch.device = "cpu",
                 max_tokens_per_call: int | None = None, page_size: int = 256,
                 num_pages: int | None = None, rollback: int = 16) -> "AttentionState":
        """Caches for ``layers`` (default: every layer, draft layers included) and every KV
        source they need. ``capacity``: positions per sequence (default cfg.max_seq_len);
        ``page_size``: token positions per page (a multiple of every ratio); ``num_pages``:
        pool size (default: enough for every slot at full capacity); ``rollback``: how many
        tokens a sequence can be truncated by; ``max_tokens_per_call``: the most new tokens
        of one sequence in one step (default capacity). Every slot starts active at 0."""
        if not isinstance(cfg, AttentionConfig):
            raise TypeError(f"cfg must be an AttentionConfig, got {type(cfg).__name__}")
        batch_size = _int_arg("batch_size", batch_size, 1, StateError)
        capacity = cfg.max_seq_len if capacity is None else _int_arg("capacity", capacity)
        if not 1 <= capacity <= cfg.max_seq_len:
            raise StateError(f"capacity must be in 1..max_seq_len={cfg.max_seq_len}, got {capacity}")
        rollback = _int_arg("rollback", rollback, 0, StateError)
        max_tokens_per_call = capacity if max_tokens_per_call is None else \
            _int_arg("max_tokens_per_call", max_tokens_per_call, 1, StateError)
        device = torch.empty(0, device=device).device  # "cuda" -> "cuda:0", as tensors report
        ids = sorted(set(range(len(cfg.layer_specs)) if layers is None else
                         (_int_arg("layers", layer, 0) for layer in layers)))
        for layer in ids:
            cfg.layer(layer)
        needed = sorted({cfg.layer(layer).kv_source for layer in ids} - {None})
        page_size = _int_arg("page_size", page_size, 1, StateError)
        for src in needed:
            if page_size % cfg.compress_ratios[src]:
                raise StateError(f"page_size={page_size} must be a positive multiple of every "
                                 f"compress ratio (layer {src} has {cfg.compress_ratios[src]})")
        max_pages = -(-capacity // page_size)
        num_pages = batch_size * max_pages if num_pages is None else \
            _int_arg("num_pages", num_pages, 0, StateError)
        d, slots = cfg.head_dim, cfg.window_size + rollback
        layer_states = {
            layer: LayerState(
                window=torch.zeros(batch_size, slots, window_row_bytes(cfg.head_dim), dtype=torch.uint8,
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
                rows=torch.zeros(num_pages, page_rows, compressed_row_bytes(cfg.head_dim),
                                 dtype=torch.uint8, device=device),
                index_keys=torch.zeros(num_pages, page_rows, index_key_bytes(cfg.index_head_dim),
                                       dtype=torch.uint8, device=device),
                recent_kv=torch.zeros(recent, device=device) if r > 1 else None,
                recent_score=torch.full(recent, float("-inf"), device=device) if r > 1 else None,
            )
        return cls(cfg, batch_size, capacity, device, layer_states, sources, page_size, rollback,
                   torch.full((batch_size, max_pages), -1, dtype=torch.int64, device=device),
                   [0] * num_pages, [True] * batch_size,
                   max_tokens_per_call=max_tokens_per_call)

    # ---- geometry ----------------------------------------------------------------------------
    @property
    def ring_slots(self) -> int:
        """Slots of every window ring: window + rollback."""
        return self.config.window_size + self.rollback

    def recent_slots(self, ratio: int) -> int:
        """Slots of a ratio-r source's recent-projection ring: r + rollback."""
        return ratio + self.rollback

    # ---- reading ---------------------------------------------------------------------------
    def positions(self, layer: int) -> torch.Tensor:
        """[B] int64 on the device: tokens layer ``layer`` has processed per sequence."""
        return self.layers[layer].positions

    def read_compressed(self, source: int, rows: torch.Tensor, n: int) -> torch.Tensor:
        """[b, n, D] bf16: compressed rows 0..n-1 of the sequences ``rows``."""
        g = torch.arange(n, device=self.device)
        return unpack_compressed_rows(paged_rows(self.sources[source].rows, self.block_table[rows], g))

    def read_index_keys(self, source: int, rows: torch.Tensor, n: int) -> torch.Tensor:
        """[b, n, d] bf16: index keys 0..n-1 of the sequences ``rows`` (rows never written
        read as zeros, as the reference's zero-initialised cache)."""
        return paged_index_keys(self.sources[source].index_keys, self.block_table[rows], n)

    # ---- writes of a step (each saves what it overwrites in the step's undo log) -------------
    def write_window(self, layer: int, plan, new_rows: torch.Tensor, undo) -> None:
        """The step's packed window rows [T, D + D/32] into layer ``layer``'s ring (the rows
        that survive the step: ``plan.ring_write``), and the layer's positions advanced."""
        state, ring = self._save_window_write(layer, plan, undo)
        tokens, flat = plan.ring_write
        ring[flat] = new_rows[tokens]
        state.positions[plan.seq_rows] = plan.seq_end

    def decode_window_write(self, layer: int, plan, undo) -> dict:
        """A decode plan's ring write, for the window K/V op to do as it packs the rows
        (norm_rope_pack's ring arguments): saves the slots and positions it overwrites, then
        returns the arguments. One token per sequence: its slot (position P mod S) holds
        position P - S, which no query of the step reads (S = window + rollback >= window), so
        the write may come before the attention; every token writes (``plan.ring_write``)."""
        state, _ = self._save_window_write(layer, plan, undo)
        return {"ring": state.window, "ring_row": None, "ring_slot": plan.ring_write[1],
                "positions": state.positions, "position": plan.seq_end}

    def _save_window_write(self, layer: int, plan, undo):
        """Save the ring slots and positions a step's window write overwrites; (the layer's
        state, its ring viewed [B * S, bytes])."""
        state = self.layers[layer]
        ring = state.window.view(-1, state.window.shape[-1])
        undo.save(ring, plan.ring_write[1])
        undo.save(state.positions, plan.seq_rows)
        return state, ring

    recent_group = staticmethod(recent_group)  # the compressor op's (ops/compressor/reference)

    def save_recent_write(self, source: SourceState, writes, undo) -> torch.Tensor:
        """Save the recent-ring slots a step's projections overwrite (``writes`` = (tokens,
        flat slots)) and return the flat slots: for ``recent_gather_write`` to write in a
        decode plan (every token writes), or for ``write_recent``."""
        _, flat = writes
        for recent in (source.recent_kv, source.recent_score):
            undo.save(recent.view(-1, recent.shape[-1]), flat)
        return flat

    def write_recent(self, source: SourceState, writes, new_kv: torch.Tensor,
                     new_score: torch.Tensor, undo) -> None:
        """This step's fp32 projections [T, D] into the source's recent ring (those that
        survive the step: ``writes`` = (tokens, flat slots))."""
        flat = self.save_recent_write(source, writes, undo)
        tokens = writes[0]
        for recent, new in ((source.recent_kv, new_kv), (source.recent_score, new_score)):
            recent.view(-1, recent.shape[-1])[flat] = new[tokens]

    def before_compressed_write(self, source: SourceState, page: torch.Tensor,
                                slot: torch.Tensor, undo) -> None:
        """Save the compressed rows and index keys at (page, slot) [N] that a compressor
        epilogue is about to write (page -1: nothing is written there)."""
        if undo.enabled:  # (a graph's log is off: no clamp launch there)
            where = (page.clamp_min(0), slot)
            undo.save(source.rows, where)
            undo.save(source.index_keys, where)

    def set_index_key_slot(self, layer: int, undo) -> None:
        """KV source ``layer`` takes the shared index-key slot (docs/numerics.md §7)."""
        old = self.index_key_slot
        undo.on_undo(lambda: setattr(self, "index_key_slot", old))
        self.index_key_slot = layer

    def index_key_source(self, layer: int) -> int:
        """The KV source whose index keys index source ``layer`` scores against."""
        if self.index_key_slot is None:
            raise StateError(f"layer {layer}: no KV source has published index keys")
        return self.index_key_slot

    # ---- checks ------------------------------------------------------------------------------
    def check_config(self, cfg: AttentionConfig) -> None:
        """Raise unless this state was allocated for ``cfg``."""
        if self.config is not cfg and self.config != cfg:
            raise StateError("the state was allocated for a different AttentionConfig than this "
                             "stack's (allocate it with stack.new_state)")

    def check_row(self, row) -> int:
        """``row`` as a slot number, or a clear error."""
        row = _int_arg("row", row, 0)
        if row >= self.batch_size:
            raise IndexError(f"sequence slot {row} out of range 0..{self.batch_size - 1}")
        return row

    def check_active(self, rows: list[int]) -> None:
        for row in rows:
            self.check_row(row)
            if not self.active[row]:
                raise StateError(f"sequence slot {row} was released; add_sequence() reuses it")

    def check_not_mid_step(self, rows: list[int], action: str) -> None:
        """Raise if a step that has started running holds one of ``rows``."""
        for row in rows:
            step = self.open_step[row]
            if step is not None and step.started:
                raise StateError(f"cannot {action}: sequence {row} is mid-step (layers "
                                 f"{step.done} of {step.layers} ran): run the remaining layers "
                                 "or step.abort()")

    def _drop_unstarted_steps(self, rows: list[int]) -> None:
        """A step opened on ``rows`` that has not run any layer is aborted (its pages return)."""
        for row in rows:
            step = self.open_step[row]
            if step is not None:
                step.abort()

    def position_of(self, row: int, layers=None) -> int:
        """The sequence's position in ``layers`` (default: all of the state's), from the host
        mirror (no device read); they must agree: a step over some layers only leaves the
        others behind until a step runs them."""
        row = self.check_row(row)
        ps = {self.position[L][row] for L in (self.layers if layers is None else layers)}
        if len(ps) != 1:
            where = {L: self.position[L][row] for L in (self.layers if layers is None else layers)}
            raise StateError(f"sequence slot {row} is mid-step: its layers are at different "
                             f"positions {where} (run the layers that are behind)")
        return ps.pop()

    def advance(self, row: int, layers, end: int) -> None:
        """Host mirror: ``layers`` of sequence ``row`` are now at ``end``."""
        for L in layers:
            self.position[L][row] = end
        self.written_end[row] = max(self.written_end[row], end)

    # ---- pages and sequences ---------------------------------------------------------------
    @property
    def free_pages(self) -> int:
        return sum(1 for r in self.page_refs if r == 0)

    def pages_needed(self, rows: list[int], ends: list[int]) -> list[int]:
        """Pages each sequence must gain to hold positions < ends[i]."""
        if not self.sources:
            return [0] * len(rows)
        held = (self.block_table >= 0).sum(1).tolist()
        return [max(0, -(-e // self.page_size) - held[r]) for r, e in zip(rows, ends)]

    def reserve(self, rows: list[int], ends: list[int]) -> list[tuple[int, int, int]]:
        """Give each sequence the pages for positions < ends[i]; raises before allocating
        anything if the pool runs out. Returns the (row, block-table column, page) taken."""
        need = self.pages_needed(rows, ends)
        if sum(need) > self.free_pages:
            raise StateError(f"out of cache pages: this step needs {sum(need)} more pages "
                             f"({self.page_size} positions each), the pool has {self.free_pages} "
                             f"free of {len(self.page_refs)}")
        taken = []
        free = (p for p, r in enumerate(self.page_refs) if r == 0)
        held = (self.block_table >= 0).sum(1).tolist()
        for row, n in zip(rows, need):
            for k in range(held[row], held[row] + n):
                page = next(free)
                self.page_refs[page] = 1
                self.block_table[row, k] = page
                taken.append((row, k, page))
        return taken

    def unreserve(self, taken: list[tuple[int, int, int]]) -> None:
        """Give back pages ``reserve`` took (a step undone)."""
        for row, k, page in reversed(taken):
            if int(self.block_table[row, k]) == page:
                self.block_table[row, k] = -1
                self.page_refs[page] -= 1

    def add_sequence(self) -> int:
        """Claim a released slot for a new sequence at position 0; returns its row."""
        for row, on in enumerate(self.active):
            if not on:
                self._reset_slot(row)
                self.active[row] = True
                return row
        raise StateError(f"all {self.batch_size} sequence slots are in use; release one first")

    def _reset_slot(self, row: int) -> None:
        self.generation[row] += 1
        self.written_end[row] = 0
        for L in self.layers:
            self.position[L][row] = 0
        for layer in self.layers.values():
            layer.positions[row] = 0

    def release(self, row: int) -> None:
        """Free a sequence's pages and slot (aborting a step that holds it, if any); its row
        can no longer be used until re-added. Always possible for an active slot."""
        self.check_active([row])
        if self.open_step[row] is not None:
            self.open_step[row].abort()
        self._drop_pages(row, 0)
        self._reset_slot(row)
        self.active[row] = False

    def _drop_pages(self, row: int, keep: int) -> None:
        for k in range(keep, self.block_table.shape[1]):
            page = int(self.block_table[row, k])
            if page >= 0:
                self.page_refs[page] -= 1
                self.block_table[row, k] = -1

    def truncate(self, row: int, position: int) -> None:
        """Roll a sequence back to ``position`` (it will continue from there), e.g. after
        rejected draft tokens: at most ``rollback`` tokens behind the furthest position its
        rings have held (two rollbacks in a row count together). A step opened on the
        sequence and not yet run is aborted. Rolling back to inside a page shared with a fork
        gives the sequence its own copy of that page, taken from the pages the rollback
        frees or the free pool; with none to take, it is refused and nothing changes."""
        row = self.check_row(row)
        self.check_active([row])
        position = _int_arg("position", position)
        self.check_not_mid_step([row], f"truncate sequence {row}")
        now = self.position_of(row)
        if not 0 <= position <= now:
            raise StateError(f"cannot roll sequence {row} back to {position}: it is at {now} "
                             "(the target must be in 0..current position)")
        if self.written_end[row] - position > self.rollback:
            raise StateError(
                f"cannot roll sequence {row} back to {position}: its rings have held positions "
                f"up to {self.written_end[row] - 1}, and they keep history for "
                f"rollback={self.rollback} tokens behind that (allocate rollback=...)")
        keep = -(-position // self.page_size)
        cow = keep and position % self.page_size and \
            self.page_refs[int(self.block_table[row, keep - 1])] > 1
        # the pages past ``keep`` that only this sequence holds are free again once dropped,
        # before the copy takes one
        freed = sum(1 for page in self.block_table[row, keep:].tolist()
                    if page >= 0 and self.page_refs[page] == 1)
        if cow and self.free_pages + freed < 1:
            raise StateError(
                f"cannot roll sequence {row} back to {position}: out of cache pages for the "
                f"copy-on-write of its page {int(self.block_table[row, keep - 1])} (shared "
                f"with a fork, and written again from position {position}); the pool has no "
                "free page: release a sequence or allocate more pages")
        self._drop_unstarted_steps([row])
        self.generation[row] += 1
        self._drop_pages(row, keep)
        if cow:
            self._own_page(row, keep - 1)
        for L in self.layers:
            self.position[L][row] = position
        for layer in self.layers.values():
            layer.positions[row] = position

    def _own_page(self, row: int, k: int) -> None:
        """Copy-on-write: a page shared with a fork becomes this sequence's own before it is
        written again (the caller checked a page is free)."""
        page = int(self.block_table[row, k])
        if self.page_refs[page] <= 1:
            return
        new = self.page_refs.index(0)
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
        row = self.check_row(row)
        self.check_active([row])
        if not isinstance(share, bool):
            raise TypeError(f"share must be a bool, got {share!r}")
        self.check_not_mid_step([row], f"fork sequence {row}")
        position = self.position_of(row)
        held = -(-position // self.page_size) if self.sources else 0  # pages with written rows
        partial = 1 if held and position % self.page_size else 0
        copies = held if not share else partial
        if copies > self.free_pages or all(self.active):
            raise StateError(f"cannot fork sequence {row}: needs a free slot and {copies} free "
                             f"pages ({self.free_pages} free)")
        new = self.add_sequence()
        for layer in self.layers.values():
            layer.window[new] = layer.window[row]
            layer.positions[new] = position
        for src in self.sources.values():
            if src.recent_kv is not None:
                src.recent_kv[new] = src.recent_kv[row]
                src.recent_score[new] = src.recent_score[row]
        self.advance(new, self.layers, position)
        self.written_end[new] = self.written_end[row]
        self.block_table[new, :held] = self.block_table[row, :held]
        for k in range(held):
            self.page_refs[int(self.block_table[row, k])] += 1
        for k in range(held - copies, held):
            self._own_page(new, k)
        return new

    # ---- bookkeeping -----------------------------------------------------------------------
    def clone(self) -> "AttentionState":
        """A deep copy of every cache (no step may be open)."""
        busy = [row for row, step in enumerate(self.open_step) if step is not None]
        if busy:
            raise StateError(f"cannot clone the state while a step is open on sequences {busy}")
        return copy.deepcopy(self)

    def kv_bytes_per_token(self) -> dict[str, float]:
        """Cache bytes per token in the packed formats (docs/numerics.md §3), over this state's
        layers.

        "compressed": compressed rows + index keys of the KV sources (890 B for V4.1-Flash);
        "window_per_sequence": the rings' W rows, a fixed cost per sequence, not per token.
        """
        cfg = self.config
        per_token = sum((compressed_row_bytes(cfg.head_dim) + index_key_bytes(cfg.index_head_dim)) / s.ratio
                        for s in self.sources.values())
        window = len(self.layers) * cfg.window_size * window_row_bytes(cfg.head_dim)
        return {"compressed": per_token, "window_per_sequence": float(window)}
