"""The command line under tensor parallelism: ``torchrun --nproc-per-node 2 -m dsv41attn ...
--tp 2 --device cpu`` (gloo), spawned by the tests. Rank 0 alone prints and writes; ``replay``
writes the same contract as at TP 1, within the fixture's tolerances; ``demo`` prints the same
table as at TP 1; ``--tp`` that torchrun did not start is one line and exit status 2; every
torchrun line of README.md is one of the commands run here."""
from __future__ import annotations

import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from conftest import fixture_files
from dsv41attn import cli
from dsv41attn.fixtures import Fixture, rel_err, tolerances
from test_cli import _blocks, _table, assert_one_line_error, run_cli

ROOT = Path(__file__).resolve().parent.parent
SMALLEST = min(fixture_files(), key=lambda f: f.stat().st_size)  # tiny_long_prefill
TIMEOUT_S = 180


def torchrun(argv: list[str], nproc: int = 2) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node nproc -m dsv41attn *argv`` from the repository root
    (``python -m torch.distributed.run``: the same launcher, found without PATH)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "-m", "dsv41attn", *argv]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)


def _errors(p: subprocess.CompletedProcess) -> str:
    """stderr without torchrun's own OMP_NUM_THREADS notice."""
    return "\n".join(line for line in p.stderr.splitlines() if "run.py" not in line
                     and not line.startswith(("*", "Setting OMP_NUM_THREADS")))


def assert_replays_agree(tp_file: Path, ref_file: Path, fixture: Fixture) -> dict:
    """A TP replay file against the TP-1 one: the same tensors, top-k equal, outputs within
    the fixture's tolerances (``fixtures.tolerances``: for the tiny fixtures <= 1e-1 per step
    and layer, median <= 1e-2, <= 1.5e-2 per layer)."""
    tol = tolerances(fixture.config)
    got, want = load_file(tp_file), load_file(ref_file)
    assert got.keys() == want.keys()
    bounds, pos = [], 0
    for _, tokens in fixture.schedule:
        bounds.append((pos, pos + tokens))
        pos += tokens
    per_output, per_layer = [], []
    for key, w in want.items():
        g = got[key]
        assert (g.dtype, g.shape) == (w.dtype, w.shape), key
        if key.startswith("topk."):
            assert torch.equal(g, w), key
            continue
        per_layer.append(rel_err(g, w))
        per_output += [rel_err(g[:, a:b], w[:, a:b]) for a, b in bounds]
    assert max(per_output) <= tol["output"], per_output
    assert statistics.median(per_output) <= tol["median"], per_output
    assert max(per_layer) <= tol["layer"], per_layer
    return {"max": max(per_output), "median": statistics.median(per_output)}


# The torchrun commands the tests run (and the README shows: test_readme_torchrun_commands).
TORCHRUN_REPLAY = ["replay", str(SMALLEST), "--out", "OUT", "--tp", "2", "--device", "cpu"]
TORCHRUN_DEMO = ["demo", "--tp", "2", "--device", "cpu"]
TORCHRUN_TPCHECK = ["tpcheck", "--tp", "2", "--config", "tiny", "--fixtures", str(SMALLEST)]


def test_replay_tp2_writes_the_tp1_contract_from_rank_0(capsys, tmp_path):
    out1, out2 = tmp_path / "tp1.safetensors", tmp_path / "tp2.safetensors"
    code, _, err = run_cli(capsys, ["replay", str(SMALLEST), "--out", str(out1)])
    assert code == 0, err
    p = torchrun([str(out2) if a == "OUT" else a for a in TORCHRUN_REPLAY])
    assert p.returncode == 0, _errors(p)
    assert p.stdout.count("wrote ") == 1 and "top-k rows differing 0/" in p.stdout, p.stdout
    assert_replays_agree(out2, out1, Fixture.load(str(SMALLEST)))
    with safe_open(str(out2), "pt") as f:
        meta = f.metadata()
    with safe_open(str(out1), "pt") as f:
        meta1 = f.metadata()
    assert meta.pop("tp") == "2" and meta1.pop("tp") == "1" and meta == meta1


def test_demo_tp2_prints_the_tp1_table_once(capsys):
    code, out1, err = run_cli(capsys, TORCHRUN_DEMO[:1])
    assert code == 0, err
    p = torchrun(TORCHRUN_DEMO)
    assert p.returncode == 0, _errors(p)
    assert p.stdout.count("layer role") == 1, p.stdout  # rank 0 alone prints
    assert "tensor parallel over 2 ranks (gloo)" in p.stdout
    read = re.search(r"per rank: rank 0 ([\d.]+) MiB, rank 1 ([\d.]+) MiB", p.stdout)
    assert read and read[1] == read[2], p.stdout  # each rank read its own half
    timing = ("prefill ms", "decode ms")
    rows = [{k: v for k, v in r.items() if k not in timing} for r in _table(out1).values()]
    assert [{k: v for k, v in r.items() if k not in timing}
            for r in _table(p.stdout).values()] == rows


def test_tpcheck_tp2_passes_and_prints_once():
    """tpcheck at TP 2 on the CPU: every role of tiny and the fixture within tolerances, rank
    0's report alone, exit 0."""
    p = torchrun(TORCHRUN_TPCHECK)
    assert p.returncode == 0, _errors(p) + p.stdout
    assert p.stdout.count("tensor-parallel check: 2 ranks (gloo)") == 1, p.stdout
    rows = re.findall(r"^ +(\d+)  (.+?) +(\S+e[-+]\d+)  (\S+)$", p.stdout, re.M)
    assert [int(r[0]) for r in rows] == [0, 1, 2, 3, 4, 5], p.stdout  # one layer per role
    assert all(r[3] in ("-", "0/47") for r in rows), rows
    assert p.stdout.count("within the fixture's tolerances") == 2, p.stdout  # both semantics
    assert p.stdout.rstrip().endswith("passed: every check within the fixtures' tolerances")


def test_tp_not_matching_torchrun_is_one_line_from_rank_0():
    p = torchrun(["demo", "--tp", "3", "--device", "cpu"])
    assert p.returncode != 0
    ours = [line for line in p.stderr.splitlines() if line.startswith("dsv41attn demo: error:")]
    assert ours == ["dsv41attn demo: error: --tp 3 does not match torchrun's WORLD_SIZE=2 "
                    "(--nproc-per-node times nodes): pass --tp 2, or start 3 processes"], p.stderr
    assert "exitcode  : 2" in p.stderr  # torchrun's report of rank 0's status


# ---- in one process: what is refused before any process group exists ------------------------

@pytest.mark.parametrize("command", [["demo"], ["replay", str(SMALLEST), "--out", "{tmp}/o"],
                                     ["tpcheck", "--config", "tiny"]])
def test_tp_without_torchrun_is_one_line_exit_2(capsys, monkeypatch, tmp_path, command):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in command] + ["--tp", "2"]
    code, _, err = run_cli(capsys, argv)
    assert_one_line_error(code, err, "--tp 2", "torchrun --nproc-per-node 2", "WORLD_SIZE")


@pytest.mark.parametrize("world,rank,names", [
    ("3", "0", ["--tp 2", "WORLD_SIZE=3"]),     # the launcher started another count
    # rank 1 leaves rank 0 time to say it (torchrun then stops rank 1); alone, as here, it
    # says it itself once the wait is over, with its rank
    ("2", "1", ["rank 1: --tp 3", "WORLD_SIZE=2"]),
    ("x", "0", ["WORLD_SIZE='x'"]),
])
def test_tp_against_the_torchrun_environment(capsys, monkeypatch, world, rank, names):
    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(cli, "TP_ERROR_GRACE_S", 0.2)
    t0 = time.monotonic()
    code, out, err = run_cli(capsys, ["demo", "--tp", "2" if world != "2" else "3"])
    assert_one_line_error(code, err, *names)
    assert out == ""
    if rank != "0":
        assert time.monotonic() - t0 >= 0.2  # it waited for rank 0 first


def test_tpcheck_needs_two_ranks_and_known_inputs(capsys, monkeypatch, tmp_path):
    """tpcheck refuses, in one line and before any process group: one rank (nothing to compare),
    an unknown config, a missing fixture."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    code, _, err = run_cli(capsys, ["tpcheck", "--config", "tiny"])
    assert_one_line_error(code, err, "torchrun --nproc-per-node N", "--tp N", "N >= 2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    code, _, err = run_cli(capsys, ["tpcheck", "--tp", "2", "--config", "huge"])
    assert_one_line_error(code, err, "--config 'huge'", "not a preset")
    code, _, err = run_cli(capsys, ["tpcheck", "--tp", "2", "--config", "tiny", "--fixtures",
                                    str(tmp_path / "none.safetensors")])
    assert_one_line_error(code, err, "none.safetensors", "no such file")
    assert not torch.distributed.is_initialized()


def test_a_world_size_the_heads_do_not_split_over_is_refused_before_starting(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")  # tiny: 8 heads, 2 groups, 4 index heads
    code, _, err = run_cli(capsys, ["demo", "--tp", "3"])
    assert_one_line_error(code, err, "3", "must divide")
    assert not torch.distributed.is_initialized()


# ---- README ----------------------------------------------------------------------------------

def _readme_torchrun() -> list[list[str]]:
    cmds = []
    for block in _blocks("sh"):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words[:1] == ["torchrun"]:
                cmds.append(words)
    return cmds


def _as_run(argv: list[str]) -> list[str]:
    """A command with its fixture named by file name and its --out value as OUT."""
    out = [Path(a).name if a.endswith(".safetensors") else a for a in argv]
    if "--out" in out:
        out[out.index("--out") + 1] = "OUT"
    return out


def test_readme_torchrun_commands():
    """Every torchrun line of the README's sh blocks is a command the tests above run (the
    fixture from either copy, --out to a temporary file), and both are there."""
    cmds = _readme_torchrun()
    tested = [_as_run(TORCHRUN_REPLAY), _as_run(TORCHRUN_DEMO), _as_run(TORCHRUN_TPCHECK)]
    for words in cmds:
        assert words[:5] == ["torchrun", "--nproc-per-node", "2", "-m", "dsv41attn"], words
        assert _as_run(words[5:]) in tested, words
        if words[5] == "replay":
            assert (ROOT / words[6]).is_file(), words
    assert {c[5] for c in cmds} == {"demo", "replay", "tpcheck"}
