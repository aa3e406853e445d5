import contextlib
import copy
import dataclasses
import os
from pathlib import Path

import pytest
import torch

from dsv41attn.cache import AttentionState

ROOT = Path(__file__).resolve().parent.parent

# The session picks Triton's mode once, before any test module imports triton: the CPU
# interpreter only where no CUDA device is present (an explicit TRITON_INTERPRET wins).
os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

_TRITON_DEVICE_CALL = '''
    def __call__(self, *args, **kwargs):
        # This is a device function call
        _patch_lang(self.fn)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise InterpreterError(repr(e)) from e
'''


def _interpreter_helpers_reuse_the_launchs_patch() -> None:
    """Under the interpreter, Triton re-patches triton.language (five inspect.getmembers walks,
    ~2 ms) at every call of a @triton.jit helper from inside a kernel, although the launch
    running that kernel has already patched the same modules and restores them only when it
    ends: a third of this suite's interpreter time. A helper whose triton.language modules the
    running launch patched now skips the repeat; any other call runs Triton's own code. Only
    Python bookkeeping changes: every kernel runs the same interpreted operations. Applied only
    to the Triton source it was written for (3.9's; any other is left as it is)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        import inspect

        import triton.language as tl
        from triton.runtime import interpreter as interp
        device_src = inspect.getsource(interp.InterpretedFunction.__call__)
        grid_call = interp.GridExecutor.__call__
        grid_src = inspect.getsource(grid_call)
    except (ImportError, AttributeError, OSError, TypeError):
        return
    if (device_src.strip() != _TRITON_DEVICE_CALL.strip()
            or "patch_scope = _patch_lang(self.fn)" not in grid_src
            or "patch_scope.restore()" not in grid_src):
        return
    running: list[frozenset] = []  # per launch in progress: the modules patched in it

    known: dict = {}

    def langs(fn) -> frozenset:  # what interp._patch_lang(fn) patches (a module's imports)
        if fn not in known:
            known[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                  if inspect.ismodule(v) and v in [tl, tl.core])
        return known[fn]

    def launch(self, *args, **kwargs):
        running.append(langs(self.fn))
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            running.pop()

    def device_call(self, *args, **kwargs):
        mine = langs(self.fn)
        if not (running and mine <= running[-1]):
            interp._patch_lang(self.fn)  # Triton never restores it: it holds for this launch
            if running:
                running[-1] = running[-1] | mine
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interp.InterpreterError(repr(e)) from e

    # _get_np_dtype (a pure function of the Triton type) rebuilds a 19-entry dict of dtypes on
    # every call, ~40 us, once per interpreted op: its answers are kept per type.
    np_dtype, np_dtypes = interp._get_np_dtype, {}

    def get_np_dtype(tt_dtype):
        key = (type(tt_dtype), str(tt_dtype))
        if key not in np_dtypes:
            np_dtypes[key] = np_dtype(tt_dtype)
        return np_dtypes[key]

    interp.GridExecutor.__call__ = launch
    interp.InterpretedFunction.__call__ = device_call
    interp._get_np_dtype = get_np_dtype


_interpreter_helpers_reuse_the_launchs_patch()

_TRITON_BLOCK_TYPE_INIT = """
    def __init__(self, element_ty: dtype, shape: List):
        self.element_ty = element_ty

        # Note that block_type's shape is a list of int
        # while tensor's shape is a list of constexpr.
        assert (isinstance(shape, (list, tuple)))

        # shape can be empty ([]) when an input is a 0D tensor.
        self.shape = tuple(_unwrap_shape(shape))
        if not self.shape:
            raise TypeError('0d block_type is forbidden')

        self.numel = validate_block_shape(self.shape)
        self.name = f'<{self.shape}, {self.element_ty}>'
"""

_TRITON_TENSOR_INIT = '''
    def __init__(self, handle, type: dtype):
        """Not called by user code."""
        super().__init__()
        # IR handle
        self.handle = handle
        # Block shape
        self.shape = type.shape if type.is_block() else ()
        self.numel = constexpr(math.prod(self.shape))
        self.type = type  # Tensor type (can be block_type)
        # Following the practice in pytorch, dtype is scalar type
        self.dtype = type.scalar
        self.shape = tuple([constexpr(s) for s in self.shape])
'''

_TRITON_UNWRAP = """
def _unwrap_if_constexpr(o):
    if isinstance(o, list):
        return [_unwrap_if_constexpr(x) for x in o]
    if isinstance(o, builtins.tuple):
        return _tuple_create(o, [_unwrap_if_constexpr(x) for x in o])
    if isinstance(o, tuple):
        return tuple([_unwrap_if_constexpr(x) for x in o], o.type)
    return o.value if isinstance(o, constexpr) else o
"""


def _interpreter_shapes_are_typed_once_per_shape() -> None:
    """Under the interpreter every op builds a tl.tensor and most build a tl.block_type, and
    each of those rebuilds the same shape facts from scratch: a tl.tuple of the dimensions with
    a tuple_type of one constexpr_type per dimension, its string, its validated element count.
    The facts depend on the dimensions only, so they are now built once per shape (by Triton's
    own __init__, the first time) and reused: each object still gets its own tl.tuple holding
    equal values under an equal type, the same numel and the same name. A shape that is not
    plain ints (or constexpr ints) takes Triton's own path, as does every error. Only Python
    bookkeeping changes: every kernel runs the same interpreted operations. Applied only to the
    Triton source it was written for (3.9's)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        import builtins
        import inspect

        import triton.language.core as core
        block_init, tensor_init = core.block_type.__init__, core.tensor.__init__
        block_src, tensor_src = inspect.getsource(block_init), inspect.getsource(tensor_init)
        unwrap = core._unwrap_if_constexpr
        unwrap_src = inspect.getsource(unwrap)
    except (ImportError, AttributeError, OSError, TypeError):
        return
    if (block_src.strip() != _TRITON_BLOCK_TYPE_INIT.strip()
            or tensor_src.strip() != _TRITON_TENSOR_INIT.strip()
            or unwrap_src.strip() != _TRITON_UNWRAP.strip()):
        return
    TT, CX = core.tuple, core.constexpr
    blocks: dict = {}   # dims -> (tuple_type of the int dims, str of that tl.tuple, numel)
    tensors: dict = {}  # dims -> (numel constexpr, [constexpr per dim], their tuple_type)

    def int_dims(vals):
        dims = []
        for s in vals:
            if type(s) is int:
                dims.append(s)
            elif type(s) is CX and type(s.value) is int:
                dims.append(s.value)
            else:
                return None
        return builtins.tuple(dims)

    def block_type_init(self, element_ty, shape):
        kind = type(shape)
        dims = int_dims(shape if kind is list else shape.values) if kind in (list, TT) else None
        facts = blocks.get(dims) if dims else None
        if facts is None:
            block_init(self, element_ty, shape)
            if dims:
                blocks[dims] = (self.shape.type, str(self.shape), self.numel)
            return
        tt, text, numel = facts
        self.element_ty = element_ty
        self.shape = TT(list(dims), tt)
        self.numel = numel
        self.name = f'<{text}, {element_ty}>'

    def tensor_init_per_shape(self, handle, type):
        if type.is_block():
            shape = type.shape
            dims = builtins.tuple(shape.values) if builtins.type(shape) is TT else None
            if dims is not None and any(builtins.type(d) is not int for d in dims):
                dims = None
        else:
            dims = ()
        facts = tensors.get(dims) if dims is not None else None
        if facts is None:
            tensor_init(self, handle, type)
            if dims is not None:
                tensors[dims] = (self.numel, self.shape.values, self.shape.type)
            return
        numel, consts, tt = facts
        self.handle = handle
        self.numel = numel
        self.type = type
        self.dtype = type.scalar
        self.shape = TT(consts, tt)

    # _unwrap_if_constexpr (called ~10 times per interpreted op) answers a constexpr or a value
    # of a type it returns as it is without walking its isinstance chain; the rest, Triton's.
    as_is = frozenset({int, float, bool, type(None), core.tensor})

    def unwrap_if_constexpr(o):
        kind = type(o)
        if kind is CX:
            return o.value
        if kind in as_is:
            return o
        return unwrap(o)

    core._unwrap_if_constexpr = unwrap_if_constexpr
    core.block_type.__init__ = block_type_init
    core.tensor.__init__ = tensor_init_per_shape


_interpreter_shapes_are_typed_once_per_shape()


def _interpreter_same_shape_and_type_answer_at_once() -> None:
    """Three answers the interpreter asks for at almost every op, given without Triton's walk
    when the question is the trivial one: TritonSemantic.broadcast_impl_value of two blocks of
    the same dims returns both as they are (Triton builds the common shape and compares it with
    each through tl.tuple normalisation to find nothing to do); cast to the scalar type the value
    already has returns it (Triton's first test, reached after unwrapping); tl.dtype == tl.dtype
    compares the names (Triton's test after its unwrap and isinstance). Every other case runs
    Triton's code. Only on the interpreter's own TritonSemantic instance (and tl.dtype.__eq__ in
    an interpreter session), only for the Triton 3.9 source these were read from (sha256 of
    each function's text)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        import hashlib
        import inspect
        import types

        import triton.language.core as core
        from triton.runtime import interpreter as interp
        sem = interp.interpreter_semantic
        broadcast, cast, dtype_eq = type(sem).broadcast_impl_value, type(sem).cast, \
            core.dtype.__eq__
        digests = [hashlib.sha256(inspect.getsource(f).encode()).hexdigest()[:16]
                   for f in (broadcast, cast, dtype_eq)]
    except (ImportError, AttributeError, OSError, TypeError):
        return
    if digests != ["90c3a175f67942b0", "b69dba3389e69c97", "b0fd419d9dbeadef"]:
        return
    BT, DT = core.block_type, core.dtype

    def broadcast_impl_value(self, lhs, rhs):
        lt, rt = lhs.type, rhs.type
        if type(lt) is BT and type(rt) is BT and lt.shape.values == rt.shape.values:
            return lhs, rhs
        return broadcast(self, lhs, rhs)

    def cast_to(self, input, dst_ty, fp_downcast_rounding=None):
        src = input.type
        s = src.element_ty if type(src) is BT else src
        d = dst_ty.element_ty if type(dst_ty) is BT else dst_ty
        if type(s) is DT and type(d) is DT and s.name == d.name:
            return input
        return cast(self, input, dst_ty, fp_downcast_rounding)

    def dtype_equal(self, other):
        if type(other) is DT:
            return self.name == other.name
        return dtype_eq(self, other)

    sem.broadcast_impl_value = types.MethodType(broadcast_impl_value, sem)
    sem.cast = types.MethodType(cast_to, sem)
    core.dtype.__eq__ = dtype_equal


_interpreter_same_shape_and_type_answer_at_once()


def pytest_configure(config):
    """DSV41ATTN_LAUNCH_RECORD=FILE (make test sets it): every distinct interpreted kernel
    launch goes to FILE, which tests/sm90_compile.py then compiles for sm_90a."""
    path = os.environ.get("DSV41ATTN_LAUNCH_RECORD")
    if path and os.environ.get("TRITON_INTERPRET") == "1":
        from sm90_compile import record_launches
        record_launches(path)


def fixture_files() -> list[Path]:
    """Every golden fixture: $DSV41ATTN_FIXTURES, then ../shared/fixtures beside the checkout,
    then the copies committed in tests/fixtures (by file name, the first found wins)."""
    dirs = [os.environ.get("DSV41ATTN_FIXTURES"), ROOT.parent / "shared" / "fixtures",
            ROOT / "tests" / "fixtures"]
    found: dict[str, Path] = {}
    for d in dirs:
        if d and Path(d).is_dir():
            for f in sorted(Path(d).glob("*.safetensors")):
                found.setdefault(f.name, f)
    return [found[k] for k in sorted(found)]


@pytest.fixture(scope="session")
def tiny():
    from dsv41attn import preset
    return preset("tiny")


@pytest.fixture(scope="session")
def flash():
    from dsv41attn import preset
    return preset("v41-flash")


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    yield


# ---- state helpers shared by the serving tests ----------------------------------------------
BF16 = torch.bfloat16


def make_x(cfg, b: int, m: int, seed: int) -> torch.Tensor:
    """[b, m, dim] bf16 rows of unit RMS, deterministic in ``seed``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, m, cfg.dim, generator=g)
    return (x / x.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-6)).to(BF16)


def make_xs(cfg, b: int, m: int, seed: int, layers=None) -> dict[int, torch.Tensor]:
    layers = range(cfg.n_layers) if layers is None else layers
    return {L: make_x(cfg, b, m, 1000 * seed + L) for L in layers}


def run_valid(stack, state, calls) -> list[dict[int, torch.Tensor]]:
    return [stack.forward(make_xs(stack.cfg, len(rows), m, seed, stack.layers), state, rows=list(rows))
            for rows, m, seed in calls]


def clone_state(s: AttentionState) -> AttentionState:
    """Independent deep copy of every cache; the config object is shared (as a caller's is)."""
    return copy.deepcopy(s, {id(s.config): s.config})


def _walk(state: AttentionState):
    """(name, value) of everything a call may change: every field of the state (but its config,
    its step bookkeeping
    and device), of each LayerState and of each SourceState, whatever the layout is."""
    for f in dataclasses.fields(state):
        if f.name in ("config", "device", "layers", "sources", "open_step", "generation"):
            continue
        yield f.name, getattr(state, f.name)
    yield "layer ids", sorted(state.layers)
    yield "source ids", sorted(state.sources)
    for kind, part in (("layers", state.layers), ("sources", state.sources)):
        for key, obj in sorted(part.items()):
            for f in dataclasses.fields(obj):
                yield f"{kind}[{key}].{f.name}", getattr(obj, f.name)


def snapshot(state: AttentionState) -> dict[str, object]:
    """A copy of every tensor (window, positions, compressed rows, index keys, open group,
    block table...) and every scalar or list (index_key_slot, page refs...) of the state."""
    snap = {}
    for name, v in _walk(state):
        snap[name] = v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
    return snap


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    """t's bytes, flat: two tensors are bit-identical (NaN payloads and -0 included) when
    these are equal."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def poison_empty(monkeypatch, module) -> None:
    """Make ``module``'s torch.empty hand out NaN-filled floating buffers (integer ones as
    they come), so a test sees whether an op writes every element of the buffers it makes."""
    empty = torch.empty

    def poisoned(*shape, dtype=None, device=None):
        t = empty(*shape, dtype=dtype, device=device)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(module.torch, "empty", poisoned)


def assert_same(before: dict[str, object], after: dict[str, object]) -> None:
    assert before.keys() == after.keys()
    for k, a in before.items():
        b = after[k]
        if isinstance(a, torch.Tensor):
            assert isinstance(b, torch.Tensor), k
            assert (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device), k
            assert torch.equal(bytes_of(a), bytes_of(b)), f"{k} changed"
        else:
            assert a == b, f"{k}: {a!r} -> {b!r}"


def assert_unchanged(state: AttentionState, snap: dict[str, object]) -> None:
    assert_same(snap, snapshot(state))


@contextlib.contextmanager
def rejected(state: AttentionState, exc, match: str):
    """The body must raise ``exc`` matching ``match`` and leave ``state`` bit-identical."""
    snap = snapshot(state)
    with pytest.raises(exc, match=match):
        yield
    assert_unchanged(state, snap)


