"""Checkpoint tensors: expected names/shapes per role, fp8 dequantisation, lazy sharded loading,
validation errors, the synthetic writer, and the golden fixtures' weights."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest

from conftest import fixture_files
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dsv41attn import checkpoint as ck
from dsv41attn.checkpoint import (
    CheckpointError, Fp8Weight, LayerWeights, expected_tensors, layer_weights_from_tensors,
    load_layer_weights, quantize_fp8, random_checkpoint_tensors, random_layer_weights,
    write_synthetic_checkpoint,
)
from dsv41attn.config import AttentionConfig, Role

FIXTURES = {f.stem: f for f in fixture_files()}
FP8, SCALE, BF16, F32 = torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.bfloat16, torch.float32
COMMON = {
    "wq_a.weight", "wq_a.scale", "q_norm.weight", "wq_b.weight", "wq_b.scale", "wkv.weight",
    "wkv.scale", "kv_norm.weight", "wo_a.weight", "wo_a.scale", "wo_b.weight", "wo_b.scale",
    "attn_sink",
}
KV_SOURCE = {"compressor.wkv.weight", "compressor.norm.weight", "indexer.wk.weight",
             "indexer.k_norm.weight"}
INDEX_SOURCE = {"indexer.wq_b.weight", "indexer.wq_b.scale", "indexer.weights_proj.weight"}


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes of a tensor, so fp8 values (and NaNs) compare exactly."""
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t


def assert_same_weights(a: LayerWeights, b: LayerWeights) -> None:
    assert a.layer == b.layer
    for f in dataclasses.fields(LayerWeights):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, Fp8Weight):
            assert isinstance(y, Fp8Weight), f.name
            assert torch.equal(bits(x.weight), bits(y.weight)), f.name
            assert torch.equal(bits(x.scale), bits(y.scale)), f.name
        elif isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype, f.name
            assert torch.equal(x, y), f.name
        else:
            assert x == y, f.name


class CountingSafeOpen:
    """Wraps ``safe_open``: records every file opened and every tensor whose data is read."""

    def __init__(self) -> None:
        self.opened: list[str] = []
        self.read: list[str] = []

    def __call__(self, filename, *args, **kwargs):
        self.opened.append(os.path.basename(filename))
        return _CountingHandle(safe_open(filename, *args, **kwargs), self.read)


class _CountingHandle:
    def __init__(self, handle, read: list[str]) -> None:
        self._handle, self._read = handle, read

    def __enter__(self):
        self._handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self._handle.__exit__(*exc)

    def get_tensor(self, name):
        self._read.append(name)
        return self._handle.get_tensor(name)

    def __getattr__(self, name):
        return getattr(self._handle, name)


@pytest.fixture
def counting(monkeypatch) -> CountingSafeOpen:
    spy = CountingSafeOpen()
    monkeypatch.setattr(ck, "safe_open", spy)
    return spy


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, tiny):
    """All tiny layers, seed 7, in many small shards."""
    path = tmp_path_factory.mktemp("sharded")
    write_synthetic_checkpoint(path, tiny, seed=7, max_shard_bytes=12_000)
    return path


def save_single(path, tensors: dict[str, torch.Tensor]) -> str:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return str(path)


# ---- expected tensors ------------------------------------------------------------------------

def test_flash_layer_2_matches_spec_table(flash):
    """A KV source with r = 2 (has every tensor), shapes copied from the V4.1-Flash checkpoint."""
    exp = expected_tensors(flash, 2)
    assert exp == {
        "wq_a.weight": (FP8, (1280, 5120)), "wq_a.scale": (SCALE, (40, 160)),
        "q_norm.weight": (BF16, (1280,)),
        "wq_b.weight": (FP8, (32768, 1280)), "wq_b.scale": (SCALE, (1024, 40)),
        "wkv.weight": (FP8, (512, 5120)), "wkv.scale": (SCALE, (16, 160)),
        "kv_norm.weight": (BF16, (512,)),
        "wo_a.weight": (FP8, (8192, 4096)), "wo_a.scale": (SCALE, (256, 128)),
        "wo_b.weight": (FP8, (5120, 8192)), "wo_b.scale": (SCALE, (160, 256)),
        "attn_sink": (F32, (64,)),
        "compressor.wkv.weight": (BF16, (512, 5120)),
        "compressor.wgate.weight": (BF16, (512, 5120)),
        "compressor.norm.weight": (BF16, (512,)),
        "indexer.wk.weight": (BF16, (128, 512)),
        "indexer.k_norm.weight": (BF16, (128,)),
        "indexer.wq_b.weight": (FP8, (4096, 1280)), "indexer.wq_b.scale": (SCALE, (128, 40)),
        "indexer.weights_proj.weight": (BF16, (32, 5120)),
    }


@pytest.mark.parametrize("layer, names", [
    (0, COMMON),  # SWA
    (2, COMMON | KV_SOURCE | {"compressor.wgate.weight"} | INDEX_SOURCE),  # Full r2
    (3, COMMON),  # Reuse r2
    (20, COMMON | KV_SOURCE | INDEX_SOURCE),  # Full r1: no gate
    (24, COMMON | INDEX_SOURCE),  # Reindex: indexer queries, no index keys
    (39, COMMON),  # Reuse r1
    (40, COMMON),  # draft (mtp.0)
])
def test_flash_names_per_role(flash, layer, names):
    assert set(expected_tensors(flash, layer)) == names


def test_flash_tensor_count(flash):
    # 43 layers x 13 common, KV sources 2/8/14 (+5) and 20 (+4), 8 index sources (+3 each).
    total = sum(len(expected_tensors(flash, L)) for L in range(43))
    assert total == 43 * 13 + 3 * 5 + 4 + 8 * 3 == 602


def test_shapes_follow_the_config(tiny):
    cfg = tiny.replace(dim=96, o_lora_rank=48, index_n_heads=3)  # G*R = 96
    exp = expected_tensors(cfg, 1)
    assert exp["wo_b.weight"] == (FP8, (96, 96)) and exp["wo_b.scale"] == (SCALE, (3, 3))
    assert exp["wo_a.weight"] == (FP8, (96, 128)) and exp["wo_a.scale"] == (SCALE, (3, 4))
    assert exp["wq_a.scale"] == (SCALE, (1, 3)) and exp["compressor.wgate.weight"] == (BF16, (32, 96))
    assert exp["indexer.wq_b.weight"] == (FP8, (96, 32))
    assert exp["indexer.weights_proj.weight"] == (BF16, (3, 96))


# ---- fp8 -------------------------------------------------------------------------------------

def test_dequantize_exact_against_float64():
    gen = torch.Generator().manual_seed(1)
    n, k = 63, 100  # partial blocks on both axes
    raw = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0x3C  # no NaNs
    weight = raw.view(FP8)
    exponents = torch.randint(-20, 20, (2, 4), generator=gen)
    scale = (exponents + 127).to(torch.uint8).view(SCALE)
    got = Fp8Weight(weight, scale).dequantize()
    assert got.dtype == BF16 and got.shape == (n, k)
    rows = torch.arange(n)[:, None] // 32
    cols = torch.arange(k)[None, :] // 32
    exact = weight.double() * torch.pow(2.0, exponents.double())[rows, cols]
    assert torch.equal(got.double(), exact)
    assert exact.abs().max() > 0 and (exact == 0).sum() < exact.numel()


def test_quantize_fp8_block_scales():
    w = torch.randn(70, 45, generator=torch.Generator().manual_seed(2)) * 0.01
    w[32:64, :32] = 0.0  # an all-zero block gets the floored scale, not a NaN
    q = quantize_fp8(w)
    assert q.weight.dtype == FP8 and q.scale.dtype == SCALE and q.scale.shape == (3, 2)
    assert (q.out_features, q.in_features) == (70, 45)
    s = q.scale.float()
    for bi in range(3):
        for bj in range(2):
            block = w[bi * 32:(bi + 1) * 32, bj * 32:(bj + 1) * 32]
            amax = max(block.abs().max().item(), 1e-30)
            assert s[bi, bj].item() == 2.0 ** torch.ceil(torch.log2(torch.tensor(amax / 448))).item()
            if block.abs().max() > 0:
                assert 224 < amax / s[bi, bj].item() <= 448
    err = (q.dequantize().float() - w).abs()
    block_scale = s.repeat_interleave(32, 0).repeat_interleave(32, 1)[:70, :45]
    assert (err <= w.abs() * 2**-4 + 2**-10 * block_scale).all()  # half an e4m3 ulp


def test_fp8_weight_rejects_bad_scale_shape():
    with pytest.raises(CheckpointError, match=r"\[2, 1\]"):
        Fp8Weight(torch.zeros(64, 32).to(FP8), torch.ones(1, 1).to(SCALE))


# ---- random weights --------------------------------------------------------------------------

def test_random_weights_dtypes_and_statistics(tiny):
    lw = random_layer_weights(tiny, 1, seed=0)  # Full r2: everything present
    assert lw.wo_a.dtype == BF16 and lw.wo_a.shape == (32, 128)
    assert lw.compressor_wkv.dtype == F32 and lw.compressor_wgate.dtype == F32
    assert lw.attn_sink.dtype == F32 and lw.attn_sink.shape == (8,)
    for norm in (lw.q_norm, lw.kv_norm, lw.compressor_norm, lw.index_k_norm):
        assert norm.dtype == BF16 and norm.min() >= 0.7 and norm.max() <= 1.3 and norm.std() > 0.1
    wq_b = lw.wq_b.dequantize().float()
    assert abs(wq_b.std().item() * 32**0.5 - 1) < 0.05  # normal(0, 1/sqrt(fan_in = Q = 32))
    assert abs(lw.compressor_wkv.std().item() * 64**0.5 - 1) < 0.1
    r1 = random_layer_weights(tiny, 3, seed=0)  # Full r1: bf16 compressor, no gate
    assert r1.compressor_wkv.dtype == BF16 and r1.compressor_wgate is None
    reuse = random_layer_weights(tiny, 2, seed=0)
    assert all(getattr(reuse, n) is None for n in (
        "compressor_wkv", "compressor_wgate", "compressor_norm", "index_wk", "index_k_norm",
        "index_wq_b", "index_weights_proj"))
    reindex = random_layer_weights(tiny, 5, seed=0)
    assert reindex.index_wq_b.out_features == 4 * 32 and reindex.index_wk is None


def test_random_layers_independent_of_selection(tiny):
    alone = random_checkpoint_tensors(tiny, [3], seed=5)
    everything = random_checkpoint_tensors(tiny, None, seed=5)
    assert set(alone) == {"layers.3.attn." + n for n in expected_tensors(tiny, 3)}
    for name, t in alone.items():
        assert torch.equal(bits(t), bits(everything[name])), name
    other_seed = random_checkpoint_tensors(tiny, [3], seed=6)
    assert not torch.equal(alone["layers.3.attn.attn_sink"], other_seed["layers.3.attn.attn_sink"])
    # Two Reuse layers of the same shapes still get different values.
    assert not torch.equal(everything["layers.2.attn.attn_sink"], everything["layers.4.attn.attn_sink"])
    assert "mtp.0.attn.wq_a.weight" in everything and "layers.8.attn.wq_a.weight" not in everything


def test_layer_weights_to_and_nbytes(tiny):
    lw = random_layer_weights(tiny, 1)
    moved = lw.to("meta")
    assert moved.layer == 1 and moved.wq_a.weight.device.type == "meta"
    assert all(t.device.type == "meta" for t in (
        moved.wq_a.scale, moved.wo_a, moved.attn_sink, moved.compressor_wgate,
        moved.index_wq_b.weight, moved.index_weights_proj))
    assert lw.wq_a.weight.device.type == "cpu"  # a copy, the original stays
    exp = expected_tensors(tiny, 1)
    stored = sum(torch.empty(0, dtype=d).element_size() * torch.Size(s).numel() for d, s in exp.values())
    # held differently from the checkpoint: wo_a bf16 without scale, compressor wkv/wgate fp32
    delta = 32 * 128 * (2 - 1) - 1 * 4 + 2 * (32 * 64 * (4 - 2))
    assert lw.nbytes == stored + delta == 45874


# ---- synthetic checkpoint round trip ---------------------------------------------------------

def test_round_trip_all_layers_many_shards(sharded, tiny):
    files = sorted(f for f in os.listdir(sharded) if f.endswith(".safetensors"))
    assert len(files) >= 5 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    total = 0
    for f in files:
        with safe_open(str(sharded / f), "pt") as h:
            sizes = [h.get_tensor(k).nbytes for k in h.keys()]
        assert sum(sizes) <= 12_000 or len(sizes) == 1
        total += sum(sizes)
    assert index["metadata"]["total_size"] == total
    assert set(index["weight_map"].values()) == set(files)
    assert AttentionConfig.from_hf(sharded) == tiny
    loaded = load_layer_weights(sharded, tiny)
    assert list(loaded) == list(range(9))
    for L, lw in loaded.items():
        assert_same_weights(lw, random_layer_weights(tiny, L, seed=7))


def test_round_trip_subset_of_layers(tmp_path, tiny):
    write_synthetic_checkpoint(tmp_path, tiny, seed=3, layers=[3, 5, 8], max_shard_bytes=20_000)
    loaded = load_layer_weights(tmp_path, tiny, layers=[8, 3])
    assert list(loaded) == [8, 3]
    assert_same_weights(loaded[3], random_layer_weights(tiny, 3, seed=3))
    assert_same_weights(loaded[8], random_layer_weights(tiny, 8, seed=3))
    assert list(load_layer_weights(tmp_path, tiny, layers=5)) == [5]
    missing = r"layers\.0\.attn\.wq_a\.weight: missing; layer 0 is a SWA"
    with pytest.raises(CheckpointError, match=missing):
        load_layer_weights(tmp_path, tiny)  # None = every layer of the config


def test_loading_reads_only_the_selected_layer(sharded, tiny, counting):
    loaded = load_layer_weights(sharded, tiny, layers=[5])
    expected = {"layers.5.attn." + n for n in expected_tensors(tiny, 5)}
    assert sorted(counting.read) == sorted(expected)
    weight_map = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(counting.opened) == sorted({weight_map[n] for n in expected})  # each once
    assert len(counting.opened) < len(set(weight_map.values()))
    assert_same_weights(loaded[5], random_layer_weights(tiny, 5, seed=7))


def test_loading_needs_only_the_shards_of_selected_layers(tmp_path, tiny):
    write_synthetic_checkpoint(tmp_path, tiny, seed=1, max_shard_bytes=12_000)
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    last = weight_map["mtp.0.attn.attn_sink"]
    assert last != weight_map["layers.0.attn.wq_a.weight"]
    os.remove(tmp_path / last)
    assert list(load_layer_weights(tmp_path, tiny, layers=0)) == [0]
    with pytest.raises(CheckpointError, match=f"shard {last} .*does not exist"):
        load_layer_weights(tmp_path, tiny, layers=8)


class _Terminal:
    """A stderr that says it is a terminal (tqdm draws only on one unless forced)."""

    def __init__(self) -> None:
        self.text = ""

    def write(self, s: str) -> int:
        self.text += s
        return len(s)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return True


def test_progress_bar(sharded, tiny, capsys, monkeypatch):
    n_bytes = sum(ck._meta_nbytes(m) for L in (1, 2) for m in expected_tensors(tiny, L).values())
    load_layer_weights(sharded, tiny, layers=[1, 2], progress=True)  # forced, even in a log
    err = capsys.readouterr().err
    assert "loading attention weights" in err and "100%" in err and err.endswith("\n"), err
    assert err.count("\r") <= 3, err  # tqdm's rate limit: no redraw per tensor in a log
    load_layer_weights(sharded, tiny, layers=[1, 2])  # None: small, so silent
    load_layer_weights(sharded, tiny, layers=[1, 2], progress=False)
    assert capsys.readouterr().err == ""
    # None and large: drawn on a terminal only (tqdm's disable=None), never into a log file
    monkeypatch.setattr(ck, "PROGRESS_AUTO_BYTES", n_bytes - 1)
    load_layer_weights(sharded, tiny, layers=[1, 2])
    assert capsys.readouterr().err == ""
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    load_layer_weights(sharded, tiny, layers=[1, 2])
    assert "loading attention weights" in terminal.text and "100%" in terminal.text


# ---- golden fixtures -------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["tiny_roles", "tiny_long_prefill"])
def test_fixture_weights_load(name):
    path = str(FIXTURES[name])
    with safe_open(path, "pt") as f:
        cfg = AttentionConfig.from_hf(json.loads(f.metadata()["config"]))
        wo_a_fp8 = f.get_tensor("layers.1.attn.wo_a.weight")
        wo_a_scale = f.get_tensor("layers.1.attn.wo_a.scale")
        sink = f.get_tensor("layers.6.attn.attn_sink")
    loaded = load_layer_weights(path, cfg)
    assert list(loaded) == list(range(8))
    roles = [cfg.layer(L).role for L in range(8)]
    assert roles == [Role.SWA, Role.FULL, Role.REUSE, Role.FULL, Role.REUSE, Role.REINDEX,
                     Role.REUSE, Role.REINDEX]
    assert [L for L, lw in loaded.items() if lw.index_wq_b is not None] == [1, 3, 5, 7]
    assert [L for L, lw in loaded.items() if lw.index_wk is not None] == [1, 3]
    assert loaded[1].compressor_wgate.dtype == F32 and loaded[3].compressor_wgate is None
    rows, cols = torch.arange(32)[:, None] // 32, torch.arange(128)[None, :] // 32
    exact = wo_a_fp8.double() * wo_a_scale.double()[rows, cols]
    assert torch.equal(loaded[1].wo_a.double(), exact)
    assert torch.equal(loaded[6].attn_sink, sink)


# ---- validation errors -----------------------------------------------------------------------

@pytest.fixture
def layer3(tiny) -> dict[str, torch.Tensor]:
    """Checkpoint tensors of tiny layer 3 (Full, ratio 1) plus layer 4 (Reuse)."""
    return random_checkpoint_tensors(tiny, [3, 4], seed=0)


def _check_both(tiny, tmp_path, tensors, layer, *patterns, counting=None):
    """The error is raised from tensors in memory and from a checkpoint file, before any read."""
    with pytest.raises(CheckpointError) as mem:
        layer_weights_from_tensors(tiny, layer, tensors)
    path = save_single(tmp_path / "bad.safetensors", tensors)
    with pytest.raises(CheckpointError) as disk:
        load_layer_weights(path, tiny, layers=layer)
    for p in patterns:
        assert p in str(mem.value), (p, str(mem.value))
        assert p in str(disk.value), (p, str(disk.value))
    if counting is not None:
        assert counting.read == []


def test_missing_tensor(tiny, tmp_path, layer3, counting):
    del layer3["layers.3.attn.indexer.wk.weight"]
    _check_both(tiny, tmp_path, layer3, 3, "layers.3.attn.indexer.wk.weight: missing",
                "layer 3 is a Full layer (ratio 1)", counting=counting)


def test_gate_in_ratio_1_layer_is_unexpected(tiny, tmp_path, layer3, counting):
    layer3["layers.3.attn.compressor.wgate.weight"] = torch.zeros(32, 64, dtype=BF16)
    _check_both(tiny, tmp_path, layer3, 3, "layers.3.attn.compressor.wgate.weight: unexpected",
                "Full layer (ratio 1), which should not have it", counting=counting)


def test_indexer_in_reuse_layer_is_unexpected(tiny, tmp_path, layer3, counting):
    layer3["layers.4.attn.indexer.weights_proj.weight"] = torch.zeros(4, 64, dtype=BF16)
    _check_both(tiny, tmp_path, layer3, 4, "layers.4.attn.indexer.weights_proj.weight: unexpected",
                "layer 4 is a Reuse layer", counting=counting)


def test_wrong_dtype(tiny, tmp_path, layer3, counting):
    layer3["layers.3.attn.wq_b.weight"] = layer3["layers.3.attn.wq_b.weight"].to(BF16)
    _check_both(tiny, tmp_path, layer3, 3,
                "layers.3.attn.wq_b.weight: expected float8_e4m3fn [256, 32], found bfloat16 [256, 32]",
                counting=counting)


def test_wrong_shape(tiny, tmp_path, layer3, counting):
    layer3["layers.3.attn.wkv.scale"] = torch.ones(2, 2).to(SCALE)
    layer3["layers.3.attn.attn_sink"] = torch.zeros(9)
    _check_both(tiny, tmp_path, layer3, 3,
                "layers.3.attn.wkv.scale: expected float8_e8m0fnu [1, 2], found float8_e8m0fnu [2, 2]",
                "layers.3.attn.attn_sink: expected float32 [8], found float32 [9]",
                "2 problem(s)", counting=counting)


def test_other_layers_are_ignored(tiny, layer3):
    layer3["layers.30.attn.nonsense"] = torch.zeros(1)  # "layers.3" is not a prefix of it
    layer3["layers.3.attn_norm.weight"] = torch.zeros(64, dtype=BF16)  # block level, not attn.
    lw = layer_weights_from_tensors(tiny, 3, layer3)
    assert lw.layer == 3 and lw.index_wk.shape == (32, 32)


def test_bf16_wo_a_without_scale_is_accepted(tiny, tmp_path, layer3):
    fp8 = Fp8Weight(layer3["layers.3.attn.wo_a.weight"], layer3["layers.3.attn.wo_a.scale"])
    layer3["layers.3.attn.wo_a.weight"] = fp8.dequantize()
    del layer3["layers.3.attn.wo_a.scale"]
    want = fp8.dequantize()
    assert torch.equal(layer_weights_from_tensors(tiny, 3, layer3).wo_a, want)
    path = save_single(tmp_path / "bf16_wo_a.safetensors", layer3)
    assert torch.equal(load_layer_weights(path, tiny, layers=3)[3].wo_a, want)


def test_bf16_wo_a_with_scale_is_an_error(tiny, tmp_path, layer3, counting):
    layer3["layers.3.attn.wo_a.weight"] = layer3["layers.3.attn.wo_a.weight"].to(BF16)
    _check_both(tiny, tmp_path, layer3, 3, "layers.3.attn.wo_a.scale: unexpected",
                "must not have a scale", counting=counting)


def test_fp8_wo_a_without_scale_is_an_error(tiny, tmp_path, layer3, counting):
    del layer3["layers.3.attn.wo_a.scale"]
    _check_both(tiny, tmp_path, layer3, 3, "layers.3.attn.wo_a.scale: missing",
                "float8_e8m0fnu [1, 4]", counting=counting)


def test_directory_without_index(tmp_path, tiny):
    with pytest.raises(CheckpointError, match="neither model.safetensors.index.json nor model.safetensors"):
        load_layer_weights(tmp_path, tiny)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_layer_weights(tmp_path / "nowhere", tiny)


def test_single_model_safetensors_directory(tmp_path, tiny):
    save_single(tmp_path / "model.safetensors", random_checkpoint_tensors(tiny, [0, 1], seed=2))
    loaded = load_layer_weights(tmp_path, tiny, layers=[0, 1])
    assert_same_weights(loaded[1], random_layer_weights(tiny, 1, seed=2))


def test_index_lists_tensors_its_shard_lacks(tmp_path, tiny):
    write_synthetic_checkpoint(tmp_path, tiny, seed=0, layers=[0], max_shard_bytes=2**30)
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = "model-00001-of-00001.safetensors"
    index["weight_map"].update({"layers.1.attn." + n: shard for n in expected_tensors(tiny, 1)})
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"layers.1.attn.wq_a.weight: listed in the index under "
                                              f"{shard}, but that shard does not hold it"):
        load_layer_weights(tmp_path, tiny, layers=1)
    assert list(load_layer_weights(tmp_path, tiny, layers=0)) == [0]


# ---- check_layer_weights: dtypes, kinds and devices of what LayerWeights holds ----------------

def _as_fp8(w: Fp8Weight, **parts) -> Fp8Weight:
    return Fp8Weight(parts.get("weight", w.weight), parts.get("scale", w.scale))


# (id, layer, field, replacement from the valid weights, checkpoint name, found, expected)
BAD_HELD = [
    ("q_norm_f32", 0, "q_norm", lambda w: w.q_norm.float(), "q_norm.weight",
     "float32 [32]", "bfloat16 [32]"),
    ("kv_norm_f16", 0, "kv_norm", lambda w: w.kv_norm.half(), "kv_norm.weight",
     "float16 [32]", "bfloat16 [32]"),
    ("attn_sink_bf16", 0, "attn_sink", lambda w: w.attn_sink.bfloat16(), "attn_sink",
     "bfloat16 [8]", "float32 [8]"),
    ("wo_a_f32", 0, "wo_a", lambda w: w.wo_a.float(), "wo_a.weight",
     "float32 [32, 128]", "bfloat16 [32, 128]"),
    ("wo_a_still_fp8", 0, "wo_a", lambda w: quantize_fp8(w.wo_a.float()), "wo_a.weight",
     "Fp8Weight", "bfloat16 [32, 128]"),
    ("wq_b_dequantised", 0, "wq_b", lambda w: w.wq_b.dequantize(), "wq_b.weight",
     "bfloat16 [256, 32]", "Fp8Weight"),
    ("compressor_wkv_bf16_at_ratio_2", 1, "compressor_wkv", lambda w: w.compressor_wkv.bfloat16(),
     "compressor.wkv.weight", "bfloat16 [32, 64]", "float32 [32, 64]"),
    ("compressor_wgate_bf16_at_ratio_2", 1, "compressor_wgate", lambda w: w.compressor_wgate.bfloat16(),
     "compressor.wgate.weight", "bfloat16 [32, 64]", "float32 [32, 64]"),
    ("compressor_wkv_f32_at_ratio_1", 3, "compressor_wkv", lambda w: w.compressor_wkv.float(),
     "compressor.wkv.weight", "float32 [32, 64]", "bfloat16 [32, 64]"),
    ("compressor_norm_f32", 1, "compressor_norm", lambda w: w.compressor_norm.float(),
     "compressor.norm.weight", "float32 [32]", "bfloat16 [32]"),
    ("index_wk_f32", 3, "index_wk", lambda w: w.index_wk.float(), "indexer.wk.weight",
     "float32 [32, 32]", "bfloat16 [32, 32]"),
    ("index_k_norm_f32", 3, "index_k_norm", lambda w: w.index_k_norm.float(), "indexer.k_norm.weight",
     "float32 [32]", "bfloat16 [32]"),
    ("index_weights_proj_f32", 5, "index_weights_proj", lambda w: w.index_weights_proj.float(),
     "indexer.weights_proj.weight", "float32 [4, 64]", "bfloat16 [4, 64]"),
    ("index_wq_b_dequantised", 5, "index_wq_b", lambda w: w.index_wq_b.dequantize(),
     "indexer.wq_b.weight", "bfloat16 [128, 32]", "Fp8Weight"),
    ("attn_sink_list", 0, "attn_sink", lambda w: w.attn_sink.tolist(), "attn_sink",
     "list", "float32 [8]"),
]


@pytest.mark.parametrize("layer,field,bad,name,found,want", [c[1:] for c in BAD_HELD],
                         ids=[c[0] for c in BAD_HELD])
def test_check_layer_weights_dtypes(tiny, layer, field, bad, name, found, want):
    w = random_layer_weights(tiny, layer)
    with pytest.raises(CheckpointError) as e:
        ck.check_layer_weights(tiny, dataclasses.replace(w, **{field: bad(w)}))
    msg = str(e.value)
    for text in (f"layer {layer}", f"layers.{layer}.attn.{name}", field, found, want):
        assert text in msg, (text, msg)


# (id, layer, field, replacement, the misplaced part as named in the message)
ELSEWHERE = [
    ("q_norm", 0, "q_norm", lambda w: w.q_norm.to("meta"), "q_norm on meta"),
    ("attn_sink", 3, "attn_sink", lambda w: w.attn_sink.to("meta"), "attn_sink on meta"),
    ("fp8_scale", 1, "wq_a", lambda w: _as_fp8(w.wq_a, scale=w.wq_a.scale.to("meta")),
     "wq_a.scale on meta"),
    ("index_wk", 1, "index_wk", lambda w: w.index_wk.to("meta"), "index_wk on meta"),
]


@pytest.mark.parametrize("layer,field,bad,where", [c[1:] for c in ELSEWHERE], ids=[c[0] for c in ELSEWHERE])
def test_check_layer_weights_one_device(tiny, layer, field, bad, where):
    w = random_layer_weights(tiny, layer)
    with pytest.raises(CheckpointError) as e:
        ck.check_layer_weights(tiny, dataclasses.replace(w, **{field: bad(w)}))
    msg = str(e.value)
    for text in (f"layer {layer}", "one device", where, "on cpu"):
        assert text in msg, (text, msg)


def test_check_layer_weights_accepts_what_the_loader_builds(tiny, tmp_path, layer3):
    for L in range(len(tiny.layer_specs)):
        ck.check_layer_weights(tiny, random_layer_weights(tiny, L))
        ck.check_layer_weights(tiny, random_layer_weights(tiny, L).to("meta"))  # one device, any
    # a re-exported checkpoint's bf16 wo_a builds the same LayerWeights dtypes
    fp8 = Fp8Weight(layer3["layers.3.attn.wo_a.weight"], layer3["layers.3.attn.wo_a.scale"])
    layer3["layers.3.attn.wo_a.weight"] = fp8.dequantize()
    del layer3["layers.3.attn.wo_a.scale"]
    ck.check_layer_weights(tiny, layer_weights_from_tensors(tiny, 3, layer3))


def test_check_layer_weights_lists_every_problem(tiny):
    w = random_layer_weights(tiny, 1)
    bad = dataclasses.replace(w, q_norm=w.q_norm.float(), attn_sink=w.attn_sink[:4],
                              compressor_wgate=None)
    with pytest.raises(CheckpointError) as e:
        ck.check_layer_weights(tiny, bad)
    msg = str(e.value)
    assert "3 problem(s)" in msg
    assert "layers.1.attn.q_norm.weight: q_norm of layer 1 must be bfloat16, found float32 [32]" in msg
    assert "layers.1.attn.attn_sink: the config expects shape [8], the weights have [4]" in msg
    assert "layers.1.attn.compressor.wgate.weight: missing for layer 1" in msg


@pytest.mark.parametrize("cfg_arg,w_arg,texts", [
    ("tiny", None, ("cfg", "AttentionConfig", "'tiny'")),
    (None, {"q_norm": 1}, ("LayerWeights", "dict")),
], ids=["cfg_is_a_name", "weights_not_layer_weights"])
def test_check_layer_weights_wrong_kinds(tiny, cfg_arg, w_arg, texts):
    with pytest.raises(CheckpointError) as e:
        ck.check_layer_weights(tiny if cfg_arg is None else cfg_arg,
                               random_layer_weights(tiny, 0) if w_arg is None else w_arg)
    for text in texts:
        assert text in str(e.value), (text, str(e.value))


# ---- bad files and arguments: the file or argument and its value are named -------------------

def _spoil(path, how: str) -> None:
    data = open(path, "rb").read()
    content = {
        "truncated": data[: len(data) // 2],
        "header_only": data[:8],
        "garbage": bytes(range(256)) * 8,
        "json": b'{"weight_map": {}}',
        "empty": b"",
    }[how]
    with open(path, "wb") as f:
        f.write(content)


SPOILED = ["truncated", "header_only", "garbage", "json", "empty"]


@pytest.mark.parametrize("how", SPOILED)
def test_bad_single_file_names_it(tmp_path, tiny, how):
    path = save_single(tmp_path / "layer0.safetensors", random_checkpoint_tensors(tiny, [0]))
    _spoil(path, how)
    with pytest.raises(CheckpointError) as e:
        load_layer_weights(path, tiny, layers=0)
    assert path in str(e.value) and "safetensors" in str(e.value), str(e.value)


@pytest.mark.parametrize("how", SPOILED)
def test_bad_shard_names_it(tmp_path, tiny, how):
    write_synthetic_checkpoint(tmp_path, tiny, seed=0, layers=[0, 1], max_shard_bytes=12_000)
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    shard = weight_map["layers.1.attn.wq_a.weight"]
    assert shard != weight_map["layers.0.attn.wq_a.weight"]
    _spoil(tmp_path / shard, how)
    with pytest.raises(CheckpointError) as e:
        load_layer_weights(tmp_path, tiny, layers=1)
    assert str(tmp_path / shard) in str(e.value), str(e.value)


def test_index_not_json_names_it(tmp_path, tiny):
    write_synthetic_checkpoint(tmp_path, tiny, seed=0, layers=[0])
    index = tmp_path / "model.safetensors.index.json"
    index.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(CheckpointError, match="model.safetensors.index.json") as e:
        load_layer_weights(tmp_path, tiny, layers=0)
    assert str(index) in str(e.value)


def test_preset_name_instead_of_a_path(tmp_path, tiny, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no directory called "tiny" here
    with pytest.raises(CheckpointError) as e:
        load_layer_weights("tiny", tiny)
    msg = str(e.value)
    for text in ("'tiny'", "preset", "checkpoint directory", ".safetensors file", "random_layer_weights"):
        assert text in msg, (text, msg)


LOAD_ARGS = [
    ("arguments_swapped", lambda cfg, path: load_layer_weights(cfg, path), ("cfg", "AttentionConfig")),
    ("path_none", lambda cfg, path: load_layer_weights(None, cfg), ("path", "None", "checkpoint directory")),
    ("layer_fractional", lambda cfg, path: load_layer_weights(path, cfg, layers=[1.5]), ("layers", "1.5")),
    ("layer_bool", lambda cfg, path: load_layer_weights(path, cfg, layers=[True]), ("layers", "True")),
    ("layers_string", lambda cfg, path: load_layer_weights(path, cfg, layers="1"), ("layers", "'1'")),
    ("random_layer_fractional", lambda cfg, path: random_layer_weights(cfg, 1.5), ("layer", "1.5")),
    ("random_seed_fractional", lambda cfg, path: random_layer_weights(cfg, 1, seed=0.5), ("seed", "0.5")),
]


@pytest.mark.parametrize("call,texts", [c[1:] for c in LOAD_ARGS], ids=[c[0] for c in LOAD_ARGS])
def test_load_bad_arguments(tmp_path, tiny, call, texts):
    path = save_single(tmp_path / "w.safetensors", random_checkpoint_tensors(tiny, [0, 1]))
    with pytest.raises(CheckpointError) as e:
        call(tiny, path)
    for text in texts:
        assert text in str(e.value), (text, str(e.value))


WRITE_ARGS = [
    ("cfg_is_a_name", lambda cfg, path: write_synthetic_checkpoint(path, "tiny"), ("cfg", "'tiny'")),
    ("seed_fractional", lambda cfg, path: write_synthetic_checkpoint(path, cfg, seed=1.5), ("seed", "1.5")),
    ("seed_string", lambda cfg, path: write_synthetic_checkpoint(path, cfg, seed="7"), ("seed", "'7'")),
    ("shard_bytes_string", lambda cfg, path: write_synthetic_checkpoint(path, cfg, max_shard_bytes="1GB"),
     ("max_shard_bytes", "'1GB'")),
    ("shard_bytes_zero", lambda cfg, path: write_synthetic_checkpoint(path, cfg, max_shard_bytes=0),
     ("max_shard_bytes", "got 0")),
    ("layers_fractional", lambda cfg, path: write_synthetic_checkpoint(path, cfg, layers=[0.5]),
     ("layers", "0.5")),
    ("path_is_a_file", lambda cfg, path: write_synthetic_checkpoint(path / "config.json", cfg),
     ("config.json", "not a directory")),
]


@pytest.mark.parametrize("call,texts", [c[1:] for c in WRITE_ARGS], ids=[c[0] for c in WRITE_ARGS])
def test_write_synthetic_bad_arguments(tmp_path, tiny, call, texts):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError) as e:
        call(tiny, tmp_path)
    for text in texts:
        assert text in str(e.value), (text, str(e.value))
    assert sorted(os.listdir(tmp_path)) == ["config.json"]  # nothing written


# ---- corrupt data and JSON paths ---------------------------------------------------------------

def _data_offset(path) -> int:
    """Where a safetensors file's tensor data starts (8-byte header length + header)."""
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def test_garbage_data_in_a_shard_is_refused(tmp_path, tiny, capsys):
    """4000 bytes of 0xff over a shard's data: NaN codes in fp8, e8m0 and bf16 tensors alike.
    The load raises naming the shard file and the spoilt tensors; nothing is returned."""
    write_synthetic_checkpoint(tmp_path, tiny, seed=0, layers=[0])
    (shard,) = tmp_path.glob("model-*.safetensors")
    data = bytearray(shard.read_bytes())
    start = _data_offset(shard) + 100
    data[start:start + 4000] = b"\xff" * 4000
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as e:
        load_layer_weights(tmp_path, tiny, layers=[0])
    msg = str(e.value)
    assert str(shard) in msg and "NaN" in msg and "corrupt" in msg, msg
    assert "layers.0.attn." in msg, msg
    # the command line says so in one line, naming the shard
    from dsv41attn.cli import main
    with pytest.raises(SystemExit) as ex:
        main(["demo", "--checkpoint", str(tmp_path), "--layers", "0", "--tokens", "2"])
    err = capsys.readouterr().err.strip()
    assert ex.value.code == 2 and len(err.splitlines()) == 1, err
    assert str(shard) in err and "NaN" in err, err


E4M3_NAN, E8M0_NAN = 0x7F, 0xFF
NONFINITE = [  # (tensor, how it is spoilt, words of the message)
    ("wq_a.weight", lambda t: t.view(torch.uint8).view(-1).__setitem__(5, E4M3_NAN),
     ("1 of its", "float8_e4m3fn", "NaN codes")),
    ("wq_a.weight", lambda t: t.view(torch.uint8).view(-1).__setitem__(7, 0xFF),
     ("1 of its", "float8_e4m3fn", "NaN codes")),
    ("wkv.scale", lambda t: t.view(torch.uint8).view(-1).__setitem__(0, E8M0_NAN),
     ("float8_e8m0fnu", "NaN codes (0xff)")),
    ("q_norm.weight", lambda t: t.__setitem__(3, float("nan")), ("bfloat16", "NaN or Inf", "at [3]")),
    ("attn_sink", lambda t: t.__setitem__(2, float("inf")), ("float32", "NaN or Inf", "at [2]")),
    ("wo_a.weight", lambda t: t.view(torch.uint8)[1].__setitem__(2, E4M3_NAN), ("at [1, 2]",)),
]


@pytest.mark.parametrize("name,spoil,words", NONFINITE, ids=[f"{c[0]}-{i}" for i, c in enumerate(NONFINITE)])
def test_nonfinite_tensor_is_named(tmp_path, tiny, name, spoil, words):
    tensors = random_checkpoint_tensors(tiny, [0], seed=4)
    full = "layers.0.attn." + name
    spoil(tensors[full])
    path = save_single(tmp_path / "w.safetensors", tensors)
    with pytest.raises(CheckpointError) as e:
        load_layer_weights(path, tiny, layers=0)
    msg = str(e.value)
    assert "1 problem(s)" in msg and f"{full} in {path}" in msg, msg
    for w in words:
        assert w in msg, (w, msg)


def test_finite_weights_pass_the_check(tiny):
    for t in random_checkpoint_tensors(tiny, seed=5).values():
        assert ck.nonfinite_summary(t) is None
    # the largest e4m3 codes (+-448: 0x7e, 0xfe) are finite; 0x7f / 0xff are not
    codes = torch.tensor([0x7E, 0xFE, 0x00, 0x80], dtype=torch.uint8).view(FP8)
    assert ck.nonfinite_summary(codes) is None
    assert "NaN" in ck.nonfinite_summary(torch.tensor([0x7F], dtype=torch.uint8).view(FP8))


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_checkpoint_json_file_stands_for_its_directory(tmp_path, tiny, name):
    write_synthetic_checkpoint(tmp_path, tiny, seed=2, layers=[1], max_shard_bytes=12_000)
    loaded = load_layer_weights(tmp_path / name, tiny, layers=1)
    assert_same_weights(loaded[1], random_layer_weights(tiny, 1, seed=2))


def test_other_json_file_is_refused(tmp_path, tiny):
    other = tmp_path / "generation_config.json"
    other.write_text("{}")
    with pytest.raises(CheckpointError) as e:
        load_layer_weights(other, tiny, layers=0)
    msg = str(e.value)
    assert str(other) in msg and "JSON file" in msg and "checkpoint directory" in msg, msg
