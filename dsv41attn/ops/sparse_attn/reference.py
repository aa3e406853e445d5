"""Sparse attention with a per-head sink (SPEC §4.5), with the kernel's rounding points.

One KV row serves every head (MQA; K = V). Per (batch, query) the index list is walked in
blocks of 64 in list order with an online softmax: fp32 logits from bf16 operands (dot
products correctly rounded to fp32), running max from -1e30 over logits only, probabilities
rounded to bf16 before P.V, fp32 accumulator, the sink added to the denominator at the end.
"""
from __future__ import annotations

import torch

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
