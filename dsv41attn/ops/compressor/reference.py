"""The compressor of a KV source (SPEC §4.3a): pools every ``r`` consecutive tokens into one
latent. r = 1: ``norm(wkv(x))`` in bf16. r > 1: fp32 wkv and wgate, a per-channel softmax over
the r tokens of a group, ``norm(bf16(pooled))``. A group left open at the end of a call is
carried to the next call in the fp32 open-group state.
"""
from __future__ import annotations

import torch

from ..common.norm import rms_norm
from ..common.packing import pack_compressed_rows, pack_index_keys
from ..common.rope import apply_rope
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


def pool_norm_rope_pack(kv: torch.Tensor, score: torch.Tensor | None, norm_weight: torch.Tensor,
                        index_wk: torch.Tensor, index_k_norm: torch.Tensor, eps: float,
                        rot: torch.Tensor, rows_pool: torch.Tensor, keys_pool: torch.Tensor,
                        page: torch.Tensor, slot: torch.Tensor) -> None:
    """The compressor's epilogue for N completed groups (SPEC §4.3a-c, §4.4.1), into the pools.

    kv: [N, r, D] fp32 or bf16, the wkv outputs of each group's r tokens (r = 1: the bf16 wkv
    row as [N, 1, D]); score: [N, r, D] fp32 wgate outputs, None iff r == 1.
    norm_weight: [D] bf16 (compressor.norm); index_wk: [d, D] bf16; index_k_norm: [d] bf16;
    eps: the norms' epsilon; rot: [N, R/2] complex64, e^{i angle} at each group's first token.
    rows_pool: [P, page_rows, D/2 + D/16] uint8 compressed rows; keys_pool: [P, page_rows,
    d/2 + d/32] uint8 index keys (packing.py layouts); page, slot: [N] int64, where group i
    goes; page[i] < 0 skips it. Written: rows_pool/keys_pool[page[i], slot[i]]; nothing else.

    latent = norm(bf16(sum_t kv_t * softmax_t(score)))  (r = 1: norm(bf16(kv)));
    keys = k_norm(latent @ index_wk^T), from the pre-RoPE latent;
    rows = fp4(RoPE(latent), 16, e4m3); index keys = fp4(RoPE(keys), 32, ue8m0).
    """
    if score is None:
        latent = rms_norm(kv[:, 0].to(torch.bfloat16), norm_weight, eps)  # [N, D] bf16
    else:
        gates = score.softmax(dim=1)  # per channel over the r tokens, as compress()
        pooled = (kv.float() * gates).sum(dim=1)  # [N, D] fp32
        latent = rms_norm(pooled.to(torch.bfloat16), norm_weight, eps)
    keys = rms_norm(linear(latent, index_wk), index_k_norm, eps)  # [N, d] bf16
    keep = page >= 0
    rows_pool[page[keep], slot[keep]] = pack_compressed_rows(apply_rope(latent, rot))[keep]
    keys_pool[page[keep], slot[keep]] = pack_index_keys(apply_rope(keys, rot))[keep]
