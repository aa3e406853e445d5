"""``python -m dsv41attn bench``: GPU timings with the floor of PERF.md.

Two parts:
- ``layers``: one V4.1-Flash attention layer per role (SWA, Full r=2, Full r=1 candidate
  source, Reindex, Reuse) with random weights, decode at batch x context and prefill from
  position 0. Caches are filled with random packed context; only the role's layer is timed
  (its source layers run untimed before it in the same step, as in the model).
- ``sparse_attn``: the sparse-attention kernel alone (decode, V4.1-Flash heads, 640 rows).

Floor = max(FLOPs / 790 TFLOP/s, bytes / copy bandwidth measured in the same run), counted as
PERF.md says: weights once as stored, activations in and out, attention rows once per query
(window 528 B, compressed 288 B), index keys once per sequence (68 B per scored row),
projections 2 x tokens x params, attention 4 x heads x 512 per (query, row), indexer
2 x 32 x 128 per (query, scored row). Times are medians of CUDA-event-timed calls.
"""
from __future__ import annotations

import csv
import statistics
import time

import torch

from .cache import compressed_row_bytes, index_key_bytes, window_row_bytes
from .checkpoint import expected_tensors, random_layer_weights
from .config import AttentionConfig, preset
from .ops.common.packing import pack_compressed_rows, pack_index_keys, pack_window_rows
from .stack import AttentionStack

BF16_FLOPS = 790e12
ROLES = {"SWA": 0, "Full r=2": 2, "Full r=1 cand": 20, "Reindex": 24, "Reuse": 21}
DECODE = [(1, 4096), (8, 4096), (64, 4096), (256, 4096), (1, 65536), (8, 65536),
          (64, 65536), (256, 65536), (1, 1 << 20)]
PREFILL = [8192, 65536]


def _events_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure_copy_bandwidth(nbytes: int = 2 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    return 2 * nbytes / (_events_ms(lambda: dst.copy_(src), 20) * 1e-3)


def _weight_bytes_and_params(cfg: AttentionConfig, layer: int) -> tuple[int, int]:
    """(bytes read, matrix elements of the projections) of one layer: weights as stored,
    except the gated compressor's, which run (and are read) in fp32 as the reference holds
    them (PERF.md's table counts them so)."""
    size = {torch.float8_e4m3fn: 1, torch.float8_e8m0fnu: 1, torch.bfloat16: 2, torch.float32: 4}
    gated = cfg.layer(layer).has_gate
    nbytes = params = 0
    for name, (dtype, shape) in expected_tensors(cfg, layer).items():
        n = 1
        for s in shape:
            n *= s
        fp32 = gated and name.startswith(("compressor.wkv", "compressor.wgate"))
        nbytes += n * (4 if fp32 else size[dtype])
        if name.endswith(".weight") and len(shape) == 2:
            params += n
    return nbytes, params


def layer_floor(cfg: AttentionConfig, layer: int, batch: int, start: int, tokens: int,
                copy_bw: float) -> tuple[float, float, float]:
    """(FLOPs, bytes, floor seconds) of one layer call: ``tokens`` per sequence from ``start``."""
    spec = cfg.layer(layer)
    wbytes, params = _weight_bytes_and_params(cfg, layer)
    q = batch * tokens
    flops = 2.0 * q * params
    nbytes = wbytes + 2 * q * cfg.dim * 2
    end = start + tokens
    # attention rows per query: window + selected compressed rows
    win_rows = sum(min(p + 1, cfg.window_size) for p in range(start, end))
    cmp_rows = sum(min(cfg.index_topk, (p + 1) // spec.ratio) for p in range(start, end)) \
        if spec.ratio else 0
    nbytes += batch * (win_rows * window_row_bytes(cfg) + cmp_rows * compressed_row_bytes(cfg))
    flops += 4.0 * batch * cfg.n_heads * cfg.head_dim * (win_rows + cmp_rows)
    if spec.is_index_source:
        n_rows = end // spec.ratio
        scored = n_rows
        if spec.is_candidate_consumer:
            scored = min(n_rows, cfg.candidate_topk_blocks * cfg.candidate_block_size)
        nbytes += batch * scored * index_key_bytes(cfg)
        pairs = sum(min((p + 1) // spec.ratio, scored) for p in range(start, end))
        flops += 2.0 * batch * cfg.index_n_heads * cfg.index_head_dim * pairs
    return flops, nbytes, max(flops / BF16_FLOPS, nbytes / copy_bw)


def fill_context(state, ctx: int, seed: int = 0) -> None:
    """Every sequence at position ``ctx`` with random (valid, packed) rings, compressed rows,
    index keys and open groups."""
    cfg, dev = state.config, state.device
    g = torch.Generator(device=dev).manual_seed(seed)
    rows = list(range(state.batch_size))
    state.reserve(rows, [ctx] * len(rows))
    for layer in state.layers.values():
        layer.window.copy_(pack_window_rows(torch.randn(
            *layer.window.shape[:2], cfg.head_dim, generator=g, device=dev).bfloat16()))
        layer.positions.fill_(ctx)
    pattern_rows = 1 << 14
    lat = pack_compressed_rows(torch.randn(pattern_rows, cfg.head_dim, generator=g, device=dev).bfloat16())
    key = pack_index_keys(torch.randn(pattern_rows, cfg.index_head_dim, generator=g, device=dev).bfloat16())
    for src in state.sources.values():
        for pool, pat in ((src.rows, lat), (src.index_keys, key)):
            flat = pool.view(-1, pool.shape[-1])
            for i in range(0, flat.shape[0], pattern_rows):
                n = min(pattern_rows, flat.shape[0] - i)
                flat[i:i + n] = pat[:n]
        if src.recent_kv is not None:
            src.recent_kv.normal_(generator=g)
            src.recent_score.normal_(generator=g)


def role_layers(cfg: AttentionConfig, role: str) -> list[int]:
    """The role's layer and the source layers it reads."""
    spec = cfg.layer(ROLES[role])
    return sorted({spec.layer, spec.kv_source, spec.index_source,
                   cfg.candidate_source_layer if spec.is_candidate_consumer else None} - {None})


class RoleBench:
    """One role's layer and the sources it reads, on the GPU, for one backend."""

    def __init__(self, cfg: AttentionConfig, role: str, backend: str, weights: dict):
        self.cfg, self.target, self.layers = cfg, ROLES[role], role_layers(cfg, role)
        self.stack = AttentionStack(cfg, {L: weights[L] for L in self.layers}, backend)

    def decode_ms(self, batch: int, ctx: int, reps: int) -> float:
        state = self.stack.new_state(batch, capacity=ctx + 1, rollback=1,
                                     max_tokens_per_call=1)
        fill_context(state, ctx)
        xs = [torch.randn(batch, 1, self.cfg.dim, device="cuda").bfloat16() for _ in range(3)]
        times = []
        for k in range(reps + 1):
            step = self.stack.step(state, 1)
            x = xs[k % len(xs)]
            for L in self.layers:
                if L == self.target:
                    times.append(_events_ms(lambda: self.stack.layers[L](x, state, step), 1))
                else:
                    self.stack.layers[L](x, state, step)
            for row in range(batch):
                state.truncate(row, ctx)
        return statistics.median(times[1:])  # the first call warms up

    def prefill_ms(self, tokens: int, reps: int) -> float:
        times = []
        for k in range(reps + 1):
            state = self.stack.new_state(1, capacity=tokens, rollback=0)
            x = torch.randn(1, tokens, self.cfg.dim, device="cuda").bfloat16()
            step = self.stack.step(state, tokens)
            for L in self.layers:
                if L == self.target:
                    times.append(_events_ms(lambda: self.stack.layers[L](x, state, step), 1))
                else:
                    self.stack.layers[L](x, state, step)

        return statistics.median(times[1:])


def bench_layers(backends=("triton", "reference"), decode=DECODE, prefill=PREFILL,
                 roles=tuple(ROLES), reference_cases=((1, 4096), (64, 4096)), log=print):
    cfg = preset("v41-flash")
    copy_bw = measure_copy_bandwidth()
    layers = sorted({L for r in roles for L in role_layers(cfg, r)})
    weights = {L: random_layer_weights(cfg, L, seed=L).to("cuda") for L in layers}
    rows = []
    for role in roles:
        benches = {b: RoleBench(cfg, role, b, weights) for b in backends}
        cases = [("decode", b, c) for b, c in decode] + [("prefill", 1, t) for t in prefill]
        for kind, batch, n in cases:
            start, tokens = (n, 1) if kind == "decode" else (0, n)
            flops, nbytes, floor = layer_floor(cfg, ROLES[role], batch, start, tokens, copy_bw)
            row = {"role": role, "kind": kind, "batch": batch, "context": n,
                   "floor_us": floor * 1e6}
            for be, bench in benches.items():
                if be == "reference" and (kind != "decode" or (batch, n) not in reference_cases):
                    continue
                t0 = time.time()
                try:
                    ms = bench.decode_ms(batch, n, 5 if be != "reference" else 2) if kind == "decode" \
                        else bench.prefill_ms(n, 2)
                except torch.cuda.OutOfMemoryError:
                    torch.cuda.empty_cache()
                    ms = float("nan")
                row[f"{be}_us"] = ms * 1e3
                if be == backends[0]:
                    row["ratio"] = ms * 1e-3 / floor
                    row["TFLOP/s"] = flops / (ms * 1e-3) / 1e12
                    row["GB/s"] = nbytes / (ms * 1e-3) / 1e9
                log(f"  {role} {kind} b={batch} n={n} {be}: {ms * 1e3:.1f} us "
                    f"({time.time() - t0:.1f} s)")
            if "reference_us" in row and row.get("triton_us"):
                row["speedup"] = row["reference_us"] / row["triton_us"]
            rows.append(row)
    return rows, copy_bw


def bench_sparse_attn(copy_bw: float, batches=(1, 8, 64, 256), window: int = 128,
                      topk: int = 512, context: int = 8192) -> list[dict]:
    """The sparse-attention op alone at decode: V4.1-Flash heads, 128 window rows (fp8, 528 B)
    + 512 compressed rows (fp4, 288 B) per query, read from the packed ring and paged pool."""
    from .ops.sparse_attn.reference import sparse_attn_paged as reference
    from .ops.sparse_attn.triton import sparse_attn_paged as kernel

    cfg = preset("v41-flash")
    h, d = cfg.n_heads, cfg.head_dim
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for b in batches:
        page_rows = 256
        pages = b * context // page_rows
        sets = []
        for _ in range(3):  # rotate inputs so rows are not served from L2
            q = torch.randn(b, 1, h, d, device="cuda", generator=g).bfloat16()
            ring = pack_window_rows(torch.randn(b, window, d, device="cuda", generator=g).bfloat16())
            pool = pack_compressed_rows(torch.randn(pages, page_rows, d, device="cuda",
                                                    generator=g).bfloat16())
            table = torch.randperm(pages, device="cuda", generator=g).view(b, -1)
            widx = torch.arange(window, device="cuda", dtype=torch.int32).expand(b, 1, window).contiguous()
            cidx = torch.rand(b, 1, context, device="cuda", generator=g).argsort(-1)[..., :topk]
            cidx = cidx.sort(-1).values.to(torch.int32).contiguous()
            sink = torch.randn(h, device="cuda", generator=g)
            sets.append((q, sink, d ** -0.5, ring, widx, pool, table, cidx))
        ref = reference(*sets[0])
        err = float((kernel(*sets[0]).double() - ref.double()).norm() / ref.double().norm())
        k = [0]

        def call():
            kernel(*sets[k[0] % 3])
            k[0] += 1

        call()
        ms = _events_ms(call, 50)
        nbytes = b * (window * window_row_bytes(cfg) + topk * compressed_row_bytes(cfg)
                      + 2 * h * d * 2 + (window + topk) * 4)
        flops = 4.0 * b * h * d * (window + topk)
        floor = max(flops / BF16_FLOPS, nbytes / copy_bw)
        rows.append({"batch": b, "us": ms * 1e3, "floor_us": floor * 1e6, "ratio": ms * 1e-3 / floor,
                     "GB/s": nbytes / (ms * 1e-3) / 1e9, "copy%": 100 * nbytes / (ms * 1e-3) / copy_bw,
                     "rel_err": err})
    return rows


def main(args) -> int:
    if not torch.cuda.is_available():
        raise SystemExit("bench needs a CUDA GPU")
    import triton

    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    if args.part in ("sparse_attn", "all"):
        copy_bw = measure_copy_bandwidth()
        print(f"sparse attention alone, decode, 640 packed rows per query; copy {copy_bw / 1e12:.2f} TB/s")
        print(f"{'batch':>6}{'us':>9}{'floor':>9}{'ratio':>7}{'GB/s':>7}{'copy%':>7}{'rel err':>9}")
        for r in bench_sparse_attn(copy_bw):
            print(f"{r['batch']:>6}{r['us']:>9.1f}{r['floor_us']:>9.1f}{r['ratio']:>7.2f}"
                  f"{r['GB/s']:>7.0f}{r['copy%']:>6.0f}%{r['rel_err']:>9.1e}")
        if args.part == "sparse_attn":
            return 0
    roles = tuple(args.roles.split(",")) if args.roles else tuple(ROLES)
    decode = DECODE if not args.quick else [(1, 4096), (64, 4096), (64, 65536)]
    prefill = PREFILL if not args.quick else [8192]
    rows, copy_bw = bench_layers(decode=decode, prefill=prefill, roles=roles)
    fields = ["role", "kind", "batch", "context", "triton_us", "reference_us", "floor_us",
              "ratio", "TFLOP/s", "GB/s", "speedup"]
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s; times in us (median)")
    print(f"{'role':<14}{'kind':<8}{'batch':>6}{'context':>9}{'triton':>10}{'reference':>11}"
          f"{'floor':>9}{'ratio':>7}{'GB/s':>7}{'speedup':>8}")
    for r in rows:
        ref = f"{r['reference_us']:.0f}" if "reference_us" in r else "-"
        sp = f"{r['speedup']:.0f}x" if "speedup" in r else "-"
        print(f"{r['role']:<14}{r['kind']:<8}{r['batch']:>6}{r['context']:>9}"
              f"{r.get('triton_us', float('nan')):>10.0f}{ref:>11}{r['floor_us']:>9.1f}"
              f"{r.get('ratio', float('nan')):>7.1f}{r.get('GB/s', float('nan')):>7.0f}{sp:>8}")
    return 0
