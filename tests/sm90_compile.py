"""Compile every Triton kernel specialisation the interpreter suite launches for an H100/H200
(sm_90a), without a GPU.

    make test                                   # the suite records its launches, then this
    python tests/sm90_compile.py LAUNCHES [-j N] [--only NAME]
    python tests/sm90_compile.py --layer v41-flash [--prefill 4096] [--batches 1,8,64,256]
    python tests/sm90_compile.py --layer v41-flash --count [--set PATH.NAME=VALUE ...]

Why: without a GPU the suite runs the kernels under Triton's CPU interpreter, which never
lowers them to PTX. A kernel the GPU backend rejects (a type or layout it cannot lower, a
constexpr branch only the GPU takes) or one asking for more shared memory than an sm_90 block
may have passes every interpreter test and fails at its first launch on a GPU, which this
project gets for minutes per session.

How: ``pytest`` with ``DSV41ATTN_LAUNCH_RECORD=FILE`` (conftest loads ``record_launches``)
writes one JSON line per distinct launch: the kernel's module and name, each argument as the
JIT specialises it (a tensor's dtype, an integer's value, a host tensor descriptor's geometry),
the constexprs and the launch options. This script then compiles each line through Triton's
own JIT path (``warmup``: specialise and compile, no launch) with ``INTERPRET`` set to False,
against a stand-in driver that reports an sm_90 target, down to a cubin by the ptxas in
Triton's wheel. It prints, per kernel, the specialisations compiled, the most registers, the
most stack (spilled bytes live there), the most shared memory and (``--sass``) the most local
loads and stores in the SASS (how spills move), and exits 1 on any compile error or a block over the
232448 B of shared memory an sm_90 block may use. Which Triton compiles is whichever the
Python imports: `make test` runs it twice, with the test extra's and with the GPU image's
3.6.0 first on PYTHONPATH.

``--layer PRESET`` instead records, running no kernel (seconds at V4.1-Flash shapes), the
launches of a triton-backend stack of one layer of each kind of the preset and its sources
through a prefill and first decode steps, compiles them the same way and prints a row per
launch: the registers, spills and shared memory of the tiles the GPU would run at those shapes,
and the instructions a warp issues per iteration of the kernel's main loop (``_main_loop``; a
kernel bound by issuing instructions costs that much per K step, so a change's count can be
compared without a GPU).

``--layer PRESET --count`` records the same steps and, compiling nothing, prints per step and
layer how many Triton kernels it launches and which, in order, with ``--set`` fast-path
settings in force (``bench --variant``'s form): a decode step's launch count per role without
a GPU.

Limits: the specialisations are the ones the interpreter tests pick (their tiles can be
smaller than a GPU run's); pointers are taken as 16-byte aligned; ``--layer``'s decode steps
start from empty caches, so a choice made by the context length (a split count, the indexer's
tiles at long contexts) is a short context's. Where a Triton's internals differ from what the
stand-in driver needs, the check says so and is skipped (exit 0).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import functools
import importlib
import inspect
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

SM90_SHARED_MAX = 232448  # bytes of shared memory one sm_90 block may use (227 KB)
TESTS = Path(__file__).resolve().parent
# the Tritons a compile probe runs under: this one (None), and the GPU image's where make has
# put it beside the venv (its triton-X dirs)
TRITONS = [None] + sorted(str(p) for p in Path(sys.prefix).glob("triton-*") if p.is_dir())


# ---- recording (a pytest plugin: conftest calls record_launches under the interpreter) ----

def _describe(v):
    """An argument as the JIT specialises it, in JSON."""
    import torch
    if isinstance(v, torch.Tensor):
        return {"tensor": str(v.dtype).removeprefix("torch.")}
    if isinstance(v, torch.dtype):
        return {"dtype": str(v).removeprefix("torch.")}
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if isinstance(v, (tuple, list)):
        return [_describe(x) for x in v]
    if type(v).__name__ == "constexpr":
        return _describe(v.value)
    if type(v).__name__ == "TensorDescriptor":
        return {"descriptor": str(v.base.dtype).removeprefix("torch."), "shape": list(v.shape),
                "strides": list(v.strides), "block": list(v.block_shape),
                "padding": getattr(v, "padding", "zero")}
    raise TypeError(f"launch argument of type {type(v).__name__}: not recordable")


def _spec_key(v):
    """What of a described runtime argument is kept apart: an integer's width, not its value
    (the JIT also specialises on 1 and on multiples of 16, which changes the code, hardly
    whether it compiles: merged, which spares a third of the compiles), never a float's."""
    if isinstance(v, bool) or v is None or isinstance(v, (str, dict)):
        return v
    if isinstance(v, int):
        return "i32" if -2**31 <= v < 2**31 else "i64"
    if isinstance(v, float):
        return "f"
    return [_spec_key(x) for x in v]


def _constexpr(param) -> bool:
    ann = param.annotation
    return "constexpr" in (ann if isinstance(ann, str) else getattr(ann, "__name__", ""))


def record_launches(path: str, execute: bool = True, tag: dict | None = None,
                    each: list | None = None) -> None:
    """Append each distinct interpreted launch of this process to ``path`` (JSON lines).
    execute False: record only, run nothing (the outputs stay as allocated). tag: a dict whose
    "tag" entry, when set, goes into each record (what the caller was doing). each: every
    launch, distinct or not, appended as (a copy of tag, the kernel's name)."""
    from triton.runtime import interpreter
    seen: set[str] = set()
    constexpr: dict = {}  # kernel -> which positional parameters are constexprs
    run = interpreter.InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        fn = self.fn
        if each is not None:
            each.append((dict(tag or {}), fn.__qualname__))
        rec = {"module": fn.__module__, "name": fn.__qualname__,
               "args": [_describe(a) for a in args],
               "kwargs": {k: _describe(v) for k, v in kwargs.items()}}
        if tag and tag.get("tag"):
            rec["tag"] = tag["tag"]
        if fn not in constexpr:
            constexpr[fn] = [_constexpr(p) for p in inspect.signature(fn).parameters.values()]
        key = json.dumps([rec["module"], rec["name"],  # a constexpr or an option by its value
                          [a if c else _spec_key(a) for c, a in zip(constexpr[fn], rec["args"])],
                          rec["kwargs"]], sort_keys=True)
        if key not in seen:
            seen.add(key)
            rec["key"] = key  # main() merges the records of several processes by it
            line = (json.dumps(rec) + "\n").encode()
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:  # one write per record: appends of processes side by side never interleave
                os.write(fd, line)
            finally:
                os.close(fd)
        if execute:
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    interpreter.InterpretedFunction.run = recording_run


def record_layer_steps(preset_name: str, path: str, prefill: int, batches: list[int],
                       each: list | None = None) -> None:
    """Record, running none, the kernel launches of a triton-backend stack of the first
    layer of each role of the preset (and its sources: tpcheck.check_layers) at the preset's shapes: a prefill of ``prefill``
    tokens of one sequence, then a first decode step of each batch size. Under the interpreter
    (the caller sets TRITON_INTERPRET=1 before triton is imported); nothing is computed, so it
    takes seconds at V4.1-Flash shapes. each: record_launches' (each launch with its step in
    "tag" and its layer in "layer")."""
    import torch

    from dsv41attn import AttentionLayer, AttentionStack, preset, random_layer_weights
    from dsv41attn.tpcheck import check_layers
    tag: dict = {}
    record_launches(path, execute=False, tag=tag, each=each)
    run = AttentionLayer.run

    def layer_run(self, *args, **kwargs):  # the launches inside it are this layer's
        tag["layer"] = self.spec.layer
        try:
            return run(self, *args, **kwargs)
        finally:
            tag.pop("layer", None)
    AttentionLayer.run = layer_run
    cfg = preset(preset_name)
    _, layers = check_layers(cfg)  # the first layer of each role and the sources it reads
    print(f"{preset_name}: layers {', '.join(map(str, layers))}", flush=True)
    stack = AttentionStack(cfg, {L: random_layer_weights(cfg, L, seed=L) for L in layers},
                           "triton")
    steps = ([(f"prefill {prefill}", 1, prefill)] if prefill else []) + \
        [(f"decode batch {b}", b, 1) for b in batches]
    for name, b, m in steps:
        tag["tag"] = name
        state = stack.new_state(b, capacity=max(prefill, 1) + 1)
        stack.forward({L: torch.zeros(b, m, cfg.dim, dtype=torch.bfloat16) for L in layers},
                      state)


# ---- compiling (worker processes, TRITON_INTERPRET=0, a stand-in sm_90 driver) ----

def _stand_in_driver() -> None:
    """Make Triton's JIT see an sm_90 device it can compile for but never launch on."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    class Utils:
        def get_device_properties(self, device):
            return {"max_shared_mem": SM90_SHARED_MAX, "multiprocessor_count": 132,
                    "max_num_regs": 65536, "warpSize": 32}

    class Sm90:
        utils = Utils()

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

        def is_active(self):
            return True

    driver.set_active(Sm90())


def _argument(v):
    import torch
    if isinstance(v, dict):
        if "tensor" in v:  # what JITFunction.warmup makes of a dtype (keywords too)
            from triton.runtime.jit import MockTensor
            return MockTensor(getattr(torch, v["tensor"]))
        if "dtype" in v:
            return getattr(torch, v["dtype"])
        if "descriptor" in v:
            from triton.tools.tensor_descriptor import TensorDescriptor
            base = torch.empty(16, dtype=getattr(torch, v["descriptor"]))
            return TensorDescriptor(base, v["shape"], v["strides"], v["block"], v["padding"])
    if isinstance(v, list):
        return tuple(_argument(x) for x in v)
    return v


def _main_loop(code: str) -> int:
    """Instructions in a SASS listing's main loop: the shortest backward-branch region that
    holds a tensor-core MMA (HGMMA / HMMA), else the shortest one of any kind; -1 without a
    loop. One warp executes them once per iteration (a K step of a GEMM or attention kernel):
    where a kernel is bound by issuing instructions, this count is its cost per step."""
    ins = [(int(a, 16), t) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", code)]
    loops = []
    for at, text in ins:
        m = re.search(r"\bBRA\s+(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))", text)
        if m and m[1] and int(m[1], 16) < at:
            body = [t for a, t in ins if int(m[1], 16) <= a <= at]
            loops.append((not any(re.search(r"\bH[G]?MMA", t) for t in body), len(body)))
    return min(loops)[1] if loops else -1


def _cuobjdump(cubin: bytes, option: str) -> str | None:
    """The output of the cuobjdump in Triton's wheel on a cubin (None where the wheel has
    none)."""
    import triton
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(tool), option, f.name], capture_output=True,
                              text=True).stdout


def _sass(cubin: bytes) -> str:
    """A cubin's SASS ('' where Triton's wheel has no cuobjdump)."""
    return _cuobjdump(cubin, "-sass") or ""


def _resources(cubin: bytes, sass: bool) -> tuple[int, int, int, int] | None:
    """(registers, stack bytes, local loads + stores, main-loop instructions) of a cubin's
    kernel, by the cuobjdump in Triton's wheel: the LDL / STL instructions of its SASS (static
    count) are where spilled registers move, the stack is where they live; ``_main_loop``
    counts a step's instructions. sass False: not disassembled, -1 for both counts."""
    usage = _cuobjdump(cubin, "--dump-resource-usage")
    if usage is None:
        return None
    code = _sass(cubin) if sass else None
    m = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    local = -1 if code is None else len(re.findall(
        r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?(?:LDL|STL)\b", code, re.M))
    loop = -1 if code is None else _main_loop(code)
    return (int(m[1]), int(m[2]), local, loop) if m else None


def _stand_in_parts() -> None:
    """Import what the stand-in driver and the compiles use (ImportError / AttributeError
    where this Triton lacks it), without making it active: the calling process's Triton and
    environment stay as they are (a pytest process keeps interpreting)."""
    import triton.backends.compiler as compiler
    import triton.runtime.jit as jit
    from triton.runtime.driver import driver
    for owner, name in ((compiler, "GPUTarget"), (jit, "MockTensor"), (jit.JITFunction, "warmup"),
                        (driver, "set_active")):
        getattr(owner, name)


def _setup_worker() -> None:
    import warnings
    warnings.filterwarnings("ignore", message=".*TRITON_DEFAULT_FP_FUSION")  # Triton 3.9's notice
    os.environ["TRITON_INTERPRET"] = "0"
    # this checkout's package (not another one installed), and probe kernels of test modules
    sys.path[:0] = [str(TESTS.parent), str(TESTS)]
    _stand_in_driver()


def compile_probe(body: str, triton_dir: str | None = None) -> dict:
    """Run ``body`` in a fresh process (the stand-in driver must not touch the caller's
    Triton) after the worker's setup, with ``s`` this module, ``json``, ``torch`` and ``M``
    (MockTensor) imported, and triton_dir (another Triton) first on the path if given: the
    body compiles a kernel for sm_90a and prints one JSON line last, returned here. Under
    pytest, a Triton whose internals the stand-in driver does not fit skips the test."""
    import json
    import subprocess
    code = (f"import json, sys\nsys.path[:0] = [{str(TESTS)!r}, {str(TESTS.parent)!r}]\n"
            "import sm90_compile as s\ns._setup_worker()\nimport torch\n"
            "from triton.runtime.jit import MockTensor as M\n" + body)
    env = dict(os.environ, TRITON_INTERPRET="0")
    if triton_dir:
        env["PYTHONPATH"] = os.pathsep.join(
            [triton_dir] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=600)
    if r.returncode:
        if "stand-in" in r.stderr or "GPUTarget" in r.stderr:
            import pytest
            pytest.skip("this Triton's internals do not fit the stand-in driver")
        raise AssertionError(r.stderr[-12000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def _compile(rec: dict, sass: bool = False) -> dict:
    """Compile one recorded launch; a dict of its resources (sass: with the local loads and
    stores counted in its disassembly) or its error."""
    out = {"name": rec["name"]}
    try:
        fn = getattr(importlib.import_module(rec["module"]), rec["name"])
        args = [_argument(a) for a in rec["args"]]
        kwargs = {k: _argument(v) for k, v in rec["kwargs"].items()}
        if "INTERPRET" in kwargs:
            kwargs["INTERPRET"] = False
        elif "INTERPRET" in fn.arg_names[:len(args)]:
            args[fn.arg_names.index("INTERPRET")] = False
        kernel = fn.warmup(*args, grid=(1,), **kwargs)
        out["shared"] = int(kernel.metadata.shared)
        out["resources"] = _resources(kernel.asm["cubin"], sass)
    except Exception as e:  # noqa: BLE001 - every failure is reported by kernel
        out["error"] = f"{type(e).__name__}: {e}"[:4000]
    return out


def _problem(r: dict) -> str | None:
    """Why a compiled launch fails the check (its compile error, or more shared memory than
    an sm_90 block may use), else None."""
    if "error" in r:
        return r["error"]
    if r["shared"] > SM90_SHARED_MAX:
        return f"{r['shared']} B of shared memory > {SM90_SHARED_MAX}"
    return None


def _only(recs: list[dict], only: str | None) -> list[dict]:
    return [r for r in recs if not only or only in r["name"]]


def read_launches(path: Path) -> list[dict]:
    """The distinct launches recorded in ``path``, first seen first: the processes of a
    sharded run each append theirs, so one launch may be there once per process (merged by
    the key record_launches gives it; a record without one by its whole text)."""
    recs: dict = {}
    for line in path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            recs.setdefault(rec.get("key") or json.dumps(rec, sort_keys=True), rec)
    return list(recs.values())


def _compile_all(recs: list[dict], jobs: int, sass: bool) -> list[dict]:
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max(1, jobs), mp_context=ctx,
                                                initializer=_setup_worker) as pool:
        return list(pool.map(functools.partial(_compile, sass=sass), recs, chunksize=4))


def _layer_report(a) -> int:
    """--layer: record (a subprocess under the interpreter), compile, a row per launch."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "launches.jsonl"
        code = (f"import sys; sys.path[:0] = {[str(TESTS.parent), str(TESTS)]!r}; "
                f"import sm90_compile as s; s.record_layer_steps({a.layer!r}, {str(path)!r}, "
                f"{a.prefill}, {[int(b) for b in a.batches.split(',') if b]!r})")
        subprocess.run([sys.executable, "-c", code], check=True,
                       env=dict(os.environ, TRITON_INTERPRET="1"))
        recs = [json.loads(line) for line in path.read_text().splitlines()]
    recs = _only(recs, a.only)
    results = _compile_all(recs, a.j, sass=True)
    print(f"{'step':18s} {'kernel (sm_90a)':28s} {'regs':>4s} {'stack':>5s} {'ld/st':>5s} "
          f"{'smem':>6s} {'loop':>5s}  constexprs (ld/st: local loads and stores in the SASS; "
          f"loop: instructions a warp issues per main-loop iteration, -1: none)")
    failed = 0
    for rec, r in sorted(zip(recs, results), key=lambda p: (p[0]["name"], p[0].get("tag", ""))):
        cx = " ".join(f"{k}={v}" for k, v in rec["kwargs"].items()
                      if k != "INTERPRET" and (k.isupper() or k.startswith("num_")))
        problem = _problem(r)
        if problem:
            failed += 1
            print(f"{rec.get('tag', ''):18s} {rec['name']:28s} FAILED {problem[:300]}")
            continue
        regs, stack, local, loop = r["resources"] or (0, 0, 0, -1)
        print(f"{rec.get('tag', ''):18s} {rec['name']:28s} {regs:4d} {stack:5d} {local:5d} "
              f"{r['shared']:6d} {loop:5d}  {cx}")
    import triton
    print(f"{len(recs) - failed} of {len(recs)} launches of a {a.layer} step compiled for sm_90a "
          f"by Triton {triton.__version__}")
    return 1 if failed else 0


def count_layer_steps(preset_name: str, prefill: int, batches: list[int],
                      settings: list[str]) -> None:
    """--layer --count (under the interpreter; the caller sets TRITON_INTERPRET=1):
    record_layer_steps' steps with ``settings`` ('PATH.NAME=VALUE', tuning.parse_setting) in
    force, and print per step and layer its role, how many Triton kernels it launches and
    which, in order (the torch ops that launch kernels of their own are not counted)."""
    from dsv41attn import preset
    from dsv41attn.tuning import parse_setting, tuned
    cfg = preset(preset_name)
    each: list = []
    with tempfile.TemporaryDirectory() as tmp, tuned([parse_setting(x) for x in settings]):
        record_layer_steps(preset_name, str(Path(tmp) / "launches.jsonl"), prefill, batches,
                           each=each)
    steps: dict = {}
    for tag, name in each:
        if "layer" in tag:
            steps.setdefault((tag.get("tag", ""), tag["layer"]), []).append(name)
    print(f"{'step':18s} {'layer':>5s} {'role':12s} {'launches':>8s}  kernels, in order"
          + (f" (with {', '.join(settings)})" if settings else ""))
    for (step, layer), names in steps.items():
        spec = cfg.layer(layer)
        role = spec.role.name + (f"/r{spec.ratio}" if spec.ratio else "")
        print(f"{step:18s} {layer:5d} {role:12s} {len(names):8d}  "
              + " ".join(n.lstrip("_").removesuffix("_kernel") for n in names))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("launches", nargs="?", help="the JSON lines the suite recorded")
    ap.add_argument("-j", type=int, default=os.cpu_count() or 1, help="compiling processes")
    ap.add_argument("--only", help="kernels whose name contains this")
    ap.add_argument("--sass", action="store_true",
                    help="count local loads and stores in each SASS (--layer always does; "
                         "a minute more over the suite's launches)")
    ap.add_argument("--layer", metavar="PRESET",
                    help="instead: record a layer step of each kind at PRESET's shapes without "
                         "running it (record_layer_steps), compile it, one row per launch")
    ap.add_argument("--prefill", type=int, default=2048, help="--layer: prefill tokens")
    ap.add_argument("--batches", default="1,64", help="--layer: decode batch sizes")
    ap.add_argument("--count", action="store_true",
                    help="--layer: count each layer's Triton launches a step instead of "
                         "compiling them (count_layer_steps)")
    ap.add_argument("--set", action="append", default=[], metavar="PATH.NAME=VALUE",
                    help="--count: a fast-path setting in force (bench --variant's form)")
    a = ap.parse_args(argv)
    if a.count or a.set:
        if not a.layer:
            ap.error("--count and --set go with --layer PRESET")
        code = (f"import sys; sys.path[:0] = {[str(TESTS.parent), str(TESTS)]!r}; "
                f"import sm90_compile as s; s.count_layer_steps({a.layer!r}, {a.prefill}, "
                f"{[int(b) for b in a.batches.split(',') if b]!r}, {a.set!r})")
        return subprocess.run([sys.executable, "-c", code],
                              env=dict(os.environ, TRITON_INTERPRET="1")).returncode
    if a.layer:
        return _layer_report(a)
    if not a.launches:
        ap.error("give LAUNCHES or --layer PRESET")
    path = Path(a.launches)
    if not path.exists() or path.stat().st_size == 0:
        print(f"sm_90 compile check: no interpreted launches in {path} (where the suite runs on "
              "a GPU its kernels compile there for real)")
        return 0
    recs = _only(read_launches(path), a.only)
    try:  # a Triton the stand-in does not fit is told apart up front, changing nothing here
        _stand_in_parts()
    except (ImportError, AttributeError) as e:
        print(f"sm_90 compile check skipped: this Triton's internals differ ({e})")
        return 0
    results = _compile_all(recs, a.j, a.sass)
    table: dict[str, list[int]] = {}  # name -> [count, regs, stack, shared, local ld/st]
    problems = []
    for r in results:
        if "error" in r:
            problems.append(f"{r['name']}: {r['error']}")
            continue
        row = table.setdefault(r["name"], [0, 0, 0, 0, -1])
        regs, stack, local, _ = r["resources"] or (0, 0, 0, -1)
        row[0] += 1
        row[1:] = (max(row[1], regs), max(row[2], stack), max(row[3], r["shared"]),
                   max(row[4], local))
        if _problem(r):  # compiled, but over the shared-memory limit
            problems.append(f"{r['name']}: {_problem(r)}")
    print(f"{'kernel (sm_90a)':32s} {'launches':>8s} {'regs':>5s} {'stack B':>8s} {'smem B':>7s} "
          f"{'ld/st':>6s}  (most of any launch; ld/st: local loads and stores in the SASS, "
          f"-1 without --sass)")
    for name in sorted(table):
        n, regs, stack, shared, local = table[name]
        print(f"{name:32s} {n:8d} {regs:5d} {stack:8d} {shared:7d} {local:6d}")
    import triton
    print(f"{len(results) - len(problems)} of {len(results)} recorded launches compiled for "
          f"sm_90a by Triton {triton.__version__}")
    for p in problems:
        print("FAILED", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
