"""Checkpoint tensors of the attention layers (docs/numerics.md §1, §2): what each layer must
hold, lazy sharded loading with validation, exact fp8 block dequantisation, and a synthetic
checkpoint writer.

Names are those of the HF checkpoint: ``layers.{L}.attn.*`` for backbone layers and
``mtp.{S}.attn.*`` for draft layers (``LayerSpec.weight_prefix``). FP8 matrices are
``float8_e4m3fn`` with a sibling ``.scale`` in ``float8_e8m0fnu``, one power of two per 32x32
block: ``W[n, k] = fp8[n, k] * scale[n // 32, k // 32]``.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import sys
from contextlib import ExitStack
from dataclasses import dataclass
from types import MappingProxyType
from typing import Iterable, Mapping

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .config import PRESETS, AttentionConfig, LayerSpec, as_index

FP8 = torch.float8_e4m3fn
SCALE = torch.float8_e8m0fnu
FP8_MAX = 448.0
BLOCK = 32  # fp8 weight block edge (AttentionConfig requires weight_block_size == 32)
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
PROGRESS_AUTO_BYTES = 256 * 2**20

# safetensors header dtype names -> torch dtypes (read-only).
_ST_DTYPES = MappingProxyType({
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
    "U8": torch.uint8, "BOOL": torch.bool,
})

Meta = tuple  # (torch.dtype | str, tuple[int, ...])


class CheckpointError(ValueError):
    """A checkpoint that does not hold what the config says; the message names the tensor."""


@dataclass(frozen=True, eq=False)  # tensors have no single truth value: identity equality
class Fp8Weight:
    """A block-quantised matrix as stored in the checkpoint.

    ``weight``: float8_e4m3fn [N, K]. ``scale``: float8_e8m0fnu [ceil(N/32), ceil(K/32)], the
    power-of-two scale of each 32x32 block (the last row/column of blocks may be partial).
    """

    weight: torch.Tensor
    scale: torch.Tensor

    def __post_init__(self) -> None:
        if self.weight.dtype != FP8 or self.scale.dtype != SCALE or self.weight.dim() != 2:
            raise CheckpointError(
                f"Fp8Weight needs a 2-D float8_e4m3fn weight and a float8_e8m0fnu scale, got "
                f"{_fmt(self.weight.dtype, self.weight.shape)} and {_fmt(self.scale.dtype, self.scale.shape)}"
            )
        n, k = self.weight.shape
        blocks = (-(-n // BLOCK), -(-k // BLOCK))
        if tuple(self.scale.shape) != blocks:
            raise CheckpointError(f"Fp8Weight scale for a [{n}, {k}] weight must be "
                                  f"{_fmt(SCALE, blocks)}, got {_fmt(SCALE, self.scale.shape)}")

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def nbytes(self) -> int:
        return _nbytes(self.weight) + _nbytes(self.scale)

    def dequantize(self) -> torch.Tensor:
        """bf16 [N, K]: ``fp8 * scale`` per 32x32 block. Exact: an e4m3 value times a power of
        two has at most 4 significant bits, which bf16 holds."""
        n, k = self.weight.shape
        full = self.scale.float().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:n, :k]
        return (self.weight.float() * full).to(torch.bfloat16)

    def to(self, device: torch.device | str) -> "Fp8Weight":
        return Fp8Weight(self.weight.to(device), self.scale.to(device))


def quantize_fp8(w: torch.Tensor) -> Fp8Weight:
    """Quantise ``w`` (float [N, K]) to e4m3 with ue8m0 block scales, as the fixtures were made:
    per block ``scale = 2^ceil(log2(max(amax, 1e-30) / 448))``, ``q = clamp(w / scale, ±448)``."""
    block_size = BLOCK
    w = w.float()
    n, k = w.shape
    nb, kb = -(-n // block_size), -(-k // block_size)
    padded = w.new_zeros(nb * block_size, kb * block_size)
    padded[:n, :k] = w.abs()
    amax = padded.view(nb, block_size, kb, block_size).amax(dim=(1, 3)).clamp_min(1e-30)
    exponent = torch.ceil(torch.log2(amax / FP8_MAX)).to(torch.int32).clamp(-127, 127)
    # ue8m0 bits are the biased exponent; building them directly avoids any cast rounding.
    scale = (exponent + 127).to(torch.uint8).view(SCALE)
    full = torch.exp2(exponent.float()).repeat_interleave(block_size, 0).repeat_interleave(block_size, 1)
    q = (w / full[:n, :k]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return Fp8Weight(q, scale)


def exact_fp8(w: torch.Tensor) -> Fp8Weight | None:
    """The block-scaled e4m3 form of the bf16 matrix ``w`` [N, K] whose ``dequantize()`` is w
    bit for bit (``quantize_fp8``'s scales: the smallest that hold each block), or None where
    no such form exists (w was not an fp8 checkpoint weight dequantised, or holds a NaN or an
    infinity). The runtime keeps wo_a dequantised; this gives back its fp8 bytes."""
    if not isinstance(w, torch.Tensor) or w.dtype != torch.bfloat16 or w.dim() != 2:
        raise TypeError(f"exact_fp8 wants a 2-D bf16 tensor, got "
                        f"{getattr(w, 'dtype', type(w))} {tuple(getattr(w, 'shape', ()))}")
    if not bool(torch.isfinite(w).all()):
        return None
    q = quantize_fp8(w)
    return q if torch.equal(q.dequantize().view(torch.int16), w.view(torch.int16)) else None


def expected_tensors(cfg: AttentionConfig, layer: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Name (relative to the layer's ``weight_prefix``) -> (dtype, shape) of every tensor the
    checkpoint holds for ``layer``, given its role. With H heads, D head_dim,
    Q q_lora_rank, G o_groups, R o_lora_rank, X dim, I index_n_heads, d index_head_dim:

    every layer: ``wq_a`` fp8 [Q, X], ``q_norm`` bf16 [Q], ``wq_b`` fp8 [H*D, Q], ``wkv`` fp8
    [D, X], ``kv_norm`` bf16 [D], ``wo_a`` fp8 [G*R, H*D/G], ``wo_b`` fp8 [X, G*R], ``attn_sink``
    f32 [H]; KV sources: ``compressor.wkv`` bf16 [D, X], ``compressor.wgate`` bf16 [D, X] (ratio
    > 1 only), ``compressor.norm`` bf16 [D], ``indexer.wk`` bf16 [d, D], ``indexer.k_norm`` bf16
    [d]; index sources: ``indexer.wq_b`` fp8 [I*d, Q], ``indexer.weights_proj`` bf16 [I, X].
    Each fp8 ``X.weight`` [N, K] has ``X.scale`` float8_e8m0fnu [ceil(N/32), ceil(K/32)].
    """
    spec = cfg.layer(layer)
    H, D, Q, G, R = cfg.n_heads, cfg.head_dim, cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank
    X, I, d, b = cfg.dim, cfg.index_n_heads, cfg.index_head_dim, cfg.weight_block_size
    bf16 = torch.bfloat16
    out: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}

    def fp8(name: str, n: int, k: int) -> None:
        out[f"{name}.weight"] = (FP8, (n, k))
        out[f"{name}.scale"] = (SCALE, (-(-n // b), -(-k // b)))

    fp8("wq_a", Q, X)
    out["q_norm.weight"] = (bf16, (Q,))
    fp8("wq_b", H * D, Q)
    fp8("wkv", D, X)
    out["kv_norm.weight"] = (bf16, (D,))
    fp8("wo_a", G * R, H * D // G)
    fp8("wo_b", X, G * R)
    out["attn_sink"] = (torch.float32, (H,))
    if spec.is_kv_source:
        out["compressor.wkv.weight"] = (bf16, (D, X))
        if spec.has_gate:
            out["compressor.wgate.weight"] = (bf16, (D, X))
        out["compressor.norm.weight"] = (bf16, (D,))
        out["indexer.wk.weight"] = (bf16, (d, D))
        out["indexer.k_norm.weight"] = (bf16, (d,))
    if spec.is_index_source:
        fp8("indexer.wq_b", I * d, Q)
        out["indexer.weights_proj.weight"] = (bf16, (I, X))
    return out


@dataclass(frozen=True, eq=False)
class LayerWeights:
    """One attention layer's weights as the forward uses them (Q, D, ... as in
    ``expected_tensors``). Optional fields are None when the layer's role lacks them.

    ``wq_a`` Fp8Weight [Q, X]; ``q_norm`` bf16 [Q]; ``wq_b`` Fp8Weight [H*D, Q]; ``wkv``
    Fp8Weight [D, X]; ``kv_norm`` bf16 [D]; ``wo_a`` bf16 [G*R, H*D/G] (dequantised exactly, as
    the reference holds it); ``wo_b`` Fp8Weight [X, G*R]; ``attn_sink`` f32 [H].
    KV sources: ``compressor_wkv`` [D, X] (bf16 at ratio 1, f32 at ratio > 1 as the reference
    promotes it), ``compressor_wgate`` f32 [D, X] (ratio > 1 only), ``compressor_norm`` bf16 [D],
    ``index_wk`` bf16 [d, D], ``index_k_norm`` bf16 [d]. Index sources: ``index_wq_b``
    Fp8Weight [I*d, Q], ``index_weights_proj`` bf16 [I, X].
    """

    layer: int
    wq_a: Fp8Weight
    q_norm: torch.Tensor
    wq_b: Fp8Weight
    wkv: Fp8Weight
    kv_norm: torch.Tensor
    wo_a: torch.Tensor
    wo_b: Fp8Weight
    attn_sink: torch.Tensor
    compressor_wkv: torch.Tensor | None = None
    compressor_wgate: torch.Tensor | None = None
    compressor_norm: torch.Tensor | None = None
    index_wk: torch.Tensor | None = None
    index_k_norm: torch.Tensor | None = None
    index_wq_b: Fp8Weight | None = None
    index_weights_proj: torch.Tensor | None = None

    def _weights(self) -> Iterable[tuple[str, torch.Tensor | Fp8Weight]]:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, (torch.Tensor, Fp8Weight)):
                yield f.name, v

    def to(self, device: torch.device | str) -> "LayerWeights":
        """A copy with every tensor on ``device``."""
        return dataclasses.replace(self, **{name: v.to(device) for name, v in self._weights()})

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors as this object holds them (fp8 + scales, bf16 wo_a, f32 compressor
        weights at ratio > 1)."""
        return sum(v.nbytes if isinstance(v, Fp8Weight) else _nbytes(v) for _, v in self._weights())


def layer_weights_from_tensors(
    cfg: AttentionConfig, layer: int, tensors: Mapping[str, torch.Tensor]
) -> LayerWeights:
    """Validate and assemble layer ``layer`` from ``tensors`` (full checkpoint names -> tensors
    in checkpoint dtypes; other layers' tensors are ignored). Raises CheckpointError listing every
    missing, unexpected, or wrongly typed/shaped tensor before anything is built. ``wo_a`` may be
    stored fp8 + scale or, as in some re-exported checkpoints (docs/numerics.md §2), bf16 with
    no scale."""
    _check_cfg(cfg, "layer_weights_from_tensors")
    spec = cfg.layer(layer)
    p = spec.weight_prefix
    own = {name[len(p):]: t for name, t in tensors.items() if name.startswith(p)}
    raise_problems([f"{p}{n}: expected a torch.Tensor, found {_found(t)}"
            for n, t in own.items() if not isinstance(t, torch.Tensor)], f"layer {layer}")
    problems = _name_problems(cfg, spec, own)
    problems += _meta_problems(cfg, spec, {n: (t.dtype, tuple(t.shape)) for n, t in own.items()})
    raise_problems(problems, f"layer {layer}")
    return build_layer_weights(spec, own)



def _names_per_layer(cfg, specs, weight_map, path) -> dict[int, dict[str, str]]:
    """layer -> {name inside ``layers.L.attn.``: full checkpoint name}, from the index or
    header key list only; raises naming every missing or unexpected name."""
    per_layer: dict[int, dict[str, str]] = {spec.layer: {} for spec in specs}
    layer_of = {spec.weight_prefix: spec.layer for spec in specs}
    for name in weight_map:
        cut = name.find(".attn.") + len(".attn.")
        if cut >= len(".attn.") and name[:cut] in layer_of:
            per_layer[layer_of[name[:cut]]][name[cut:]] = name
    problems: list[str] = []
    for spec in specs:
        problems += _name_problems(cfg, spec, per_layer[spec.layer])
    raise_problems(problems, "checkpoint " + os.fspath(path))
    return per_layer

def load_layer_weights(
    path: str | os.PathLike,
    cfg: AttentionConfig,
    layers: int | Iterable[int] | None = None,
    device: torch.device | str = "cpu",
    progress: bool | None = None,
) -> dict[int, LayerWeights]:
    """Load the attention weights of ``layers`` (None: every layer of ``cfg``, backbone and
    draft) from ``path``: a HF checkpoint directory with ``model.safetensors.index.json`` and its
    shards, a directory with one ``model.safetensors``, or a single ``.safetensors`` file.

    Lazy: only the selected layers' tensors are read, each needed shard is opened once, and
    names, dtypes and shapes are all checked against ``expected_tensors`` (from the index / file
    headers) before any tensor data is read; then every tensor read is checked for NaN / Inf
    codes (``nonfinite_summary``), so a shard with corrupt data raises CheckpointError naming
    the file and the tensor instead of loading weights that turn outputs into NaN.
    ``progress``: a tqdm bar of the bytes read on stderr; None (default) shows it when more
    than 256 MiB are to be read and stderr is a terminal, True always, False never. Returns
    {layer: LayerWeights} on ``device``, in the order of ``layers``. ``path`` may also be the
    checkpoint's ``config.json`` or ``model.safetensors.index.json``: its directory is read.
    """
    _check_cfg(cfg, "load_layer_weights")
    tensors, _ = read_layer_tensors(path, cfg, layers, device=device, progress=progress)
    return {L: build_layer_weights(cfg.layer(L), own) for L, own in tensors.items()}


def read_layer_tensors(
    path: str | os.PathLike,
    cfg: AttentionConfig,
    layers: int | Iterable[int] | None = None,
    slices: Mapping[str, tuple[slice, ...]] | None = None,
    device: torch.device | str = "cpu",
    progress: bool | None = None,
) -> tuple[dict[int, dict[str, torch.Tensor]], int]:
    """The checkpoint tensors of ``layers`` as stored (the reading half of
    ``load_layer_weights``, whose paths, checks and ``progress`` it shares): names from the
    index / header key list, then dtypes and shapes from the shard headers, all checked before
    any data is read; every tensor read is checked for NaN / Inf codes.

    ``slices``: name relative to the layer prefix (e.g. ``"wq_b.weight"``) -> the index of the
    part to read (a tuple of slices, read with safetensors ``get_slice``: tensor parallelism's
    per-rank slices, ``tp.py``); other tensors are read whole. Returns ({layer: {relative name:
    tensor on ``device``}} in the order of ``layers``, the bytes read)."""
    _check_cfg(cfg, "read_layer_tensors")
    ids = _layer_ids(cfg, layers)
    specs = [cfg.layer(L) for L in ids]
    root, weight_map, single = _resolve(path)
    slices = slices or {}
    with ExitStack() as stack:
        handles: dict[str, tuple[object, set[str]]] = {}  # shard file -> (open handle, its keys)

        def shard(fname: str) -> tuple[object, set[str]]:
            if fname not in handles:
                full = os.path.join(root, fname)
                if not os.path.isfile(full):
                    raise CheckpointError(
                        f"shard {fname} named by {os.path.join(root, INDEX_FILE)} does not exist")
                try:
                    h = stack.enter_context(safe_open(full, framework="pt", device="cpu"))
                    handles[fname] = (h, set(h.keys()))
                except (SafetensorError, OSError) as e:
                    raise CheckpointError(f"{full}: not a readable safetensors file (truncated, "
                                          f"corrupt or another format): {e}") from e
            return handles[fname]

        def read(full: str, rel: str) -> torch.Tensor:
            fname = weight_map[full]
            try:
                h = shard(fname)[0]
                return h.get_slice(full)[slices[rel]] if rel in slices else h.get_tensor(full)
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{os.path.join(root, fname)}: reading {full} failed: {e}") from e

        if weight_map is None:
            weight_map = dict.fromkeys(shard(single)[1], single)
        # 1. names, from the index / header key list only (one pass over all names).
        per_layer = _names_per_layer(cfg, specs, weight_map, path)
        problems: list[str] = []
        # 2. dtypes and shapes, from the shard headers.
        metas: dict[int, dict[str, Meta]] = {}
        for spec in specs:
            metas[spec.layer] = meta = {}
            for rel, full in per_layer[spec.layer].items():
                fname = weight_map[full]
                h, keys = shard(fname)
                if full not in keys:
                    problems.append(
                        f"{full}: listed in the index under {fname}, but that shard does not hold it")
                    continue
                sl = h.get_slice(full)
                meta[rel] = (_ST_DTYPES.get(sl.get_dtype(), sl.get_dtype()), tuple(sl.get_shape()))
            problems += _meta_problems(cfg, spec, meta)
        raise_problems(problems, "checkpoint " + os.fspath(path))
        # 3. data, each tensor checked for NaN / Inf codes before it leaves the CPU.
        total_bytes = sum(_meta_nbytes((m[0], _sliced_shape(m[1], slices.get(rel))))
                          for meta in metas.values() for rel, m in meta.items())
        show = progress if progress is not None else total_bytes > PROGRESS_AUTO_BYTES
        bar = _progress_bar(total_bytes, forced=progress is True) if show else None
        if bar is not None:
            stack.callback(bar.close)
        out: dict[int, dict[str, torch.Tensor]] = {}
        nbytes = 0
        for spec in specs:
            out[spec.layer] = own = {}
            for rel, full in per_layer[spec.layer].items():
                t = read(full, rel)
                bad = nonfinite_summary(t)
                if bad:
                    problems.append(f"{full} in {os.path.join(root, weight_map[full])}: {bad} "
                                    f"(the file's data is corrupt or was written wrong)")
                own[rel] = t.to(device)
                nbytes += _nbytes(t)
                if bar is not None:
                    bar.update(_nbytes(t))
        raise_problems(problems, "checkpoint " + os.fspath(path))
    return out, nbytes


def nonfinite_summary(t: torch.Tensor) -> str | None:
    """None if every value of ``t`` is a finite number, else what is not and where: NaN codes
    of float8_e4m3fn (0x7f, 0xff; it has no infinity) and float8_e8m0fnu (0xff), NaN or Inf
    in the other float dtypes. Integer tensors are always finite."""
    if t.dtype in (FP8, SCALE):
        codes = t.contiguous().view(torch.uint8)
        bad = (codes & 0x7F) == 0x7F if t.dtype == FP8 else codes == 0xFF
        what = "NaN codes (0x7f/0xff)" if t.dtype == FP8 else "NaN codes (0xff)"
    elif t.dtype.is_floating_point:
        bad = ~torch.isfinite(t)
        what = "NaN or Inf values"
    else:
        return None
    n = int(bad.sum())
    if n == 0:
        return None
    first = [int(i) for i in torch.nonzero(bad.reshape(t.shape))[0]] if t.dim() else []
    return (f"{n} of its {t.numel()} {str(t.dtype).removeprefix('torch.')} entries are {what}, "
            f"the first at {first}")


def random_checkpoint_tensors(
    cfg: AttentionConfig, layers: int | Iterable[int] | None = None, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Random checkpoint tensors (full names, checkpoint dtypes, CPU) for ``layers`` (None: all),
    drawn like the fixtures: fp8 matrices normal(0, 1/sqrt(fan_in)) quantised with ue8m0 32x32
    block scales (``quantize_fp8``); bf16 matrices normal(0, 1/sqrt(fan_in)); norm weights
    uniform(0.7, 1.3) bf16; ``attn_sink`` normal(0, 1) f32. Each layer has its own generator
    seeded from (seed, layer), so a layer's weights do not depend on which others are drawn."""
    _check_cfg(cfg, "random_checkpoint_tensors")
    _check_seed(seed, "random_checkpoint_tensors")
    out: dict[str, torch.Tensor] = {}
    for L in _layer_ids(cfg, layers):
        prefix = cfg.layer(L).weight_prefix
        digest = hashlib.sha256(f"dsv41attn:{seed}:{L}".encode()).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        for name, (dtype, shape) in expected_tensors(cfg, L).items():
            if name.endswith(".scale"):
                continue  # drawn with its weight
            if dtype == FP8:
                w = torch.randn(shape, generator=gen) / math.sqrt(shape[1])
                q = quantize_fp8(w)
                base = name[: -len(".weight")]
                out[prefix + name], out[prefix + base + ".scale"] = q.weight, q.scale
            elif name == "attn_sink":
                out[prefix + name] = torch.randn(shape, generator=gen)
            elif len(shape) == 1:  # norm weights
                out[prefix + name] = (torch.rand(shape, generator=gen) * 0.6 + 0.7).to(dtype)
            else:
                out[prefix + name] = (torch.randn(shape, generator=gen) / math.sqrt(shape[1])).to(dtype)
    return out


def random_layer_weights(
    cfg: AttentionConfig, layer: int, seed: int = 0, device: torch.device | str = "cpu"
) -> LayerWeights:
    """The LayerWeights of ``random_checkpoint_tensors(cfg, [layer], seed)``, on ``device``."""
    lw = layer_weights_from_tensors(cfg, layer, random_checkpoint_tensors(cfg, [layer], seed))
    return lw.to(device)


def write_synthetic_checkpoint(
    path: str | os.PathLike,
    cfg: AttentionConfig,
    seed: int = 0,
    layers: int | Iterable[int] | None = None,
    max_shard_bytes: int = 2**30,
) -> None:
    """Write a HF-style checkpoint of random attention weights (``random_checkpoint_tensors``)
    to directory ``path`` (created): ``config.json`` (``cfg.to_hf()``), shards
    ``model-0000i-of-0000N.safetensors`` filled in layer order up to ``max_shard_bytes`` each
    (a tensor larger than that gets a shard of its own), and ``model.safetensors.index.json``.
    Layers are drawn one at a time, so memory stays near one shard plus one layer."""
    _check_cfg(cfg, "write_synthetic_checkpoint")
    _check_seed(seed, "write_synthetic_checkpoint")
    if as_index(max_shard_bytes) is None or max_shard_bytes < 1:
        raise CheckpointError(f"write_synthetic_checkpoint: max_shard_bytes must be a positive "
                              f"integer (bytes), got {max_shard_bytes!r}")
    if not isinstance(path, (str, os.PathLike)):
        raise CheckpointError(f"write_synthetic_checkpoint: path must be a directory path, got "
                              f"{type(path).__name__} {path!r:.80}")
    if os.path.exists(path) and not os.path.isdir(path):
        raise CheckpointError(f"write_synthetic_checkpoint: {os.fspath(path)} exists and is not a "
                              f"directory; path is the checkpoint directory to create")
    ids = _layer_ids(cfg, layers)
    if not ids:
        raise CheckpointError("write_synthetic_checkpoint: no layers selected")
    # Plan the shards from the expected sizes, before drawing anything.
    plan: list[list[str]] = [[]]
    used = total = 0
    for L in ids:
        prefix = cfg.layer(L).weight_prefix
        for name, (dtype, shape) in expected_tensors(cfg, L).items():
            size = _meta_nbytes((dtype, shape))
            if plan[-1] and used + size > max_shard_bytes:
                plan.append([])
                used = 0
            plan[-1].append(prefix + name)
            used += size
            total += size
    n = len(plan)
    files = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg.to_hf(), f, indent=2)
    weight_map = {name: files[i] for i, names in enumerate(plan) for name in names}
    pending: dict[str, torch.Tensor] = {}
    shard_idx = 0
    for L in ids:
        pending.update(random_checkpoint_tensors(cfg, [L], seed))
        while shard_idx < n and all(name in pending for name in plan[shard_idx]):
            part = {name: pending.pop(name).contiguous() for name in plan[shard_idx]}
            save_file(part, os.path.join(path, files[shard_idx]), metadata={"format": "pt"})
            shard_idx += 1
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump(index, f, indent=2)


# ---- internals ------------------------------------------------------------------------------

def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _sliced_shape(shape: tuple[int, ...], index: tuple[slice, ...] | None) -> tuple[int, ...]:
    """The shape of ``tensor[index]`` for a tensor of ``shape`` (index: slices of the leading
    dims, or None for the whole tensor)."""
    if index is None:
        return tuple(shape)
    return tuple(len(range(*index[i].indices(n))) if i < len(index) else n
                 for i, n in enumerate(shape))


def _meta_nbytes(meta: Meta) -> int:
    dtype, shape = meta
    itemsize = dtype.itemsize if isinstance(dtype, torch.dtype) else 1
    return math.prod(shape) * itemsize


def _fmt(dtype: torch.dtype | str, shape: Iterable[int]) -> str:
    name = str(dtype).removeprefix("torch.")
    return f"{name} [{', '.join(str(int(s)) for s in shape)}]"


def _describe(spec: LayerSpec) -> str:
    return f"layer {spec.layer} is a {spec.role.value} layer (ratio {spec.ratio})"


def _check_cfg(cfg: object, where: str) -> None:
    if not isinstance(cfg, AttentionConfig):
        hint = " (make one with preset() or load_config())" if isinstance(cfg, (str, os.PathLike)) else ""
        raise CheckpointError(f"{where}: cfg must be an AttentionConfig, got "
                              f"{type(cfg).__name__} {cfg!r:.80}{hint}")


def _check_seed(seed: object, where: str) -> None:
    if as_index(seed) is None:
        raise CheckpointError(f"{where}: seed must be an integer, got {type(seed).__name__} {seed!r:.80}")


def _layer_ids(cfg: AttentionConfig, layers: int | Iterable[int] | None) -> list[int]:
    if layers is None:
        return list(range(len(cfg.layer_specs)))
    many = isinstance(layers, Iterable) and not isinstance(layers, (str, bytes))
    ids = []
    for L in (list(layers) if many else [layers]):
        if as_index(L) is None:
            raise CheckpointError(f"layers={layers!r:.80}: layer ids must be integers, got "
                                  f"{type(L).__name__} {L!r}")
        ids.append(as_index(L))
        cfg.layer(ids[-1])  # raises ConfigError naming the valid range
    return list(dict.fromkeys(ids))


def _name_problems(cfg: AttentionConfig, spec: LayerSpec, found: Iterable[str]) -> list[str]:
    """Missing and unexpected names (relative) for ``spec``. ``wo_a.scale`` may be absent (bf16
    wo_a); whether that is allowed depends on wo_a's dtype, checked in ``_meta_problems``."""
    expected = expected_tensors(cfg, spec.layer)
    found = set(found)
    p = spec.weight_prefix
    problems = [f"{p}{n}: missing; {_describe(spec)}, which needs it"
                for n in expected if n not in found and n != "wo_a.scale"]
    problems += [f"{p}{n}: unexpected tensor; {_describe(spec)}, which should not have it"
                 for n in sorted(found) if n not in expected]
    return problems


def _meta_problems(cfg: AttentionConfig, spec: LayerSpec, meta: Mapping[str, Meta]) -> list[str]:
    """Dtype/shape mismatches among the expected names present in ``meta`` (relative names)."""
    expected = dict(expected_tensors(cfg, spec.layer))
    p = spec.weight_prefix
    problems: list[str] = []
    wo_a = meta.get("wo_a.weight")
    if wo_a is not None and wo_a[0] == torch.bfloat16:
        # A re-exported checkpoint may hold wo_a already dequantised (docs/numerics.md §2): no
        # scale then.
        expected["wo_a.weight"] = (torch.bfloat16, expected["wo_a.weight"][1])
        if "wo_a.scale" in meta:
            problems.append(f"{p}wo_a.scale: unexpected; {p}wo_a.weight is bfloat16 (already "
                            f"dequantised), so it must not have a scale (found {_fmt(*meta['wo_a.scale'])})")
        expected.pop("wo_a.scale")
    elif wo_a is not None and "wo_a.scale" not in meta:
        problems.append(f"{p}wo_a.scale: missing; {p}wo_a.weight is {_fmt(*wo_a)}, which needs a "
                        f"block scale {_fmt(*expected['wo_a.scale'])} (only a bfloat16 wo_a may lack it)")
    for name, (dtype, shape) in expected.items():
        if name not in meta:
            continue
        got_dtype, got_shape = meta[name]
        if got_dtype != dtype or tuple(got_shape) != tuple(shape):
            problems.append(f"{p}{name}: expected {_fmt(dtype, shape)}, found {_fmt(got_dtype, got_shape)}")
    return problems


def raise_problems(problems: list[str], where: str) -> None:
    """Raise one CheckpointError listing ``problems`` (the first 20) under ``where``; nothing if
    there are none."""
    if not problems:
        return
    shown = problems[:20]
    more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
    raise CheckpointError(f"{where}: {len(problems)} problem(s):\n  " + "\n  ".join(shown) + more)


# LayerWeights field -> checkpoint name relative to the layer prefix; an fp8 weight is a stem
# with ".weight" and ".scale". The one place the two namings meet.
_FIELDS = (
    ("wq_a", "wq_a"), ("q_norm", "q_norm.weight"), ("wq_b", "wq_b"), ("wkv", "wkv"),
    ("kv_norm", "kv_norm.weight"), ("wo_a", "wo_a.weight"), ("wo_b", "wo_b"),
    ("attn_sink", "attn_sink"), ("compressor_wkv", "compressor.wkv.weight"),
    ("compressor_wgate", "compressor.wgate.weight"), ("compressor_norm", "compressor.norm.weight"),
    ("index_wk", "indexer.wk.weight"), ("index_k_norm", "indexer.k_norm.weight"),
    ("index_wq_b", "indexer.wq_b"), ("index_weights_proj", "indexer.weights_proj.weight"),
)
_FP8_STEMS = {"wq_a", "wq_b", "wkv", "wo_b", "indexer.wq_b"}


def build_layer_weights(spec: LayerSpec, t: Mapping[str, torch.Tensor]) -> LayerWeights:
    """Assemble layer ``spec``'s LayerWeights from validated tensors keyed by their names
    relative to the layer prefix, in checkpoint dtypes (``read_layer_tensors``): wo_a dequantised
    to bf16 (a bf16 wo_a kept as it is), the gated compressor's weights promoted to fp32 (as the
    reference runs them)."""
    fields: dict[str, object] = {}
    for field, name in _FIELDS:
        if name in _FP8_STEMS:
            if f"{name}.weight" in t:
                fields[field] = Fp8Weight(t[f"{name}.weight"], t[f"{name}.scale"])
        elif name in t:
            fields[field] = t[name]
    wo_a = fields["wo_a"]
    if wo_a.dtype != torch.bfloat16:
        fields["wo_a"] = Fp8Weight(wo_a, t["wo_a.scale"]).dequantize()
    if spec.has_gate:
        fields["compressor_wkv"] = fields["compressor_wkv"].float()
        fields["compressor_wgate"] = fields["compressor_wgate"].float()
    return LayerWeights(layer=spec.layer, **fields)


def _held_dtypes(spec: LayerSpec) -> dict[str, torch.dtype]:
    """LayerWeights field -> dtype of the tensor it holds for ``spec``'s layer (fp8 fields: of
    their ``.weight``; their ``.scale`` is float8_e8m0fnu). What ``build_layer_weights`` makes of
    the checkpoint dtypes: wo_a dequantised to bf16, the gated compressor promoted to fp32."""
    out: dict[str, torch.dtype] = {}
    for field, name in _FIELDS:
        if name in _FP8_STEMS:
            out[field] = FP8
        elif name == "attn_sink":
            out[field] = torch.float32
        else:
            out[field] = torch.bfloat16
    if spec.has_gate:
        out["compressor_wkv"] = out["compressor_wgate"] = torch.float32
    return out


def check_layer_weights(cfg: AttentionConfig, w: LayerWeights) -> None:
    """Raise CheckpointError unless ``w`` holds exactly the weights, with the dtypes and shapes,
    that layer ``w.layer`` of ``cfg`` needs (weights built for another config, or hand-made
    ones), all on one device. Every problem is listed, each naming the field, its checkpoint
    name, and what was found and expected."""
    if not isinstance(cfg, AttentionConfig):
        raise CheckpointError(f"check_layer_weights: cfg must be an AttentionConfig, got "
                              f"{type(cfg).__name__} {cfg!r:.80}")
    if not isinstance(w, LayerWeights):
        raise CheckpointError(f"check_layer_weights: weights must be a LayerWeights, got "
                              f"{type(w).__name__} {w!r:.80}")
    spec = cfg.layer(w.layer)
    expected = expected_tensors(cfg, w.layer)
    dtypes = _held_dtypes(spec)
    p = spec.weight_prefix
    problems: list[str] = []
    devices: dict[str, list[str]] = {}  # device -> fields there
    for field, name in _FIELDS:
        v = getattr(w, field)
        key = f"{name}.weight" if name in _FP8_STEMS else name
        want = expected.get(key)
        if want is None and v is not None:
            problems.append(f"{p}{key}: the config gives layer {w.layer} no such tensor "
                            f"(role {spec.role.value}), but the weights have one")
            continue
        if want is None:
            continue
        if v is None:
            problems.append(f"{p}{key}: missing for layer {w.layer}")
            continue
        want_shape, want_dtype = tuple(want[1]), dtypes[field]
        if name in _FP8_STEMS:
            if not isinstance(v, Fp8Weight):
                problems.append(f"{p}{key}: {field} must be an Fp8Weight (float8_e4m3fn weight + "
                                f"float8_e8m0fnu scale) of {list(want_shape)}, found "
                                f"{_found(v)}")
                continue
            parts = {"weight": (v.weight, FP8, want_shape),
                     "scale": (v.scale, SCALE, tuple(expected[f"{name}.scale"][1]))}
        else:
            parts = {"": (v, want_dtype, want_shape)}
        for part, (t, dtype, shape) in parts.items():
            label = f"{p}{name}.{part}" if part else f"{p}{key}"
            what = f"{field}.{part}" if part else field
            if not isinstance(t, torch.Tensor):
                problems.append(f"{label}: {what} must be a torch.Tensor {_fmt(dtype, shape)}, "
                                f"found {_found(t)}")
                continue
            devices.setdefault(str(t.device), []).append(what)
            if tuple(t.shape) != shape:
                problems.append(f"{label}: the config expects shape {list(shape)}, the weights "
                                f"have {list(t.shape)}")
            if t.dtype != dtype:
                problems.append(f"{label}: {what} of layer {w.layer} must be "
                                f"{str(dtype).removeprefix('torch.')}, found "
                                f"{_fmt(t.dtype, t.shape)} (expected {_fmt(dtype, shape)})")
    if len(devices) > 1:
        main = max(devices, key=lambda dev: len(devices[dev]))
        elsewhere = "; ".join(f"{', '.join(fields)} on {dev}"
                              for dev, fields in devices.items() if dev != main)
        problems.append(f"layer {w.layer}: all tensors must be on one device, found {elsewhere}, "
                        f"the other {len(devices[main])} on {main}")
    raise_problems(problems, f"layer {w.layer} weights")


def _found(v: object) -> str:
    if isinstance(v, torch.Tensor):
        return f"a torch.Tensor {_fmt(v.dtype, v.shape)}"
    return f"{type(v).__name__} {v!r:.80}"


def _resolve(path: str | os.PathLike) -> tuple[str, dict[str, str] | None, str | None]:
    """(directory, weight_map or None, single file name or None) for a checkpoint path."""
    if not isinstance(path, (str, os.PathLike)):
        hint = (" (the arguments are (path, cfg))" if isinstance(path, AttentionConfig) else "")
        raise CheckpointError(f"load_layer_weights: path must be {_PATH_KINDS}, got "
                              f"{type(path).__name__} {path!r:.80}{hint}")
    path = os.fspath(path)
    if os.path.isfile(path) and os.path.basename(path) in (INDEX_FILE, "config.json"):
        # the checkpoint's own JSON files stand for the directory that holds them
        path = os.path.dirname(os.path.abspath(path))
    elif os.path.isfile(path):
        if path.endswith(".json"):
            raise CheckpointError(
                f"checkpoint path {path} is a JSON file, not safetensors weights: pass the "
                f"checkpoint directory (expected {_PATH_KINDS}); a config goes to load_config")
        return os.path.dirname(path) or ".", None, os.path.basename(path)
    if not os.path.isdir(path):
        if path in PRESETS:
            raise CheckpointError(
                f"checkpoint path {path} does not exist: {path!r} is a config preset name, not a "
                f"checkpoint. load_layer_weights needs {_PATH_KINDS}; for random weights without "
                f"a checkpoint use random_layer_weights(cfg, layer, seed), or write one with "
                f"write_synthetic_checkpoint(path, cfg)")
        raise CheckpointError(f"checkpoint path {path} does not exist (expected {_PATH_KINDS})")
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index with a 'weight_map' ({e!r})") from e
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: 'weight_map' must map tensor names to shard files")
        return path, {str(k): str(v) for k, v in weight_map.items()}, None
    if os.path.isfile(os.path.join(path, SINGLE_FILE)):
        return path, None, SINGLE_FILE
    raise CheckpointError(f"{path} holds neither {INDEX_FILE} nor {SINGLE_FILE} (expected {_PATH_KINDS})")


_PATH_KINDS = (f"a checkpoint directory (with {INDEX_FILE} and its shards, or one {SINGLE_FILE}) "
               f"or a .safetensors file")


def _progress_bar(total_bytes: int, forced: bool):
    """A tqdm bar of the bytes read, on stderr. Auto (``forced`` False): drawn only when stderr
    is a terminal (tqdm's ``disable=None``), so logs get no redraws; ``progress=True`` draws it
    anyway, at most a few redraws a second."""
    from tqdm.auto import tqdm

    return tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024,
                desc="loading attention weights", disable=False if forced else None,
                mininterval=0.5 if forced else 0.1, leave=True, file=sys.stderr)
