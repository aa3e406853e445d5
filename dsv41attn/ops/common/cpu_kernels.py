"""Which of torch's CPU kernels the reference backend runs, so that its bits are the golden
fixtures' on any x86 CPU (docs/numerics.md §8).

Two of the reference's operations take a kernel that torch (or a library under it) picks by CPU:

- fp32 ``exp`` (the sparse attention's online softmax) runs MKL's vector math, which has one
  code path per instruction set: SSE, AVX2, AVX-512 and AMX machines round about 1% of inputs
  one unit differently. MKL's reproducibility mode ``COMPATIBLE`` runs one path on every x86
  CPU. MKL reads it from the environment variable ``MKL_CBWR`` when it first runs, so
  :func:`pin_mkl_branch` sets it when the package is imported (before any MKL call of this
  process, or it comes too late; a value already set is kept).
- bf16 matmuls (``F.linear`` with a bf16 weight, the grouped ``wo_a`` and index-score einsums)
  go to oneDNN on a CPU with AVX-512 (its blocking, AMX tiles where present) and to torch's own
  kernel elsewhere. :func:`torch_bf16_matmul` turns oneDNN off around each such call.

The golden fixtures were made with the kernels these two settings select; on a Xeon with AMX,
torch's defaults change the last bit of about one output in 400 of the V4.1-geometry fixture
and 9 of its 3312 top-k rows. :func:`check_reference_kernels` runs a small probe of both
kernels against the bits they gave where every fixture replays exactly, so a process whose MKL
was started before the pin (or a torch build whose kernels round differently) is told, not
silently a few bits off.
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading
import warnings
from typing import Iterator

import torch
import torch.nn.functional as F

MKL_BRANCH = "COMPATIBLE"

# where PROBE_BITS were recorded, and every golden fixture replays bit for bit
PROBE_PLATFORM = "torch 2.13.0+cpu on x86-64, ATen's AVX2 or AVX512 kernels"
# hash of each probe's output bits (see _probe) under MKL_CBWR=COMPATIBLE with oneDNN off
PROBE_BITS = {"exp": 1095492383, "linear": 2074281225, "einsum": 602310429}


class ReferenceBitsWarning(UserWarning):
    """The reference backend's CPU kernels do not round as the golden fixtures' did: results stay
    within the fixtures' tolerances but are not bit for bit DeepSeek's."""


def pin_mkl_branch() -> None:
    """Ask MKL for its ``COMPATIBLE`` code path (one path on every x86 CPU), unless the
    environment already names one. Effective only before MKL's first call in this process."""
    os.environ.setdefault("MKL_CBWR", MKL_BRANCH)


def torch_bf16_matmul(device: torch.device | None = None) -> contextlib.AbstractContextManager:
    """Context: the bf16 matmuls inside run on torch's own CPU kernel (oneDNN off), then the
    flag is restored. ``device``: the operands' device; on any other than the CPU nothing
    changes (a no-op context: the Triton backend's GPU linears pass through here).

    torch's flag is one per process, so the contexts of all threads share one count: the
    first to enter turns oneDNN off, the last to leave restores what the first found, and a
    thread's bf16 matmuls never run on oneDNN while another thread's context ends (other
    code's CPU matmuls meanwhile run on torch's kernel too)."""
    if device is not None and device.type != "cpu":
        return contextlib.nullcontext()
    return _onednn_off()


_ONEDNN_LOCK = threading.Lock()
_onednn_users = 0  # contexts inside _onednn_off, all threads
_onednn_before = True  # the flag the first of them found


@contextlib.contextmanager
def _onednn_off() -> Iterator[None]:
    global _onednn_users, _onednn_before
    with _ONEDNN_LOCK:
        if _onednn_users == 0:
            _onednn_before = torch.backends.mkldnn.enabled
            torch.backends.mkldnn.enabled = False
        _onednn_users += 1
    try:
        yield
    finally:
        with _ONEDNN_LOCK:
            _onednn_users -= 1
            if _onednn_users == 0:
                torch.backends.mkldnn.enabled = _onednn_before


def _hash_bits(t: torch.Tensor) -> int:
    """An order-sensitive hash of a tensor's bits (integer arithmetic only)."""
    v = t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()]).long().flatten()
    v = v & 0xFFFFFFFF
    w = torch.arange(v.numel(), dtype=torch.int64) % 65521 + 1
    return int((v * w % 2147483647).sum() % 2147483647)


def _bf16_pattern(seed: int, n: int) -> torch.Tensor:
    """n bf16 values from integer hashing alone: random sign and mantissa, exponents 2^-9..2^0
    (so fp32 sums of their products are inexact and their order shows)."""
    j = torch.arange(n, dtype=torch.int64)
    h = (j * 2246822519 + seed * 3266489917) % (2 ** 32)
    bits = (((h >> 31) & 1) << 15) | ((118 + (h >> 7) % 10) << 7) | (h % 128)
    return bits.to(torch.int16).view(torch.bfloat16)


def _probe() -> dict[str, int]:
    """The probe: fp32 exp over [-90, 0) and the two bf16 matmul forms of the reference, at sizes
    where oneDNN's and torch's kernels, and MKL's code paths, round differently."""
    i = torch.arange(4096, dtype=torch.int64)
    x = (-((i * 2654435761 + 12345) % (2 ** 32)).double() / 2 ** 32 * 90).float()
    a = _bf16_pattern(1, 256 * 4096).view(256, 4096)
    with torch_bf16_matmul():
        lin = F.linear(a.view(512, 2048), _bf16_pattern(2, 64 * 2048).view(64, 2048))
        ein = torch.einsum("ngd,grd->ngr", a.unsqueeze(1).expand(256, 8, 4096),
                           _bf16_pattern(3, 8 * 32 * 4096).view(8, 32, 4096))
    return {"exp": _hash_bits(torch.exp(x)), "linear": _hash_bits(lin), "einsum": _hash_bits(ein)}


@functools.cache
def check_reference_kernels() -> str | None:
    """None when this process's CPU kernels give the probe the golden fixtures' bits; else a
    sentence saying which differ and what to do."""
    got = _probe()
    bad = [k for k, v in got.items() if v != PROBE_BITS[k]]
    if not bad:
        return None
    cbwr = os.environ.get("MKL_CBWR")
    hint = []
    if "exp" in bad:
        hint.append(f"MKL_CBWR is {cbwr!r}: set MKL_CBWR={MKL_BRANCH} before torch's first CPU "
                    "operation (importing dsv41attn first does it)" if cbwr != MKL_BRANCH else
                    f"MKL_CBWR={MKL_BRANCH} is set but came after MKL's first call in this process "
                    "(import dsv41attn before running torch CPU operations), or this torch "
                    "build's MKL rounds differently")
    if bad != ["exp"]:
        hint.append(f"torch {torch.__version__}'s own bf16 matmul kernel (CPU capability "
                    f"{torch.backends.cpu.get_cpu_capability()}) rounds differently from the ones "
                    f"the fixtures replay with ({PROBE_PLATFORM})")
    return (f"the reference backend's CPU kernels ({', '.join(bad)}) do not round as the golden "
            f"fixtures' did: outputs stay within the fixtures' tolerances but are not bit for bit "
            f"DeepSeek's; {'; '.join(hint)}")


def warn_if_kernels_differ() -> None:
    """A ReferenceBitsWarning when :func:`check_reference_kernels` finds a difference (the probe
    runs once per process)."""
    msg = check_reference_kernels()
    if msg is not None:
        warnings.warn(msg, ReferenceBitsWarning, stacklevel=3)
