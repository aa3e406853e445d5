"""The lightning indexer (docs/numerics.md §5, step 4): bf16 index scores, per-query
visibility, the two-level candidate blocks, and the deterministic top-k (higher score first,
ties to the lower row).
"""
from __future__ import annotations

import torch

from ..common.cpu_kernels import torch_bf16_matmul
from ..common.packing import paged_index_keys


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """s[b,i,t] = sum_h w[b,i,h] * relu(q[b,i,h,:] . k[b,t,:]), in bf16 as the reference.

    q: [B, M, I, d] bf16 (fp4-fake-quantised, post-RoPE); weights: [B, M, I] bf16 (already
    scaled by d^-0.5 I^-0.5); keys: [B, N, d] bf16. Returns [B, M, N] bf16.
    """
    with torch_bf16_matmul(q.device):  # the fixtures' kernel on any CPU (cpu_kernels)
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


def index_topk(q_index: torch.Tensor, head_weights: torch.Tensor, key_pool: torch.Tensor,
               block_table: torch.Tensor, token_row: torch.Tensor, visible: torch.Tensor,
               n_rows: int, topk: int, token_groups: list[tuple[int, torch.Tensor]],
               candidates: torch.Tensor | None = None, candidate_topk: int | None = None,
               block_size: int = 8, score_budget: int = 1 << 30, reduce=None,
               head_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The lightning indexer over the paged fp4 index keys, one query per packed token.

    q_index: [T, I, d] bf16 index queries (post-RoPE, fp4-fake-quantised); head_weights: [T, I]
    bf16, used as ``head_weights * head_scale`` (bf16: the layer's weights_proj(x) and
    index_weight_scale); key_pool: [P, page_rows, d/2 + d/32] uint8 packed index keys;
    block_table: [B, pages] int64 page ids of every state row; token_row: [T] int64 each
    query's state row; visible: [T] int64 rows the query may see ((P + 1) // r); n_rows: rows
    per sequence to score (>= every visible; rows beyond a query's ``visible`` are masked, so
    a wider scan selects the same rows). token_groups: the packed tokens as (m, token ids
    [g * m]) of sequences with m tokens each, sequence-major: how this reference batches
    (a kernel reads ``token_row`` instead). candidates: [T, ceil(n_rows / block_size)] bool
    blocks a candidate source kept (a consumer scores only rows inside them) or None.
    candidate_topk: for the candidate source, the blocks to keep per query (newest visible
    block pinned). score_budget: bytes of bf16 scores per query tile (bounds memory at long
    context; results do not depend on it). reduce: None, or a callable given each
    tile's bf16 scores [g, m, n] summed over the heads of ``q_index`` and returning the scores
    to use (tensor parallelism: the local heads' partial sum all-reduced over the ranks,
    docs/numerics.md §10), applied before visibility, candidates and top-k; every rank calls
    it equally often.

    Returns (selected [T, min(topk, n_rows)] int32 row numbers ascending, -1 padded;
    kept blocks [T, nblk] bool for the candidate source, else None).
    """
    t_all, dev = q_index.shape[0], q_index.device
    if head_scale != 1.0:
        head_weights = head_weights * head_scale  # bf16, rounded once
    k = min(topk, n_rows)
    selected = torch.empty(t_all, k, dtype=torch.int32, device=dev)
    nblk = -(-n_rows // block_size)
    keep = torch.empty(t_all, nblk, dtype=torch.bool, device=dev) \
        if candidate_topk is not None else None
    if n_rows == 0:
        return selected, keep
    n_heads = q_index.shape[1]
    for m, tokens in token_groups:
        g = tokens.numel() // m
        rows = token_row[tokens].view(g, m)[:, 0]
        keys = paged_index_keys(key_pool, block_table[rows], n_rows)  # [g, n, d] bf16
        q = q_index[tokens].view(g, m, *q_index.shape[1:])
        w = head_weights[tokens].view(g, m, n_heads)
        vis = visible[tokens].view(g, m)
        cand = candidates[tokens].view(g, m, -1) if candidates is not None else None
        sel = torch.empty(g, m, k, dtype=torch.int32, device=dev)
        kept = torch.empty(g, m, nblk, dtype=torch.bool, device=dev) if keep is not None else None
        tile = max(1, min(m, score_budget // max(1, g * n_heads * n_rows * 2)))
        for i0 in range(0, m, tile):
            t = slice(i0, i0 + tile)
            scores = index_scores(q[:, t], w[:, t], keys)
            if reduce is not None:
                scores = reduce(scores)
            scores = mask_invisible(scores, vis[:, t])
            if kept is not None:
                kept[:, t] = candidate_blocks(scores, vis[:, t], candidate_topk, block_size)
            if cand is not None:
                scores = scores.masked_fill(~expand_blocks(cand[:, t], block_size, n_rows),
                                            float("-inf"))
            sel[:, t] = select_topk(scores, vis[:, t], topk)
        selected[tokens] = sel.flatten(0, 1)
        if keep is not None:
            keep[tokens] = kept.flatten(0, 1)
    return selected, keep
