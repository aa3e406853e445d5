"""tuning: settings of the package's module constants parsed, refused with a message naming
what is wrong, set for a block and put back; and bench --variant's alternation of variants
(the layer timings faked: the GPU half is in test_bench_gpu.py)."""
import math

import pytest
import torch

import dsv41attn.ops.linear.triton as lin
from dsv41attn.ops.common import triton as common_triton
from dsv41attn.tuning import Setting, parse_setting, parse_variant, settable, tuned

R = "ops.linear.triton.SPLIT_PROGRAMS_PER_SM"  # the constants these tests set (ints)
P = "ops.linear.triton.SPLIT_PARTIAL_BYTES"


@pytest.mark.parametrize("text,value", [
    ("ops.linear.triton.SPLIT_PROGRAMS_PER_SM=16", 16),
    ("dsv41attn.ops.linear.triton.SPLIT_PROGRAMS_PER_SM=16", 16),
    ("ops.linear.triton.SPLIT_PARTIAL_BYTES=40M", 40 << 20),
    ("ops.linear.triton.SPLIT_PARTIAL_BYTES=3k", 3 << 10),
    ("ops.linear.triton.SPLIT_PARTIAL_BYTES=1G", 1 << 30),
    ("ops.linear.triton.SPLIT_PARTIAL_BYTES=0x100", 256),
    ("ops.linear.triton.SPLIT_PARTIAL_BYTES= 12 ", 12),
    ("ops.linear.triton.SWAP_WS=on", True),
    ("ops.linear.triton.SWAP_WS=1", True),
    ("ops.linear.triton.SWAP_WS=False", False),
    ("ops.linear.triton.SWAP_WS=no", False),
    ("ops.linear.triton.PRESCALE_MIN_M=64", 64),  # read when called, not as a default value
    ("ops.sparse_attn.triton.SPLIT_BLOCKS=4", 4),
])
def test_values_parse_as_the_constants_type(text, value):
    s = parse_setting(text)
    assert s.value == value and type(s.value) is type(value), (text, s)
    assert s.module.startswith("dsv41attn.") and s.name in text
    assert str(s) == f"{s.module[len('dsv41attn.'):]}.{s.name}={value}"


@pytest.mark.parametrize("text,names", [
    ("ops.linear.triton.SPLIT_PROGRAMS_PER_SM", ["PATH.NAME=VALUE"]),
    ("SPLIT_PROGRAMS_PER_SM=16", ["PATH.NAME=VALUE"]),
    ("nowhere.X=1", ["dsv41attn.nowhere"]),
    ("layer.NOPE=1", ["NOPE", "dsv41attn.layer"]),
    ("ops.linear.triton.split_max_m=1", ["split_max_m", "upper-case"]),
    ("ops.linear.triton.SPLIT_PROGRAMS_PER_SM=many", ["'many'", "int"]),
    ("ops.linear.triton.SPLIT_PROGRAMS_PER_SM=1.5", ["'1.5'", "int"]),
    ("ops.linear.triton.SPLIT_PROGRAMS_PER_SM=", ["''", "int"]),
    ("ops.linear.triton.SWAP_WS=maybe", ["'maybe'", "bool", "on"]),
    ("ops.linear.gluon.SWAP_BK=64", ["SWAP_BK", "imported by name"]),
    ("ops.common.quant.FP4_MAX=5", ["dsv41attn.ops.common.quant", "no settable", "formats"]),
    ("ops.linear.reference.FP8_BLOCK=16", ["reference"]),
    ("cli.TP_ERROR_GRACE_S=1", ["dsv41attn.cli", "no settable"]),
    ("ops.linear.gluon.BLOCK_K=32", ["BLOCK_K", "default argument", "unsupported"]),
    ("ops.linear.triton.DENSE_BLOCK_K=1", ["DENSE_BLOCK_K", "dict"]),
])
def test_bad_settings_are_refused_naming_what_is_wrong(text, names):
    with pytest.raises(ValueError) as e:
        parse_setting(text)
    for name in names:
        assert name in str(e.value), (name, str(e.value))


def test_variants():
    assert parse_variant("base") == ("base", ())
    name, settings = parse_variant(f"pf:{R}=16, {P}=8M")
    assert name == "pf" and [(s.name, s.value) for s in settings] == [
        ("SPLIT_PROGRAMS_PER_SM", 16), ("SPLIT_PARTIAL_BYTES", 8 << 20)]
    for bad, word in ((":ops.linear.triton.SPLIT_PROGRAMS_PER_SM=1", "NAME"), ("a b", "NAME"),
                      (f"x:{R}=1,{R}=2", "twice"),
                      ("x:layer.NOPE=1", "NOPE")):
        with pytest.raises(ValueError, match=word):
            parse_variant(bad)


def test_tuned_sets_for_the_block_and_restores_after_an_error():
    before = (lin.SPLIT_PROGRAMS_PER_SM, lin.SPLIT_PARTIAL_BYTES)
    settings = [parse_setting(f"{R}=7"), parse_setting(f"{P}=5")]
    with tuned(settings):
        assert (lin.SPLIT_PROGRAMS_PER_SM, lin.SPLIT_PARTIAL_BYTES) == (7, 5)
    assert (lin.SPLIT_PROGRAMS_PER_SM, lin.SPLIT_PARTIAL_BYTES) == before
    with pytest.raises(RuntimeError, match="inside"):
        with tuned(settings):
            raise RuntimeError("inside")
    assert (lin.SPLIT_PROGRAMS_PER_SM, lin.SPLIT_PARTIAL_BYTES) == before
    with tuned([]):  # no settings: nothing set
        assert (lin.SPLIT_PROGRAMS_PER_SM, lin.SPLIT_PARTIAL_BYTES) == before


def test_tuned_forgets_cached_results_on_entry_and_exit():
    """A cached function of the package may have read a constant: its cache is emptied."""
    common_triton.is_hopper(torch.device("cpu"))
    assert common_triton.is_hopper.cache_info().currsize > 0
    with tuned([parse_setting("ops.linear.triton.SPLIT_PROGRAMS_PER_SM=3")]):
        assert common_triton.is_hopper.cache_info().currsize == 0
        common_triton.is_hopper(torch.device("cpu"))
    assert common_triton.is_hopper.cache_info().currsize == 0


# ---- bench --variant, the layer timings faked ----------------------------------------------

class _FakeBench:
    """Stands in for RoleBench: its times and outputs read the K-range constant as it is when
    it is built and when it is called (as the real layer reads it)."""
    calls: list = []

    def __init__(self, cfg, role, backend, weights, group=None, batch_invariant=False):
        self.built = lin.SPLIT_PROGRAMS_PER_SM
        self.role, self.backend, self.invariant = role, backend, batch_invariant
        self.round = 0

    def _now(self):
        assert lin.SPLIT_PROGRAMS_PER_SM == self.built, "called under another variant's settings"
        return lin.SPLIT_PROGRAMS_PER_SM

    def decode_graph_us(self, batch, ctx, reps, queued=True):
        v = self._now()
        self.calls.append(("graph", self.backend, self.invariant, v))
        self.round += 1
        return 100.0 - v + (5.0 if self.round == 1 else 0.0), 3.0  # the second round is faster

    def decode_eager_us(self, batch, ctx, reps, compile_target=False):
        self.calls.append(("eager", self.backend, self.invariant, self._now()))
        return 500.0

    def prefill_us(self, tokens, reps, queued=True):
        v = self._now()
        self.calls.append(("prefill", self.backend, self.invariant, v))
        if v == 9:
            raise RuntimeError("boom")
        return 1000.0 + v

    def profile_decode(self, batch, ctx):
        return [("k_invariant" if self.invariant else "k_default", 2.0, 1)], [("facts", 1.0, 1)]

    def profile_prefill(self, tokens):
        return [("p_invariant" if self.invariant else "p_default", 3.0, 2)]

    def decode_output(self, batch, ctx):
        out = torch.zeros(batch, 4, dtype=torch.bfloat16)
        out[0, : self._now() % 4] = 1  # variants with SPLIT_PROGRAMS_PER_SM % 4 != 0 differ
        return out

    def prefill_output(self, tokens):
        return torch.zeros(1, tokens, 4, dtype=torch.bfloat16) + (self._now() == 5)


@pytest.fixture
def fake_bench(monkeypatch):
    import dsv41attn.bench as bench
    monkeypatch.setattr(bench, "RoleBench", _FakeBench)
    monkeypatch.setattr(bench, "measure_copy_bandwidth", lambda *a, **k: 3e12)
    monkeypatch.setattr(bench, "_weights", lambda *a, **k: {})
    # the constant the fake reads, 0 in the defaults (the fake never plans a GEMM)
    monkeypatch.setattr(lin, "SPLIT_PROGRAMS_PER_SM", 0)
    _FakeBench.calls = []
    return bench


def test_variants_alternate_and_each_runs_under_its_settings(fake_bench):
    variants = [parse_variant("base"), parse_variant(f"pf:{R}=16"),
                parse_variant("odd:ops.linear.triton.SPLIT_PROGRAMS_PER_SM=5")]
    before = lin.SPLIT_PROGRAMS_PER_SM
    rows, _ = fake_bench.bench_layers(decode=[(1, 4096)], prefill=[64], roles=("SWA",),
                                      reference_cases=((1, 4096),), log=lambda *a: None,
                                      variants=variants, rounds=2)
    assert lin.SPLIT_PROGRAMS_PER_SM == before
    assert [(r["kind"], r["variant"]) for r in rows] == [
        ("decode", "base"), ("decode", "pf"), ("decode", "odd"),
        ("prefill", "base"), ("prefill", "pf"), ("prefill", "odd")]
    graphs = [c[3] for c in _FakeBench.calls if c[0] == "graph"]
    assert graphs == [before, 16, 5] * 2  # rounds alternate over the variants
    dec = {r["variant"]: r for r in rows if r["kind"] == "decode"}
    assert dec["base"]["triton_us"] == 100.0 - before  # the least of the rounds
    assert dec["pf"]["triton_us"] == 84.0 and dec["odd"]["triton_us"] == 95.0
    assert dec["pf"]["vs_first%"] == pytest.approx(100 * (84 / (100 - before) - 1))
    assert "diff" not in dec["base"] and dec["pf"]["diff"] == 0 and dec["odd"]["diff"] == 1
    # the eager and reference times: the first variant's only, under its settings
    assert "triton_eager_us" in dec["base"] and "reference_us" in dec["base"]
    assert not any(k in dec[v] for v in ("pf", "odd") for k in ("triton_eager_us", "reference_us"))
    assert {c[3] for c in _FakeBench.calls if c[0] == "eager"} == {before}
    pre = {r["variant"]: r for r in rows if r["kind"] == "prefill"}
    assert pre["pf"]["triton_us"] == 1016.0 and pre["odd"]["diff"] == 64 * 4
    assert pre["pf"]["diff"] == 0


def test_a_failing_variant_is_reported_and_the_others_still_run(fake_bench):
    variants = [parse_variant("base"), parse_variant(f"bad:{R}=9")]
    logged = []
    rows, _ = fake_bench.bench_layers(decode=[], prefill=[64], roles=("SWA",),
                                      reference_cases=(), log=logged.append,
                                      variants=variants, rounds=2)
    base, bad = rows
    assert base["triton_us"] == 1000.0 + lin.SPLIT_PROGRAMS_PER_SM and "failed" not in base
    assert math.isnan(bad["triton_us"]) and len(bad["failed"]) == 2
    assert "boom" in bad["failed"][0] and any("[bad]" in line and "boom" in line for line in logged)


def test_without_variants_one_row_a_case_as_before(fake_bench):
    rows, _ = fake_bench.bench_layers(decode=[(8, 4096)], prefill=[], roles=("SWA", "Reuse"),
                                      reference_cases=(), log=lambda *a: None)
    assert [(r["role"], r["variant"]) for r in rows] == [("SWA", "default"), ("Reuse", "default")]
    assert all("diff" not in r and r["triton_us"] == 105.0 - lin.SPLIT_PROGRAMS_PER_SM
               for r in rows)
    assert all(r["triton_facts_us"] == 3.0 for r in rows)
    assert [c[0] for c in _FakeBench.calls] == ["graph", "graph"]
    assert isinstance(rows[0]["floor_us"], float) and rows[0]["ratio"] > 0


def test_setting_dataclass_is_frozen():
    s = Setting("dsv41attn.ops.linear.triton", "SPLIT_PROGRAMS_PER_SM", 1)
    with pytest.raises(Exception):
        s.value = 2


def test_plot_draws_a_series_per_role_and_variant(tmp_path):
    """plot of a bench --csv file written with variants: each (role, variant) its own bars
    (one series per role would draw the variants over each other)."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from dsv41attn.bench import plot_csv
    path = tmp_path / "v.csv"
    path.write_text("role,kind,variant,batch,context,ratio\n"
                    "SWA,decode,base,1,4096,2.2\nSWA,decode,pf,1,4096,1.9\n"
                    "Reuse,decode,base,1,4096,2.3\nReuse,decode,pf,1,4096,2.0\n")
    plot_csv(str(path), str(tmp_path / "v.png"))
    _, labels = plt.gcf().axes[0].get_legend_handles_labels()
    plt.close("all")
    assert [x for x in labels if "[" in x] == ["SWA [base]", "SWA [pf]", "Reuse [base]",
                                              "Reuse [pf]"], labels
    assert (tmp_path / "v.png").stat().st_size > 0


def _bench_args(**kw):
    from dsv41attn.cli import build_parser
    argv = ["bench"] + [a for k, v in kw.items() for a in (f"--{k.replace('_', '-')}", v)]
    return build_parser().parse_args(argv)


def test_bench_profile_with_batch_invariant_profiles_both_modes(fake_bench, monkeypatch, capsys):
    """bench --profile: each role's decode step and prefill call, their kernels; with
    --batch-invariant the invariant mode's after the default's, from a layer built in it."""
    bench = fake_bench
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake GPU")
    argv = ["bench", "--part", "layers", "--roles", "SWA", "--decode", "1x4096",
            "--prefill", "64", "--profile"]
    from dsv41attn.cli import build_parser
    for invariant in (False, True):
        args = build_parser().parse_args(argv + ["--batch-invariant"] * invariant)
        assert bench.main(args) == 0
        out = capsys.readouterr().out
        titles = [line for line in out.splitlines() if line.startswith("per-kernel")]
        want = ["per-kernel GPU time, SWA, decode b=1 4K (one eager step):",
                "per-kernel GPU time, SWA, prefill 64 tokens (one eager call):"]
        if invariant:
            want += [t.replace("SWA,", "SWA, batch-invariant,") for t in want]
        assert titles == want, out
        assert ("k_invariant" in out) == invariant and "k_default" in out
        assert ("p_invariant" in out) == invariant and "p_default" in out
        assert "1 launches, 2.0 us of GPU time in all (besides the step's facts: 1 launches" in out


def test_bench_main_prints_the_variants_of_the_gemm_part(fake_bench, monkeypatch, capsys):
    """bench --part gemm --variant ...: a row per weight, rows and variant with its vs and
    diff; a failed variant fails the command (the GPU parts faked)."""
    bench = fake_bench
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake GPU")
    seen = {}

    def fake_gemm(copy_bw, rows, variants, rounds):
        seen.update(rows=rows, variants=[v for v, _ in variants], rounds=rounds)
        out = []
        for m in rows:
            for i, (v, _) in enumerate(variants):
                r = {"weight": "wq_b", "N": 32768, "K": 1280, "rows": m, "variant": v,
                     "us": 20.0 - i, "floor_us": 10.0, "ratio": 2.0 - i / 10, "GB/s": 1.0,
                     "copy%": 50.0, "TFLOP/s": 1.0, "vs_first%": -5.0 * i}
                if i:
                    r["diff"] = 3 * i
                if v == "bad":
                    r.update(us=float("nan"), failed=["RuntimeError: no"])
                out.append(r)
        return out

    monkeypatch.setattr(bench, "bench_gemm", fake_gemm)
    monkeypatch.setattr(bench, "bench_wo_a", lambda copy_bw: [])
    args = _bench_args(part="gemm", rows="32,64", variant="swap:ops.linear.triton.SWAP_WS=1")
    args.variant.insert(0, parse_variant("base"))
    assert bench.main(args) == 0
    out = capsys.readouterr().out
    assert seen == {"rows": [32, 64], "variants": ["base", "swap"], "rounds": 2}
    assert "swap: ops.linear.triton.SWAP_WS=True" in out and "base: the defaults" in out
    lines = [line.split() for line in out.splitlines() if line.startswith("wq_b")]
    assert [(w[2], w[3], w[5], w[6]) for w in lines] == [
        ("32", "base", "-", "-"), ("32", "swap", "-5.0%", "3"),
        ("64", "base", "-", "-"), ("64", "swap", "-5.0%", "3")]
    args.variant.append(parse_variant("bad"))
    assert bench.main(args) == 1
    out = capsys.readouterr().out
    assert "2 case(s) failed" in out and "gemm wq_b rows=64 [bad] RuntimeError: no" in out


def test_bench_main_prints_the_variants_of_the_layers_part(fake_bench, monkeypatch, capsys):
    bench = fake_bench
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake GPU")
    args = _bench_args(part="layers", roles="SWA", decode="1x4096", prefill="")
    args.variant = [parse_variant("base"), parse_variant(f"odd:{R}=5")]
    assert bench.main(args) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("SWA ")]
    assert [(r[1], r[2], r[6], r[7]) for r in rows] == [
        ("decode", "base", "-", "-"), ("decode", "odd", f"{100 * (95 / 100 - 1):+.1f}%", "1")], out


def test_a_setting_reaches_the_planners():
    """Settings act where the code reads them: the fp8 GEMM's plan follows PRESCALE_MIN_M
    (its square tiles on bf16 values from that many rows) and the attention's list cut
    follows SPLIT_BLOCKS."""
    from dsv41attn.ops.linear import triton as lin
    from dsv41attn.ops.sparse_attn import triton as attn
    plan = lambda: lin._linear_shape_plan(256, 1280, 160, 132, None, True, False)  # noqa: E731
    assert not plan().prescaled or plan().swap
    with tuned([parse_setting("ops.linear.triton.PRESCALE_MIN_M=256")]):
        assert plan().prescaled and not plan().swap  # the square tiles, on bf16 values
    assert attn._pick_splits(10) == (-(-10 // attn.SPLIT_BLOCKS), attn.SPLIT_BLOCKS)
    with tuned([parse_setting("ops.sparse_attn.triton.SPLIT_BLOCKS=3")]):
        assert attn._pick_splits(10) == (4, 3)


def test_settable_lists_what_a_setting_may_name_with_its_comment():
    """bench --settings' list: every entry parses as a setting of its own value, the fast
    path's switches are there with their comments (a group of constants under one comment
    shares it), and no reference or shared-format constant is."""
    listed = {str(s).split("=")[0]: (s, c) for s, c in settable()}
    for key, (s, _) in listed.items():
        assert parse_setting(f"{key}={s.value}") == s
    assert R in listed and "ops.linear.triton.SWAP_WS" in listed
    assert listed["ops.linear.triton.SWAP_WS_MIN_BYTES"][1] == \
        "the weights (e4m3 bytes) they run for"
    assert listed["ops.output.triton.WO_A_STEP_CODES_MAX_ROWS"][1].startswith(
        "Calls of up to this many rows")
    assert not any(k.startswith(("ops.common.quant.", "ops.common.packing.")) or ".reference." in k
                   for k in listed)
    assert "ops.common.quant.FP4_MAX" not in listed and "ops.linear.gluon.SWAP_BK" not in listed
    assert all(k.startswith("ops.linear.gluon.")
               for k in (str(s) for s, _ in settable(["ops.linear.gluon"])))


def test_bench_settings_lists_them_without_a_gpu(capsys):
    from dsv41attn.cli import main
    assert main(["bench", "--settings"]) == 0
    out = capsys.readouterr().out
    assert f"{len(settable())} constants --variant may set" in out
    assert f"  {R}=3 " in out and "ops.linear.triton.SWAP_WS=True" in out


def test_bench_gemm_csv(fake_bench, monkeypatch, tmp_path):
    """bench --part gemm --csv writes the fp8 linears' rows (it wrote nothing before)."""
    import csv
    bench = fake_bench
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake GPU")
    monkeypatch.setattr(bench, "bench_gemm", lambda copy_bw, rows, variants, rounds: [
        {"weight": "wo_b", "N": 5120, "K": 8192, "rows": m, "variant": "default", "us": 20.0,
         "floor_us": 14.0, "ratio": 20 / 14, "GB/s": 2000.0, "copy%": 66.0, "TFLOP/s": 1.0,
         "vs_first%": 0.0} for m in rows])
    monkeypatch.setattr(bench, "bench_wo_a", lambda copy_bw: [])
    path = tmp_path / "g.csv"
    assert bench.main(_bench_args(part="gemm", rows="1,8", csv=str(path))) == 0
    got = list(csv.DictReader(path.open()))
    assert [(r["weight"], r["rows"], r["us"]) for r in got] == [("wo_b", "1", "20.0"),
                                                                ("wo_b", "8", "20.0")]
    assert list(got[0]) == bench.GEMM_FIELDS


def test_plot_refuses_a_csv_that_is_not_the_layers(tmp_path):
    from dsv41attn.bench import GEMM_FIELDS, plot_csv
    path = tmp_path / "g.csv"
    path.write_text(",".join(GEMM_FIELDS) + "\nwo_b,5120,8192,1,default,20,0,,14,1.4,2000,66,1\n")
    with pytest.raises(SystemExit, match="not a layers CSV.*'batch'.*'role'"):
        plot_csv(str(path), str(tmp_path / "g.png"))


def test_bench_main_prints_the_variants_of_the_sparse_attn_part(fake_bench, monkeypatch,
                                                                capsys):
    bench = fake_bench
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake GPU")
    seen = {}

    def fake_attn(copy_bw, variants, rounds):
        seen.update(variants=[v for v, _ in variants], rounds=rounds)
        rows = []
        for i, (v, _) in enumerate(variants):
            r = {"batch": 8, "variant": v, "us": 30.0 - i, "invariant_us": 31.0, "floor_us": 10.0,
                 "ratio": 3.0, "GB/s": 1.0, "copy%": 30.0, "vs_first%": -10.0 * i}
            if v != "bad":
                r.update(rel_err=1e-3, launch_us=40.0)
            else:
                r["failed"] = ["ValueError: no"]
            if i:
                r["diff"] = 0
            rows.append(r)
        return rows

    prefill_seen = []
    monkeypatch.setattr(bench, "bench_sparse_attn", fake_attn)
    monkeypatch.setattr(bench, "bench_sparse_attn_prefill",
                        lambda copy_bw, variants, rounds: prefill_seen.append(
                            ([v for v, _ in variants], rounds)) or [])
    args = _bench_args(part="sparse_attn")
    args.variant = [parse_variant(f"a:{R}=3"), parse_variant("b")]
    assert bench.main(args) == 0
    out = capsys.readouterr().out
    assert seen == {"variants": ["a", "b"], "rounds": 2}
    assert prefill_seen == [(["a", "b"], 2)]
    lines = [line.split() for line in out.splitlines() if line.startswith("     8")]
    assert [(w[1], w[3], w[4], w[9]) for w in lines] == [("a", "-", "-", "1.0e-03"),
                                                         ("b", "-10.0%", "0", "1.0e-03")], out
    args.variant.append(parse_variant("bad"))
    assert bench.main(args) == 1
    assert "sparse_attn b=8 [bad] ValueError: no" in capsys.readouterr().out
