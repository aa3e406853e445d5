"""bench's per-role decode timing on the GPU: every role's graph of its layer and sources, the
sources-only graph and the step's facts give a finite time (the consumer roles once failed
here: the facts plan was made after the sources ran ahead of the target layer). Needs CUDA and
compiled kernels (TRITON_INTERPRET=0); skipped elsewhere."""
import math
import os
import time

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available()
                                or os.environ.get("TRITON_INTERPRET") == "1",
                                reason="needs a CUDA GPU with compiled Triton kernels")


@pytest.fixture(scope="module")
def weights():
    from dsv41attn import preset
    from dsv41attn.bench import ROLES, _weights, role_layers
    cfg = preset("v41-flash")
    return cfg, _weights(cfg, sorted({L for r in ROLES for L in role_layers(cfg, r)}))


@pytest.mark.parametrize("queued", [True, False])
@pytest.mark.parametrize("role", ["SWA", "Full r=2", "Full r=1 cand", "Reindex", "Reuse"])
def test_decode_graph_time_of_every_role(weights, role, queued):
    from dsv41attn.bench import RoleBench
    cfg, w = weights
    layer_us, facts_us = RoleBench(cfg, role, "triton", w).decode_graph_us(2, 640, 3, queued)
    assert math.isfinite(layer_us) and layer_us > 0, (role, layer_us)
    assert math.isfinite(facts_us) and facts_us > 0, (role, facts_us)


def test_gemm_part_times_every_weight_of_the_layer():
    """bench --part gemm: each fp8 linear the layer calls, at a decode and a prefill row count,
    gives a finite time at or above its floor (the floor counts the bytes every call must
    move, so a time under it would mean the weights were not read from HBM)."""
    from dsv41attn.bench import GEMM_WEIGHTS, bench_gemm, measure_copy_bandwidth
    rows = bench_gemm(measure_copy_bandwidth(256 << 20), rows=(1, 128), min_bytes=128 << 20)
    assert [(r["weight"], r["rows"]) for r in rows] == [(w, m) for w in GEMM_WEIGHTS
                                                        for m in (1, 128)]
    for r in rows:
        assert math.isfinite(r["us"]) and r["ratio"] >= 0.9, r


def test_gemm_part_times_wo_a_four_ways():
    """bench --part gemm's wo_a rows: the codes (rescaled, and with scaled operands), torch's
    and dense_linear's GEMM at each row count, finite and at or above the fp8 floor, both code
    forms giving dense_linear's bits."""
    from dsv41attn.bench import bench_wo_a, measure_copy_bandwidth
    rows = bench_wo_a(measure_copy_bandwidth(256 << 20), rows=(1, 64), min_bytes=128 << 20)
    forms = ("codes", "codes, scaled", "bf16 torch", "bf16 fixed")
    assert [(r["form"], r["rows"]) for r in rows] == [(f, m) for f in forms for m in (1, 64)]
    for r in rows:
        assert math.isfinite(r["us"]) and r["ratio"] >= 0.9, r
        assert r["same_bits"] is (True if r["form"].startswith("codes") else None), r


@pytest.mark.parametrize("role", ["SWA", "Full r=2"])
def test_profiles_list_the_layers_kernels(weights, role):
    """bench --profile: a decode step's and a prefill call's kernels, each with a positive GPU
    time and call count, the sparse attention among them; the decode step's facts apart."""
    from dsv41attn.bench import RoleBench
    cfg, w = weights
    bench = RoleBench(cfg, role, "triton", w)
    layer, facts = bench.profile_decode(2, 640)
    prefill = bench.profile_prefill(384)
    for table in (layer, facts, prefill):
        assert table and all(us > 0 and n >= 1 for _, us, n in table), table
        assert [us for _, us, _ in table] == sorted((us for _, us, _ in table), reverse=True)
    for table in (layer, prefill):
        assert any("sparse_attn" in name for name, _, _ in table), [k for k, *_ in table]
    assert not any("sparse_attn" in name for name, _, _ in facts)


def test_timeline_of_a_decode_step(weights):
    """bench --timeline: one replay of Full r=2's decode-step graph, every launch with its
    start (in order, from 0), length and stream lane; the attention among them, and the branch
    streams as lanes beside the query path's."""
    from dsv41attn.bench import RoleBench
    cfg, w = weights
    rows = RoleBench(cfg, "Full r=2", "triton", w).timeline_decode(2, 640)
    starts = [r["start_us"] for r in rows]
    assert rows and starts[0] == 0 and starts == sorted(starts)
    assert all(r["us"] >= 0 for r in rows)
    assert any("sparse_attn" in r["name"] for r in rows), [r["name"] for r in rows]
    lanes = {r["lane"] for r in rows}
    assert lanes == set(range(len(lanes))) and len(lanes) >= 2, lanes


def test_sparse_attn_prefill_part():
    """bench --part sparse_attn's prefill table: the kernel agrees with the reference on the
    prefill cases (window alone, and with ratio-2 compressed rows), the times are finite and
    at or above the floor, and a second variant (one program an item) gives the first's
    bits."""
    from dsv41attn.bench import bench_sparse_attn_prefill, measure_copy_bandwidth
    from dsv41attn.tuning import parse_variant
    rows = bench_sparse_attn_prefill(measure_copy_bandwidth(256 << 20), tokens=(1024, 3000),
                                     variants=[parse_variant("base"), parse_variant(
                                         "item:ops.sparse_attn.gluon.PERSISTENT=0")])
    assert [(r["tokens"], r["ratio_c"], r["variant"]) for r in rows] == [
        (t, c, v) for c in (0, 2) for t in (1024, 3000) for v in ("base", "item")]
    for r in rows:
        assert r["rel_err"] < 1e-2 and "failed" not in r, r
        assert math.isfinite(r["us"]) and r["ratio"] >= 0.9 and r["invariant_us"] > 0, r
        assert r.get("diff", 0) == 0, r


def test_prefill_timing_queued_behind_a_hold_hides_the_host(weights):
    """bench's prefill timing: queued behind a spin kernel (the default) a call's time is the
    GPU's, the host's time hidden. A call that sleeps 20 ms on the host before its one small
    kernel: held 100 ms it times well under 20 ms (the host ahead), unheld over 20 ms (and
    the host not ahead). A role's prefill is finite both ways and faster queued (at 384
    tokens the host's launches take longer than the GPU's work)."""
    from dsv41attn.bench import RoleBench, _events_ms, _held_ms
    x = torch.ones(1 << 20, device="cuda")

    def fn():
        time.sleep(0.02)
        x.add_(1)
    ms, ahead = _held_ms(fn, 100.0)
    assert ahead and ms < 5, ms
    ms, ahead = _held_ms(fn, 0.0)
    assert not ahead and ms >= 20, ms
    assert _events_ms(fn, 1) >= 20
    cfg, w = weights
    bench = RoleBench(cfg, "SWA", "triton", w)
    queued, idle = bench.prefill_us(384, 2), bench.prefill_us(384, 2, queued=False)
    assert math.isfinite(queued) and math.isfinite(idle) and 0 < queued < idle, (queued, idle)


@pytest.mark.parametrize("role", ["SWA", "Full r=2", "Full r=1 cand", "Reindex", "Reuse"])
def test_layer_calls_make_no_synchronising_call(weights, role):
    """Once its step is open, a layer call (a prefill of 384 tokens, then two decode steps,
    the role's sources included) makes no synchronising CUDA call (torch's sync debug mode
    raises on one): its launches queue behind whatever the GPU still runs, a model's previous
    layer say, which the queued prefill timing assumes. A first pass compiles the kernels."""
    from dsv41attn.bench import RoleBench
    cfg, w = weights
    bench = RoleBench(cfg, role, "triton", w)
    stack = bench.stack
    for check in (False, True):
        state = stack.new_state(1, capacity=400, rollback=0)
        for tokens in (384, 1, 1):
            xs = {L: torch.randn(1, tokens, cfg.dim, device="cuda").bfloat16()
                  for L in bench.layers}
            step = stack.step(state, tokens)
            torch.cuda.synchronize()
            if check:
                torch.cuda.set_sync_debug_mode("error")
            try:
                out = stack.run(step, xs)
            finally:
                torch.cuda.set_sync_debug_mode(0)
            assert all(torch.isfinite(y).all() for y in out.values())


def test_attention_launch_variants_part():
    """bench --part attn_variants at small cases: every variant times each case, the default
    launch differs from itself nowhere, and a variant's differing count is a count."""
    from dsv41attn.bench import ATTN_VARIANTS, bench_attn_variants
    variants = {k: ATTN_VARIANTS[k] for k in ("default", "block_h=32", "16 warps")}
    rows = bench_attn_variants(batches=(1, 2), prefill=256, context=1024, variants=variants)
    assert [(r["variant"], r["case"]) for r in rows] == [
        (v, c) for v in variants for c in ("b=1", "b=2", "prefill 256")]
    for r in rows:
        assert "failed" not in r and math.isfinite(r["us"]) and r["us"] > 0, r
        assert r["differing"] == 0 if r["variant"] == "default" else r["differing"] >= 0, r


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="the Gluon kernel needs a Hopper GPU (sm_90)")
def test_attention_kernels_part():
    """bench --part attn_kernels at small cases: each kernel and cut times each case, the
    unsplit Gluon kernel gives the unsplit Triton kernel's bits (the same rounding points and
    sums), every differing count is a count."""
    from dsv41attn.bench import ATTN_KERNELS, bench_attn_kernels
    rows = bench_attn_kernels(batches=(1, 3), context=1024)
    assert [(r["kernel"], r["list"], r["batch"]) for r in rows] == [
        (k, n, b) for n in (128, 640) for b in (1, 3) for k in ATTN_KERNELS]
    for r in rows:
        assert "failed" not in r and math.isfinite(r["us"]) and r["us"] > 0, r
        assert r["differing"] >= 0, r
        if r["kernel"] in ("triton, unsplit", "gluon, unsplit"):
            assert r["differing"] == 0, r


def test_variants_time_each_setting_and_count_differing_bits():
    """bench --part layers --variant: each variant's layer timed under its settings, and its
    output compared with the first's. Without the 1-8-row diagonal tiles (DIAG_MAX_M = 0) the
    GEMMs run the plain 16-row tiles, which promise the same bits."""
    from dsv41attn.bench import bench_layers
    from dsv41attn.tuning import parse_variant
    variants = [parse_variant("base"), parse_variant("nodiag:ops.linear.triton.DIAG_MAX_M=0")]
    rows, _ = bench_layers(decode=[(2, 640)], prefill=[], roles=("SWA", "Full r=2"),
                           reference_cases=(), log=lambda *a: None, variants=variants, rounds=2)
    assert [(r["role"], r["variant"]) for r in rows] == [
        ("SWA", "base"), ("SWA", "nodiag"), ("Full r=2", "base"), ("Full r=2", "nodiag")]
    for r in rows:
        assert "failed" not in r and math.isfinite(r["triton_us"]) and r["triton_us"] > 0, r
    assert [r["diff"] for r in rows if r["variant"] == "nodiag"] == [0, 0]


def test_gemm_variants_time_each_setting_and_count_differing_bits():
    """bench --part gemm --variant: fp8_linear timed under each variant in graphs captured
    under its settings; the swapped Gluon tiles (SWAP_WS, the default) promise the Triton
    tiles' bits, so the diff column is 0 at every row count (1 row: the same plan either way)."""
    from dsv41attn.bench import bench_gemm, measure_copy_bandwidth
    from dsv41attn.tuning import parse_variant
    variants = [parse_variant("base"), parse_variant("triton:ops.linear.triton.SWAP_WS=0")]
    rows = bench_gemm(measure_copy_bandwidth(256 << 20), rows=(1, 128), names=("wq_b", "wo_b"),
                      min_bytes=128 << 20, variants=variants, rounds=2)
    assert [(r["weight"], r["rows"], r["variant"]) for r in rows] == [
        (w, m, v) for w in ("wq_b", "wo_b") for m in (1, 128) for v in ("base", "triton")]
    for r in rows:
        assert "failed" not in r and math.isfinite(r["us"]) and r["ratio"] >= 0.9, r
    assert [r["diff"] for r in rows if r["variant"] == "triton"] == [0, 0, 0, 0]


def test_sparse_attn_variants_time_each_and_count_differing_bits():
    """bench --part sparse_attn --variant: a row per batch and variant; the same settings
    twice give the same bits (the kernel is deterministic), and a split of 4 blocks instead
    of the default is timed and its bits counted."""
    from dsv41attn.bench import bench_sparse_attn, measure_copy_bandwidth
    from dsv41attn.tuning import parse_variant
    variants = [parse_variant("base"), parse_variant("again"),
                parse_variant("split4:ops.sparse_attn.triton.SPLIT_BLOCKS=4")]
    rows = bench_sparse_attn(measure_copy_bandwidth(256 << 20), batches=(1, 64),
                             variants=variants, rounds=2)
    assert [(r["batch"], r["variant"]) for r in rows] == [
        (b, v) for b in (1, 64) for v in ("base", "again", "split4")]
    for r in rows:
        assert "failed" not in r and math.isfinite(r["us"]) and r["us"] > 0, r
        assert r["rel_err"] < 1e-2, r
    assert [r["diff"] for r in rows if r["variant"] == "again"] == [0, 0]
    assert all(isinstance(r["diff"], int) for r in rows if r["variant"] == "split4")


def test_the_fifty_first_sessions_settings_keep_every_bit():
    """The settings prepared without a GPU, all on (wo_a's codes by their bits and through TMA
    up to 64 rows, the merge's narrow deep tiles, the two-bit top-k search, wo_b's input
    quantised inside wo_a, the compressor's range sum in its last program): each promises the
    same bits, so the layer's output differs in no element from the defaults', in a decode
    step (2 and 16 sequences) of SWA and Full r=2."""
    from dsv41attn.bench import bench_layers
    from dsv41attn.tuning import parse_variant
    on = ("ops.linear.triton.DENSE_CODE_BITS=1,ops.linear.triton.DENSE_FP8_TMA_MAX_M=64,"
          "ops.sparse_attn.triton.MERGE_BLOCK_D=32,ops.sparse_attn.triton.MERGE_STAGES=8,"
          "ops.indexer.triton.SEARCH_DIGIT_BITS=2,ops.output.triton.QUANT_IN_WO_A=1,"
          "ops.compressor.triton.PROJECT_LAST_SUM=1")
    variants = [parse_variant("base"), parse_variant("new:" + on)]
    rows, _ = bench_layers(decode=[(2, 640), (16, 640)], prefill=[], roles=("SWA", "Full r=2"),
                           reference_cases=(), log=lambda *a: None, variants=variants, rounds=1)
    assert len(rows) == 8
    for r in rows:
        assert "failed" not in r and math.isfinite(r["triton_us"]) and r["triton_us"] > 0, r
    assert [r["diff"] for r in rows if r["variant"] == "new"] == [0, 0, 0, 0]
