"""A step's plan: every per-token fact the layers of one step need, built once per step.

A step runs ``tokens[i]`` new tokens for each sequence ``rows[i]`` of an ``AttentionState``,
packed sequence-major as [T = sum(tokens), dim]. Prefill, chunked prefill, draft verification
and decode (and any mix of them in one step) differ only in these values; every layer runs the
same code over the packed tokens (``layer.py``).

Per packed token t (all device tensors, derived from the token's position by ``_derive``, so a
``DecodePlan`` can re-derive them on the GPU from positions it advances itself):

| field | shape | meaning |
|---|---|---|
| ``pos`` | [T] int64 | absolute position P |
| ``token_row`` | [T] int64 | the token's state row (its ring and block-table row) |
| ``rotations[variant]`` | [T, R/2] complex64 | e^{i fp32(P) f_j}, per RoPE variant the step's layers use |
| ``window_ids`` | [T, W] int32 | the window list: positions max(0, P-W+1)..P ascending, then -1; id < B*S is ring row ``row*S + p % S`` (written by an earlier step), id >= B*S is this step's row ``id - B*S`` |
| ``ring_write`` | ([n], [n]) int64 | (token, flat ring slot) of the tokens that end in the ring (the last S of each sequence) |
| ``ratios[r].visible`` | [T] int64 | compressed rows the query may see, (P+1) // r |
| ``ratios[r].scan`` | int | rows per sequence an indexer scans (rows beyond ``visible`` are masked) |
| ``ratios[r].close_*`` | [N] | KV sources: the tokens that complete a group, its (page, slot) and its RoPE |
| ``ratios[r].members`` | [N, r] int64 | r > 1: ids of the group's r tokens in the fp32 recent-projection ring (< B*(r+R)) or this step (>= B*(r+R)) |
| ``ratios[r].recent_write`` | ([n], [n]) | r > 1: (token, flat slot) of the projections that end in the recent ring |

One list layout for every call kind (our decision, docs/numerics.md §6): the window part is
always W wide with its -1 pads last, then the compressed part. It is DeepSeek's prefill layout
of a prompt of >= W tokens, and DeepSeek's decode layout from position W-1 on; for shorter
prompts and early decode steps DeepSeek's own prefill and decode disagree in the last bits, we
keep this one.

The ``Board`` carries what index sources publish for the layers after them in the same step
(top-k, candidate blocks), the index-key slot rule (docs/numerics.md §7) lives in
``publishes_index_keys``, and the ``UndoLog`` records the bytes every write overwrites so a
failed step can be undone.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .cache import AttentionState, StateError
from .config import AttentionConfig, LayerSpec
from .ops.common.rope import rope_rotations
from .ops.step_facts import reference as facts


def rope_variant(spec: LayerSpec) -> tuple[float, bool]:
    """The key of a layer's RoPE table: (base, YaRN). Window-only layers use one variant,
    every layer with ratio > 0 the other (docs/numerics.md §4)."""
    return (spec.rope_base, spec.yarn)


def publishes_index_keys(semantics: str, produced: bool) -> bool:
    """Whether a KV source takes the shared index-key slot in this step: always in "fixed"
    semantics, only when it produced a latent in "reference" semantics (DeepSeek's code,
    docs/numerics.md §7)."""
    return semantics == "fixed" or produced


@dataclass
class RatioFacts:
    """The facts of one compress ratio r for the step's tokens (see the module table)."""

    ratio: int
    visible: torch.Tensor  # [T] int64
    scan: int
    close_tokens: torch.Tensor | None = None  # [N] int64 packed token ids
    close_page: torch.Tensor | None = None  # [N] int64, -1 = the token completes no group
    close_slot: torch.Tensor | None = None  # [N] int64
    close_rot: torch.Tensor | None = None  # [N, R/2] complex64 at the group's first token
    members: torch.Tensor | None = None  # [N, r] int64 (r > 1)
    recent_write: tuple[torch.Tensor, torch.Tensor] | None = None  # (tokens [n], flat [n])

    @property
    def produced(self) -> bool:
        """Whether any group completes in this step (host plans only: compacted lists)."""
        return self.close_tokens is not None and self.close_tokens.numel() > 0


class Board:
    """What a step's index sources publish for the layers after them (docs/numerics.md §1)."""

    def __init__(self, keep_index_inputs: bool = False):
        self._topk: dict[int, torch.Tensor] = {}
        self._candidates: torch.Tensor | None = None
        # traced steps: index source -> (index queries, head weights, key pool, RatioFacts)
        self.index_inputs: dict | None = {} if keep_index_inputs else None

    def publish_topk(self, layer: int, selected: torch.Tensor) -> None:
        self._topk[layer] = selected

    def topk(self, layer: int) -> torch.Tensor:
        """[T, k] int32 compressed-row numbers (-1 pad) that index source ``layer`` selected."""
        if layer not in self._topk:
            raise StateError(f"index source {layer} has not published a top-k in this step")
        return self._topk[layer]

    def publish_candidates(self, keep: torch.Tensor) -> None:
        self._candidates = keep

    def candidates(self) -> torch.Tensor:
        """[T, nblk] bool: the candidate blocks the candidate source kept."""
        if self._candidates is None:
            raise StateError("no candidate blocks were published in this step")
        return self._candidates


class UndoLog:
    """The bytes a step's writes overwrote, restored newest first by ``undo``.

    ``save(buffer, index)`` copies ``buffer[index]`` before a write to those entries; a
    host-side action (pages, slot) is recorded as a callable."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._entries: list = []

    def save(self, buffer: torch.Tensor, index) -> None:
        if self.enabled:
            self._entries.append((buffer, index, buffer[index].clone()))

    def on_undo(self, action) -> None:
        self._entries.append(action)

    def undo(self) -> None:
        for entry in reversed(self._entries):
            if callable(entry):
                entry()
            else:
                buffer, index, old = entry
                buffer[index] = old
        self._entries.clear()

    def clear(self) -> None:
        self._entries.clear()


@dataclass
class StepPlan:
    """The packed tokens of one step and every fact its layers need (module docstring).

    Built by ``StepPlan.build`` from host lists (a step) or by ``DecodePlan`` (positions on the
    device, re-derived every run by ``derive``)."""

    cfg: AttentionConfig
    state: AttentionState
    rows: list[int]  # state rows of the sequences with tokens, in packed order
    tokens: list[int]  # tokens per sequence (all >= 1)
    cu_seqlens: list[int]  # packed offsets, len(rows) + 1
    token_row: torch.Tensor  # [T] int64
    freqs: dict[tuple[float, bool], torch.Tensor]  # RoPE variant -> [R/2] fp32 on the device
    ratios_used: dict[int, tuple | None]  # ratio -> RoPE variant of its KV source if one runs
    compact: bool  # host plan: compressor and ring lists hold only the tokens that write
    kernels: bool = False  # decode plan on a GPU backend: derive the facts in Triton
    seq_rows: torch.Tensor = None  # [b] int64 state rows (device)
    seq_end: torch.Tensor = None  # [b] int64 each sequence's position after the step
    # per-token facts (set by derive)
    pos: torch.Tensor = None
    rotations: dict = field(default_factory=dict)
    window_ids: torch.Tensor = None
    ring_write: tuple[torch.Tensor, torch.Tensor] = None
    ratios: dict[int, RatioFacts] = field(default_factory=dict)
    token_groups: list[tuple[int, torch.Tensor]] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return self.cu_seqlens[-1]

    @classmethod
    def build(cls, cfg: AttentionConfig, state: AttentionState, rows: list[int],
              starts: list[int], tokens: list[int], freqs, ratios_used: dict[int, tuple | None]
              ) -> "StepPlan":
        """A host step: ``tokens[i] >= 1`` tokens of sequence ``rows[i]`` from ``starts[i]``."""
        dev = state.device
        cu = [0]
        for t in tokens:
            cu.append(cu[-1] + t)
        # one host-to-device copy: [T, 5] (row, position, start, first token, last position)
        per_token = torch.tensor(
            [[r, p, s, first, s + m - 1] for r, s, m, first in zip(rows, starts, tokens, cu)
             for p in range(s, s + m)], dtype=torch.int64).reshape(-1, 5).to(dev)
        row, pos, start, first, last = per_token.unbind(1)
        plan = cls(cfg, state, list(rows), list(tokens), cu, row, freqs, ratios_used, True)
        ends = torch.tensor([list(rows), [s + m for s, m in zip(starts, tokens)]]).to(dev)
        plan.seq_rows, plan.seq_end = ends[0], ends[1]
        scans = {r: max((s + m) // r for s, m in zip(starts, tokens)) for r in ratios_used}
        plan.derive(pos, start, first, last, scans)
        by_len: dict[int, list[int]] = {}
        for i, m in enumerate(tokens):
            by_len.setdefault(m, []).append(i)
        plan.token_groups = [
            (m, torch.tensor([t for i in members for t in range(cu[i], cu[i] + m)],
                             dtype=torch.int64).to(dev))
            for m, members in by_len.items()]
        return plan

    def rotations_of(self, spec: LayerSpec) -> torch.Tensor:
        """[T, R/2] complex64: the RoPE of each token's position in ``spec``'s variant."""
        return self.rotations[rope_variant(spec)]

    def derive(self, pos: torch.Tensor, start: torch.Tensor, first: torch.Tensor,
               last: torch.Tensor, scans: dict[int, int]) -> None:
        """Every per-token fact from the positions (pure device ops: capturable).

        pos, start, first, last: [T] int64: each token's position, its sequence's first
        position in this step, the packed index of that first token, and its last position.
        A decode plan with ``kernels`` set derives the integer facts in two Triton kernels
        (the same values as ``ops/step_facts/reference``)."""
        cfg, st = self.cfg, self.state
        w, slots, n_ring = cfg.window_size, st.ring_slots, st.batch_size * st.ring_slots
        row = self.token_row
        self.pos = pos
        if not self.compact:  # a decode plan: one token per sequence
            self.seq_end = pos + 1
        self.rotations = {v: rope_rotations(f, pos) for v, f in self.freqs.items()}
        if self.kernels:
            from .ops.step_facts import triton as facts_kernels

            everyone = torch.arange(pos.numel(), device=pos.device)
            self.window_ids, flat = facts_kernels.decode_window_facts(pos, row, w, slots, n_ring)
            self.ring_write = (everyone, flat)
        else:
            self.window_ids = facts.window_ids(pos, start, first, row, w, slots, n_ring)
            self.ring_write = self._writes(*facts.ring_slots(pos, last, row, slots))
        self.ratios = {}
        for r, variant in self.ratios_used.items():
            page_rows, held = st.page_size // r, st.recent_slots(r)
            if self.kernels:
                vis, page, slot, gpos, members, recent = facts_kernels.decode_group_facts(
                    pos, row, st.block_table, r, page_rows, held, st.batch_size * held,
                    variant is not None)
                self.ratios[r] = RatioFacts(r, vis, scans[r]) if variant is None else RatioFacts(
                        r, vis, scans[r], everyone, page, slot,
                        rope_rotations(self.freqs[variant], gpos), members,
                        (everyone, recent) if recent is not None else None)
                continue
            ratio = RatioFacts(r, (pos + 1) // r, scans[r])
            if variant is not None:
                closing, page, slot, gpos, members = facts.group_facts(
                    pos, start, first, row, st.block_table, r, page_rows, held,
                    st.batch_size * held)
                tokens = closing.nonzero().squeeze(1) if self.compact else \
                    torch.arange(pos.numel(), device=pos.device)
                ratio.close_tokens, ratio.close_page, ratio.close_slot = \
                    tokens, page[tokens], slot[tokens]
                ratio.close_rot = rope_rotations(self.freqs[variant], gpos[tokens])
                if r > 1:
                    ratio.members = members[tokens]
                    ratio.recent_write = self._writes(*facts.ring_slots(pos, last, row, held))
            self.ratios[r] = ratio

    def _writes(self, keep: torch.Tensor, flat: torch.Tensor):
        """(tokens, flat slots) of the writes that survive the step: compacted on a host plan,
        every token on a device plan (there every token writes: one token per sequence)."""
        if self.compact:
            tokens = keep.nonzero().squeeze(1)
            return tokens, flat[tokens]
        return torch.arange(flat.numel(), device=flat.device), flat
