"""``reference``'s facts for a decode step (one token per sequence: start = last = P, first =
the token itself) in two small Triton kernels instead of ~25 torch launches: the window list
and ring slot per token, then per compress ratio the visible rows and a KV source's group
facts. Same values as the reference, bit for bit (integers)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.triton import next_pow2


@triton.jit
def _window_kernel(pos_ptr, row_ptr, ids_ptr, flat_ptr, W, S, N_RING, BLOCK_W: tl.constexpr):
    t = tl.program_id(0)
    p = tl.load(pos_ptr + t)
    row = tl.load(row_ptr + t)
    j = tl.arange(0, BLOCK_W)
    q = tl.maximum(p - W + 1, 0) + j  # positions, ascending
    ids = tl.where(q >= p, N_RING + t + q - p, row * S + q % S)  # the token itself is new
    ids = tl.where(q <= p, ids, -1)
    tl.store(ids_ptr + t * W + j, ids.to(tl.int32), mask=j < W)
    tl.store(flat_ptr + t, row * S + p % S)


@triton.jit
def _group_kernel(pos_ptr, row_ptr, table_ptr, table_stride, vis_ptr, page_ptr, slot_ptr,
                  gpos_ptr, members_ptr, recent_ptr, R, PAGE_ROWS, HELD, N_RECENT,
                  HAS_SOURCE: tl.constexpr, BLOCK_R: tl.constexpr):
    t = tl.program_id(0)
    p = tl.load(pos_ptr + t)
    tl.store(vis_ptr + t, (p + 1) // R)
    if HAS_SOURCE:
        row = tl.load(row_ptr + t)
        g = p // R
        page = tl.load(table_ptr + row * table_stride + g // PAGE_ROWS)
        page = tl.where((p + 1) % R == 0, page, -1)
        tl.store(page_ptr + t, page)
        tl.store(slot_ptr + t, g % PAGE_ROWS)
        tl.store(gpos_ptr + t, g * R)
        if BLOCK_R > 1:
            j = tl.arange(0, BLOCK_R)
            q = g * R + j
            m = tl.where(q >= p, N_RECENT + t + q - p, row * HELD + q % HELD)
            tl.store(members_ptr + t * R + j, m, mask=j < R)
            tl.store(recent_ptr + t, row * HELD + p % HELD)


def decode_window_facts(pos: torch.Tensor, row: torch.Tensor, window: int, slots: int,
                        n_ring: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(window_ids [T, W] int32, ring flat slot [T] int64) of one decode token per sequence.
    pos, row: [T] int64 on the device."""
    t = pos.numel()
    ids = torch.empty(t, window, dtype=torch.int32, device=pos.device)
    flat = torch.empty(t, dtype=torch.int64, device=pos.device)
    if t:
        _window_kernel[(t,)](pos, row, ids, flat, window, slots, n_ring,
                             BLOCK_W=next_pow2(window))
    return ids, flat


def decode_group_facts(pos: torch.Tensor, row: torch.Tensor, block_table: torch.Tensor,
                       ratio: int, page_rows: int, held: int, n_recent: int, has_source: bool):
    """(visible [T], page [T], slot [T], group_pos [T], members [T, r] or None, recent flat
    slot [T] or None) for one decode token per sequence; only visible without a source."""
    t, dev = pos.numel(), pos.device
    vis = torch.empty(t, dtype=torch.int64, device=dev)
    page, slot, gpos = (torch.empty(t, dtype=torch.int64, device=dev) for _ in range(3))
    members = torch.empty(t, ratio, dtype=torch.int64, device=dev) if ratio > 1 else None
    recent = torch.empty(t, dtype=torch.int64, device=dev) if ratio > 1 else None
    if t:
        table = block_table.contiguous()
        _group_kernel[(t,)](pos, row, table, table.stride(0), vis, page, slot, gpos,
                            members if members is not None else vis,
                            recent if recent is not None else vis, ratio, page_rows, held,
                            n_recent, HAS_SOURCE=has_source, BLOCK_R=next_pow2(ratio)
                            if ratio > 1 else 1)
    if not has_source:
        return vis, None, None, None, None, None
    return vis, page, slot, gpos, members, recent
