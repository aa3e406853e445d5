"""Triton sparse_attn against the reference (SPEC §4.5); runs under TRITON_INTERPRET=1 on CPU."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest
import torch

pytest.importorskip("triton")

from dsv41attn.ops.sparse_attn.reference import sparse_attn as ref_attn
from dsv41attn.ops.sparse_attn.triton import _interpreting
from dsv41attn.ops.sparse_attn.triton import sparse_attn as tri_attn

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# an empty row computes exp(sink + 1e30) = inf on purpose (acc 0 / inf = 0)
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

# (B, M, H, D, W, N, sink kind)
CASES = [
    (1, 1, 1, 32, 1, 5, "rand"),
    (1, 1, 8, 32, 0, 5, "rand"),
    (2, 3, 3, 32, 7, 5, "big"),
    (1, 5, 17, 32, 64, 70, "rand"),
    (2, 3, 8, 64, 65, 70, "neg"),
    (1, 3, 17, 64, 130, 200, "rand"),
    (2, 1, 1, 64, 130, 200, "big"),
    (1, 5, 3, 32, 65, 200, "neg"),
    (2, 5, 16, 32, 7, 70, "mixed"),
    (1, 3, 8, 64, 1, 5, "mixed"),
    (2, 1, 17, 32, 130, 70, "mixed"),
    (1, 3, 1, 64, 64, 200, "rand"),
    (1, 2, 5, 128, 70, 70, "rand"),
    (1, 2, 3, 512, 65, 70, "mixed"),  # the model's head dim
]


def make_inputs(b, m, h, d, w, n, sink_kind, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, m, h, d, generator=g).bfloat16()
    kv = torch.randn(b, n, d, generator=g).bfloat16()
    sink = {"rand": torch.randn(h, generator=g),
            "big": torch.full((h,), 30.0),  # sink dominates: output near 0
            "neg": torch.full((h,), -1e4),  # sink negligible: plain softmax
            "mixed": torch.tensor([(80.0, -80.0, 0.5)[k % 3] for k in range(h)]),
            }[sink_kind].float()
    idx = torch.randint(0, n, (b, m, w), generator=g, dtype=torch.int32)
    idx[torch.rand(b, m, w, generator=g) < 0.2] = -1  # scattered holes
    if w:
        idx[..., -min(w, 3):] = -1  # -1 at row ends, as the window/compressed padding gives
        idx[0, m - 1] = -1  # one all -1 row
    return [t.to(DEV) for t in (q, kv, sink, idx)]


@pytest.mark.parametrize("b,m,h,d,w,n,sink_kind", CASES)
def test_matches_reference(b, m, h, d, w, n, sink_kind):
    q, kv, sink, idx = make_inputs(b, m, h, d, w, n, sink_kind, seed=b * 1000 + w * 10 + h)
    scale = d ** -0.5
    ref = ref_attn(q, kv, sink, idx, scale).float()
    out = torch.full_like(q, float("nan"))  # poison: every element must be written
    got = tri_attn(q, kv, sink, idx, scale, out=out)
    assert got.data_ptr() == out.data_ptr() and got.dtype == torch.bfloat16
    got = got.float()
    assert not torch.isnan(got).any()
    assert torch.equal(got[0, m - 1], torch.zeros_like(got[0, m - 1]))  # empty row: exact 0
    err = (got - ref).norm() / ref.norm().clamp_min(1e-30)
    assert err <= 1e-2 or ref.norm() == 0, f"relative error {err:.3e}"
    assert (got - ref).abs().max() <= 2e-2
    if _interpreting():  # same rounding points, so (nearly) bit-equal; a GPU's dot order may differ
        assert (got != ref).float().mean() <= 0.01


def test_allocates_and_handles_noncontiguous():
    q, kv, sink, idx = make_inputs(1, 3, 5, 32, 9, 20, "rand", seed=7)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # same values, other strides
    got = tri_attn(qt, kv, sink, idx, 32 ** -0.5)
    ref = ref_attn(q, kv, sink, idx, 32 ** -0.5)
    assert got.is_contiguous() and got.shape == q.shape
    assert (got.float() - ref.float()).abs().max() <= 2e-2


def test_rejects_bad_inputs():
    q, kv, sink, idx = make_inputs(1, 1, 2, 32, 4, 8, "rand", seed=1)
    with pytest.raises(TypeError):
        tri_attn(q.float(), kv, sink, idx, 1.0)
    with pytest.raises(TypeError):
        tri_attn(q, kv, sink, idx.long(), 1.0)
    with pytest.raises(ValueError):
        tri_attn(q[..., :24], kv[..., :24], sink, idx, 1.0)  # D not a power of two
    with pytest.raises(ValueError):
        tri_attn(q, kv, sink[:1], idx, 1.0)
    with pytest.raises(ValueError):
        tri_attn(q, kv, sink, idx, 1.0, out=torch.empty(1, 1, 2, 16, dtype=torch.bfloat16))


def test_empty_row_with_minus_inf_sink_is_zero():
    """0 / 0 here in the reference (NaN); the kernel keeps the rule "no valid entry -> 0"."""
    q, kv, sink, idx = make_inputs(1, 2, 3, 32, 9, 20, "rand", seed=3)
    sink[1] = float("-inf")
    got = tri_attn(q, kv, sink, idx, 32 ** -0.5).float()
    assert not torch.isnan(got).any() and torch.equal(got[0, 1], torch.zeros_like(got[0, 1]))
    ref = ref_attn(q, kv, sink, idx, 32 ** -0.5).float()
    assert (got[0, 0] - ref[0, 0]).abs().max() <= 2e-2


# ---- sparse_attn_paged: rows decoded in the kernel from the packed caches ---------------------

from dsv41attn.ops.common.packing import (
    pack_compressed_rows,
    pack_window_rows,
    unpack_compressed_rows,
    unpack_window_rows,
)
from dsv41attn.ops.sparse_attn.reference import sparse_attn_paged as ref_paged
from dsv41attn.ops.sparse_attn.triton import _pick_splits
from dsv41attn.ops.sparse_attn.triton import sparse_attn_paged as tri_paged


def make_paged(b, m, h, d, nw, ww, k, page_rows, sink_kind="rand", seed=0):
    """Packed window rows, a paged pool with a shuffled block table, lists with -1 holes and
    one all -1 row (query m-1 of sequence 0)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, m, h, d, generator=g).bfloat16()
    sink = {"rand": torch.randn(h, generator=g), "mixed": torch.tensor(
        [(80.0, -80.0, 0.5)[j % 3] for j in range(h)])}[sink_kind].float()
    window = pack_window_rows(torch.randn(b, nw, d, generator=g).bfloat16())
    pages = max(1, -(-max(k, 1) * 2 // page_rows))  # rows 0 .. 2k-1 of each sequence
    n_pool = b * pages + 3  # a few pages no sequence holds
    pool = pack_compressed_rows(torch.randn(n_pool * page_rows, d, generator=g).bfloat16())
    pool = pool.view(n_pool, page_rows, -1)
    perm = torch.randperm(n_pool, generator=g)
    table = torch.cat([perm[: b * pages].view(b, pages), torch.full((b, 1), -1)], 1)  # -1: none
    widx = torch.randint(0, nw, (b, m, ww), generator=g, dtype=torch.int32)
    widx[torch.rand(b, m, ww, generator=g) < 0.2] = -1
    cidx = torch.randint(0, pages * page_rows, (b, m, k), generator=g, dtype=torch.int32)
    cidx[torch.rand(b, m, k, generator=g) < 0.2] = -1
    widx[0, m - 1] = -1
    cidx[0, m - 1] = -1
    if not k:
        pool = table = None
    return [t if t is None else t.to(DEV) for t in (q, sink, window, widx, pool, table, cidx)]


# (B, M, H, D, Nw, Ww, K, page_rows, splits): 64-blocks that mix window and compressed rows
PAGED_CASES = [
    (2, 3, 8, 32, 20, 70, 30, 4, 1),
    (2, 3, 8, 32, 20, 70, 30, 4, 2),
    (2, 3, 8, 32, 20, 70, 30, 4, 3),
    (1, 2, 17, 64, 10, 5, 0, 4, 1),
    (1, 2, 17, 64, 10, 5, 0, 4, 3),  # one block: splits 2, 3 have nothing to do
    (2, 2, 1, 32, 6, 0, 65, 8, 1),
    (2, 2, 1, 32, 6, 0, 65, 8, 2),
    (1, 3, 17, 32, 40, 100, 100, 16, 3),
    (2, 1, 8, 64, 30, 64, 64, 8, 1),  # block edge exactly at the window's end
    (2, 1, 8, 64, 30, 64, 64, 8, None),  # decode: the heuristic splits
    (1, 2, 1, 64, 8, 1, 130, 4, 2),
    (1, 2, 5, 128, 40, 70, 200, 8, 1),  # D >= 128: rows decoded from int32 words; 3 blocks
    (1, 2, 5, 128, 40, 70, 200, 8, 3),  # ... of compressed rows, prefetched 1-3 blocks ahead
    (2, 1, 3, 128, 130, 128, 260, 16, 1),  # window blocks and 5 compressed ones, no mixed block
    (1, 2, 3, 512, 20, 40, 40, 4, 2),  # the model's head dim (slow under the interpreter)
]


@pytest.mark.parametrize("b,m,h,d,nw,ww,k,page_rows,splits", PAGED_CASES)
def test_paged_matches_reference(b, m, h, d, nw, ww, k, page_rows, splits):
    args = make_paged(b, m, h, d, nw, ww, k, page_rows, "mixed" if h > 8 else "rand",
                      seed=ww * 7 + k + h)
    q, sink = args[:2]
    scale = d ** -0.5
    ref = ref_paged(q, sink, scale, *args[2:]).float()
    out = torch.full_like(q, float("nan"))  # poison: every element must be written
    got = tri_paged(q, sink, scale, *args[2:], out=out, num_splits=splits)
    assert got.data_ptr() == out.data_ptr() and got.dtype == torch.bfloat16
    got = got.float()
    assert not torch.isnan(got).any()
    assert torch.equal(got[0, m - 1], torch.zeros_like(got[0, m - 1]))  # empty row: exact 0
    err = (got - ref).norm() / ref.norm().clamp_min(1e-30)
    assert err <= 1e-2, f"relative error {err:.3e}"
    assert (got - ref).abs().max() <= 3e-2
    if _interpreting() and splits == 1:  # the reference's rounding points and block order
        assert torch.equal(got, ref)


def test_paged_decodes_every_code_exactly():
    """One entry per query, q = 0 and sink = -inf: o is the decoded row itself (p = 1)."""
    g = torch.Generator().manual_seed(5)
    d, n = 64, 8
    codes = torch.arange(256, dtype=torch.uint8).view(4, d)
    codes[codes == 0x7F] = 0  # e4m3fn NaN codes: never written by the packers
    codes[codes == 0xFF] = 0x80
    exps = torch.randint(100, 160, (4, d // 32), generator=g, dtype=torch.uint8)
    window = torch.cat([codes, exps], 1).repeat(2, 1).unsqueeze(0)  # [1, 8, 66]
    pairs = torch.randint(0, 256, (n, d // 2), generator=g, dtype=torch.uint8)
    scales = torch.randint(0, 0x7F, (n, d // 16), generator=g, dtype=torch.uint8)  # all finite
    pool = torch.cat([pairs, scales], 1).view(4, 2, -1)  # 4 pages of 2 rows
    table = torch.tensor([[2, 0, 3, 1]])
    m = 2 * n  # query i < n: window row i; query n + j: compressed row j
    widx = torch.full((1, m, 1), -1, dtype=torch.int32)
    cidx = torch.full((1, m, 1), -1, dtype=torch.int32)
    widx[0, :n, 0] = torch.arange(n, dtype=torch.int32)
    cidx[0, n:, 0] = torch.arange(n, dtype=torch.int32)
    q = torch.zeros(1, m, 2, d, dtype=torch.bfloat16)
    sink = torch.full((2,), float("-inf"))
    args = [t.to(DEV) for t in (q, sink, window, widx, pool, table, cidx)]
    got = tri_paged(args[0], args[1], 1.0, *args[2:]).cpu()
    comp = unpack_compressed_rows(pool[table[0].long()].view(n, -1))  # row g in order
    want = torch.cat([unpack_window_rows(window[0]), comp]).unsqueeze(1).expand(m, 2, d)
    assert torch.equal(got[0], want)


def test_paged_expanded_lists_and_block_h():
    """Index lists with stride-0 batch dims (the layer expands its window list); BLOCK_H 32, 64."""
    q, sink, window, widx, pool, table, cidx = make_paged(2, 3, 5, 32, 12, 9, 20, 4, seed=11)
    widx = widx[:1].expand(2, -1, -1)
    ref = ref_paged(q, sink, 0.3, window, widx, pool, table, cidx).float()
    for kw in ({}, {"block_h": 32}, {"block_h": 64, "num_splits": 2}, {"num_splits": 2}):
        got = tri_paged(q, sink, 0.3, window, widx, pool, table, cidx, **kw).float()
        assert (got - ref).abs().max() <= 2e-2


def test_paged_unaligned_rows():
    """Packed rows in views that start off a 4-byte boundary (D >= 128 loads int32 words)."""
    q, sink, window, widx, pool, table, cidx = make_paged(1, 2, 3, 128, 12, 9, 20, 4, seed=13)
    ref = ref_paged(q, sink, 0.1, window, widx, pool, table, cidx)

    def shifted(t):  # the same bytes one byte into a buffer
        return torch.cat([t.new_zeros(1), t.flatten()])[1:].view(t.shape)

    window, pool = shifted(window), shifted(pool)
    assert window.data_ptr() % 4 and pool.data_ptr() % 4
    got = tri_paged(q, sink, 0.1, window, widx, pool, table, cidx)
    assert (got.float() - ref.float()).abs().max() <= 2e-2
    if _interpreting():
        assert torch.equal(got, ref)


def test_paged_empty_lists_and_minus_inf_sink():
    q, sink, window, widx, pool, table, cidx = make_paged(1, 2, 3, 32, 5, 4, 6, 4, seed=3)
    empty = torch.zeros_like(widx[..., :0])
    got = tri_paged(q, sink, 1.0, window, empty, None, None, empty)
    assert torch.equal(got, torch.zeros_like(q))
    sink[1] = float("-inf")  # with the all -1 row: 0 / 0 in the reference, 0 here
    got = tri_paged(q, sink, 1.0, window, widx, pool, table, cidx, num_splits=2).float()
    assert not torch.isnan(got).any() and torch.equal(got[0, 1], torch.zeros_like(got[0, 1]))


def test_paged_rejects_bad_inputs():
    q, sink, window, widx, pool, table, cidx = make_paged(1, 1, 2, 32, 5, 4, 6, 4, seed=1)
    good = {"q": q, "sink": sink, "scale": 1.0, "window_rows": window, "window_idx": widx,
            "compressed_pool": pool, "block_table": table, "compressed_idx": cidx}
    bad = [(TypeError, {"q": q.float()}), (TypeError, {"window_idx": widx.long()}),
           (TypeError, {"block_table": table.int()}), (TypeError, {"window_rows": window.char()}),
           (ValueError, {"window_rows": window[..., :-1]}), (ValueError, {"sink": sink[:1]}),
           (ValueError, {"compressed_pool": None}), (ValueError, {"compressed_idx": cidx[0]}),
           (ValueError, {"compressed_pool": pool[..., :-2]})]
    for exc, change in bad:
        with pytest.raises(exc):
            tri_paged(**{**good, **change})
    with pytest.raises(ValueError):
        tri_paged(**good, block_h=24)
    with pytest.raises(ValueError):
        tri_paged(**good, out=torch.empty(1, 1, 2, 16, dtype=torch.bfloat16))


def test_split_heuristic():
    assert _pick_splits(programs=4, n_blocks=10, m=1, sms=132) == 10  # decode: spread out
    assert _pick_splits(programs=32, n_blocks=10, m=1, sms=132) == 4  # one wave: 128 programs
    assert _pick_splits(programs=4 * 64, n_blocks=10, m=1, sms=132) == 1  # enough programs
    assert _pick_splits(programs=4 * 64, n_blocks=10, m=64, sms=132) == 1  # prefill
    assert _pick_splits(programs=1, n_blocks=1, m=1, sms=132) == 1
    for programs in range(1, 140, 7):
        for n_blocks in range(1, 40, 3):
            s = _pick_splits(programs, n_blocks, 1, 132)
            per = -(-n_blocks // s)
            assert 1 <= s <= n_blocks and -(-n_blocks // per) == s  # no split without a block
            assert s == 1 or programs * s <= 132
