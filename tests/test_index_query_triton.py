"""The index query's RoPE + fp4 fake quant kernel against its reference, bit for bit (runs under
TRITON_INTERPRET=1 on the CPU, compiled on a GPU)."""
import pytest
import torch

pytest.importorskip("triton")

import dsv41attn.ops.index_query.triton as T
from dsv41attn.config import preset
from dsv41attn.ops.common.rope import rope_frequencies, rope_rotations
from dsv41attn.ops.index_query.reference import rope_fp4_heads as reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _rot(cfg, n, start=0):
    layer = next(i for i in range(cfg.n_layers) if cfg.layer(i).is_index_source)
    freqs = rope_frequencies(cfg, cfg.layer(layer))
    return rope_rotations(freqs, torch.arange(start, start + n))


def _same(a, b):
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("name,n,start", [("tiny", 3, 0), ("v41-flash", 2, 70000)])
def test_matches_the_reference_bit_for_bit(name, n, start, monkeypatch):
    cfg = preset(name)
    h, d = cfg.index_n_heads, cfg.index_head_dim
    g = torch.Generator().manual_seed(n)
    q = (torch.randn(n, h, d, generator=g) * torch.logspace(-3, 2, h)[None, :, None]).bfloat16()
    rot = _rot(cfg, n, start)
    # an output element the kernel does not write stays NaN
    monkeypatch.setattr(T.torch, "empty", lambda *a, **k: torch.full(a, float("nan"), **k))
    got = T.rope_fp4_heads(q.to(DEV), rot.to(DEV)).cpu()
    assert _same(got, reference(q, rot))


def test_boundaries_ties_signs_and_odd_head_counts():
    """Heads not a multiple of the program's block; e2m1 ties at every rounding boundary; small
    negatives (-0); an all-zero block (the amax floor); tiny magnitudes near the scale floor."""
    d, r2, h, n = 64, 8, 5, 2
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75,
                         -2.5, -3.5, -5.0, -0.01])
    q = torch.zeros(n, h, d)
    q[:, 0, :16] = ties  # amax 6: s = 1, every tie exact
    q[:, 0, 16:32] = ties * 2.0 ** -20
    q[:, 1, :32] = -1e-3 * torch.arange(32)  # -0 from the first element
    # normal values under the amax floor 6 * 2^-126 (the interpreter misreads bf16 subnormals)
    q[:, 2, :32] = 2.0 ** -125 * (1 + torch.arange(32) / 31)
    q[:, 3] = torch.randn(d)  # head 4 stays zero (the floor, all outputs 0)
    q = q.bfloat16()
    rot = torch.polar(torch.ones(n, r2), torch.rand(n, r2))
    got = T.rope_fp4_heads(q.to(DEV), rot.to(DEV)).cpu()
    want = reference(q, rot)
    assert _same(got, want)
    assert (want[:, 1, 0].view(torch.int16) == -32768).all()  # -0 kept


def test_bad_arguments():
    def c64(*shape):
        return torch.ones(*shape, dtype=torch.complex64, device=DEV)

    q = torch.zeros(2, 3, 48, device=DEV).bfloat16()
    with pytest.raises(ValueError, match="D = 48 must be a power of two"):
        T.rope_fp4_heads(q, c64(2, 4))
    with pytest.raises(ValueError, match="bf16"):
        T.rope_fp4_heads(q.float(), c64(2, 4))
    with pytest.raises(ValueError, match="rot shape"):
        T.rope_fp4_heads(torch.zeros(2, 3, 64, device=DEV).bfloat16(), c64(3, 4))
    assert T.rope_fp4_heads(torch.zeros(0, 3, 64, device=DEV).bfloat16(),
                            c64(0, 4)).shape == (0, 3, 64)
