"""Conformance: every golden fixture (DeepSeek's reference outputs) replayed through the stack in
both index-key semantics, against the tolerances of the fixtures' README, and bit for bit.

The README's bar: tiny fixtures — identical top-k sets, every (step, layer) output relative
error <= 1e-1, median <= 1e-2, per layer <= 1.5e-2; V4.1 geometry — <= 1% of top-k rows
differing (left out of the errors), <= 2.5e-2 per output, median <= 1.5e-2, per layer <= 2e-2.
The reference path reproduces the fixtures' rounding points, so we also demand bit equality.
"""
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, fixture_files
from dsv41attn.fixtures import Fixture, compare, replay, tolerance_problems

FILES = fixture_files()
assert FILES, "no golden fixtures found"


@pytest.fixture(scope="module", ids=[f.stem for f in FILES], params=[
    pytest.param(f, marks=pytest.mark.slow) if f.stem == "v41_geometry" else f for f in FILES])
def replayed(request):
    fx = Fixture.load(str(request.param))
    return fx, replay(fx, fx.semantics)


def check_within_tolerances(fx: Fixture, c: dict, sem: str) -> None:
    """The fixture README's tolerances on a ``compare`` result (``fixtures.tolerances``)."""
    problems = tolerance_problems(fx, c, sem)
    assert not problems, problems


def test_fixture_within_readme_tolerances(replayed):
    fx, results = replayed
    for sem in fx.semantics:
        check_within_tolerances(fx, compare(fx, results[sem], sem), sem)


def test_fixture_bit_exact(replayed):
    """Same rounding points as the fixtures' reference run: every output bit and top-k equal."""
    fx, results = replayed
    for sem in fx.semantics:
        for layer in fx.layers:
            got = results[sem][f"out.{sem}.l{layer}"]
            exp = fx.expected(sem, layer)
            diff = int((got != exp).sum())
            assert diff == 0, f"{sem} layer {layer}: {diff} of {exp.numel()} values differ"
        c = compare(fx, results[sem], sem)
        assert c["topk_rows"][0] == 0


def test_semantics_are_distinguished(replayed):
    """The comparison can fail: each semantics' outputs miss the other's where they differ
    (the README: 32/272, 10/88 and 2/20 layer calls differ)."""
    fx, results = replayed
    if len(fx.semantics) < 2:
        pytest.skip("fixture has one semantics")
    differing = sum(
        not torch.equal(results["fixed"][f"out.fixed.l{L}"], fx.expected("reference", L))
        for L in fx.layers)
    assert differing > 0


def test_replay_cli_contract(tmp_path):
    """`python -m dsv41attn replay` writes out.{sem}.l{L} / topk.{sem}.l{L} in position order."""
    path = next(f for f in FILES if f.stem == "tiny_roles")
    out = tmp_path / "r.safetensors"
    subprocess.run([sys.executable, "-m", "dsv41attn", "replay", str(path), "--out", str(out),
                    "--semantics", "reference"], check=True, cwd=ROOT, capture_output=True)
    got = load_file(str(out))
    fx = Fixture.load(str(path))
    tokens = sum(t for _, t in fx.schedule)
    for layer in fx.layers:
        y = got[f"out.reference.l{layer}"]
        assert y.dtype == torch.bfloat16 and y.shape == (fx.batch, tokens, fx.config.dim)
        assert torch.equal(y, fx.expected("reference", layer))
    for layer in (1, 3, 5, 7):
        t = got[f"topk.reference.l{layer}"]
        assert t.dtype == torch.int32 and t.shape[:2] == (fx.batch, tokens)
        # step 0 (prefill of 13): the fixture stores g + 13.
        exp0 = fx.tensors[f"topk.reference.s0.l{layer}"]
        g = torch.where(exp0 >= 0, exp0 - 13, -1)
        assert torch.equal(t[:, :13, : g.shape[-1]].sort(-1).values, g.sort(-1).values)
    assert not any(k.startswith("topk") and k.endswith(("l0", "l2", "l4", "l6")) for k in got)


def test_triton_backend_replays_a_fixture(tmp_path, capsys):
    """The whole stack with the Triton backend (CPU interpreter here, compiled on a GPU), through
    the CLI's replay run in-process (test_replay_cli_contract runs `python -m dsv41attn`)."""
    pytest.importorskip("triton")
    import os

    from dsv41attn.cli import main
    path = next(f for f in FILES if f.stem == "tiny_long_prefill")
    out = tmp_path / "t.safetensors"
    device = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"  # the session's mode
    code = main(["replay", str(path), "--out", str(out), "--backend", "triton", "--device", device])
    assert code == 0, capsys.readouterr().err
    fx = Fixture.load(str(path))
    got = load_file(str(out))
    c = compare(fx, {k: v for k, v in got.items()}, "fixed")
    assert c["topk_rows"][0] == 0
    assert max(e for *_, e in c["per_output"]) <= 1e-1
    assert max(c["per_layer"].values()) <= 1.5e-2
