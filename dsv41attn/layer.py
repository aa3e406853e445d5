"""One V4.1 attention layer's forward (docs/numerics.md §5), readable top to bottom.

The layer holds only its config, spec and weights. Every cache lives in the caller's
``AttentionState``; every per-token fact of the step (positions, RoPE, window lists, ring and
page slots, compressor groups, visibility) lives in the step's ``StepPlan``; what index
sources publish for later layers lives on the step's ``Board``. One code path serves every
call kind: prefill, chunks, draft verification, decode and any mix in one step are values of
the plan. The flow mirrors the reference ``Attention.forward``:

  window K/V [-> compressor]   (on a CUDA device: a branch stream, beside the query path)
  query path [-> index query, RoPE'd]   (and an index source's head weights: on the branch
                                         unless it holds a compressor, else here)
  -> [indexer] -> sparse attention with sink -> inverse RoPE -> grouped wo_a -> wo_b
  -> this step's rows into the ring

(A decode plan, one token per sequence, writes its rows into the ring with the window K/V
pack instead: the slot it overwrites is one no query of the step reads.)

Every op goes through the backend's ``Ops`` (reference torch or Triton, same signatures).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .cache import AttentionState, StateError
from .checkpoint import LayerWeights, check_layer_weights
from .config import AttentionConfig
from .ops.backends import get_ops
from .ops.common.cpu_kernels import warn_if_kernels_differ
from .ops.common.rope import rope_frequencies
from .plan import Board, RatioFacts, StepPlan, UndoLog, publishes_index_keys
from .streams import Fork
from .tp import TensorParallel, check_shard_weights

if TYPE_CHECKING:
    from .stack import Step


class AttentionLayer:
    """Layer ``weights.layer`` of ``cfg`` with its weights; stateless between calls.
    ``backend``: "reference" (plain torch) or "triton" (Triton kernels where they exist).
    ``tp_group``: None, or a torch.distributed process group over which the heads are split
    (``tp.py``, docs/numerics.md §10): ``weights`` is then this rank's shard
    (``shard_layer_weights``), ``cfg`` stays the global config, and every rank runs the same
    calls on its own replicated state. A group of one rank is the unsharded layer.
    ``batch_invariant`` (triton only): every reduction in a fixed order, so that a sequence's
    outputs never depend on the call (``ops.backends``; its cost in docs/benchmarks.md)."""

    def __init__(self, cfg: AttentionConfig, weights: LayerWeights, backend: str = "reference",
                 tp_group=None, batch_invariant: bool = False):
        self.cfg = cfg
        self.ops = get_ops(backend, batch_invariant)
        self.spec = cfg.layer(weights.layer)
        self.weights = weights
        self.tp = TensorParallel.of(cfg, tp_group, weights.attn_sink.device)  # None: unsharded
        if self.tp is None:
            check_layer_weights(cfg, weights)
            self.heads, self.groups, self.index_heads = cfg.n_heads, cfg.o_groups, cfg.index_n_heads
        else:
            check_shard_weights(cfg, weights, self.tp.shape)
            s = self.tp.shape
            self.heads, self.groups, self.index_heads = s.heads, s.groups, s.index_heads
        self.prepare()
        # [rope_head_dim/2] fp32 on the weights' device (plans build rotations from it)
        self.freqs = rope_frequencies(cfg, self.spec).to(self.device)
        if backend == "reference" and self.device.type == "cpu":
            warn_if_kernels_differ()  # torch's CPU kernels round as the golden fixtures' did

    @property
    def device(self) -> torch.device:
        return self.weights.attn_sink.device

    def prepare(self) -> None:
        """Build the backend's copies of weights (``prepared_nbytes``) from ``self.weights`` as
        they are now; ``__init__`` does. Call it after writing weights in place: a copy serves
        only the tensor it was made from, unchanged, so until then eager calls take the
        slower path that reads the weights themselves, and a ``DecodeGraph`` whose launches
        read the copy refuses to replay (it would read the old values). A copy made from the
        same tensors is rewritten in place, so such a graph replays again, reading the new
        values; one the new weights cannot have (wo_a no longer exactly fp8) is dropped, and
        a graph that read it must be captured again."""
        w = self.weights
        # the r > 1 compressor's projections (the triton backend's step-sized mode: a float64
        # copy of wkv and wgate, docs/numerics.md §9)
        # (each rewritten in place where it was made from the same tensors: a decode graph
        # that captured it then reads the new values)
        before = getattr(self, "compressor_kw", {}).get("prepared")
        self.compressor_kw = (self.ops.compressor_prepare(w.compressor_wkv, w.compressor_wgate,
                                                          previous=before)
                              if self.spec.is_kv_source and self.spec.ratio > 1 else {})
        # wo_a's (the triton backend: its e4m3 codes, read by decode-sized calls)
        before = getattr(self, "wo_a_kw", {}).get("codes")
        self.wo_a_kw = self.ops.wo_a_prepare(w.wo_a, previous=before)

    def _prepared(self) -> dict[str, tuple[object, bool]]:
        """Each prepared copy, by the weights it was made from: (the copy, whether it still
        serves them)."""
        w, out = self.weights, {}
        prepared = self.compressor_kw.get("prepared")
        if prepared is not None:
            out["compressor_wkv / compressor_wgate"] = (
                prepared, prepared.serves(w.compressor_wkv, w.compressor_wgate))
        codes = self.wo_a_kw.get("codes")
        if codes is not None:
            out["wo_a"] = (codes, codes.serves(w.wo_a))
        return out

    def serving_copies(self) -> dict[str, object]:
        """The prepared copies that serve their weights now, by those weights' names (what a
        captured decode graph reads: ``DecodeGraph`` checks they are still these)."""
        return {name: copy for name, (copy, serves) in self._prepared().items() if serves}

    def stale_prepared(self) -> list[str]:
        """The weights whose prepared copies no longer serve them (written in place, or
        replaced, since ``prepare``): what ``prepare`` would rebuild."""
        return [name for name, (_, serves) in self._prepared().items() if not serves]

    @property
    def prepared_nbytes(self) -> int:
        """Bytes the layer keeps beside ``weights.nbytes``: what its backend prepared once (the
        triton backend: wo_a's e4m3 codes; in its step-sized mode also a float64 copy of a
        ratio > 1 compressor's weights)."""
        return sum(v.nbytes for kw in (self.compressor_kw, self.wo_a_kw) for v in kw.values())

    def forward(self, x: torch.Tensor, state: AttentionState, step: "Step") -> torch.Tensor:
        """This layer's part of an open step.

        x: bf16, packed [sum(tokens), dim] in the step's ``cu_seqlens`` order, or [b, m, dim]
        when every sequence of the step has m tokens. Returns the output in x's layout.
        Everything is checked before the first write; if this layer raises, the whole step is
        undone (every sequence back where it was before the step) and the error re-raised.
        Under tensor parallelism the call succeeds or fails on every rank together: if one
        rank's part raises, every rank undoes the step (the others raise ``tp.PeerFailure``);
        ``TensorParallel.agreement``.
        """
        step.begin_layer(self, x, state)
        try:
            with torch.no_grad():
                if self.tp is None:
                    y = self.run(x.reshape(-1, x.shape[-1]), state, step.plan, step.board,
                                 step.undo, step.semantics, step.trace)
                else:
                    with self.tp.agreement(self.spec.layer):
                        y = self.run(x.reshape(-1, x.shape[-1]), state, step.plan, step.board,
                                     step.undo, step.semantics, step.trace)
        except BaseException:
            step.abort()
            raise
        step.end_layer(self.spec.layer)
        return y.view(x.shape)

    __call__ = forward

    def run(self, x: torch.Tensor, state: AttentionState, plan: StepPlan, board: Board,
            undo: UndoLog, semantics: str, trace=None) -> torch.Tensor:
        """The layer over the step's packed tokens, no checks (``forward`` and ``DecodePlan``
        check first). x: [T, dim] bf16 -> [T, dim] bf16. No host sync for a decode plan on
        a capturable backend. ``trace``: None, or a callable given (layer, record) after the
        attention, before anything else is written (``trace.py``); it reads, never writes."""
        cfg, spec, w, ops = self.cfg, self.spec, self.weights, self.ops
        t = x.shape[0]
        rot = plan.rotations_of(spec)  # [T, R/2] complex64

        decode = not plan.compact  # a decode plan: one token per sequence
        # an index source with rows to score this step: its indexer inputs (index query, head
        # weights) are made inside the fork, the head weights on the window K/V branch (the
        # shortest path)
        facts = plan.ratios[spec.ratio] if spec.ratio > 0 else None  # this layer's ratio group
        scoring = facts is not None and spec.is_index_source and facts.scan > 0
        compresses = facts is not None and spec.is_kv_source
        head_weights = None
        with Fork(x.device, ops.capturable, branches=2 if compresses else 1) as fork:
            # Window K/V (step 2) and the compressed rows (step 3) read only x and the state:
            # on a CUDA device each runs on a branch stream of its own beside the query path
            # (streams.py).
            with fork.branch(0):
                # Window K/V: norm, RoPE, fp8, packed rows of this step. A step plan writes
                # them into the ring after attention (a long chunk's rows would overwrite
                # slots its early queries read); a decode plan's one token per sequence
                # overwrites a slot no query reads, so the same launch writes it and the
                # layer's positions.
                kv = ops.fp8_linear(x, w.wkv.weight, w.wkv.scale)
                ring = state.decode_window_write(spec.layer, plan, undo) if decode else {}
                new_rows = ops.norm_rope_pack(kv, w.kv_norm, cfg.norm_eps, rot, **ring)
                if scoring:
                    head_weights = self._head_weights(x)
            if compresses:
                with fork.branch(1):
                    self._compress(x, state, facts, undo, semantics, decode)

            # Query path (docs/numerics.md §5, step 1): wq_a, then q_norm inside wq_b's
            # act-quant and the query's RoPE as wq_b writes q. An index source with rows to
            # score this step projects the indexer's query from the same qr: one act-quant
            # for both.
            q_low = ops.fp8_linear(x, w.wq_a.weight, w.wq_a.scale)
            q_norm, q_rope = (w.q_norm, cfg.norm_eps), (rot, cfg.head_dim)
            q_index = None
            if scoring:
                q, q_index = ops.fp8_linear_pair(q_low, w.wq_b.weight, w.wq_b.scale,
                                                 w.index_wq_b.weight, w.index_wq_b.scale,
                                                 norm=q_norm, rope=q_rope)
                q_index = ops.rope_fp4_heads(q_index.view(t, self.index_heads,
                                                          cfg.index_head_dim), rot)
            else:
                q = ops.fp8_linear(q_low, w.wq_b.weight, w.wq_b.scale, norm=q_norm, rope=q_rope)
            q = q.view(t, self.heads, cfg.head_dim)  # [T, H, D], RoPE'd
        # joined: the indexer and the attention read the rows the branch wrote

        # The selection of compressed rows (step 4).
        pool = None
        selected = torch.empty(t, 0, dtype=torch.int32, device=x.device)
        if facts is not None:
            selected = self._index(x, q_index, head_weights, state, plan, facts, board) \
                if spec.is_index_source else board.topk(spec.index_source)
            pool = state.sources[spec.kv_source].rows

        # Sparse attention with sink (step 5, §6), the ring read in place. Its output comes
        # with step 6's inverse RoPE applied (on the GPU by the split merge where there is
        # one: no launch of its own), unless a trace hook reads the output before it.
        layer_state = state.layers[spec.layer]
        turned = trace is None
        o = ops.sparse_attn_paged(q, w.attn_sink, cfg.softmax_scale, layer_state.window,
                                  new_rows, plan.window_ids, pool, state.block_table,
                                  plan.token_row, selected,
                                  out_rot=rot if turned else None)  # [T, H, D]

        # Inverse RoPE (unless done above) and the grouped output projection (step 6).
        if trace is not None:
            trace(self, {"plan": plan, "board": board, "q": q, "new_rows": new_rows,
                         "window_ring": layer_state.window, "pool": pool, "selected": selected,
                         "block_table": state.block_table, "o": o})
        if self.tp is None:  # and wo_b: [T, dim]
            y = ops.output_projection(o, None if turned else rot, w.wo_a, self.groups,
                                      w.wo_b.weight, w.wo_b.scale, **self.wo_a_kw)
        else:  # this rank's fp32 wo_b partial, all-reduced in fp32, then bf16
            u = ops.inverse_rope_wo_a(o, None if turned else rot, w.wo_a, self.groups,
                                      **self.wo_a_kw)  # [T, G * Rk]
            y = self.tp.wo_b(ops, u, w.wo_b)

        if not decode:
            state.write_window(spec.layer, plan, new_rows, undo)
        return y

    def _compress(self, x: torch.Tensor, state: AttentionState, facts: RatioFacts,
                  undo: UndoLog, semantics: str, decode: bool) -> None:
        """KV source (docs/numerics.md §5, step 3): the groups completed by this step's tokens
        become compressed rows and index keys in the pool (keys from the pre-RoPE latent); r > 1
        keeps every token's fp32 projections in the recent ring for the open group (a decode
        plan's one token per sequence: the gathers and the ring write in one op)."""
        cfg, spec, w = self.cfg, self.spec, self.weights
        source = state.sources[spec.layer]
        if spec.ratio == 1:
            # ratio 1: every token closes its group (close_tokens lists them all, in order)
            kv = self.ops.linear(x, w.compressor_wkv).unsqueeze(1)  # [N = T, 1, D] bf16
            score = None
        else:
            new_kv, new_score = self.ops.compressor_project(
                x, w.compressor_wkv, w.compressor_wgate, **self.compressor_kw)  # [T, D] fp32
            if decode:
                kv, score = self.ops.recent_gather_write(
                    source.recent_kv, source.recent_score, new_kv, new_score, facts.members,
                    state.save_recent_write(source, facts.recent_write, undo))  # [N, r, D]
            else:
                kv = state.recent_group(source.recent_kv, new_kv, facts.members)  # [N, r, D]
                score = state.recent_group(source.recent_score, new_score, facts.members)
                state.write_recent(source, facts.recent_write, new_kv, new_score, undo)
        page, slot = facts.close_page, facts.close_slot
        state.before_compressed_write(source, page, slot, undo)
        self.ops.pool_norm_rope_pack(kv, score, w.compressor_norm, w.index_wk, w.index_k_norm,
                                     cfg.norm_eps, facts.close_rot, source.rows,
                                     source.index_keys, page, slot)
        if publishes_index_keys(semantics, facts.produced):
            state.set_index_key_slot(spec.layer, undo)

    def _head_weights(self, x: torch.Tensor) -> torch.Tensor:
        """The indexer's per-head weights of each token [T, index heads] bf16 (step 4), before
        ``index_weight_scale`` (the indexer applies it as it reads them: one launch fewer)."""
        return self.ops.linear(x, self.weights.index_weights_proj)

    def _index(self, x: torch.Tensor, q_index: torch.Tensor | None,
               head_weights: torch.Tensor | None, state: AttentionState, plan: StepPlan,
               facts: RatioFacts, board: Board) -> torch.Tensor:
        """The lightning indexer of an index source (docs/numerics.md §5, step 4): top-k [T, k]
        int32 (-1 pad), published for the layers that reuse them (and, for the candidate
        source, the kept candidate blocks). q_index: the indexer's rotated fp4 query [T, index
        heads, index head dim] bf16, head_weights: [T, index heads] bf16 before
        index_weight_scale (both None when there is nothing to score: facts.scan == 0)."""
        cfg, spec = self.cfg, self.spec
        t = x.shape[0]
        keep = None
        if facts.scan == 0:
            selected = torch.empty(t, 0, dtype=torch.int32, device=x.device)
            if spec.is_candidate_source:
                keep = torch.empty(t, 0, dtype=torch.bool, device=x.device)
        else:
            keys = state.sources[state.index_key_source(spec.layer)].index_keys
            selected, keep = self.ops.index_topk(
                q_index, head_weights, keys, state.block_table, plan.token_row, facts.visible,
                facts.scan, cfg.index_topk, plan.token_groups,
                board.candidates() if spec.is_candidate_consumer else None,
                cfg.candidate_topk_blocks if spec.is_candidate_source else None,
                cfg.candidate_block_size,
                reduce=None if self.tp is None else self.tp.reduce_scores,
                head_scale=cfg.index_weight_scale)
            if board.index_inputs is not None:  # a traced step keeps what the indexer scored
                board.index_inputs[spec.layer] = (q_index, head_weights * cfg.index_weight_scale,
                                                  keys, facts)
        if keep is not None:
            board.publish_candidates(keep)
        board.publish_topk(spec.layer, selected)
        return selected

    # ---- validation, before anything is written ------------------------------------------
    def check_input(self, x: torch.Tensor, step: "Step") -> None:
        """x's type, dtype, shape and device for this step (no state is read)."""
        cfg, layer = self.cfg, self.spec.layer
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"layer {layer}: x must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype != torch.bfloat16:
            raise TypeError(f"layer {layer}: x must be bfloat16, got {x.dtype}")
        if x.dim() == 3:
            if not step.uniform or tuple(x.shape) != (len(step.tokens), step.tokens[0], cfg.dim):
                raise ValueError(
                    f"layer {layer}: x has shape {list(x.shape)}; a [b, m, dim] input needs every "
                    f"sequence of the step to have m tokens, i.e. [{len(step.tokens)}, "
                    f"{step.tokens[0]}, {cfg.dim}] here (tokens {step.tokens}); otherwise pack x "
                    f"as [sum(tokens)={step.total_tokens}, dim]")
        elif x.dim() != 2 or tuple(x.shape) != (step.total_tokens, cfg.dim):
            raise ValueError(f"layer {layer}: x must have shape [sum(tokens)={step.total_tokens}, "
                             f"dim={cfg.dim}] (or [b, m, dim] when every sequence has m tokens), "
                             f"got {list(x.shape)}")
        if x.device != step.state.device or x.device != self.device:
            raise ValueError(f"layer {layer}: x is on {x.device}, the state on "
                             f"{step.state.device} and the weights on {self.device}: they must agree")

    def check_state(self, state: AttentionState) -> None:
        """This layer can run on ``state``: same config, its caches and its source's exist."""
        spec = self.spec
        state.check_config(self.cfg)
        if spec.layer not in state.layers:
            raise StateError(f"layer {spec.layer} has no caches in this state "
                             f"(allocated for layers {sorted(state.layers)})")
        if spec.kv_source is not None and spec.kv_source not in state.sources:
            raise StateError(f"layer {spec.layer} needs KV source {spec.kv_source}, which has "
                             "no caches in this state")
