"""The sm_90a compile check (tests/sm90_compile.py) records launches under the interpreter and
fails one that the interpreter runs but an H100/H200 cannot: a K loop of 128 x 128 fp16 tiles
pipelined 5 deep asks for 320 KB of shared memory (2 stages: 128 KB, fine)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

import sm90_compile  # noqa: E402
from dsv41attn.ops.common.triton import neg, neg_zeros  # noqa: E402

TESTS = Path(__file__).resolve().parent


@triton.jit
def _matmul_kernel(a_ptr, b_ptr, o_ptr, K, B: tl.constexpr):
    """o [B, B] = a [B, K] @ b [K, B] over K steps of B."""
    i = tl.arange(0, B)
    acc = tl.zeros((B, B), tl.float32)
    for k in tl.range(0, K, B):
        a = tl.load(a_ptr + i[:, None] * K + k + i[None, :])
        b = tl.load(b_ptr + (k + i[:, None]) * B + i[None, :])
        acc = tl.dot(a, b, acc)
    tl.store(o_ptr + i[:, None] * B + i[None, :], acc)


_LAUNCH = """
import sys, torch
sys.path.insert(0, {tests!r})
import sm90_compile
sm90_compile.record_launches({path!r})
from test_sm90_compile import _matmul_kernel
a = torch.randint(-2, 3, (128, 256)).half()  # small integers: every sum exact
b = torch.randint(-2, 3, (256, 128)).half()
for stages in {stages!r}:
    o = torch.empty(128, 128)
    _matmul_kernel[(1,)](a, b, o, 256, B=128, num_stages=stages, num_warps=8)
    assert torch.equal(o, a.float() @ b.float())  # the interpreter runs every depth
"""


def _record(tmp_path: Path, stages) -> Path:
    path = tmp_path / "launches.jsonl"
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("DSV41ATTN_LAUNCH_RECORD", None)  # not into the suite's own record
    subprocess.run([sys.executable, "-c", _LAUNCH.format(tests=str(TESTS), path=str(path),
                                                         stages=list(stages))],
                   env=env, check=True, timeout=300)
    return path


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="records interpreted launches (on a GPU the kernels compile for real)")
def test_the_check_passes_a_kernel_the_gpu_compiles_and_fails_one_it_rejects(tmp_path, capsys):
    import sm90_compile
    path = _record(tmp_path, (2, 5, 2))
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["kwargs"]["num_stages"] for r in recs] == [2, 5]  # one line per specialisation
    assert recs[0]["args"] == [{"tensor": "float16"}, {"tensor": "float16"},
                               {"tensor": "float32"}, 256]

    assert sm90_compile.main([str(path), "-j", "1"]) == 1
    out = capsys.readouterr().out
    assert "1 of 2 recorded launches compiled for sm_90a" in out
    assert "FAILED _matmul_kernel: 327680 B of shared memory > 232448" in out

    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps(recs[0]) + "\n")
    assert sm90_compile.main([str(good), "-j", "1"]) == 0
    out = capsys.readouterr().out
    assert "1 of 1 recorded launches compiled for sm_90a" in out
    row = next(line.split() for line in out.splitlines() if line.startswith("_matmul_kernel"))
    assert int(row[1]) == 1 and int(row[2]) > 0  # one launch; registers read from the cubin
    assert 0 < int(row[4]) <= sm90_compile.SM90_SHARED_MAX


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="records interpreted launches (on a GPU the kernels compile for real)")
def test_launches_of_several_recording_processes_merge(tmp_path):
    """Two processes append their launches to one record (a sharded suite): each launch is
    there once per process, and read_launches keeps one of each, first seen first."""
    import sm90_compile
    path = _record(tmp_path, (2, 5))
    assert _record(tmp_path, (5,)) == path  # a second process, the same file
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["kwargs"]["num_stages"] for r in lines] == [2, 5, 5]
    assert [r["kwargs"]["num_stages"] for r in sm90_compile.read_launches(path)] == [2, 5]


def test_a_layer_step_is_recorded_without_running_and_compiled(capsys):
    """--layer: a stack of one layer of each kind, a prefill and two decode steps recorded at
    the preset's shapes with no kernel run, each launch compiled: a row per launch."""
    import sm90_compile
    assert sm90_compile.main(["--layer", "tiny", "--prefill", "64", "--batches", "1,8",
                              "-j", "1"]) == 0
    out = capsys.readouterr().out
    assert "launches of a tiny step compiled for sm_90a" in out
    rows = [line.split() for line in out.splitlines() if "_kernel" in line]
    kernels = {r[2] if r[0] == "prefill" else r[3] for r in rows}
    assert {"_sparse_attn_paged_kernel", "_fp8_decode_kernel", "_score_kernel",
            "_latent_kernel", "_norm_rope_pack_kernel"} <= kernels
    steps = {" ".join(r[:2]) if r[0] == "prefill" else " ".join(r[:3]) for r in rows}
    assert {"prefill 64", "decode batch 1"} <= steps <= {"prefill 64", "decode batch 1",
                                                        "decode batch 8"}
    # the loop column: the GEMM and attention kernels' launches show their K loops' sizes
    loops: dict = {}
    for r in rows:
        name, loop = (r[2], r[7]) if r[0] == "prefill" else (r[3], r[8])
        loops.setdefault(name, []).append(int(loop))
    assert max(loops["_sparse_attn_paged_kernel"]) > 0 and max(loops["_fp8_decode_kernel"]) > 0


def test_main_loop_is_the_shortest_backward_branch_holding_an_mma():
    """_main_loop counts the instructions from a backward branch's target to the branch: the
    shortest such region with an MMA in it, else the shortest region, else -1."""
    import sm90_compile

    def listing(*ops):
        return "\n".join(f"        /*{16 * i:04x}*/                   {op} ;"
                         for i, op in enumerate(ops))
    two = listing("MOV R1, R2", "LDS R4, [R1]", "HGMMA.64x16x16.F32 R8, R4, gdesc[UR4], R8",
                  "IADD3 R1, R1, 0x1", "@P0 BRA 0x10", "ISETP.GE P1, R1, 0x4",
                  "@P1 BRA 0x50", "EXIT")
    assert sm90_compile._main_loop(two) == 4  # 0x10..0x40, the MMA loop; not 0x50..0x60
    assert sm90_compile._main_loop(two.replace("HGMMA.64x16x16.F32", "FFMA")) == 2
    assert sm90_compile._main_loop(listing("MOV R1, R2", "@P0 BRA 0x40", "EXIT")) == -1


@triton.jit
def _sum_from_neg_zero_kernel(x_ptr, o_ptr, KS):
    """o [128] = -0 + x[0] + ... + x[KS - 1], the start from neg_zeros."""
    i = tl.arange(0, 128)
    acc = neg_zeros([128], tl.float32)
    for k in tl.range(0, KS):  # a loop: the start stays a constant of the PTX
        acc = acc + tl.load(x_ptr + k * 128 + i)
    tl.store(o_ptr + i, acc)


@triton.jit
def _negate_kernel(x_ptr, o_ptr):
    """o [128] = neg(x)."""
    i = tl.arange(0, 128)
    tl.store(o_ptr + i, neg(tl.load(x_ptr + i)))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") != "1", reason="interpreter")
def test_neg_zeros_and_neg_keep_the_sign_of_zero():
    """A sum of -0 terms started from neg_zeros is -0, as the reference's; neg turns +0 into
    -0 and back, and every other value as -x."""
    import torch
    x = torch.full((3, 128), -0.0)
    o = torch.empty(128)
    _sum_from_neg_zero_kernel[(1,)](x, o, 3)
    assert torch.equal(o.view(torch.int32), torch.full((128,), -2 ** 31, dtype=torch.int32))
    v = torch.cat([torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 1e-45, -3.5]),
                   torch.randn(122)])
    _negate_kernel[(1,)](v, o)
    assert torch.equal(o.view(torch.int32), (-v).view(torch.int32))




@pytest.mark.parametrize("triton_dir", sm90_compile.TRITONS, ids=lambda d: "this" if d is None else
                         Path(d).name)
def test_neg_zeros_and_neg_for_sm90(triton_dir):
    """The start is a -0 constant in the sm_90a PTX (tl.full(-0.0) compiles to +0 under the
    GPU image's Triton 3.6: the GPU kernels started their sums at +0 and gave +0 where the
    reference gives -0), and neg flips the sign bit (3.6 compiles -x to 0 - x)."""
    import sm90_compile
    got = sm90_compile.compile_probe("""
import test_sm90_compile as t
k = t._sum_from_neg_zero_kernel.warmup(M(torch.float32), M(torch.float32), 3, num_warps=4,
                                      grid=(1,))
ptx = k.asm["ptx"]
n = t._negate_kernel.warmup(M(torch.float32), M(torch.float32), num_warps=4, grid=(1,))
nptx = n.asm["ptx"]
print(json.dumps({"neg": ptx.count("0f80000000") + ptx.count("-2147483648"),
                  "pos": ptx.count("0f00000000"), "sub": nptx.count("sub.f32"),
                  "flip": nptx.count("xor.b32") + nptx.count("neg.f32")}))
""", triton_dir)
    assert got["neg"] >= 1 and got["pos"] == 0, got
    assert got["sub"] == 0 and got["flip"] >= 1, got


def test_layer_launches_are_counted_per_step_and_layer(capfd):
    """--layer --count: each layer's Triton launches a step, in order, with no kernel run; a
    setting given with --set is in force (the compressor's range sum in its projections' last
    program: one launch fewer, at the r = 2 source only, where its projections run)."""
    import sm90_compile

    def counts(*sets):
        args = ["--layer", "tiny", "--prefill", "8", "--batches", "2", "--count"]
        assert sm90_compile.main(args + [x for s in sets for x in ("--set", s)]) == 0
        rows = [line.split() for line in capfd.readouterr().out.splitlines()
                if line.startswith(("prefill", "decode"))]
        return {(r[0], int(r[2 if r[0] == "prefill" else 3])): r for r in rows}

    base = counts()
    assert len(base) == 12  # 6 layers, a prefill and a decode step
    last = counts("ops.compressor.triton.PROJECT_LAST_SUM=1")
    for (step, layer), row in base.items():
        i = 4 if step == "prefill" else 5  # the launch count's column
        got = last[step, layer]
        if layer == 1:  # the r = 2 source
            assert row[i - 1] == "FULL/r2" and "dense_sum" in row[i + 1:]
            assert int(got[i]) == int(row[i]) - 1 and "dense_sum" not in got[i + 1:]
        else:
            assert got == row
