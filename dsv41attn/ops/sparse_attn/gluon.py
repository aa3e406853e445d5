"""Sparse attention over a window of packed fp8 rows, warp-specialized in Gluon (Hopper).

Why: the Triton kernel (``triton.sparse_attn_paged``) decodes a block's packed rows, then runs
its MMAs, then decodes the next block, in the same warps: Triton waits for each ``tl.dot``'s
wgmma right after issuing it, and at 64 heads x 512 columns one program holds an SM, so the
tensor cores idle while rows are decoded (docs/benchmarks.md, twenty-eighth session). Here a
producer partition (4 warps) decodes each 64-row block into a shared-memory ring while the
consumer partition (two warp groups, the default one) runs the logits' and P.V's wgmmas on the
block before, handing buffers over by mbarriers.

Scope of this first kernel: window entries only (SWA's lists, ``compressed_idx`` with K = 0),
no split of the list, 64 heads a program, D a multiple of 64 up to 512. Its reference is
``reference.sparse_attn_paged`` and its twin the Triton kernel, which the CPU tests run under
the interpreter; Gluon kernels do not run under the interpreter, so this one is checked on a
GPU against the Triton kernel, and on the CPU only compiled for sm_90a.

Numerics as the Triton kernel's: each row's e4m3 codes times its block's 2^(e-127), exact in
bf16; logits one wgmma chain over D in K order; running max from -1e30 over the logits, p
rounded to bf16 before P.V; acc = acc * alpha + p.kv in fp32; the sink added to the
denominator at the end. The row sums of p may add in another order than the Triton kernel's.
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                               warpgroup_mma, warpgroup_mma_wait)

ROWS, MAX_HEADS = 64, 64  # list entries per block (rows per ring stage); heads a program
BLOCK_N, HEADS = gl.constexpr(ROWS), gl.constexpr(MAX_HEADS)  # the same, for the kernels
ROWS_PER_STORE = 8  # rows the producer decodes per shared-memory store (the swizzle's period)
PRODUCER_WARPS = gl.constexpr(4)
PRODUCER_REGS = 56  # the producer's register budget (setmaxnreg); the consumers get the rest


@gluon.jit
def _row_ptrs(ring_ptr, new_ptr, ids, N_RING, N_NEW, RB: gl.constexpr):
    """Byte pointers of window entries ``ids`` and their validity (as triton._window_ptrs):
    id < N_RING: ring row id; id >= N_RING: new row id - N_RING (clamped); -1: none."""
    ok = ids >= 0
    r = gl.where(ok, ids, 0).to(gl.int64)
    ptr = gl.where(r < N_RING, ring_ptr + r * RB,
                   new_ptr + gl.minimum(r - N_RING, N_NEW - 1) * RB)
    return ptr, ok


@gluon.jit
def _producer(ring_ptr, new_ptr, widx_ptr, kv_bufs, ready, empty, t, N_RING, N_NEW, WW, sw_t,
              D: gl.constexpr, STAGES: gl.constexpr, RS: gl.constexpr):
    """Decode block j's 64 window rows into ring stage j % STAGES, RS rows a store (a multiple
    of the shared layout's swizzle period, 8 rows)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 16], [1, 32], [PRODUCER_WARPS, 1], [1, 0])
    rows = gl.arange(0, RS, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    RB: gl.constexpr = D + D // 32
    n_blocks = gl.cdiv(WW, BLOCK_N)
    for j in range(n_blocks):
        stage = j % STAGES
        phase = (j // STAGES) & 1
        mbarrier.wait(empty.index(stage), phase ^ 1)
        buf = kv_bufs.index(stage)
        for r0 in gl.static_range(0, BLOCK_N, RS):
            e_idx = j * BLOCK_N + r0 + rows
            ids = gl.load(widx_ptr + t * sw_t + e_idx, mask=e_idx < WW, other=-1)
            ptr, ok = _row_ptrs(ring_ptr, new_ptr, ids, N_RING, N_NEW, RB)
            codes = gl.load(ptr[:, None] + cols[None, :], mask=ok[:, None], other=0)
            e = gl.load(ptr[:, None] + D + cols[None, :] // 32, mask=ok[:, None], other=0)
            scale = (e.to(gl.int32) << 23).to(gl.float32, bitcast=True)  # 2^(e-127); 0 -> 0
            v = codes.to(gl.float8e4nv, bitcast=True).to(gl.float32) * scale
            buf.slice(r0, RS, dim=0).store(v.to(gl.bfloat16))
        fence_async_shared()
        mbarrier.arrive(ready.index(stage), count=1)


@gluon.jit
def _consumer(q_smem, kv_bufs, ready, empty, widx_ptr, sink_ptr, o_ptr, t, H, WW, sw_t, scale,
              D: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    """The online softmax over the blocks the producer fills; o [t] = acc / (l + e^(sink-m))."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, BLOCK_N // 2, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, D // 2, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    m_i = gl.full([HEADS], -1e30, gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([HEADS], gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([HEADS, D], gl.float32, layout=o_layout)
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    n_blocks = gl.cdiv(WW, BLOCK_N)
    for j in range(n_blocks):
        stage = j % STAGES
        phase = (j // STAGES) & 1
        e_idx = j * BLOCK_N + cols
        valid = gl.load(widx_ptr + t * sw_t + e_idx, mask=e_idx < WW, other=-1) >= 0
        mbarrier.wait(ready.index(stage), phase)
        kv = kv_bufs.index(stage)
        s = warpgroup_mma(q_smem, kv.permute((1, 0)),
                          gl.zeros([HEADS, BLOCK_N], gl.float32, layout=s_layout), is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=[s])
        s = gl.where(valid[None, :], s, float("-inf")) * scale
        m_new = gl.maximum(m_i, gl.max(s, 1))  # >= -1e30: no inf - inf
        alpha = gl.exp(m_i - m_new)
        p = gl.exp(s - m_new[:, None])
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        pb = gl.convert_layout(p.to(gl.bfloat16), p_layout)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        acc = warpgroup_mma(pb, kv, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        mbarrier.arrive(empty.index(stage), count=1)
    heads = gl.arange(0, HEADS, layout=gl.SliceLayout(1, o_layout))
    h_mask = heads < H
    m_o = gl.convert_layout(m_i, gl.SliceLayout(1, o_layout))
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    l_o = l_o + gl.exp(gl.load(sink_ptr + heads, mask=h_mask, other=0.0) - m_o)
    o = (acc / gl.where(l_o > 0, l_o, 1.0)[:, None]).to(gl.bfloat16)
    dcols = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    gl.store(o_ptr + t * H * D + heads[:, None] * D + dcols[None, :], o, mask=h_mask[:, None])


@gluon.jit
def _window_attn_kernel(q_ptr, sink_ptr, ring_ptr, new_ptr, widx_ptr, o_ptr, scale, H, N_RING,
                        N_NEW, WW, sw_t, D: gl.constexpr, STAGES: gl.constexpr,
                        RS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                        num_warps: gl.constexpr):
    """One program a token t: q [T, H, D] bf16 (H <= 64, padded heads load 0), the window
    ring [*, D + D/32] and new rows [N_NEW, D + D/32] uint8, widx [T, WW] int32 entries
    (token stride sw_t), o [T, H, D] bf16."""
    t = gl.program_id(0).to(gl.int64)
    q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
    qr = gl.arange(0, HEADS, layout=gl.SliceLayout(1, q_layout))
    qc = gl.arange(0, D, layout=gl.SliceLayout(0, q_layout))
    q = gl.load(q_ptr + t * H * D + qr[:, None] * D + qc[None, :], mask=(qr < H)[:, None],
                other=0.0)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [HEADS, D],
                                       gl.NVMMASharedLayout.get_default_for([HEADS, D],
                                                                            gl.bfloat16), q)
    kv_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, D],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_N, D],
                                                                             gl.bfloat16))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    fence_async_shared()
    gl.warp_specialize([
        (_consumer, (q_smem, kv_bufs, ready, empty, widx_ptr, sink_ptr, o_ptr, t, H, WW, sw_t,
                     scale, D, STAGES, num_warps)),
        (_producer, (ring_ptr, new_ptr, widx_ptr, kv_bufs, ready, empty, t, N_RING, N_NEW, WW,
                     sw_t, D, STAGES, RS)),
    ], [PRODUCER_WARPS], [PRODUCER_REGS])


def window_attn(q: torch.Tensor, sink: torch.Tensor, scale: float, window_ring: torch.Tensor,
                new_rows: torch.Tensor, window_ids: torch.Tensor, *, stages: int = 2,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``sparse_attn_paged`` for window-only lists (no compressed entries, no ``out_rot``), on
    a Hopper GPU: q [T, H, D] bf16 (H <= 64, D a multiple of 64, at most 512), sink [H] fp32,
    window_ring [B, S, D + D/32] uint8 contiguous, new_rows [T, D + D/32] uint8, window_ids
    [T, WW] int32 (ids as ``sparse_attn_paged``'s). Returns [T, H, D] bf16."""
    t, h, d = q.shape
    rb = d + d // 32
    if q.dtype != torch.bfloat16 or not 1 <= h <= MAX_HEADS or d % 64 or d > 512:
        raise ValueError(f"q must be [T, H <= {MAX_HEADS}, D] bf16 with D a multiple of 64 up to "
                         f"512, got {tuple(q.shape)} {q.dtype}")
    for name, x, shape, dtype in (("sink", sink, (h,), torch.float32),
                                  ("new_rows", new_rows, (t, rb), torch.uint8),
                                  ("window_ids", window_ids, (t, window_ids.shape[-1]),
                                   torch.int32)):
        if tuple(x.shape) != shape or x.dtype != dtype:
            raise ValueError(f"{name} must be {list(shape)} {dtype}, got {tuple(x.shape)} "
                             f"{x.dtype}")
    if window_ring.dtype != torch.uint8 or window_ring.shape[-1] != rb \
            or not window_ring.is_contiguous():
        raise ValueError(f"window_ring must be a contiguous [B, S, {rb}] uint8 tensor, got "
                         f"{tuple(window_ring.shape)} {window_ring.dtype}")
    if stages < 1 or (stages * ROWS + MAX_HEADS) * d * 2 > 200 * 1024:
        raise ValueError(f"stages = {stages}: the ring and q must fit in shared memory")
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device)[0] < 9:
        raise ValueError(f"window_attn runs on a Hopper or newer CUDA GPU, got q on {q.device}")
    out = torch.empty_like(q) if out is None else out
    if t == 0:
        return out
    n_ring = window_ring.numel() // rb
    q, new_rows, widx = q.contiguous(), new_rows.contiguous(), window_ids
    widx = widx if widx.stride(1) == 1 else widx.contiguous()
    ring = window_ring if n_ring else new_rows
    _window_attn_kernel[(t,)](q, sink, ring, new_rows, widx, out, float(scale), h, n_ring, t,
                              widx.shape[1], widx.stride(0), D=d, STAGES=stages,
                              RS=ROWS_PER_STORE, PRODUCER_REGS=PRODUCER_REGS, num_warps=8)
    return out
