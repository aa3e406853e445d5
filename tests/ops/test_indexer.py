"""The indexer (ops/indexer/reference.py, SPEC §0.5, §4.4): index scores against float64,
visibility, top-k and candidate blocks against plain sorted() calls on (score, index) keys, and
the paged op ``index_topk`` (fp4 keys through the block table, per-query visibility, candidate
blocks, query tiles) against a dense recomputation."""
from __future__ import annotations

import pytest
import torch

from dsv41attn.ops.common.packing import pack_index_keys, unpack_index_keys
from dsv41attn.ops.common.quant import index_fp4_fake_quant
from dsv41attn.ops.indexer.reference import (
    candidate_blocks, expand_blocks, index_scores, index_topk, mask_invisible,
    select_candidate_blocks, select_topk, top_indices,
)

from .conftest import BF16, F32, F64

NINF = float("-inf")


@pytest.mark.parametrize("r", [1, 2], ids=lambda r: f"r{r}")
def test_mask_invisible_spec_rule(r):
    positions = list(range(0, 19))
    N = 19 // r + 1
    scores = torch.randn(2, len(positions), N, generator=torch.Generator().manual_seed(r)).to(BF16)
    visible = torch.tensor([[(P + 1) // r for P in positions]] * 2)
    out = mask_invisible(scores, visible)
    for i, P in enumerate(positions):
        L = (P + 1) // r  # SPEC §0.5: row e visible iff e < (P+1)//r
        assert torch.equal(out[:, i, :L], scores[:, i, :L])
        assert (out[:, i, L:] == NINF).all()


def topk_oracle(scores: torch.Tensor, visible: torch.Tensor, topk: int) -> torch.Tensor:
    B, M, N = scores.shape
    k = min(topk, N)
    out = []
    for b in range(B):
        rows = []
        for i in range(M):
            s = scores[b, i].tolist()
            best = sorted(range(N), key=lambda t: (-s[t], t))[:k]  # higher score, then lower t
            sel = sorted(best)
            L = int(visible[b, i])
            rows.append([t if t < L else -1 for t in sel])
        out.append(rows)
    return torch.tensor(out, dtype=torch.int32)


@pytest.mark.parametrize("topk,N", [(5, 13), (20, 13), (4, 4), (3, 29)],
                         ids=lambda v: str(v))
def test_select_topk_matches_oracle_with_ties(topk, N):
    g = torch.Generator().manual_seed(topk * 100 + N)
    B, M = 2, 9
    scores = torch.randint(0, 3, (B, M, N), generator=g).to(BF16)  # many exact ties
    visible = torch.randint(0, N + 1, (B, M), generator=g)
    visible[0, 0] = 0
    visible[0, 1] = N
    masked = mask_invisible(scores, visible)
    out = select_topk(masked, visible, topk)
    assert out.dtype == torch.int32 and out.shape == (B, M, min(topk, N))
    assert torch.equal(out, topk_oracle(masked, visible, topk))
    for row, L in zip(out.reshape(-1, out.shape[-1]).tolist(), visible.flatten().tolist()):
        valid = [t for t in row if t != -1]
        assert valid == sorted(valid) and all(t < L for t in valid)
        assert row == valid + [-1] * (len(row) - len(valid))  # -1s last
        assert len(valid) == min(L, len(row))


def test_select_topk_tie_prefers_lower_index():
    s = torch.tensor([[[1.0, 2.0, 2.0, 0.0, 2.0, 2.0]]], dtype=BF16)
    out = select_topk(s, torch.tensor([[6]]), 3)
    assert out.tolist() == [[[1, 2, 4]]]
    assert top_indices(s, 3).tolist() == [[[1, 2, 4]]]  # score order, ties to lower index


def candidates_oracle(scores, visible, topk_blocks, bs):
    B, M, N = scores.shape
    nblk = -(-N // bs)
    out = torch.zeros(B, M, N, dtype=torch.bool)
    for b in range(B):
        for i in range(M):
            s = scores[b, i].float().tolist() + [NINF] * (nblk * bs - N)
            bsc = [max(s[k * bs:(k + 1) * bs]) for k in range(nblk)]
            L = int(visible[b, i])
            if L > 0:
                bsc[(L - 1) // bs] = float("inf")
            picked = sorted(range(nblk), key=lambda k: (-bsc[k], k))[:min(topk_blocks, nblk)]
            for k in picked:
                if bsc[k] > NINF:
                    out[b, i, k * bs:min((k + 1) * bs, N)] = True
    return out


@pytest.mark.parametrize("N,bs,topk_blocks", [(29, 4, 3), (16, 8, 1), (40, 8, 2), (7, 3, 10)],
                         ids=lambda v: str(v))
def test_select_candidate_blocks_matches_oracle(N, bs, topk_blocks):
    g = torch.Generator().manual_seed(N * bs)
    B, M = 2, 11
    scores = torch.randint(-2, 3, (B, M, N), generator=g).to(BF16)
    visible = torch.randint(0, N + 1, (B, M), generator=g)
    visible[0, :4] = torch.tensor([0, 1, N, bs])
    masked = mask_invisible(scores, visible)
    c = select_candidate_blocks(masked, visible, topk_blocks, bs)
    assert c.dtype == torch.bool and c.shape == (B, M, N)
    assert torch.equal(c, candidates_oracle(masked, visible, topk_blocks, bs))


def test_candidate_blocks_named_cases():
    bs = 4
    # 3 full blocks + a partial block of 2 (N = 14); the newest visible block scores lowest
    s = torch.tensor([[5, 5, 5, 5, 9, 0, 0, 0, 7, 7, 7, 7, -3, -3]], dtype=F32)
    vis = torch.tensor([[14]])
    c = select_candidate_blocks(s.unsqueeze(0).to(BF16), vis, 2, bs)[0, 0].tolist()
    # pinned block 3 (rows 12-13) + best other block (block 1: max 9)
    assert c == [False] * 4 + [True] * 4 + [False] * 4 + [True] * 2
    # ties between blocks 0 and 2 (both max 5) -> the lower block id wins
    s2 = torch.tensor([[5, 0, 0, 0, 1, 1, 1, 1, 0, 5, 0, 0, 0, 0]], dtype=F32)
    c2 = select_candidate_blocks(s2.unsqueeze(0).to(BF16), vis, 2, bs)[0, 0].tolist()
    assert c2 == [True] * 4 + [False] * 8 + [True] * 2
    # visible = 0: nothing pinned, everything -inf -> nothing kept
    s3 = mask_invisible(torch.zeros(1, 1, 14, dtype=BF16), torch.tensor([[0]]))
    assert not select_candidate_blocks(s3, torch.tensor([[0]]), 4, bs).any()
    # visible = 5: blocks 2 and 3 are all -inf and must not be kept even with room for them
    s4 = mask_invisible(torch.ones(1, 1, 14, dtype=BF16), torch.tensor([[5]]))
    c4 = select_candidate_blocks(s4, torch.tensor([[5]]), 10, bs)[0, 0].tolist()
    assert c4 == [True] * 8 + [False] * 6


def index_scores_oracle(q, w, k):
    d = torch.einsum("bshd,btd->bsht", q.to(F64), k.to(F64))
    return (d.clamp_min(0) * w.to(F64).unsqueeze(-1)).sum(2)


@pytest.mark.parametrize("B,M,I,d,N", [(1, 3, 32, 128, 17), (2, 5, 4, 32, 9), (1, 2, 3, 64, 1)],
                         ids=["flash_heads", "tiny", "I3_N1"])
def test_index_scores_matches_float64(B, M, I, d, N):
    g = torch.Generator().manual_seed(I + N)
    q = index_fp4_fake_quant(torch.randn(B, M, I, d, generator=g).to(BF16))
    k = index_fp4_fake_quant(torch.randn(B, N, d, generator=g).to(BF16))
    w = (torch.randn(B, M, I, generator=g) / 64).to(BF16)  # signed head weights
    s = index_scores(q, w, k)
    assert s.dtype == BF16 and s.shape == (B, M, N)
    ref = index_scores_oracle(q, w, k)
    # each term carries ~2 bf16 roundings; scale the bound by the sum of |terms|
    mag = index_scores_oracle(q, w.abs(), k)
    assert ((s.to(F64) - ref).abs() <= 2e-2 * mag + 1e-6).all()


def test_index_scores_relu_per_head_before_weighting():
    d = 32
    k = torch.zeros(1, 1, d, dtype=BF16)
    k[0, 0, 0] = 1.0
    q = torch.zeros(1, 1, 3, d, dtype=BF16)
    q[0, 0, 0, 0] = -3.0  # dot -3: relu -> 0, even though its weight is negative
    q[0, 0, 1, 0] = 2.0   # dot 2, weight 1 -> 2
    q[0, 0, 2, 0] = -1.0  # dot -1, weight 1 -> 0 (summing before relu would give 2 - 1 - ...)
    w = torch.tensor([[[-1.0, 1.0, 1.0]]], dtype=BF16)
    assert index_scores(q, w, k).item() == 2.0
    w2 = torch.tensor([[[1.0, -0.5, 1.0]]], dtype=BF16)  # negative weight on a positive dot
    assert index_scores(q, w2, k).item() == -1.0


def _paged_setup(seqs=(5, 1, 7), n_rows=23, page_rows=4, heads=4, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    b = len(seqs)
    pages = -(-n_rows // page_rows)
    perm = torch.randperm(b * pages + 3, generator=g)[: b * pages]
    table = perm.view(b, pages)  # shuffled page ids, spare pages unused
    keys = index_fp4_fake_quant(torch.randn(b, n_rows, d, generator=g).bfloat16())
    pool = torch.zeros(b * pages + 3, page_rows, d // 2 + d // 32, dtype=torch.uint8)
    for s in range(b):
        for t in range(n_rows):
            pool[table[s, t // page_rows], t % page_rows] = pack_index_keys(keys[s, t])
    tokens = sum(seqs)
    q = index_fp4_fake_quant(torch.randn(tokens, heads, d, generator=g).bfloat16())
    w = (torch.randn(tokens, heads, generator=g) / 8).bfloat16()
    token_row = torch.tensor([s for s, m in enumerate(seqs) for _ in range(m)])
    visible = torch.randint(0, n_rows + 1, (tokens,), generator=g)
    visible[0] = 0  # a query that sees nothing
    groups = {}
    start = 0
    for s, m in enumerate(seqs):
        groups.setdefault(m, []).extend(range(start, start + m))
        start += m
    token_groups = [(m, torch.tensor(ids)) for m, ids in groups.items()]
    return q, w, pool, table, token_row, visible, token_groups, keys


@pytest.mark.parametrize("budget", [1, 1 << 30], ids=["one-query-tiles", "one-tile"])
@pytest.mark.parametrize("topk", [4, 30], ids=["k4", "k-above-rows"])
def test_index_topk_matches_dense(budget, topk):
    q, w, pool, table, token_row, visible, groups, keys = _paged_setup()
    sel, keep = index_topk(q, w, pool, table, token_row, visible, 23, topk, groups,
                           candidate_topk=2, block_size=3, score_budget=budget)
    assert torch.equal(unpack_index_keys(pool[table[1, 0], 1]), keys[1, 1])
    for t in range(q.shape[0]):
        s = mask_invisible(index_scores(q[t:t + 1, None], w[t:t + 1, None],
                                        keys[token_row[t]][None]), visible[t:t + 1, None])
        want_keep = candidate_blocks(s, visible[t:t + 1, None], 2, 3)
        assert torch.equal(keep[t], want_keep[0, 0]), t
        want = select_topk(s, visible[t:t + 1, None], topk)[0, 0]
        assert torch.equal(sel[t], want), t
    assert sel.shape == (q.shape[0], min(topk, 23))
    assert (sel[0] == -1).all()  # sees nothing: all pads
    valid = sel >= 0
    assert bool((sel[valid] < visible.unsqueeze(1).expand_as(sel)[valid]).all())


def test_index_topk_consumer_scores_only_kept_blocks():
    """A consumer masked by a source's kept blocks (3 blocks of 3 rows, top-4: as in the model,
    the kept blocks always hold enough rows) never selects a row outside them."""
    q, w, pool, table, token_row, visible, groups, keys = _paged_setup(seed=1)
    _, keep = index_topk(q.flip(0), w, pool, table, token_row, visible, 23, 4, groups,
                         candidate_topk=3, block_size=3)
    sel, none = index_topk(q, w, pool, table, token_row, visible, 23, 4, groups,
                           candidates=keep, block_size=3)
    assert none is None
    allowed = expand_blocks(keep, 3, 23)
    for t in range(q.shape[0]):
        picked = sel[t][sel[t] >= 0]
        assert picked.numel() == min(4, int(visible[t])), t
        assert bool(allowed[t, picked.long()].all()), t


def test_index_topk_unallocated_pages_read_zero_keys():
    q, w, pool, table, token_row, visible, groups, keys = _paged_setup(seed=2)
    table[:, -1] = -1  # the last page of every sequence was never allocated
    visible = torch.full_like(visible, 23)
    sel, _ = index_topk(q, w, pool, table, token_row, visible, 23, 23, groups)
    dense = keys.clone()
    dense[:, 20:] = 0
    for t in range(q.shape[0]):
        s = index_scores(q[t:t + 1, None], w[t:t + 1, None], dense[token_row[t]][None])
        assert torch.equal(sel[t], select_topk(s, visible[t:t + 1, None], 23)[0, 0])
