"""The L2 prefetch hint (ops/common/prefetch.py): the span it asks for, nothing off a Hopper GPU,
its instruction in the sm_90a code, and on a GPU: eager and captured, no value changes."""
import os
from pathlib import Path

import pytest
import torch

import sm90_compile
from dsv41attn.ops.backends import get_ops
from dsv41attn.ops.common import prefetch

GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"


def test_span_is_the_aligned_inside_of_the_storage_within_the_budget():
    t = torch.zeros(1000, dtype=torch.uint8)
    base = t.data_ptr()
    start, n = prefetch.prefetch_span(t)
    assert start % 16 == 0 and n % 16 == 0
    assert base <= start < base + 16 and start + n <= base + 1000 and start + n > base + 1000 - 32
    s2, n2 = prefetch.prefetch_span(t[3:])  # an unaligned view: rounded up inside it
    assert s2 % 16 == 0 and s2 >= base + 3 and s2 + n2 <= base + 1000
    assert prefetch.prefetch_span(t, 100)[1] == (base + 100 - start) // 16 * 16
    assert prefetch.prefetch_span(t, 0)[1] == 0 and prefetch.prefetch_span(t, -5)[1] == 0
    with pytest.raises(ValueError, match="contiguous"):
        prefetch.prefetch_span(torch.zeros(8, 8)[:, ::2])


def test_off_a_hopper_gpu_nothing_is_asked():
    w = torch.randn(64, 64)
    assert prefetch.l2_prefetch([w]) == 0 and prefetch.l2_prefetch([]) == 0
    assert get_ops("reference").l2_prefetch([w], 1 << 20) == 0


@pytest.mark.parametrize("triton_dir", sm90_compile.TRITONS, ids=lambda d: "this" if d is None else
                         Path(d).name)
def test_the_bulk_prefetch_is_in_the_sm90_code(triton_dir):
    """The inline PTX survives to the SASS (is_pure=False: not dropped as unused), once per
    lane, behind the lane's size > 0 predicate."""
    got = sm90_compile.compile_probe("""
from dsv41attn.ops.common import prefetch as p
k = p._l2_prefetch_kernel.warmup(2**40 + 256, 33554432, CHUNK=p.CHUNK, LANES=p.LANES,
                                 num_warps=p.LANES // 32, grid=(1,))
code = s._sass(k.asm["cubin"]) or ""
print(json.dumps({"ptx": k.asm["ptx"].count("cp.async.bulk.prefetch.L2.global"),
                  "sass": code.count("UBLKPF"), "disassembled": bool(code)}))
""", triton_dir)
    assert got["ptx"] == 1, got
    assert got["sass"] >= 1 or not got["disassembled"], got


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU with compiled Triton kernels")
def test_on_the_gpu_eager_and_captured_no_value_changes():
    dev = torch.device("cuda")
    if not prefetch.is_hopper(dev):
        pytest.skip("the bulk prefetch is sm_90's")
    a = torch.randint(-100, 100, (3 << 20,), dtype=torch.int32, device=dev)  # 12 MB
    b = torch.randn(1000, 37, device=dev)
    keep = (a.clone(), b.clone())
    asked = prefetch.l2_prefetch([a, b])
    assert asked == prefetch.prefetch_span(a)[1] + prefetch.prefetch_span(b)[1]
    assert prefetch.l2_prefetch([a, b], 1 << 20) == 1 << 20  # the budget, from the first
    assert prefetch.l2_prefetch([a, b], 0) == 0
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g):
            prefetch.l2_prefetch([a, b], 5 << 20)
            c = a * 2
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    assert torch.equal(a, keep[0]) and torch.equal(b, keep[1]) and torch.equal(c, keep[0] * 2)
