"""The command line, run in-process through ``main``: every user error is one line on stderr
and exit status 2 naming the bad value; ``demo``'s top-k column counts the rows the last token
selected; ``--checkpoint DIR`` reads DIR's config.json; and every Python snippet and CPU
command of README.md runs as written, so the README cannot go stale."""
from __future__ import annotations

import argparse
import importlib.util
import json
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest
import torch

from dsv41attn import AttentionStack, preset, random_layer_weights, write_synthetic_checkpoint
from dsv41attn.cli import CliError, build_parser, main

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
TINY_ROLES = str(ROOT / "tests" / "fixtures" / "tiny_roles.safetensors")


def run_cli(capsys, argv: list[str]) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``main(argv)``."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str, *names: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("dsv41attn") and ": error: " in lines[0], err
    for name in names:
        assert name in lines[0], (name, err)


# ---- errors --------------------------------------------------------------------------------

ERRORS = [  # (argv, strings the message must contain); {tmp} is a fresh directory
    (["replay", "{tmp}/nope.safetensors", "--out", "{tmp}/o.safetensors"], ["nope.safetensors"]),
    (["replay", str(README), "--out", "{tmp}/o.safetensors"], ["README.md", "safetensors"]),
    (["replay", TINY_ROLES, "--out", "{tmp}/missing/o.safetensors"], ["missing"]),
    (["replay", TINY_ROLES, "--out", "{tmp}"], ["--out", "directory"]),
    (["replay", TINY_ROLES, "--out", "{tmp}/o.safetensors", "--schedule", "13,1,1,4;7,6,1,1,1"],
     ["'13,1,1,4;7,6,1,1,1'", "46"]),
    (["replay", TINY_ROLES, "--out", "{tmp}/o.safetensors", "--schedule", "13,x"], ["'13,x'"]),
    (["replay", TINY_ROLES, "--out", "{tmp}/o.safetensors", "--schedule", "46;5,5,5,5,5,5,5,5,6",
      "--semantics", "reference"], ["reference", "46;5,5,5,5,5,5,5,5,6"]),
    (["demo", "--tokens", "0"], ["--tokens", "'0'"]),
    (["demo", "--batch", "0"], ["--batch", "'0'"]),
    (["demo", "--decode-steps", "-1"], ["--decode-steps", "'-1'"]),
    (["demo", "--tokens", "x"], ["--tokens", "'x'"]),
    (["demo", "--tokens", "5000"], ["5000", "max_position_embeddings", "4096", "--max-seq-len"]),
    (["demo", "--layers", "0,x"], ["'x'"]),
    (["demo", "--layers", "5-3"], ["5-3"]),
    (["demo", "--layers", "8"], ["[8]", "0..7"]),
    (["demo", "--config", "nope"], ["'nope'", "tiny", "v41-flash"]),
    (["demo", "--checkpoint", "{tmp}/nope"], ["nope"]),
    (["demo", "--checkpoint", str(README)], ["README.md"]),
    (["demo", "--device", "nope"], ["'nope'"]),
    (["demo", "--backend", "nope"], ["'nope'"]),
    (["demo", "--batch-invariant"], ["--batch-invariant", "--backend triton", "reference"]),
    (["replay", TINY_ROLES, "--out", "{tmp}/o.safetensors", "--batch-invariant"],
     ["--batch-invariant", "--backend triton"]),
    (["plot", "{tmp}/nope.csv", "{tmp}/x.png"], ["nope.csv"]),
    (["bench", "--variant", "x:layer.NOPE=1"], ["--variant", "NOPE", "dsv41attn.layer"]),
    (["bench", "--variant", "x:ops.linear.triton.SPLIT_MAX_M=lots"],
     ["--variant", "'lots'", "int"]),
    (["bench", "--part", "layers", "--variant", "a", "--variant",
      "a:ops.linear.triton.SPLIT_MAX_M=1"],
     ["--variant", "['a', 'a']"]),
    (["bench", "--variant", "a", "--variant-rounds", "0"], ["--variant-rounds", "'0'"]),
    (["bench", "--variant", "a", "--part", "indexer"], ["--variant", "sparse_attn"]),
    (["bench", "--part", "layers", "--rows", "64"], ["--rows", "layers"]),
    (["bench", "--part", "gemm", "--rows", "1,0"], ["--rows", "'1,0'"]),
    (["bench", "--part", "indexer", "--csv", "{tmp}/x.csv"], ["--csv", "indexer"]),
    (["frob"], ["'frob'"]),
    ([], ["COMMAND"]),
]


@pytest.mark.parametrize("argv,names", ERRORS, ids=[" ".join(a[:4]) for a, _ in ERRORS])
def test_errors_are_one_line_exit_2(capsys, tmp_path, argv, names):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    code, _, err = run_cli(capsys, argv)
    assert_one_line_error(code, err, *names)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this torch has CUDA")
@pytest.mark.parametrize("argv", [["demo", "--device", "cuda"], ["bench", "--quick"]])
def test_cuda_on_a_cpu_torch(capsys, argv):
    code, _, err = run_cli(capsys, argv)
    assert_one_line_error(code, err, "cuda" if "--device" in argv else "CUDA")


def test_triton_on_the_cpu_without_the_interpreter(capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    code, _, err = run_cli(capsys, ["demo", "--backend", "triton", "--device", "cpu"])
    assert_one_line_error(code, err, "triton")


def test_unreadable_checkpoint_shard(capsys, tmp_path):
    write_synthetic_checkpoint(tmp_path, preset("tiny"), layers=[0])
    (shard,) = tmp_path.glob("model-*.safetensors")
    shard.write_bytes(b"\0\0\0")  # truncated: not even a header length
    code, _, err = run_cli(capsys, ["demo", "--checkpoint", str(tmp_path), "--layers", "0"])
    assert_one_line_error(code, err, str(tmp_path))


def test_debug_shows_the_exception(capsys, monkeypatch):
    with pytest.raises(CliError, match="5000"):
        main(["demo", "--tokens", "5000", "--debug"])
    monkeypatch.setenv("DSV41ATTN_DEBUG", "1")
    with pytest.raises(CliError, match="'nope'"):
        main(["demo", "--config", "nope"])


def test_module_entry_point_exit_status(capsys, monkeypatch):
    """``python -m dsv41attn`` exits with main's status."""
    monkeypatch.setattr(sys, "argv", ["dsv41attn", "demo", "--layers", "5-3"])
    with pytest.raises(SystemExit) as e:
        runpy.run_module("dsv41attn", run_name="__main__")
    assert_one_line_error(e.value.code, capsys.readouterr().err, "5-3")


def test_checkpoint_config_json_stands_for_its_directory(capsys, tmp_path):
    write_synthetic_checkpoint(tmp_path, preset("tiny"), layers=[0])
    code, out, err = run_cli(capsys, ["demo", "--checkpoint", str(tmp_path / "config.json"),
                                      "--layers", "0", "--tokens", "3", "--decode-steps", "0"])
    assert code == 0, err
    assert sorted(_table(out)) == [0]
    other = tmp_path / "generation_config.json"
    other.write_text("{}")
    code, _, err = run_cli(capsys, ["demo", "--checkpoint", str(other)])
    assert_one_line_error(code, err, "generation_config.json", "--config")


# ---- env, --version ------------------------------------------------------------------------

def test_version(capsys):
    import dsv41attn

    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", dsv41attn.__version__), dsv41attn.__version__
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'version = "{dsv41attn.__version__}"' in pyproject  # one version, written once
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"dsv41attn {dsv41attn.__version__}"


def test_version_falls_back_to_pyproject(monkeypatch):
    import importlib.metadata

    import dsv41attn

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert dsv41attn._version() == dsv41attn.__version__


def test_env_reports_what_a_bug_report_needs(capsys, monkeypatch):
    import dsv41attn

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    code, out, err = run_cli(capsys, ["env"])
    assert code == 0, err
    lines = dict(line.split(":", 1) for line in out.splitlines())
    for key in ("dsv41attn", "python", "torch", "triton", "numpy", "safetensors", "CUDA", "GPU",
                "Triton kernels", "sparse attention", "TRITON_INTERPRET",
                "reference CPU kernels"):
        assert key in lines, (key, out)
    assert "golden fixtures'" in lines["reference CPU kernels"]  # the suite's process pins them
    assert dsv41attn.__version__ in lines["dsv41attn"]
    assert str(Path(dsv41attn.__file__).parent) in lines["dsv41attn"]  # the install path
    assert torch.__version__ in lines["torch"]
    assert sys.version.split()[0] in lines["python"]
    if importlib.util.find_spec("triton") is not None:
        assert "interpreted" in lines["Triton kernels"]
        if not torch.cuda.is_available():  # the Gluon kernel runs on a Hopper GPU only
            assert lines["sparse attention"].strip().startswith("the Triton kernel"), lines
    code, out, _ = run_cli(capsys, ["env", "--json"])
    info = json.loads(out)
    assert code == 0 and info["TRITON_INTERPRET"] == "1"
    if not torch.cuda.is_available():
        assert info["GPU"] == "none"
    monkeypatch.delenv("TRITON_INTERPRET")
    info = json.loads(run_cli(capsys, ["env", "--json"])[1])
    if importlib.util.find_spec("triton") is not None and not torch.cuda.is_available():
        assert info["Triton kernels"].startswith("neither"), info


# ---- help ----------------------------------------------------------------------------------

def _parsers(p: argparse.ArgumentParser):
    yield p
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for q in a.choices.values():
                yield from _parsers(q)


def test_every_option_has_help_and_the_help_renders():
    for p in _parsers(build_parser()):
        for a in p._actions:
            if not isinstance(a, argparse._SubParsersAction):
                assert a.help and a.help != argparse.SUPPRESS, (p.prog, a.dest)
        text = p.format_help()
        assert "``" not in text and "SPEC" not in text and "PERF.md" not in text, p.prog


# ---- demo ----------------------------------------------------------------------------------

def _table(out: str) -> dict[int, dict[str, int | str]]:
    """demo's per-layer rows: layer -> {role, ratio, window, compressed, topk}."""
    rows = {}
    for line in out.splitlines():
        f = line.split()
        if len(f) == 8 and f[0].isdigit():
            rows[int(f[0])] = dict(role=f[1], ratio=int(f[2]), window=int(f[3]),
                                   compressed=int(f[4]), topk=int(f[5]))
    return rows


def _selected_by_last_token(tokens: int, decode_steps: int, batch: int = 2) -> dict[int, int]:
    """Through the public API: per layer, the entries >= 0 of the last token's step.topk row
    (of the layer's index source) in the last step."""
    cfg = preset("tiny")
    stack = AttentionStack(cfg, {L: random_layer_weights(cfg, L) for L in range(cfg.n_layers)})
    state = stack.new_state(batch, capacity=tokens + decode_steps)
    gen = torch.Generator().manual_seed(1)
    for m in [tokens] + [1] * decode_steps:
        step = stack.step(state, m)
        stack.run(step, lambda L: torch.randn(batch, m, cfg.dim, generator=gen).bfloat16())
    return {L: int((step.topk(cfg.layer(L).index_source)[-1] >= 0).sum()) if cfg.layer(L).ratio
            else 0 for L in stack.layers}


@pytest.mark.parametrize("tokens,decode_steps", [(12, 1), (1, 0)])
def test_demo_topk_column_counts_the_selected_rows(capsys, tokens, decode_steps):
    code, out, err = run_cli(capsys, ["demo", "--tokens", str(tokens),
                                      "--decode-steps", str(decode_steps), "--batch", "1"])
    assert code == 0, err
    assert "SPEC" not in out
    rows = _table(out)
    cfg = preset("tiny")
    assert sorted(rows) == list(range(cfg.n_layers))
    expected = _selected_by_last_token(tokens, decode_steps, batch=1)
    assert {L: r["topk"] for L, r in rows.items()} == expected
    pos = tokens + decode_steps - 1
    for L, r in rows.items():
        ratio = cfg.layer(L).ratio
        n_cmp = (pos + 1) // ratio if ratio else 0
        assert r["compressed"] == n_cmp and r["window"] == min(pos + 1, cfg.window_size)
        assert r["topk"] == min(cfg.index_topk, n_cmp)  # the last token sees every row
    if tokens == 12:  # 6 and 13 compressed rows: index_topk = 4 of them selected
        assert {r["topk"] for r in rows.values() if r["ratio"]} == {cfg.index_topk}


def test_demo_checkpoint_reads_its_config(capsys, tmp_path):
    wide = tmp_path / "wide"  # window 16, not tiny's 8: shows whose config ran
    write_synthetic_checkpoint(wide, preset("tiny").replace(window_size=16), layers=[0, 1])
    code, out, err = run_cli(capsys, ["demo", "--checkpoint", str(wide), "--layers", "1",
                                      "--tokens", "20", "--decode-steps", "1"])
    assert code == 0, err
    rows = _table(out)
    assert sorted(rows) == [1] and rows[1]["window"] == 16 and rows[1]["topk"] == 4
    other = tmp_path / "dim96"  # a checkpoint that --config tiny does not fit
    write_synthetic_checkpoint(other, preset("tiny").replace(dim=96), layers=[0])
    code, _, err = run_cli(capsys, ["demo", "--checkpoint", str(other), "--config", "tiny",
                                    "--layers", "0"])
    assert_one_line_error(code, err, str(other), "--config tiny")


# ---- README --------------------------------------------------------------------------------

def _blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def test_readme_python_snippets_run():
    """Every ```python block, in order, in one namespace (each continues the one before);
    a block whose first line is '# needs a CUDA GPU' runs only where there is one."""
    blocks = _blocks("python")
    assert len(blocks) >= 4
    ns: dict = {"__name__": "readme"}
    for i, code in enumerate(blocks):
        if code.startswith("# needs a CUDA GPU") and not torch.cuda.is_available():
            continue
        exec(compile(code, f"README.md, python block {i + 1}", "exec"), ns)


def _readme_commands() -> list[list[str]]:
    cmds = []
    for block in _blocks("sh"):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words[:3] == ["python", "-m", "dsv41attn"]:
                cmds.append(words[3:])
    return cmds


README_COMMANDS = [c for c in _readme_commands() if c[0] not in ("bench", "plot")]


def test_readme_bench_commands_parse():
    """The README's bench lines (they need a GPU to run) are valid options, variants and all."""
    benches = [c for c in _readme_commands() if c[0] == "bench"]
    assert any("--variant" in c for c in benches)
    for argv in benches:
        args = build_parser().parse_args(argv)
        assert all(isinstance(name, str) for name, _ in args.variant), argv


def test_readme_has_commands():
    assert any(c[0] == "demo" for c in README_COMMANDS)
    assert any("--schedule" in c for c in README_COMMANDS)


@pytest.mark.parametrize("argv", README_COMMANDS, ids=[" ".join(c) for c in README_COMMANDS])
def test_readme_commands_run(capsys, monkeypatch, tmp_path, argv):
    """Every `python -m dsv41attn` line of the README's sh blocks, from the repository root
    (--out goes to a temporary file); bench and plot need a GPU / a bench CSV."""
    monkeypatch.chdir(ROOT)
    if "--out" in argv:  # to a temporary file of the same kind
        argv = list(argv)
        i = argv.index("--out") + 1
        argv[i] = str(tmp_path / ("out" + Path(argv[i]).suffix))
        if argv[0] == "inspect" and importlib.util.find_spec("matplotlib") is None:
            pytest.skip("inspect --out needs matplotlib, which is not installed")
    code, out, err = run_cli(capsys, argv)
    assert code == 0, (argv, err)
    if argv[0] == "replay":  # bit for bit, as the README says
        assert "top-k rows differing 0/" in out and "error max 0.000e+00" in out, (argv, out)
    if argv[0] == "inspect" and "--out" in argv:
        assert Path(argv[argv.index("--out") + 1]).read_bytes()[:4] == b"\x89PNG"


def test_numerics_citations_name_existing_sections():
    """Every 'docs/numerics.md §N' in the library and the tests names a section of that file."""
    sections = set(re.findall(r"^## (\d+)\. ", (ROOT / "docs" / "numerics.md").read_text(), re.M))
    cited = {}
    for path in [*ROOT.glob("dsv41attn/**/*.py"), *ROOT.glob("tests/**/*.py")]:
        for n in re.findall(r"numerics\.md §(\d+)", path.read_text()):
            cited.setdefault(n, path.name)
        for n in re.findall(r"numerics\.md §\d+(?:, §(\d+))+", path.read_text()):
            cited.setdefault(n, path.name)
    assert cited, "no citations found"
    missing = {n: where for n, where in cited.items() if n not in sections}
    assert not missing, missing


def test_help_schedule_example_fits_its_fixture():
    from dsv41attn.cli import SCHEDULE_EXAMPLE
    from dsv41attn.fixtures import Fixture, parse_schedule

    text, name = re.fullmatch(r"'([^']+)' for (\w+) .*", SCHEDULE_EXAMPLE).groups()
    fx = Fixture.load(str(ROOT / "tests" / "fixtures" / f"{name}.safetensors"))
    seqs = parse_schedule(text)
    total = sum(t for _, t in fx.schedule)
    assert len(seqs) == fx.batch and all(sum(s) == total for s in seqs)
