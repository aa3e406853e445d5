"""The sliding-window part of a call (SPEC §4.2 and §6): which KV rows the window attends over,
the index matrix into them, and the ring update.

Three layouts, all listing positions max(0, P-W+1)..P for the query at position P:
- prefill at position 0: the chunk's own rows; row i lists them ascending, -1 padded at the
  end (the reference's prefill layout, width min(m, W));
- one token at p > 0 (decode): the ring after the write, oldest slot first, -1 for
  positions < 0 (the reference's decode layout, width W);
- m > 1 tokens at p0 > 0 (chunked prefill, speculative verify): the ring before the write
  followed by the chunk's rows, ascending, -1 padded at the end (width min(W, p0 + m)).
"""
from __future__ import annotations

import torch


def window_indices_prefill(m: int, window: int, device=None) -> torch.Tensor:
    """[m, min(m, W)] int32: row i lists max(0, i-W+1)+j, -1 where that exceeds i."""
    i = torch.arange(m, device=device).unsqueeze(1)
    e = (i - window + 1).clamp_min(0) + torch.arange(min(m, window), device=device)
    return torch.where(e > i, -1, e).to(torch.int32)


def window_indices_decode(pos: torch.Tensor, window: int, slots: int | None = None) -> torch.Tensor:
    """[B, W] int32 ring slots oldest first for one query per sequence at ``pos`` [B]: the
    slots (t mod ``slots``) of positions pos-W+1..pos, -1 for positions < 0. ``slots``: the
    ring size (default W; larger when the ring keeps history for rollback)."""
    slots = window if slots is None else slots
    t = pos.unsqueeze(1) - window + 1 + torch.arange(window, device=pos.device)
    return torch.where(t < 0, -1, t % slots).to(torch.int32)


def window_indices_chunk(start: int, m: int, window: int, slots: int | None = None,
                         device=None) -> torch.Tensor:
    """[m, min(W, start+m)] int32 into ``cat([ring before the write, chunk])``: positions
    t < start live in ring slot t mod ``slots`` (default W), positions t >= start at row
    slots + (t - start)."""
    slots = window if slots is None else slots
    width = min(window, start + m)
    pos = start + torch.arange(m, device=device).unsqueeze(1)
    t = pos - width + 1 + torch.arange(width, device=device)  # ascending, last = pos
    row = torch.where(t < start, t % slots, slots + t - start)
    row = torch.where(t < 0, -1, row)
    # -1 entries (t < 0) come first; move them to the end as in the prefill layout.
    order = torch.sort((row < 0).to(torch.int8), dim=1, stable=True).indices
    return torch.gather(row, 1, order).to(torch.int32)


def ring_write(ring: torch.Tensor, kv: torch.Tensor, start: int) -> torch.Tensor:
    """A new ring [B, S, ...] with the last min(m, S) rows of ``kv`` [B, m, ...] (positions
    start..start+m-1) written at slot = position mod S (S = ring.shape[1])."""
    window, m = ring.shape[1], kv.shape[1]
    n = min(m, window)
    slots = torch.arange(start + m - n, start + m, device=ring.device) % window
    out = ring.clone()
    out[:, slots] = kv[:, m - n:]
    return out
