"""The compressor's epilogue (ops/compressor/reference.pool_norm_rope_pack, SPEC §4.3a-c,
§4.4.1): the per-channel gate softmax over each group's r tokens against a plain fp32 loop,
norm -> index keys from the pre-RoPE latent -> RoPE -> fp4 packing, pages < 0 skipped.

The norm, linear, RoPE and packing are each tested against their own oracles (test_norm_rope,
test_linear, tests/test_packing.py); here they only compose. Chunk invariance of the compressor
(groups open across steps) is covered end to end by the serving tests."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dsv41attn.config import preset
from dsv41attn.ops.common.norm import rms_norm
from dsv41attn.ops.common.packing import pack_compressed_rows, pack_index_keys
from dsv41attn.ops.common.rope import apply_rope, rope_frequencies, rope_rotations
from dsv41attn.ops.compressor.reference import pool_norm_rope_pack
from dsv41attn.ops.linear.reference import linear

from .conftest import BF16, F64, f32

EPS = 1e-20  # SPEC §2.4: every norm in the layer
POISON = 0xFF  # a byte no write leaves in an e4m3 scale or a ue8m0 exponent
PAGE_ROWS = 4


def _dims(name: str):
    """(D, d, rope frequencies of the first compressed layer) of a preset."""
    cfg = preset(name)
    layer = next(L for L in range(cfg.n_layers) if cfg.layer(L).ratio > 0)
    return cfg.head_dim, cfg.index_head_dim, rope_frequencies(cfg, cfg.layer(layer))


def _args(n: int, r: int, name: str, first_pos: int, seed: int) -> dict:
    """pool_norm_rope_pack's arguments for n groups of ratio r (group i stands for position
    first_pos + i * r) into poisoned pools, at distinct shuffled (page, slot), every third group
    skipped (page -1). kv on a k/64 grid, scores any fp32 values."""
    D, d, freqs = _dims(name)
    g = torch.Generator().manual_seed(seed)
    kv = torch.randint(-128, 129, (n, r, D), generator=g).float() / 64
    score = None
    if r == 1:
        kv = kv.to(BF16)
    else:
        score = torch.randn(n, r, D, generator=g) * 3
    pages = n + 2
    where = torch.randperm(pages * PAGE_ROWS, generator=g)[:n]
    page, slot = where // PAGE_ROWS, where % PAGE_ROWS
    page[1::3] = -1
    return {
        "kv": kv, "score": score,
        "norm_weight": (1 + 0.3 * torch.randn(D, generator=g)).to(BF16),
        "index_wk": (torch.randn(d, D, generator=g) / D ** 0.5).to(BF16),
        "index_k_norm": (1 + 0.3 * torch.randn(d, generator=g)).to(BF16), "eps": EPS,
        "rot": rope_rotations(freqs, first_pos + r * torch.arange(n)),
        "rows_pool": torch.full((pages, PAGE_ROWS, D // 2 + D // 16), POISON, dtype=torch.uint8),
        "keys_pool": torch.full((pages, PAGE_ROWS, d // 2 + d // 32), POISON, dtype=torch.uint8),
        "page": page, "slot": slot,
    }


def pool_oracle(kv: torch.Tensor, score: torch.Tensor | None) -> torch.Tensor:
    """[N, D] bf16 pooled latents before the norm. r > 1, in fp32 with explicit rounding points:
    per channel, e_t = exp(s_t - max_t s), den = e_0 + e_1 + ... in token order, pooled =
    sum over t in token order of kv_t * (e_t / den); then bf16. r = 1: the bf16 kv row."""
    if score is None:
        return kv[:, 0]
    K, G = kv.numpy(), score.numpy()
    r = K.shape[1]
    e = np.exp((G - G.max(axis=1, keepdims=True)).astype(f32)).astype(f32)
    den = e[:, 0]
    for t in range(1, r):
        den = (den + e[:, t]).astype(f32)
    acc = np.zeros_like(K[:, 0])
    for t in range(r):
        acc = (acc + K[:, t] * (e[:, t] / den).astype(f32)).astype(f32)
    return torch.from_numpy(acc).to(BF16)


def _expected(a: dict, latent: torch.Tensor):
    """(rows, keys) bytes of each group from its normed latent: index keys from the pre-RoPE
    latent, then RoPE on both, then fp4 packing."""
    keys = rms_norm(linear(latent, a["index_wk"]), a["index_k_norm"], EPS)
    return (pack_compressed_rows(apply_rope(latent, a["rot"])),
            pack_index_keys(apply_rope(keys, a["rot"])))


@pytest.mark.parametrize("name,r,first_pos", [("tiny", 1, 5), ("tiny", 2, 6), ("tiny", 4, 40),
                                              ("v41-flash", 2, 1000), ("v41-flash", 4, 0)],
                         ids=lambda v: str(v))
def test_pool_norm_rope_pack_matches_oracle(name, r, first_pos):
    n = 7
    a = _args(n, r, name, first_pos, seed=r)
    latent = rms_norm(pool_oracle(a["kv"], a["score"]), a["norm_weight"], EPS)
    want_rows, want_keys = _expected(a, latent)
    rows0, keys0 = a["rows_pool"].clone(), a["keys_pool"].clone()
    pool_norm_rope_pack(**a)
    rows, keys = a["rows_pool"], a["keys_pool"]
    for i, (pg, sl) in enumerate(zip(a["page"].tolist(), a["slot"].tolist())):
        if pg < 0:
            continue
        assert torch.equal(rows[pg, sl], want_rows[i]), i
        assert torch.equal(keys[pg, sl], want_keys[i]), i
        rows0[pg, sl], keys0[pg, sl] = rows[pg, sl], keys[pg, sl]
    # nothing else written: the skipped groups (page -1) and every other entry keep the poison
    assert torch.equal(rows, rows0) and torch.equal(keys, keys0)
    # the case separates index keys of the pre-RoPE latent from keys of the post-RoPE one
    post = rms_norm(linear(apply_rope(latent, a["rot"]), a["index_wk"]), a["index_k_norm"], EPS)
    assert not torch.equal(pack_index_keys(apply_rope(post, a["rot"])), want_keys)


def test_pool_gate_softmax_is_per_channel_over_the_r_tokens():
    """Gate logits +-40 make the softmax one-hot in fp32 (e^-80 vanishes next to |kv| >= 1/4):
    channel c takes the kv of token c % 4 of its group, exactly, and the even channels of the
    second group an exact mean (equal logits). A softmax over channels, a gate shared by the
    channels or pooling without gates gives other latents."""
    r, D, n = 4, 32, 2
    a = _args(n, r, "tiny", 0, seed=0)
    g = torch.Generator().manual_seed(1)  # kv in +-{1..8}/4: never 0, where e^-80 * kv would show
    kv = torch.randint(1, 9, (n, r, D), generator=g).float() / 4 * \
        (1 - 2 * torch.randint(0, 2, (n, r, D), generator=g)).float()
    score = torch.full((n, r, D), -40.0)
    for c in range(D):
        score[:, c % r, c] = 40.0
    score[1, :, 0::2] = 0.0
    a.update(kv=kv, score=score, page=torch.tensor([0, 1]), slot=torch.tensor([2, 3]))
    pooled = torch.empty(n, D, dtype=F64)
    for c in range(D):  # plain per-channel selection / mean
        pooled[0, c] = kv[0, c % r, c].item()
        pooled[1, c] = kv[1, :, c].mean().item() if c % 2 == 0 else kv[1, c % r, c].item()
    latent = rms_norm(pooled.to(BF16), a["norm_weight"], EPS)
    want_rows, want_keys = _expected(a, latent)
    pool_norm_rope_pack(**a)
    assert torch.equal(a["rows_pool"][0, 2], want_rows[0])
    assert torch.equal(a["rows_pool"][1, 3], want_rows[1])
    assert torch.equal(a["keys_pool"][[0, 1], [2, 3]], want_keys)
    shared_gate = (kv * score[..., :1].softmax(1)).sum(1)
    for wrong in (kv.mean(1), (kv * score.softmax(-1)).sum(1), shared_gate):
        wrong_rows = _expected(a, rms_norm(wrong.to(BF16), a["norm_weight"], EPS))[0]
        assert not torch.equal(wrong_rows, want_rows)
