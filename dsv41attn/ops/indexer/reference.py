"""The lightning indexer (SPEC §4.4): bf16 index scores, per-query visibility, the two-level
candidate blocks, and the deterministic top-k (SPEC §0.2).
"""
from __future__ import annotations

import torch


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """s[b,i,t] = sum_h w[b,i,h] * relu(q[b,i,h,:] . k[b,t,:]), in bf16 as the reference.

    q: [B, M, I, d] bf16 (fp4-fake-quantised, post-RoPE); weights: [B, M, I] bf16 (already
    scaled by d^-0.5 I^-0.5); keys: [B, N, d] bf16. Returns [B, M, N] bf16.
    """
    s = torch.einsum("bshd,btd->bsht", q, keys)  # bf16 out, fp32 accumulate
    return (s.relu() * weights.unsqueeze(-1)).sum(dim=2)


def mask_invisible(scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """-inf at t >= visible[b, i] (compressed row t not yet complete for query i).

    scores: [B, M, N]; visible: [B, M] int64 = (P_i + 1) // r.
    """
    t = torch.arange(scores.shape[-1], device=scores.device)
    return scores.masked_fill(t >= visible.unsqueeze(-1), float("-inf"))


def top_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries per row: higher score first, ties to the lower index.

    scores: [..., N]; returns [..., k] int64 in score order (not sorted by index).
    """
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def candidate_blocks(scores: torch.Tensor, visible: torch.Tensor, topk_blocks: int,
                     block_size: int) -> torch.Tensor:
    """Level one (candidate source): keep the best ``topk_blocks`` blocks of ``block_size``
    compressed rows per query, the newest visible block always kept.

    scores: [B, M, N] bf16, already masked by visibility; visible: [B, M] int64.
    Returns kept blocks [B, M, ceil(N / block_size)] bool. A block scoring -inf (nothing
    visible) is never kept; with visible = 0 no block is pinned.
    """
    b, m, n = scores.shape
    nblk = -(-n // block_size)
    padded = torch.nn.functional.pad(scores.float(), (0, nblk * block_size - n), value=float("-inf"))
    block_score = padded.view(b, m, nblk, block_size).amax(-1)  # [B, M, nblk]
    newest = (visible - 1).div(block_size, rounding_mode="floor")  # -1 when nothing is visible
    blk = torch.arange(nblk, device=scores.device)
    block_score = block_score.masked_fill(blk == newest.unsqueeze(-1), float("inf"))
    picked = top_indices(block_score, min(topk_blocks, nblk))
    keep = torch.zeros(b, m, nblk, dtype=torch.bool, device=scores.device)
    return keep.scatter_(-1, picked, torch.gather(block_score, -1, picked) > float("-inf"))


def expand_blocks(keep: torch.Tensor, block_size: int, n: int) -> torch.Tensor:
    """Block mask [B, M, nblk] -> position mask [B, M, n] bool."""
    return keep.repeat_interleave(block_size, dim=-1)[..., :n]


def select_candidate_blocks(scores: torch.Tensor, visible: torch.Tensor, topk_blocks: int,
                            block_size: int) -> torch.Tensor:
    """``candidate_blocks`` expanded to positions: [B, M, N] bool."""
    keep = candidate_blocks(scores, visible, topk_blocks, block_size)
    return expand_blocks(keep, block_size, scores.shape[-1])


def select_topk(scores: torch.Tensor, visible: torch.Tensor, topk: int) -> torch.Tensor:
    """Level two: k = min(topk, N) rows per query, sorted ascending; rows a query cannot see
    (>= visible) become -1, which the sort places last.

    scores: [B, M, N] bf16 (masked); visible: [B, M]. Returns [B, M, k] int32 compressed-row
    numbers g (row g holds tokens g*r .. g*r+r-1), -1 padded.
    """
    k = min(topk, scores.shape[-1])
    sel = top_indices(scores, k).sort(dim=-1).values
    return torch.where(sel < visible.unsqueeze(-1), sel, -1).to(torch.int32)
