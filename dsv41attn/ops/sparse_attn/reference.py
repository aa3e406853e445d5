"""Sparse attention with a per-head sink (docs/numerics.md §6), with the kernel's rounding points.

One KV row serves every head (MQA; K = V). Per (batch, query) the index list is walked in
blocks of 64 in list order with an online softmax: fp32 logits from bf16 operands (dot
products correctly rounded to fp32), running max from -1e30 over logits only, probabilities
rounded to bf16 before P.V, fp32 accumulator, the sink added to the denominator at the end.
"""
from __future__ import annotations

import torch

from ..common.packing import paged_rows, unpack_compressed_rows, unpack_window_rows
from ..common.rope import apply_rope

BLOCK = 64
NEG_INIT = -1e30


def sparse_attn(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor,
                scale: float, max_queries: int = 64) -> torch.Tensor:
    """o[b,i,h] = sum_t e^{l_t} kv[idx_t] / (sum_t e^{l_t} + e^{sink_h}), l_t = scale q.kv[idx_t].

    q: [B, M, H, D] bf16; kv: [B, N, D] bf16 (rows addressed by idx); sink: [H] fp32;
    idx: [B, M, W] int32 row numbers into kv, -1 = skip. Returns [B, M, H, D] bf16; a query
    with no valid entry gives 0 (no NaN).
    """
    b, m, h, d = q.shape
    out = torch.empty_like(q)
    sink = sink.float()
    for i0 in range(0, m, max_queries):
        qs = q[:, i0:i0 + max_queries].to(torch.float64)  # [B, m', H, D]
        # whole 64-blocks: a list's trailing -1 pads (their number depends on the call) then
        # never change how a block's probabilities are summed
        ids = idx[:, i0:i0 + max_queries].long()
        ids = torch.nn.functional.pad(ids, (0, -ids.shape[-1] % BLOCK), value=-1)
        mq = qs.shape[1]
        run_max = torch.full((b, mq, h), NEG_INIT, dtype=torch.float32, device=q.device)
        run_sum = torch.zeros(b, mq, h, dtype=torch.float32, device=q.device)
        acc = torch.zeros(b, mq, h, d, dtype=torch.float32, device=q.device)
        for j0 in range(0, ids.shape[-1], BLOCK):
            blk = ids[..., j0:j0 + BLOCK]  # [B, m', w]
            valid = blk >= 0
            rows = torch.gather(
                kv.unsqueeze(1).expand(b, mq, *kv.shape[1:]), 2,
                blk.clamp_min(0).unsqueeze(-1).expand(*blk.shape, d),
            ).to(torch.float64)  # [B, m', w, D]
            logits = torch.einsum("bmhd,bmwd->bmhw", qs, rows).float()
            logits = logits.masked_fill(~valid.unsqueeze(2), float("-inf")) * scale
            new_max = torch.maximum(run_max, logits.amax(-1))
            alpha = torch.exp(run_max - new_max)
            p = torch.exp(logits - new_max.unsqueeze(-1))  # [B, m', H, w] fp32
            run_sum = run_sum * alpha + p.sum(-1)
            pv = torch.einsum("bmhw,bmwd->bmhd", p.bfloat16().to(torch.float64), rows).float()
            acc = acc * alpha.unsqueeze(-1) + pv
            run_max = new_max
        run_sum = run_sum + torch.exp(sink - run_max)
        out[:, i0:i0 + max_queries] = (acc / run_sum.unsqueeze(-1)).to(q.dtype)
    return out


def sparse_attn_paged(q: torch.Tensor, sink: torch.Tensor, scale: float,
                      window_ring: torch.Tensor, new_rows: torch.Tensor, window_ids: torch.Tensor,
                      compressed_pool: torch.Tensor | None, block_table: torch.Tensor | None,
                      token_row: torch.Tensor, compressed_idx: torch.Tensor,
                      max_queries: int = 64, *, out_rot: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """Sparse attention over the packed caches, one query per packed token of a step: each
    query's list is its window entries then its compressed entries, walked as one list
    (``sparse_attn``'s numerics). The window ring is read in place: no copy of it.

    q: [T, H, D] bf16; sink: [H] fp32.
    window_ring: [B, S, D + D/32] uint8, the layer's ring (packed fp8 rows) as before the step.
    new_rows: [T, D + D/32] uint8, the step's own packed window rows.
    window_ids: [T, Ww] int32: id in 0..B*S-1 is ring row ``window_ring.view(B*S, -1)[id]``,
    id >= B*S is ``new_rows[id - B*S]``, -1 skips.
    compressed_pool: [P, page_rows, D/2 + D/16] uint8 packed fp4 rows (None without any);
    block_table: [B, pages] int64 page ids of every state row (None without any);
    token_row: [T] int64 state row of each token (its block-table row);
    compressed_idx: [T, K] int32 compressed row numbers g (row g = pool[block_table[row,
    g // page_rows], g % page_rows]), -1 skips; out_rot: None, or [T, R/2] complex64: the
    output's last R dims of each head are then turned back by its conjugate (step 6's inverse
    RoPE, as apply_rope(o, out_rot, inverse=True)). Returns [T, H, D] bf16 (0 for an empty
    list).
    """
    t_all, h, d = q.shape
    out = torch.empty_like(q)
    ring = window_ring.reshape(-1, window_ring.shape[-1])
    n_ring, k = ring.shape[0], compressed_idx.shape[-1]
    # Unpacking is row by row, so a row unpacked before or after its gather has the same bits:
    # where the ring and new rows (or the compressed pool) hold fewer rows than one chunk of
    # queries reads, each is unpacked once here rather than once per read (fewer unpacks, and
    # never more unpacked rows alive than one chunk's).
    chunk = min(t_all, max_queries)
    window_once = n_ring + t_all < chunk * window_ids.shape[-1]
    if window_once:
        ring, new_rows = unpack_window_rows(ring), unpack_window_rows(new_rows)
    pool_once = k and compressed_pool.shape[0] * compressed_pool.shape[1] < chunk * k
    if pool_once:
        compressed_pool = unpack_compressed_rows(compressed_pool)
    for t0 in range(0, t_all, max_queries):
        t = slice(t0, t0 + max_queries)
        ids = window_ids[t].long()  # [t, Ww]
        from_ring = ids < n_ring
        kv = torch.where(from_ring.unsqueeze(-1), ring[ids.clamp(0, n_ring - 1)],
                         new_rows[(ids - n_ring).clamp(0, t_all - 1)])
        if not window_once:
            kv = unpack_window_rows(kv)  # [t, Ww, D]
        idx = torch.where(ids >= 0, torch.arange(ids.shape[1], device=q.device), -1)
        if k:
            g = compressed_idx[t].long()  # [t, K]
            rows = paged_rows(compressed_pool, block_table[token_row[t]], g.clamp_min(0))
            if not pool_once:
                rows = unpack_compressed_rows(rows)
            kv = torch.cat([kv, rows], dim=1)  # [t, Ww + K, D]
            own = ids.shape[1] + torch.arange(k, device=q.device)
            idx = torch.cat([idx, torch.where(g >= 0, own, -1)], dim=1)
        out[t] = sparse_attn(q[t].unsqueeze(1), kv, sink, idx.unsqueeze(1).to(torch.int32),
                             scale).squeeze(1)
    if out_rot is not None:
        out = apply_rope(out, out_rot.unsqueeze(1), inverse=True)  # rot over the heads
    return out
