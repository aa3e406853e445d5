"""The compressor of a KV source (docs/numerics.md §5, step 3): pools every ``r`` consecutive
tokens into one latent. r = 1: ``norm(wkv(x))`` in bf16. r > 1: fp32 wkv and wgate, a
per-channel softmax over the r tokens of a group, ``norm(bf16(pooled))``. The layer projects
the tokens and keeps the fp32 projections of a group still open at the end of a step in the
source's recent ring (``plan.py``: ``RatioFacts.members``); ``pool_norm_rope_pack`` is the
epilogue of the groups that complete.
"""
from __future__ import annotations

import torch

from ..common.norm import rms_norm
from ..common.packing import pack_compressed_rows, pack_index_keys
from ..common.rope import apply_rope
from ..linear.reference import linear


def project(x: torch.Tensor, wkv: torch.Tensor, wgate: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """r > 1: every token's fp32 wkv and wgate outputs (the values the recent ring keeps).

    x: [T, dim] bf16; wkv, wgate: [D, dim] fp32. Returns (kv, score), each [T, D] fp32, the
    correctly rounded fp32 of each exact dot product (``linear``'s fp32 path)."""
    xf = x.float()
    return linear(xf, wkv), linear(xf, wgate)


def prepare_project(wkv: torch.Tensor, wgate: torch.Tensor, previous: object = None) -> dict:
    """Extra arguments of ``project`` prepared once per layer: none (it reads wkv and wgate as
    they are; the triton backend's step-sized form keeps a float64 copy, ``previous`` the one
    it had)."""
    return {}


def recent_group(recent: torch.Tensor, new: torch.Tensor, members: torch.Tensor) -> torch.Tensor:
    """[N, r, D] fp32: each group's r token projections, from the recent ring ``recent``
    [B, r + R, D] (member id < B*(r+R): its flat slot) or this step's ``new`` [T, D] (id
    B*(r+R) + t: token t; ids past the step's tokens read its last one: a group still open,
    whose row is never written)."""
    flat = recent.view(-1, recent.shape[-1])
    n = flat.shape[0]
    old = flat[members.clamp(max=n - 1)]
    fresh = new[(members - n).clamp(0, new.shape[0] - 1)]
    return torch.where((members < n).unsqueeze(-1), old, fresh)


def recent_gather_write(recent_kv: torch.Tensor, recent_score: torch.Tensor,
                        new_kv: torch.Tensor, new_score: torch.Tensor, members: torch.Tensor,
                        write: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's r > 1 open-group bookkeeping in one op: (kv, score) [T, r, D] fp32,
    ``recent_group`` of both rings, then this step's projections new_kv, new_score [T, D]
    into the rings [B, r + R, D] at flat slots ``write`` [T] int64 (-1: not written).

    The gathers read the rings as they were: no write slot may be a member slot of the step
    (a decode step: a token's slot, position P mod (r + R), holds position P - r - R, outside
    every group of the step)."""
    kv = recent_group(recent_kv, new_kv, members)
    score = recent_group(recent_score, new_score, members)
    keep = write >= 0
    for ring, new in ((recent_kv, new_kv), (recent_score, new_score)):
        ring.view(-1, ring.shape[-1])[write[keep]] = new[keep]
    return kv, score


def pool_norm_rope_pack(kv: torch.Tensor, score: torch.Tensor | None, norm_weight: torch.Tensor,
                        index_wk: torch.Tensor, index_k_norm: torch.Tensor, eps: float,
                        rot: torch.Tensor, rows_pool: torch.Tensor, keys_pool: torch.Tensor,
                        page: torch.Tensor, slot: torch.Tensor) -> None:
    """The compressor's epilogue for N completed groups (docs/numerics.md §5, step 3), into the
    pools.

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
        gates = score.softmax(dim=1)  # per channel over the r tokens
        pooled = (kv.float() * gates).sum(dim=1)  # [N, D] fp32
        latent = rms_norm(pooled.to(torch.bfloat16), norm_weight, eps)
    keys = rms_norm(linear(latent, index_wk), index_k_norm, eps)  # [N, d] bf16
    keep = page >= 0
    rows_pool[page[keep], slot[keep]] = pack_compressed_rows(apply_rope(latent, rot))[keep]
    keys_pool[page[keep], slot[keep]] = pack_index_keys(apply_rope(keys, rot))[keep]
