"""The fast path's module-level switches and sizes, set for a while.

The Triton backend's choices (which tiles a GEMM runs, in how many K ranges, how many
programs a kernel takes...) are module constants, each documented where it is defined
(``dsv41attn/ops/linear/triton.py``'s ``SWAP_WS`` and ``SPLIT_PROGRAMS_PER_SM``...).
``tuned`` sets some of them for the length of a ``with`` block and puts them back after,
which is how ``bench --variant`` times one configuration against another in one process
(alternating, on the same GPU and weights); ``settable`` lists them (``bench --settings``).
A setting reads ``PATH.NAME=VALUE``: ``PATH`` a module of the fast path (``layer``,
``ops.linear.triton``: see FAST_PATH), ``NAME`` an upper-case bool, int or float constant it
defines, ``VALUE`` of the same type (bools: 1/0, true/false, on/off, yes/no; ints: decimal
or 0x hex, with an optional K, M or G suffix for 2**10, 2**20, 2**30).

What a setting can change is what the code reads at the time: a layer built, a plan made or
a CUDA graph captured under a setting keeps what it chose then. Some constants decide the
order of a sum (a GEMM's K ranges): such a setting changes output bits, which the bench's
``diff`` column shows. Constants bound elsewhere when a module is imported are refused, as
setting the module's own name would leave that binding as it was: those another module
imports by name (``from .quant import FP8_BLOCK``) and those a function takes as a default
argument value (``ops.linear.gluon.unsupported(..., stage_k=BLOCK_K)``).
"""

from __future__ import annotations

import ast
import functools
import importlib
import re
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

PACKAGE = __name__.rsplit(".", 1)[0]  # "dsv41attn"
_NAME = re.compile(r"[A-Z][A-Z0-9_]*\Z")
_TRUE, _FALSE = ("1", "true", "on", "yes"), ("0", "false", "off", "no")
_SUFFIX = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


@dataclass(frozen=True)
class Setting:
    """One constant's value: ``module`` (the full dotted name) . ``name`` = ``value``."""
    module: str
    name: str
    value: bool | int | float

    def __str__(self) -> str:
        return f"{self.module[len(PACKAGE) + 1:]}.{self.name}={self.value}"


# Where the fast path's constants live: the layer and the ops' kernel modules. Not the
# reference ops, nor the formats every backend shares (the quantisation's and the packed
# rows'): those define the numerics, which no setting may change.
FAST_PATH = ("layer", "streams", "ops")
NOT_SETTABLE = ("ops.common.quant", "ops.common.packing", "ops.common.cpu_kernels")


def _under(rel: str, prefixes: Iterable[str]) -> bool:
    """Whether module path ``rel`` is one of ``prefixes`` or inside one."""
    return any(rel == p or rel.startswith(p + ".") for p in prefixes)


def _settable_module(rel: str) -> bool:
    """Whether ``rel`` (a module path under the package, as settings write it) holds settable
    constants: under FAST_PATH, not a reference module, not in NOT_SETTABLE."""
    return _under(rel, FAST_PATH) and rel not in NOT_SETTABLE and \
        not rel.endswith(".reference") and not rel.endswith("__init__")


@functools.cache
def _sources() -> tuple[tuple[str, str, list[str], ast.Module], ...]:
    """The package's modules, read and parsed once: (module path as settings write it, file
    path from the package's parent, source lines, syntax tree)."""
    root = Path(__file__).parent
    out = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        out.append((path.relative_to(root).with_suffix("").as_posix().replace("/", "."),
                    path.relative_to(root.parent).as_posix(), text.splitlines(),
                    ast.parse(text, str(path))))
    return tuple(out)


@functools.cache
def _bound_at_import() -> dict[str, str]:
    """Names the package binds when a module is imported, so that setting the constant later
    would not reach them: name -> where (the first place found). Those some module imports by
    name (``from .quant import FP8_BLOCK``), and those a function takes as a default argument
    value (``def f(n=SPLIT_BLOCKS)``: the value at import)."""
    bound: dict[str, str] = {}
    for _, where, _, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    bound.setdefault(alias.asname or alias.name, f"imported by name in {where}")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                fn = getattr(node, "name", "a lambda")
                for d in node.args.defaults + [d for d in node.args.kw_defaults if d]:
                    for name in ast.walk(d):
                        if isinstance(name, ast.Name):
                            bound.setdefault(name.id, f"a default argument value of {fn} in "
                                                      f"{where}")
    return bound


def _parse_value(text: str, current, where: str):
    """``text`` as a value of ``current``'s type (see the module doc)."""
    s = text.strip()
    if isinstance(current, bool):
        if s.lower() in _TRUE:
            return True
        if s.lower() in _FALSE:
            return False
        raise ValueError(f"{where}: {text!r} is not a bool (expected one of "
                         f"{', '.join(_TRUE + _FALSE)})")
    if isinstance(current, int):
        scale = _SUFFIX.get(s[-1:].upper(), 1) if s else 1
        digits = s[:-1] if scale > 1 else s
        try:
            return int(digits, 0) * scale
        except ValueError:
            raise ValueError(f"{where}: {text!r} is not an int (expected e.g. 16, 0x10, "
                             f"40M)") from None
    try:
        return float(s)
    except ValueError:
        raise ValueError(f"{where}: {text!r} is not a float") from None


def parse_setting(text: str) -> Setting:
    """``PATH.NAME=VALUE`` (see the module doc) as a Setting; ValueError naming what is wrong
    (no module, no such constant, not a bool/int/float, imported elsewhere, a bad value)."""
    target, eq, value = text.partition("=")
    path, dot, name = target.strip().rpartition(".")
    if not eq or not dot or not path or not name:
        raise ValueError(f"setting {text!r}: expected PATH.NAME=VALUE, e.g. "
                         f"ops.linear.triton.SWAP_WS=0")
    module = path if path == PACKAGE or path.startswith(PACKAGE + ".") else f"{PACKAGE}.{path}"
    rel = module[len(PACKAGE) + 1:]
    if not _settable_module(rel):
        raise ValueError(f"setting {text!r}: {module} holds no settable constants (settings "
                         f"reach {', '.join(FAST_PATH)} and their modules, except the reference "
                         f"ops and the shared formats {', '.join(NOT_SETTABLE)})")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"setting {text!r}: no module {module} ({e})") from None
    if not _NAME.match(name) or not hasattr(mod, name):
        raise ValueError(f"setting {text!r}: {module} has no upper-case constant {name!r}")
    current = getattr(mod, name)
    if not isinstance(current, (bool, int, float)):
        raise ValueError(f"setting {text!r}: {module}.{name} is a "
                         f"{type(current).__name__}, expected a bool, int or float constant")
    if name in _bound_at_import():
        raise ValueError(f"setting {text!r}: {name} is {_bound_at_import()[name]}, fixed when "
                         f"that module was imported: setting {module}.{name} would not reach it")
    return Setting(module, name, _parse_value(value, current, f"setting {text!r}"))


def parse_variant(text: str) -> tuple[str, tuple[Setting, ...]]:
    """``NAME`` (the defaults) or ``NAME:SETTING,SETTING...`` as (name, settings)."""
    name, _, rest = text.partition(":")
    name = name.strip()
    if not name or not re.fullmatch(r"[\w.+=-]+", name):
        raise ValueError(f"variant {text!r}: expected NAME or NAME:PATH.NAME=VALUE,... with "
                         f"a NAME of letters, digits, _ . + = -")
    settings = tuple(parse_setting(s) for s in rest.split(",") if s.strip())
    if len({(s.module, s.name) for s in settings}) < len(settings):
        raise ValueError(f"variant {text!r}: a constant is set twice")
    return name, settings


def _comment(lines: list[str], lineno: int) -> str:
    """The comment of the assignment on line ``lineno`` (1-based): its inline comment, else the
    comment lines right above it, joined."""
    line = lines[lineno - 1]
    if "#" in line:
        return line.split("#", 1)[1].strip()
    above = []
    i = lineno - 2
    while i >= 0 and re.match(r"[A-Z][A-Z0-9_]* = ", lines[i]):  # one comment for the group
        i -= 1
    while i >= 0 and lines[i].lstrip().startswith("#"):
        above.insert(0, lines[i].lstrip()[1:].strip())
        i -= 1
    return " ".join(above)


def settable(prefixes: Iterable[str] = FAST_PATH) -> list[tuple[Setting, str]]:
    """Every constant a setting may name in the package's modules under ``prefixes`` (paths
    as settings write them; a module that cannot be imported here, e.g. without Triton, is
    left out), with its current value and its comment, in source order: what ``bench
    --settings`` lists."""
    found = []
    for rel, _, lines, tree in _sources():
        if not _settable_module(rel) or not _under(rel, prefixes):
            continue
        try:
            mod = importlib.import_module(f"{PACKAGE}.{rel}")
        except ImportError:
            continue
        for node in tree.body:
            if not (isinstance(node, (ast.Assign, ast.AnnAssign))):
                continue
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if not (isinstance(t, ast.Name) and _NAME.match(t.id)):
                    continue
                value = getattr(mod, t.id, None)
                if isinstance(value, (bool, int, float)) and t.id not in _bound_at_import():
                    found.append((Setting(mod.__name__, t.id, value),
                                  _comment(lines, node.lineno)))
    return found


_THIS = sys.modules[__name__]  # its caches read the source files, not the constants


def _clear_caches() -> None:
    """Forget what the package's cached functions computed from the constants."""
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not (mod_name == PACKAGE or mod_name.startswith(PACKAGE + ".")):
            continue
        for value in list(vars(mod).values()):
            if callable(getattr(value, "cache_clear", None)) and mod is not _THIS \
                    and getattr(value, "__module__", None) == mod_name:
                value.cache_clear()


@contextmanager
def tuned(settings: Iterable[Setting]) -> Iterator[None]:
    """Within the block each setting's constant has its value; after it (error or not) every
    one has the value it had before."""
    settings = tuple(settings)
    saved = []
    try:
        for s in settings:
            mod = sys.modules[s.module]
            saved.append((mod, s.name, getattr(mod, s.name)))
            setattr(mod, s.name, s.value)
        if settings:
            _clear_caches()
        yield
    finally:
        for mod, name, value in reversed(saved):
            setattr(mod, name, value)
        if settings:
            _clear_caches()
