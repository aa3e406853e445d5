"""AttentionConfig: the attention keys of a DeepSeek-V4.1 ``config.json``, validated, and the
per-layer roles derived from them (docs/numerics.md §1).

One source of truth: every shape, role, RoPE table and weight name elsewhere in the package is
derived from an ``AttentionConfig`` and a layer id.
"""
from __future__ import annotations

import contextvars
import dataclasses
import difflib
import enum
import json
import math
import numbers
import operator
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

SEMANTICS = ("fixed", "reference")

# Inference name -> HF config.json key, where they differ: validation messages name both, so an
# error from ``from_hf`` points at the key to fix in the file.
HF_KEYS = {
    "dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
    "rope_head_dim": "qk_rope_head_dim", "window_size": "sliding_window",
    "kv_source_layers": "kv_source_layer_ids", "index_source_layers": "index_source_layer_ids",
    "candidate_source_layer": "candidate_source_layer_id", "n_mtp_layers": "num_nextn_predict_layers",
    "rope_factor": "rope_scaling.factor",
    "original_seq_len": "rope_scaling.original_max_position_embeddings",
    "beta_fast": "rope_scaling.beta_fast", "beta_slow": "rope_scaling.beta_slow",
    "norm_eps": "rms_norm_eps", "max_seq_len": "max_position_embeddings",
    "weight_block_size": "quantization_config.weight_block_size",
}
_POSITIVE_INTS = (
    "dim", "n_layers", "n_heads", "head_dim", "rope_head_dim", "q_lora_rank", "o_groups",
    "o_lora_rank", "window_size", "index_n_heads", "index_head_dim", "index_topk",
    "original_seq_len", "max_seq_len", "weight_block_size",
)
_OTHER_INTS = ("n_mtp_layers", "candidate_source_layer", "candidate_topk_blocks", "candidate_block_size")
_INT_LISTS = ("compress_ratios", "kv_source_layers", "index_source_layers")
# float field -> (lower bound, whether the bound itself is allowed, what the value is)
_FLOATS = {
    "rope_theta": (1.0, False, "the RoPE base of ratio-0 layers"),
    "compress_rope_theta": (1.0, False, "the RoPE base of compressing layers"),
    "rope_factor": (0.0, False, "the YaRN frequency divisor"),
    "beta_fast": (0.0, False, "a YaRN ramp bound in rotations"),
    "beta_slow": (0.0, False, "a YaRN ramp bound in rotations"),
    "norm_eps": (0.0, True, "the RMSNorm epsilon"),
}


# While ``from_hf`` builds a config: the fields whose value came from a config.json key.
# Validation messages then name those fields by the key the user wrote (``hidden_size``, not
# ``dim``); fields given as overrides, or built directly, keep their inference names.
_FROM_FILE: contextvars.ContextVar[frozenset] = contextvars.ContextVar("_FROM_FILE",
                                                                       default=frozenset())


def _key(name: str) -> str:
    """A field as the user wrote it: its config.json key when it came from one, else its name."""
    return HF_KEYS.get(name, name) if name in _FROM_FILE.get() else name


def _hf(name: str) -> str:
    """The suffix `` (config.json KEY)`` for a field given by its inference name whose HF key
    differs from it (none when the message already names the key)."""
    if name in _FROM_FILE.get():
        return ""
    return f" (config.json {HF_KEYS[name]})" if name in HF_KEYS else ""


def _int_hint(v: Any) -> str:
    """For an integral float where an integer is needed: how to write it instead."""
    if isinstance(v, float) and v.is_integer():
        return f" (an integer has no decimal point: write {int(v)}, not {v!r})"
    return ""


def as_index(v: Any) -> int | None:
    """``v`` as an int if it is one (numpy and 0-d integer torch values too; not bools), else None."""
    if isinstance(v, bool):
        return None
    try:
        return operator.index(v)
    except TypeError:
        return None


def _is_int(v: Any) -> bool:
    return as_index(v) is not None


def _is_real(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


class ConfigError(ValueError):
    """An inconsistent or incomplete attention config; the message names the field (by its
    config.json key when it came from one)."""


class ConfigWarning(UserWarning):
    """A config.json key dsv41attn does not read that looks like a misspelt one it does."""


class Role(str, enum.Enum):
    """The CSA2 layer mode (docs/numerics.md §1)."""

    SWA = "SWA"  # ratio 0: window attention only
    FULL = "Full"  # KV source: compressor, index keys, own indexer
    REINDEX = "Reindex"  # index source, not a KV source: own indexer over its source's keys
    REUSE = "Reuse"  # ratio > 0, neither: source's compressed rows and top-k


@dataclass(frozen=True)
class LayerSpec:
    """Everything about layer ``layer`` that follows from the config (no weights, no state).

    ``kv_source``/``index_source`` are the layers whose compressed rows / top-k this layer uses
    (itself for sources; None for SWA). ``weight_prefix`` is the checkpoint name prefix.
    """

    layer: int
    role: Role
    ratio: int
    kv_source: int | None
    index_source: int | None
    is_candidate_source: bool
    is_candidate_consumer: bool
    rope_base: float
    yarn: bool
    is_draft: bool
    weight_prefix: str
    candidate_source: int | None = None  # the candidate source a consumer reads

    @property
    def reads(self) -> tuple[int, ...]:
        """The layers whose publications this layer reads in the same step (its KV source,
        its index source, the candidate source for a consumer), itself excluded."""
        return tuple(sorted({self.kv_source, self.index_source, self.candidate_source}
                            - {None, self.layer}))

    @property
    def is_kv_source(self) -> bool:
        return self.role is Role.FULL

    @property
    def is_index_source(self) -> bool:
        return self.role in (Role.FULL, Role.REINDEX)

    @property
    def has_gate(self) -> bool:
        """KV sources with ratio > 1 pool their groups with a learned per-channel gate."""
        return self.is_kv_source and self.ratio > 1


@dataclass(frozen=True)
class AttentionConfig:
    """The V4.1 attention hyper-parameters, with inference-code names (their config.json keys:
    ``HF_KEYS``).

    ``compress_ratios`` has ``n_layers + n_mtp_layers`` entries (draft layers last, ratio 0).
    ``max_seq_len`` bounds positions (HF ``max_position_embeddings``); results do not depend on
    it. ``index_semantics`` picks the index-key semantics (docs/numerics.md §7): "fixed"
    (default: a KV source publishes its own index keys before scoring) or "reference"
    (DeepSeek's code as it is).
    """

    dim: int
    n_layers: int
    n_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window_size: int
    compress_ratios: tuple[int, ...]
    kv_source_layers: tuple[int, ...]
    index_source_layers: tuple[int, ...]
    candidate_source_layer: int
    candidate_topk_blocks: int
    candidate_block_size: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_mtp_layers: int = 0
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_factor: float = 16.0
    original_seq_len: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    norm_eps: float = 1e-20
    max_seq_len: int = 4096
    weight_block_size: int = 32
    index_semantics: str = "fixed"
    layer_specs: tuple[LayerSpec, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in _INT_LISTS:
            values = getattr(self, name)
            if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
                raise ConfigError(f"{_key(name)} must be a list of integers, got "
                                  f"{type(values).__name__} {values!r}{_hf(name)}")
            for i, v in enumerate(values):
                # ints only: 2.0, 2.5, True and "2" are all refused, naming the entry
                if not _is_int(v):
                    raise ConfigError(f"{_key(name)}[{i}]={v!r} must be an integer"
                                      f"{_int_hint(v)}{_hf(name)}")
            object.__setattr__(self, name, tuple(int(v) for v in values))
        self._validate()  # messages show the values as given
        # validated numpy / other integral and real scalars are stored as plain int / float
        for name in _POSITIVE_INTS + _OTHER_INTS:
            object.__setattr__(self, name, int(getattr(self, name)))
        for name in _FLOATS:
            object.__setattr__(self, name, float(getattr(self, name)))
        specs = tuple(self._derive(layer) for layer in range(self.n_layers + self.n_mtp_layers))
        object.__setattr__(self, "layer_specs", specs)

    # ---- derived quantities -------------------------------------------------------------
    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.head_dim ** -0.5

    @property
    def index_weight_scale(self) -> float:
        """``index_head_dim^-0.5 · index_n_heads^-0.5``, the reference's product (1/64 for
        V4.1-Flash once rounded to fp32, the precision the bf16 product uses)."""
        return self.index_head_dim ** -0.5 * self.index_n_heads ** -0.5

    @property
    def candidates_enabled(self) -> bool:
        return self.candidate_source_layer >= 0

    @property
    def heads_per_group(self) -> int:
        return self.n_heads // self.o_groups

    def layer(self, layer: int) -> LayerSpec:
        """The spec of backbone layer ``layer`` (0..n_layers-1) or draft layer (n_layers..)."""
        index = as_index(layer)
        if index is None:
            raise ConfigError(f"layer must be an integer layer id, got {type(layer).__name__} {layer!r}")
        if not 0 <= index < len(self.layer_specs):
            raise ConfigError(
                f"layer {layer} out of range: this config has layers 0..{len(self.layer_specs) - 1}"
            )
        return self.layer_specs[index]

    def kv_src(self, layer: int) -> int | None:
        """The largest KV source <= layer (None if there is none)."""
        return max((s for s in self.kv_source_layers if s <= layer), default=None)

    def idx_src(self, layer: int) -> int | None:
        """The largest index source <= layer (None if there is none)."""
        return max((s for s in self.index_source_layers if s <= layer), default=None)

    def replace(self, **changes: Any) -> "AttentionConfig":
        """A copy with ``changes`` (inference field names) applied and validated."""
        _check_field_names(changes, "replace")
        return dataclasses.replace(self, **changes)

    # ---- construction --------------------------------------------------------------------
    @classmethod
    def from_hf(cls, source: "str | os.PathLike | Mapping[str, Any]", **overrides: Any) -> "AttentionConfig":
        """Build from a HF ``config.json``: a path to the file, a checkpoint directory holding
        it, or the parsed dict. V4.1 keeps the text model under ``text_config``; a flat dict
        (as in the fixtures) is accepted too. ``overrides`` use inference names."""
        _check_field_names(overrides, "from_hf")
        if isinstance(source, Mapping):
            raw, where = source, "config dict"
        elif isinstance(source, (str, os.PathLike)):
            path = os.fspath(source)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            if not os.path.isfile(path):
                raise ConfigError(f"config file not found: {path}")
            try:
                with open(path, encoding="utf-8") as f:
                    raw = json.load(f)
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ConfigError(f"config file {path} is not a readable JSON config: {e}") from e
            where = f"config file {path}"
        else:
            raise ConfigError(f"from_hf: source must be a config.json path, a checkpoint directory "
                              f"or a dict, got {type(source).__name__} {source!r}")
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{where}: expected a JSON object of config keys, got "
                              f"{type(raw).__name__} {raw!r:.200}")
        text = raw.get("text_config", raw)
        if not isinstance(text, Mapping):
            raise ConfigError(f"{where}: text_config={text!r} must be an object holding the text "
                              f"model's keys, got {type(text).__name__}")
        # Messages of a file name it; those of a dict (the caller's own) need no prefix.
        prefix = f"{where}: " if where.startswith("config file") else ""
        try:
            _warn_unknown_keys(text, where)
            fields = _from_hf_keys(text)
            token = _FROM_FILE.set(frozenset(fields) - set(overrides))
            try:
                return cls(**{**fields, **overrides})
            finally:
                _FROM_FILE.reset(token)
        except ConfigError as e:
            if not prefix:
                raise
            raise ConfigError(prefix + str(e)) from None

    def to_hf(self) -> dict[str, Any]:
        """The HF ``config.json`` dict (text model under ``text_config``) that round-trips every
        HF key. ``index_semantics`` is ours, not an HF key: pass it to from_hf as an override."""
        text = {
            "hidden_size": self.dim,
            "num_hidden_layers": self.n_layers,
            "num_nextn_predict_layers": self.n_mtp_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": 1,
            "head_dim": self.head_dim,
            "qk_rope_head_dim": self.rope_head_dim,
            "q_lora_rank": self.q_lora_rank,
            "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank,
            "sliding_window": self.window_size,
            "compress_ratios": list(self.compress_ratios),
            "kv_source_layer_ids": list(self.kv_source_layers),
            "index_source_layer_ids": list(self.index_source_layers),
            "candidate_source_layer_id": self.candidate_source_layer,
            "candidate_topk_blocks": self.candidate_topk_blocks,
            "candidate_block_size": self.candidate_block_size,
            "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk,
            "rope_theta": self.rope_theta,
            "compress_rope_theta": self.compress_rope_theta,
            "rope_scaling": {
                "type": "yarn",
                "rope_type": "yarn",
                "factor": self.rope_factor,
                "original_max_position_embeddings": self.original_seq_len,
                "beta_fast": self.beta_fast,
                "beta_slow": self.beta_slow,
            },
            "rms_norm_eps": self.norm_eps,
            "max_position_embeddings": self.max_seq_len,
            "quantization_config": {
                "quant_method": "fp8",
                "fmt": "e4m3",
                "scale_fmt": "ue8m0",
                "weight_block_size": [self.weight_block_size, self.weight_block_size],
            },
        }
        return {"model_type": "deepseek_v41", "text_config": text}

    # ---- internals -------------------------------------------------------------------------
    def _derive(self, layer: int) -> LayerSpec:
        ratio = self.compress_ratios[layer]
        is_draft = layer >= self.n_layers
        if ratio == 0:
            role = Role.SWA
        elif layer in self.kv_source_layers:
            role = Role.FULL
        elif layer in self.index_source_layers:
            role = Role.REINDEX
        else:
            role = Role.REUSE
        cand = self.candidates_enabled
        prefix = f"mtp.{layer - self.n_layers}.attn." if is_draft else f"layers.{layer}.attn."
        return LayerSpec(
            layer=layer,
            role=role,
            ratio=ratio,
            kv_source=None if ratio == 0 else self.kv_src(layer),
            index_source=None if ratio == 0 else self.idx_src(layer),
            is_candidate_source=cand and layer == self.candidate_source_layer,
            is_candidate_consumer=cand
            and layer in self.index_source_layers
            and layer > self.candidate_source_layer,
            rope_base=self.compress_rope_theta if ratio > 0 else self.rope_theta,
            yarn=ratio > 0,
            is_draft=is_draft,
            weight_prefix=prefix,
            candidate_source=self.candidate_source_layer if cand and layer in
            self.index_source_layers and layer > self.candidate_source_layer else None,
        )

    def _validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)

        k = _key  # each field as the user wrote it (config.json key or inference name)
        for name in _POSITIVE_INTS:
            v = getattr(self, name)
            need(_is_int(v) and v >= 1,
                 f"{k(name)} must be a positive integer, got {v!r}{_int_hint(v)}{_hf(name)}")
        for name in _OTHER_INTS:
            v = getattr(self, name)
            need(_is_int(v), f"{k(name)} must be an integer, got {v!r}{_int_hint(v)}{_hf(name)}")
        for name, (low, inclusive, what) in _FLOATS.items():
            v = getattr(self, name)
            ok = _is_real(v) and math.isfinite(v) and (v >= low if inclusive else v > low)
            need(ok, f"{k(name)} ({what}) must be a finite number {'>=' if inclusive else '>'} "
                     f"{low:g}, got {v!r}{_hf(name)}")
        need(self.n_mtp_layers >= 0,
             f"{k('n_mtp_layers')} must be >= 0, got {self.n_mtp_layers}{_hf('n_mtp_layers')}")
        need(self.candidate_source_layer >= -1,
             f"{k('candidate_source_layer')} must be -1 (no candidates) or a backbone layer, got "
             f"{self.candidate_source_layer}{_hf('candidate_source_layer')}")
        blk = self.weight_block_size
        need(blk == 32, f"{k('weight_block_size')} must be 32 (V4.1 fp8 32x32 blocks), got {blk}")
        need(self.index_semantics in SEMANTICS,
             f"index_semantics must be one of {SEMANTICS}, got {self.index_semantics!r}")
        need(self.n_heads % self.o_groups == 0,
             f"{k('n_heads')}={self.n_heads} is not divisible by {k('o_groups')}={self.o_groups}")
        need(self.rope_head_dim % 2 == 0,
             f"{k('rope_head_dim')}={self.rope_head_dim} must be even (interleaved pairs)")
        need(self.rope_head_dim <= self.head_dim,
             f"{k('rope_head_dim')}={self.rope_head_dim} exceeds {k('head_dim')}={self.head_dim}")
        need(self.rope_head_dim <= self.index_head_dim,
             f"{k('rope_head_dim')}={self.rope_head_dim} exceeds "
             f"{k('index_head_dim')}={self.index_head_dim}")
        # Quantisation blocks: fp8 act-quant (32) on every fp8 GEMM input and on the window KV;
        # fp4 blocks of 16 on compressed latents and 32 on index q/k.
        for name, v in ((k("dim"), self.dim), (k("q_lora_rank"), self.q_lora_rank),
                        (k("head_dim"), self.head_dim), (k("index_head_dim"), self.index_head_dim),
                        (f"{k('o_groups')}*{k('o_lora_rank')}", self.o_groups * self.o_lora_rank)):
            need(v % 32 == 0, f"{name}={v} must be a multiple of 32 (the fp8/fp4 quant block)")
        n_all = self.n_layers + self.n_mtp_layers
        ratios, n, mtp = k("compress_ratios"), k("n_layers"), k("n_mtp_layers")
        need(len(self.compress_ratios) == n_all,
             f"{ratios} has {len(self.compress_ratios)} entries, expected {n} + {mtp} = "
             f"{self.n_layers} + {self.n_mtp_layers} = {n_all}")
        for i, r in enumerate(self.compress_ratios):
            need(isinstance(r, int) and r >= 0, f"{ratios}[{i}]={r!r} must be an integer >= 0")
            if i >= self.n_layers:
                need(r == 0, f"{ratios}[{i}]={r}: draft layers run window attention only (ratio 0)")
        for name in ("kv_source_layers", "index_source_layers"):
            ids = getattr(self, name)
            need(list(ids) == sorted(set(ids)), f"{k(name)}={list(ids)} must be sorted and unique")
            for s in ids:
                need(0 <= s < self.n_layers,
                     f"{k(name)} entry {s} is not a backbone layer 0..{self.n_layers - 1}")
                need(self.compress_ratios[s] > 0,
                     f"{k(name)} entry {s} has compress ratio 0; a source must compress (ratio > 0)")
        kv_ids, ix_ids = k("kv_source_layers"), k("index_source_layers")
        for s in self.kv_source_layers:
            need(s in self.index_source_layers,
                 f"KV source layer {s} is not in {ix_ids}={list(self.index_source_layers)}: "
                 "a KV source makes index keys and must run its indexer")
        for layer in range(self.n_layers):
            r = self.compress_ratios[layer]
            if r == 0:
                continue
            src = self.kv_src(layer)
            need(src is not None,
                 f"layer {layer} has compress ratio {r} but no KV source at or before it "
                 f"({kv_ids}={list(self.kv_source_layers)})")
            need(self.compress_ratios[src] == r,
                 f"layer {layer} has ratio {r} but its KV source {src} has ratio "
                 f"{self.compress_ratios[src]}: a KV-sharing group must share one ratio")
        c, cand = self.candidate_source_layer, k("candidate_source_layer")
        if c >= 0:
            blocks, size = k("candidate_topk_blocks"), k("candidate_block_size")
            need(c < self.n_layers, f"{cand}={c} is not a backbone layer")
            need(c in self.index_source_layers,
                 f"{cand}={c} is not in {ix_ids}={list(self.index_source_layers)}")
            need(self.candidate_topk_blocks >= 1 and self.candidate_block_size >= 1,
                 f"{blocks}={self.candidate_topk_blocks} and {size}="
                 f"{self.candidate_block_size} must be >= 1")
            need(self.candidate_topk_blocks * self.candidate_block_size >= self.index_topk,
                 f"{blocks}*{size} = {self.candidate_topk_blocks}*"
                 f"{self.candidate_block_size} < {k('index_topk')}={self.index_topk}: consumers "
                 "could select fewer than index_topk visible rows")
            for s in self.index_source_layers:
                if s > c:
                    need(self.compress_ratios[s] == self.compress_ratios[c],
                         f"candidate consumer {s} has ratio {self.compress_ratios[s]} but the "
                         f"candidate source {c} has ratio {self.compress_ratios[c]}: the mask "
                         "widths would differ")


def _check_field_names(changes: Mapping[str, Any], where: str) -> None:
    """Overrides / replacements must name init fields of AttentionConfig (inference names)."""
    known = [f.name for f in dataclasses.fields(AttentionConfig) if f.init]
    unknown = [k for k in changes if k not in known]
    if unknown:
        hint = {v: k for k, v in HF_KEYS.items()}
        named = ", ".join(f"{k!r}" + (f" (the HF key of {hint[k]!r})" if k in hint else "")
                          for k in unknown)
        raise ConfigError(f"{where}: unknown config field(s) {named}; the fields are "
                          f"{', '.join(known)}")


def _from_hf_keys(text: Mapping[str, Any]) -> dict[str, Any]:
    """Map HF ``text_config`` keys to inference names; missing required keys are an error.
    Values pass through unconverted: AttentionConfig validates their types (an integer key
    takes an integer, not 2.0) and ranges, its messages naming the HF key. Only the nested
    objects are checked here."""
    required = {
        "hidden_size": "dim",
        "num_hidden_layers": "n_layers",
        "num_attention_heads": "n_heads",
        "head_dim": "head_dim",
        "qk_rope_head_dim": "rope_head_dim",
        "q_lora_rank": "q_lora_rank",
        "o_groups": "o_groups",
        "o_lora_rank": "o_lora_rank",
        "sliding_window": "window_size",
        "compress_ratios": "compress_ratios",
        "kv_source_layer_ids": "kv_source_layers",
        "index_source_layer_ids": "index_source_layers",
        "index_n_heads": "index_n_heads",
        "index_head_dim": "index_head_dim",
        "index_topk": "index_topk",
    }
    missing = [k for k in required if k not in text]
    if missing:
        others = [k for k in text if isinstance(k, str) and k not in ATTENTION_KEYS]
        hints = [f"{k!r} for {close[0]!r}" for k in others
                 for close in [difflib.get_close_matches(k, missing, n=1, cutoff=0.85)] if close]
        hint = f" (found {', '.join(hints)}: misspelt?)" if hints else ""
        raise ConfigError(f"config.json lacks required attention keys: {', '.join(missing)}{hint}")
    out: dict[str, Any] = {name: text[key] for key, name in required.items()}
    kv_heads = text.get("num_key_value_heads", 1)
    if kv_heads != 1 or isinstance(kv_heads, bool):
        raise ConfigError(f"num_key_value_heads={kv_heads!r}: V4.1 attention has one shared KV head (1)")
    optional = {
        "candidate_source_layer_id": ("candidate_source_layer", -1),
        "candidate_topk_blocks": ("candidate_topk_blocks", 0),
        "candidate_block_size": ("candidate_block_size", 1),
        "rope_theta": ("rope_theta", None), "compress_rope_theta": ("compress_rope_theta", None),
        "rms_norm_eps": ("norm_eps", None), "max_position_embeddings": ("max_seq_len", None),
        "num_nextn_predict_layers": ("n_mtp_layers", None),
    }
    for key, (name, default) in optional.items():
        if key in text:
            out[name] = text[key]
        elif default is not None:
            out[name] = default
    if "n_mtp_layers" not in out:
        # draft layers are the ratios past the backbone; a malformed list or count is reported
        # by AttentionConfig, naming the key
        ratios, n = text["compress_ratios"], text["num_hidden_layers"]
        if isinstance(ratios, (list, tuple)) and _is_int(n):
            if len(ratios) < n:
                raise ConfigError(f"compress_ratios has {len(ratios)} entries, fewer than "
                                  f"num_hidden_layers={n}: one ratio per layer (draft layers "
                                  f"last, counted by num_nextn_predict_layers)")
            out["n_mtp_layers"] = len(ratios) - n
    scaling = text.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, Mapping):
        raise ConfigError(f"rope_scaling={scaling!r} must be an object (type 'yarn', factor, "
                          f"original_max_position_embeddings, beta_fast, beta_slow) or null, got "
                          f"{type(scaling).__name__}")
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type", "yarn"))
        if kind != "yarn":
            raise ConfigError(f"rope_scaling type {kind!r} is not supported; V4.1 uses 'yarn'")
        out["rope_factor"] = scaling.get("factor", 16.0)
        out["original_seq_len"] = scaling.get("original_max_position_embeddings", 65536)
        out["beta_fast"] = scaling.get("beta_fast", 32.0)
        out["beta_slow"] = scaling.get("beta_slow", 1.0)
    quant = text.get("quantization_config")
    if quant is not None and not isinstance(quant, Mapping):
        raise ConfigError(f"quantization_config={quant!r} must be an object (quant_method, fmt, "
                          f"scale_fmt, weight_block_size) or null, got {type(quant).__name__}")
    if quant:
        block = quant.get("weight_block_size", [32, 32])
        if not (isinstance(block, (list, tuple)) and len(block) == 2
                and all(_is_int(v) for v in block)):
            raise ConfigError(f"quantization_config.weight_block_size={block!r} must be a "
                              f"[rows, cols] pair of integers, e.g. [32, 32]")
        if block[0] != block[1]:
            raise ConfigError(f"quantization_config.weight_block_size={list(block)} must be square")
        out["weight_block_size"] = int(block[0])
        fmt = quant.get("scale_fmt", "ue8m0")
        if fmt != "ue8m0":
            raise ConfigError(f"quantization_config.scale_fmt={fmt!r}: expected 'ue8m0'")
    return out


# The text_config keys from_hf reads, and others of a DeepSeek (V3/V4) config.json that the
# attention layer does not need. A key in neither set that closely resembles one read here is
# likely misspelt (its default would be used silently): ``_warn_unknown_keys`` warns about it.
# Any other key is another part of the model and is ignored.
ATTENTION_KEYS = frozenset({
    "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "qk_rope_head_dim",
    "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "compress_ratios",
    "kv_source_layer_ids", "index_source_layer_ids", "index_n_heads", "index_head_dim",
    "index_topk", "candidate_source_layer_id", "candidate_topk_blocks", "candidate_block_size",
    "rope_theta", "compress_rope_theta", "rms_norm_eps", "max_position_embeddings",
    "num_nextn_predict_layers", "num_key_value_heads", "rope_scaling", "quantization_config",
})
OTHER_MODEL_KEYS = frozenset({
    "vocab_size", "intermediate_size", "moe_intermediate_size", "n_shared_experts",
    "n_routed_experts", "routed_scaling_factor", "kv_lora_rank", "v_head_dim",
    "qk_nope_head_dim", "qk_head_dim", "topk_method", "n_group", "topk_group",
    "num_experts_per_tok", "moe_layer_freq", "first_k_dense_replace", "norm_topk_prob",
    "scoring_func", "aux_loss_alpha", "seq_aux", "hidden_act", "initializer_range",
    "use_cache", "pad_token_id", "bos_token_id", "eos_token_id", "tie_word_embeddings",
    "attention_bias", "attention_dropout", "model_type", "architectures", "torch_dtype",
    "dtype", "transformers_version", "auto_map", "ep_size", "num_hash_layers",
})


def _warn_unknown_keys(text: Mapping[str, Any], where: str) -> None:
    """Warn (ConfigWarning) for each key that is not read here, not a known key of the rest of
    the model, and close to a key that is read (a likely typo, e.g. ``sliding_windw``)."""
    for key in text:
        if not isinstance(key, str) or key in ATTENTION_KEYS or key in OTHER_MODEL_KEYS:
            continue
        close = difflib.get_close_matches(key, sorted(ATTENTION_KEYS), n=1, cutoff=0.85)
        if close:
            warnings.warn(f"{where}: key {key!r} is not one dsv41attn reads; did you mean "
                          f"{close[0]!r}? ({close[0]!r} is "
                          f"{'given too' if close[0] in text else 'not given'})",
                          ConfigWarning, stacklevel=3)


def _v41_flash() -> AttentionConfig:
    return AttentionConfig(
        dim=5120, n_layers=40, n_mtp_layers=3, n_heads=64, head_dim=512, rope_head_dim=64,
        q_lora_rank=1280, o_groups=8, o_lora_rank=1024, window_size=128,
        compress_ratios=(0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0),
        kv_source_layers=(2, 8, 14, 20), index_source_layers=(2, 8, 14, 20, 24, 28, 32, 36),
        candidate_source_layer=20, candidate_topk_blocks=2048, candidate_block_size=8,
        index_n_heads=32, index_head_dim=128, index_topk=512, max_seq_len=1048576,
    )


def _tiny() -> AttentionConfig:
    # Every role: 0 SWA, 1 Full r2, 2 Reuse r2, 3 Full r1 + candidate source, 4 Reuse r1,
    # 5 Reindex (candidate consumer), 6 Reuse, 7 Reindex, 8 draft (SWA).
    return AttentionConfig(
        dim=64, n_layers=8, n_mtp_layers=1, n_heads=8, head_dim=32, rope_head_dim=8,
        q_lora_rank=32, o_groups=2, o_lora_rank=16, window_size=8,
        compress_ratios=(0, 2, 2, 1, 1, 1, 1, 1, 0),
        kv_source_layers=(1, 3), index_source_layers=(1, 3, 5, 7),
        candidate_source_layer=3, candidate_topk_blocks=3, candidate_block_size=2,
        index_n_heads=4, index_head_dim=32, index_topk=4, max_seq_len=4096,
    )


PRESETS = {"v41-flash": _v41_flash, "tiny": _tiny}


def preset(name: str, **overrides: Any) -> AttentionConfig:
    """A built-in config: ``v41-flash`` (the real V4.1-Flash values) or ``tiny``."""
    if not isinstance(name, str) or name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    cfg = PRESETS[name]()
    return cfg.replace(**overrides) if overrides else cfg


def load_config(source: "str | os.PathLike | Mapping[str, Any]", **overrides: Any) -> AttentionConfig:
    """A preset name, a ``config.json`` path or a checkpoint directory (or, as ``from_hf``, the
    parsed dict)."""
    if isinstance(source, str) and source in PRESETS:
        return preset(source, **overrides)
    if isinstance(source, (str, os.PathLike)) and not os.path.exists(source):
        path = os.fspath(source)
        raise ConfigError(f"config file not found: {path} (load_config takes a preset name, one "
                          f"of {', '.join(PRESETS)}, a config.json path or a checkpoint directory)")
    return AttentionConfig.from_hf(source, **overrides)


def yarn_correction_range(cfg: AttentionConfig, base: float) -> tuple[int, int]:
    """(low, high) frequency-pair indices of the YaRN ramp (docs/numerics.md §4): (15, 25) for
    V4.1."""
    dim = cfg.rope_head_dim

    def corr(rotations: float) -> float:
        return dim * math.log(cfg.original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    return max(math.floor(corr(cfg.beta_fast)), 0), min(math.ceil(corr(cfg.beta_slow)), dim - 1)
