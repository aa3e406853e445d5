"""The reference backend's CPU kernels (dsv41attn/ops/common/cpu_kernels.py): the ones the golden
fixtures replay exactly with are the ones this process runs, and a process that runs others is
told so."""
import os
import subprocess
import sys
import threading

import pytest
import torch

from conftest import ROOT
from dsv41attn import AttentionLayer, random_layer_weights
from dsv41attn.ops.common import cpu_kernels


def test_this_process_runs_the_fixtures_kernels():
    """Importing dsv41attn before torch's first CPU op pins MKL's path (what the suite does):
    the probe then gives the recorded bits, as every fixture does (test_fixtures)."""
    assert os.environ.get("MKL_CBWR") == cpu_kernels.MKL_BRANCH
    assert cpu_kernels.check_reference_kernels() is None


def test_the_pin_keeps_a_branch_the_user_chose(monkeypatch):
    monkeypatch.setenv("MKL_CBWR", "AVX2")
    cpu_kernels.pin_mkl_branch()
    assert os.environ["MKL_CBWR"] == "AVX2"


def test_bf16_matmul_context_restores_onednn_also_when_raising():
    before = torch.backends.mkldnn.enabled
    with pytest.raises(RuntimeError, match="inside"):
        with cpu_kernels.torch_bf16_matmul():
            assert torch.backends.mkldnn.enabled is False
            raise RuntimeError("inside")
    assert torch.backends.mkldnn.enabled == before
    with cpu_kernels.torch_bf16_matmul(torch.device("meta")):  # not the CPU: nothing changes
        assert torch.backends.mkldnn.enabled == before


def test_bf16_matmul_contexts_of_two_threads_share_the_flag():
    """torch's oneDNN flag is one per process: a thread's context ending while another's is
    open leaves oneDNN off for it; the last to leave restores the flag the first found."""
    before = torch.backends.mkldnn.enabled
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def a():
        with cpu_kernels.torch_bf16_matmul():
            a_in.set()
            b_in.wait(5)
        a_out.set()

    def b():
        a_in.wait(5)
        with cpu_kernels.torch_bf16_matmul():
            b_in.set()
            a_out.wait(5)
            seen["after a left"] = torch.backends.mkldnn.enabled

    threads = [threading.Thread(target=f) for f in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen == {"after a left": False}
    assert torch.backends.mkldnn.enabled == before


def test_a_reference_layer_warns_when_the_kernels_differ(tiny, monkeypatch):
    """A probe that disagrees (here: a recorded einsum hash that no kernel gives) makes building a
    CPU reference layer warn, naming the kernel; the Triton backend is not concerned."""
    monkeypatch.setitem(cpu_kernels.PROBE_BITS, "einsum", -1)
    cpu_kernels.check_reference_kernels.cache_clear()
    try:
        w = random_layer_weights(tiny, 1, seed=0)
        with pytest.warns(cpu_kernels.ReferenceBitsWarning, match=r"\(einsum\).*torch"):
            AttentionLayer(tiny, w, backend="reference")
    finally:
        monkeypatch.undo()
        cpu_kernels.check_reference_kernels.cache_clear()
    assert cpu_kernels.check_reference_kernels() is None


_PROBE_AFTER_MKL = """
import torch
torch.exp(torch.linspace(-90, 0, 4096))  # MKL starts here, before dsv41attn's pin
from dsv41attn.ops.common import cpu_kernels
print(cpu_kernels._probe()["exp"])
print(cpu_kernels.check_reference_kernels())
"""


def test_mkl_on_another_branch_is_reported():
    """A process whose MKL runs another code path (MKL_CBWR=AVX2, chosen before the pin) gets a
    message naming exp and MKL_CBWR; on a CPU whose MKL gives that path COMPATIBLE's exp bits
    there is nothing to report."""
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    env.update(MKL_CBWR="AVX2", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", _PROBE_AFTER_MKL], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    exp_bits, msg = r.stdout.strip().splitlines()
    if int(exp_bits) == cpu_kernels.PROBE_BITS["exp"]:
        pytest.skip("this CPU's MKL gives the AVX2 path COMPATIBLE's exp bits")
    assert "(exp)" in msg and "MKL_CBWR is 'AVX2'" in msg, msg


@pytest.mark.slow
def test_fixture_bits_do_not_follow_the_instruction_sets(tmp_path):
    """v41_geometry (the fixture whose bits moved on a Xeon with AMX) replayed by the CLI with
    ATen, oneDNN and MKL held to AVX2, as on an older or non-Intel CPU: every output bit and
    top-k row is still DeepSeek's."""
    from safetensors.torch import load_file

    from conftest import fixture_files
    from dsv41attn.fixtures import Fixture

    path = next(f for f in fixture_files() if f.stem == "v41_geometry")
    out = tmp_path / "r.safetensors"
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2",
               MKL_ENABLE_INSTRUCTIONS="AVX2")
    r = subprocess.run([sys.executable, "-m", "dsv41attn", "replay", str(path), "--out", str(out),
                        "--semantics", "reference"], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "top-k rows differing 0/3312" in r.stdout, r.stdout
    assert "ReferenceBitsWarning" not in r.stderr, r.stderr
    got, fx = load_file(str(out)), Fixture.load(str(path))
    for layer in fx.layers:
        assert torch.equal(got[f"out.reference.l{layer}"], fx.expected("reference", layer)), layer
