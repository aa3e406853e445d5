"""Sparse attention with a per-head sink (SPEC §4.5), with the kernel's rounding points.

One KV row serves every head (MQA; K = V). Per (batch, query) the index list is walked in
blocks of 64 in list order with an online softmax: fp32 logits from bf16 operands (dot
products correctly rounded to fp32), running max from -1e30 over logits only, probabilities
rounded to bf16 before P.V, fp32 accumulator, the sink added to the denominator at the end.
"""
from __future__ import annotations

import torch

from ..common.packing import paged_rows, unpack_compressed_rows, unpack_window_rows

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
        ids = idx[:, i0:i0 + max_queries].long()
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
                      window_rows: torch.Tensor, window_idx: torch.Tensor,
                      compressed_pool: torch.Tensor | None, block_table: torch.Tensor | None,
                      compressed_idx: torch.Tensor) -> torch.Tensor:
    """Sparse attention over packed caches: the list of each query is its window entries then
    its compressed entries, walked as one list (``sparse_attn``'s numerics).

    q: [B, M, H, D] bf16; sink: [H] fp32; window_rows: [B, Nw, D + D/32] uint8 packed fp8 rows
    (ring and/or this call's rows); window_idx: [B, M, Ww] int32 rows of window_rows, -1 skip;
    compressed_pool: [P, page_rows, D/2 + D/16] uint8 packed fp4 rows (None without any);
    block_table: [B, pages] int64 page ids of these sequences; compressed_idx: [B, M, K] int32
    compressed row numbers g, -1 skip. Returns [B, M, H, D] bf16.
    """
    window = unpack_window_rows(window_rows)  # [B, Nw, D]
    kv, idx = window, window_idx
    b, m, k = compressed_idx.shape
    if k and m == 1:  # decode: each entry's own row (no host read: capturable in a CUDA graph)
        g = compressed_idx.clamp_min(0).flatten(1).long()  # [B, K]
        compressed = unpack_compressed_rows(paged_rows(compressed_pool, block_table, g))
        kv = torch.cat([window, compressed], dim=1)
        own = window.shape[1] + torch.arange(k, device=q.device, dtype=torch.int32)
        idx = torch.cat([window_idx, torch.where(compressed_idx >= 0, own, -1)], dim=-1)
    elif k:  # many queries share rows: unpack rows 0..n-1 once
        n = int(compressed_idx.max()) + 1  # rows 0..n-1 cover every entry
        g = torch.arange(max(n, 0), device=q.device)
        compressed = unpack_compressed_rows(paged_rows(compressed_pool, block_table, g))
        kv = torch.cat([window, compressed], dim=1)
        shifted = torch.where(compressed_idx >= 0, compressed_idx + window.shape[1], -1)
        idx = torch.cat([window_idx, shifted.to(torch.int32)], dim=-1)
    return sparse_attn(q, kv, sink, idx, scale)
