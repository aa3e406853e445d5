"""The reference sparse attention with sink (ops/sparse_attn/reference.sparse_attn, SPEC §4.5)
against a float64 softmax and a scalar re-enactment of the kernel's rounding points."""
from __future__ import annotations

import math

import pytest
import torch

from dsv41attn.ops.sparse_attn.reference import sparse_attn

from .conftest import BF16, F64, f32


def attn_oracle(q, kv, sink, idx, scale):
    """float64: o = sum_t e^{l_t} v_t / (sum_t e^{l_t} + e^{sink_h}); empty rows -> 0."""
    B, M, H, D = q.shape
    out = torch.zeros(B, M, H, D, dtype=F64)
    qd, kvd, sd = q.to(F64), kv.to(F64), sink.to(F64)
    for b in range(B):
        for i in range(M):
            ids = [t for t in idx[b, i].tolist() if t != -1]
            if not ids:
                continue
            rows = kvd[b, ids]  # [T, D]
            logits = scale * qd[b, i] @ rows.T  # [H, T]
            mx = torch.maximum(logits.max(-1).values, sd)
            e = torch.exp(logits - mx[:, None])
            out[b, i] = (e @ rows) / (e.sum(-1) + torch.exp(sd - mx))[:, None]
    return out


def rel_err(o: torch.Tensor, ref: torch.Tensor) -> float:
    """max |o - ref| over max |ref| per (b, i, h) vector; rows whose oracle is 0 must be 0."""
    num = (o.to(F64) - ref).abs().amax(-1)
    den = ref.abs().amax(-1)
    assert ((den > 0) | (num == 0)).all()
    return (num / den.clamp_min(1e-300)).max().item()


def make_attn(B, M, H, D, N, width, seed, sink_scale=1.0, q_scale=3.0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, M, H, D, generator=g) * q_scale).to(BF16)
    kv = torch.randn(B, N, D, generator=g).to(BF16)
    sink = torch.randn(H, generator=g) * sink_scale
    idx = torch.stack([torch.stack([torch.randperm(N, generator=g)[:width] for _ in range(M)])
                       for _ in range(B)]).to(torch.int32)
    return q, kv, sink, idx


ATTN_SHAPES = {
    "H5_D32_w20": (2, 3, 5, 32, 40, 20),
    "H7_D64_w150_crosses_two_blocks": (1, 2, 7, 64, 200, 150),
    "H3_D512_w64": (1, 2, 3, 512, 70, 64),
    "M70_more_than_64_queries": (1, 70, 3, 32, 30, 9),
}


@pytest.mark.parametrize("case", list(ATTN_SHAPES))
def test_sparse_attn_matches_softmax_with_sink(case):
    B, M, H, D, N, width = ATTN_SHAPES[case]
    q, kv, sink, idx = make_attn(B, M, H, D, N, width, seed=width)
    # punch -1 holes (not only at the end) into some rows
    g = torch.Generator().manual_seed(9)
    holes = torch.rand(idx.shape, generator=g) < 0.25
    idx = torch.where(holes, -1, idx)
    scale = D ** -0.5
    o = sparse_attn(q, kv, sink, idx, scale)
    assert o.dtype == BF16 and o.shape == q.shape
    assert rel_err(o, attn_oracle(q, kv, sink, idx, scale)) < 2e-2


def test_sparse_attn_empty_rows_give_exact_zero():
    q, kv, sink, idx = make_attn(1, 4, 5, 32, 16, 10, seed=1)
    idx[0, 1] = -1
    idx[0, 3] = -1
    sink = torch.tensor([-1e4, -50.0, 0.0, 50.0, 1e4])
    o = sparse_attn(q, kv, sink, idx, 32 ** -0.5)
    assert not torch.isnan(o).any()
    assert (o[0, 1] == 0).all() and (o[0, 3] == 0).all()
    assert rel_err(o[:, [0, 2]], attn_oracle(q, kv, sink, idx, 32 ** -0.5)[:, [0, 2]]) < 2e-2


@pytest.mark.parametrize("sink_value", [-1e4, -30.0, 0.0, 5.0, 30.0, 1e4],
                         ids=lambda s: f"sink{s:g}")
def test_sparse_attn_extreme_sinks(sink_value):
    q, kv, _, idx = make_attn(1, 3, 3, 64, 50, 40, seed=7)
    sink = torch.full((3,), sink_value)
    o = sparse_attn(q, kv, sink, idx, 64 ** -0.5)
    ref = attn_oracle(q, kv, sink, idx, 64 ** -0.5)
    assert not torch.isnan(o).any()
    if sink_value >= 1e3:  # e^{sink} swamps everything: the output is 0 in any precision
        assert (o == 0).all() and ref.abs().max() == 0
    else:
        assert rel_err(o, ref) < 2e-2


def test_sparse_attn_sink_is_unscaled_and_denominator_only():
    """One key with logit l and sink s: o = v * e^l / (e^l + e^s) — the sink is not multiplied by
    the softmax scale and adds no value. Choose l = 0 (q = 0): o = v / (1 + e^s)."""
    kv = torch.randn(1, 3, 32, generator=torch.Generator().manual_seed(6)).to(BF16)
    q = torch.zeros(1, 1, 2, 32, dtype=BF16)
    sink = torch.tensor([math.log(3.0), -100.0])
    idx = torch.tensor([[[2, -1, -1]]], dtype=torch.int32)
    o = sparse_attn(q, kv, sink, idx, 0.125)
    v = kv[0, 2].to(F64)
    assert ((o[0, 0, 0].to(F64) - v / 4).abs() <= 2.0 ** -8 * v.abs()).all()
    assert torch.equal(o[0, 0, 1], kv[0, 2])


def _bf16(v: float) -> float:
    return torch.tensor(v, dtype=F64).to(BF16).item()


def test_sparse_attn_rounding_points_exact():
    """Three keys, hand-simulated kernel (SPEC §4.5): fp32 logits, running max over logits only
    (not the sink), p = exp(l - M) in fp32, p rounded to bf16 for P.V but summed in fp32, the sink
    term added at the end, bf16 output. K = V, so the value of key t is its own row."""
    D = 32
    kv = torch.zeros(1, 3, D, dtype=BF16)
    kv[0, 1, 0], kv[0, 1, 1] = -0.1, 1.0   # l1 = bf16(-0.1) = -0.10009765625
    kv[0, 2, 0], kv[0, 2, 2] = -0.7, 1.0   # l2 = bf16(-0.69921875)
    q = torch.zeros(1, 1, 1, D, dtype=BF16)
    q[0, 0, 0, 0] = 1.0
    sink_v = 0.3
    o = sparse_attn(q, kv, torch.tensor([sink_v]), torch.tensor([[[0, 1, 2]]], dtype=torch.int32), 1.0)

    l = [0.0, kv[0, 1, 0].item(), kv[0, 2, 0].item()]

    def simulate(round_p: bool, sink_in_max: bool) -> list[float]:
        M = max(l + ([sink_v] if sink_in_max else []))
        p = [float(f32(math.exp(float(f32(t - M))))) for t in l]
        pv = [_bf16(x) if round_p else x for x in p]
        den = float(f32(f32(f32(p[0] + p[1]) + p[2]) + f32(math.exp(float(f32(sink_v - M))))))
        acc = [float(f32(pv[1] * 1.0)), float(f32(pv[2] * 1.0))]  # dims 1 and 2; dim 0 mixes
        return [_bf16(float(f32(a / den))) for a in acc]

    spec = simulate(True, False)
    assert spec != simulate(False, False)  # the case separates bf16 P from fp32 P...
    assert spec != simulate(True, True)  # ...and a running max that includes the sink
    assert [o[0, 0, 0, 1].item(), o[0, 0, 0, 2].item()] == spec


def kernel_sim(q_h: list[float], rows: list[list[float]], sink: float, scale: float,
               block: int) -> list[float]:
    """Scalar re-enactment of SPEC §4.5's kernel for one (query, head): blocks of ``block``
    entries in list order, fp32 logits, running max from -1e30 over logits, fp32 p summed in fp32,
    bf16(p) times V summed exactly then rounded to fp32 per block, fp32 rescaling, sink last."""
    run_max, run_sum, acc = f32(-1e30), f32(0), [f32(0)] * len(q_h)
    for j0 in range(0, len(rows), block):
        blk = rows[j0:j0 + block]
        logits = [f32(f32(math.fsum(a * b for a, b in zip(q_h, r))) * f32(scale)) for r in blk]
        new_max = max(run_max, max(logits))
        alpha = f32(math.exp(float(f32(run_max - new_max))))
        p = [f32(math.exp(float(f32(lg - new_max)))) for lg in logits]
        run_sum = f32(f32(run_sum * alpha) + f32(math.fsum(float(x) for x in p)))
        pb = [_bf16(float(x)) for x in p]
        for d in range(len(acc)):
            pv = f32(math.fsum(pb[t] * blk[t][d] for t in range(len(blk))))
            acc[d] = f32(f32(acc[d] * alpha) + pv)
        run_max = new_max
    run_sum = f32(run_sum + f32(math.exp(float(f32(f32(sink) - run_max)))))
    return [_bf16(float(f32(a / run_sum))) for a in acc]


def test_sparse_attn_64_blocks_exact():
    """150 entries (blocks 0-63, 64-127, 128-149) with the largest logits late in the list, so the
    running max moves between blocks and the bf16 rounding of p depends on the 64-blocking."""
    g = torch.Generator().manual_seed(8)
    D, N, H = 4, 160, 2
    q = (torch.randint(-8, 9, (1, 1, H, D), generator=g).float() / 4).to(BF16)  # exact dots
    kv = (torch.randint(-8, 9, (1, N, D), generator=g).float() / 8).to(BF16)
    q[..., 0] = 2.0
    kv[0, :, 0] = (torch.linspace(-1, 1, N) * 8).round() / 8  # logits grow along the list ...
    idx = torch.arange(N - 150, N, dtype=torch.int32).view(1, 1, 150)  # ... and are visited late
    sink = torch.tensor([0.7, -2.0])
    o = sparse_attn(q, kv, sink, idx, 0.5)
    rows = kv[0, N - 150:].to(F64).tolist()
    for h in range(H):
        qh = q[0, 0, h].to(F64).tolist()
        exp64 = kernel_sim(qh, rows, sink[h].item(), 0.5, 64)
        assert o[0, 0, h].tolist() == exp64, h
    alt = [kernel_sim(q[0, 0, h].to(F64).tolist(), rows, sink[h].item(), 0.5, 32) for h in range(H)]
    assert alt != [kernel_sim(q[0, 0, h].to(F64).tolist(), rows, sink[h].item(), 0.5, 64)
                   for h in range(H)]  # the case does separate 64-blocking from 32-blocking


def test_sparse_attn_permutation_and_duplicates():
    q, kv, sink, idx = make_attn(1, 4, 5, 64, 120, 100, seed=3)
    scale = 64 ** -0.5
    o = sparse_attn(q, kv, sink, idx, scale)
    g = torch.Generator().manual_seed(1)
    perm = torch.stack([torch.randperm(100, generator=g) for _ in range(4)])
    idx_p = torch.gather(idx[0], 1, perm).unsqueeze(0)
    o_p = sparse_attn(q, kv, sink, idx_p, scale)
    ref = attn_oracle(q, kv, sink, idx, scale)
    assert rel_err(o_p, ref) < 2e-2
    diff = (o_p.to(F64) - o.to(F64)).abs().amax(-1) / o.to(F64).abs().amax(-1)
    assert diff.max() < 2e-2
    # a duplicated index counts twice
    idx_d = idx.clone()
    idx_d[..., 90:] = idx_d[..., :10]
    o_d = sparse_attn(q, kv, sink, idx_d, scale)
    assert rel_err(o_d, attn_oracle(q, kv, sink, idx_d, scale)) < 2e-2


def test_sparse_attn_duplicate_counts_twice_exact_case():
    """All logits 0 (q = 0), sink -100: idx [a, b, b] gives (v_a + 2 v_b) / 3, not (v_a + v_b) / 2."""
    g = torch.Generator().manual_seed(2)
    kv = torch.randn(1, 4, 32, generator=g).to(BF16)
    q = torch.zeros(1, 1, 1, 32, dtype=BF16)
    idx = torch.tensor([[[1, 3, -1, 3]]], dtype=torch.int32)
    o = sparse_attn(q, kv, torch.tensor([-100.0]), idx, 0.1)[0, 0, 0].to(F64)
    ref = (kv[0, 1].to(F64) + 2 * kv[0, 3].to(F64)) / 3
    assert ((o - ref).abs() <= 2.0 ** -7 * ref.abs() + 1e-3).all()
