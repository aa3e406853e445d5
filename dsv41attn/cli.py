"""The ``dsv41attn`` command line (also ``python -m dsv41attn``): demo, replay, inspect, env,
bench, plot, soak.

Errors a user can make (a bad option value, a missing or foreign file, a config that does not
fit) end as one line on stderr and exit status 2, as argparse's own do; ``--debug`` (or
``DSV41ATTN_DEBUG=1``) shows the traceback instead. Only the library's own error types
(ConfigError, CheckpointError, StateError, ValueError) and this module's ``CliError`` are
turned into such lines: anything else is a bug and keeps its traceback.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import sys
import tempfile
import time

import torch
import torch.distributed as distributed
from safetensors import SafetensorError
from safetensors.torch import save_file

from . import __version__
from .cache import StateError
from .checkpoint import INDEX_FILE, CheckpointError, load_layer_weights, write_synthetic_checkpoint
from .config import PRESETS, SEMANTICS, ConfigError, load_config
from .fixtures import Fixture, compare, parse_schedule, replay
from .ops.backends import BACKENDS
from .stack import AttentionStack
from .tp import check_world_size, load_layer_weights_tp

DESCRIPTION = """\
The DeepSeek-V4.1 attention layer, as DeepSeek's reference defines it: run a prefill and
decode steps through every layer role, replay a golden fixture, look inside a forward (what
each query selected and where its attention went), report the environment for a bug report,
check tensor parallelism against one process, time the Triton kernels on a GPU, plot those
timings."""

EPILOG = """\
examples:
  dsv41attn demo                                  tiny preset, random weights, CPU
  dsv41attn demo --tokens 1 --decode-steps 3      one prompt token, three decode steps
  dsv41attn demo --checkpoint DIR --layers 20-24  a HF checkpoint; its config.json is used
  dsv41attn replay tests/fixtures/tiny_long_prefill.safetensors --out /tmp/o.safetensors
  dsv41attn replay tests/fixtures/tiny_long_prefill.safetensors --out /tmp/o.safetensors \\
      --schedule '13,1,1,4,20;7,6,26'
  dsv41attn inspect tests/fixtures/tiny_roles.safetensors --out /tmp/inspect.png
  dsv41attn env                                   versions, GPU, Triton mode: for a bug report
  torchrun --nproc-per-node 2 -m dsv41attn demo --tp 2 --device cpu
                                                  heads split over 2 processes (gloo)
  torchrun --nproc-per-node 2 -m dsv41attn tpcheck --tp 2 --config tiny
                                                  sharded layers against whole ones
  dsv41attn COMMAND --help                        every option of COMMAND"""

# The tiny fixtures (tests/fixtures/README.md): batch 2, tiny_roles 46 positions,
# tiny_long_prefill 39.
SCHEDULE_EXAMPLE = "'13,1,1,4,20;7,6,26' for tiny_long_prefill (2 sequences of 39 tokens)"


class CliError(Exception):
    """A mistake in what the user asked for; the message is one line naming the bad value."""


class _Parser(argparse.ArgumentParser):
    """argparse with its errors on one line: 'PROG: error: MESSAGE (see PROG --help)'."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# ---- option types (argparse calls them; ArgumentTypeError messages are shown as they are) ----

def _int_at_least(lo: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"{text!r}: must be >= {lo}")
        return v

    parse.__name__ = f"integer >= {lo}"
    return parse


def _variant(text: str):
    from .tuning import parse_variant
    try:
        return parse_variant(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


_variant.__name__ = "variant"


def _device(text: str) -> torch.device:
    try:
        dev = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a device: use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(
                f"{text!r}: this torch ({torch.__version__}) sees no CUDA GPU; use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(
                f"{text!r}: there are {torch.cuda.device_count()} CUDA device(s), "
                f"0..{torch.cuda.device_count() - 1}")
    elif dev.type != "cpu":
        raise argparse.ArgumentTypeError(f"{text!r}: only cpu and cuda devices are supported")
    return dev


# ---- checks shared by the commands -----------------------------------------------------------

def _one_line(e: BaseException) -> str:
    """A library message on one line: a CheckpointError's list of problems shows its first."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    if not lines:
        return type(e).__name__
    if len(lines) == 1:
        return lines[0]
    more = f" (and {len(lines) - 2} more; --debug shows all)" if len(lines) > 2 else ""
    return f"{lines[0]} {lines[1]}{more}"


def _check_backend(backend: str, device: torch.device, batch_invariant: bool = False) -> None:
    if backend != "triton":
        if batch_invariant:
            raise CliError(f"--batch-invariant needs --backend triton, got --backend {backend} "
                           "(the reference backend runs torch's kernels)")
        return
    if importlib.util.find_spec("triton") is None:
        raise CliError("--backend triton needs the triton package "
                       "(pip install 'dsv41attn[gpu]'); use --backend reference")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise CliError("--backend triton on --device cpu runs only under the Triton "
                       "interpreter: set TRITON_INTERPRET=1 (slow), or use --device cuda")


def _check_out(path: str, option: str = "--out") -> None:
    """Fail before any work when ``path`` cannot be written."""
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise CliError(f"{option} {path}: is a directory; give a file name")
    if not os.path.isdir(parent):
        raise CliError(f"{option} {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise CliError(f"{option} {path}: not writable")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- tensor parallelism: one process per rank, started by torchrun --------------------------

class _TP:
    """The processes a command runs on: one (group None), or the ``--tp`` ranks torchrun
    started, in one process group (NCCL on CUDA, gloo on the CPU: the only difference)."""

    def __init__(self, group=None, rank: int = 0, world: int = 1, backend: str | None = None):
        self.group, self.rank, self.world, self.backend = group, rank, world, backend

    def describe(self) -> str:
        return "" if self.group is None else \
            f", tensor parallel over {self.world} ranks ({self.backend})"


def _tp_world(args: argparse.Namespace, device: torch.device) -> int:
    """``--tp`` against torchrun's environment (WORLD_SIZE), before any work: the world size."""
    tp, env = args.tp, os.environ.get("WORLD_SIZE")
    command = args.parser.prog.split()[-1]
    if env is None:
        if tp > 1:
            raise CliError(f"--tp {tp} runs one process per rank: start it with torchrun "
                           f"--nproc-per-node {tp} -m dsv41attn {command} ... --tp {tp} "
                           "(WORLD_SIZE is not set)")
        return 1
    if not env.isdigit() or int(env) < 1:
        raise CliError(f"WORLD_SIZE={env!r} (from torchrun) is not a positive integer")
    if int(env) != tp:
        raise CliError(f"--tp {tp} does not match torchrun's WORLD_SIZE={env} (--nproc-per-node "
                       f"times nodes): pass --tp {env}, or start {tp} processes")
    if tp > 1 and device.type == "cuda":
        if device.index is not None:
            raise CliError(f"--device {device}: under --tp each rank runs on its own GPU, "
                           "cuda:LOCAL_RANK; pass --device cuda")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if local >= torch.cuda.device_count():
            raise CliError(f"--tp {tp}: rank with LOCAL_RANK={local} has no GPU of its own (this "
                           f"host has {torch.cuda.device_count()})")
    return tp


def _tp_start(args: argparse.Namespace, world: int,
              device: torch.device) -> tuple[_TP, torch.device]:
    """Join torchrun's process group (world > 1; after every check of the options), NCCL with
    one GPU per rank (cuda:LOCAL_RANK) or gloo on the CPU. ``main`` destroys it at exit."""
    if world == 1:
        return _TP(), device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    distributed.init_process_group(backend)
    args.tp_joined = True
    return _TP(distributed.group.WORLD, distributed.get_rank(),
               distributed.get_world_size(), backend), device


TP_ERROR_GRACE_S = 15  # how long a rank other than 0 waits for rank 0 to report a user error


def _not_rank0(args: argparse.Namespace) -> bool:
    """A rank other than 0 of a ``--tp`` command under torchrun: it prints nothing (a user
    error only after TP_ERROR_GRACE_S, if rank 0 has not been stopped by then: see main)."""
    return getattr(args, "tp", 1) > 1 and os.environ.get("RANK", "0") != "0"


# ---- demo ------------------------------------------------------------------------------------

def _parse_layers(text: str, n: int, cfg_name: str) -> list[int]:
    """'0-3,20' -> [0, 1, 2, 3, 20]: backbone layers 0..n-1."""
    out: list[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if m is None:
            raise CliError(f"--layers {text!r}: {part.strip()!r} is not a layer number or a "
                           "range like 20-24")
        a = int(m[1])
        b = a if m[2] is None else int(m[2])
        if b < a:
            raise CliError(f"--layers {text!r}: range {a}-{b} is empty (write it {b}-{a})")
        out.extend(range(a, b + 1))
    bad = sorted({L for L in out if L >= n})
    if bad:
        raise CliError(f"--layers {text!r}: {bad} outside 0..{n - 1}, the backbone layers of "
                       f"config {cfg_name}")
    return sorted(set(out))


def _demo_config(args: argparse.Namespace):
    """(config, its name for messages): --config, else the checkpoint's config.json, else tiny."""
    source = args.config
    if source is None and args.checkpoint is not None:
        ckpt = args.checkpoint
        where = ckpt if os.path.isdir(ckpt) else os.path.dirname(os.path.abspath(ckpt))
        source = os.path.join(where, "config.json")
        if not os.path.isfile(source):
            raise CliError(f"--checkpoint {ckpt}: no config.json in {where}; pass --config "
                           f"(a preset: {', '.join(PRESETS)}; or a config.json)")
    source = source or "tiny"
    overrides = {} if args.max_seq_len is None else {"max_seq_len": args.max_seq_len}
    return _load_config_arg(source, **overrides), source


def _load_config_arg(source: str, **overrides):
    """--config's value: a preset, a config.json or a checkpoint directory holding one."""
    if source not in PRESETS and not os.path.exists(source):
        raise CliError(f"--config {source!r}: not a preset ({', '.join(PRESETS)}), "
                       "a config.json or a checkpoint directory")
    try:
        return load_config(source, **overrides)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CliError(f"--config {source}: not a JSON config file ({e})") from e


def _check_checkpoint(path: str) -> None:
    if not os.path.exists(path):
        raise CliError(f"--checkpoint {path}: no such file or directory")
    own_json = os.path.basename(path) in ("config.json", INDEX_FILE)  # stand for their directory
    if os.path.isfile(path) and not path.endswith(".safetensors") and not own_json:
        hint = " (a config file goes to --config)" if path.endswith(".json") else ""
        raise CliError(f"--checkpoint {path}: expected a checkpoint directory (or its "
                       f"config.json) or a .safetensors file{hint}")


def demo(args: argparse.Namespace) -> int:
    """Prefill then decode through every layer role, one table row per layer."""
    device = args.device
    _check_backend(args.backend, device, args.batch_invariant)
    if args.checkpoint is not None:
        _check_checkpoint(args.checkpoint)
    cfg, cfg_name = _demo_config(args)
    total = args.tokens + args.decode_steps
    if total > cfg.max_seq_len:
        raise CliError(f"--tokens {args.tokens} + --decode-steps {args.decode_steps} = {total} "
                       f"positions, more than config {cfg_name} allows (max_position_embeddings "
                       f"= {cfg.max_seq_len}); pass --max-seq-len {total} to raise the limit")
    layers = (list(range(cfg.n_layers)) if args.layers is None
              else _parse_layers(args.layers, cfg.n_layers, cfg_name))
    needed = sorted(set(layers) | {s for L in layers for s in (
        cfg.layer(L).kv_source, cfg.layer(L).index_source,
        cfg.candidate_source_layer if cfg.layer(L).is_candidate_consumer else None)
        if s is not None})
    world = _tp_world(args, device)
    check_world_size(cfg, world)
    if needed != layers:
        print(f"adding source layers {sorted(set(needed) - set(layers))} that {layers} read")
    tp, device = _tp_start(args, world, device)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.checkpoint
        if path is None:  # under --tp every rank writes the same one and reads its slices
            path = os.path.join(tmp, "synthetic")
            write_synthetic_checkpoint(path, cfg, seed=args.seed, layers=needed)
            print(f"config {cfg_name}: synthetic checkpoint (seed {args.seed}) for layers {needed}")
        else:
            print(f"config {cfg_name}: checkpoint {path}, layers {needed}")
        t0 = time.perf_counter()
        try:
            if tp.group is None:
                weights = load_layer_weights(path, cfg, needed, device=device)
            else:
                weights, nbytes = load_layer_weights_tp(path, cfg, needed, tp.rank, tp.world,
                                                        device=device)
        except SafetensorError as e:
            raise CliError(f"--checkpoint {path}: a file in it is not readable safetensors "
                           f"({e})") from e
        except CheckpointError as e:
            if args.checkpoint is None or args.config is None:
                raise
            raise CliError(f"{_one_line(e)} (does --config {args.config} fit this checkpoint? "
                           "without --config its config.json is read)") from e
        print(f"loaded {sum(w.nbytes for w in weights.values()) / 2**20:.1f} MiB of attention "
              f"weights in {time.perf_counter() - t0:.2f} s" + ("" if tp.group is None else
                                                               " on rank 0"))
        if tp.group is not None:  # what each rank read: its own slices only
            per_rank = [None] * tp.world
            distributed.all_gather_object(per_rank, nbytes, group=tp.group)
            print("read from the checkpoint per rank: " + ", ".join(
                f"rank {r} {b / 2**20:.2f} MiB" for r, b in enumerate(per_rank)))
    stack = AttentionStack(cfg, weights, backend=args.backend, tp_group=tp.group,
                           batch_invariant=args.batch_invariant)
    if stack.prepared_nbytes:
        print(f"the {args.backend} backend keeps {stack.prepared_nbytes / 2**20:.2f} MiB beside "
              "the weights (float64 copies of the ratio > 1 compressors' weights)")
    state = stack.new_state(args.batch, capacity=total, device=device)
    gen = torch.Generator().manual_seed(args.seed)

    def inputs(m: int) -> dict[int, torch.Tensor]:
        x = torch.randn(args.batch, m, cfg.dim, generator=gen)
        x = x / x.pow(2).mean(-1, keepdim=True).sqrt()  # unit RMS, as after attn_norm
        return {L: x.to(torch.bfloat16).to(device) for L in needed}

    times: dict[int, list[float]] = {L: [] for L in needed}
    info: dict[int, tuple[int, int, int]] = {}
    for step_no in range(1 + args.decode_steps):
        m = args.tokens if step_no == 0 else 1
        pos = args.tokens + step_no - 1  # the position of this step's last token
        xs = inputs(m)
        step = stack.step(state, m, semantics=args.semantics)
        for L in needed:
            _sync(device)
            t = time.perf_counter()
            y = stack.layers[L](xs[L], state, step)
            _sync(device)
            times[L].append(time.perf_counter() - t)
            if not torch.isfinite(y.float()).all():
                raise SystemExit(f"dsv41attn demo: layer {L} produced a non-finite output")
            spec = cfg.layer(L)
            win = min(pos + 1, cfg.window_size)
            n_cmp = (pos + 1) // spec.ratio if spec.ratio else 0
            # step.topk: [sum(tokens), k] int32, -1 padded; the step's last token is the last
            # row (the last sequence's last token; every sequence is at the same position).
            sel = int((step.topk(spec.index_source)[-1] >= 0).sum()) if spec.ratio else 0
            info[L] = (win, n_cmp, sel)
    last = total - 1
    print(f"\n{args.batch} sequence(s): prefill {args.tokens} token(s), then {args.decode_steps} "
          f"decode step(s); backend {args.backend}, {device}{tp.describe()}")
    print(f"per layer, what the last token (position {last}) attends: its window rows, the "
          f"compressed rows that exist,\nand top-k = the compressed rows it selected (the "
          f"entries >= 0 of its row of step.topk(index source))")
    print(f"{'layer':>5} {'role':<8} {'ratio':>5} {'window':>6} {'compressed':>10} "
          f"{'top-k':>5} {'prefill ms':>10} {'decode ms':>9}")
    for L in needed:
        spec = cfg.layer(L)
        win, n_cmp, sel = info[L]
        dec = (f"{sum(times[L][1:]) / (len(times[L]) - 1) * 1e3:>9.1f}" if len(times[L]) > 1
               else f"{'-':>9}")
        role = spec.role.value + ("*" if spec.is_candidate_source else "")
        print(f"{L:>5} {role:<8} {spec.ratio:>5} {win:>6} {n_cmp:>10} {sel:>5} "
              f"{times[L][0] * 1e3:>10.1f} {dec}")
    if any(cfg.layer(L).is_candidate_source for L in needed):
        print("(* candidate source)")
    b = state.kv_bytes_per_token()
    print(f"\nKV cache, packed (window rows fp8, compressed rows and index keys fp4): "
          f"{b['compressed']:.0f} B per token of compressed rows + index keys over "
          f"{len(state.sources)} KV source(s), plus {b['window_per_sequence']:.0f} B of window "
          f"rows per sequence ({len(state.layers)} layers x {cfg.window_size} rows)")
    return 0


# ---- replay ----------------------------------------------------------------------------------

def _load_fixture(path: str) -> Fixture:
    if not os.path.exists(path):
        raise CliError(f"fixture {path}: no such file (the shipped fixtures are in "
                       "tests/fixtures/)")
    if os.path.isdir(path):
        raise CliError(f"fixture {path}: is a directory; give a .safetensors fixture file")
    try:
        return Fixture.load(path)
    except SafetensorError as e:
        raise CliError(f"fixture {path}: not a safetensors file ({e})") from e


def _schedule(text: str, fixture: Fixture, semantics: str) -> list[list[int]]:
    name = os.path.basename(fixture.path)
    try:
        seqs = parse_schedule(text)
    except ValueError:
        raise CliError(f"--schedule {text!r}: expected chunk lengths >= 1, sequences separated "
                       f"by ';', chunks by ',' (e.g. {SCHEDULE_EXAMPLE})") from None
    total = sum(t for _, t in fixture.schedule)
    sums = [sum(s) for s in seqs]
    if len(seqs) != fixture.batch or any(s != total for s in sums):
        raise CliError(f"--schedule {text!r}: {name} holds {fixture.batch} sequence(s) of "
                       f"{total} tokens each; this schedule has {len(seqs)}, of "
                       f"{', '.join(map(str, sums))} tokens")
    own = [t for _, t in fixture.schedule]
    if semantics == "reference" and any(s != own for s in seqs):
        shown = ",".join(map(str, own[:4])) + (f",... ({len(own)} chunks)" if len(own) > 4 else "")
        raise CliError(f"--schedule {text!r}: --semantics reference replays the fixture's own "
                       f"schedule only ({shown} per sequence); use --semantics fixed")
    return seqs


def replay_cmd(args: argparse.Namespace) -> int:
    """Run a fixture through the library and write its outputs (a stable contract)."""
    _check_backend(args.backend, args.device, args.batch_invariant)
    world = _tp_world(args, args.device)
    _check_out(args.out)  # on every rank: each decides alike whether to go on
    fixture = _load_fixture(args.fixture)
    schedule = _schedule(args.schedule, fixture, args.semantics) if args.schedule else None
    check_world_size(fixture.config, world)
    tp, device = _tp_start(args, world, args.device)
    result = replay(fixture, [args.semantics], device=device, schedule=schedule,
                    stack=fixture.stack(device, args.backend, tp.group,
                                        args.batch_invariant))[args.semantics]
    if tp.rank != 0:  # every rank holds the same outputs (all-reduced); rank 0 writes them
        return 0
    try:
        save_file({k: v.contiguous() for k, v in result.items()}, args.out,
                  metadata={"fixture": os.path.basename(args.fixture),
                            "semantics": args.semantics, "backend": args.backend,
                            "device": str(args.device), "schedule": args.schedule or "fixture",
                            "tp": str(tp.world)})
    except (OSError, SafetensorError) as e:
        raise CliError(f"--out {args.out}: cannot write it ({e})") from e
    if args.semantics in fixture.semantics:
        c = compare(fixture, result, args.semantics)
        bad, total = c["topk_rows"]
        errs = sorted(e for *_, e in c["per_output"])
        print(f"{os.path.basename(args.fixture)} [{args.semantics}]: top-k rows differing "
              f"{bad}/{total}; output error max {errs[-1]:.3e}, median {errs[len(errs) // 2]:.3e}; "
              f"per layer max {max(c['per_layer'].values()):.3e}")
    print(f"wrote {len(result)} tensors to {args.out}")
    return 0


# ---- tpcheck ---------------------------------------------------------------------------------

def tpcheck_cmd(args: argparse.Namespace) -> int:
    """The sharded layers against the unsharded ones per role, then each fixture at --tp N."""
    from .tpcheck import check_fixtures, check_roles

    _check_backend(args.backend, args.device, args.batch_invariant)
    source = args.config
    cfg = _load_config_arg(source)
    fixtures = [_load_fixture(p) for p in args.fixtures]
    world = _tp_world(args, args.device)
    if world < 2:
        raise CliError("tpcheck compares a stack sharded over the ranks with a whole one: run it "
                       "under torchrun --nproc-per-node N with --tp N, N >= 2")
    check_world_size(cfg, world)
    for fx in fixtures:
        check_world_size(fx.config, world)
    tp, device = _tp_start(args, world, args.device)
    print(f"tensor-parallel check: {tp.world} ranks ({tp.backend}), {device}, backend "
          f"{args.backend}{' (batch-invariant)' if args.batch_invariant else ''}, config "
          f"{source}, seed {args.seed}")
    t0 = time.perf_counter()
    report = check_roles(cfg, tp.group, device, args.backend, args.batch_invariant, args.seed)
    print(f"each role's layer at TP {tp.world} against one process's, outputs of the rows whose "
          f"selection agrees ({time.perf_counter() - t0:.1f} s):")
    print(f"{'layer':>6}  {'role':<34}{'max error':>10}  top-k rows differing")
    for layer, name, err, bad, total in report.roles:
        print(f"{layer:>6}  {name:<34}{err:>10.2e}  " + (f"{bad}/{total}" if total else "-"))
    if fixtures:
        t0 = time.perf_counter()
        check_fixtures(fixtures, tp.group, device, args.backend, args.batch_invariant, report)
        print(f"golden fixtures at TP {tp.world} ({time.perf_counter() - t0:.1f} s):")
        for line in report.fixtures:
            print(f"  {line}")
    if report.problems:
        print(f"FAILED: {len(report.problems)} problem(s):", *report.problems, sep="\n  ")
        return 1
    print("passed: every check within the fixtures' tolerances")
    return 0


# ---- inspect ---------------------------------------------------------------------------------

def _default_inspect_layer(cfg) -> int:
    """The candidate source if there is one, else the first KV source, else layer 0."""
    if cfg.candidates_enabled:
        return cfg.candidate_source_layer
    return cfg.kv_source_layers[0] if cfg.kv_source_layers else 0


def _fmt_list(values, limit: int = 12) -> str:
    shown = ", ".join(values[:limit])
    return f"[{shown}{', ...' if len(values) > limit else ''}]"


def inspect_cmd(args: argparse.Namespace) -> int:
    """Trace a forward (a fixture's schedule, or random input) and show what the sparse
    attention did: a per-layer summary, one token in detail, and (--out) a figure."""
    from .trace import Trace, plot_trace, trace_fixture, trace_random

    _check_backend(args.backend, args.device, args.batch_invariant)
    if args.out is not None:
        if importlib.util.find_spec("matplotlib") is None:
            raise CliError("inspect --out draws with matplotlib, which is not installed "
                           "(pip install 'dsv41attn[plot]'); without --out it prints the summary")
        _check_out(args.out)
    if args.fixture is not None:
        for opt, given in (("--config", args.config), ("--tokens", args.tokens),
                           ("--decode-steps", args.decode_steps), ("--batch", args.batch)):
            if given is not None:
                raise CliError(f"{opt} is for random input; a fixture brings its own config and "
                               "schedule (drop FIXTURE or the option)")
        fixture = _load_fixture(args.fixture)
        cfg, source = fixture.config, os.path.basename(args.fixture)
        if args.semantics not in fixture.semantics:
            print(f"({source} records {', '.join(fixture.semantics)} outputs; tracing "
                  f"{args.semantics} semantics, compared with none)")
    else:
        try:
            cfg = load_config(args.config or "tiny")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CliError(f"--config {args.config}: not a JSON config file ({e})") from e
        source = f"random input, config {args.config or 'tiny'}"
        tokens = 40 if args.tokens is None else args.tokens
        steps = 4 if args.decode_steps is None else args.decode_steps
        if tokens + steps > cfg.max_seq_len:
            raise CliError(f"--tokens {tokens} + --decode-steps {steps} exceed the config's "
                           f"max_position_embeddings = {cfg.max_seq_len}")
    layer = _default_inspect_layer(cfg) if args.layer is None else args.layer
    if not 0 <= layer < cfg.n_layers:
        raise CliError(f"--layer {layer}: the config has backbone layers 0..{cfg.n_layers - 1}")
    if not 0 <= args.head < cfg.n_heads:
        raise CliError(f"--head {args.head}: the config has heads 0..{cfg.n_heads - 1}")
    trace = Trace(probs=[layer])
    if args.fixture is not None:
        outs = trace_fixture(fixture, trace, args.semantics, args.device, args.backend,
                             args.batch_invariant)
        schedule = ",".join(str(t) for _, t in fixture.schedule)
        print(f"{source}: {fixture.batch} sequence(s), schedule {schedule} per sequence, "
              f"{args.semantics} semantics, backend {args.backend}")
        if args.semantics in fixture.semantics:
            same = all(torch.equal(outs[L], fixture.expected(args.semantics, L))
                       for L in fixture.layers)
            print("the traced outputs equal the fixture's recorded outputs bit for bit" if same
                  else "the traced outputs differ from the fixture's recorded outputs")
    else:
        batch = 1 if args.batch is None else args.batch
        trace_random(cfg, trace, tokens, steps, batch, args.seed, args.semantics, args.device,
                     args.backend, args.batch_invariant)
        print(f"{source}: {batch} sequence(s), prefill {tokens} then {steps} decode step(s), "
              f"seed {args.seed}, {args.semantics} semantics, backend {args.backend}")
    summary = trace.summary()
    print(f"\nper layer, mean over {len(trace.records)} traced step(s), every token and head: "
          f"attention mass on the sink,\nthe window rows and the selected compressed rows; "
          f"compressed rows selected per query; candidate blocks kept per query")
    print(f"{'layer':>5} {'role':<8} {'ratio':>5} {'sink':>6} {'window':>6} {'compr.':>6} "
          f"{'selected':>8} {'cand.blocks':>11}")
    for L, row in summary.items():
        sel = f"{row['selected']:>8.2f}" if row["selected"] is not None else f"{'-':>8}"
        cand = f"{row['candidate_blocks']:>11.2f}" if row["candidate_blocks"] is not None \
            else f"{'-':>11}"
        print(f"{L:>5} {row['role']:<8} {row['ratio']:>5} {row['sink']:>6.3f} "
              f"{row['window']:>6.3f} {row['compressed']:>6.3f} {sel} {cand}")
    # one token in detail: the last token of the first sequence, in the last step
    rec = trace.layer(layer)
    t = int((rec.token_row == rec.token_row[0]).nonzero()[-1])
    pos, wins = int(rec.pos[t]), rec.window_pos[t][rec.window_pos[t] >= 0].tolist()
    print(f"\nlayer {layer} ({rec.role}, ratio {rec.ratio}), head {args.head}, the last token of "
          f"sequence row {int(rec.token_row[t])} (position {pos}):")
    print(f"  window rows: positions {wins[0]}..{wins[-1]} ({len(wins)})")
    if rec.ratio:
        ok = rec.selected[t] >= 0
        g = rec.selected[t][ok].tolist()
        print(f"  compressed rows visible: {int(rec.visible[t])}; selected {len(g)}: "
              f"g = {_fmt_list([str(v) for v in g])}, first positions "
              f"{_fmt_list([str(v) for v in rec.selected_pos[t][ok].tolist()])}")
        src = rec if rec.index_scores is not None else \
            trace.records[rec.step].get(rec.index_source)
        if src is not None and src.index_scores is not None:
            sc = src.index_scores[t][ok].tolist()
            print(f"  their index scores (layer {src.layer}'s indexer): "
                  f"{_fmt_list([f'{v:.3g}' for v in sc])}")
    print(f"  attention mass: sink {float(rec.mass_sink[t, args.head]):.3f}, window "
          f"{float(rec.mass_window[t, args.head]):.3f}, compressed "
          f"{float(rec.mass_compressed[t, args.head]):.3f}")
    if args.out is not None:
        try:
            plot_trace(trace, layer, args.head, args.out,
                       title=f"{source}, {args.semantics} semantics")
        except OSError as e:
            raise CliError(f"--out {args.out}: cannot write it ({e})") from e
        print(f"wrote {args.out}")
    return 0


# ---- env -------------------------------------------------------------------------------------

def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _install_kind() -> str:
    """How this package is installed: editable, a regular install, or a bare source tree.
    (A source tree's own ``*.egg-info`` on sys.path is a distribution too: every one found is
    asked whether pip installed it editable.)"""
    dists = list(importlib.metadata.distributions(name="dsv41attn"))
    if not dists:
        return "not installed: imported from a source tree"
    for dist in dists:
        try:
            info = json.loads(dist.read_text("direct_url.json") or "{}")
        except json.JSONDecodeError:
            continue
        if isinstance(info, dict) and info.get("dir_info", {}).get("editable"):
            return f"editable install of {info.get('url', '?').removeprefix('file://')}"
    return "installed"


def environment() -> dict[str, object]:
    """What a bug report should carry: versions, the GPU, how Triton kernels would run."""
    import dsv41attn

    cuda = torch.cuda.is_available()
    gpus = []
    if cuda:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append(f"cuda:{i} {p.name} (sm_{p.major}{p.minor}, "
                        f"{p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs)")
    triton = _dist_version("triton")
    interpret = os.environ.get("TRITON_INTERPRET")
    if triton is None:
        mode = "unavailable: triton is not installed (pip install 'dsv41attn[gpu]'); --backend reference only"
    elif interpret == "1":
        mode = "interpreted on the CPU (TRITON_INTERPRET=1): exact but slow"
    elif cuda:
        mode = "compiled for the GPU (TRITON_INTERPRET unset or 0)"
    else:
        mode = ("neither: no CUDA GPU and TRITON_INTERPRET is not 1; --backend triton needs a GPU "
                "or TRITON_INTERPRET=1 (the test suite sets it itself on a CPU)")
    return {
        "dsv41attn": f"{__version__} at {os.path.dirname(os.path.abspath(dsv41attn.__file__))} "
                     f"({_install_kind()})",
        "python": f"{platform.python_version()} ({platform.python_implementation()}, "
                  f"{sys.executable})",
        "platform": platform.platform(),
        "torch": f"{torch.__version__} (CUDA build {torch.version.cuda or 'none'})",
        "triton": triton or "not installed",
        "numpy": _dist_version("numpy") or "not installed",
        "safetensors": _dist_version("safetensors") or "not installed",
        "tqdm": _dist_version("tqdm") or "not installed",
        "matplotlib": _dist_version("matplotlib") or "not installed (inspect --out needs it)",
        "CUDA": (f"available, {torch.cuda.device_count()} device(s)" if cuda
                 else "not available to this torch"),
        "GPU": "; ".join(gpus) if gpus else "none",
        "Triton kernels": mode,
        "sparse attention": _attention_kernel() if triton else "the reference op only",
        "TRITON_INTERPRET": "unset" if interpret is None else interpret,
        "CPU threads": str(torch.get_num_threads()),
        "reference CPU kernels": _reference_kernels(),
    }


def _attention_kernel() -> str:
    """Which sparse-attention kernel the triton backend runs here (Gluon on Hopper)."""
    try:
        from .ops.sparse_attn.paged import kernel_report
    except Exception as e:  # noqa: BLE001 - a report line, never a failure of `env`
        return f"unknown: importing the triton backend's attention failed ({e!r})"
    return kernel_report()


def _reference_kernels() -> str:
    """Whether the reference backend's CPU kernels round as the golden fixtures' did."""
    from .ops.common.cpu_kernels import check_reference_kernels

    msg = check_reference_kernels()
    return (f"the golden fixtures' (MKL_CBWR={os.environ.get('MKL_CBWR')}, bf16 matmuls on "
            "torch's own kernel)" if msg is None else msg)


def env_cmd(args: argparse.Namespace) -> int:
    """Print the environment (``--json``: as one JSON object)."""
    info = environment()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    width = max(map(len, info))
    for key, value in info.items():
        print(f"{key + ':':<{width + 1}} {value}")
    return 0


# ---- bench, plot -----------------------------------------------------------------------------

def bench_cmd(args: argparse.Namespace) -> int:
    """GPU timings of the Triton kernels against the reference path (needs CUDA + triton)."""
    if args.settings:
        return _print_settings()
    if args.csv and args.part not in ("layers", "gemm", "all"):
        raise CliError(f"--csv writes the layers part's rows (--part layers or all) or the "
                       f"gemm part's (--part gemm); --part {args.part} has none to write")
    if args.variant:
        if args.part not in ("layers", "gemm", "sparse_attn"):
            raise CliError(f"--variant times the layers, gemm and sparse_attn parts only; got "
                           f"--part {args.part}: pass one of those")
        names = [name for name, _ in args.variant]
        if len(set(names)) < len(names):
            raise CliError(f"--variant: each variant needs a name of its own, got {names}")
    if args.rows and args.part not in ("gemm", "all"):
        raise CliError(f"--rows sets the gemm part's row counts; got --part {args.part}")
    if args.rows and not re.fullmatch(r"[1-9]\d*(,[1-9]\d*)*,?", args.rows):
        raise CliError(f"--rows {args.rows!r}: expected token row counts >= 1 like 1,64,256")
    if not torch.cuda.is_available():
        raise CliError(f"bench needs a CUDA GPU; this torch ({torch.__version__}) sees none")
    if importlib.util.find_spec("triton") is None:
        raise CliError("bench needs the triton package (pip install 'dsv41attn[gpu]')")
    from .bench import ROLES, main as bench_main

    if args.roles:
        bad = [r for r in args.roles.split(",") if r not in ROLES]
        if bad:
            raise CliError(f"--roles {args.roles!r}: unknown {bad}; known: {', '.join(ROLES)}")
    if args.decode and not re.fullmatch(r"\d+x\d+(,\d+x\d+)*,?", args.decode):
        raise CliError(f"--decode {args.decode!r}: expected BATCHxCONTEXT,... like 1x4096,64x65536")
    if args.prefill and not re.fullmatch(r"\d+(,\d+)*,?", args.prefill):
        raise CliError(f"--prefill {args.prefill!r}: expected lengths like 8192,65536")
    if args.csv:
        _check_out(args.csv, "--csv")
    world = _tp_world(args, torch.device("cuda"))
    check_world_size(load_config("v41-flash"), world)
    args.tp_run, _ = _tp_start(args, world, torch.device("cuda"))
    return bench_main(args)


def _print_settings() -> int:
    """bench --settings: what --variant may set, with each constant's value and comment."""
    from .tuning import settable

    rows = settable()
    print(f"{len(rows)} constants --variant may set (PATH.NAME=VALUE, the current value shown; "
          "the comment is the one beside it in the source, shortened):")
    width = max(len(str(s)) for s, _ in rows) + 2
    previous = None
    for setting, comment in rows:
        short = comment if len(comment) <= 96 else comment[:93].rstrip() + "..."
        if comment and comment == previous:  # constants under one comment
            short = "(the comment above)"
        previous = comment
        print(f"  {str(setting):<{width}}{short}")
    return 0


def plot_cmd(args: argparse.Namespace) -> int:
    """A bench --csv file as a bar chart of the ratio to the floor (needs matplotlib)."""
    if not os.path.isfile(args.csv):
        raise CliError(f"{args.csv}: no such file (write one with bench --csv)")
    if importlib.util.find_spec("matplotlib") is None:
        raise CliError("plot needs matplotlib (pip install 'dsv41attn[plot]')")
    _check_out(args.png, "PNG")
    from .bench import plot_csv

    plot_csv(args.csv, args.png)
    print(f"wrote {args.png}")
    return 0


def soak_cmd(args: argparse.Namespace) -> int:
    """The serving soak: a randomized mix of calls, every output checked against the oracle."""
    from .soak import soak

    if args.backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1" \
            and not torch.cuda.is_available():
        raise CliError("--backend triton needs a CUDA GPU or TRITON_INTERPRET=1")
    fig = soak(seconds=args.minutes * 60, seed=args.seed, backend=args.backend)
    print(fig.line())
    if fig.mismatches:
        print(f"first mismatch: {fig.first_mismatch}")
        return 1
    return 0


# ---- the parser ------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    p = _Parser(prog="dsv41attn", description=DESCRIPTION, epilog=EPILOG, formatter_class=fmt)
    p.add_argument("--version", action="version", version=f"dsv41attn {__version__}",
                   help="print the package version and exit")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND",
                           title="commands (COMMAND --help lists its options)")
    common = _Parser(add_help=False)
    common.add_argument("--debug", action="store_true",
                        help="show the Python traceback of an error (also DSV41ATTN_DEBUG=1)")

    def tp_opt(q: argparse.ArgumentParser, device: str) -> None:
        q.add_argument("--tp", type=_int_at_least(1), default=1, metavar="N",
                       help="tensor parallelism: split the heads over N processes, started by "
                            f"torchrun --nproc-per-node N; {device}; rank 0 prints "
                            "(default: 1)")

    def device_opt(q: argparse.ArgumentParser, semantics: bool = True) -> None:
        q.add_argument("--device", type=_device, default="cpu",
                       help="torch device to run on: cpu, cuda or cuda:N (default: cpu)")
        q.add_argument("--backend", choices=BACKENDS, default="reference",
                       help="reference: plain PyTorch with DeepSeek's rounding; triton: the "
                            "Triton kernels (CUDA, or the CPU with TRITON_INTERPRET=1) "
                            "(default: reference)")
        q.add_argument("--batch-invariant", action="store_true",
                       help="triton: every reduction in a fixed order, so a sequence gets the "
                            "same bits alone, in any batch, chunked or token by token "
                            "(slower at large batches and prefill; docs/benchmarks.md)")
        if not semantics:
            return
        q.add_argument("--semantics", choices=SEMANTICS, default="fixed",
                       help="index-key semantics: fixed (each KV source publishes its own index "
                            "keys before scoring) or reference (DeepSeek's code as it is) "
                            "(default: fixed)")

    d = sub.add_parser("demo", parents=[common],
                       help="prefill + decode through every layer role, one table row per layer",
                       description="Prefill, then decode one token per step, through the "
                                   "attention layers of a config, with random inputs; prints "
                                   "per layer the rows the last token attends and the time "
                                   "taken. Random weights unless --checkpoint is given.")
    d.add_argument("--config", metavar="NAME|PATH",
                   help=f"a preset ({', '.join(PRESETS)}), a config.json, or a checkpoint "
                        "directory holding one (default: the --checkpoint's config.json, "
                        "else tiny)")
    d.add_argument("--checkpoint", metavar="DIR",
                   help="HF checkpoint directory (config.json + safetensors shards) or a "
                        ".safetensors file (default: random weights, written as a synthetic "
                        "checkpoint and loaded)")
    d.add_argument("--layers", metavar="LIST",
                   help="backbone layers to run, e.g. 0-3,20; the source layers they read "
                        "are added (default: all backbone layers)")
    d.add_argument("--tokens", type=_int_at_least(1), default=29, metavar="N",
                   help="prefill length per sequence (default: 29)")
    d.add_argument("--decode-steps", type=_int_at_least(0), default=6, metavar="N",
                   help="decode steps after the prefill, one token each (default: 6)")
    d.add_argument("--batch", type=_int_at_least(1), default=2, metavar="B",
                   help="sequences run together (default: 2)")
    d.add_argument("--max-seq-len", type=_int_at_least(1), metavar="N",
                   help="override the config's max_position_embeddings, the most positions a "
                        "sequence may reach (tiny: 4096)")
    d.add_argument("--seed", type=int, default=0,
                   help="seed of the random weights and inputs (default: 0)")
    device_opt(d)
    tp_opt(d, "gloo with --device cpu, NCCL (one GPU per rank) with --device cuda")
    d.set_defaults(func=demo, parser=d)

    r = sub.add_parser("replay", parents=[common],
                       help="run a golden fixture, compare with its recorded outputs, write "
                            "ours",
                       description="Replay a golden fixture (tests/fixtures/*.safetensors) "
                                   "through the library, print how its outputs compare with "
                                   "the fixture's, and write them: out.{semantics}.l{L} "
                                   "[batch, tokens, hidden] bf16 per layer, and topk."
                                   "{semantics}.l{L} (compressed row numbers, int32, -1 pad) "
                                   "per index source.")
    r.add_argument("fixture", metavar="FIXTURE",
                   help="a fixture file, e.g. tests/fixtures/tiny_roles.safetensors")
    r.add_argument("--out", required=True, metavar="FILE",
                   help="safetensors file to write the outputs to")
    r.add_argument("--schedule", metavar="CHUNKS",
                   help="per-sequence chunk lengths, sequences separated by ';', chunks by ','; "
                        "each sequence's chunks sum to the fixture's tokens, and batch step k "
                        f"runs every sequence's k-th chunk, e.g. {SCHEDULE_EXAMPLE}; "
                        "tiny_roles has 2 of 46 (default: the fixture's own schedule)")
    device_opt(r)
    tp_opt(r, "gloo with --device cpu, NCCL (one GPU per rank) with --device cuda; rank 0 "
              "writes --out")
    r.set_defaults(func=replay_cmd, parser=r)

    ins = sub.add_parser("inspect", parents=[common],
                         help="trace a forward: what each query selected and where its "
                              "attention went, per layer; --out draws a figure",
                         description="Trace every layer of a forward, a golden fixture's "
                                     "schedule (FIXTURE) or random input on a preset, and print "
                                     "per layer the mean attention mass on the sink, the window "
                                     "rows and the selected compressed rows, the compressed rows "
                                     "selected per query and the candidate blocks kept; then one "
                                     "token of --layer in detail. --out draws, for --layer and "
                                     "--head, the rows each query attended by position and the "
                                     "attention mass per head (needs matplotlib).")
    ins.add_argument("fixture", metavar="FIXTURE", nargs="?",
                     help="a fixture file, e.g. tests/fixtures/tiny_roles.safetensors "
                          "(default: random input on --config)")
    ins.add_argument("--out", metavar="FIGURE.png", help="draw the figure to this file")
    ins.add_argument("--layer", type=_int_at_least(0), metavar="L",
                     help="the layer shown in detail and drawn (default: the candidate source, "
                          "else the first KV source)")
    ins.add_argument("--head", type=_int_at_least(0), default=0, metavar="H",
                     help="the head shown in detail and drawn (default: 0)")
    ins.add_argument("--config", metavar="NAME|PATH",
                     help="without FIXTURE: a preset or config.json (default: tiny)")
    ins.add_argument("--tokens", type=_int_at_least(1), metavar="N",
                     help="without FIXTURE: prefill length (default: 40)")
    ins.add_argument("--decode-steps", type=_int_at_least(0), metavar="N",
                     help="without FIXTURE: decode steps after the prefill (default: 4)")
    ins.add_argument("--batch", type=_int_at_least(1), metavar="B",
                     help="without FIXTURE: sequences run together (default: 1)")
    ins.add_argument("--seed", type=int, default=0,
                     help="without FIXTURE: seed of the random weights and inputs (default: 0)")
    device_opt(ins)
    ins.set_defaults(func=inspect_cmd, parser=ins)

    ev = sub.add_parser("env", parents=[common],
                        help="versions, GPU and Triton mode: what a bug report should carry",
                        description="Print the versions of dsv41attn (and where it is "
                                    "installed), Python, torch, triton, numpy, safetensors, "
                                    "tqdm and matplotlib; CUDA and the GPUs; and whether the "
                                    "Triton kernels would compile for a GPU or run under the "
                                    "interpreter (TRITON_INTERPRET). Paste it into a bug report.")
    ev.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    ev.set_defaults(func=env_cmd, parser=ev)

    bn = sub.add_parser("bench", parents=[common],
                        help="time the Triton kernels against the reference on a CUDA GPU",
                        description="Time one V4.1-Flash layer per role and the sparse-attention "
                                    "kernel alone on a CUDA GPU, against the reference path "
                                    "and the floor (FLOPs and bytes moved).")
    bn.add_argument("--csv", metavar="FILE",
                    help="also write the layer rows as CSV (--part layers or all; with "
                         "--part gemm the fp8 linears' rows)")
    bn.add_argument("--part", choices=("layers", "sparse_attn", "indexer", "gemm", "all",
                                       "attn_variants", "attn_kernels"),
                    default="all",
                    help="layers: one layer per role; sparse_attn: the sparse-attention kernel "
                         "alone; indexer: the lightning indexer alone; gemm: each fp8 linear "
                         "alone, and wo_a from its fp8 codes, on torch and on dense_linear; "
                         "all: every part (default: all); attn_variants (not in all): "
                         "the sparse-attention kernel's launch options (head tile, warps, "
                         "column chunks) against its defaults, decode and an 8K prefill; "
                         "attn_kernels (not in all): the Triton and the warp-specialized "
                         "Gluon sparse attention by cut, decode at 4K")
    bn.add_argument("--roles", metavar="LIST",
                    help="comma-separated subset of: SWA,Full r=2,Full r=1 cand,Reindex,Reuse "
                         "(default: all)")
    bn.add_argument("--quick", action="store_true", help="a few cases only")
    bn.add_argument("--decode", metavar="CASES",
                    help="decode cases BATCHxCONTEXT,... (e.g. 1x4096,64x65536)")
    bn.add_argument("--prefill", metavar="LENGTHS",
                    help="prefill lengths, e.g. 8192,65536 ('' for none)")
    bn.add_argument("--compile", action="store_true",
                    help="also time the reference path under torch.compile (decode b=64 4K)")
    bn.add_argument("--profile", action="store_true",
                    help="per-kernel breakdown of each role's decode step at 4K, at each "
                         "batch of the 4K decode cases (none at 4K: b=1 and b=64), and of "
                         "each prefill case's layer call: its launches, their GPU time, the "
                         "longest kernels (with --batch-invariant, the invariant mode's too)")
    bn.add_argument("--timeline", action="store_true",
                    help="which kernel ran when, and on which stream, in one CUDA-graph replay "
                         "of each role's decode step at 4K, at each batch of the 4K decode "
                         "cases (none at 4K: b=1 and b=64), with each stream's idle time "
                         "before each launch and each stream's span: where a step's critical "
                         "path runs and where it waits")
    bn.add_argument("--batch-invariant", action="store_true",
                    help="also time every layer case in the batch-invariant mode (columns "
                         "invariant and cost: its time and its extra time over the default)")
    bn.add_argument("--idle-replays", action="store_true",
                    help="time each decode graph replay alone from an idle GPU (its launch "
                         "latency and input copy included: the tables before the eleventh "
                         "session) and each prefill call from an idle GPU (the host's time to "
                         "its launches included: before the twenty-fifth session); default: "
                         "decode steps queued back to back, as a serving loop, and each "
                         "prefill call queued while a spin kernel holds the GPU, as behind "
                         "a model's previous layer")
    bn.add_argument("--rows", metavar="LIST",
                    help="--part gemm: the token rows of each fp8 linear, e.g. 32,64,128,256 "
                         "(default: bench.GEMM_ROWS, decode batches to an 8K prefill)")
    bn.add_argument("--variant", type=_variant, action="append", default=[],
                    metavar="NAME[:PATH.NAME=VALUE,...]",
                    help="with --part layers, gemm or sparse_attn: time every layer case "
                         "(every fp8 linear, wo_a under the first only; the attention's "
                         "decode and prefill cases) under each variant "
                         "(repeat the option), a variant being the defaults with some of "
                         "the fast path's module constants set (--settings lists them), "
                         "e.g. --variant base --variant "
                         "r4:ops.linear.triton.SPLIT_PROGRAMS_PER_SM=4; "
                         "the variants' times alternate over --variant-rounds rounds (the "
                         "least kept); columns vs and diff: each variant's time against the "
                         "first's and its output elements whose bits differ from the first's")
    bn.add_argument("--settings", action="store_true",
                    help="list the constants --variant may set, with their values and "
                         "comments, and exit (no GPU needed)")
    bn.add_argument("--variant-rounds", type=_int_at_least(1), default=2, metavar="N",
                    help="rounds over the variants (default: 2)")
    tp_opt(bn, "NCCL, one GPU per rank; times are rank 0's")
    bn.set_defaults(func=bench_cmd, parser=bn)

    pl = sub.add_parser("plot", parents=[common],
                        help="plot a bench --csv file (ratio to the floor); needs matplotlib",
                        description="Draw a bench --csv file as bars of the ratio to the floor "
                                    "per role and case (needs matplotlib).")
    pl.add_argument("csv", metavar="CSV", help="a file written by bench --csv")
    pl.add_argument("png", metavar="PNG", help="the figure to write")
    pl.set_defaults(func=plot_cmd, parser=pl)

    tc = sub.add_parser("tpcheck", parents=[common],
                        help="tensor parallelism: sharded layers against whole ones, fixtures "
                             "at --tp N (under torchrun)",
                        description="Under torchrun, one process per rank: one layer of each "
                                    "role of --config (and its sources), random weights, a "
                                    "ragged schedule run whole and sharded over the ranks, "
                                    "compared row by row; then each --fixtures file replayed "
                                    "at --tp N. Both are held to the golden fixtures' "
                                    "tolerances; exit status 1 when one is not met.")
    tc.add_argument("--config", metavar="NAME|PATH", default="v41-flash",
                    help=f"a preset ({', '.join(PRESETS)}), a config.json or a checkpoint "
                         "directory (default: v41-flash; tiny runs in seconds on the CPU)")
    tc.add_argument("--fixtures", nargs="*", default=[], metavar="FIXTURE",
                    help="fixture files to replay at --tp N, e.g. tests/fixtures/*.safetensors "
                         "(default: none)")
    tc.add_argument("--seed", type=int, default=0,
                    help="seed of the random weights and inputs (default: 0)")
    device_opt(tc, semantics=False)  # both stacks run the config's semantics
    tp_opt(tc, "gloo with --device cpu, NCCL (one GPU per rank) with --device cuda")
    tc.set_defaults(func=tpcheck_cmd, parser=tc)

    sk = sub.add_parser("soak", parents=[common],
                        help="randomized serving soak: every output against token-by-token decode",
                        description="Drive a small paged state (tiny preset) with a seeded random "
                                    "mix of ragged steps, chunks, decode plans, draft verification "
                                    "and rollbacks, forks, releases, failing and aborted steps, and "
                                    "compare every output with the same tokens decoded one by one "
                                    "on a fresh state, bit for bit. Exit status 1 on a mismatch.")
    sk.add_argument("--minutes", type=float, default=1.0, help="how long to run (default: 1)")
    sk.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    sk.add_argument("--backend", choices=BACKENDS, default="reference",
                    help="ops backend of the state under test and of the oracle (default: "
                         "reference; triton runs in its batch-invariant mode, so that a "
                         "token's bits cannot depend on the call)")
    sk.set_defaults(func=soak_cmd, parser=sk)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the command line; user errors exit with status 2 and one line on stderr."""
    args = build_parser().parse_args(argv)
    debug = args.debug or os.environ.get("DSV41ATTN_DEBUG", "") not in ("", "0")
    quiet = _not_rank0(args)
    try:
        with contextlib.ExitStack() as on_exit:
            if quiet:  # under --tp only rank 0 prints
                on_exit.enter_context(contextlib.redirect_stdout(
                    on_exit.enter_context(open(os.devnull, "w"))))
            on_exit.callback(_tp_end, args)
            return args.func(args)
    except BrokenPipeError:  # `dsv41attn env | head`: the reader left; no traceback
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except CliError as e:
        if debug:
            raise
        message = str(e)
    except (ConfigError, CheckpointError, StateError, ValueError) as e:
        # The library's user-facing errors (the first three are ValueErrors). TypeError is not
        # caught: the CLI builds every tensor itself, so one would be a bug, with a traceback.
        if debug:
            raise
        message = _one_line(e)
    if quiet and not getattr(args, "tp_joined", False):
        # Every rank checked the same options, so rank 0 says what is wrong. torchrun stops
        # every rank once one exits: leaving first could stop rank 0 before it printed (seen
        # on a loaded 2-core machine: no message at all). So wait; if rank 0 has not exited
        # by then, the error is this rank's own (its GPU, say): say it, with the rank.
        time.sleep(TP_ERROR_GRACE_S)
    if quiet:
        message = f"rank {os.environ.get('RANK')}: {message}"
    sys.stderr.write(f"{args.parser.prog}: error: {message}\n")
    raise SystemExit(2)


def _tp_end(args: argparse.Namespace) -> None:
    """Destroy the process group a --tp command joined (at exit, errors included)."""
    if getattr(args, "tp_joined", False) and distributed.is_initialized():
        distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
