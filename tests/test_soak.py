"""The serving soak (dsv41attn/soak.py), short runs: every output equals the oracle's, and the
soak is not blind (an injected bit flip in a ring is reported)."""
import pytest
import torch

from dsv41attn.soak import soak


def test_soak_reference_backend_is_clean():
    fig = soak(max_steps=70, seed=1)
    assert fig.mismatches == 0, fig.first_mismatch
    assert fig.steps >= 70 and fig.rollbacks and fig.forks and fig.releases, fig.line()
    assert fig.failed_steps + fig.aborted_steps and fig.stale_refused, fig.line()


def test_soak_sees_an_injected_fault():
    fig = soak(max_steps=25, seed=2, inject="ring")
    assert fig.mismatches > 0, fig.line()


@pytest.mark.triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU state: runs under the interpreter only")
def test_soak_triton_backend_is_clean():
    pytest.importorskip("triton")
    fig = soak(max_steps=3, seed=3, backend="triton")
    assert fig.mismatches == 0, fig.first_mismatch
