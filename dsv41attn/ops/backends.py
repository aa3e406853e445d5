"""Backend selection: chosen once per layer or stack (an argument, never a global flag).

"reference" runs every op in plain torch (the spec in code); "triton" runs the ops that have
a Triton kernel through it (sparse attention with sink over the packed caches, on a Hopper
GPU through its warp-specialized Gluon twin, ``ops/sparse_attn/paged.py``; the fp8 linears, the window K/V epilogue and query RoPE, the
compressor's fp32 projections, recent-ring gathers and epilogue, the index query's RoPE and
fp4 fake quant, the lightning indexer, inverse RoPE with the grouped wo_a) and the rest
through the reference ops, on whatever device the tensors live.
Each op's reference (``ops/<op>/reference.py``) has the same signature as its kernel.

``batch_invariant`` (triton only; docs/numerics.md §9): True runs every reduction in an order
fixed by the weights' and lists' shapes, so a sequence gets the same bits alone, in any batch,
in any chunking and token by token; False (the default) lets the sparse attention size its
split to the step and runs the bf16 / fp32 linears and wo_a on torch (cuBLAS picks kernels by
row count), which is faster where invariance costs (a batch of 256 and prefill, measured in
docs/benchmarks.md) and equally exact against the reference's tolerances. The fp8 GEMMs and
the query RMSNorm keep their fixed order in both modes: it costs them nothing. The ratio > 1
compressor projections run dense_linear in the fixed mode and, by default, an fp64-summing
kernel up to 16 rows (faster than torch there) and torch's float64 GEMM above. The reference
backend has one mode (torch's kernels, whose blocking may follow the row count on a GPU).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

BACKENDS = ("reference", "triton")


@dataclass(frozen=True)
class Ops:
    """The op implementations one backend uses."""

    name: str
    sparse_attn_paged: Callable
    fp8_linear: Callable  # norm=(weight, eps): RMSNorm'd input (q_norm before wq_b);
    # rope=(rot, head_dim): the query's RoPE on the output's heads (after wq_b)
    fp8_linear_pair: Callable  # two fp8 linears of one input, one act-quant (wq_b and the
    # index wq_b)
    norm_rope_pack: Callable  # window K/V: RMSNorm + RoPE + fp8 + pack (+ ring write)
    compressor_project: Callable  # r > 1 compressor: fp32 wkv and wgate of every token
    compressor_prepare: Callable  # (wkv, wgate) -> compressor_project's extra keyword
    # arguments, built once per layer
    recent_gather_write: Callable  # r > 1 decode: the groups' projections, the recent-ring write
    pool_norm_rope_pack: Callable  # compressor epilogue: rows and index keys into the pools
    inverse_rope_wo_a: Callable  # inverse RoPE + block-diagonal wo_a
    output_projection: Callable  # step 6 whole: inverse_rope_wo_a, then the fp8 wo_b
    wo_a_prepare: Callable  # wo_a -> inverse_rope_wo_a's extra keyword arguments, built once
    # per layer
    index_topk: Callable  # the lightning indexer: scores, candidate blocks, top-k
    rope_fp4_heads: Callable  # the index query's RoPE + fp4 fake quant
    linear: Callable  # bf16 / fp32 weights (reference.linear's signature)
    capturable: bool  # every op runs without host syncs: a decode step can be graph-captured
    batch_invariant: bool  # a sequence's bits never depend on the call (see the module doc)


def get_ops(backend: str, batch_invariant: bool = False) -> Ops:
    if not isinstance(batch_invariant, bool):
        raise TypeError(f"batch_invariant must be a bool, got {batch_invariant!r}")
    if backend == "reference":
        from .compressor.reference import pool_norm_rope_pack
        from .compressor.reference import prepare_project as compressor_prepare
        from .compressor.reference import project as compressor_project
        from .compressor.reference import recent_gather_write
        from .index_query.reference import rope_fp4_heads
        from .indexer.reference import index_topk
        from .linear.reference import fp8_linear, fp8_linear_pair, linear
        from .output.reference import inverse_rope_wo_a, output_projection
        from .output.reference import prepare_wo_a as wo_a_prepare
        from .sparse_attn.reference import sparse_attn_paged
        from .window_kv.reference import norm_rope_pack
        if batch_invariant:
            raise ValueError("batch_invariant=True needs backend 'triton' (the reference "
                             "backend runs torch's kernels, which promise no call-invariant order)")
    elif backend == "triton":
        try:
            from .compressor import reference as compressor_reference
            from .compressor.triton import pool_norm_rope_pack, prepare_project
            from .compressor.triton import project as compressor_project
            from .compressor.triton import recent_gather_write
            from .index_query.triton import rope_fp4_heads
            from .indexer.triton import index_topk
            from .linear import reference as torch_linears
            from .linear import triton as fixed_linears
            from .linear.triton import fp8_linear, fp8_linear_pair
            from .output import triton as output
            from .output.triton import prepare_wo_a as wo_a_prepare
            from .sparse_attn.paged import sparse_attn_paged  # Gluon on Hopper
            from .window_kv.triton import norm_rope_pack
        except ImportError as e:  # triton missing
            raise ValueError(f"backend 'triton' needs the triton package: {e}") from e
        if batch_invariant:
            linear, inverse_rope_wo_a = fixed_linears.linear, output.inverse_rope_wo_a
            output_projection = output.output_projection
            compressor_prepare = compressor_reference.prepare_project  # dense_linear: fp32
        else:  # the step-sized forms where the fixed order costs
            linear = torch_linears.linear
            inverse_rope_wo_a = partial(output.inverse_rope_wo_a, fixed_order=False)
            output_projection = partial(output.output_projection, fixed_order=False)
            sparse_attn_paged = partial(sparse_attn_paged, split_blocks=0)
            compressor_project = partial(compressor_project, fixed_order=False)
            compressor_prepare = prepare_project  # a float64 copy of the weights
    else:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    # the reference ops write through boolean masks (host syncs): not capturable
    return Ops(backend, sparse_attn_paged, fp8_linear, fp8_linear_pair, norm_rope_pack,
               compressor_project, compressor_prepare, recent_gather_write,
               pool_norm_rope_pack, inverse_rope_wo_a, output_projection, wo_a_prepare,
               index_topk, rope_fp4_heads,
               linear, backend == "triton", batch_invariant)
