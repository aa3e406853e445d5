"""``python -m dsv41attn bench``: GPU timings against a floor of FLOPs and bytes moved.

Three parts:
- ``layers``: one V4.1-Flash attention layer per role (SWA, Full r=2, Full r=1 candidate
  source, Reindex, Reuse) with random weights, decode at batch x context and prefill from
  position 0. Caches are filled with random packed context; only the role's layer is timed
  (its source layers run untimed before it in the same step, as in the model).
- ``sparse_attn``: the sparse-attention kernel alone (decode, V4.1-Flash heads, 640 rows).
- ``indexer``: the lightning indexer alone (decode: scoring, candidate blocks, top-k).
- ``gemm``: each fp8 linear of a layer alone (act_quant + the blockwise GEMM, as the layer
  calls it) at decode and prefill row counts, against its weight bytes and FLOPs.

Floor = max(FLOPs / 790 TFLOP/s, bytes / copy bandwidth measured in the same run), counted
so: weights once as stored, activations in and out, attention rows once per query
(window 528 B, compressed 288 B), index keys once per sequence (68 B per scored row),
projections 2 x tokens x params, attention 4 x heads x 512 per (query, row), indexer
2 x 32 x 128 per (query, scored row). Times are medians of CUDA-event-timed calls.
"""
from __future__ import annotations

import csv
import statistics
import time

import torch

from .checkpoint import expected_tensors, random_layer_weights
from .config import AttentionConfig, preset
from .ops.common.packing import (compressed_row_bytes, index_key_bytes, pack_compressed_rows,
                                 pack_index_keys, pack_window_rows, window_row_bytes)
from .plan import UndoLog
from .stack import AttentionStack
from .tp import shard_layer_weights, shard_slices, tp_shape
from .tuning import tuned

BF16_FLOPS = 790e12
ROLES = {"SWA": 0, "Full r=2": 2, "Full r=1 cand": 20, "Reindex": 24, "Reuse": 21}
DECODE = [(1, 4096), (8, 4096), (64, 4096), (256, 4096), (1, 65536), (8, 65536),
          (64, 65536), (256, 65536), (1, 1 << 20)]
PREFILL = [8192, 65536]


def _events_ms(fn, reps: int, calls: int = 1) -> float:
    """ms per call of ``fn``: the median of ``reps`` samples, each ``calls`` calls back to back
    between two CUDA events (calls > 1: the host queues calls ahead of the GPU, as a serving
    loop does, and no call waits for its own launch)."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def _queued_ms(fn, reps: int, rounds: int = 5) -> float:
    """ms per call of ``fn`` called ``reps`` times back to back, median over ``rounds`` such
    runs (``_events_ms`` with ``calls=reps``)."""
    return _events_ms(fn, rounds, calls=reps)


_SPIN_CYCLES_PER_MS: list[float] = []  # torch.cuda._sleep's rate, measured once


def _spin_cycles_per_ms() -> float:
    if not _SPIN_CYCLES_PER_MS:
        cycles = 20_000_000
        torch.cuda._sleep(cycles // 10)  # warm-up
        _SPIN_CYCLES_PER_MS.append(cycles / _events_ms(lambda: torch.cuda._sleep(cycles), 3))
    return _SPIN_CYCLES_PER_MS[0]


def _held_ms(fn, hold_ms: float) -> tuple[float, bool]:
    """(ms, ahead) of one call of ``fn`` whose launches the host queues while a spin kernel
    holds the GPU for ``hold_ms``: the time from the GPU reaching the call to its end, so the
    host's own time (before the first launch and between launches) hides behind the hold as
    it hides behind a model's previous layer, and what is timed is the GPU's work and the
    gaps its dependencies make. ahead: the host had queued the whole call before the hold
    ended (else the host's time leaked into ms: hold longer)."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(int(hold_ms * _spin_cycles_per_ms()))
    start.record()
    fn()
    ahead = not start.query()  # the start event not reached yet: the GPU still held
    end.record()
    end.synchronize()
    return start.elapsed_time(end), ahead


def _graph_ms(fn, calls: int = 1, reps: int = 20, queued: bool = False) -> float:
    """ms per call of ``fn`` (which makes ``calls`` calls) captured in a CUDA graph: median of
    ``reps`` timed replays (queued: ``_queued_ms`` of them), after a warm-up run on a side
    stream and an upload replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    return (_queued_ms if queued else _events_ms)(graph.replay, reps) / calls


def measure_copy_bandwidth(nbytes: int = 2 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    return 2 * nbytes / (_events_ms(lambda: dst.copy_(src), 20) * 1e-3)


def _weight_bytes_and_params(cfg: AttentionConfig, layer: int,
                             world: int = 1) -> tuple[int, int]:
    """(bytes read, matrix elements of the projections) of one layer on one rank of ``world``
    (its slices of the head-sharded tensors, ``tp.shard_slices``; the rest whole): weights as
    stored, except the gated compressor's, which run (and are read) in fp32 as the reference
    holds them (the floor counts them so)."""
    size = {torch.float8_e4m3fn: 1, torch.float8_e8m0fnu: 1, torch.bfloat16: 2, torch.float32: 4}
    gated = cfg.layer(layer).has_gate
    cut = shard_slices(tp_shape(cfg, 0, world)) if world > 1 else {}
    nbytes = params = 0
    for name, (dtype, shape) in expected_tensors(cfg, layer).items():
        held = [len(range(*sl.indices(d))) for d, sl in zip(shape, cut.get(name, ()))]
        n = 1
        for d in held + list(shape[len(held):]):
            n *= d
        fp32 = gated and name.startswith(("compressor.wkv", "compressor.wgate"))
        nbytes += n * (4 if fp32 else size[dtype])
        if name.endswith(".weight") and len(shape) == 2:
            params += n
    return nbytes, params


def _index_pairs(cfg: AttentionConfig, layer: int, start: int, end: int) -> tuple[int, int]:
    """An index source's (rows scored per sequence, (query, scored row) pairs of one sequence)
    for tokens at positions start .. end - 1; (0, 0) for other layers."""
    spec = cfg.layer(layer)
    if not spec.is_index_source:
        return 0, 0
    n_rows = end // spec.ratio
    scored = n_rows
    if spec.is_candidate_consumer:
        scored = min(n_rows, cfg.candidate_topk_blocks * cfg.candidate_block_size)
    return scored, sum(min((p + 1) // spec.ratio, scored) for p in range(start, end))


def allreduce_bytes(cfg: AttentionConfig, layer: int, batch: int, start: int,
                    tokens: int) -> int:
    """Bytes a tensor-parallel layer call must all-reduce (docs/numerics.md §10): wo_b's fp32
    partial output, and for an index source the bf16 index scores of every (query, scored
    row) pair. (The layer reduces each query's whole row of scores, width the rows scored, so
    a prefill moves about twice the pairs: the floor counts what the design needs.)"""
    _, pairs = _index_pairs(cfg, layer, start, start + tokens)
    return batch * tokens * cfg.dim * 4 + batch * pairs * 2


def layer_floor(cfg: AttentionConfig, layer: int, batch: int, start: int, tokens: int,
                copy_bw: float, world: int = 1,
                allreduce_bw: float | None = None) -> tuple[float, float, float]:
    """(FLOPs, bytes, floor seconds) of one layer call: ``tokens`` per sequence from ``start``.
    ``world`` > 1: one rank's share under tensor parallelism (its weight slices, heads and
    index heads; every cache row and index key read whole, as each rank holds them all), and
    the floor adds ``allreduce_bytes`` at ``allreduce_bw`` bytes/s (measured: the collectives
    sit between the layer's steps, nothing to overlap them with)."""
    spec = cfg.layer(layer)
    if world > 1 and not allreduce_bw:
        raise ValueError(f"a per-rank floor (world={world}) needs the measured all-reduce "
                         f"bandwidth, got allreduce_bw={allreduce_bw!r}")
    wbytes, params = _weight_bytes_and_params(cfg, layer, world)
    heads, index_heads = cfg.n_heads // world, cfg.index_n_heads // world
    q = batch * tokens
    flops = 2.0 * q * params
    nbytes = wbytes + 2 * q * cfg.dim * 2
    end = start + tokens
    # attention rows per query: window + selected compressed rows
    win_rows = sum(min(p + 1, cfg.window_size) for p in range(start, end))
    cmp_rows = sum(min(cfg.index_topk, (p + 1) // spec.ratio) for p in range(start, end)) \
        if spec.ratio else 0
    nbytes += batch * (win_rows * window_row_bytes(cfg.head_dim) + cmp_rows * compressed_row_bytes(cfg.head_dim))
    flops += 4.0 * batch * heads * cfg.head_dim * (win_rows + cmp_rows)
    scored, pairs = _index_pairs(cfg, layer, start, end)
    nbytes += batch * scored * index_key_bytes(cfg.index_head_dim)
    flops += 2.0 * batch * index_heads * cfg.index_head_dim * pairs
    floor = max(flops / BF16_FLOPS, nbytes / copy_bw)
    if world > 1:
        floor += allreduce_bytes(cfg, layer, batch, start, tokens) / allreduce_bw
    return flops, nbytes, floor


def measure_allreduce_bandwidth(group, nbytes: int = 256 << 20, device="cuda",
                                reps: int = 10) -> float:
    """Bytes per second of an fp32 SUM all-reduce of ``nbytes`` over ``group`` (None: the
    default group): the buffer's bytes over the time, the median of ``reps`` after a warm-up,
    the slowest rank's (every rank returns the same figure)."""
    import torch.distributed as dist

    def sync():
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()

    buf = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
    dist.all_reduce(buf, group=group)
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        dist.all_reduce(buf, group=group)
        sync()
        times.append(time.perf_counter() - t0)
    slowest = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return nbytes / slowest.item()


def fill_context(state, ctx: int, seed: int = 0) -> None:
    """Every sequence at position ``ctx`` with random (valid, packed) rings, compressed rows,
    index keys and open groups."""
    cfg, dev = state.config, state.device
    g = torch.Generator(device=dev).manual_seed(seed)
    rows = list(range(state.batch_size))
    state.reserve(rows, [ctx] * len(rows))
    for row in rows:  # the host mirror of the positions set below
        state.advance(row, state.layers, ctx)
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

    def __init__(self, cfg: AttentionConfig, role: str, backend: str, weights: dict,
                 tp_group=None, batch_invariant: bool = False):
        self.cfg, self.target, self.layers = cfg, ROLES[role], role_layers(cfg, role)
        self.stack = AttentionStack(cfg, {L: weights[L] for L in self.layers}, backend,
                                    tp_group=tp_group, batch_invariant=batch_invariant)

    def _decode_state(self, batch: int, ctx: int, steps: int):
        """Sequences at position ``ctx`` (at most max_seq_len - steps: room for the steps)."""
        ctx = min(ctx, self.cfg.max_seq_len - steps)
        state = self.stack.new_state(batch, capacity=ctx + steps, rollback=0,
                                     max_tokens_per_call=1)
        fill_context(state, ctx)
        g = torch.Generator(device="cuda").manual_seed(1)
        xs = [{L: torch.randn(batch, self.cfg.dim, device="cuda", generator=g).bfloat16()
               for L in self.layers} for _ in range(3)]
        return state, xs

    def decode_graph_us(self, batch: int, ctx: int, reps: int,
                        queued: bool = True) -> tuple[float, float]:
        """(layer, step facts) in us: CUDA-graph replays of a decode step (DecodePlan.capture)
        of the role's layer and its sources, minus a graph of the sources alone (same state,
        next plan); and a graph of the step's shared facts alone (``DecodePlan.derive_facts``:
        once per step, whatever the layer count), which a role without sources subtracts
        instead. queued (the default): ``_queued_ms`` of the graph launches, steps back to back
        as a serving loop runs them (the host's bookkeeping of those steps follows the timed
        launches: the graph itself advances the device's positions); else the median of
        ``reps`` replays timed one by one from an idle GPU, each with its input copy and its
        launch latency (the tables before the eleventh session)."""
        rounds = 5 if queued else 1
        state, xs = self._decode_state(batch, ctx, 2 * (rounds * reps + 3))
        # the facts first: after the sources-only graph the sources are ahead of the target
        # layer, and a plan of every layer is refused mid-step
        facts = _graph_ms(self.stack.plan_decode(state, steps=1, layers=self.layers).derive_facts,
                          reps=reps, queued=queued)
        times = {}
        sources = [L for L in self.layers if L != self.target]
        for name, layers in (("all", self.layers), ("sources", sources)):
            if not layers:
                continue
            plan = self.stack.plan_decode(state, steps=rounds * reps + 3, layers=layers)
            graph = plan.capture(xs[0])
            graph.replay(xs[1])  # first replay uploads the graph
            if queued:
                times[name] = _queued_ms(graph.graph.replay, reps, rounds)
                for _ in range(rounds * reps):
                    plan._advance()  # the steps just run, in the host's books
            else:
                inputs = iter(xs * reps)
                times[name] = _events_ms(lambda g=graph, it=inputs: g.replay(next(it)), reps)
        return (times["all"] - times.get("sources", facts)) * 1e3, facts * 1e3

    def decode_eager_us(self, batch: int, ctx: int, reps: int, compile_target: bool = False) -> float:
        """Median over steps of the role's layer alone, run eagerly (host launches included)
        through a DecodePlan; ``compile_target``: the layer's decode under torch.compile."""
        state, xs = self._decode_state(batch, ctx, reps + 2)
        plan = self.stack.plan_decode(state, steps=reps + 2)
        layer = self.stack.layers[self.target]
        runners = {self.target: torch.compile(layer.run)} if compile_target else None
        times = []
        for k in range(reps + 2):
            steps = plan.iter_run(xs[k % len(xs)], runners)
            for L in plan.layers:
                if L == self.target:
                    times.append(_events_ms(lambda: next(steps), 1))
                else:
                    next(steps)
            next(steps, None)  # the step counts once every layer ran
        return statistics.median(times[2:]) * 1e3  # the first two calls warm up (and compile)

    def _prefill(self, tokens: int, measure):
        """One prefill of ``tokens`` random tokens from position 0 on a new state, through the
        role's sources, then its layer under ``measure`` (given the call; its result is
        returned)."""
        state = self.stack.new_state(1, capacity=tokens, rollback=0)
        g = torch.Generator(device="cuda").manual_seed(2)
        x = torch.randn(1, tokens, self.cfg.dim, device="cuda", generator=g).bfloat16()
        step = self.stack.step(state, tokens)
        for L in self.layers:
            call = lambda f=self.stack.layers[L]: f(x, state, step)
            if L == self.target:
                return measure(call)
            call()

    def decode_output(self, batch: int, ctx: int) -> torch.Tensor:
        """The role's layer's output [batch, dim] in one eager decode step from position ``ctx``
        (the state and input ``decode_graph_us`` starts from: the same for every call)."""
        state, xs = self._decode_state(batch, ctx, 1)
        return self.stack.plan_decode(state, steps=1, layers=self.layers).run(xs[0])[self.target]

    def prefill_output(self, tokens: int) -> torch.Tensor:
        """The role's layer's output [1, tokens, dim] in the prefill ``prefill_us`` times (the
        same input for every call)."""
        return self._prefill(tokens, lambda call: call())

    def prefill_us(self, tokens: int, reps: int, queued: bool = True,
                   hold_ms: float = 10.0) -> float:
        """Median of ``reps`` prefill calls of the layer after one that warms up (and
        compiles). queued (the default): each call's launches queued while the GPU is held
        (``_held_ms``; the hold doubles until the host is ahead), as a model's layers follow
        one another; else from an idle GPU, the host's time to each launch included (the
        tables before the twenty-fifth session)."""
        self.prefill_output(tokens)  # the warm-up
        times = []
        for _ in range(reps):
            if not queued:
                times.append(self._prefill(tokens, lambda call: _events_ms(call, 1)))
                continue
            while True:
                ms, ahead = self._prefill(tokens, lambda call: _held_ms(call, hold_ms))
                if ahead:
                    break
                if hold_ms > 2000:  # no time of the GPU's alone to report
                    raise RuntimeError(f"the host did not queue the layer call within a "
                                       f"{hold_ms:.0f} ms hold of the GPU: does it synchronise?")
                hold_ms *= 2
            times.append(ms)
        return statistics.median(times) * 1e3

    def profile_decode(self, batch: int, ctx: int) -> tuple[list[tuple[str, float, int]],
                                                             list[tuple[str, float, int]]]:
        """Per-kernel GPU time in one eager decode step: (name, us, calls) for every kernel and
        copy, longest first (calls summed: the launches a CUDA graph holds, run as a graph runs
        them, without the undo log's saves), of (the role's layer, the step's shared facts). A
        layer that is the step's first includes the facts (``DecodePlan.derive_facts`` runs
        before it), so those are subtracted."""
        state, xs = self._decode_state(batch, ctx, 4)
        plan = self.stack.plan_decode(state, steps=3)
        plan.run(xs[0])
        facts = _kernel_times(plan.derive_facts)
        # the launches a captured graph holds: no undo log (this state is thrown away after)
        steps = plan._launch(plan._inputs(xs[1]), UndoLog(enabled=False))
        first = plan.layers.index(self.target) == 0
        for L in plan.layers[:plan.layers.index(self.target)]:  # sources run outside the profile
            next(steps)
        layer = _kernel_times(lambda: next(steps))
        steps.close()
        if first:
            for name, (us, n) in facts.items():
                us0, n0 = layer.get(name, (0.0, 0))
                if n0 > n:
                    layer[name] = (max(us0 - us, 0.0), n0 - n)
                else:
                    layer.pop(name, None)
        return _longest_first(layer), _longest_first(facts)

    def timeline_decode(self, batch: int, ctx: int) -> list[dict]:
        """The GPU's activity in one replay of a captured decode step of the role's layers (the
        step's shared facts first, then the sources, then the role's layer), as
        ``timeline_rows`` gives it: which kernel ran when, how long, on which stream (the
        branch streams beside the query path show as their own lanes). The replay is the
        fourth of the graph, so its uploads and first-touch costs are behind it, and it reuses
        the static inputs (no input copy ahead of the graph's first kernel)."""
        import json
        import tempfile

        from torch.profiler import ProfilerActivity, profile
        state, xs = self._decode_state(batch, ctx, 8)
        plan = self.stack.plan_decode(state, steps=6, layers=self.layers)
        graph = plan.capture(xs[0])
        for i in range(3):
            graph.replay(xs[1 + i % 2])
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graph.replay()  # the static inputs as the last replay left them: no input copy
            torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as d:
            path = f"{d}/trace.json"
            prof.export_chrome_trace(path)
            with open(path) as f:
                return timeline_rows(json.load(f)["traceEvents"])

    def profile_prefill(self, tokens: int) -> list[tuple[str, float, int]]:
        """Per-kernel GPU time of the role's layer in one eager prefill of ``tokens`` tokens
        from position 0 (the call ``prefill_us`` times, after one untimed call compiled it):
        (name, us, calls), longest first. The sources run before it and the step's shared facts
        are derived when the step opens, both outside the profile."""
        self._prefill(tokens, lambda call: call())
        return _longest_first(self._prefill(tokens, _kernel_times))


def _kernel_times(fn) -> dict[str, tuple[float, int]]:
    """name -> (us, calls) of every kernel and copy ``fn`` runs on the GPU (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total if hasattr(e, "device_time_total")
             else e.cuda_time_total, e.count) for e in prof.key_averages()]
    return {name: (us, n) for name, us, n in rows if us > 0}


def timeline_rows(events: list[dict]) -> list[dict]:
    """The GPU's work in a chrome trace's events (the torch profiler's ``export_chrome_trace``):
    every kernel, copy and memset in order of start, as {"start_us": from the first one's
    start, "us": its length, "lane": its stream, numbered 0, 1, .. in order of first use,
    "idle_us": how long its lane sat idle before it, since the lane's previous launch ended
    (None for a lane's first): a launch that waited there, for another lane's work or for
    SMs that other lanes held, "name"}."""
    acts = sorted((e for e in events
                   if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e),
                  key=lambda e: e["ts"])
    lanes: dict = {}
    ends: dict = {}  # lane -> where its last launch so far ended
    t0 = acts[0]["ts"] if acts else 0.0
    rows = []
    for e in acts:
        lane = lanes.setdefault(e.get("tid"), len(lanes))
        start, us = float(e["ts"] - t0), float(e["dur"])
        rows.append({"start_us": start, "us": us, "lane": lane,
                     "idle_us": None if lane not in ends else max(0.0, start - ends[lane]),
                     "name": e["name"]})
        ends[lane] = max(ends.get(lane, start + us), start + us)
    return rows


def _print_timeline(rows: list[dict]) -> None:
    """One case of ``bench --timeline``: the replay's span, the kernels' summed time, each
    lane's launches, busy time and extent, then every launch (start, length, lane, its lane's
    idle time before it, name)."""
    if not rows:
        print("  no GPU activity recorded")
        return
    span = max(r["start_us"] + r["us"] for r in rows)
    lanes = sorted({r["lane"] for r in rows})
    print(f"  {len(rows)} launches on {len(lanes)} stream(s), {span:.1f} us from the first start "
          f"to the last end, {sum(r['us'] for r in rows):.1f} us of GPU time in all")
    for lane in lanes:
        mine = [r for r in rows if r["lane"] == lane]
        print(f"  lane {lane}: {len(mine)} launches, {sum(r['us'] for r in mine):.1f} us busy, "
              f"from {mine[0]['start_us']:.1f} to "
              f"{max(r['start_us'] + r['us'] for r in mine):.1f}")
    print(f"  {'start':>8} {'us':>7} {'lane':>4} {'idle':>6}  kernel")
    for r in rows:
        idle = "-" if r["idle_us"] is None else f"{r['idle_us']:.1f}"
        print(f"  {r['start_us']:>8.1f} {r['us']:>7.1f} {r['lane']:>4} {idle:>6}  "
              f"{r['name'][:80]}")


def _longest_first(table: dict[str, tuple[float, int]]) -> list[tuple[str, float, int]]:
    return sorted(((k, us, n) for k, (us, n) in table.items()), key=lambda r: -r[1])


def _weights(cfg: AttentionConfig, layers, tp=None) -> dict:
    """Random weights of ``layers`` on the GPU; under ``--tp`` (tp: the CLI's ranks) this
    rank's shards of them."""
    return {L: shard_layer_weights(cfg, random_layer_weights(cfg, L, seed=L),
                                   0 if tp is None else tp.rank,
                                   1 if tp is None else tp.world).to("cuda") for L in layers}


def _differing(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements of ``a`` and ``b`` (same shape and dtype) whose bits differ."""
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return int((a.view(bits) != b.view(bits)).sum())


def _rate(case: list[dict], floor: float, nbytes: float, copy_bw: float,
          flops: float | None = None, key: str = "us") -> None:
    """A part's rows of one case (a row per variant, its time in us under ``key``): the floor
    (seconds) and each row's ratio to it, bandwidth, share of copy_bw, TFLOP/s (given flops)
    and time against the first variant's."""
    for row in case:
        us = row[key]
        row.update({"floor_us": floor * 1e6, "ratio": us * 1e-6 / floor,
                    "GB/s": nbytes / (us * 1e-6) / 1e9,
                    "copy%": 100 * nbytes / (us * 1e-6) / copy_bw,
                    "vs_first%": 100 * (us / case[0][key] - 1)})
        if flops is not None:
            row["TFLOP/s"] = flops / (us * 1e-6) / 1e12


def _failed(row: dict, e: Exception) -> None:
    """A variant's case that raised: no time, its reason kept (the GPU's queue drained)."""
    row["us"] = float("nan")
    row.setdefault("failed", []).append(f"{type(e).__name__}: {e}"[:300])
    torch.cuda.synchronize()


def _diff_outputs(case: list[dict], variants, output) -> None:
    """Each later variant's ``diff``: the elements of its output (``output(i)`` for variant i,
    run under its settings) whose bits differ from the first variant's; an output that raises
    is reported in its row's ``failed``."""
    outputs = []
    for i, (row, (_, settings)) in enumerate(zip(case, variants)):
        try:
            with tuned(settings):
                outputs.append(output(i))
        except Exception as e:  # noqa: BLE001 - reported with the row
            outputs.append(None)
            row.setdefault("failed", []).append(f"output: {type(e).__name__}: {e}"[:300])
    for row, out in zip(case[1:], outputs[1:]):
        if out is not None and outputs[0] is not None:
            row["diff"] = _differing(out, outputs[0])


def _timed(row: dict, key: str, fn, fn_args, log, label: str, keep_min: bool = False) -> None:
    """row[key] = fn(*fn_args) in us (a decode's (layer, facts) pair also sets the facts'
    key); nan where it failed (the reason in row["failed"] unless out of memory, and logged).
    keep_min: the lesser of this time and one already there (rounds of a variant)."""
    t0 = time.time()
    try:
        value = fn(*fn_args)
        if isinstance(value, tuple):  # decode: (the layer, the step's shared facts)
            value, facts = value
            row[key[:-3] + "_facts_us"] = min(facts, row.get(key[:-3] + "_facts_us", facts)) \
                if keep_min else facts
    except torch.cuda.OutOfMemoryError:
        value = float("nan")
    except Exception as e:  # noqa: BLE001 - reported, the other cases still run
        value = float("nan")
        msg = f"{type(e).__name__}: {e}"
        row.setdefault("failed", []).append(f"{key}: {msg[:200]}")
        log(f"  {label} {key}: failed: {msg[:200]} ... {msg[-600:]}")
    torch.cuda.empty_cache()
    if keep_min and key in row and row[key] == row[key]:  # a number (not nan) there already
        value = row[key] if value != value else min(value, row[key])
    row[key] = value
    log(f"  {label} {key}: {value:.1f} us ({time.time() - t0:.1f} s)")


def bench_layers(decode=DECODE, prefill=PREFILL, roles=tuple(ROLES),
                 reference_cases=((1, 4096), (64, 4096)), compile_cases=(), log=print, tp=None,
                 invariant: bool = False, queued: bool = True,
                 variants=(("default", ()),), rounds: int = 1):
    """Rows of the per-role table: triton under CUDA-graph replay (the serving path), and for
    ``reference_cases`` the reference path eager and the triton path eager (host launches
    included); ``compile_cases``: the reference path under torch.compile as well;
    ``invariant``: every case also in the batch-invariant mode (``invariant_us``); ``queued``:
    decode graphs timed back to back and prefill calls queued behind a hold of the GPU (else
    both from an idle GPU, see ``RoleBench.decode_graph_us`` and ``prefill_us``). ``tp``: the
    ranks of ``--tp`` (every rank runs the same cases on its shard; the floor is one rank's,
    ``layer_floor`` with the all-reduce bandwidth measured here over the ranks).

    ``variants``: (name, settings) pairs (``tuning.parse_variant``), a row per case and
    variant, each variant's layer built and run under its settings (``tuning.tuned``). Their
    triton times alternate over ``rounds`` rounds (the least kept), so drift on the GPU falls
    on all alike; every other time is the first variant's only. Each later variant's row also
    counts the output elements (``diff``) that differ from the first's on the same state and
    input: a setting that changes an order of summation shows there."""
    cfg = preset("v41-flash")
    copy_bw = measure_copy_bandwidth()
    world = 1 if tp is None else tp.world
    allreduce_bw = measure_allreduce_bandwidth(tp.group) if world > 1 else None
    layers = sorted({L for r in roles for L in role_layers(cfg, r)})
    weights = _weights(cfg, layers, tp)
    group = None if tp is None else tp.group
    compare = len(variants) > 1
    rows = []
    for role in roles:
        tris = []
        for _, settings in variants:
            with tuned(settings):
                tris.append(RoleBench(cfg, role, "triton", weights, group))
        tri = tris[0]
        ref = RoleBench(cfg, role, "reference", weights, group)
        inv = RoleBench(cfg, role, "triton", weights, group, batch_invariant=True) \
            if invariant else None
        cases = [("decode", b, c) for b, c in decode] + [("prefill", 1, t) for t in prefill]
        for kind, batch, n in cases:
            start, tokens = (n, 1) if kind == "decode" else (0, n)
            flops, nbytes, floor = layer_floor(cfg, ROLES[role], batch, start, tokens, copy_bw,
                                               world, allreduce_bw)
            base = {"role": role, "kind": kind, "batch": batch, "context": n,
                    "floor_us": floor * 1e6, "flops": flops, "bytes": nbytes, "tp": world}
            if world > 1:
                base["allreduce_bytes"] = allreduce_bytes(cfg, ROLES[role], batch, start, tokens)
                base["allreduce_GB/s"] = allreduce_bw / 1e9
            case_rows = [dict(base, variant=name) for name, _ in variants]
            label = f"{role} {kind} b={batch} n={n}"
            for _ in range(rounds):
                for row, bench, (name, settings) in zip(case_rows, tris, variants):
                    fn = (bench.decode_graph_us, (batch, n, 20, queued)) if kind == "decode" \
                        else (bench.prefill_us, (n, 2, queued))
                    with tuned(settings):
                        _timed(row, "triton_us", *fn, log,
                               label + (f" [{name}]" if compare else ""), keep_min=True)
            if compare:
                _diff_outputs(case_rows, variants,
                              lambda i: tris[i].decode_output(batch, n) if kind == "decode"
                              else tris[i].prefill_output(n))
                torch.cuda.empty_cache()
            row = case_rows[0]
            runs = []
            if inv is not None:
                runs += [("invariant_us", (inv.decode_graph_us, (batch, n, 20, queued))
                          if kind == "decode" else (inv.prefill_us, (n, 2, queued)))]
            if kind == "decode" and (batch, n) in reference_cases:
                runs += [("triton_eager_us", (tri.decode_eager_us, (batch, n, 5))),
                         ("reference_us", (ref.decode_eager_us, (batch, n, 3)))]
            if kind == "decode" and (batch, n) in compile_cases:
                runs += [("compiled_us", (ref.decode_eager_us, (batch, n, 3, True)))]
            with tuned(variants[0][1]):
                for key, (fn, fn_args) in runs:
                    _timed(row, key, fn, fn_args, log, label)
            _rate(case_rows, floor, nbytes, copy_bw, flops, key="triton_us")
            for row in case_rows:
                us = row["triton_us"]
                for key in ("reference_us", "compiled_us"):
                    if key in row:
                        row["speedup_" + key[:-3]] = row[key] / us
                if "invariant_us" in row:
                    row["invariant_cost%"] = 100 * (row["invariant_us"] / us - 1)
            rows += case_rows
    return rows, copy_bw


def decode_attn_case(batch: int, heads: int, head_dim: int, window: int, topk: int,
                     context: int, device="cuda", generator=None, page_rows: int = 256) -> tuple:
    """``sparse_attn_paged``'s arguments for one decode step of ``batch`` sequences at
    ``context``: each query's window is the ring's newest ``window - 1`` rows and the step's
    own row, then ``topk`` random compressed rows of the sequence's ``context`` (ascending),
    in a paged pool whose pages are shuffled over the sequences."""
    g = generator
    pages = batch * context // page_rows
    q = torch.randn(batch, heads, head_dim, device=device, generator=g).bfloat16()
    # the ring holds the window before the step; the newest row is the step's own
    ring = pack_window_rows(torch.randn(batch, window, head_dim, device=device,
                                        generator=g).bfloat16())
    new_rows = pack_window_rows(torch.randn(batch, head_dim, device=device, generator=g).bfloat16())
    pool = pack_compressed_rows(torch.randn(pages, page_rows, head_dim, device=device,
                                            generator=g).bfloat16())
    table = torch.randperm(pages, device=device, generator=g).view(batch, -1)
    seq = torch.arange(batch, device=device)
    widx = torch.cat([seq[:, None] * window + torch.arange(1, window, device=device),
                      batch * window + seq[:, None]], 1).to(torch.int32)  # [batch, W]
    cidx = torch.rand(batch, context, device=device, generator=g).argsort(-1)[..., :topk]
    cidx = cidx.sort(-1).values.to(torch.int32).contiguous()
    sink = torch.randn(heads, device=device, generator=g)
    return q, sink, head_dim ** -0.5, ring, new_rows, widx, pool, table, seq, cidx


def _attn_rounds(case: list[dict], variants, rounds: int, sets: list[tuple], ref,
                 reps: int = 20, launch: bool = False) -> None:
    """The attention parts' timing of one case (``case``: a row per variant of ``variants``):
    the triton backend's sparse_attn_paged in the default mode (splits sized to the step) and
    the batch-invariant one, each in a CUDA graph over the argument ``sets`` (rotated, so
    rows are not served from L2; median of ``reps`` replays), the variants alternating over
    ``rounds`` rounds (the least kept, as ``us`` and ``invariant_us``). In the first round,
    each row's output on ``sets[0]``: its ``rel_err`` to ``ref`` (float64; None: not
    compared), a later variant's ``diff`` (its elements whose bits differ from the first's)
    and, with ``launch``, one eager launch's time; a variant that raises gets its reason in
    ``failed``."""
    from .ops.backends import get_ops

    kernel = get_ops("triton").sparse_attn_paged
    invariant = get_ops("triton", batch_invariant=True).sparse_attn_paged
    for row in case:
        row.update(us=float("inf"), invariant_us=float("inf"))
    first = None
    for rnd in range(rounds):
        for row, (_, settings) in zip(case, variants):
            try:
                with tuned(settings):
                    if rnd == 0:  # the output, its error (and one eager launch)
                        out = kernel(*sets[0])
                        if ref is not None:
                            row["rel_err"] = float((out.double() - ref).norm() / ref.norm())
                        if first is None:
                            first = out
                        else:
                            row["diff"] = _differing(out, first)
                        del out
                        if launch:
                            row["launch_us"] = _events_ms(lambda: kernel(*sets[0]), 20) * 1e3
                    for key, f in (("us", kernel), ("invariant_us", invariant)):
                        ms = _graph_ms(lambda f=f: [f(*args) for args in sets], len(sets),
                                       reps=reps)
                        row[key] = min(row[key], ms * 1e3)
            except Exception as e:  # noqa: BLE001 - reported, the other variants run
                _failed(row, e)


def bench_sparse_attn(copy_bw: float, batches=(1, 8, 64, 256), window: int = 128,
                      topk: int = 512, context: int = 8192, variants=(("default", ()),),
                      rounds: int = 1) -> list[dict]:
    """The triton backend's sparse-attention op alone at decode (on a Hopper GPU its Gluon
    kernel, ``ops/sparse_attn/paged.py``): V4.1-Flash heads, 128 window rows (fp8, 528 B)
    + 512 compressed rows (fp4, 288 B) per query, read from the packed ring and paged pool
    (``decode_attn_case``). ``variants`` and ``rounds`` as in ``bench_gemm``: a row per batch
    and variant, its times (graph, invariant mode, one eager launch) and error under its
    settings, the graphs alternating over the rounds; a later variant's ``diff`` counts the
    output elements whose bits differ from the first's."""
    from .ops.sparse_attn.reference import sparse_attn_paged as reference

    cfg = preset("v41-flash")
    h, d = cfg.n_heads, cfg.head_dim
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for b in batches:
        # three input sets, rotated so rows are not served from L2
        sets = [decode_attn_case(b, h, d, window, topk, context, generator=g) for _ in range(3)]
        ref = reference(*sets[0])
        nbytes = b * (window * window_row_bytes(cfg.head_dim) + topk * compressed_row_bytes(cfg.head_dim)
                      + 2 * h * d * 2 + (window + topk) * 4)
        flops = 4.0 * b * h * d * (window + topk)
        floor = max(flops / BF16_FLOPS, nbytes / copy_bw)
        case = [{"batch": b, "variant": v} for v, _ in variants]
        _attn_rounds(case, variants, rounds, sets, ref.double(), launch=True)
        _rate(case, floor, nbytes, copy_bw)
        rows += case
    return rows


# sparse_attn_paged's launch options (block_h, num_warps, d_chunks) timed against its defaults
ATTN_VARIANTS = {"default": {}, "block_h=32": {"block_h": 32},
                 "block_h=32, 4 warps": {"block_h": 32, "num_warps": 4},
                 "block_h=16": {"block_h": 16}, "block_h=16, 4 warps": {"block_h": 16, "num_warps": 4},
                 "16 warps": {"num_warps": 16}, "block_h=32, d_chunks=2": {"block_h": 32, "d_chunks": 2}}


def bench_attn_variants(batches=(1, 8, 64, 256), prefill: int = 8192, context: int = 8192,
                        variants=ATTN_VARIANTS) -> list[dict]:
    """The sparse-attention kernel in each launch variant of ``variants`` (keyword arguments
    of ``sparse_attn_paged``; the default mode: splits sized to the step): the decode cases of
    ``bench_sparse_attn`` (``decode_attn_case``, three input sets rotated) and one prefill of
    ``prefill`` tokens (``prefill_attn_case``, ratio 2), us in a CUDA graph, and how many
    output elements' bits differ from the default launch's (another head tile can change the
    MMA's form, so its sums)."""
    from .ops.sparse_attn.triton import sparse_attn_paged

    cfg = preset("v41-flash")
    h, d = cfg.n_heads, cfg.head_dim
    g = torch.Generator(device="cuda").manual_seed(0)
    cases = {f"b={b}": [decode_attn_case(b, h, d, cfg.window_size, cfg.index_topk, context,
                                         generator=g) for _ in range(3)] for b in batches}
    if prefill:
        cases[f"prefill {prefill}"] = [prefill_attn_case(prefill, h, d, cfg.window_size,
                                                         cfg.index_topk, 2, generator=g)[0]]
    rows, base = [], {}
    for name, kw in variants.items():
        def call(*args, kw=kw):
            return sparse_attn_paged(*args, split_blocks=0, **kw)
        for case, sets in cases.items():
            row = {"variant": name, "case": case}
            try:
                out = call(*sets[0])
                row["us"] = _graph_ms(lambda: [call(*a) for a in sets], len(sets),
                                      reps=10 if case.startswith("prefill") else 20) * 1e3
            except Exception as e:  # noqa: BLE001 - a variant that does not compile or fit
                row["us"], row["failed"] = float("nan"), f"{type(e).__name__}: {e}"[:200]
                rows.append(row)
                continue
            if not kw:
                base[case] = out
            row["differing"] = _differing(out, base[case]) if case in base else None
            rows.append(row)
        torch.cuda.empty_cache()
    return rows


ATTN_KERNELS = {  # sparse attention kernel and cut: (op, keyword arguments)
    "triton, 2-block splits": ("triton", {}),
    "triton, step-sized": ("triton", {"split_blocks": 0}),
    "triton, unsplit": ("triton", {"num_splits": 1}),
    "gluon, unsplit": ("gluon", {"num_splits": 1}),
    "gluon, 2-block splits": ("gluon", {}),
    "gluon, step-sized": ("gluon", {"split_blocks": 0}),
}


def bench_attn_kernels(batches=(1, 8, 64, 256), context: int = 4096,
                       kernels=ATTN_KERNELS) -> list[dict]:
    """The Triton sparse attention and the warp-specialized Gluon one
    (``gluon.sparse_attn_paged_ws``), each in the cuts of ``kernels``, on the decode cases of
    ``decode_attn_case`` at V4.1-Flash's heads: the window alone and the window plus
    ``index_topk`` compressed rows, at ``context``; us in a CUDA graph, and how many output
    elements' bits differ from the unsplit Triton kernel's (as every part's diff: a -0 for a
    +0 counts, a NaN where the first has the same NaN does not)."""
    from .ops.sparse_attn.gluon import sparse_attn_paged_ws
    from .ops.sparse_attn.triton import sparse_attn_paged

    ops = {"triton": sparse_attn_paged, "gluon": sparse_attn_paged_ws}
    cfg = preset("v41-flash")
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for topk in (0, cfg.index_topk):
        n = cfg.window_size + topk  # list entries a token
        for b in batches:
            args = decode_attn_case(b, cfg.n_heads, cfg.head_dim, cfg.window_size, topk,
                                    context, generator=g)
            base = sparse_attn_paged(*args, num_splits=1)
            for name, (op, kw) in kernels.items():
                row = {"kernel": name, "list": n, "batch": b, "case": f"{n} rows b={b}"}
                try:
                    out = ops[op](*args, **kw)
                    row["us"] = _graph_ms(lambda: ops[op](*args, **kw)) * 1e3
                    row["differing"] = _differing(out, base)
                except Exception as e:  # noqa: BLE001 - a kernel this GPU cannot run
                    row["us"], row["failed"] = float("nan"), f"{type(e).__name__}: {e}"[:200]
                rows.append(row)
            torch.cuda.empty_cache()
    return rows


def _print_attn_grid(rows: list[dict], key: str, width: int) -> None:
    """bench_attn_kernels' or bench_attn_variants' rows as a grid: a line per ``key`` (kernel
    or variant), a column per case, each cell the us and [the differing outputs] if any;
    then what failed."""
    cases = list(dict.fromkeys(r["case"] for r in rows))
    print(f"{key:<24}" + "".join(f"{c:>{width}}" for c in cases))
    for name in dict.fromkeys(r[key] for r in rows):
        cells = []
        for r in (r for r in rows if r[key] == name):
            diff = "" if r.get("differing") in (None, 0) else f" [{r['differing']}]"
            cells.append(f"{r['us']:.1f}{diff}" if "failed" not in r else "failed")
        print(f"{name:<24}" + "".join(f"{c:>{width}}" for c in cells))
    for r in rows:
        if "failed" in r:
            print(f"  {r[key]} {r['case']}: {r['failed']}")


def prefill_attn_case(tokens: int, heads: int, head_dim: int, window: int, topk: int,
                      ratio: int, device="cuda", generator=None, page_rows: int = 256,
                      chunk: int = 1024) -> tuple[tuple, int]:
    """``sparse_attn_paged``'s arguments for one sequence prefilling ``tokens`` tokens from
    position 0, as a layer's step lays them out: token p's window list is positions
    max(0, p - window + 1) .. p (the step's own rows, -1 pads last), then (ratio > 0: a
    compressed layer) its compressed list ``topk`` random rows among the ``(p + 1) // ratio``
    complete ones (all of them when fewer), ascending, -1 pads last; ratio 0 (an SWA layer):
    no pool, no compressed entries. The ring is empty. Returns (arguments, valid list entries
    in all)."""
    g = generator
    q = torch.randn(tokens, heads, head_dim, device=device, generator=g).bfloat16()
    sink = torch.randn(heads, device=device, generator=g)
    ring = pack_window_rows(torch.zeros(1, window, head_dim, device=device).bfloat16())
    new_rows = pack_window_rows(torch.randn(tokens, head_dim, device=device,
                                            generator=g).bfloat16())
    pos = torch.arange(tokens, device=device)
    first = (pos - window + 1).clamp_min(0)
    slot = first[:, None] + torch.arange(window, device=device)  # [T, window] positions
    # ids 0 .. window - 1 are the (empty) ring's rows, window + p the step's row of position p
    widx = torch.where(slot <= pos[:, None], window + slot, -1).to(torch.int32)
    token_row = torch.zeros(tokens, dtype=torch.int64, device=device)
    if ratio == 0:
        cidx = torch.empty(tokens, 0, dtype=torch.int32, device=device)
        return (q, sink, head_dim ** -0.5, ring, new_rows, widx, None, None, token_row,
                cidx), int((widx >= 0).sum())
    n_rows = tokens // ratio  # compressed rows once the prompt is in
    pages = max(1, -(-n_rows // page_rows))
    pool = pack_compressed_rows(torch.randn(pages, page_rows, head_dim, device=device,
                                            generator=g).bfloat16())
    table = torch.randperm(pages, device=device, generator=g).view(1, -1)
    k = min(topk, max(n_rows, 1))
    cidx = torch.full((tokens, k), -1, dtype=torch.int32, device=device)
    for t0 in range(0, tokens, chunk):  # random scores over the visible rows, top k of them
        vis = (pos[t0:t0 + chunk] + 1) // ratio
        score = torch.rand(vis.shape[0], max(n_rows, 1), device=device, generator=g)
        score = score.masked_fill(torch.arange(score.shape[1], device=device) >= vis[:, None], -1)
        val, ids = score.topk(k, dim=1)
        ids = torch.where(val >= 0, ids, n_rows + 1).sort(dim=1).values  # -1 pads last
        cidx[t0:t0 + chunk] = torch.where(ids <= n_rows, ids, -1).to(torch.int32)
    valid = int((widx >= 0).sum() + (cidx >= 0).sum())
    return (q, sink, head_dim ** -0.5, ring, new_rows, widx, pool, table, token_row, cidx), valid


def bench_sparse_attn_prefill(copy_bw: float, tokens=(8192, 65536), ratios=(0, 2),
                              reference_max: int = 8192, variants=(("default", ()),),
                              rounds: int = 1) -> list[dict]:
    """The sparse-attention op alone in a prefill: one sequence of ``tokens`` tokens from
    position 0 (``prefill_attn_case``: V4.1-Flash heads, 128 window rows, and at a ratio > 0
    top-512 of the ratio's compressed rows per query; ratio 0 is an SWA layer's window
    alone). FLOPs count the valid list entries; bytes every row, query and output once; also
    the share of the bf16 peak the floor counts. ``variants`` and ``rounds`` as in
    ``bench_sparse_attn``: a row per case and variant (the graphs alternating over the
    rounds), a later variant's ``diff`` its output elements whose bits differ from the
    first's; ``ratio_c`` is the case's compression ratio (``ratio``, as in every part, its
    time over the floor). The reference's output is compared up to ``reference_max``
    tokens."""
    from .ops.sparse_attn.reference import sparse_attn_paged as reference

    cfg = preset("v41-flash")
    h, d = cfg.n_heads, cfg.head_dim
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for ratio in ratios:
        for t in tokens:
            args, valid = prefill_attn_case(t, h, d, cfg.window_size, cfg.index_topk, ratio,
                                            generator=g)
            q, _, _, _, new_rows, widx, pool, _, _, cidx = args
            nbytes = (new_rows.numel() + 2 * q.numel() * 2 + (widx.numel() + cidx.numel()) * 4
                      + (min(pool.numel(), (t // ratio) * pool.shape[-1]) if ratio else 0))
            flops = 4.0 * h * d * valid
            floor = max(flops / BF16_FLOPS, nbytes / copy_bw)
            ref = reference(*args).double() if t <= reference_max else None
            case = [{"tokens": t, "ratio_c": ratio, "variant": v} for v, _ in variants]
            _attn_rounds(case, variants, rounds, [args], ref, reps=5)
            _rate(case, floor, nbytes, copy_bw, flops)
            for row in case:
                row["peak%"] = 100 * flops / (row["us"] * 1e-6) / BF16_FLOPS
            rows += case
            del args, ref, q, new_rows, widx, pool, cidx  # a 64K case's are GBs
            torch.cuda.empty_cache()
    return rows


INDEXER_CASES = [("top-k", 1, 2048), ("candidate source", 1, 4096),  # short contexts (4K)
                 ("candidate source", 64, 4096),
                 ("candidate source", 64, 65536), ("candidate source", 256, 65536),
                 ("candidate source", 1, 1 << 20), ("top-k", 64, 32768), ("top-k", 256, 32768),
                 ("top-k, mixed", 64, 65536), ("Reindex", 64, 65536), ("Reindex", 1, 1 << 20),
                 ("candidate source, prefill", 1, 16384), ("candidate source, prefill", 1, 65536)]


def _weight_copies(make, nbytes: int, min_bytes: int) -> list:
    """``make()`` called until the copies, ``nbytes`` each, pass ``min_bytes``: a timed loop
    over them streams its weights from HBM, not L2, as a model's layers do."""
    return [make() for _ in range(-(-min_bytes // nbytes))]


GEMM_WEIGHTS = ("wq_a", "wkv", "wq_b", "indexer.wq_b", "wo_b")  # the layer's fp8_linear calls
GEMM_ROWS = (1, 8, 64, 256, 4096, 8192)  # 8192: an 8K prefill's projections


def bench_gemm(copy_bw: float, rows=GEMM_ROWS, names=GEMM_WEIGHTS, layer: int = 2,
               min_bytes: int = 512 << 20, variants=(("default", ()),),
               rounds: int = 1) -> list[dict]:
    """Each fp8 weight of V4.1-Flash ``layer`` (``names``, as expected_tensors names them) at
    ``rows`` tokens: fp8_linear (act_quant + GEMM, bf16 out) in a CUDA graph that runs it over
    enough weight copies to pass ``min_bytes`` (so the weights stream from HBM, not L2, as in a
    model); floor = max(FLOPs / 790 TFLOP/s, (weight + scale + x + y bytes) / copy_bw).
    ``variants`` and ``rounds`` as in ``bench_layers``: a row per weight, row count and
    variant, each timed in a graph captured under its settings, the variants alternating; a
    later variant's ``diff`` counts its outputs whose bits differ from the first's (same x
    and weight); a variant that raises gives a nan time and its reason in ``failed``."""
    from .checkpoint import quantize_fp8
    from .ops.linear.triton import fp8_linear

    cfg = preset("v41-flash")
    shapes = expected_tensors(cfg, layer)
    out = []
    for name in names:
        n, k = shapes[name + ".weight"][1]
        w = quantize_fp8(torch.randn(n, k, device="cuda") / k ** 0.5)
        wbytes = w.weight.numel() + w.scale.numel()
        copies = _weight_copies(lambda: (w.weight.clone(), w.scale.clone()), wbytes, min_bytes)
        for m in rows:
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)

            def call():
                for wt, sc in copies:
                    fp8_linear(x, wt, sc)

            flops = 2.0 * m * n * k
            nbytes = wbytes + 2 * m * (k + n)
            floor = max(flops / BF16_FLOPS, nbytes / copy_bw)
            case = [{"weight": name, "N": n, "K": k, "rows": m, "variant": v, "us": float("inf")}
                    for v, _ in variants]
            for _ in range(rounds):
                for row, (_, settings) in zip(case, variants):
                    try:
                        with tuned(settings):
                            row["us"] = min(row["us"], _graph_ms(call, calls=len(copies)) * 1e3)
                    except Exception as e:  # noqa: BLE001 - reported, the other variants run
                        _failed(row, e)
            if len(variants) > 1:
                _diff_outputs(case, variants, lambda i: fp8_linear(x, w.weight, w.scale))
            _rate(case, floor, nbytes, copy_bw, flops)
            out += case
        copies.clear()  # this weight's copies go before the next weight's are made
        torch.cuda.empty_cache()
    return out


WO_A_ROWS = (1, 16, 64, 256)  # decode batches; the codes serve up to 16 / 64 rows by mode


def bench_wo_a(copy_bw: float, rows=WO_A_ROWS, layer: int = 2,
               min_bytes: int = 512 << 20) -> list[dict]:
    """V4.1-Flash ``layer``'s grouped wo_a alone (the projection inverse_rope_wo_a runs once o
    is turned back) four ways, at each of ``rows``: "codes" (dense_fp8_linear on the fp8
    codes and block scales, rescaled where the scales allow it, as prepare_wo_a's codes run),
    "codes, scaled" (the same with rescaled=False: each element times its block scale before
    the MMA), "bf16 torch" (torch's batched GEMM on the bf16 copy: the default mode past
    WO_A_STEP_CODES_MAX_ROWS), "bf16 fixed" (dense_linear on the bf16 copy: the
    batch-invariant mode past WO_A_CODES_MAX_ROWS); each in a CUDA graph over enough weight
    copies to pass ``min_bytes``. floor = max(FLOPs / 790 TFLOP/s, (fp8 weight + scales + x +
    y bytes) / copy_bw), as the layer's floor counts wo_a; same_bits: the codes' output
    against dense_linear's (they promise the same bits)."""
    from .checkpoint import quantize_fp8
    from .ops.linear.triton import dense_fp8_linear, dense_linear, rescalable_scales

    cfg = preset("v41-flash")
    n, k = expected_tensors(cfg, layer)["wo_a.weight"][1]
    groups = cfg.o_groups
    ng, kg = n // groups, k
    w = quantize_fp8(torch.randn(n, k, device="cuda") / k ** 0.5)
    w16 = w.dequantize()
    wbytes = w.weight.numel() + w.scale.numel()
    rescaled = {"codes": rescalable_scales(w.scale), "codes, scaled": False}
    wants = {}  # rows -> dense_linear's output on that row count's x (both code forms check it)
    out = []
    for form in ("codes", "codes, scaled", "bf16 torch", "bf16 fixed"):
        make, one = ((lambda: (w.weight.clone(), w.scale.clone())), wbytes) \
            if form in rescaled else (w16.clone, w16.numel() * 2)
        copies = _weight_copies(make, one, min_bytes)
        for m in rows:
            g = torch.Generator(device="cuda").manual_seed(m)  # the same x for every form
            x = torch.randn(m, groups * kg, device="cuda", generator=g).to(torch.bfloat16)
            y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")

            def call():
                for c in copies:
                    if form in rescaled:
                        dense_fp8_linear(x, c[0], c[1], groups, rescaled=rescaled[form], out=y)
                    elif form == "bf16 torch":
                        torch.bmm(x.view(m, groups, kg).transpose(0, 1),
                                  c.view(groups, ng, kg).transpose(1, 2),
                                  out=y.view(m, groups, ng).transpose(0, 1))
                    else:
                        dense_linear(x, c, groups)

            us = _graph_ms(call, calls=len(copies)) * 1e3
            flops = 2.0 * m * n * kg
            floor = max(flops / BF16_FLOPS, (wbytes + 2 * m * (groups * kg + n)) / copy_bw)
            same = None
            if form in rescaled:
                if m not in wants:
                    wants[m] = dense_linear(x, w16, groups).view(torch.int16)
                got = dense_fp8_linear(x, w.weight, w.scale, groups, rescaled=rescaled[form])
                same = torch.equal(got.view(torch.int16), wants[m])
            out.append({"form": form, "N": n, "K": groups * kg, "rows": m, "us": us,
                        "floor_us": floor * 1e6, "ratio": us * 1e-6 / floor, "same_bits": same})
        copies.clear()
        torch.cuda.empty_cache()
    return out


def indexer_floor(cfg: AttentionConfig, batch: int, scored: float, copy_bw: float,
                  key_rows: int | None = None) -> tuple[float, float, float]:
    """(FLOPs, bytes, floor s) of the indexer alone for ``batch`` queries that each score
    ``scored`` rows (on average): the fp4 keys once (68 B a row; decode queries each read their
    own sequence's, ``key_rows`` = batch x scored; a prefill's share one sequence's), the
    queries and head weights in, the top-k out; 2 x heads x head_dim FLOPs per (query, scored
    row)."""
    heads, d = cfg.index_n_heads, cfg.index_head_dim
    key_rows = batch * scored if key_rows is None else key_rows
    nbytes = (key_rows * index_key_bytes(d)
              + batch * (heads * d * 2 + heads * 2 + cfg.index_topk * 4))
    flops = 2.0 * batch * heads * d * scored
    return flops, nbytes, max(flops / BF16_FLOPS, nbytes / copy_bw)


def bench_indexer(copy_bw: float, cases=INDEXER_CASES, page_rows: int = 256) -> list[dict]:
    """The lightning indexer alone (``ops/indexer``): random fp4 keys on shuffled pages; at
    decode one query per sequence seeing every row ("..., mixed": sequences of random lengths
    up to the rows, as a serving batch holds); "..., prefill": one sequence's ``rows`` tokens
    from position 0, query i seeing rows 0 .. i (a ratio-1 source). The candidate source
    keeps ``candidate_topk_blocks`` blocks, a Reindex consumer scores rows inside that many
    random blocks. Per case: the CUDA-graph replay time, the GPU time of the scoring kernel
    and of the rest (torch profiler, eager calls), and the reference op (eager) where it fits
    (its selection compared)."""
    from torch.profiler import ProfilerActivity, profile

    from .ops.common.quant import index_fp4_fake_quant
    from .ops.indexer import reference, triton as kernel

    cfg = preset("v41-flash")
    heads, d, bs = cfg.index_n_heads, cfg.index_head_dim, cfg.candidate_block_size
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for kind, b, n in cases:
        prefill = kind.endswith(", prefill")
        kind_base = kind.split(",")[0]
        pages = b * (-(-n // page_rows)) + 3
        pool = torch.randint(0, 256, (pages, page_rows, index_key_bytes(d)), generator=g,
                             device="cuda", dtype=torch.int32).to(torch.uint8)
        pool[..., d // 2:] = torch.randint(118, 128, pool[..., d // 2:].shape, generator=g,
                                           device="cuda", dtype=torch.int32).to(torch.uint8)
        table = torch.randperm(pages, generator=g, device="cuda")[: pages - 3].view(b, -1)
        queries = n if prefill else b
        q = index_fp4_fake_quant(torch.randn(queries, heads, d, generator=g, device="cuda").bfloat16())
        w = (torch.randn(queries, heads, generator=g, device="cuda") * cfg.index_weight_scale).bfloat16()
        if prefill:
            rows_of = torch.zeros(queries, dtype=torch.long, device="cuda")
            vis = torch.arange(1, n + 1, device="cuda")
            groups = [(n, torch.arange(n, device="cuda"))]
        else:
            rows_of, vis = torch.arange(b, device="cuda"), torch.full((b,), n, device="cuda")
            groups = [(1, rows_of)]
        if kind.endswith(", mixed"):
            vis = torch.randint(1, n + 1, (b,), generator=g, device="cuda")
        kw = dict(block_size=bs)
        scored = vis.float().mean().item()
        if kind_base == "candidate source":
            kw["candidate_topk"] = cfg.candidate_topk_blocks
        elif kind_base == "Reindex":
            nblk = -(-n // bs)
            picked = torch.rand(b, nblk, generator=g, device="cuda").topk(
                min(cfg.candidate_topk_blocks, nblk), dim=1).indices
            kw["candidates"] = torch.zeros(b, nblk, dtype=torch.bool, device="cuda").scatter_(
                1, picked, True)
            scored = min(n, cfg.candidate_topk_blocks * bs)
        args = (q, w, pool, table, rows_of, vis, n, cfg.index_topk, groups)

        def call(impl=kernel):
            return impl.index_topk(*args, **kw)

        fits = queries * n <= 64 * 65536 if not prefill else n <= 16384  # the reference's time
        if fits:
            want, got = call(reference), call()
            same = torch.equal(want[0], got[0]) and (want[1] is None
                                                     or torch.equal(want[1], got[1]))
            del want, got
        else:
            same = None
        us = _graph_ms(call) * 1e3
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                call()
            torch.cuda.synchronize()
        score_us = other_us = 0.0
        for e in prof.key_averages():
            t = getattr(e, "self_device_time_total", None)
            t = (e.self_cuda_time_total if t is None else t) / 5
            if "_score_kernel" in e.key:
                score_us += t
            elif t > 0:
                other_us += t
        ref_us = _events_ms(lambda: call(reference), 3) * 1e3 if fits else None
        flops, nbytes, floor = indexer_floor(cfg, queries, scored, copy_bw,
                                             key_rows=n if prefill else None)
        rows.append({"kind": kind, "batch": b, "rows": n, "us": us, "score_us": score_us,
                     "select_us": other_us, "floor_us": floor * 1e6, "ratio": us * 1e-6 / floor,
                     # key bytes scored (a prefill's: each query's visible rows)
                     "key_GB/s": queries * scored * index_key_bytes(d) / (score_us * 1e-6) / 1e9,
                     "reference_us": ref_us, "same_as_reference": same})
        del pool  # the graph went with _graph_ms
        torch.cuda.empty_cache()
    return rows


def main(args) -> int:
    if not torch.cuda.is_available():
        raise SystemExit("bench needs a CUDA GPU")
    import triton

    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    if args.part in ("indexer", "all"):
        copy_bw = measure_copy_bandwidth()
        print(f"lightning indexer alone, V4.1-Flash (top-{preset('v41-flash').index_topk}); "
              f"copy {copy_bw / 1e12:.2f} TB/s; graph = CUDA-graph replay, scoring / rest = GPU "
              "time of the kernels (eager); prefill: one sequence, a query per row")
        print(f"{'case':<27}{'batch':>6}{'rows':>9}{'graph us':>10}{'scoring':>9}{'rest':>7}"
              f"{'key GB/s':>9}{'floor':>8}{'ratio':>7}{'ref us':>9}  same as reference")
        for r in bench_indexer(copy_bw):
            ref = "-" if r["reference_us"] is None else f"{r['reference_us']:.0f}"
            print(f"{r['kind']:<27}{r['batch']:>6}{r['rows']:>9}{r['us']:>10.1f}"
                  f"{r['score_us']:>9.1f}{r['select_us']:>7.1f}{r['key_GB/s']:>9.0f}"
                  f"{r['floor_us']:>8.1f}{r['ratio']:>7.1f}{ref:>9}  {r['same_as_reference']}")
        if args.part == "indexer":
            return 0
    variants = getattr(args, "variant", None) or [("default", ())]
    rounds = getattr(args, "variant_rounds", 2) if len(variants) > 1 else 1
    compare = len(variants) > 1
    if compare:
        _print_variants(variants, rounds)
    vwidth = max(9, 2 + max(len(v) for v, _ in variants))  # the variant column
    failed = []
    if args.part in ("gemm", "all"):
        copy_bw = measure_copy_bandwidth()
        print(f"fp8 linears alone (act_quant + GEMM, bf16 out), V4.1-Flash; copy "
              f"{copy_bw / 1e12:.2f} TB/s; us = CUDA-graph replay, weights streamed from HBM")
        print(f"{'weight':<14}{'N x K':>13}{'rows':>6}" + (f"  {'variant':<{vwidth}}" if compare
                                                           else "") +
              f"{'us':>9}" + (f"{'vs':>8}{'diff':>9}" if compare else "") +
              f"{'floor':>8}{'ratio':>7}{'GB/s':>7}{'copy%':>7}{'TFLOP/s':>9}")
        rows = [int(v) for v in args.rows.split(",") if v] if getattr(args, "rows", None) \
            else GEMM_ROWS
        gemm_rows = bench_gemm(copy_bw, rows=rows, variants=variants, rounds=rounds)
        for r in gemm_rows:
            first = r["variant"] == variants[0][0]
            vs = "-" if first else f"{r['vs_first%']:+.1f}%"
            diff = "-" if "diff" not in r else str(r["diff"])
            print(f"{r['weight']:<14}{r['N']:>7}x{r['K']:<5}{r['rows']:>6}" +
                  (f"  {r['variant']:<{vwidth}}" if compare else "") + f"{r['us']:>9.1f}" +
                  (f"{vs:>8}{diff:>9}" if compare else "") +
                  f"{r['floor_us']:>8.1f}{r['ratio']:>7.2f}{r['GB/s']:>7.0f}{r['copy%']:>6.0f}%"
                  f"{r['TFLOP/s']:>9.0f}")
            failed += [f"gemm {r['weight']} rows={r['rows']} [{r['variant']}] {m}"
                       for m in r.get("failed", ())]
        print("wo_a alone (the grouped GEMM, 8 groups): its fp8 codes (rescaled where the "
              "scales allow, as the layer runs them, and with scaled operands), its bf16 copy "
              "on torch and on dense_linear; floor counts the fp8 bytes; same bits: codes = "
              "dense_linear" + ("; under each variant in turn" if compare else ""))
        print(f"{'form':<15}{'rows':>6}" + (f"  {'variant':<{vwidth}}" if compare else "") +
              f"{'us':>9}{'floor':>8}{'ratio':>7}  same bits")
        for name, settings in variants:
            with tuned(settings):
                wo_a_rows = bench_wo_a(copy_bw)
            for r in wo_a_rows:
                same = "" if r["same_bits"] is None else str(r["same_bits"])
                print(f"{r['form']:<15}{r['rows']:>6}" +
                      (f"  {name:<{vwidth}}" if compare else "") +
                      f"{r['us']:>9.1f}{r['floor_us']:>8.1f}{r['ratio']:>7.2f}  {same}")
        if args.part == "gemm":
            if args.csv:
                _write_csv(args.csv, gemm_rows, GEMM_FIELDS)
            if failed:
                print(f"{len(failed)} case(s) failed:", *failed, sep="\n  ")
            return 1 if failed else 0
    grids = {  # the parts not in all: (title, rows, line key, column width)
        "attn_kernels": ("sparse attention, the Triton kernel and the warp-specialized Gluon "
                         "one by cut, V4.1-Flash decode at 4K; us = CUDA-graph replay; [n] = "
                         "output elements whose bits differ from the unsplit Triton kernel's",
                         bench_attn_kernels, "kernel", 18),
        "attn_variants": ("sparse attention by launch variant (sparse_attn_paged's block_h, "
                          "num_warps, d_chunks), V4.1-Flash; us = CUDA-graph replay; [n] = "
                          "output elements whose bits differ from the default launch's",
                          bench_attn_variants, "variant", 22)}
    if args.part in grids:
        title, bench, key, width = grids[args.part]
        print(title)
        _print_attn_grid(bench(), key, width)
        return 0
    if args.part in ("sparse_attn", "all"):
        copy_bw = measure_copy_bandwidth()
        print(f"sparse attention alone, decode, 640 packed rows per query; copy {copy_bw / 1e12:.2f} "
              "TB/s; us = CUDA-graph replay (default mode), invariant = batch_invariant=True, "
              "launch = one eager call")
        print(f"{'batch':>6}" + (f"  {'variant':<{vwidth}}" if compare else "") + f"{'us':>9}"
              + (f"{'vs':>8}{'diff':>9}" if compare else "") +
              f"{'floor':>9}{'ratio':>7}{'GB/s':>7}{'copy%':>7}{'rel err':>9}"
              f"{'invariant':>10}{'launch':>8}")
        for r in bench_sparse_attn(copy_bw, variants=variants, rounds=rounds):
            vs = "-" if r["variant"] == variants[0][0] else f"{r['vs_first%']:+.1f}%"
            diff = str(r["diff"]) if "diff" in r else "-"
            err = f"{r['rel_err']:.1e}" if "rel_err" in r else "-"
            launch = f"{r['launch_us']:.1f}" if "launch_us" in r else "-"
            print(f"{r['batch']:>6}" + (f"  {r['variant']:<{vwidth}}" if compare else "") +
                  f"{r['us']:>9.1f}" + (f"{vs:>8}{diff:>9}" if compare else "") +
                  f"{r['floor_us']:>9.1f}{r['ratio']:>7.1f}"
                  f"{r['GB/s']:>7.0f}{r['copy%']:>6.0f}%{err:>9}"
                  f"{r['invariant_us']:>10.1f}{launch:>8}")
            failed += [f"sparse_attn b={r['batch']} [{r['variant']}] {m}"
                       for m in r.get("failed", ())]
        print(f"sparse attention alone, prefill: one sequence from position 0, 128 window rows "
              f"per query, and at ratio r > 0 top-{preset('v41-flash').index_topk} of the "
              "ratio's compressed rows; us = CUDA-graph replay; peak = the floor's bf16 FLOP/s")
        print(f"{'tokens':>7}{'r':>3}" + (f"  {'variant':<{vwidth}}" if compare else "")
              + f"{'us':>10}" + (f"{'vs':>8}{'diff':>9}" if compare else "")
              + f"{'floor':>10}{'ratio':>7}{'TFLOP/s':>9}{'peak%':>7}{'rel err':>9}"
              f"{'invariant':>10}")
        for r in bench_sparse_attn_prefill(copy_bw, variants=variants, rounds=rounds):
            vs = "-" if r["variant"] == variants[0][0] else f"{r['vs_first%']:+.1f}%"
            diff = str(r["diff"]) if "diff" in r else "-"
            err = f"{r['rel_err']:.1e}" if "rel_err" in r else "-"
            print(f"{r['tokens']:>7}{r['ratio_c']:>3}"
                  + (f"  {r['variant']:<{vwidth}}" if compare else "") + f"{r['us']:>10.1f}"
                  + (f"{vs:>8}{diff:>9}" if compare else "")
                  + f"{r['floor_us']:>10.1f}{r['ratio']:>7.1f}"
                  f"{r['TFLOP/s']:>9.0f}{r['peak%']:>6.0f}%{err:>9}{r['invariant_us']:>10.1f}")
            failed += [f"sparse_attn prefill {r['tokens']} r={r['ratio_c']} [{r['variant']}] "
                       f"{m}" for m in r.get("failed", ())]
        if args.part == "sparse_attn":
            if failed:
                print(f"{len(failed)} case(s) failed:", *failed, sep="\n  ")
            return 1 if failed else 0
    roles = tuple(args.roles.split(",")) if args.roles else tuple(ROLES)
    decode = DECODE if not args.quick else [(1, 4096), (64, 4096), (64, 65536)]
    prefill = PREFILL if not args.quick else [8192]
    if args.decode is not None:  # "1x4096,64x65536"
        decode = [tuple(int(v) for v in c.split("x")) for c in args.decode.split(",") if c]
    if args.prefill is not None:
        prefill = [int(v) for v in args.prefill.split(",") if v]
    compile_cases = ((64, 4096),) if args.compile else ()
    tp = getattr(args, "tp_run", None)
    rows, copy_bw = bench_layers(decode=decode, prefill=prefill, roles=roles,
                                 compile_cases=compile_cases, tp=tp,
                                 invariant=args.batch_invariant, queued=not args.idle_replays,
                                 variants=variants, rounds=rounds)
    fields = ["role", "kind", "variant", "vs_first%", "diff", "batch", "context", "triton_us",
              "triton_facts_us", "invariant_us",
              "invariant_cost%",
              "triton_eager_us", "reference_us", "compiled_us", "floor_us", "ratio", "TFLOP/s", "GB/s", "speedup_reference",
              "speedup_compiled", "flops", "bytes", "tp", "allreduce_bytes", "allreduce_GB/s"]
    if args.csv:
        _write_csv(args.csv, rows, fields)
    replays = "one by one from an idle GPU" if args.idle_replays else \
        "steps queued back to back; a prefill call queued while the GPU is held"
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s; times in us (median); triton = CUDA-graph "
          f"replay of the layer ({replays}), eager = host launches included; facts = the step's shared facts "
          "(once per step for all layers, not in the layer's time)")
    if tp is not None and tp.world > 1 and rows:
        print(f"--tp {tp.world}: times and floors are one rank's (its weight slices, heads and index "
              "heads; every cache row and index key read whole) plus its all-reduce bytes at "
              f"{rows[0]['allreduce_GB/s']:.0f} GB/s, an fp32 all-reduce of 256 MB measured "
              "over the ranks")
    print(f"{'role':<14}{'kind':<8}" + (f"{'variant':<{vwidth}}" if compare else "") +
          f"{'batch':>6}{'context':>9}{'triton':>9}"
          + (f"{'vs':>8}{'diff':>9}" if compare else "") +
          f"{'facts':>7}{'floor':>8}{'ratio':>7}"
          f"{'TFLOP/s':>8}{'GB/s':>7}{'eager':>8}{'ref':>8}{'compile':>8}{'speedup':>8}"
          f"{'invariant':>10}{'cost':>7}")

    def fmt(r, key, spec=".0f"):
        v = r.get(key)
        return "-" if v is None else format(v, spec)

    for r in rows:
        vs = f"{fmt(r, 'vs_first%', '+.1f')}%" if r["variant"] != variants[0][0] else "-"
        print(f"{r['role']:<14}{r['kind']:<8}" + (f"{r['variant']:<{vwidth}}" if compare else "") +
              f"{r['batch']:>6}{r['context']:>9}{fmt(r, 'triton_us'):>9}" +
              (f"{vs:>8}{fmt(r, 'diff', 'd'):>9}" if compare else "") +
              f"{fmt(r, 'triton_facts_us'):>7}{r['floor_us']:>8.1f}"
              f"{fmt(r, 'ratio', '.2f' if compare else '.1f'):>7}"
              f"{fmt(r, 'TFLOP/s', '.1f'):>8}{fmt(r, 'GB/s'):>7}{fmt(r, 'triton_eager_us'):>8}"
              f"{fmt(r, 'reference_us'):>8}{fmt(r, 'compiled_us'):>8}"
              f"{fmt(r, 'speedup_reference', '.0f'):>7}x"
              f"{fmt(r, 'invariant_us'):>10}{fmt(r, 'invariant_cost%', '+.0f'):>6}%")
    # an out-of-memory case is a nan in the table; any other failure fails the command
    failed += [f"{r['role']} {r['kind']} b={r['batch']} n={r['context']} "
               + (f"[{r['variant']}] " if compare else "") + m
               for r in rows for m in r.get("failed", ())]
    benches = {}
    if args.profile or args.timeline:  # one set of weights and a bench per role for both
        cfg = preset("v41-flash")
        weights = _weights(cfg, sorted({L for r in roles for L in role_layers(cfg, r)}), tp)
        group = None if tp is None else tp.group
        benches = {role: RoleBench(cfg, role, "triton", weights, group) for role in roles}
    at_4k = sorted({b for b, n in decode if n == 4096})
    if args.profile:
        batches = at_4k or ((1, 64) if decode else ())
        # with --batch-invariant the invariant mode's steps too, each after the default's
        modes = ("", ", batch-invariant") if args.batch_invariant else ("",)
        profiled = [(role, mode, RoleBench(cfg, role, "triton", weights, group,
                                           batch_invariant=True) if mode else bench)
                    for role, bench in benches.items() for mode in modes]
        for role, mode, bench in profiled:
            cases = [(f"decode b={b} 4K (one eager step)", f"b={b}",
                      lambda b=b, bench=bench: bench.profile_decode(b, 4096)) for b in batches]
            cases += [(f"prefill {t} tokens (one eager call)", f"prefill {t}",
                       lambda t=t, bench=bench: (bench.profile_prefill(t), None))
                      for t in prefill]
            for title, case, run in cases:
                print(f"per-kernel GPU time, {role}{mode}, {title}:")
                try:
                    top, facts = run()
                except Exception as e:  # noqa: BLE001 - reported, the table above stands
                    print(f"  failed: {type(e).__name__}: {e}"[:300])
                    failed.append(f"{role}{mode} profile {case}: {type(e).__name__}: {e}"[:300])
                    continue
                _print_profile(top, facts)
    if args.timeline:
        for role, bench in benches.items():
            for b in at_4k or (1, 64):
                print(f"timeline, {role}, decode b={b} 4K (one replay of the step's graph: the "
                      f"step's facts, then the sources, then the layer; lane = stream):")
                try:
                    _print_timeline(bench.timeline_decode(b, 4096))
                except Exception as e:  # noqa: BLE001 - reported, the table above stands
                    print(f"  failed: {type(e).__name__}: {e}"[:300])
                    failed.append(f"{role} timeline b={b}: {type(e).__name__}: {e}"[:300])
    if failed:
        print(f"{len(failed)} case(s) failed:", *failed, sep="\n  ")
        return 1
    return 0


GEMM_FIELDS = ["weight", "N", "K", "rows", "variant", "us", "vs_first%", "diff", "floor_us",
               "ratio", "GB/s", "copy%", "TFLOP/s"]


def _write_csv(path: str, rows: list[dict], fields: list[str]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def _print_variants(variants, rounds: int) -> None:
    print(f"variants (times: the least of {rounds} alternating rounds; vs = against the first "
          "variant; diff = output elements whose bits differ from the first's, same inputs):")
    for name, settings in variants:
        print(f"  {name}: {', '.join(map(str, settings)) or 'the defaults'}")


def _print_profile(top, facts=None, shown: int = 12) -> None:
    """One case of ``bench --profile``: launches and GPU time in all, then the longest
    kernels (``facts``: the step's shared facts, reported beside the layer)."""
    extra = "" if facts is None else (f" (besides the step's facts: {sum(n for *_, n in facts)} "
                                      f"launches, {sum(us for _, us, _ in facts):.1f} us)")
    print(f"  {sum(n for *_, n in top)} launches, {sum(us for _, us, _ in top):.1f} us of GPU "
          f"time in all{extra}; the longest:")
    for name, us, n in top[:shown]:
        print(f"  {us:>8.1f} us {n:>4}x  {name[:90]}")
    if len(top) > shown:
        print(f"  {sum(us for _, us, _ in top[shown:]):>8.1f} us "
              f"{sum(n for *_, n in top[shown:]):>4}x  the {len(top) - shown} other kernels")


def plot_csv(csv_path: str, png_path: str) -> None:
    """Ratio to the floor per role and case from a ``bench --csv`` file, log scale, with the
    project's target (1.5 x the floor, README "GPU") drawn; needs matplotlib (``pip install
    dsv41attn[plot]``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit(f"plot needs matplotlib (pip install 'dsv41attn[plot]'): {e}") from e
    with open(csv_path, newline="") as f:
        reader = csv.DictReader(f)
        missing = {"role", "kind", "batch", "context", "ratio"} - set(reader.fieldnames or ())
        if missing:
            raise SystemExit(f"{csv_path}: not a layers CSV of bench --csv (plot draws the "
                             f"layer rows; missing columns {sorted(missing)})")
        rows = [r for r in reader if r.get("ratio") not in (None, "", "nan")]
    if not rows:
        raise SystemExit(f"{csv_path}: no rows with a ratio")
    # a bar series per role, and per variant where the file has several (bench --variant)
    series = list(dict.fromkeys((r["role"], r.get("variant") or "default") for r in rows))
    several = len({v for _, v in series}) > 1
    cases = list(dict.fromkeys(
        (r["kind"], int(r["batch"]), int(r["context"])) for r in rows))
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(cases) * len(series) / 3), 4.5))
    width = 0.8 / len(series)
    for i, (role, variant) in enumerate(series):
        ratio = {(r["kind"], int(r["batch"]), int(r["context"])): float(r["ratio"])
                 for r in rows if (r["role"], r.get("variant") or "default") == (role, variant)}
        xs = [k + i * width for k, c in enumerate(cases) if c in ratio]
        ax.bar(xs, [ratio[c] for c in cases if c in ratio], width,
               label=f"{role} [{variant}]" if several else role)
    labels = [f"{'dec' if k == 'decode' else 'pre'}\nb={b}\n"
              f"{f'{n >> 20}M' if n >= 1 << 20 else f'{n >> 10}K'}" for k, b, n in cases]
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(cases))], labels, fontsize=8)
    ax.axhline(1.5, color="k", linestyle="--", linewidth=1, label="target 1.5")
    ax.set_yscale("log")
    ax.set_ylabel("time / floor (PERF.md)")
    ax.set_title("dsv41attn triton backend, one V4.1-Flash layer per role")
    ax.legend(fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
