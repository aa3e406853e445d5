"""AttentionConfig: the V4.1-Flash preset and its role table (README, "V4.1-Flash layer roles";
docs/numerics.md §1), HF config.json parsing and round trips, the golden fixtures' configs, and
every validation error."""
from __future__ import annotations

import copy
import json
import math
import re
import warnings

import pytest

from conftest import fixture_files
import torch
from safetensors import safe_open

from dsv41attn.cache import AttentionState
from dsv41attn.config import (
    AttentionConfig, ConfigError, ConfigWarning, Role, load_config, preset, yarn_correction_range,
)

FIXTURES = fixture_files()

S, F, RI, RU = Role.SWA, Role.FULL, Role.REINDEX, Role.REUSE


# ---------------------------------------------------------------------------------------------
# V4.1-Flash preset: the README's role table, written out independently of the config's helpers.
# ---------------------------------------------------------------------------------------------

def _flash_table() -> dict[int, tuple[Role, int, int | None, int | None]]:
    """layer -> (role, ratio, kv_source, index_source), straight from the README's role table."""
    t: dict[int, tuple[Role, int, int | None, int | None]] = {}
    for L in (0, 1, 40, 41, 42):
        t[L] = (S, 0, None, None)
    for L in (2, 8, 14):
        t[L] = (F, 2, L, L)
    t[20] = (F, 1, 20, 20)
    for L in (24, 28, 32, 36):
        t[L] = (RI, 1, 20, L)
    reuse = {
        range(3, 8): (2, 2, 2), range(9, 14): (2, 8, 8), range(15, 20): (2, 14, 14),
        range(21, 24): (1, 20, 20), range(25, 28): (1, 20, 24), range(29, 32): (1, 20, 28),
        range(33, 36): (1, 20, 32), range(37, 40): (1, 20, 36),
    }
    for rng, (r, kv, ix) in reuse.items():
        for L in rng:
            t[L] = (RU, r, kv, ix)
    assert sorted(t) == list(range(43))
    return t


FLASH_TABLE = _flash_table()


def test_flash_scalar_values(flash):
    assert (flash.dim, flash.n_layers, flash.n_mtp_layers) == (5120, 40, 3)
    assert (flash.n_heads, flash.head_dim, flash.rope_head_dim, flash.nope_head_dim) == (64, 512, 64, 448)
    assert (flash.q_lora_rank, flash.o_groups, flash.o_lora_rank) == (1280, 8, 1024)
    assert flash.heads_per_group == 8
    assert flash.window_size == 128
    assert flash.compress_ratios == (0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0)
    assert len(flash.compress_ratios) == 43
    assert flash.kv_source_layers == (2, 8, 14, 20)
    assert flash.index_source_layers == (2, 8, 14, 20, 24, 28, 32, 36)
    assert (flash.candidate_source_layer, flash.candidate_topk_blocks, flash.candidate_block_size) == (20, 2048, 8)
    assert flash.candidates_enabled
    assert (flash.index_n_heads, flash.index_head_dim, flash.index_topk) == (32, 128, 512)
    assert (flash.rope_theta, flash.compress_rope_theta) == (10000.0, 160000.0)
    assert (flash.rope_factor, flash.original_seq_len, flash.beta_fast, flash.beta_slow) == (16.0, 65536, 32.0, 1.0)
    assert flash.norm_eps == 1e-20
    assert flash.max_seq_len == 1048576
    assert flash.weight_block_size == 32
    assert flash.index_semantics == "fixed"


@pytest.mark.parametrize("L", range(43))
def test_flash_role_table(flash, L):
    role, ratio, kv, ix = FLASH_TABLE[L]
    spec = flash.layer(L)
    assert spec.layer == L
    assert (spec.role, spec.ratio, spec.kv_source, spec.index_source) == (role, ratio, kv, ix)
    assert spec.is_kv_source == (role is F)
    assert spec.is_index_source == (role in (F, RI))
    assert spec.has_gate == (L in (2, 8, 14))
    assert spec.is_candidate_source == (L == 20)
    assert spec.is_candidate_consumer == (L in (24, 28, 32, 36))
    assert spec.is_draft == (L >= 40)
    if ratio == 0:
        assert (spec.rope_base, spec.yarn) == (10000.0, False)
    else:
        assert (spec.rope_base, spec.yarn) == (160000.0, True)
    want_prefix = f"mtp.{L - 40}.attn." if L >= 40 else f"layers.{L}.attn."
    assert spec.weight_prefix == want_prefix


def test_flash_role_lists(flash):
    by_role = {r: [s.layer for s in flash.layer_specs if s.role is r] for r in Role}
    assert by_role[S] == [0, 1, 40, 41, 42]
    assert by_role[F] == [2, 8, 14, 20]
    assert by_role[RI] == [24, 28, 32, 36]
    assert by_role[RU] == [L for L in range(3, 40) if L not in (8, 14, 20, 24, 28, 32, 36)]
    assert flash.layer(40).weight_prefix == "mtp.0.attn."
    assert flash.layer(42).weight_prefix == "mtp.2.attn."
    assert flash.layer(39).weight_prefix == "layers.39.attn."
    assert flash.layer(25).kv_source == 20 and flash.layer(25).index_source == 24
    assert flash.layer(3).kv_source == 2 and flash.layer(3).index_source == 2


def test_flash_layer_out_of_range(flash):
    for bad in (43, -1, 100):
        with pytest.raises(ConfigError, match=rf"layer {bad} out of range: this config has layers 0\.\.42"):
            flash.layer(bad)


def test_flash_softmax_scale(flash):
    assert flash.softmax_scale == 512 ** -0.5


def test_flash_index_weight_scale_rounds_to_1_64_in_fp32(flash):
    # What the bf16 product actually uses: the scale as an fp32 scalar. This part is exact
    # today, so the float64 error above does not change any output.
    assert torch.tensor(flash.index_weight_scale, dtype=torch.float32).item() == 1 / 64
    assert math.isclose(flash.index_weight_scale, 1 / 64, rel_tol=1e-15)
    w = torch.randn(4, 7, 32, generator=torch.Generator().manual_seed(1)).bfloat16()
    assert torch.equal(w * flash.index_weight_scale, w * (1 / 64))


def test_flash_yarn_range(flash):
    assert yarn_correction_range(flash, flash.compress_rope_theta) == (15, 25)


def test_flash_packed_bytes(flash):
    state = AttentionState.allocate(flash, 1, capacity=16, layers=[2, 8, 14, 20])
    assert sorted(state.sources) == [2, 8, 14, 20]
    got = state.kv_bytes_per_token()
    assert got["compressed"] == 890
    # 4 rings of 128 rows of 512 fp8 + 16 ue8m0 bytes
    assert got["window_per_sequence"] == 4 * 128 * 528


def test_flash_packed_bytes_other_layer_sets(flash):
    # A Reuse layer alone pulls in its KV source's caches: 288 + 68 bytes per 2 tokens.
    state = AttentionState.allocate(flash, 1, capacity=16, layers=[3])
    assert sorted(state.sources) == [2]
    assert state.kv_bytes_per_token()["compressed"] == 178
    # Every layer (draft layers too): still only the four KV sources hold compressed rows.
    state = AttentionState.allocate(flash, 1, capacity=16)
    assert sorted(state.sources) == [2, 8, 14, 20]
    assert state.kv_bytes_per_token()["compressed"] == 890


def test_tiny_role_table(tiny):
    roles = [(s.role, s.ratio, s.kv_source, s.index_source) for s in tiny.layer_specs]
    assert roles == [
        (S, 0, None, None), (F, 2, 1, 1), (RU, 2, 1, 1), (F, 1, 3, 3), (RU, 1, 3, 3),
        (RI, 1, 3, 5), (RU, 1, 3, 5), (RI, 1, 3, 7), (S, 0, None, None),
    ]
    assert [s.layer for s in tiny.layer_specs if s.is_candidate_source] == [3]
    assert [s.layer for s in tiny.layer_specs if s.is_candidate_consumer] == [5, 7]
    assert tiny.layer(8).is_draft and tiny.layer(8).weight_prefix == "mtp.0.attn."


def test_preset_overrides_and_unknown():
    assert preset("tiny", window_size=16).window_size == 16
    assert preset("tiny", window_size=16) == preset("tiny").replace(window_size=16)
    with pytest.raises(ConfigError, match=r"unknown preset 'v4-pro'; known: v41-flash, tiny"):
        preset("v4-pro")


# ---------------------------------------------------------------------------------------------
# from_hf / to_hf
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["v41-flash", "tiny"])
def test_round_trip_presets(name):
    cfg = preset(name)
    back = AttentionConfig.from_hf(cfg.to_hf())
    assert back == cfg
    assert back.layer_specs == cfg.layer_specs
    # and through JSON text
    assert AttentionConfig.from_hf(json.loads(json.dumps(cfg.to_hf()))) == cfg


def test_round_trip_non_default_values(tiny):
    cfg = tiny.replace(
        rope_theta=5000.0, compress_rope_theta=80000.0, rope_factor=8.0, original_seq_len=32768,
        beta_fast=16.0, beta_slow=2.0, norm_eps=1e-6, max_seq_len=2048,
        candidate_source_layer=-1, candidate_topk_blocks=0, candidate_block_size=1,
        n_mtp_layers=0, compress_ratios=tiny.compress_ratios[:8], window_size=16,
    )
    assert not cfg.candidates_enabled
    back = AttentionConfig.from_hf(json.loads(json.dumps(cfg.to_hf())))
    assert back == cfg
    assert back.layer_specs == cfg.layer_specs
    assert not any(s.is_candidate_source or s.is_candidate_consumer for s in back.layer_specs)


def test_index_semantics_is_an_override_not_an_hf_key(tiny):
    cfg = tiny.replace(index_semantics="reference")
    assert "index_semantics" not in cfg.to_hf()["text_config"]
    assert AttentionConfig.from_hf(cfg.to_hf(), index_semantics="reference") == cfg


def test_from_hf_text_config_and_flat(tiny):
    hf = tiny.to_hf()
    assert set(hf) >= {"model_type", "text_config"}
    assert AttentionConfig.from_hf(hf) == tiny
    flat = dict(hf["text_config"])
    assert AttentionConfig.from_hf(flat) == tiny


def test_from_hf_file_and_directory(tiny, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(tiny.to_hf()))
    assert AttentionConfig.from_hf(path) == tiny
    assert AttentionConfig.from_hf(str(path)) == tiny
    assert AttentionConfig.from_hf(tmp_path) == tiny
    assert AttentionConfig.from_hf(str(tmp_path)) == tiny
    other = tmp_path / "flat.json"
    other.write_text(json.dumps(tiny.to_hf()["text_config"]))
    assert AttentionConfig.from_hf(other) == tiny
    assert load_config(str(path)) == tiny
    assert load_config(str(tmp_path)) == tiny
    assert load_config("tiny") == tiny


def test_from_hf_overrides_use_inference_names(tiny):
    cfg = AttentionConfig.from_hf(tiny.to_hf(), index_semantics="reference", max_seq_len=128)
    assert cfg.index_semantics == "reference" and cfg.max_seq_len == 128
    assert cfg == tiny.replace(index_semantics="reference", max_seq_len=128)


def test_from_hf_defaults_for_optional_keys(tiny):
    text = dict(tiny.to_hf()["text_config"])
    for k in ("num_key_value_heads", "candidate_source_layer_id", "candidate_topk_blocks",
              "candidate_block_size", "num_nextn_predict_layers", "rope_theta",
              "compress_rope_theta", "rope_scaling", "rms_norm_eps", "max_position_embeddings",
              "quantization_config"):
        del text[k]
    cfg = AttentionConfig.from_hf(text)
    assert cfg.candidate_source_layer == -1 and not cfg.candidates_enabled
    assert cfg.n_mtp_layers == 1  # len(compress_ratios) - num_hidden_layers
    assert (cfg.rope_theta, cfg.compress_rope_theta, cfg.rope_factor) == (10000.0, 160000.0, 16.0)
    assert (cfg.original_seq_len, cfg.beta_fast, cfg.beta_slow) == (65536, 32.0, 1.0)
    assert (cfg.norm_eps, cfg.max_seq_len, cfg.weight_block_size) == (1e-20, 4096, 32)


@pytest.mark.skipif(not FIXTURES, reason="golden fixtures not found")
@pytest.mark.parametrize("path", FIXTURES, ids=[p.name for p in FIXTURES])
def test_fixture_configs(path, tiny):
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    raw = json.loads(meta["config"])
    cfg = AttentionConfig.from_hf(raw)
    roles = [s.role for s in cfg.layer_specs]
    assert cfg.n_mtp_layers == 0
    assert len(cfg.layer_specs) == raw["num_hidden_layers"] == len(raw["compress_ratios"])
    if path.name.startswith("tiny"):
        assert roles == [S, F, RU, F, RU, RI, RU, RI]
        # the tiny preset is the fixture config plus one draft layer
        assert cfg == tiny.replace(n_mtp_layers=0, compress_ratios=tiny.compress_ratios[:8])
    elif path.name.startswith("v41_geometry"):
        assert roles == [S, F, RU, F, RI]
        assert (cfg.n_heads, cfg.head_dim, cfg.rope_head_dim) == (64, 512, 64)
        assert cfg.index_weight_scale == pytest.approx(1 / 64, rel=1e-15)
    assert cfg.layer(cfg.candidate_source_layer).is_candidate_source
    # and the parsed config survives its own round trip
    assert AttentionConfig.from_hf(cfg.to_hf()) == cfg


# ---------------------------------------------------------------------------------------------
# Validation errors: ConfigError naming the field and the value
# ---------------------------------------------------------------------------------------------

def _t() -> AttentionConfig:
    return preset("tiny")


def _hf(edit=None, drop=()) -> dict:
    hf = copy.deepcopy(_t().to_hf())
    text = hf["text_config"]
    for k in drop:
        del text[k]
    if edit:
        text.update(edit)
    return hf


BAD_CONFIGS = [
    ("no_kv_source_before",
     lambda: _t().replace(kv_source_layers=(3,)),
     r"layer 1 has compress ratio 2 but no KV source at or before it \(kv_source_layers=\[3\]\)"),
    ("kv_source_not_index_source",
     lambda: _t().replace(index_source_layers=(1, 5, 7)),
     r"KV source layer 3 is not in index_source_layers=\[1, 5, 7\]"),
    ("candidate_source_not_index_source",
     lambda: _t().replace(candidate_source_layer=4),
     r"candidate_source_layer=4 is not in index_source_layers=\[1, 3, 5, 7\]"),
    ("candidate_source_not_backbone",
     lambda: _t().replace(candidate_source_layer=8),
     r"candidate_source_layer=8 is not a backbone layer"),
    ("group_ratio_mismatch",
     lambda: _t().replace(compress_ratios=(0, 2, 1, 1, 1, 1, 1, 1, 0)),
     r"layer 2 has ratio 1 but its KV source 1 has ratio 2"),
    ("candidate_consumer_ratio_mismatch",
     lambda: _t().replace(candidate_source_layer=1),
     r"candidate consumer 3 has ratio 1 but the candidate source 1 has ratio 2"),
    ("heads_not_divisible_by_groups",
     lambda: _t().replace(o_groups=3),
     r"n_heads=8 is not divisible by o_groups=3"),
    ("candidate_blocks_too_few",
     lambda: _t().replace(candidate_topk_blocks=1),
     r"candidate_topk_blocks\*candidate_block_size = 1\*2 < index_topk=4"),
    ("candidate_blocks_zero",
     lambda: _t().replace(candidate_block_size=0),
     r"candidate_topk_blocks=3 and candidate_block_size=0 must be >= 1"),
    ("ratios_too_short",
     lambda: _t().replace(compress_ratios=(0, 2, 2, 1, 1, 1, 1, 1)),
     r"compress_ratios has 8 entries, expected n_layers \+ n_mtp_layers = 8 \+ 1 = 9"),
    ("ratios_too_long",
     lambda: _t().replace(compress_ratios=(0, 2, 2, 1, 1, 1, 1, 1, 0, 0)),
     r"compress_ratios has 10 entries, expected .* = 9"),
    ("ratio_negative",
     lambda: _t().replace(compress_ratios=(-1, 2, 2, 1, 1, 1, 1, 1, 0)),
     r"compress_ratios\[0\]=-1 must be an integer >= 0"),
    ("draft_layer_compresses",
     lambda: _t().replace(compress_ratios=(0, 2, 2, 1, 1, 1, 1, 1, 1)),
     r"compress_ratios\[8\]=1: draft layers run window attention only"),
    ("kv_sources_unsorted",
     lambda: _t().replace(kv_source_layers=(3, 1)),
     r"kv_source_layers=\[3, 1\] must be sorted and unique"),
    ("index_sources_repeated",
     lambda: _t().replace(index_source_layers=(1, 3, 3, 5, 7)),
     r"index_source_layers=\[1, 3, 3, 5, 7\] must be sorted and unique"),
    ("index_source_out_of_range",
     lambda: _t().replace(index_source_layers=(1, 3, 5, 7, 8)),
     r"index_source_layers entry 8 is not a backbone layer 0\.\.7"),
    ("kv_source_negative",
     lambda: _t().replace(kv_source_layers=(-1, 1, 3)),
     r"kv_source_layers entry -1 is not a backbone layer 0\.\.7"),
    ("index_source_ratio_zero",
     lambda: _t().replace(index_source_layers=(0, 1, 3, 5, 7)),
     r"index_source_layers entry 0 has compress ratio 0"),
    ("kv_source_ratio_zero",
     lambda: _t().replace(kv_source_layers=(0, 1, 3), index_source_layers=(0, 1, 3, 5, 7)),
     r"kv_source_layers entry 0 has compress ratio 0"),
    ("rope_head_dim_odd",
     lambda: _t().replace(rope_head_dim=7),
     r"rope_head_dim=7 must be even"),
    ("rope_head_dim_too_big",
     lambda: _t().replace(rope_head_dim=34),
     r"rope_head_dim=34 exceeds head_dim=32"),
    ("dim_not_mult_32",
     lambda: _t().replace(dim=48),
     r"dim=48 must be a multiple of 32"),
    ("q_lora_not_mult_32",
     lambda: _t().replace(q_lora_rank=40),
     r"q_lora_rank=40 must be a multiple of 32"),
    ("head_dim_not_mult_32",
     lambda: _t().replace(head_dim=48),
     r"head_dim=48 must be a multiple of 32"),
    ("index_head_dim_not_mult_32",
     lambda: _t().replace(index_head_dim=48),
     r"index_head_dim=48 must be a multiple of 32"),
    ("o_lora_not_mult_32",
     lambda: _t().replace(o_lora_rank=20),
     r"o_groups\*o_lora_rank=40 must be a multiple of 32"),
    ("n_heads_zero",
     lambda: _t().replace(n_heads=0),
     r"n_heads must be a positive integer, got 0"),
    ("window_float",
     lambda: _t().replace(window_size=8.0),
     r"window_size must be a positive integer, got 8\.0"),
    ("n_mtp_negative",
     lambda: _t().replace(n_mtp_layers=-1, compress_ratios=(0, 2, 2, 1, 1, 1, 1)),
     r"n_mtp_layers must be >= 0, got -1"),
    ("unknown_semantics",
     lambda: _t().replace(index_semantics="exact"),
     r"index_semantics must be one of \('fixed', 'reference'\), got 'exact'"),
    ("weight_block_128",
     lambda: _t().replace(weight_block_size=128),
     r"weight_block_size must be 32 .*got 128"),
    # HF dict edits
    ("hf_missing_keys",
     lambda: AttentionConfig.from_hf(_hf(drop=("hidden_size", "index_topk", "compress_ratios"))),
     r"config\.json lacks required attention keys: hidden_size, compress_ratios, index_topk"),
    ("hf_missing_key_flat",
     lambda: AttentionConfig.from_hf(_hf(drop=("sliding_window",))["text_config"]),
     r"lacks required attention keys: sliding_window$"),
    ("hf_kv_heads",
     lambda: AttentionConfig.from_hf(_hf({"num_key_value_heads": 8})),
     r"num_key_value_heads=8: V4\.1 attention has one shared KV head"),
    ("hf_rope_linear",
     lambda: AttentionConfig.from_hf(_hf({"rope_scaling": {"type": "linear", "factor": 4.0}})),
     r"rope_scaling type 'linear' is not supported; V4\.1 uses 'yarn'"),
    ("hf_rope_type_dynamic",
     lambda: AttentionConfig.from_hf(_hf({"rope_scaling": {"rope_type": "dynamic", "type": "yarn",
                                                          "factor": 4.0}})),
     r"rope_scaling type 'dynamic' is not supported"),
    ("hf_block_not_square",
     lambda: AttentionConfig.from_hf(_hf({"quantization_config": {"weight_block_size": [32, 64]}})),
     r"quantization_config\.weight_block_size=\[32, 64\] must be square"),
    ("hf_block_128",
     lambda: AttentionConfig.from_hf(_hf({"quantization_config": {"weight_block_size": [128, 128]}})),
     r"weight_block_size must be 32 .*got 128"),
    ("hf_scale_fmt",
     lambda: AttentionConfig.from_hf(_hf({"quantization_config": {"weight_block_size": [32, 32],
                                                                  "scale_fmt": "e4m3"}})),
     r"quantization_config\.scale_fmt='e4m3': expected 'ue8m0'"),
    ("hf_ratios_length",
     lambda: AttentionConfig.from_hf(_hf({"num_nextn_predict_layers": 3})),
     r"compress_ratios has 9 entries, expected num_hidden_layers \+ num_nextn_predict_layers "
     r"= 8 \+ 3 = 11"),
]


@pytest.mark.parametrize("build,match", [c[1:] for c in BAD_CONFIGS], ids=[c[0] for c in BAD_CONFIGS])
def test_validation_errors(build, match):
    with pytest.raises(ConfigError, match=match):
        build()


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)


def test_missing_config_file(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(ConfigError, match=r"config file not found: .*nope\.json"):
        AttentionConfig.from_hf(missing)
    with pytest.raises(ConfigError, match=r"config file not found: .*nope\.json"):
        load_config(str(missing))
    # a directory without config.json names the file it looked for
    with pytest.raises(ConfigError, match=r"config file not found: .*config\.json"):
        AttentionConfig.from_hf(tmp_path)


def test_fractional_ratio_rejected():
    with pytest.raises(ConfigError, match=r"compress_ratios\[1\]=2\.5 must be an integer"):
        _t().replace(compress_ratios=(0, 2.5, 2, 1, 1, 1, 1, 1, 0))


# ---------------------------------------------------------------------------------------------
# Values that cannot work, and inputs of the wrong kind: ConfigError naming the key and value
# ---------------------------------------------------------------------------------------------

def _hf_edit(**edit) -> dict:
    return _hf(edit)


def _yarn(**edit) -> dict:
    scaling = dict(_t().to_hf()["text_config"]["rope_scaling"], **edit)
    return _hf({"rope_scaling": scaling})


NAN, INF = float("nan"), float("inf")

# (id, build, texts the message must contain: the key and the value)
BAD_VALUES = [
    # direct construction: the inference name (and the HF key where it differs)
    ("norm_eps_negative", lambda: _t().replace(norm_eps=-1e-6), ("norm_eps", "-1e-06", "rms_norm_eps")),
    ("norm_eps_nan", lambda: _t().replace(norm_eps=NAN), ("norm_eps", "nan")),
    ("norm_eps_inf", lambda: _t().replace(norm_eps=INF), ("norm_eps", "inf")),
    ("rope_theta_zero", lambda: _t().replace(rope_theta=0.0), ("rope_theta", "0.0")),
    ("rope_theta_negative", lambda: _t().replace(rope_theta=-10000.0), ("rope_theta", "-10000.0")),
    ("rope_theta_nan", lambda: _t().replace(rope_theta=NAN), ("rope_theta", "nan")),
    ("compress_rope_theta_zero", lambda: _t().replace(compress_rope_theta=0),
     ("compress_rope_theta", "got 0")),
    ("compress_rope_theta_negative", lambda: _t().replace(compress_rope_theta=-1.0),
     ("compress_rope_theta", "-1.0")),
    ("compress_rope_theta_nan", lambda: _t().replace(compress_rope_theta=NAN),
     ("compress_rope_theta", "nan")),
    ("rope_factor_zero", lambda: _t().replace(rope_factor=0.0), ("rope_factor", "0.0")),
    ("beta_slow_zero", lambda: _t().replace(beta_slow=0.0), ("beta_slow", "0.0")),
    ("rope_theta_string", lambda: _t().replace(rope_theta="10000"), ("rope_theta", "'10000'")),
    ("original_seq_len_zero", lambda: _t().replace(original_seq_len=0),
     ("original_seq_len", "got 0", "original_max_position_embeddings")),
    ("index_n_heads_bool", lambda: _t().replace(index_n_heads=True), ("index_n_heads", "True")),
    ("original_seq_len_fractional", lambda: _t().replace(original_seq_len=65536.5),
     ("original_seq_len", "65536.5")),
    ("n_mtp_layers_bool", lambda: _t().replace(n_mtp_layers=True), ("n_mtp_layers", "True")),
    ("candidate_topk_blocks_fractional", lambda: _t().replace(candidate_topk_blocks=2.5),
     ("candidate_topk_blocks", "2.5")),
    ("candidate_source_float", lambda: _t().replace(candidate_source_layer=3.0),
     ("candidate_source_layer", "3.0")),
    ("candidate_source_below_minus_1", lambda: _t().replace(candidate_source_layer=-2),
     ("candidate_source_layer", "-2")),
    ("compress_ratios_string", lambda: _t().replace(compress_ratios="022111110"),
     ("compress_ratios", "'022111110'")),
    ("compress_ratios_none", lambda: _t().replace(compress_ratios=None), ("compress_ratios", "None")),
    ("kv_source_string_entry", lambda: _t().replace(kv_source_layers=("1", 3)),
     ("kv_source_layers[0]", "'1'")),
    ("replace_unknown_field", lambda: _t().replace(rms_norm_eps=1e-6), ("rms_norm_eps", "norm_eps")),
    ("layer_fractional", lambda: _t().layer(2.5), ("layer", "2.5")),
    # from_hf: the HF key
    ("hf_rms_norm_eps_negative", lambda: AttentionConfig.from_hf(_hf_edit(rms_norm_eps=-1e-6)),
     ("rms_norm_eps", "-1e-06")),
    ("hf_rms_norm_eps_nan", lambda: AttentionConfig.from_hf(_hf_edit(rms_norm_eps=NAN)),
     ("rms_norm_eps", "nan")),
    ("hf_rope_theta_zero", lambda: AttentionConfig.from_hf(_hf_edit(rope_theta=0)),
     ("rope_theta", "got 0")),
    ("hf_rope_theta_negative", lambda: AttentionConfig.from_hf(_hf_edit(rope_theta=-10000)),
     ("rope_theta", "-10000")),
    ("hf_rope_theta_nan", lambda: AttentionConfig.from_hf(_hf_edit(rope_theta=NAN)),
     ("rope_theta", "nan")),
    ("hf_rope_theta_string", lambda: AttentionConfig.from_hf(_hf_edit(rope_theta="1e4")),
     ("rope_theta", "'1e4'")),
    ("hf_compress_rope_theta_zero", lambda: AttentionConfig.from_hf(_hf_edit(compress_rope_theta=0)),
     ("compress_rope_theta", "got 0")),
    ("hf_compress_rope_theta_negative",
     lambda: AttentionConfig.from_hf(_hf_edit(compress_rope_theta=-160000.0)),
     ("compress_rope_theta", "-160000.0")),
    ("hf_compress_rope_theta_nan", lambda: AttentionConfig.from_hf(_hf_edit(compress_rope_theta=NAN)),
     ("compress_rope_theta", "nan")),
    ("hf_original_max_position_embeddings_zero",
     lambda: AttentionConfig.from_hf(_yarn(original_max_position_embeddings=0)),
     ("rope_scaling.original_max_position_embeddings", "got 0")),
    ("hf_original_max_position_embeddings_fractional",
     lambda: AttentionConfig.from_hf(_yarn(original_max_position_embeddings=65536.5)),
     ("rope_scaling.original_max_position_embeddings", "65536.5")),
    ("hf_yarn_factor_zero", lambda: AttentionConfig.from_hf(_yarn(factor=0)),
     ("rope_scaling.factor", "got 0")),
    ("hf_hidden_size_fractional", lambda: AttentionConfig.from_hf(_hf_edit(hidden_size=64.5)),
     ("hidden_size", "64.5")),
    ("hf_heads_bool", lambda: AttentionConfig.from_hf(_hf_edit(num_attention_heads=True)),
     ("num_attention_heads", "True")),
    ("hf_max_position_embeddings_fractional",
     lambda: AttentionConfig.from_hf(_hf_edit(max_position_embeddings=4096.5)),
     ("max_position_embeddings", "4096.5")),
    ("hf_candidate_block_size_bool", lambda: AttentionConfig.from_hf(_hf_edit(candidate_block_size=True)),
     ("candidate_block_size", "True")),
    ("hf_nextn_fractional", lambda: AttentionConfig.from_hf(_hf_edit(num_nextn_predict_layers=1.5)),
     ("num_nextn_predict_layers", "1.5")),
    ("hf_compress_ratios_string",
     lambda: AttentionConfig.from_hf(_hf_edit(compress_ratios="0,2,2,1,1,1,1,1,0")),
     ("compress_ratios", "'0,2,2,1,1,1,1,1,0'")),
    ("hf_compress_ratios_none", lambda: AttentionConfig.from_hf(_hf_edit(compress_ratios=None)),
     ("compress_ratios", "None")),
    ("hf_compress_ratios_none_with_nextn",
     lambda: AttentionConfig.from_hf(_hf(drop=("num_nextn_predict_layers",), edit={"compress_ratios": None})),
     ("compress_ratios", "None")),
    ("hf_index_source_ids_string", lambda: AttentionConfig.from_hf(_hf_edit(index_source_layer_ids="1,3")),
     ("index_source_layer_ids", "'1,3'")),
    ("hf_rope_scaling_string", lambda: AttentionConfig.from_hf(_hf_edit(rope_scaling="yarn")),
     ("rope_scaling", "'yarn'")),
    ("hf_block_size_int",
     lambda: AttentionConfig.from_hf(_hf_edit(quantization_config={"weight_block_size": 32})),
     ("quantization_config.weight_block_size", "=32")),
    ("hf_block_size_bools",
     lambda: AttentionConfig.from_hf(_hf_edit(quantization_config={"weight_block_size": [True, True]})),
     ("quantization_config.weight_block_size", "[True, True]")),
    ("hf_quantization_config_string",
     lambda: AttentionConfig.from_hf(_hf_edit(quantization_config="fp8")),
     ("quantization_config", "'fp8'")),
    ("hf_text_config_string", lambda: AttentionConfig.from_hf({"text_config": "deepseek_v41"}),
     ("text_config", "'deepseek_v41'")),
    ("hf_not_a_dict", lambda: AttentionConfig.from_hf(42), ("source", "42")),
    ("hf_none", lambda: AttentionConfig.from_hf(None), ("source", "None")),
    ("hf_override_hf_name", lambda: AttentionConfig.from_hf(_hf(), rms_norm_eps=1e-6),
     ("rms_norm_eps", "norm_eps")),
    # presets / load_config
    ("preset_unhashable", lambda: preset(["tiny"]), ("preset", "['tiny']")),
    ("preset_unknown_override", lambda: preset("tiny", window=16), ("'window'", "window_size")),
    ("load_config_none", lambda: load_config(None), ("source", "None")),
    ("load_config_unknown_name", lambda: load_config("v4-pro"), ("v4-pro", "v41-flash, tiny")),
]


@pytest.mark.parametrize("build,texts", [c[1:] for c in BAD_VALUES], ids=[c[0] for c in BAD_VALUES])
def test_bad_values_name_key_and_value(build, texts):
    with pytest.raises(ConfigError) as e:
        build()
    for text in texts:
        assert text in str(e.value), (text, str(e.value))


def _tiny_json() -> str:
    return json.dumps(_t().to_hf(), indent=2)


BAD_FILES = [
    ("truncated", lambda: _tiny_json()[: len(_tiny_json()) // 2].encode()),
    ("not_json", lambda: b"hidden_size = 64\n"),
    ("binary", lambda: b"\x89PNG\r\n\x1a\n\xff\xfe\x00\x01"),
    ("empty", lambda: b""),
    ("json_list", lambda: b"[1, 2, 3]"),
    ("text_config_list", lambda: json.dumps({"text_config": [1, 2]}).encode()),
]


@pytest.mark.parametrize("content", [c[1] for c in BAD_FILES], ids=[c[0] for c in BAD_FILES])
@pytest.mark.parametrize("as_dir", [False, True], ids=["file", "dir"])
def test_bad_config_file_names_the_path(tmp_path, content, as_dir):
    path = tmp_path / "config.json"
    path.write_bytes(content())
    for load in (AttentionConfig.from_hf, load_config):
        with pytest.raises(ConfigError) as e:
            load(str(tmp_path) if as_dir else str(path))
        assert str(path) in str(e.value), str(e.value)


def test_numpy_scalars_are_plain_ints_and_floats(tiny):
    np = pytest.importorskip("numpy")
    # numpy scalars from a caller are plain int / float once validated
    cfg = tiny.replace(window_size=np.int64(16), rope_theta=np.float32(5000.0))
    assert cfg == tiny.replace(window_size=16, rope_theta=5000.0)
    assert type(cfg.window_size) is int and type(cfg.rope_theta) is float
    # an int where a float is expected is fine (rope_theta: 10000)
    assert AttentionConfig.from_hf(_hf({"rope_theta": 10000})) == tiny


# A known key with a value of the wrong type raises, naming the key: an integer key takes an
# integer, so 2.0 in compress_ratios (or 64.0 as hidden_size) is refused, with how to write it.
INTEGRAL_FLOATS = [
    ({"hidden_size": 64.0}, "hidden_size", "64.0", "write 64"),
    ({"max_position_embeddings": 4096.0}, "max_position_embeddings", "4096.0", "write 4096"),
    ({"candidate_block_size": 2.0}, "candidate_block_size", "2.0", "write 2"),
    ({"compress_ratios": [0, 2.0, 2, 1, 1, 1, 1, 1, 0]}, "compress_ratios[1]", "2.0", "write 2"),
    ({"kv_source_layer_ids": [1.0, 3]}, "kv_source_layer_ids[0]", "1.0", "write 1"),
    ({"quantization_config": {"weight_block_size": [32.0, 32.0]}},
     "quantization_config.weight_block_size", "[32.0, 32.0]", "pair of integers"),
]


@pytest.mark.parametrize("edit,key,value,hint", INTEGRAL_FLOATS, ids=[c[1] for c in INTEGRAL_FLOATS])
def test_integral_floats_in_integer_keys_are_refused(edit, key, value, hint):
    with pytest.raises(ConfigError) as e:
        AttentionConfig.from_hf(_hf(edit))
    msg = str(e.value)
    assert msg.startswith(key) and value in msg and hint in msg, msg


def test_direct_construction_refuses_float_ratios():
    with pytest.raises(ConfigError, match=r"compress_ratios\[1\]=2\.0 must be an integer .*write 2"):
        _t().replace(compress_ratios=(0, 2.0, 2, 1, 1, 1, 1, 1, 0))


# Messages of a config.json name the keys the user wrote, not the inference fields.
HF_NAMED = [
    ({"hidden_size": "64"}, "hidden_size must be a positive integer, got '64'", "dim"),
    ({"sliding_window": 0}, "sliding_window must be a positive integer, got 0", "window_size"),
    ({"max_position_embeddings": 0}, "max_position_embeddings must be a positive integer, got 0",
     "max_seq_len"),
    ({"num_attention_heads": 6}, "num_attention_heads=6 is not divisible by o_groups=4", "n_heads"),
    ({"qk_rope_head_dim": 7}, "qk_rope_head_dim=7 must be even", "rope_head_dim"),
    ({"kv_source_layer_ids": [3]}, "(kv_source_layer_ids=[3])", "kv_source_layers"),
    ({"candidate_topk_blocks": 1},
     "candidate_topk_blocks*candidate_block_size = 1*2 < index_topk=4", "candidate_source_layer"),
    ({"candidate_source_layer_id": 8}, "candidate_source_layer_id=8 is not a backbone layer",
     "candidate_source_layer="),
    ({"rms_norm_eps": -1.0}, "rms_norm_eps (the RMSNorm epsilon) must be", "norm_eps ("),
]


@pytest.mark.parametrize("edit,text,absent", HF_NAMED, ids=[next(iter(c[0])) for c in HF_NAMED])
def test_hf_messages_name_the_config_json_keys(edit, text, absent):
    hf = _hf(edit)
    if "num_attention_heads" in edit:
        hf["text_config"]["o_groups"] = 4
    with pytest.raises(ConfigError) as e:
        AttentionConfig.from_hf(hf)
    msg = str(e.value)
    assert text in msg, msg
    assert not re.search(rf"(?<![\w.]){re.escape(absent)}", msg), msg  # the field name, alone


def test_overrides_keep_their_inference_names(tiny):
    with pytest.raises(ConfigError) as e:
        AttentionConfig.from_hf(_hf(), window_size=0)
    assert str(e.value).startswith("window_size must be a positive integer, got 0 "
                                   "(config.json sliding_window)"), str(e.value)
    # and direct construction keeps its names (with the HF key as a hint)
    with pytest.raises(ConfigError, match=r"^dim must be a positive integer, got '64' "
                                          r"\(config.json hidden_size\)$"):
        tiny.replace(dim="64")


def test_file_messages_name_the_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_hf({"sliding_window": -8})))
    for load in (AttentionConfig.from_hf, load_config):
        with pytest.raises(ConfigError) as e:
            load(str(tmp_path))
        assert str(e.value).startswith(f"config file {path}: sliding_window must be"), str(e.value)


def test_ratios_shorter_than_the_layers():
    hf = _hf(drop=("num_nextn_predict_layers",), edit={"compress_ratios": [0, 2, 2, 1]})
    with pytest.raises(ConfigError, match=r"compress_ratios has 4 entries, fewer than "
                                          r"num_hidden_layers=8"):
        AttentionConfig.from_hf(hf)


# Unknown keys: the rest of the model's keys are ignored; one that looks like a misspelt
# attention key warns (its default would otherwise be used silently).
def test_model_keys_do_not_warn(tiny):
    hf = _hf({"vocab_size": 129280, "qk_nope_head_dim": 448, "v_head_dim": 512,
              "n_routed_experts": 256, "kv_lora_rank": 512, "some_future_key": 1})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert AttentionConfig.from_hf(hf) == tiny
        for name in ("tiny", "v41-flash"):
            AttentionConfig.from_hf(preset(name).to_hf())


@pytest.mark.parametrize("typo,meant", [("rope_thetta", "rope_theta"),
                                        ("compress_rope_thet", "compress_rope_theta"),
                                        ("rms_norm_epsilon", "rms_norm_eps")])
def test_misspelt_key_warns(tiny, typo, meant):
    hf = _hf({typo: 1.0}, drop=(meant,))
    with pytest.warns(ConfigWarning, match=rf"'{typo}' is not one dsv41attn reads; did you mean "
                                           rf"'{meant}'\? \('{meant}' is not given\)"):
        assert AttentionConfig.from_hf(hf) == tiny  # the default of the key meant


def test_misspelt_required_key_is_named_in_the_error():
    hf = _hf({"sliding_windw": 8}, drop=("sliding_window",))
    with pytest.warns(ConfigWarning, match="sliding_windw"):
        with pytest.raises(ConfigError, match=r"lacks required attention keys: sliding_window "
                                              r"\(found 'sliding_windw' for 'sliding_window'"):
            AttentionConfig.from_hf(hf)
