"""``python -m dsv41attn bench``: time the ops that have a Triton kernel against the reference
path on the same GPU, with the floor of PERF.md (counted FLOPs and bytes over the measured
ceilings) and the ratio.

Today that is the sparse attention with sink (decode: one query per sequence over 128 window
rows + 512 compressed rows, V4.1-Flash heads). Rows are read as bf16 (1024 B per row); the
packed-cache kernel of issue 4 will read 528 / 288 B rows instead.
"""
from __future__ import annotations

import csv
import io
import statistics

import torch

COPY_BW = 4.3e12  # device-to-device copy, bytes read + written, H200 (PERF.md); re-measured below
BF16_FLOPS = 790e12


def _time_ms(fn, reps: int = 50) -> float:
    """Median of ``reps`` CUDA-event-timed calls after warm-up."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
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
    ms = _time_ms(lambda: dst.copy_(src), reps=20)
    return 2 * nbytes / (ms * 1e-3)


def sparse_attn_case(batch: int, window: int = 128, topk: int = 512, heads: int = 64,
                     head_dim: int = 512, context: int = 4096, sets: int = 4, seed: int = 0):
    """Decode inputs at V4.1-Flash shapes, ``sets`` independent copies (rotated so the rows
    do not sit in L2)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for _ in range(sets):
        n = window + context
        q = torch.randn(batch, 1, heads, head_dim, device="cuda", generator=g).bfloat16()
        kv = torch.randn(batch, n, head_dim, device="cuda", generator=g).bfloat16()
        win = torch.arange(window, device="cuda").expand(batch, 1, window)
        cmp = torch.rand(batch, 1, context, device="cuda", generator=g).argsort(-1)[..., :topk]
        idx = torch.cat([win, window + cmp.sort(-1).values], -1).to(torch.int32).contiguous()
        sink = torch.randn(heads, device="cuda", generator=g)
        out.append((q, kv, sink, idx))
    return out


def bench_sparse_attn(batches=(1, 8, 64, 256)) -> list[dict]:
    from .ops.sparse_attn.reference import sparse_attn as reference
    from .ops.sparse_attn.triton import sparse_attn as triton_kernel

    copy_bw = measure_copy_bandwidth()
    rows = []
    for b in batches:
        cases = sparse_attn_case(b)
        q0, kv0, sink0, idx0 = cases[0]
        scale = q0.shape[-1] ** -0.5
        ref = reference(q0, kv0, sink0, idx0, scale)
        got = triton_kernel(q0, kv0, sink0, idx0, scale)
        err = float((got.double() - ref.double()).norm() / ref.double().norm())
        heads, d, w = q0.shape[2], q0.shape[3], idx0.shape[-1]
        flops = 4 * b * heads * d * w
        nbytes = b * (w * d * 2 + heads * d * 2 * 2 + w * 4)  # rows, q in + o out, indices
        floor_ms = max(flops / BF16_FLOPS, nbytes / copy_bw) * 1e3
        k = [0]

        def run(fn):
            def call():
                qq, kk, ss, ii = cases[k[0] % len(cases)]
                k[0] += 1
                fn(qq, kk, ss, ii, scale)
            return call

        t_triton = _time_ms(run(triton_kernel))
        t_ref = _time_ms(run(reference), reps=5)
        rows.append({
            "op": "sparse_attn decode", "batch": b, "rows_per_query": w, "rel_err": err,
            "triton_ms": t_triton, "reference_ms": t_ref, "floor_ms": floor_ms,
            "ratio": t_triton / floor_ms, "GB/s": nbytes / (t_triton * 1e-3) / 1e9,
            "copy_GB/s": copy_bw / 1e9, "TFLOP/s": flops / (t_triton * 1e-3) / 1e12,
            "speedup_vs_reference": t_ref / t_triton,
        })
    return rows


def main(args) -> int:
    if not torch.cuda.is_available():
        raise SystemExit("bench needs a CUDA GPU")
    import triton

    rows = bench_sparse_attn()
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    if args.csv:
        with open(args.csv, "w") as f:
            f.write(buf.getvalue())
    print(f"{'op':<20}{'batch':>6}{'triton ms':>11}{'ref ms':>10}{'floor ms':>10}{'ratio':>7}"
          f"{'GB/s':>8}{'copy%':>7}{'speedup':>9}{'rel err':>9}")
    for r in rows:
        print(f"{r['op']:<20}{r['batch']:>6}{r['triton_ms']:>11.4f}{r['reference_ms']:>10.2f}"
              f"{r['floor_ms']:>10.4f}{r['ratio']:>7.2f}{r['GB/s']:>8.0f}"
              f"{100 * r['GB/s'] / r['copy_GB/s']:>6.0f}%{r['speedup_vs_reference']:>9.0f}"
              f"{r['rel_err']:>9.1e}")
    return 0
