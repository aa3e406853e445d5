"""One V4.1 attention layer's forward (SPEC §4), readable top to bottom.

The layer holds only its config, spec and weights; every cache lives in the caller's
``AttentionState`` and everything published between layers of one forward step lives in the
``Step`` (``stack.py``). The flow mirrors the reference ``Attention.forward``:

  query path -> window K/V and the ring -> [compressor -> indexer] -> sparse attention with
  sink -> inverse RoPE -> grouped wo_a -> wo_b

Two entry points share it: ``decode`` (one token per sequence, each at its own position on the
device, fixed shapes: GPU-only, capturable in a CUDA graph) and ``_forward_group`` (several
tokens per sequence from one position: prefill, chunks, draft verification). The fusable ops
go through the backend's ``Ops`` (reference torch or Triton, same signatures).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .cache import AttentionState, StateError
from .checkpoint import LayerWeights, check_layer_weights
from .config import AttentionConfig
from .ops.common.norm import rms_norm
from .ops.common.packing import pack_compressed_rows, pack_index_keys, pack_window_rows
from .ops.common.quant import index_fp4_fake_quant
from .ops.common.rope import apply_rope, rope_frequencies, rope_rotations
from .ops.common.window import (ring_write, window_indices_chunk, window_indices_decode,
                                window_indices_prefill)
from .ops.compressor.reference import compress
from .ops.indexer.reference import (candidate_blocks, expand_blocks, index_scores,
                                    mask_invisible, select_topk)
from .ops.linear.reference import linear
from .ops.backends import get_ops

INDEX_SCORE_BUDGET = 1 << 30  # bytes of bf16 index scores per query tile

if TYPE_CHECKING:
    from .stack import Group, Step


class AttentionLayer:
    """Layer ``weights.layer`` of ``cfg`` with its weights; stateless between calls.
    ``backend``: "reference" (plain torch) or "triton" (Triton kernels where they exist)."""

    def __init__(self, cfg: AttentionConfig, weights: LayerWeights, backend: str = "reference"):
        self.cfg = cfg
        self.ops = get_ops(backend)
        self.spec = cfg.layer(weights.layer)
        self.weights = weights
        check_layer_weights(cfg, weights)
        # [rope_head_dim/2] fp32, on the weights' device: no host copy per call (graph capture)
        self.freqs = rope_frequencies(cfg, self.spec).to(self.device)

    @property
    def device(self) -> torch.device:
        return self.weights.attn_sink.device

    def forward(self, x: torch.Tensor, state: AttentionState, step: "Step") -> torch.Tensor:
        """One step of this layer.

        x: bf16, [b, m, dim] when every sequence of the step is at one position with one token
        count (``step.uniform``), else packed [sum(tokens), dim] in ``step.cu_seqlens`` order.
        Returns the output in x's layout. Updates this layer's ring and cursor (and, for a KV
        source, its compressed rows, index keys and open group) and publishes what later
        layers of the step need. Bad input raises before any state changes.
        """
        self._check_call(x, state, step)
        state.epoch += 1  # positions move outside any DecodePlan
        if x.dim() == 3:
            y = self._run_group(x, state, step.groups[0])
        else:
            y = torch.empty_like(x)
            for g in step.groups:
                xg = x[g.token_index].view(g.rows.numel(), g.tokens, -1)
                y[g.token_index] = self._run_group(xg, state, g).flatten(0, 1)
        step.mark_done(self.spec.layer)
        return y

    __call__ = forward

    def _run_group(self, x: torch.Tensor, state: AttentionState, group: "Group") -> torch.Tensor:
        if group.tokens == 1:
            return self.decode(x, state, group, group.positions())
        return self._forward_group(x, state, group)

    def decode(self, x: torch.Tensor, state: AttentionState, group: "Group",
               pos: torch.Tensor) -> torch.Tensor:
        """One token per sequence, each at its own position: the GPU-only step of decoding.

        x: [b, 1, dim] bf16 for the sequences ``group.rows``; pos: [b] int64 on the device,
        their positions (== this layer's cursor for them). Every shape is fixed by ``group``
        (the rows each indexer scans: ``group.scan_rows(r)``), and nothing is read back to
        the host, so this can be captured in a CUDA graph (``DecodePlan``). No validation
        here: ``forward`` and ``DecodePlan`` check before calling.
        """
        cfg, spec, w, ops = self.cfg, self.spec, self.weights, self.ops
        b = x.shape[0]
        rows = group.rows
        rot = rope_rotations(self.freqs, pos)  # [b, R/2] complex64

        # Query path (§4.1).
        qr = rms_norm(ops.fp8_linear(x, w.wq_a.weight, w.wq_a.scale), w.q_norm, cfg.norm_eps)
        q = ops.fp8_linear(qr, w.wq_b.weight, w.wq_b.scale).view(b, cfg.n_heads, cfg.head_dim)
        q = ops.rope_heads(q, rot).unsqueeze(1)  # [b, 1, H, D]

        # Window K/V (§4.2): norm, RoPE, fp8, packed into the ring, then attended from it.
        layer_state = state.layers[spec.layer]
        slots = layer_state.window.shape[1]
        kv = ops.fp8_linear(x, w.wkv.weight, w.wkv.scale)[:, 0]  # [b, D] bf16
        ops.norm_rope_pack(kv, w.kv_norm, cfg.norm_eps, rot, layer_state.window, rows, pos % slots)
        window_rows = layer_state.window[rows]  # [b, W + R, D + D/32] uint8, oldest slot first
        window_idx = window_indices_decode(pos, cfg.window_size, slots).unsqueeze(1)

        pool = table = None
        selected = torch.empty(b, 1, 0, dtype=torch.int32, device=x.device)
        if spec.ratio > 0:
            if spec.is_kv_source:
                self._decode_compressor(x, state, group, pos)
            selected = (self._index(x, qr, pos.unsqueeze(1), rot.unsqueeze(1), state, group)
                        if spec.is_index_source else group.topk(spec.index_source))
            pool, table = state.sources[spec.kv_source].rows, state.block_table[rows]
        o = ops.sparse_attn_paged(q, w.attn_sink, cfg.softmax_scale, window_rows,
                                  window_idx, pool, table, selected)  # [b, 1, H, D]
        y = self._output(o, rot.unsqueeze(1))
        layer_state.positions[rows] = pos + 1
        return y

    def _output(self, o: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
        """Inverse RoPE and the grouped output projection (§4.6): o [b, m, H, D] bf16, rot
        [b or 1, m, R/2] -> [b, m, dim] bf16."""
        cfg, w = self.cfg, self.weights
        b, m = o.shape[:2]
        rot = rot.expand(b, m, -1).reshape(b * m, -1)
        # bf16 wo_a: on a GPU cuBLAS's GEMM beats the fused fp8 kernel (ops/output/triton.py)
        u = self.ops.inverse_rope_wo_a(o.reshape(b * m, cfg.n_heads, cfg.head_dim), rot,
                                       w.wo_a, cfg.o_groups)  # [b * m, G * o_lora_rank]
        return self.ops.fp8_linear(u.view(b, m, -1), w.wo_b.weight, w.wo_b.scale)

    def _decode_compressor(self, x, state: AttentionState, group: "Group", pos: torch.Tensor):
        """KV source, one token per sequence: the token joins its group's fp32 projections; a
        sequence whose group completes (pos + 1 divisible by r) writes the group's compressed
        row and index key, the others keep their bytes (restored: shapes stay fixed)."""
        cfg, spec, w = self.cfg, self.spec, self.weights
        rows, r = group.rows, spec.ratio
        source = state.sources[spec.layer]
        g = pos // r  # [b] the token's group (compressed row number)
        if r == 1:
            kv, score = linear(x, w.compressor_wkv), None  # [b, 1, D] bf16: the group itself
        else:
            xf = x.float()
            held = source.recent_kv.shape[1]
            source.recent_kv[rows, pos % held] = linear(xf, w.compressor_wkv)[:, 0]
            source.recent_score[rows, pos % held] = linear(xf, w.compressor_wgate)[:, 0]
            tokens = ((g * r).unsqueeze(1) + torch.arange(r, device=x.device)) % held  # [b, r]
            kv = source.recent_kv[rows.unsqueeze(1), tokens]  # [b, r, D] fp32, the whole group
            score = source.recent_score[rows.unsqueeze(1), tokens]
        page = state.block_table[rows, g // source.page_rows]
        slot = g % source.page_rows
        if r > 1:  # an incomplete group must not overwrite its (future) row: keep the bytes
            old_rows, old_keys = source.rows[page, slot], source.index_keys[page, slot]
        rot = rope_rotations(self.freqs, g * r)  # [b, R/2]: a group stands for its first token
        self.ops.pool_norm_rope_pack(kv, score, w.compressor_norm, w.index_wk, w.index_k_norm,
                                     cfg.norm_eps, rot, source.rows, source.index_keys, page, slot)
        if r > 1:
            done = ((pos + 1) % r == 0).unsqueeze(1)
            source.rows[page, slot] = torch.where(done, source.rows[page, slot], old_rows)
            source.index_keys[page, slot] = torch.where(done, source.index_keys[page, slot], old_keys)
        group.publish_index_keys(spec.layer, produced=group.semantics == "fixed"
                                 or group.completes_group(r))

    def _forward_group(self, x: torch.Tensor, state: AttentionState, step: "Group") -> torch.Tensor:
        """x: [b, m, dim] for the sequences ``step.rows``, all at ``step.start_pos``."""
        cfg, spec, w = self.cfg, self.spec, self.weights
        b, m, _ = x.shape
        p0, rows = step.start_pos, step.rows
        pos = p0 + torch.arange(m, device=x.device)  # [m]
        rot = rope_rotations(self.freqs, pos)  # [m, R/2] complex64

        # Query path (§4.1).
        linear8 = self.ops.fp8_linear
        qr = rms_norm(linear8(x, w.wq_a.weight, w.wq_a.scale), w.q_norm, cfg.norm_eps)
        q = linear8(qr, w.wq_b.weight, w.wq_b.scale).unflatten(-1, (cfg.n_heads, cfg.head_dim))
        q = apply_rope(q, rot.unsqueeze(1))  # [b, m, H, D]

        # Window K/V (§4.2): norm -> RoPE -> fp8 quant, stored packed (528 B rows).
        kv = rms_norm(linear8(x, w.wkv.weight, w.wkv.scale), w.kv_norm, cfg.norm_eps)
        kv_packed = pack_window_rows(apply_rope(kv, rot))  # [b, m, D + D/32] uint8
        layer_state = state.layers[spec.layer]
        ring = layer_state.window[rows]  # [b, W + R, D + D/32] uint8, before this call
        new_ring = ring_write(ring, kv_packed, p0)
        window_rows, window_idx = self._window(kv_packed, ring, new_ring, p0, m)

        pool = table = None
        selected = torch.empty(b, m, 0, dtype=torch.int32, device=x.device)
        if spec.ratio > 0:
            selected = self._select_compressed(x, qr, pos, rot, state, step)  # [b, m, k]
            pool, table = state.sources[spec.kv_source].rows, state.block_table[rows]
        o = self.ops.sparse_attn_paged(q, w.attn_sink, cfg.softmax_scale, window_rows,
                                       window_idx, pool, table, selected)  # [b, m, H, D]

        y = self._output(o, rot.unsqueeze(0))

        layer_state.window[rows] = new_ring
        layer_state.positions[rows] = p0 + m
        return y

    # ---- the window part -----------------------------------------------------------------
    def _window(self, kv, ring, new_ring, p0: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(window rows [b, n_win, bytes] packed, indices [b, m, w_win] int32) for the three
        call kinds; ``ring`` is the ring before this call's write, ``new_ring`` after it."""
        win, b, slots = self.cfg.window_size, kv.shape[0], ring.shape[1]
        if p0 == 0:
            return kv, window_indices_prefill(m, win, kv.device).expand(b, -1, -1)
        if m == 1:
            pos = torch.full((b,), p0, device=kv.device)
            return new_ring, window_indices_decode(pos, win, slots).unsqueeze(1)
        idx = window_indices_chunk(p0, m, win, slots, kv.device)
        return torch.cat([ring, kv], dim=1), idx.expand(b, -1, -1)

    # ---- compressed rows and their selection (§4.3, §4.4) --------------------------------
    def _select_compressed(self, x, qr, pos, rot, state: AttentionState, step: "Group"):
        """The compressed row numbers [b, m, k] each query attends to (-1 pad): this layer's
        indexer for index sources, its source's top-k otherwise. A KV source first runs its
        compressor. pos [m] and rot [m, R/2] are the queries' positions and rotations."""
        if self.spec.is_kv_source:
            self._run_compressor(x, state, step)
        if not self.spec.is_index_source:
            return step.topk(self.spec.index_source)
        return self._index(x, qr, pos.unsqueeze(0), rot.unsqueeze(0), state, step)

    def _index(self, x, qr, pos, rot, state: AttentionState, group: "Group") -> torch.Tensor:
        """The lightning indexer of an index source (§4.4): top-k compressed rows [b, m, k]
        int32 (-1 pad), published for the layers that reuse them (and, for the candidate
        source, the kept candidate blocks). pos [b or 1, m] int64 and rot [b or 1, m, R/2]:
        the queries' positions and rotations. Scans ``group.scan_rows(r)`` rows per sequence;
        rows a query cannot see yet are masked, so a longer scan selects the same rows."""
        cfg, spec, w = self.cfg, self.spec, self.weights
        b, m, _ = x.shape
        rows, r = group.rows, spec.ratio
        n_total = group.scan_rows(r)
        if n_total == 0:
            selected = torch.empty(b, m, 0, dtype=torch.int32, device=x.device)
            group.publish_topk(spec.layer, selected)
            return selected

        q_index = self.ops.fp8_linear(qr, w.index_wq_b.weight, w.index_wq_b.scale)
        q_index = q_index.unflatten(-1, (cfg.index_n_heads, cfg.index_head_dim))
        q_index = index_fp4_fake_quant(apply_rope(q_index, rot.unsqueeze(2)))
        head_weights = linear(x, w.index_weights_proj) * cfg.index_weight_scale  # [b, m, I]
        keys = state.read_index_keys(group.index_key_layer(spec), rows, n_total)
        visible = ((pos + 1) // r).expand(b, m)
        bs = cfg.candidate_block_size
        if spec.is_candidate_source:
            keep = torch.empty(b, m, -(-n_total // bs), dtype=torch.bool, device=x.device)
        if spec.is_candidate_consumer:
            keep = group.candidates(n_total)
        selected = torch.empty(b, m, min(cfg.index_topk, n_total), dtype=torch.int32,
                               device=x.device)
        # Query tiles bound the [tile, I, n_total] score buffer (SPEC §10.5); rows are independent.
        tile = max(1, min(m, INDEX_SCORE_BUDGET // max(1, b * cfg.index_n_heads * n_total * 2)))
        for i0 in range(0, m, tile):
            t = slice(i0, i0 + tile)
            scores = index_scores(q_index[:, t], head_weights[:, t], keys)  # [b, t, n] bf16
            scores = mask_invisible(scores, visible[:, t])
            if spec.is_candidate_source:
                keep[:, t] = candidate_blocks(scores, visible[:, t], cfg.candidate_topk_blocks, bs)
            if spec.is_candidate_consumer:
                scores = scores.masked_fill(~expand_blocks(keep[:, t], bs, n_total), float("-inf"))
            selected[:, t] = select_topk(scores, visible[:, t], cfg.index_topk)
        if spec.is_candidate_source:
            group.publish_candidates(keep)
        group.publish_topk(spec.layer, selected)
        return selected

    def _run_compressor(self, x, state: AttentionState, step: "Group") -> None:
        """KV source: pool completed groups, then index keys from the pre-RoPE latent, then
        the rotated, fp4-quantised latent into the compressed rows (SPEC §10.10)."""
        cfg, spec, w = self.cfg, self.spec, self.weights
        p0, rows, r = step.start_pos, step.rows, spec.ratio
        source = state.sources[spec.layer]
        open_kv = open_score = None
        if source.recent_kv is not None:  # the open group's tokens, from the recent ring
            held = torch.arange(p0 - p0 % r, p0, device=x.device) % source.recent_kv.shape[1]
            open_kv = source.recent_kv[rows[:, None], held[None, :]]
            open_score = source.recent_score[rows[:, None], held[None, :]]
        latent, kv, score = compress(x, p0, r, w.compressor_wkv, w.compressor_wgate,
                                     w.compressor_norm, cfg.norm_eps, open_kv, open_score)
        if kv is not None:
            source.recent_kv[rows] = ring_write(source.recent_kv[rows], kv, p0)
            source.recent_score[rows] = ring_write(source.recent_score[rows], score, p0)
        if latent is not None:
            g = p0 // r + torch.arange(latent.shape[1], device=x.device)
            rot = rope_rotations(self.freqs, g * r)  # a group stands for its first token
            keys = rms_norm(linear(latent, w.index_wk), w.index_k_norm, cfg.norm_eps)
            packed_keys = pack_index_keys(apply_rope(keys, rot))
            packed_rows = pack_compressed_rows(apply_rope(latent, rot))
            state.write_compressed(spec.layer, rows, g, packed_rows, packed_keys)
        step.publish_index_keys(spec.layer, produced=latent is not None)

    # ---- validation, before anything is written ------------------------------------------
    def check_input(self, x: torch.Tensor, step: "Step") -> None:
        """x's type, dtype, shape and device for this step (no state is read)."""
        cfg = self.cfg
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype != torch.bfloat16:
            raise TypeError(f"x must be bfloat16, got {x.dtype}")
        if x.dim() == 3:
            if not step.uniform or x.shape[0] != step.rows.numel() or x.shape[2] != cfg.dim:
                raise ValueError(
                    f"x has shape {list(x.shape)}; a [b, m, dim] input needs every sequence at "
                    f"one position with one token count and b={step.rows.numel()}, "
                    f"dim={cfg.dim}; otherwise pack x as [sum(tokens)={step.total_tokens}, dim]")
            if x.shape[1] != step.tokens[0]:
                raise ValueError(f"x has m={x.shape[1]} tokens but the step was opened for "
                                 f"{step.tokens[0]}")
        elif x.dim() != 2 or x.shape[0] != step.total_tokens or x.shape[1] != cfg.dim:
            raise ValueError(f"x must have shape [sum(tokens)={step.total_tokens}, dim={cfg.dim}] "
                             f"(or [b, m, dim] for a uniform step), got {list(x.shape)}")
        if x.device != step.state.device or x.device != self.device:
            raise ValueError(f"x is on {x.device}, the state on {step.state.device} and the "
                             f"weights on {self.device}: they must agree")

    def _check_call(self, x: torch.Tensor, state: AttentionState, step: "Step") -> None:
        cfg, spec = self.cfg, self.spec
        if step.state is not state:
            raise StateError("the step was opened on a different state")
        if state.config is not cfg and state.config != cfg:
            raise StateError("the state was allocated for a different AttentionConfig")
        self.check_input(x, step)
        if spec.layer not in state.layers:
            raise StateError(f"layer {spec.layer} has no caches in this state "
                             f"(allocated for layers {sorted(state.layers)})")
        if spec.kv_source is not None and spec.kv_source not in state.sources:
            raise StateError(f"layer {spec.layer} needs KV source {spec.kv_source}, which has "
                             "no caches in this state")
        seen = state.layers[spec.layer].positions[step.rows].tolist()
        for row, p, m, have in zip(step.rows.tolist(), step.starts, step.tokens, seen):
            if have != p:
                raise StateError(
                    f"layer {spec.layer}: sequence {row} is at position {have}, but this step "
                    f"continues it from {p}: positions must neither skip nor repeat")
        step.check_can_run(spec)

