"""``python -m dsv41attn`` / ``dsv41attn``: demo | replay | bench | plot."""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
from safetensors.torch import save_file

from .checkpoint import load_layer_weights, write_synthetic_checkpoint
from .config import SEMANTICS, load_config
from .fixtures import Fixture, compare, parse_schedule, replay
from .ops.backends import BACKENDS
from .stack import AttentionStack



def _parse_layers(text: str | None, n: int) -> list[int] | None:
    if not text:
        return None
    out: list[int] = []
    for part in text.split(","):
        if "-" in part:
            a, b = part.split("-")
            out.extend(range(int(a), int(b) + 1))
        else:
            out.append(int(part))
    bad = [L for L in out if not 0 <= L < n]
    if bad:
        raise SystemExit(f"--layers: {bad} outside 0..{n - 1}")
    return sorted(set(out))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def demo(args: argparse.Namespace) -> int:
    """Prefill then decode through every layer role, one table row per layer."""
    device = torch.device(args.device)
    cfg = load_config(args.config)
    layers = _parse_layers(args.layers, cfg.n_layers) or list(range(cfg.n_layers))
    needed = sorted(set(layers) | {s for L in layers for s in (
        cfg.layer(L).kv_source, cfg.layer(L).index_source,
        cfg.candidate_source_layer if cfg.layer(L).is_candidate_consumer else None) if s is not None})
    if needed != layers:
        print(f"adding source layers {sorted(set(needed) - set(layers))} that {layers} read")
    with tempfile.TemporaryDirectory() as tmp:
        path = args.checkpoint
        if path is None:
            path = os.path.join(tmp, "synthetic")
            write_synthetic_checkpoint(path, cfg, seed=args.seed, layers=needed)
            print(f"config {args.config}: synthetic checkpoint (seed {args.seed}) for layers {needed}")
        t0 = time.perf_counter()
        weights = load_layer_weights(path, cfg, needed, device=device)
        print(f"loaded {sum(w.nbytes for w in weights.values()) / 2**20:.1f} MiB of attention "
              f"weights in {time.perf_counter() - t0:.2f} s")
    stack = AttentionStack(cfg, weights, backend=args.backend)
    total = args.tokens + args.decode_steps
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
        xs = inputs(m)
        step = stack.step(state, m, semantics=args.semantics)
        for L in needed:
            _sync(device)
            t = time.perf_counter()
            y = stack.layers[L](xs[L], state, step)
            _sync(device)
            times[L].append(time.perf_counter() - t)
            if not torch.isfinite(y.float()).all():
                raise SystemExit(f"layer {L}: non-finite output")
            spec = cfg.layer(L)
            pos = step.start_pos + m - 1
            win = min(pos + 1, cfg.window_size)
            n_cmp = (pos + 1) // spec.ratio if spec.ratio else 0
            sel = int((step.topk(spec.index_source)[0, -1] >= 0).sum()) if spec.ratio else 0
            info[L] = (win, n_cmp, sel)
    last = args.tokens + args.decode_steps - 1
    print(f"\n{args.batch} sequence(s): prefill {args.tokens} tokens, then {args.decode_steps} "
          f"decode steps; rows seen by the token at position {last}, backend {args.backend}, {device}")
    print(f"{'layer':>5} {'role':<8} {'ratio':>5} {'window':>6} {'compressed':>10} "
          f"{'top-k':>5} {'prefill ms':>10} {'decode ms':>9}")
    for L in needed:
        spec = cfg.layer(L)
        win, n_cmp, sel = info[L]
        dec = sum(times[L][1:]) / max(1, len(times[L]) - 1) * 1e3
        role = spec.role.value + ("*" if spec.is_candidate_source else "")
        print(f"{L:>5} {role:<8} {spec.ratio:>5} {win:>6} {n_cmp:>10} {sel:>5} "
              f"{times[L][0] * 1e3:>10.1f} {dec:>9.1f}")
    print("(* candidate source)")
    b = state.kv_bytes_per_token()
    print(f"\nKV cache, packed (SPEC §0.4): {b['compressed']:.0f} B per token of compressed rows + "
          f"index keys over {len(state.sources)} KV source(s), plus {b['window_per_sequence']:.0f} B "
          f"of window rows per sequence ({len(state.layers)} layers x {cfg.window_size} rows)")
    return 0


def replay_cmd(args: argparse.Namespace) -> int:
    """Run a fixture through the library and write its outputs (a stable contract)."""
    fixture = Fixture.load(args.fixture)
    schedule = parse_schedule(args.schedule) if args.schedule else None
    result = replay(fixture, [args.semantics], device=args.device, schedule=schedule,
                    backend=args.backend)[args.semantics]
    save_file({k: v.contiguous() for k, v in result.items()}, args.out,
              metadata={"fixture": os.path.basename(args.fixture), "semantics": args.semantics,
                        "backend": args.backend, "device": str(args.device),
                        "schedule": args.schedule or "fixture"})
    if args.semantics in fixture.semantics:
        c = compare(fixture, result, args.semantics)
        bad, total = c["topk_rows"]
        errs = sorted(e for *_, e in c["per_output"])
        print(f"{os.path.basename(args.fixture)} [{args.semantics}]: top-k rows differing "
              f"{bad}/{total}; output error max {errs[-1]:.3e}, median {errs[len(errs) // 2]:.3e}; "
              f"per layer max {max(c['per_layer'].values()):.3e}")
    print(f"wrote {len(result)} tensors to {args.out}")
    return 0


def bench_cmd(args: argparse.Namespace) -> int:
    """GPU timings of the Triton kernels against the reference path (needs CUDA + triton)."""
    from .bench import main as bench_main

    return bench_main(args)


def plot_cmd(args: argparse.Namespace) -> int:
    from .bench import plot_csv

    plot_csv(args.csv, args.png)
    print(f"wrote {args.png}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dsv41attn", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="prefill + decode through every layer role, per-layer table")
    d.add_argument("--config", default="tiny", help="preset name, config.json or checkpoint dir")
    d.add_argument("--checkpoint", help="HF checkpoint dir (default: synthetic random weights)")
    d.add_argument("--layers", help="e.g. 0-3,20 (default: all backbone layers)")
    d.add_argument("--tokens", type=int, default=29, help="prefill length")
    d.add_argument("--decode-steps", type=int, default=6)
    d.add_argument("--batch", type=int, default=2)
    d.add_argument("--device", default="cpu")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--semantics", choices=SEMANTICS, default="fixed")
    d.add_argument("--backend", choices=BACKENDS, default="reference")
    d.set_defaults(func=demo)
    r = sub.add_parser("replay", help="run a golden fixture and write out.{sem}.l{L}/topk.{sem}.l{L}")
    r.add_argument("fixture")
    r.add_argument("--out", required=True)
    r.add_argument("--semantics", choices=SEMANTICS, default="fixed")
    r.add_argument("--device", default="cpu")
    r.add_argument("--backend", choices=BACKENDS, default="reference")
    r.add_argument("--schedule", help="per-sequence chunk lengths, sequences separated by ';', "
                   "chunks by ',' (e.g. '13,1,1,4;7,6,1,1,1'); default: the fixture's own")
    r.set_defaults(func=replay_cmd)
    bn = sub.add_parser("bench", help="time the Triton kernels against the reference on a GPU")
    bn.add_argument("--csv", help="write the layer rows as CSV")
    bn.add_argument("--part", choices=("layers", "sparse_attn", "all"), default="all")
    bn.add_argument("--roles", help="comma-separated subset of: SWA,Full r=2,Full r=1 cand,Reindex,Reuse")
    bn.add_argument("--quick", action="store_true", help="a few cases only")
    bn.add_argument("--decode", help="decode cases BATCHxCONTEXT,... (e.g. 1x4096,64x65536)")
    bn.add_argument("--prefill", help="prefill lengths, e.g. 8192,65536 ('' for none)")
    bn.add_argument("--compile", action="store_true",
                    help="also time the reference path under torch.compile (decode b=64 4K)")
    bn.add_argument("--profile", action="store_true",
                    help="per-kernel breakdown of each role's decode (b=64, 4K)")
    bn.set_defaults(func=bench_cmd)
    pl = sub.add_parser("plot", help="plot a bench --csv file (ratio to the floor); needs matplotlib")
    pl.add_argument("csv")
    pl.add_argument("png")
    pl.set_defaults(func=plot_cmd)
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
