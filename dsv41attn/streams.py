"""A layer call on two CUDA streams: the window K/V and compressor work beside the query path.

Inside one layer, the window K/V path (wkv, norm, RoPE, fp8 pack, the decode ring write) and a
KV source's compressor read only x and the state, and the query path (wq_a, norm, wq_b, RoPE,
the index query and its RoPE) reads only x: neither waits for the other until the indexer and
the attention read the rows the first one wrote. An index source's head weights (one small
linear of x) go on the branch, or on the query path where the branch holds a compressor. At
decode sizes each of their kernels leaves most of an H200's SMs idle (a GEMM of one token
streams its weight from 1-2 programs per SM), so running the two paths side by side hides the
shorter one. ``Fork`` does it with one extra stream per device, the *branch*:

    with Fork(device, enabled) as fork:   # the branch waits for what the caller queued so far
        with fork.branch():               # launched on the branch stream
            ...window K/V, compressor...
        ...query path, on the caller's stream...
    # joined: the caller's stream waits for the branch (also when the body raised)

Every op keeps its arithmetic, so the outputs are the same bits as on one stream. Under CUDA-
graph capture the fork and the join become the graph's edges (the branch joins the capture
through its wait on the capturing stream). Memory: a tensor made on the caller's stream and
read on the branch must stay referenced until the join (the layer holds its inputs for the
whole call); a tensor made on the branch and read by the caller after the join is safe to
free, because every later use of the branch starts with a fork, which waits for the caller's
work queued before it. One branch per device, shared by all callers: waits only add order, so
two callers on different streams stay correct (they may wait for each other).
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

_BRANCHES: dict[str, torch.cuda.Stream] = {}  # device -> its branch stream


def branch_stream(device: torch.device) -> torch.cuda.Stream:
    """The device's branch stream (made on first use)."""
    key = str(device)
    stream = _BRANCHES.get(key)
    if stream is None:
        stream = _BRANCHES[key] = torch.cuda.Stream(device=device)
    return stream


class Fork:
    """Fork the caller's current stream into a branch on entry, join it on exit (see the
    module doc). ``enabled`` False, or a non-CUDA device: one stream, ``branch()`` does
    nothing."""

    def __init__(self, device: torch.device, enabled: bool = True):
        on = bool(enabled) and device.type == "cuda"
        self.main = torch.cuda.current_stream(device) if on else None
        self.stream = branch_stream(device) if on else None

    def __enter__(self) -> "Fork":
        if self.stream is not None:
            self.stream.wait_stream(self.main)
        return self

    def __exit__(self, *exc) -> bool:
        if self.stream is not None:
            self.main.wait_stream(self.stream)
        return False

    def branch(self):
        """Context: launches go to the branch stream (one stream: the caller's)."""
        return torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()
