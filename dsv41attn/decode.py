"""Decoding without host syncs: plan once on the host, run on the GPU only, replay a CUDA graph.

FlashInfer's split. ``DecodePlan`` (host, once per batch of sequences): checks the
sequences, reads their positions once, reserves every page the next ``steps`` tokens write,
and fixes every shape, including the compressed rows each indexer scans (enough for the last
of those steps; rows a query cannot see yet are masked, so scanning more selects the same
rows). ``DecodePlan.run`` then decodes one token per sequence through the layers with the
positions read and advanced on the device: no host sync and no data-dependent shape, so it
can run inside ``torch.cuda.graph``. ``DecodePlan.capture`` does that: one eager warm-up step
(it compiles the kernels), then a graph of the next step, replayed by ``DecodeGraph.replay``.

A plan is valid until ``steps`` tokens are decoded or the state is changed by anything else
(a step, truncate, fork, release, add_sequence): ``AttentionState.epoch`` tells.
Plans use "fixed" index-key semantics (every KV source publishes its keys every step);
"reference" semantics depends on each step's position, so it runs through ``stack.step``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import torch

from .cache import AttentionState, StateError

if TYPE_CHECKING:
    from .stack import AttentionStack

Inputs = Mapping[int, torch.Tensor] | Callable[[int], torch.Tensor]


class DecodePlan:
    """``steps`` decode steps (one token per sequence) of the sequences in state rows ``rows``
    (default: all) through ``layers`` (default: the stack's layers in the state)."""

    def __init__(self, stack: "AttentionStack", state: AttentionState,
                 rows: Sequence[int] | torch.Tensor | None = None, steps: int = 1,
                 layers: Sequence[int] | None = None):
        from .stack import Group

        cfg = stack.cfg
        if cfg.index_semantics != "fixed":
            raise ValueError(f"a DecodePlan runs 'fixed' index-key semantics; this config has "
                             f"{cfg.index_semantics!r} (use stack.step for it)")
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be an int >= 1, got {steps!r}")
        if rows is None:
            rows = torch.arange(state.batch_size)
        rows = torch.as_tensor(rows, dtype=torch.int64).reshape(-1).cpu()
        if rows.numel() == 0 or rows.unique().numel() != rows.numel():
            raise ValueError(f"rows must name distinct sequences, got {rows.tolist()}")
        state.check_active(rows.tolist())
        order = sorted(L for L in (stack.layers if layers is None else layers) if L in state.layers)
        if not order:
            raise StateError(f"none of the layers has caches in this state "
                             f"(allocated for {sorted(state.layers)})")
        missing = [L for L in order if L not in stack.layers]
        if missing:
            raise KeyError(f"layers {missing} are not in this stack ({sorted(stack.layers)})")
        for L in order:
            spec = cfg.layer(L)
            for src in (spec.kv_source, spec.index_source,
                        cfg.candidate_source_layer if spec.is_candidate_consumer else None):
                if src is not None and src != L and src not in order:
                    raise StateError(f"layer {L} reads what layer {src} publishes; plan both")
        dev_rows = rows.to(state.device)
        # the one host read of the plan: every layer's position for these sequences
        held = torch.stack([state.layers[L].positions[dev_rows] for L in order]).cpu()
        if not bool((held == held[0]).all()):
            raise StateError(f"sequences {rows.tolist()} are mid-step: their layers are at "
                             f"different positions")
        positions = held[0].tolist()
        for row, p in zip(rows.tolist(), positions):
            if p + steps > state.capacity:
                raise StateError(f"sequence {row}: {steps} steps from position {p} exceed the "
                                 f"cache capacity of {state.capacity} positions")
        state.reserve(rows.tolist(), [p + steps for p in positions])

        self.stack, self.state, self.layers = stack, state, order
        self.steps_left = steps
        self.positions = positions  # host mirror, advanced by each run
        self.group = Group(state, dev_rows, None, 1, torch.arange(len(positions), device=state.device),
                           "fixed")
        ratios = {cfg.layer(L).ratio for L in order if cfg.layer(L).is_index_source}
        self.group.scan = {r: (max(positions) + steps) // r for r in ratios}
        self.epoch = state.epoch

    @property
    def batch_size(self) -> int:
        return len(self.positions)

    def run(self, xs: Inputs) -> dict[int, torch.Tensor]:
        """Decode one token per sequence: xs maps layer -> [b, dim] (or [b, 1, dim]) bf16
        (or is a function of the layer). Returns layer -> output in x's layout. GPU only."""
        self._check_live()
        inputs = self._inputs(xs)
        out = self._launch(inputs)
        self._advance()
        return out

    def capture(self, xs: Inputs) -> "DecodeGraph":
        """Run one step eagerly on a side stream (the warm-up: kernels compile, workspaces
        are allocated), then capture the next step in a CUDA graph. Takes two of the plan's
        steps; the warm-up's outputs are ``DecodeGraph.warmup_outputs``."""
        if self.state.device.type != "cuda":
            raise ValueError(f"CUDA-graph capture needs a CUDA state, this one is on "
                             f"{self.state.device}")
        backend = self.stack.layers[self.layers[0]].ops.name
        if backend != "triton":
            raise ValueError(f"capture needs backend='triton': the {backend!r} ops read the host "
                             "(boolean-mask writes), which a CUDA graph cannot record")
        if self.steps_left < 2:
            raise StateError(f"capture needs 2 steps left in the plan (warm-up + captured), "
                             f"it has {self.steps_left}")
        return DecodeGraph(self, xs)

    # ---- internals -------------------------------------------------------------------------
    def _check_live(self) -> None:
        if self.state.epoch != self.epoch:
            raise StateError("the state changed since this plan was made (a step, truncate, "
                             "fork, release or add_sequence): plan again")
        if self.steps_left < 1:
            raise StateError("this plan's steps are used up (its pages were reserved for them): "
                             "plan again")

    def _inputs(self, xs: Inputs) -> dict[int, torch.Tensor]:
        get = xs if callable(xs) else xs.__getitem__
        cfg, b, out = self.stack.cfg, self.batch_size, {}
        for L in self.layers:
            x = get(L)
            if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16:
                raise TypeError(f"layer {L}: x must be a bfloat16 torch.Tensor, got "
                                f"{getattr(x, 'dtype', type(x).__name__)}")
            if tuple(x.shape) not in ((b, cfg.dim), (b, 1, cfg.dim)):
                raise ValueError(f"layer {L}: x must be [b={b}, dim={cfg.dim}] or [b, 1, dim], "
                                 f"got {list(x.shape)}")
            if x.device != self.state.device:
                raise ValueError(f"layer {L}: x is on {x.device}, the state on {self.state.device}")
            out[L] = x
        return out

    def _launch(self, inputs: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """The GPU-only part: every layer's decode, positions read from the state."""
        g, out = self.group, {}
        for L in self.layers:
            x = inputs[L]
            pos = self.state.layers[L].positions[g.rows]  # [b] int64, on the device
            y = self.stack.layers[L].decode(x.reshape(-1, 1, x.shape[-1]), self.state, g, pos)
            out[L] = y.view(x.shape)
        return out

    def _advance(self) -> None:
        self.steps_left -= 1
        self.positions = [p + 1 for p in self.positions]


class DecodeGraph:
    """A decode step of a ``DecodePlan`` captured in a CUDA graph. ``replay(xs)`` copies xs
    into the static inputs, replays, and returns the static outputs (overwritten by the next
    replay: copy what you keep)."""

    def __init__(self, plan: DecodePlan, xs: Inputs):
        plan._check_live()
        self.plan = plan
        self.inputs = {L: x.detach().clone() for L, x in plan._inputs(xs).items()}
        side = torch.cuda.Stream(device=plan.state.device)
        side.wait_stream(torch.cuda.current_stream(plan.state.device))
        with torch.cuda.stream(side):
            warm = plan.run(self.inputs)
        torch.cuda.current_stream(plan.state.device).wait_stream(side)
        self.warmup_outputs = {L: y.clone() for L, y in warm.items()}
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = plan._launch(self.inputs)

    def replay(self, xs: Inputs | None = None) -> dict[int, torch.Tensor]:
        """One decode step (xs: as ``DecodePlan.run``; None reuses the static inputs)."""
        self.plan._check_live()
        if xs is not None:
            for L, x in self.plan._inputs(xs).items():
                self.inputs[L].copy_(x.view(self.inputs[L].shape))
        self.graph.replay()
        self.plan._advance()
        return self.outputs
