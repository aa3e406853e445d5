"""Triton sparse_attn against the reference (SPEC §4.5); runs under TRITON_INTERPRET=1 on CPU."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest
import torch

pytest.importorskip("triton")

from dsv41attn.ops.common.triton import interpreting
from dsv41attn.ops.sparse_attn.reference import sparse_attn as ref_attn
from dsv41attn.ops.sparse_attn.triton import sparse_attn as tri_attn

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module", autouse=True)
def _reference_math():
    """Under the interpreter tl.exp is numpy's exp, which differs from the reference's torch.exp
    in the last bit for about 40% of fp32 inputs, and tl.dot is numpy's fp32 matmul (a BLAS
    sgemm, not rounded once as the reference's float64 dots are); either flips an output's
    bf16 rounding now and then, depending on the CPU and the BLAS build. In this module they
    compute as the reference does, so the kernels' rounding points and block order compare bit
    for bit (the TRITON_INTERPRET mechanism itself is untouched)."""
    if not interpreting():
        yield
        return
    import numpy as np
    from triton.runtime import interpreter

    create_dot = interpreter.InterpreterBuilder.create_dot

    def torch_exp(x):
        return torch.from_numpy(np.array(x, copy=True)).exp().numpy()

    def rounded_once_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.data.dtype != np.float32 or b.data.dtype != np.float32 \
                or d.data.dtype != np.float32:  # only the fp32-held bf16 operands used here
            return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        ab = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64)).astype(np.float32)
        return interpreter.TensorHandle(ab + d.data, d.dtype.scalar)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(interpreter.InterpreterBuilder, "create_exp",
                   lambda self, arg: self.unary_op(arg, torch_exp))
        mp.setattr(interpreter.InterpreterBuilder, "create_dot", rounded_once_dot)
        yield
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
    if interpreting():  # same rounding points, so (nearly) bit-equal; a GPU's dot order may differ
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


# ---- sparse_attn_paged: one query per packed token, rows decoded from the packed caches -------

from dsv41attn.ops.common.packing import (
    pack_compressed_rows,
    pack_window_rows,
    unpack_compressed_rows,
    unpack_window_rows,
)
from dsv41attn.ops.sparse_attn.reference import sparse_attn_paged as ref_paged
from dsv41attn.ops.sparse_attn.triton import SPLIT_BLOCKS, _pick_splits, _wave_splits
from dsv41attn.ops.sparse_attn.triton import sparse_attn_paged as tri_paged

RING_B, RING_S = 3, 12  # the ring: 3 sequences x 12 slots


def make_step(t, h, d, ww, k, page_rows, sink_kind="rand", seed=0, b=RING_B, s=RING_S):
    """A step's packed inputs, as the reference's arguments after q, sink, scale (a dict): a ring
    of b sequences x s slots, the step's new rows, window ids mixing ring ids, new-row ids and
    -1 (holes, and 2 pads at the end of the window part, so in the middle of the list), a paged
    pool with a shuffled block table (a -1 column: no page), token_row spreading the tokens
    over the sequences, compressed ids with -1 holes and end pads, and one token (T // 2) whose
    lists are all -1."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, d, generator=g).bfloat16()
    sink = {"rand": torch.randn(h, generator=g), "mixed": torch.tensor(
        [(80.0, -80.0, 0.5)[j % 3] for j in range(h)])}[sink_kind].float()
    ring = pack_window_rows(torch.randn(b, s, d, generator=g).bfloat16())
    new_rows = pack_window_rows(torch.randn(t, d, generator=g).bfloat16())
    n_ring = b * s
    token_row = torch.randint(0, b, (t,), generator=g)
    token_row[: min(t, b)] = torch.randperm(b, generator=g)[: min(t, b)]  # every sequence
    wids = torch.where(torch.rand(t, ww, generator=g) < 0.5,
                       torch.randint(0, n_ring, (t, ww), generator=g),
                       n_ring + torch.randint(0, t, (t, ww), generator=g)).to(torch.int32)
    wids[torch.rand(t, ww, generator=g) < 0.2] = -1
    wids[:, ww - min(ww, 2):] = -1
    pages = max(1, -(-max(k, 1) * 2 // page_rows))  # rows 0 .. 2k-1 of each sequence
    n_pool = b * pages + 3  # a few pages no sequence holds
    pool = pack_compressed_rows(torch.randn(n_pool * page_rows, d, generator=g).bfloat16())
    pool = pool.view(n_pool, page_rows, -1)
    perm = torch.randperm(n_pool, generator=g)
    table = torch.cat([perm[: b * pages].view(b, pages), torch.full((b, 1), -1)], 1)
    cidx = torch.randint(0, pages * page_rows, (t, k), generator=g, dtype=torch.int32)
    cidx[torch.rand(t, k, generator=g) < 0.2] = -1
    cidx[:, k - min(k, 2):] = -1
    wids[t // 2] = -1
    cidx[t // 2] = -1
    if not k:
        pool = table = None
    args = {"window_ring": ring, "new_rows": new_rows, "window_ids": wids,
            "compressed_pool": pool, "block_table": table, "token_row": token_row,
            "compressed_idx": cidx}
    return q.to(DEV), sink.to(DEV), {n: v if v is None else v.to(DEV) for n, v in args.items()}


# (T, H, D, Ww, K, page_rows, splits); T odd, blocks that mix window and compressed rows
PAGED_CASES = [
    (7, 8, 32, 70, 30, 4, 1),
    (7, 8, 32, 70, 30, 4, 2),
    (7, 8, 32, 70, 30, 4, 3),
    (7, 17, 64, 5, 0, 4, 1),  # K = 0: window only
    (7, 17, 64, 5, 0, 4, 3),  # one block: splits 2, 3 have nothing to do
    (7, 16, 32, 0, 65, 8, 1),  # Ww = 0: compressed only
    (7, 16, 32, 0, 65, 8, 2),
    (63, 16, 32, 30, 30, 8, 1),  # T = 63 (the interpreter's cost is per program): one block
    (5, 8, 64, 64, 64, 8, 1),  # block edge exactly at the window's end
    (5, 8, 64, 64, 64, 8, None),  # the default: splits of SPLIT_BLOCKS blocks
    (3, 16, 128, 70, 200, 8, 1),  # D >= 128: rows decoded from int32 words; 3 blocks
    (3, 16, 128, 70, 200, 8, 3),  # ... of compressed rows, prefetched 1-3 blocks ahead
    (3, 8, 128, 128, 130, 16, 1),  # window blocks and 3 compressed ones, no mixed block
    (3, 16, 512, 40, 40, 4, 1),  # the model's head dim
    (3, 16, 512, 40, 40, 4, 2),
    (5, 8, 64, 20, 70, 6, 2),  # page_rows not a power of two: page and row by division
]


@pytest.mark.parametrize("t,h,d,ww,k,page_rows,splits", PAGED_CASES)
def test_paged_matches_reference(t, h, d, ww, k, page_rows, splits):
    q, sink, args = make_step(t, h, d, ww, k, page_rows, "mixed" if h > 8 else "rand",
                              seed=ww * 7 + k + h + t)
    scale = d ** -0.5
    ref = ref_paged(q, sink, scale, **args).float()
    out = torch.full_like(q, float("nan"))  # poison: every element must be written
    got = tri_paged(q, sink, scale, **args, out=out, num_splits=splits)
    assert got.data_ptr() == out.data_ptr() and got.dtype == torch.bfloat16
    got = got.float()
    assert not torch.isnan(got).any()
    assert torch.equal(got[t // 2], torch.zeros_like(got[t // 2]))  # empty list: exact 0
    err = (got - ref).norm() / ref.norm().clamp_min(1e-30)
    assert err <= 1e-2, f"relative error {err:.3e}"
    assert (got - ref).abs().max() <= 3e-2
    if interpreting() and splits == 1:  # the reference's rounding points and block order
        assert torch.equal(got, ref)


@pytest.mark.parametrize("t,h,d,ww,k,page_rows,r2", [
    (7, 8, 32, 70, 30, 4, 16),  # the whole head turns (R = D)
    (7, 17, 64, 5, 0, 4, 4),  # window only; 17 heads: a partial head block
    (3, 16, 512, 40, 40, 4, 32),  # the model's D and R: the tail inside the last 128 columns
    (3, 8, 256, 10, 70, 8, 1),  # one pair
])
@pytest.mark.parametrize("splits", [1, 2, 3, None])
def test_paged_out_rot_turns_the_output_back(t, h, d, ww, k, page_rows, r2, splits):
    """out_rot: the attention output with each head's last R dims turned back (step 6's inverse
    RoPE) by the split merge, or by rope_heads after an unsplit kernel: the same bits as
    rope_heads(inverse=True) on the plain output, every element written, the reference's
    out_rot alike."""
    from dsv41attn.ops.common.rope import apply_rope
    from dsv41attn.ops.common.triton import rope_heads

    q, sink, args = make_step(t, h, d, ww, k, page_rows, seed=t + d + r2)
    g = torch.Generator().manual_seed(d + r2)
    rot = torch.polar(torch.ones(t, r2), torch.rand(t, r2, generator=g) * 6.3).to(DEV)
    plain = tri_paged(q, sink, d ** -0.5, **args, num_splits=splits)
    out = torch.full_like(q, float("nan"))
    got = tri_paged(q, sink, d ** -0.5, **args, num_splits=splits, out=out, out_rot=rot)
    assert got.data_ptr() == out.data_ptr() and not torch.isnan(got.float()).any()
    assert torch.equal(got, rope_heads(plain, rot, inverse=True))
    assert not torch.equal(got[:, :, d - 2 * r2:], plain[:, :, d - 2 * r2:])
    assert torch.equal(got[:, :, :d - 2 * r2], plain[:, :, :d - 2 * r2])  # the nope dims
    ref = ref_paged(q.cpu(), sink.cpu(), d ** -0.5, **{n: v if v is None else v.cpu()
                                                      for n, v in args.items()},
                    out_rot=rot.cpu())
    assert torch.equal(ref, apply_rope(ref_paged(q.cpu(), sink.cpu(), d ** -0.5,
                                                 **{n: v if v is None else v.cpu()
                                                    for n, v in args.items()}),
                                       rot.cpu().unsqueeze(1), inverse=True))
    if interpreting() and splits == 1:
        assert torch.equal(got.cpu(), ref)
    with pytest.raises(ValueError, match="rot"):
        tri_paged(q, sink, 1.0, **args, out_rot=rot[:-1])


def test_paged_empty_step_gives_the_reference_signed_zeros():
    """A step in which no token has a list entry launches nothing: o = 0 turned back by
    out_rot, to the bit the reference's (its rotated zeros are -0 where cos and sin are both
    negative: an angle in every quadrant here), with and without a given out buffer."""
    q, sink, args = make_step(4, 8, 32, 0, 0, 4, seed=3)
    angles = torch.arange(4 * 8, dtype=torch.float32).view(4, 8) * 0.7  # every quadrant
    rot = torch.polar(torch.ones(4, 8), angles).to(DEV)
    ref = ref_paged(q.cpu(), sink.cpu(), 0.3, **{n: v if v is None else v.cpu()
                                                for n, v in args.items()}, out_rot=rot.cpu())
    assert (ref.view(torch.int16) == torch.tensor(-32768, dtype=torch.int16)).any()  # -0 there
    out = torch.full_like(q, float("nan"))
    for got in (tri_paged(q, sink, 0.3, **args, out_rot=rot),
                tri_paged(q, sink, 0.3, **args, out=out, out_rot=rot)):
        assert torch.equal(got.cpu().view(torch.int16), ref.view(torch.int16))
    assert not torch.equal(tri_paged(q, sink, 0.3, **args).cpu().view(torch.int16),
                           ref.view(torch.int16))  # unturned: +0 everywhere


def test_paged_decodes_every_code_exactly():
    """One entry per token, q = 0 and sink = -inf: o is the decoded row itself (p = 1), from
    the ring, from new_rows and from the pool through each token's block-table row."""
    g = torch.Generator().manual_seed(5)
    d, n = 64, 8
    codes = torch.arange(256, dtype=torch.uint8).view(4, d)
    codes[codes == 0x7F] = 0  # e4m3fn NaN codes: never written by the packers
    codes[codes == 0xFF] = 0x80
    exps = torch.randint(100, 160, (4, d // 32), generator=g, dtype=torch.uint8)
    rows = torch.cat([codes, exps], 1)  # [4, 66]
    ring = rows.view(2, 2, -1)  # B = 2 sequences x 2 slots
    pairs = torch.randint(0, 256, (n, d // 2), generator=g, dtype=torch.uint8)
    scales = torch.randint(0, 0x7F, (n, d // 16), generator=g, dtype=torch.uint8)  # all finite
    pool = torch.cat([pairs, scales], 1).view(4, 2, -1)  # 4 pages of 2 rows
    table = torch.tensor([[2, 0, 3, 1], [1, 3, 0, 2]])
    t = 2 * n  # token i < 4: ring row i; 4 <= i < 8: new row i; 8 + j: compressed row j
    new_rows = rows.flip(0).repeat(4, 1)  # [16, 66]
    token_row = torch.arange(t) % 2
    wids = torch.full((t, 1), -1, dtype=torch.int32)
    cidx = torch.full((t, 1), -1, dtype=torch.int32)
    wids[:8, 0] = torch.arange(8, dtype=torch.int32)  # 4..7: new rows 0..3 (ids >= B*S = 4)
    cidx[n:, 0] = torch.arange(n, dtype=torch.int32)
    q = torch.zeros(t, 2, d, dtype=torch.bfloat16)
    sink = torch.full((2,), float("-inf"))
    dev = [x.to(DEV) for x in (q, sink, ring, new_rows, wids, pool, table, token_row, cidx)]
    got = tri_paged(dev[0], dev[1], 1.0, *dev[2:]).cpu()
    comp = unpack_compressed_rows(pool[table[token_row[n:], torch.arange(n) // 2],
                                       torch.arange(n) % 2])
    want = torch.cat([unpack_window_rows(rows), unpack_window_rows(new_rows[:4]), comp])
    assert torch.equal(got, want.unsqueeze(1).expand(t, 2, d))


def test_paged_ring_read_in_place():
    """The ring as a view into a larger buffer (another layer's rows around it), new-row ids
    past the last row (read the last one, as the reference), expanded window ids (stride 0
    over tokens), block_h 32 and 64."""
    q, sink, args = make_step(7, 16, 32, 20, 30, 4, seed=11)
    ring = args["window_ring"]
    big = torch.randint(0, 256, (3 * RING_B, *ring.shape[1:]), dtype=torch.uint8, device=DEV)
    big[RING_B:2 * RING_B] = ring
    args["window_ring"] = big[RING_B:2 * RING_B]
    wids = args["window_ids"][:1].clone()
    wids[0, 3] = RING_B * RING_S + 7 + 5  # past new_rows' 7 rows
    args["window_ids"] = wids.expand(7, -1)
    ref = ref_paged(q, sink, 0.3, **args)
    for kw in ({}, {"block_h": 32}, {"block_h": 64, "num_splits": 2}, {"num_splits": 2}):
        got = tri_paged(q, sink, 0.3, **args, **kw)
        assert (got.float() - ref.float()).abs().max() <= 2e-2
        if interpreting() and kw.get("num_splits", 1) == 1:
            assert torch.equal(got, ref)


def test_paged_unaligned_rows():
    """Ring, new rows and pool in views that start off a 4-byte boundary (D >= 128 loads int32
    words): read in place by bytes instead, same result."""
    q, sink, args = make_step(3, 8, 128, 9, 20, 4, seed=13)
    ref = ref_paged(q, sink, 0.1, **args)

    def shifted(x):  # the same bytes one byte into a buffer
        return torch.cat([x.new_zeros(1), x.flatten()])[1:].view(x.shape)

    for name in ("window_ring", "new_rows", "compressed_pool"):
        args[name] = shifted(args[name])
        assert args[name].data_ptr() % 4
    got = tri_paged(q, sink, 0.1, **args)
    assert (got.float() - ref.float()).abs().max() <= 2e-2
    if interpreting():
        assert torch.equal(got, ref)


def test_paged_empty_lists_and_minus_inf_sink():
    q, sink, args = make_step(5, 8, 32, 4, 6, 4, seed=3)
    empty = torch.zeros_like(args["window_ids"][:, :0])
    none = {**args, "window_ids": empty, "compressed_idx": empty, "compressed_pool": None,
            "block_table": None}
    got = tri_paged(q, sink, 1.0, **none, out=torch.full_like(q, float("nan")))
    assert torch.equal(got, torch.zeros_like(q))
    sink[1] = float("-inf")  # with the all -1 token: 0 / 0 in the reference, 0 here
    for splits in (1, 2):
        got = tri_paged(q, sink, 1.0, **args, num_splits=splits).float()
        assert not torch.isnan(got).any() and torch.equal(got[2], torch.zeros_like(got[2]))
    sink = sink.clamp_min(-1e4)
    wids = torch.where(args["window_ids"] >= 0, args["window_ids"] % 5, -1)  # new rows 0..4
    ring0 = {**args, "window_ring": args["window_ring"][:0], "window_ids": wids}  # B*S = 0
    ring1 = {**args, "window_ring": args["window_ring"][:1],  # the same rows past a ring
             "window_ids": torch.where(wids >= 0, wids + RING_S, -1)}
    got = tri_paged(q, sink, 1.0, **ring0).float()
    ref = ref_paged(q, sink, 1.0, **ring1).float()
    assert (got - ref).abs().max() <= 2e-2
    if interpreting():
        assert torch.equal(got, ref)


def test_paged_rejects_bad_inputs():
    q, sink, args = make_step(3, 8, 32, 4, 6, 4, seed=1)
    good = {"q": q, "sink": sink, "scale": 1.0, **args}
    ring, wids, cidx = args["window_ring"], args["window_ids"], args["compressed_idx"]
    bad = [(TypeError, "q", {"q": q.float()}),
           (ValueError, "q", {"q": q[None]}),
           (ValueError, "q", {"q": q[..., :24]}),  # D not a power of two
           (ValueError, "sink", {"sink": sink[:1]}),
           (TypeError, "sink", {"sink": sink.double()}),
           (ValueError, "window_ring", {"window_ring": ring.flatten(0, 1)}),  # rank 2
           (ValueError, "window_ring", {"window_ring": ring[..., :-1]}),
           (TypeError, "window_ring", {"window_ring": ring.char()}),
           (ValueError, "window_ring", {"window_ring": ring.transpose(0, 1)}),  # not in place
           (ValueError, "new_rows", {"new_rows": args["new_rows"][:-1]}),
           (ValueError, "new_rows", {"new_rows": args["new_rows"][:, :-1]}),
           (TypeError, "window_ids", {"window_ids": wids.long()}),
           (ValueError, "window_ids", {"window_ids": wids[None]}),
           (ValueError, "window_ids", {"window_ids": wids[:-1]}),
           (TypeError, "token_row", {"token_row": args["token_row"].int()}),
           (ValueError, "token_row", {"token_row": args["token_row"][:-1]}),
           (TypeError, "compressed_idx", {"compressed_idx": cidx.long()}),
           (ValueError, "compressed_idx", {"compressed_idx": cidx[:-1]}),
           (ValueError, "compressed_pool", {"compressed_pool": None}),
           (ValueError, "compressed_pool", {"compressed_pool": args["compressed_pool"][..., :-2]}),
           (ValueError, "block_table", {"block_table": None}),
           (TypeError, "block_table", {"block_table": args["block_table"].int()}),
           (ValueError, "block_table", {"block_table": args["block_table"][0]}),
           (ValueError, "block_h", {"block_h": 24}),
           (ValueError, "num_splits", {"num_splits": 0}),
           (ValueError, "d_chunks", {"d_chunks": 3}),
           (ValueError, "d_chunks", {"d_chunks": 2}),  # D = 32: halves too narrow
           (ValueError, "out", {"out": torch.empty(3, 8, 16, dtype=torch.bfloat16)})]
    for exc, name, change in bad:
        with pytest.raises(exc, match=name):
            tri_paged(**{**good, **change})


def test_split_heuristic():
    """Splits of a fixed number of 64-blocks, whatever the step's token count."""
    assert _pick_splits(10, 1) == (10, 1)
    assert _pick_splits(10, 2) == (5, 2)
    assert _pick_splits(10, 3) == (4, 3)  # the last split shorter
    assert _pick_splits(1) == (1, SPLIT_BLOCKS)
    for n_blocks in range(1, 40, 3):
        for per in range(1, 6):
            s, got = _pick_splits(n_blocks, per)
            assert got == per and (s - 1) * per < n_blocks <= s * per  # none without a block
    # split_blocks=0: sized to the step (not call-invariant)
    assert _wave_splits(programs=4, n_blocks=10, sms=132) == 10  # decode: spread out
    assert _wave_splits(programs=32, n_blocks=10, sms=132) == 4  # one wave: 128 programs
    assert _wave_splits(programs=4 * 64, n_blocks=10, sms=132) == 1  # enough programs
    # a window alone (2 blocks): split for a few tokens, not for 64 (the partials' traffic)
    assert _wave_splits(programs=8, n_blocks=2, sms=132) == 2
    assert _wave_splits(programs=33, n_blocks=2, sms=132) == 2
    assert _wave_splits(programs=34, n_blocks=2, sms=132) == 1
    assert _wave_splits(programs=64, n_blocks=2, sms=132) == 1
    assert _wave_splits(programs=64, n_blocks=10, sms=132) == 2  # a long list still splits
    for programs in range(1, 140, 7):
        for n_blocks in range(1, 40, 3):
            s = _wave_splits(programs, n_blocks, 132)
            per = -(-n_blocks // s)
            assert 1 <= s <= n_blocks and -(-n_blocks // per) == s  # no split without a block
            assert s == 1 or programs * s <= 132


@pytest.mark.parametrize("split_blocks", [1, None])
def test_paged_token_bits_do_not_depend_on_the_call(split_blocks):
    """A token's output is the same in a step of 3 tokens as in one of 70 (a decode-sized and a
    prefill-sized step: T-dependent splitting would cut them differently), and with a wider
    compressed list (a batch-mate scanning more rows: -1 pads), for lists of 4 blocks cut into
    splits: the cut and the merge order follow the token's own list."""
    t, h, d, ww, k = 70, 16, 32, 70, 130
    q, sink, args = make_step(t, h, d, ww, k, 8, "mixed", seed=21)
    n_ring = RING_B * RING_S
    wids = args["window_ids"]
    args["window_ids"] = torch.where(wids >= n_ring + 3, -1, wids)  # new rows of tokens < 3
    few = {n: (v[:3] if n in ("new_rows", "window_ids", "token_row", "compressed_idx") else v)
           for n, v in args.items()}
    wide = dict(args, compressed_idx=torch.cat(
        [args["compressed_idx"], torch.full((t, 64), -1, dtype=torch.int32, device=DEV)], 1))
    kw = {"split_blocks": split_blocks}
    all_ = tri_paged(q, sink, d ** -0.5, **args, **kw)
    part = tri_paged(q[:3], sink, d ** -0.5, **few, **kw)
    wider = tri_paged(q, sink, d ** -0.5, **wide, **kw)
    assert torch.equal(part.view(torch.int16), all_[:3].view(torch.int16))
    assert torch.equal(wider.view(torch.int16), all_.view(torch.int16))
    ref = ref_paged(q[:3], sink, d ** -0.5, **few).float()
    assert (part.float() - ref).norm() / ref.norm() <= 1e-2
    if split_blocks is None:  # split_blocks=0: sized to the step, as close to the reference
        wave = tri_paged(q[:3], sink, d ** -0.5, **few, split_blocks=0).float()
        assert (wave - ref).norm() / ref.norm() <= 1e-2


@pytest.mark.parametrize("d,page_rows", [(64, 4), (256, 6)])
def test_paged_column_halves_same_bits(d, page_rows):
    """d_chunks=2 (a tile decoded and multiplied in two column halves, the logits one dot
    chained over them) gives the bits of d_chunks=1, unsplit and split, into a NaN-poisoned
    buffer; the byte path at D=64, int32 words at D=256 (halves of 128)."""
    q, sink, args = make_step(5, 16, d, 70, 100, page_rows, "mixed", seed=d + page_rows)
    sink[3] = float("-inf")
    for kw in ({"num_splits": 1}, {"num_splits": 3}, {"split_blocks": 0}, {}):
        one = tri_paged(q, sink, d ** -0.5, **args, **kw, d_chunks=1)
        out = torch.full_like(q, float("nan"))
        two = tri_paged(q, sink, d ** -0.5, **args, **kw, d_chunks=2, out=out)
        assert not torch.isnan(two).any()
        assert torch.equal(one.view(torch.int16), two.view(torch.int16)), kw
        assert torch.equal(two[2], torch.zeros_like(two[2]))  # the all -1 token


@pytest.mark.parametrize("ratio", [0, 1, 2])
def test_prefill_case_layout_and_kernel_bits(ratio):
    """bench's prefill case (``prefill_attn_case``) lays out a layer's prefill from position
    0: token p sees window positions max(0, p - W + 1) .. p (new rows, -1 pads last) and, in a
    compressed layer, min(k, (p + 1) // ratio) distinct complete compressed rows, ascending,
    -1 pads last (ratio 0: none, no pool); the kernel gives the reference's bits on it, with
    queries past the window and early queries with fewer visible rows than k."""
    from dsv41attn.bench import prefill_attn_case
    g = torch.Generator(device=DEV).manual_seed(ratio)
    window, k, tokens = 16, 8, 40
    args, valid = prefill_attn_case(tokens, 16, 64, window, k, ratio, device=DEV, generator=g,
                                    page_rows=8, chunk=16)
    q, sink, scale, ring, new_rows, widx, pool, table, token_row, cidx = args
    assert widx.shape == (tokens, window) and cidx.shape == (tokens, k if ratio else 0)
    assert (pool is None and table is None) == (ratio == 0)
    counted = 0
    for p in range(tokens):
        w = widx[p].tolist()
        first = max(0, p - window + 1)
        assert w == [window + s for s in range(first, p + 1)] + [-1] * (window - (p + 1 - first))
        c = [x for x in cidx[p].tolist() if x >= 0]
        vis = (p + 1) // ratio if ratio else 0
        assert len(c) == min(k, vis) and c == sorted(set(c)) and all(x < vis for x in c), (p, c)
        assert cidx[p].tolist()[len(c):] == [-1] * (cidx.shape[1] - len(c))
        counted += len(w) - w.count(-1) + len(c)
    assert valid == counted
    want = ref_paged(*args)
    got = tri_paged(*args)
    if ratio:
        assert torch.equal(got, want)
    else:  # a window alone: the kernel's row sums of p add in another order (a few last bits)
        assert (got.float() - want.float()).abs().max() <= 2e-3 and (got != want).sum() <= 8


def test_one_token_step_takes_16_head_tiles(monkeypatch):
    """A step of one token with splits sized to the step (split_blocks=0, the default mode's)
    runs 16-head tiles (more, smaller programs: faster at b=1 on an H100); any other call, or
    an explicit block_h, keeps the default tile (H up to 64). Either way within the
    reference's tolerance, every element written."""
    import dsv41attn.ops.sparse_attn.triton as S
    seen = []
    kernel = S._sparse_attn_paged_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*a, **kw):
                seen.append(kw["BLOCK_H"])
                return kernel[grid](*a, **kw)
            return launch
    monkeypatch.setattr(S, "_sparse_attn_paged_kernel", Spy())
    q, sink, args = make_step(3, 64, 64, 70, 100, 8, "mixed", seed=3)
    n_ring = RING_B * RING_S  # token 2 alone (token 1's lists are all -1), its ring rows
    q = q[2:]
    args = {n: (v[2:] if n in ("new_rows", "window_ids", "token_row", "compressed_idx")
                else v) for n, v in args.items()}
    args["window_ids"] = torch.where(args["window_ids"] >= n_ring, -1, args["window_ids"])
    ref = ref_paged(q, sink, 64 ** -0.5, **args).float()
    assert ref.abs().sum() > 0
    for kw, tile in (({"split_blocks": 0}, 16), ({}, 64), ({"split_blocks": 0, "block_h": 64}, 64)):
        out = torch.full_like(q, float("nan"))
        got = tri_paged(q, sink, 64 ** -0.5, **args, **kw, out=out).float()
        assert seen[-1] == tile, (kw, seen)
        assert not torch.isnan(got).any() and (got - ref).norm() / ref.norm() <= 1e-2, kw
    q2, sink2, args2 = make_step(2, 64, 64, 70, 100, 8, "mixed", seed=4)
    tri_paged(q2, sink2, 64 ** -0.5, **args2, split_blocks=0)
    assert seen[-1] == 64  # two tokens: the default tile


@pytest.mark.parametrize("block_d,stages", [(32, 8), (64, 1)])
def test_merge_tiles_and_depth_change_no_bit(block_d, stages, monkeypatch):
    """The split merge's tile width (MERGE_BLOCK_D) and its loop's pipeline depth
    (MERGE_STAGES) are launch choices only: with and without out_rot (the tail turned back
    inside a tile narrower than the rotated dims, and across tiles), 7 splits of a list, the
    same bits as the defaults'."""
    import dsv41attn.ops.sparse_attn.triton as AT
    t, h, d, r2 = 3, 16, 256, 32
    q, sink, args = make_step(t, h, d, 300, 140, 8, seed=11)
    g = torch.Generator().manual_seed(12)
    rot = torch.polar(torch.ones(t, r2), torch.rand(t, r2, generator=g) * 6.3).to(DEV)
    want = [tri_paged(q, sink, d ** -0.5, **args, num_splits=7, out_rot=r)
            for r in (None, rot)]
    monkeypatch.setattr(AT, "MERGE_BLOCK_D", block_d)
    monkeypatch.setattr(AT, "MERGE_STAGES", stages)
    for r, w in zip((None, rot), want):
        out = torch.full_like(q, float("nan"))
        got = tri_paged(q, sink, d ** -0.5, **args, num_splits=7, out=out, out_rot=r)
        assert got.data_ptr() == out.data_ptr() and torch.equal(got, w)
