"""Weights pulled into the GPU's L2 cache ahead of the kernel that reads them.

Why: in a decode step the memory bus idles after the query path's GEMMs. The indexer, the
attention and its split merge read a few MB of cache rows, while wo_a and wo_b (about 75 MB
of fp8 codes at V4.1-Flash) wait behind them and then stream from HBM one after the other.
``l2_prefetch`` asks the memory system to bring a weight's bytes into L2 meanwhile, so that
the GEMM after the attention reads them from L2. It is only a hint: no value changes, it
writes nothing, and a byte not brought in (or evicted again) is read from HBM as before.

How: one Hopper bulk prefetch (``cp.async.bulk.prefetch.L2.global``: an address and a byte
count, no shared memory, nothing waits on it) per CHUNK bytes, issued by the lanes of a few
programs that end as soon as they have issued theirs. The range is trimmed to 16-byte
boundaries inside each tensor (the instruction's alignment). Elsewhere (not sm_90, the CPU
interpreter, a CPU tensor) it does nothing: the reference of a hint is no op.

What to prefetch and how much is the caller's choice: the H100's and H200's L2 holds 50 MB,
and bytes beyond what stays resident only add traffic.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton import cdiv, interpreting, is_hopper

CHUNK = 64 * 1024  # bytes a prefetch instruction asks for
LANES = 128  # prefetches a program issues (one a thread)


@triton.jit
def _l2_prefetch_kernel(base, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr):
    """Bytes [base + CHUNK i, +CHUNK) of [base, base + nbytes) into L2 for i = the program's
    LANES chunks (base and nbytes multiples of 16; a chunk past the end asks for nothing)."""
    i = tl.program_id(0) * LANES + tl.arange(0, LANES)
    off = i.to(tl.int64) * CHUNK
    size = tl.maximum(tl.minimum(nbytes - off, CHUNK), 0).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [base + off, size], dtype=tl.int32, is_pure=False, pack=1)


def prefetch_span(t: torch.Tensor, max_bytes: int | None = None) -> tuple[int, int]:
    """(address, bytes) of the 16-byte-aligned part of t's storage that l2_prefetch asks for:
    from its data pointer rounded up to 16, at most max_bytes (None: all of it), rounded down
    to a multiple of 16. t must be contiguous."""
    if not t.is_contiguous():
        raise ValueError(f"l2_prefetch needs contiguous tensors, got strides {t.stride()}")
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    if max_bytes is not None:
        end = min(end, start + max(int(max_bytes), 0))
    start = (start + 15) // 16 * 16
    return start, max(end - start, 0) // 16 * 16


def l2_prefetch(tensors, max_bytes: int | None = None) -> int:
    """Ask for the bytes of ``tensors`` (contiguous CUDA tensors, in order) to be brought into
    L2, at most ``max_bytes`` in all (None: every byte), on the current stream; returns the
    bytes asked for (0 where this device or mode has no prefetch). Capturable: one small
    launch a tensor, no host sync."""
    tensors = list(tensors)
    if not tensors or interpreting() or not tensors[0].is_cuda or \
            not is_hopper(tensors[0].device):
        return 0
    budget = None if max_bytes is None else int(max_bytes)
    asked = 0
    for t in tensors:
        if budget is not None and budget <= 0:
            break
        base, nbytes = prefetch_span(t, budget)
        if nbytes == 0:
            continue
        grid = (cdiv(nbytes, CHUNK * LANES),)
        _l2_prefetch_kernel[grid](base, nbytes, CHUNK=CHUNK, LANES=LANES, num_warps=LANES // 32)
        asked += nbytes
        if budget is not None:
            budget -= nbytes
    return asked
