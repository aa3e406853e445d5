"""The compressor of a KV source (SPEC §4.3a): pools every ``r`` consecutive tokens into one
latent. r = 1: ``norm(wkv(x))`` in bf16. r > 1: fp32 wkv and wgate, a per-channel softmax over
the r tokens of a group, ``norm(bf16(pooled))``. A group left open at the end of a call is
carried to the next call in the fp32 open-group state.
"""
from __future__ import annotations

import torch

from ..common.norm import rms_norm
from ..linear.reference import linear


def compress(x: torch.Tensor, start_pos: int, ratio: int, wkv: torch.Tensor,
             wgate: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
             open_kv: torch.Tensor | None, open_score: torch.Tensor | None,
             ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Latents of the groups that complete in this call.

    x: [B, m, X] bf16, tokens at positions start_pos..start_pos+m-1. For ratio > 1,
    open_kv/open_score: [B, start_pos % r, D] fp32, the wkv/wgate outputs of the tokens of
    the group still open before the call.
    Returns (latent [B, n_new, D] bf16 pre-RoPE, or None when no group completes; kv and
    score [B, m, D] fp32 of the new tokens for the caller to keep, None at ratio 1).
    """
    if ratio == 1:
        return rms_norm(linear(x, wkv), norm_weight, eps), None, None
    b, m, _ = x.shape
    xf = x.float()
    kv = linear(xf, wkv)  # [B, m, D] fp32
    score = linear(xf, wgate)
    held = start_pos % ratio
    n_new = (held + m) // ratio
    if n_new == 0:
        return None, kv, score
    d = kv.shape[-1]
    kv_all = torch.cat([open_kv, kv], dim=1)[:, :n_new * ratio]  # [B, held + m, D]
    score_all = torch.cat([open_score, score], dim=1)[:, :n_new * ratio]
    groups = kv_all.view(b, n_new, ratio, d)
    gates = score_all.view(b, n_new, ratio, d).softmax(dim=2)  # per channel over r tokens
    pooled = (groups * gates).sum(dim=2)  # [B, n_new, D] fp32
    return rms_norm(pooled.to(x.dtype), norm_weight, eps), kv, score
