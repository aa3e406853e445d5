"""The integer facts of a step's tokens (``plan.py``'s table), in plain torch: the spec in code.

From each token's position P, its sequence's first position in the step (``start``), the packed
index of that first token (``first``), its last position (``last``) and its state row:
the window list (positions max(0, P-W+1)..P ascending, then -1; ring ids for positions before
``start``, ids of this step's rows after the ring's B*S), which tokens end in the ring, and per
compress ratio the visible rows and, for a KV source, the group a token completes, its
(page, slot) and the ids of its r member tokens. Pure device ops: capturable.
"""
from __future__ import annotations

import torch


def window_ids(pos, start, first, row, window: int, slots: int, n_ring: int) -> torch.Tensor:
    """[T, W] int32: the window list of each token (ids into ring ++ this step's rows)."""
    p = (pos - window + 1).clamp_min(0).unsqueeze(1) + torch.arange(window, device=pos.device)
    ids = torch.where(p >= start.unsqueeze(1), n_ring + first.unsqueeze(1) + p - start.unsqueeze(1),
                      row.unsqueeze(1) * slots + p % slots)
    return torch.where(p <= pos.unsqueeze(1), ids, -1).to(torch.int32)


def ring_slots(pos, last, row, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(keep [T] bool, flat [T] int64): the tokens among the last ``slots`` of their sequence,
    and the flat slot row * slots + P % slots each one goes to."""
    return pos > last - slots, row * slots + pos % slots


def group_facts(pos, start, first, row, block_table, ratio: int, page_rows: int, held: int,
                n_recent: int):
    """For a KV source of ``ratio``: (closing [T] bool, page [T] (-1 unless closing), slot [T],
    group_pos [T] = the group's first position g*r, members [T, r] ids into the recent ring
    (< n_recent) or this step's tokens (>= n_recent); None at ratio 1)."""
    closing = (pos + 1) % ratio == 0
    g = pos // ratio
    page = torch.gather(block_table[row], 1, (g // page_rows).unsqueeze(1))[:, 0]
    page = torch.where(closing, page, -1)
    members = None
    if ratio > 1:
        q = (g * ratio).unsqueeze(1) + torch.arange(ratio, device=pos.device)  # [T, r]
        s0 = start.unsqueeze(1)
        members = torch.where(q >= s0, n_recent + first.unsqueeze(1) + q - s0,
                              row.unsqueeze(1) * held + q % held)
    return closing, page, g % page_rows, g * ratio, members
