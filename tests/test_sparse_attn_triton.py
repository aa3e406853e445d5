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
