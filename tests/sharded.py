"""Run the test suite split over several pytest processes, each test's outcome kept as it ends.

    make test-sharded [ARGS="..."]              # every test, one process per core or so
    python tests/sharded.py [-j N] [--limit S] [--out DIR] [--durations N] [--log-tail N]
                            [selection ...]

``selection`` is what pytest selects tests with (paths, node ids, ``-k``, ``-m``); by default
the whole suite. Where torch and triton are already installed (a GPU image without internet,
say) run the script with that Python instead of the Makefile's virtual environment.

Why: on a GPU machine the Triton kernel tests spend most of their time compiling, one kernel
at a time per process (one process did not get through the kernel test files inside ten
minutes); N processes compile N kernels at once. On the CPU (``make test``, 2 processes) the
interpreted kernels keep both cores busy where one pytest process used one: 830 s -> 590 s
for the suite on a 2-core machine. Each process gets ``OMP_NUM_THREADS`` =
cores // N (unless set), so the CPU reference ops beside the kernels do not oversubscribe
the cores. Each process loads this file as a pytest plugin: the processes share the tests
out as they go, in collection order, each claiming the next free one when it is done (a
process that drew the long tests does not hold up the rest; dealt round-robin instead, one of
two processes finished 100 s after the other), and each appends each test's outcome to the
file ``DSV41ATTN_RESULTS`` names the moment the test ends, so a process stopped at
``--limit`` still reports what it finished, and what no process finished is listed by node
id. Exit status
0 only when every collected test passed or was skipped; each process's output is in
``--out`` (a new temporary folder unless given). ``--durations N`` lists the N slowest tests;
``--log-tail N`` prints, for each process where a test failed, the last N lines of its
output (pytest's tracebacks), so a CI log shows why.
"""
from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BAD = ("failed", "error", "unfinished")


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    """The plugin side: where $DSV41ATTN_CLAIMS names a folder, this process runs only the
    tests it claims there, in collection order: test i is claimed by creating the file i
    (O_EXCL: one process wins it). Every process collects the same tests, so the processes
    share them out as they go, each taking the next free one when it is done (a process
    claims its next test before it runs the current one, as pytest's teardown needs to know
    the next test). Elsewhere pytest's own loop runs."""
    claims = os.environ.get("DSV41ATTN_CLAIMS")
    if not claims or session.config.option.collectonly or session.testsfailed:
        return None  # pytest's own loop (which reports collection errors)
    items = session.items

    def claim(start: int):
        for i in range(start, len(items)):
            try:
                os.close(os.open(os.path.join(claims, str(i)),
                                 os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                return i
            except FileExistsError:
                continue
        return None

    nxt = claim(0)
    while nxt is not None:
        cur, nxt = nxt, claim(nxt + 1)
        items[cur].config.hook.pytest_runtest_protocol(
            item=items[cur], nextitem=None if nxt is None else items[nxt])
        if session.shouldfail:
            raise session.Failed(session.shouldfail)
        if session.shouldstop:
            raise session.Interrupted(session.shouldstop)
    return True


def pytest_runtest_logreport(report) -> None:
    """The plugin side (each process loads this file with ``-p sharded``): each phase that
    decides a test's outcome (its call, a skip or a failure at setup or teardown) appended to
    $DSV41ATTN_RESULTS as it ends: phase, outcome, node id and the failure's message."""
    path = os.environ.get("DSV41ATTN_RESULTS")
    if not path or (report.when != "call" and report.outcome == "passed"):
        return
    message = ""
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)  # the exception's own message
        text = crash.message if crash is not None else report.longreprtext.strip()
        message = " ".join(text.split())[:300]
    with open(path, "a") as f:
        f.write(f"{report.when}\t{report.outcome}\t{report.nodeid}\t{message}\t"
                f"{report.duration:.3f}\n")


def collect(selection: list[str], root: Path, env: dict) -> list[str]:
    """Node ids pytest selects, in its collection order (relative to ``root``)."""
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p",
                           "no:cacheprovider", *selection], cwd=root, env=env,
                          capture_output=True, text=True)
    ids = [line.strip() for line in done.stdout.splitlines() if "::" in line]
    if done.returncode not in (0, 5) or not ids:  # 5: nothing collected
        sys.exit(f"collection failed (pytest exit {done.returncode}):\n"
                 f"{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return ids


def _records(path: Path) -> list[tuple[str, str, str, str, float]]:
    """One process's results file, line by line: (phase, outcome, node id, message, seconds)."""
    if not path.exists():
        return []
    recs = []
    for line in path.read_text().splitlines():
        when, outcome, node, message, secs = (line.split("\t") + ["", "", "", "", ""])[:5]
        recs.append((when, outcome, node, message, float(secs or 0)))
    return recs


def outcomes(recs) -> dict[str, tuple[str, str]]:
    """node id -> (outcome, message) from one process's results (_records): a failure or error
    in any phase wins over a pass, a skip at setup stands for the test."""
    seen: dict[str, tuple[str, str]] = {}
    for when, outcome, node, message, _ in recs:
        if outcome == "failed" and when != "call":
            outcome = "error"
        if seen.get(node, ("",))[0] not in BAD:
            seen[node] = (outcome, message)
    return seen


def call_seconds(recs) -> dict[str, float]:
    """node id -> the seconds its call phase took, from one process's results (_records)."""
    return {node: secs for when, _, node, _, secs in recs if when == "call"}


def main(argv=None) -> int:
    cores = os.cpu_count() or 1
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-j", "--jobs", type=int, default=max(1, min(16, cores - 2)),
                    help="pytest processes (default: the cores less two, at most 16)")
    ap.add_argument("--limit", type=float, default=None,
                    help="seconds after which unfinished processes are stopped (default: none)")
    ap.add_argument("--root", type=Path, default=ROOT,
                    help="folder pytest runs in (default: this repository's root)")
    ap.add_argument("--out", type=Path, default=None,
                    help="folder for each process's output and results (default: a new temporary one)")
    ap.add_argument("--durations", type=int, default=0, metavar="N",
                    help="also list the N slowest tests (their call phase)")
    ap.add_argument("--log-tail", type=int, default=0, metavar="N",
                    help="where a test failed, also print the last N lines of its process's "
                         "output (pytest's tracebacks and summary)")
    args, selection = ap.parse_known_args(argv)
    if args.jobs < 1:
        ap.error(f"--jobs must be at least 1, got {args.jobs}")
    out = args.out or Path(tempfile.mkdtemp(prefix="dsv41attn-tests-"))
    out.mkdir(parents=True, exist_ok=True)
    here = str(Path(__file__).resolve().parent)
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))
    env.setdefault("OMP_NUM_THREADS", str(max(1, cores // args.jobs)))
    ids = collect(selection, args.root, env)
    jobs = min(args.jobs, len(ids))
    print(f"{len(ids)} tests over {jobs} processes, OMP_NUM_THREADS="
          f"{env['OMP_NUM_THREADS']}; output in {out}", flush=True)
    claims = out / "claims"  # the processes share the tests out as they go (pytest_runtestloop)
    shutil.rmtree(claims, ignore_errors=True)
    claims.mkdir()
    start = time.monotonic()
    procs = []
    for i in range(jobs):
        results = out / f"results{i}.tsv"
        results.unlink(missing_ok=True)
        with open(out / f"pytest{i}.log", "w") as log:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "sharded",
                 *ids], cwd=args.root,
                env=dict(env, DSV41ATTN_RESULTS=str(results), DSV41ATTN_CLAIMS=str(claims)),
                stdout=log, stderr=subprocess.STDOUT))
    for p in procs:
        left = None if args.limit is None else max(0.0, args.limit - (time.monotonic() - start))
        try:
            p.wait(timeout=left)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    seen: dict[str, tuple[str, str]] = {}
    secs: dict[str, float] = {}
    failing = []  # the processes where a test failed or errored
    for i in range(jobs):
        recs = _records(out / f"results{i}.tsv")  # read once for both
        mine = outcomes(recs)
        seen.update(mine)
        secs.update(call_seconds(recs))
        if any(outcome in BAD for outcome, _ in mine.values()):
            failing.append(i)
    per_file: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for node in ids:
        per_file[node.split("::")[0]][seen.get(node, ("unfinished", ""))[0]] += 1
    width = max(len(f) for f in per_file)
    for f, counts in per_file.items():
        print(f"{f:{width}}  " + "  ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    if args.durations > 0 and secs:
        print(f"the {min(args.durations, len(secs))} slowest tests (seconds, call phase):")
        for node, t in sorted(secs.items(), key=lambda kv: -kv[1])[:args.durations]:
            print(f"  {t:8.2f}  {node}")
    bad = [(node, *seen.get(node, ("unfinished", ""))) for node in ids
           if seen.get(node, ("unfinished",))[0] in BAD]
    if args.log_tail > 0:
        for i in failing:
            lines = (out / f"pytest{i}.log").read_text(errors="replace").splitlines()
            print(f"--- process {i}: the last {min(args.log_tail, len(lines))} lines of "
                  f"its output ({out / f'pytest{i}.log'})")
            print(*lines[-args.log_tail:], sep="\n")
    for node, outcome, message in bad:
        print(f"{outcome.upper()} {node}" + (f": {message}" if message else ""))
    total = collections.Counter(seen.get(n, ("unfinished",))[0] for n in ids)
    print(", ".join(f"{v} {k}" for k, v in sorted(total.items()))
          + f" in {time.monotonic() - start:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
