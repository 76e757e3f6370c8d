"""Translate a traced torch.fx joint graph into the sbpc logical IR.

fx models a multi-result op as one node plus ``getitem`` nodes; the IR gives the op several
named results instead. Devices become ``#device`` so a plan runs on any backend. Every node
keeps its module path and the user's file:line; a backward node inherits both from the
forward op it differentiates (same autograd ``seq_nr``).
"""
from __future__ import annotations

import functools
import operator
import os
import re
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from sbpc.compiler.ir.types import DTYPE_BY_TORCH_NAME, DType, Node, Ref, Role, SourceLoc, Sym, TensorType
from sbpc.compiler.frontend.model_loader import display_path
from sbpc.errors import CaptureError

MODULE_KEY = "sbpc_module"
MAX_CONSTANT_NUMEL = 4096
_FRAME_RE = re.compile(r'File "([^"]+)", line (\d+)')
_NOT_IDENT = re.compile(r"[^A-Za-z0-9_]")
_LIBRARY_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch,))
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the package root
_SBPC_DIRS = tuple(os.path.join(_ROOT, d) + os.sep for d in ("compiler", "runtime"))


def value_name(text: str) -> str:
    """A readable IR value name for a parameter path such as ``h.0.attn.c_attn.weight``."""
    name = _NOT_IDENT.sub("_", text)
    return name if name[:1].isalpha() or name[:1] == "_" else f"v_{name}"


def tensor_type(t: torch.Tensor) -> TensorType:
    name = str(t.dtype).removeprefix("torch.")
    if name not in DTYPE_BY_TORCH_NAME:
        raise CaptureError(f"tensors of dtype {t.dtype} are not supported yet",
                           hint="use a float (float32, bfloat16, float16, float64), int64/32/16/8, uint8 or bool tensor")
    return TensorType(tuple(int(s) for s in t.shape), DTYPE_BY_TORCH_NAME[name])


class UnsupportedArg(Exception):
    """An argument the IR cannot hold: its type, or a dtype the plan has no name for."""


def convert_literal(a: Any) -> Any:
    """A python/torch constant as an IR argument (dtype, device, layout, scalar, string)."""
    if isinstance(a, torch.dtype):
        name = str(a).removeprefix("torch.")
        if name not in DTYPE_BY_TORCH_NAME:
            raise UnsupportedArg(f"dtype {name}")
        return DType(DTYPE_BY_TORCH_NAME[name])
    if isinstance(a, torch.device):
        return Sym("device")
    if isinstance(a, (torch.layout, torch.memory_format)):
        return Sym(str(a).removeprefix("torch."))
    if a is None or isinstance(a, (bool, int, float, complex, str)):
        return a
    raise UnsupportedArg(f"{a!r} of type {type(a).__name__}")


def convert_arg(a: Any, names: dict[torch.fx.Node, str] | None) -> Any:
    """A python/torch argument as an IR argument."""
    if isinstance(a, torch.fx.Node):
        return Ref(names[a])
    if isinstance(a, (list, tuple)):
        return [convert_arg(x, names) for x in a]
    try:
        return convert_literal(a)
    except UnsupportedArg as err:
        raise CaptureError(f"argument {err} cannot be put in a plan",
                           hint="ops may take tensors, numbers (complex too), strings, dtypes and lists of them") from None


@dataclass
class ImportedGraph:
    nodes: list[Node]
    names: dict[torch.fx.Node, str]  # fx node (or getitem) -> IR value name
    placeholders: list[torch.fx.Node]
    outputs: list[Any]  # the fx output node's flat args


def import_fx(graph: torch.fx.Graph, input_names: list[str] | None = None) -> ImportedGraph:
    """``input_names`` renames the placeholders, in order (fx names them ``arg0_1``...). The
    tensor constants of ``get_attr`` nodes are attributes of ``graph.owning_module``."""
    names: dict[torch.fx.Node, str] = {}
    given = iter(input_names or [])
    where = _Locations()
    locs = _forward_locations(graph, where)
    nodes: list[Node] = []
    placeholders = []
    outputs: list[Any] = []
    for n in graph.nodes:
        if n.op == "placeholder":
            names[n] = next(given, n.name)
            placeholders.append(n)
        elif n.op == "output":
            outputs = list(torch.utils._pytree.tree_flatten(n.args[0])[0])
        elif n.op == "call_function" and n.target is operator.getitem:
            continue  # named when its producer is imported
        elif n.op == "call_function":
            nodes.append(_import_node(n, names, locs, where))
        elif n.op == "get_attr":
            nodes.append(_import_constant(n, getattr(graph.owning_module, n.target), names))
        else:
            raise CaptureError(f"unexpected fx node {n.op} {n.name}")
    return ImportedGraph(nodes, names, placeholders, outputs)


def _import_node(n: torch.fx.Node, names: dict, locs: dict, where: _Locations) -> Node:
    val = n.meta.get("val")
    if isinstance(val, (tuple, list)):
        picks = {u.args[1]: u for u in n.users if u.target is operator.getitem}
        outs = []
        for i, _ in enumerate(val):
            user = picks.get(i)
            name = user.name if user is not None else f"{n.name}_r{i}"
            if user is not None:
                names[user] = name
            outs.append(name)
        types = [tensor_type(v) if isinstance(v, torch.Tensor) else TensorType((), "none") for v in val]
    else:
        names[n] = n.name
        outs, types = [n.name], [tensor_type(val)]
    role = Role.BACKWARD if n.meta.get("autograd_backward") else Role.FORWARD
    # Only backward ops borrow the location of their forward op: a forward op that autograd
    # does not track carries a stale seq_nr.
    loc = (locs.get(n.meta.get("seq_nr")) if role == Role.BACKWARD else None) or where(n)
    return Node(outputs=outs, op=str(n.target), args=tuple(convert_arg(a, names) for a in n.args),
                kwargs={k: convert_arg(v, names) for k, v in n.kwargs.items()}, types=types, role=role, loc=loc)


def _import_constant(n: torch.fx.Node, value: torch.Tensor, names: dict) -> Node:
    """A tensor literal created inside forward(); small ones travel in the plan."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(value, FakeTensor) or value.numel() > MAX_CONSTANT_NUMEL:
        raise CaptureError(f"forward() creates a tensor constant of shape {list(value.shape)} that sbpc cannot embed",
                           location=str(_location(n) or "") or None,
                           hint=f"register it as a buffer, or keep constants under {MAX_CONSTANT_NUMEL} elements")
    names[n] = n.name
    ttype = tensor_type(value)
    return Node([n.name], "sbpc.constant", (value.flatten().tolist(), list(value.shape)),
                {"dtype": DType(ttype.dtype)}, [ttype], Role.FORWARD, loc=_location(n))


def _forward_locations(graph: torch.fx.Graph, where: _Locations) -> dict[str, SourceLoc]:
    """seq_nr -> location of the forward op; backward ops look theirs up here."""
    out: dict[str, SourceLoc] = {}
    for n in graph.nodes:
        seq = n.meta.get("seq_nr")
        if n.op == "call_function" and not n.meta.get("autograd_backward") and seq not in (None, "-1", -1):
            loc = where(n)
            if loc is not None:
                out.setdefault(seq, loc)
    return out


class _Locations:
    """``_location`` of the nodes of one graph, parsed once per distinct stack trace and module:
    a stamped layer's copies share their stack trace strings (``stamp_expand``), so a 1T graph's
    ~11,000 ops have a few hundred of them."""

    def __init__(self):
        self._parsed: dict[tuple[str | None, str], SourceLoc | None] = {}

    def __call__(self, n: torch.fx.Node) -> SourceLoc | None:
        key = (n.meta.get("stack_trace"), (n.meta.get("custom") or {}).get(MODULE_KEY, ""))
        if key not in self._parsed:
            self._parsed[key] = _location(n)
        return self._parsed[key]


def _location(n: torch.fx.Node) -> SourceLoc | None:
    module = (n.meta.get("custom") or {}).get(MODULE_KEY, "")
    frames = _FRAME_RE.findall(n.meta.get("stack_trace") or "")
    user = [(f, int(line)) for f, line in frames if is_user_file(f)]
    if not user:
        return SourceLoc(module, "?", 0) if module else None
    file, line = user[-1]
    return SourceLoc(module, display_path(file), line)


def caller_location() -> SourceLoc | None:
    """The innermost frame of the current stack that is the user's code (not torch, not sbpc)."""
    cwd = os.getcwd()
    frame = sys._getframe(1)
    while frame is not None:
        if _is_user_file(frame.f_code.co_filename, cwd):
            return SourceLoc("", display_path(frame.f_code.co_filename), frame.f_lineno)
        frame = frame.f_back
    return None


def is_user_file(filename: str) -> bool:
    return _is_user_file(filename, os.getcwd())


@functools.lru_cache(maxsize=4096)
def _is_user_file(filename: str, cwd: str) -> bool:
    """Cached per working directory (a relative name is resolved against it): capture asks for
    every frame of every op, of a handful of files."""
    path = os.path.normpath(os.path.join(cwd, filename))
    return not path.startswith(_LIBRARY_DIRS) and not path.startswith(_SBPC_DIRS) and not filename.startswith("<")
