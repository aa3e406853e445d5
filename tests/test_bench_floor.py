"""The floors bench divides by are PERF.md's table (V4.1-Flash, one layer, 4.3 TB/s, 790 TFLOP/s);
and bench --timeline's reading of a profiler trace."""
import pytest

from dsv41attn import preset
from dsv41attn.bench import ROLES, layer_floor, timeline_rows

CFG = preset("v41-flash")
ORDER = ["SWA", "Full r=2", "Full r=1 cand", "Reindex", "Reuse"]
DECODE_US = {  # PERF.md, decode one token per sequence
    (1, 4096): [29.5, 35.8, 32.1, 30.9, 29.5],
    (1, 1 << 20): [29.5, 44.0, 48.7, 31.1, 29.5],
    (8, 65536): [29.6, 40.3, 40.7, 33.3, 29.9],
    (64, 4096): [30.8, 41.3, 39.7, 38.4, 33.0],
    (64, 65536): [30.8, 72.3, 101.9, 50.9, 33.0],
    (256, 4096): [87.5, 121.6, 125.4, 123.6, 109.2],
    (256, 65536): [87.5, 203.2, 311.4, 156.2, 109.2],
}


@pytest.mark.parametrize("case", list(DECODE_US), ids=lambda c: f"b{c[0]}_ctx{c[1]}")
def test_decode_floor_matches_perf_table(case):
    batch, ctx = case
    for role, want in zip(ORDER, DECODE_US[case]):
        got = layer_floor(CFG, ROLES[role], batch, ctx, 1, 4.3e12)[2] * 1e6
        assert got == pytest.approx(want, abs=0.15), role


def test_prefill_floor_matches_perf_text():
    ms = {r: layer_floor(CFG, ROLES[r], 1, 0, 8192, 4.3e12)[2] * 1e3 for r in ORDER}
    assert ms["SWA"] == pytest.approx(2.8, abs=0.05) and ms["Full r=1 cand"] == pytest.approx(4.0, abs=0.05)
    ms = {r: layer_floor(CFG, ROLES[r], 1, 0, 65536, 4.3e12)[2] * 1e3 for r in ORDER}
    for role, want in zip(ORDER, [22, 41, 52, 39, 28]):
        assert ms[role] == pytest.approx(want, abs=0.6), role


def test_indexer_floor_is_the_key_bytes_at_long_context():
    """PERF.md: index keys once per sequence (68 B per scored row), 2 x 32 x 128 FLOPs per
    (query, scored row): at b=64 x 64K rows the keys' 285 MB at 4.3 TB/s (66 us) bound it, above
    the 43.5 us of FLOPs; a Reindex consumer scores at most 2048 blocks of 8 rows."""
    from dsv41attn.bench import indexer_floor

    flops, nbytes, floor = indexer_floor(CFG, 64, 65536, 4.3e12)
    assert flops == 2 * 64 * 32 * 128 * 65536
    assert nbytes == 64 * (65536 * 68 + 32 * 128 * 2 + 32 * 2 + 512 * 4)
    assert floor * 1e6 == pytest.approx(66.4, abs=0.1)
    assert indexer_floor(CFG, 64, 2048 * 8, 4.3e12)[2] * 1e6 == pytest.approx(16.7, abs=0.1)


def test_indexer_floor_of_a_prefill_is_the_causal_dots():
    """A 64K prefill's indexer: each query scores the rows up to its own (2^31 pairs, 17.6
    TFLOP: 22.3 ms at 790 TFLOP/s); the sequence's keys are read once (4.5 MB), not once per
    query, so the FLOPs bound it."""
    from dsv41attn.bench import indexer_floor

    n = 65536
    flops, nbytes, floor = indexer_floor(CFG, n, (n + 1) / 2, 4.3e12, key_rows=n)
    assert flops == 2 * 32 * 128 * n * (n + 1) / 2
    assert nbytes == n * 68 + n * (32 * 128 * 2 + 32 * 2 + 512 * 4)
    assert floor * 1e3 == pytest.approx(22.27, abs=0.01)


def test_per_rank_weight_bytes_are_the_loaders_slices(tmp_path):
    """Under --tp the floor counts one rank's weights: the bytes it saves against w = 1 are
    those the checkpoint loader does not read for that rank (tiny preset, every role)."""
    from dsv41attn import write_synthetic_checkpoint
    from dsv41attn.bench import _weight_bytes_and_params
    from dsv41attn.tp import load_layer_weights_tp

    cfg = preset("tiny")
    layers = list(range(cfg.n_layers))
    write_synthetic_checkpoint(tmp_path, cfg, seed=0, layers=layers)
    full = {L: load_layer_weights_tp(tmp_path, cfg, [L], 0, 1)[1] for L in layers}
    for L in layers:
        one = _weight_bytes_and_params(cfg, L)[0]
        for rank in range(2):
            read = load_layer_weights_tp(tmp_path, cfg, [L], rank, 2)[1]
            assert _weight_bytes_and_params(cfg, L, 2)[0] - one == read - full[L], (L, rank)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_per_rank_floor_at_v41_flash(world):
    """One rank of ``world``: the head-sharded weights divide by world, the attention and
    index FLOPs too, the cache bytes do not, and the all-reduce bytes (wo_b's fp32 output,
    an index source's bf16 scores) are added at the measured bandwidth."""
    from dsv41attn.bench import _weight_bytes_and_params, allreduce_bytes

    sharded = (32768 * 1280 + 1024 * 40) + 64 * 4 + (8192 * 4096 + 256 * 128) \
        + (5120 * 8192 + 160 * 256)  # wq_b, attn_sink, wo_a, wo_b (+ scales)
    index = (4096 * 1280 + 128 * 40) + 32 * 5120 * 2  # indexer.wq_b, weights_proj
    for role, extra in (("SWA", 0), ("Full r=1 cand", index)):
        full = _weight_bytes_and_params(CFG, ROLES[role])[0]
        got = _weight_bytes_and_params(CFG, ROLES[role], world)[0]
        assert got == full - (sharded + extra) * (world - 1) // world, role
    bw, ar = 4.3e12, 200e9
    for role in ORDER:
        f1, b1, _ = layer_floor(CFG, ROLES[role], 64, 4096, 1, bw)
        fw, bw_bytes, floor = layer_floor(CFG, ROLES[role], 64, 4096, 1, bw, world, ar)
        assert fw < f1 and bw_bytes < b1
        moved = allreduce_bytes(CFG, ROLES[role], 64, 4096, 1)
        assert floor == pytest.approx(max(fw / 790e12, bw_bytes / bw) + moved / ar)
    assert allreduce_bytes(CFG, ROLES["SWA"], 1, 4096, 1) == 5120 * 4
    assert allreduce_bytes(CFG, ROLES["Full r=1 cand"], 64, 4096, 1) == 64 * (5120 * 4 + 4097 * 2)
    # a Reindex layer's scores are its candidate blocks' rows only
    assert allreduce_bytes(CFG, ROLES["Reindex"], 1, 65536, 1) == 5120 * 4 + 2048 * 8 * 2
    with pytest.raises(ValueError, match="all-reduce bandwidth"):
        layer_floor(CFG, 0, 1, 4096, 1, bw, world)


def test_timeline_reads_the_gpu_work_of_a_trace(capsys):
    """timeline_rows: kernels, copies and memsets only (not host events, nor GPU events without
    a length), in order of start from 0, streams numbered in order of first use, each with its
    lane's idle time before it (none for a lane's first); printed with a line per lane."""
    events = [
        {"cat": "kernel", "name": "b", "ts": 110.5, "dur": 2.0, "tid": 146},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 90.0, "dur": 5.0, "tid": 1},
        {"cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 100.0, "dur": 1.5, "tid": 7},
        {"cat": "kernel", "name": "c", "ts": 111.0, "dur": 4.0, "tid": 7},
        {"cat": "gpu_memset", "name": "Memset", "ts": 120.0, "dur": 0.5, "tid": 149},
        {"cat": "kernel", "name": "flow", "ts": 95.0, "tid": 7},
        {"ph": "M", "name": "process_name"},
    ]
    events.append({"cat": "kernel", "name": "d", "ts": 114.0, "dur": 1.0, "tid": 7})  # inside c
    rows = timeline_rows(events)
    assert rows == [
        {"start_us": 0.0, "us": 1.5, "lane": 0, "idle_us": None, "name": "Memcpy DtoD"},
        {"start_us": 10.5, "us": 2.0, "lane": 1, "idle_us": None, "name": "b"},
        {"start_us": 11.0, "us": 4.0, "lane": 0, "idle_us": 9.5, "name": "c"},
        {"start_us": 14.0, "us": 1.0, "lane": 0, "idle_us": 0.0, "name": "d"},
        {"start_us": 20.0, "us": 0.5, "lane": 2, "idle_us": None, "name": "Memset"},
    ]
    assert timeline_rows([]) == []
    from dsv41attn.bench import _print_timeline
    _print_timeline(rows)
    out = capsys.readouterr().out
    assert "5 launches on 3 stream(s), 20.5 us from the first start" in out
    assert "lane 0: 3 launches, 6.5 us busy, from 0.0 to 15.0" in out
    assert "lane 2: 1 launches, 0.5 us busy, from 20.0 to 20.5" in out
    assert " 0    9.5  c\n" in out and " 1      -  b\n" in out  # lane, its idle time, name
