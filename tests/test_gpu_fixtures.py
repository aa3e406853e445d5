"""Every golden fixture replayed on the GPU through the Triton backend, within the fixtures'
tolerances (the same bounds test_fixtures applies on the CPU). Needs CUDA and compiled
kernels; skipped elsewhere."""
import os

import pytest
import torch

from conftest import fixture_files
from dsv41attn.fixtures import Fixture, compare, replay
from test_fixtures import check_within_tolerances

pytestmark = pytest.mark.skipif(not torch.cuda.is_available()
                                or os.environ.get("TRITON_INTERPRET") == "1",
                                reason="needs a CUDA GPU with compiled Triton kernels")

FILES = fixture_files()


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["default", "batch_invariant"])
@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_fixture_replays_on_the_gpu(path, batch_invariant):
    fx = Fixture.load(str(path))
    results = replay(fx, fx.semantics, device="cuda", backend="triton",
                     stack=fx.stack("cuda", "triton", batch_invariant=batch_invariant))
    for sem in fx.semantics:
        c = compare(fx, {k: v.cpu() for k, v in results[sem].items()}, sem)
        bad, total = c["topk_rows"]
        errs = [e for *_, e in c["per_output"]]
        print(f"{path.stem} {sem} batch_invariant={batch_invariant}: top-k rows {bad}/{total}, max output error {max(errs):.2e}")
        check_within_tolerances(fx, c, sem)
