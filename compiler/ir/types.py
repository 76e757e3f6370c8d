"""The logical IR: typed values, nodes and graphs.

A ``Graph`` is SSA: every ``Value`` is defined once, by a graph input or by a node's result,
before any use. Nodes hold ATen (or ``sbpc.*``) operators with positional and keyword
arguments; an argument is a python literal, a ``Ref`` to a value, a ``DType`` or a ``Sym``
(device, layout, memory format). Placement (``stage``) and nd-SBP live in typed fields that
passes fill in; nothing is stuck onto nodes ad hoc.

The graph also carries the ``init`` region: the recorded construction of the parameters and
buffers (factories and in-place random fills), replayed by the runtime from a seed.
"""
from __future__ import annotations

import enum
import operator
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Sequence

from sbpc.compiler.ir.mesh import Mesh
from sbpc.runtime.kinds import MemoryKind
from sbpc.runtime.plan import DTYPES, PipelineSpec
from sbpc.runtime.sbp import NdSbp, local_shape

DTYPE_BY_TORCH_NAME = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class TensorType:
    shape: tuple[int, ...]
    dtype: str  # short name, a key of DTYPES

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(map(str, self.shape))}]"

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_size(self.dtype)

    def local_nbytes(self, nd: NdSbp | None, sizes: tuple[int, ...]) -> int:
        """Bytes each device holds when laid out as ``nd`` over axes of ``sizes`` (None: whole)."""
        if nd is None:
            return self.nbytes
        n = 1
        for d in local_shape(self.shape, nd, sizes):
            n *= d
        return n * dtype_size(self.dtype)


def dtype_size(dtype: str) -> int:
    return {"f64": 8, "i64": 8, "c64": 8, "f32": 4, "i32": 4, "f16": 2, "bf16": 2, "i16": 2, "work": 0}.get(dtype, 1)


@dataclass(frozen=True)
class Ref:
    """A use of a value, by name."""

    name: str

    def __repr__(self) -> str:
        return f"%{self.name}"


@dataclass(frozen=True)
class DType:
    name: str  # short name, a key of DTYPES

    def __repr__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Sym:
    """A symbolic constant: ``device`` (filled in by the runtime), a layout or memory format."""

    name: str

    def __repr__(self) -> str:
        return f"#{self.name}"


class Role(enum.Enum):
    PRE = "pre"  # per micro-batch, before any forward (the inputs of a sum over micro-batches)
    FORWARD = "fwd"
    BACKWARD = "bwd"
    OPTIMIZER = "opt"
    INIT = "init"


class InputKind(enum.Enum):
    PARAM = "param"
    BUFFER = "buffer"
    STATE = "state"  # optimizer state
    BATCH = "batch"
    # a per-step scalar the runtime gives each step, not a state the step updates: the learning
    # rate ("lr", f64[], B on every axis), so one plan follows any schedule
    HYPER = "hyper"


class OutputKind(enum.Enum):
    LOSS = "loss"
    GRAD = "grad"  # the gradient of a parameter, before the optimizer
    UPDATE = "update"  # the new value of a param or optimizer state
    INIT = "init"  # init region: the constructed value of a param or buffer
    METRIC = "metric"  # a number of the step the runtime reports: "grad_norm" (--clip-grad)


@dataclass(frozen=True)
class SourceLoc:
    module: str  # module path such as "h.0.attn", "" for the root
    file: str
    line: int

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}"
        return f"{self.module} @ {where}" if self.module else where


@dataclass
class Node:
    outputs: list[str]  # result value names, possibly none (in-place init ops)
    op: str  # "aten.mm.default", "sbpc.attention"
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    types: list[TensorType]  # one per output
    role: Role
    loc: SourceLoc | None = None
    stage: int | None = None  # placement: the pipeline stage
    sbp: list[NdSbp] | None = None  # one nd-SBP per output
    sbp_in: list[NdSbp] | None = None  # the nd-SBP it needs of each tensor use, in uses() order
    # how propagation (or a pass) chose it, for `sbpc explain`: not in the text IR, so not in a node's identity
    why: str | None = field(default=None, compare=False)
    memory: MemoryKind = MemoryKind.DEVICE  # placement's memory: host for the offloaded optimizer
    # uses() of the ``args`` and ``kwargs`` objects it was computed from (see uses); not a field
    # of the node's identity, and dataclasses.replace starts the copy without it
    _uses: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def uses(self) -> tuple[str, ...]:
        """The values it reads, in argument order, keyword arguments last. Passes call this
        millions of times on a 1T-parameter graph (every pass and the verifier walk every
        node's uses), so it is computed once per node and kept with the ``args`` and ``kwargs``
        objects it came from: a pass that gives a node new arguments (assigning ``args`` or
        ``kwargs``, or ``dataclasses.replace``) gets its new uses. Arguments are never changed
        in place (a pass builds new tuples and dicts), which is what makes the cache valid."""
        cached = self._uses
        if cached is not None and cached[0] is self.args and cached[1] is self.kwargs:
            return cached[2]
        out: list[str] = []
        _refs(self.args, out)
        if self.kwargs:
            _refs(self.kwargs.values(), out)
        uses = tuple(out)
        self._uses = (self.args, self.kwargs, uses)
        return uses

    def replace(self, **changes: Any) -> "Node":
        """``dataclasses.replace(self, **changes)`` at a third of its cost: passes copy a node
        ~200k times at 1T, and ``replace`` builds keyword arguments from every field. The copy
        is made by ``__init__`` (a copied ``__dict__`` would leave the node without CPython's
        inline attribute values, which makes every later attribute read of it slower) and keeps
        the uses cache, which stays valid: it is checked against the ``args`` and ``kwargs``
        objects it came from."""
        if not _NODE_FIELDS.issuperset(changes):
            raise TypeError(f"Node has no field {sorted(changes.keys() - _NODE_FIELDS)[0]!r}")
        new = Node(*_node_fields(self))
        new._uses = self._uses
        for name, value in changes.items():
            setattr(new, name, value)
        return new


_NODE_INIT = tuple(f.name for f in fields(Node) if f.init)  # in __init__'s order
_NODE_FIELDS = frozenset(_NODE_INIT)
_node_fields = operator.attrgetter(*_NODE_INIT)


def map_refs(a: Any, fn: Callable[[str], str]) -> Any:
    """``a`` with every ``Ref`` renamed by ``fn``, through lists, tuples and dicts."""
    if isinstance(a, Ref):
        return Ref(fn(a.name))
    if isinstance(a, dict):
        return {k: map_refs(v, fn) for k, v in a.items()}
    if isinstance(a, (list, tuple)):
        return type(a)(map_refs(x, fn) for x in a)
    return a


class FreshNames:
    """New value names that collide with none in ``taken`` (which it extends): ``x``, ``x_1``, ..."""

    def __init__(self, taken: set[str]):
        self.taken = taken

    def __call__(self, base: str) -> str:
        i, name = 0, base
        while name in self.taken:
            i += 1
            name = f"{base}_{i}"
        self.taken.add(name)
        return name


def rename_uses(n: Node, fn: Callable[[str], str]) -> Node:
    return n.replace(args=map_refs(n.args, fn), kwargs=map_refs(n.kwargs, fn))


def producers(nodes: Sequence[Node]) -> dict[str, int]:
    """Value name -> the index of the node that makes it (graph inputs are not in it)."""
    return {o: i for i, n in enumerate(nodes) for o in n.outputs}


def users(nodes: Sequence[Node]) -> dict[str, list[int]]:
    """Value name -> the indices of the nodes that read it, each node once, in program order."""
    out: dict[str, list[int]] = {}
    for i, n in enumerate(nodes):
        for u in dict.fromkeys(n.uses()):
            out.setdefault(u, []).append(i)
    return out


def _refs(args: Any, out: list[str]) -> None:
    """Append the names of the ``Ref``s in ``args`` (through lists and tuples) to ``out``."""
    for a in args:
        if isinstance(a, Ref):
            out.append(a.name)
        elif isinstance(a, (list, tuple)):
            _refs(a, out)


@dataclass(frozen=True)
class StateName:
    """The name of an optimizer state input: which state of which parameter. Its text form
    (in the IR, the plan and checkpoints) is ``exp_avg:h.0.attn.c_attn.weight``; the step
    counter, shared by every parameter, is ``step``."""
    state: str  # exp_avg, exp_avg_sq, momentum_buffer, step; master (--offload optimizer: the host's copy)
    param: str | None = None  # the parameter's FQN; None: shared

    def __str__(self) -> str:
        return self.state if self.param is None else f"{self.state}:{self.param}"

    @classmethod
    def parse(cls, text: str) -> StateName:
        state, sep, param = text.partition(":")
        return cls(state, param if sep else None)


@dataclass
class GraphInput:
    kind: InputKind
    value: str
    type: TensorType
    name: str  # param/buffer FQN, a StateName's text ("exp_avg:h.0.attn.c_attn.weight"), "batch.0" or "lr"
    sbp: NdSbp | None = None
    why: str | None = None  # where its SBP came from (`sbpc explain`); not in the text IR
    memory: MemoryKind = MemoryKind.DEVICE  # where the runtime holds it between steps

    @property
    def state_of(self) -> str | None:
        """For optimizer state, the parameter it belongs to (None: not state, or the shared step)."""
        return StateName.parse(self.name).param if self.kind == InputKind.STATE else None


@dataclass
class GraphOutput:
    kind: OutputKind
    value: str
    name: str  # the loss is named "loss"; others name the param, state or buffer


@dataclass
class Graph:
    name: str
    mesh: Mesh
    inputs: list[GraphInput] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)
    outputs: list[GraphOutput] = field(default_factory=list)
    init: list[Node] = field(default_factory=list)
    init_outputs: list[GraphOutput] = field(default_factory=list)
    schedule: PipelineSpec | None = None  # set by the schedule pass on pipelined meshes
    # module paths whose ops form row-wise regions (compiler/sbp/rowwise.py): found by capture
    # (Hugging Face's experts modules); after sbp-propagate, the ones it split as regions
    rowwise: tuple[str, ...] = ()
    # forward values whose conversions the backward makes again instead of keeping the forward's
    # (sbp-propagate's memory term decides, boxing does it); not in the text IR, used up by boxing
    regather: frozenset[str] = frozenset()
    # the pipeline's task graph of these nodes (compiler/passes/schedule.py's task_graph), kept
    # with the node and output lists it was built from; not part of the graph's identity
    _tasks: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def value_types(self) -> dict[str, TensorType]:
        types = {i.value: i.type for i in self.inputs}
        for n in self.nodes:
            types.update(zip(n.outputs, n.types))
        return types

    def producers(self) -> dict[str, int]:
        """Value name -> the index in ``nodes`` of the node that makes it."""
        return producers(self.nodes)

    def users(self) -> dict[str, list[int]]:
        """Value name -> the indices in ``nodes`` of its readers, each once, in program order."""
        return users(self.nodes)

    def outputs_of(self, kind: OutputKind) -> list[GraphOutput]:
        return [o for o in self.outputs if o.kind == kind]

    def inputs_of(self, kind: InputKind) -> list[GraphInput]:
        return [i for i in self.inputs if i.kind == kind]
