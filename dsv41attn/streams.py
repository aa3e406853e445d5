"""A layer call on up to three CUDA streams: the window K/V path and the compressor each beside
the query path.

Inside one layer, the window K/V path (wkv, norm, RoPE, fp8 pack, the decode ring write) and a
KV source's compressor read only x and the state, and the query path (wq_a, norm, wq_b, RoPE,
the index query and its RoPE) reads only x: none waits for another until the indexer and the
attention read the rows the first two wrote. An index source's head weights (one small linear
of x) go on the window K/V branch. At decode sizes each of their kernels leaves most of an
H200's SMs idle (a GEMM of one token streams its weight from 1-2 programs per SM), so running
the paths side by side hides the shorter ones. The compressor gets a branch of its own: on one
branch behind the window K/V path it was the longest path of a decode step (H200, Full r=2, b
= 1: the window K/V path then the compressor 70 us, the query path 49). ``Fork`` does it with
extra streams per device, the *branches* (index 0, 1, ...):

    with Fork(device, enabled, branches=2) as fork:   # each branch waits for what the
        with fork.branch(0):                          # caller queued so far
            ...window K/V...                          # launched on branch 0's stream
        with fork.branch(1):
            ...compressor...                          # on branch 1's
        ...query path, on the caller's stream...
    # joined: the caller's stream waits for every branch (also when the body raised)

Every op keeps its arithmetic, so the outputs are the same bits as on one stream. Under CUDA-
graph capture the fork and the join become the graph's edges (a branch joins the capture
through its wait on the capturing stream). Memory: a tensor made on the caller's stream and
read on a branch must stay referenced until the join (the layer holds its inputs for the
whole call); a tensor made on a branch and read by the caller after the join is safe to free,
because every later use of that branch starts with a fork, which waits for the caller's work
queued before it. Each branch's stream is one per device, shared by all callers: waits only
add order, so two callers on different streams stay correct (they may wait for each other).
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

_BRANCHES: dict[tuple[str, int], torch.cuda.Stream] = {}  # (device, index) -> that branch


def branch_stream(device: torch.device, index: int = 0) -> torch.cuda.Stream:
    """The device's branch stream number ``index`` (made on first use)."""
    key = (str(device), index)
    stream = _BRANCHES.get(key)
    if stream is None:
        stream = _BRANCHES[key] = torch.cuda.Stream(device=device)
    return stream


class Fork:
    """Fork the caller's current stream into ``branches`` branches on entry, join them on exit
    (see the module doc). ``enabled`` False, or a non-CUDA device: one stream, ``branch(i)``
    does nothing."""

    def __init__(self, device: torch.device, enabled: bool = True, branches: int = 1):
        if isinstance(branches, bool) or not isinstance(branches, int) or branches < 1:
            raise ValueError(f"branches must be an int >= 1, got {branches!r}")
        on = bool(enabled) and device.type == "cuda"
        self.main = torch.cuda.current_stream(device) if on else None
        self.streams = [branch_stream(device, i) for i in range(branches)] if on else []
        self.branches = branches

    def __enter__(self) -> "Fork":
        for stream in self.streams:
            stream.wait_stream(self.main)
        return self

    def __exit__(self, *exc) -> bool:
        for stream in self.streams:
            self.main.wait_stream(stream)
        return False

    def branch(self, index: int = 0):
        """Context: launches go to branch ``index``'s stream (one stream: the caller's)."""
        if not 0 <= index < self.branches:
            raise ValueError(f"branch {index!r} of a fork of {self.branches}")
        return torch.cuda.stream(self.streams[index]) if self.streams else nullcontext()
