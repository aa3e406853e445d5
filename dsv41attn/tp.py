"""Tensor parallelism over the heads (docs/numerics.md §10), with torch.distributed only
(NCCL or gloo: the same code path).

World size w must divide n_heads, o_groups and index_n_heads. Rank r holds the contiguous
slices of the per-head tensors: ``wq_b`` rows (local heads H/w, with their 32-row scale
blocks), ``attn_sink`` [H/w], ``wo_a`` rows (local groups G/w; held dequantised to bf16, each
shard dequantised on its own), ``wo_b`` input columns (dim 1), ``indexer.wq_b`` rows (local
index heads I/w) and ``indexer.weights_proj`` rows [I/w, dim]; everything else and every cache
is replicated: each rank runs the whole state and the whole serving API. ``cfg`` stays the
global config everywhere (the index head-weight scale uses the global I); the local counts come
from ``TPShape`` only.

Two collectives per layer: the index scores, a per-rank partial sum over the local index heads
in bf16, all-reduced as a SUM in bf16 before visibility, candidates and top-k (so rounding
depends on w, and near-ties can order differently than at w = 1); and wo_b's fp32 partial
(before the bf16 cast), all-reduced as a SUM in fp32 and then cast to bf16 (as the reference's
RowParallelLinear; the fp32 sum keeps the result within one bf16 rounding of w = 1).

wo_b's activation quantisation works in 32-column blocks of its full input. When the column
split is 32-aligned (V4.1: 8192/w), each rank quantises its own columns (same blocks as w = 1).
When it is not (the tiny test geometries, o_groups*o_lora_rank = 32), the blocks straddle
ranks: the ranks all-gather the wo_b input so every block's scale is that of w = 1, and each
rank multiplies only its own columns (zero weight elsewhere in its blocks).

A layer call of a step succeeds or fails on every rank together (``TensorParallel.agreement``):
a rank whose part raises (out of memory, an interrupt: what differs between ranks that run the
same calls) announces it at the next agreement, a one-int all-reduce before each collective
and at the end of the call, so no rank waits in a collective for a rank that left, and every
rank undoes the step (``Step.abort``). Argument checks run before it and fail alike on every
rank given the same calls. Plans and CUDA graphs run without it (a graph cannot read the host).
"""
from __future__ import annotations

import dataclasses
import datetime
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.distributed as dist

from .checkpoint import (FP8, SCALE, Fp8Weight, LayerWeights, build_layer_weights,
                         check_layer_weights, raise_problems, read_layer_tensors)
from .config import AttentionConfig, ConfigError
from .ops.common.quant import act_quant
from .ops.linear.reference import fp8_gemm

BLOCK = 32


@dataclass(frozen=True)
class TPShape:
    """What rank ``rank`` of ``world`` holds: local heads, o_groups and index heads, and the
    [start, stop) slices of the sharded dims. The one place these counts are derived."""

    rank: int
    world: int
    heads: int
    groups: int
    index_heads: int
    q_rows: tuple[int, int]  # wq_b rows (heads * head_dim)
    o_rows: tuple[int, int]  # wo_a rows (groups * o_lora_rank)
    o_cols: tuple[int, int]  # wo_b input columns (= this rank's wo_a rows)
    index_rows: tuple[int, int]  # indexer.wq_b rows (index heads * index_head_dim)

    @property
    def head_slice(self) -> slice:
        return slice(self.rank * self.heads, (self.rank + 1) * self.heads)

    @property
    def index_head_slice(self) -> slice:
        return slice(self.rank * self.index_heads, (self.rank + 1) * self.index_heads)

    @property
    def o_col_blocks(self) -> tuple[int, int]:
        """wo_b scale columns (32-column blocks) this rank's input columns touch."""
        c0, c1 = self.o_cols
        return c0 // BLOCK, -(-c1 // BLOCK)

    @property
    def o_cols_aligned(self) -> bool:
        return self.o_cols[0] % BLOCK == 0 and self.o_cols[1] % BLOCK == 0


def check_world_size(cfg: AttentionConfig, world: int) -> None:
    """Raise ConfigError unless ``cfg`` can be split over ``world`` ranks (docs/numerics.md
    §10): w divides n_heads, o_groups and index_n_heads, and every rank's fp8 row slices (wq_b,
    indexer.wq_b) start and end on their 32-row scale blocks. Reads no tensor."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ConfigError(f"tensor-parallel world size must be a positive int, got {world!r}")
    bad = [f"{name}={n}" for name, n in (("n_heads", cfg.n_heads), ("o_groups", cfg.o_groups),
                                          ("index_n_heads", cfg.index_n_heads)) if n % world]
    if bad:
        raise ConfigError(
            f"tensor-parallel world size {world} must divide n_heads, o_groups and "
            f"index_n_heads (SPEC §7), but it does not divide {', '.join(bad)}; valid world "
            f"sizes: {[w for w in range(1, cfg.o_groups + 1) if _divides(cfg, w)]}")
    problems = []
    for name, rows in (("wq_b", cfg.n_heads // world * cfg.head_dim),
                       ("indexer.wq_b", cfg.index_n_heads // world * cfg.index_head_dim)):
        if rows % BLOCK:
            problems.append(f"{name}: {rows} rows per rank is not a multiple of the {BLOCK}-row "
                            f"fp8 scale block")
    k = cfg.o_groups * cfg.o_lora_rank
    for r in range(world):
        s = tp_shape(cfg, r, world, check=False)
        b0, b1 = s.o_col_blocks
        if b1 - b0 != -(-(s.o_cols[1] - s.o_cols[0]) // BLOCK):
            problems.append(f"wo_b: rank {r}'s input columns {s.o_cols[0]}..{s.o_cols[1]} of "
                            f"{k} span {b1 - b0} scale blocks of {BLOCK}; a shard must touch "
                            f"ceil(cols/{BLOCK}) blocks")
    if problems:
        raise ConfigError(f"tensor-parallel world size {world}: the shards do not fit the fp8 "
                          f"blocks:\n  " + "\n  ".join(problems))


def _divides(cfg: AttentionConfig, w: int) -> bool:
    return not (cfg.n_heads % w or cfg.o_groups % w or cfg.index_n_heads % w)


def tp_shape(cfg: AttentionConfig, rank: int, world: int, check: bool = True) -> TPShape:
    """Rank ``rank``'s local counts and slices (``check_world_size`` first unless check=False)."""
    if check:
        check_world_size(cfg, world)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise ConfigError(f"tensor-parallel rank must be an int in 0..{world - 1}, got {rank!r}")
    h, g, i = cfg.n_heads // world, cfg.o_groups // world, cfg.index_n_heads // world

    def span(n: int) -> tuple[int, int]:
        return rank * n, (rank + 1) * n

    return TPShape(rank, world, h, g, i, span(h * cfg.head_dim), span(g * cfg.o_lora_rank),
                   span(g * cfg.o_lora_rank), span(i * cfg.index_head_dim))


# ---- weights --------------------------------------------------------------------------------

def _rows(w: Fp8Weight, r0: int, r1: int) -> Fp8Weight:
    return Fp8Weight(w.weight[r0:r1].contiguous(), w.scale[r0 // BLOCK:r1 // BLOCK].contiguous())


def shard_layer_weights(cfg: AttentionConfig, weights: LayerWeights, rank: int,
                        world: int) -> LayerWeights:
    """Rank ``rank``'s slices (docs/numerics.md §10) of a full layer's weights (copies: the
    full tensors can be dropped). world = 1 returns ``weights`` itself."""
    s = tp_shape(cfg, rank, world)
    if world == 1:
        return weights
    check_layer_weights(cfg, weights)
    w = weights
    b0, b1 = s.o_col_blocks
    c0, c1 = s.o_cols
    out = dict(
        wq_b=_rows(w.wq_b, *s.q_rows),
        attn_sink=w.attn_sink[s.head_slice].contiguous(),
        wo_a=w.wo_a[s.o_rows[0]:s.o_rows[1]].contiguous(),
        wo_b=Fp8Weight(w.wo_b.weight[:, c0:c1].contiguous(), w.wo_b.scale[:, b0:b1].contiguous()),
    )
    if w.index_wq_b is not None:
        out["index_wq_b"] = _rows(w.index_wq_b, *s.index_rows)
        out["index_weights_proj"] = w.index_weights_proj[s.index_head_slice].contiguous()
    return dataclasses.replace(w, **out)


def _shard_shapes(cfg: AttentionConfig, s: TPShape) -> dict[str, tuple[int, ...]]:
    """LayerWeights field (fp8: ``field.weight`` / ``field.scale``) -> shape held by rank s."""
    k = cfg.o_groups * cfg.o_lora_rank
    b0, b1 = s.o_col_blocks
    return {
        "wq_b.weight": (s.heads * cfg.head_dim, cfg.q_lora_rank),
        "wq_b.scale": (s.heads * cfg.head_dim // BLOCK, -(-cfg.q_lora_rank // BLOCK)),
        "attn_sink": (s.heads,),
        "wo_a": (s.groups * cfg.o_lora_rank, cfg.n_heads * cfg.head_dim // cfg.o_groups),
        "wo_b.weight": (cfg.dim, k // s.world),
        "wo_b.scale": (-(-cfg.dim // BLOCK), b1 - b0),
        "index_wq_b.weight": (s.index_heads * cfg.index_head_dim, cfg.q_lora_rank),
        "index_wq_b.scale": (s.index_heads * cfg.index_head_dim // BLOCK,
                             -(-cfg.q_lora_rank // BLOCK)),
        "index_weights_proj": (s.index_heads, cfg.dim),
    }


def check_shard_weights(cfg: AttentionConfig, weights: LayerWeights, s: TPShape) -> None:
    """Raise CheckpointError unless ``weights`` is rank s's shard of a layer of ``cfg``: the
    sharded fields have their shard shapes, the replicated ones pass ``check_layer_weights``."""
    spec = cfg.layer(weights.layer)
    shapes = _shard_shapes(cfg, s)
    problems, stand_in = [], {}
    for field in ("wq_b", "attn_sink", "wo_a", "wo_b", "index_wq_b", "index_weights_proj"):
        v = getattr(weights, field)
        if v is None:
            continue  # missing where needed: check_layer_weights reports it
        parts = {"weight": v.weight, "scale": v.scale} if isinstance(v, Fp8Weight) else {"": v}
        for part, t in parts.items():
            key = f"{field}.{part}" if part else field
            if tuple(t.shape) != shapes[key]:
                problems.append(f"{spec.weight_prefix}{key}: rank {s.rank} of {s.world} must "
                                f"hold shape {list(shapes[key])}, found {list(t.shape)}")
        # the full-size stand-in lets check_layer_weights check dtypes and the rest
        full = {"wq_b": (cfg.n_heads * cfg.head_dim, cfg.q_lora_rank),
                "index_wq_b": (cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank),
                "wo_b": (cfg.dim, cfg.o_groups * cfg.o_lora_rank)}
        if isinstance(v, Fp8Weight) and field in full:
            n, k = full[field]
            stand_in[field] = Fp8Weight(
                torch.empty(n, k, dtype=v.weight.dtype, device=v.weight.device),
                torch.empty(-(-n // BLOCK), -(-k // BLOCK), dtype=v.scale.dtype,
                            device=v.scale.device))
        elif isinstance(v, torch.Tensor):
            n = {"attn_sink": (cfg.n_heads,),
                 "wo_a": (cfg.o_groups * cfg.o_lora_rank, shapes["wo_a"][1]),
                 "index_weights_proj": (cfg.index_n_heads, cfg.dim)}[field]
            stand_in[field] = torch.empty(n, dtype=v.dtype, device=v.device)
    raise_problems(problems, f"layer {weights.layer} tensor-parallel weights")
    check_layer_weights(cfg, dataclasses.replace(weights, **stand_in))


def shard_slices(s: TPShape) -> dict[str, tuple[slice, ...]]:
    """Checkpoint tensor name (relative to the layer) -> the slice of it rank ``s`` holds, for
    the sharded tensors (the others: all of it); the wo_a rows' scale blocks included, as
    stored (fp8 with block scales)."""
    b0, b1 = s.o_col_blocks
    (q0, q1), (a0, a1), (c0, c1), (i0, i1) = s.q_rows, s.o_rows, s.o_cols, s.index_rows
    return {
        "wq_b.weight": (slice(q0, q1),), "wq_b.scale": (slice(q0 // BLOCK, q1 // BLOCK),),
        "attn_sink": (s.head_slice,),
        "wo_a.weight": (slice(a0, a1),), "wo_a.scale": (slice(a0 // BLOCK, -(-a1 // BLOCK)),),
        "wo_b.weight": (slice(None), slice(c0, c1)), "wo_b.scale": (slice(None), slice(b0, b1)),
        "indexer.wq_b.weight": (slice(i0, i1),),
        "indexer.wq_b.scale": (slice(i0 // BLOCK, i1 // BLOCK),),
        "indexer.weights_proj.weight": (s.index_head_slice,),
    }


def load_layer_weights_tp(path: str | os.PathLike, cfg: AttentionConfig,
                          layers: int | Iterable[int] | None, rank: int, world: int,
                          device: torch.device | str = "cpu", progress: bool | None = None
                          ) -> tuple[dict[int, LayerWeights], int]:
    """Rank ``rank``'s shard of ``layers`` (None: all) from a checkpoint (the paths of
    ``load_layer_weights``), reading only that rank's slices with safetensors ``get_slice``
    (``checkpoint.read_layer_tensors``).

    The world size is checked (``check_world_size``) before any file is opened, then names,
    dtypes and shapes of the full tensors from the headers, before any data is read; every
    slice read is checked for NaN / Inf codes. Returns ({layer: LayerWeights shard}, bytes
    read by this rank)."""
    check_world_size(cfg, world)
    s = tp_shape(cfg, rank, world)
    sharded = world > 1
    a0, a1 = s.o_rows
    tensors, nbytes = read_layer_tensors(path, cfg, layers, slices=shard_slices(s) if sharded
                                         else None, progress=progress)
    out = {}
    for layer, own in tensors.items():
        if sharded and own["wo_a.weight"].dtype != torch.bfloat16:
            # dequantise the shard itself: its rows need not start on a scale block
            sc = own.pop("wo_a.scale").float().repeat_interleave(BLOCK, 0)
            sc = sc.repeat_interleave(BLOCK, 1)[a0 - a0 // BLOCK * BLOCK:][:a1 - a0]
            wa = own["wo_a.weight"]
            own["wo_a.weight"] = (wa.float() * sc[:, :wa.shape[1]]).to(torch.bfloat16)
        out[layer] = build_layer_weights(cfg.layer(layer),
                                         {k: v.to(device) for k, v in own.items()})
    for lw in out.values():
        check_shard_weights(cfg, lw, s) if sharded else check_layer_weights(cfg, lw)
    return out, nbytes


# ---- the layer's collectives ----------------------------------------------------------------

class PeerFailure(RuntimeError):
    """Raised on the ranks whose part of a layer call went through when another rank's part
    raised: the step was undone on every rank (that rank raises its own error)."""


class TensorParallel:
    """One layer's view of its process group: local counts, the two reductions, and the
    agreement that makes a step's layer call succeed or fail on every rank together."""

    def __init__(self, cfg: AttentionConfig, group, device: torch.device | str = "cpu"):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.shape = tp_shape(cfg, self.rank, self.world)
        self._flag = torch.zeros(1, dtype=torch.int32, device=device)
        self._agreeing: int | None = None  # the layer of the guarded call under way
        self._settled = False  # this call's outcome is agreed (a peer's failure was heard)

    @classmethod
    def of(cls, cfg: AttentionConfig, group,
           device: torch.device | str = "cpu") -> "TensorParallel | None":
        """None without a group or with a group of one rank (the unsharded layer)."""
        if group is None or dist.get_world_size(group) == 1:
            return None
        return cls(cfg, group, device)

    # ---- agreement: a step's layer call fails on every rank or on none ---------------------
    @contextmanager
    def agreement(self, layer: int):
        """Guard one layer call of a step (``AttentionLayer.forward``).

        Every collective of the body is preceded by an agreement, a one-int MAX all-reduce of
        this rank's status (0, or rank + 1 once it has failed), and the body ends with one
        more. A rank whose body raises takes part in one agreement, the next, announcing its
        failure, and re-raises; the ranks still running hear it at that same agreement (their
        next collective would have been the data collective the failed rank never reaches)
        and raise PeerFailure. So every rank issues the same collectives, none waits on a rank
        that left, and the call fails or succeeds on all of them; the caller undoes the step.
        Costs one agreement per collective plus one per layer call; plans and CUDA graphs
        (``AttentionLayer.run`` outside a step) run without it."""
        self._agreeing, self._settled = layer, False
        try:
            yield
            self._agree(failed=False)  # the call's end: every rank's part went through
        except BaseException:
            if not self._settled:
                self._settled = True
                self._agree(failed=True)
            raise
        finally:
            self._agreeing = None

    def _agree(self, failed: bool) -> None:
        """One agreement; raises PeerFailure if another rank announced a failure."""
        flag = self._flag
        flag.fill_(self.rank + 1 if failed else 0)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        who = int(flag.item()) - 1
        if who >= 0 and not failed:
            self._settled = True
            raise PeerFailure(f"layer {self._agreeing}: rank {who} of {self.world} raised in "
                              f"this layer call (its own error is raised there); the step was "
                              f"undone on every rank")

    def _before_collective(self) -> None:
        if self._agreeing is not None:
            self._agree(failed=False)

    # ---- the layer's collectives -----------------------------------------------------------
    def reduce_scores(self, scores: torch.Tensor) -> torch.Tensor:
        """Index scores: local heads' bf16 partial sum -> SUM over ranks, in bf16
        (docs/numerics.md §10)."""
        scores = scores.contiguous()
        self._before_collective()
        dist.all_reduce(scores, op=dist.ReduceOp.SUM, group=self.group)
        return scores

    def wo_b(self, ops, u: torch.Tensor, wo_b: Fp8Weight) -> torch.Tensor:
        """RowParallel wo_b: this rank's fp32 partial over its input columns, all-reduced as
        a SUM in fp32, then cast to bf16. u: [T, local cols] bf16 -> [T, dim] bf16."""
        if self.shape.o_cols_aligned:
            y = ops.fp8_linear(u, wo_b.weight, wo_b.scale, out_dtype=torch.float32)
        else:
            y = self._straddled_partial(u, wo_b)
        self._before_collective()
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=self.group)
        return y.to(torch.bfloat16)

    def _straddled_partial(self, u: torch.Tensor, wo_b: Fp8Weight) -> torch.Tensor:
        """The fp32 partial when 32-column quant blocks straddle ranks: the whole input is
        gathered so each block's activation scale is that of w = 1; this rank's columns only
        (zero weight on the rest of its blocks)."""
        parts = [torch.empty_like(u) for _ in range(self.world)]
        u = u.contiguous()
        self._before_collective()
        dist.all_gather(parts, u, group=self.group)
        x_q, x_s = act_quant(torch.cat(parts, dim=-1))  # [T, K] e4m3 values, [T, K/32]
        (c0, c1), (b0, b1) = self.shape.o_cols, self.shape.o_col_blocks
        w = torch.zeros(wo_b.weight.shape[0], (b1 - b0) * BLOCK, dtype=FP8, device=u.device)
        w[:, c0 - b0 * BLOCK:c1 - b0 * BLOCK] = wo_b.weight
        return fp8_gemm(x_q[:, b0 * BLOCK:b1 * BLOCK].contiguous(), x_s[:, b0:b1].contiguous(),
                        w, wo_b.scale)


# ---- process groups ---------------------------------------------------------------------------

def init_gloo(rank: int, world: int, port: int, timeout_s: float = 60.0) -> None:
    """A gloo process group over 127.0.0.1:``port`` (tests, CPU runs), failing after
    ``timeout_s`` instead of hanging when a rank is missing."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout_s))


__all__ = ["TPShape", "TensorParallel", "PeerFailure", "check_world_size", "tp_shape",
           "shard_layer_weights", "shard_slices", "check_shard_weights", "load_layer_weights_tp",
           "init_gloo",
           "SCALE"]
