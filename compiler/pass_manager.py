"""The pass manager: named passes, their contracts, IR verification after each, LLVM-style IR dumps.

A pass is an object with a kebab-case ``name`` and ``apply(graph, ctx) -> graph``. Options are
dataclass fields; policies (cost models, partitioners) are passed in, never hard-wired. A pass
declares the facts it ``needs`` and ``provides`` (class attributes; a pass that declares none
needs and provides nothing); the manager checks a pass list before it runs anything, so a
missing prerequisite is a one-line error naming the pass, the fact and who provides it.
"""
from __future__ import annotations

import dataclasses
import copy
import enum
import operator
import os
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Iterable, Protocol, TextIO

from sbpc.compiler.ir.printer import print_graph
from sbpc.compiler.ir.types import Graph
from sbpc.compiler.ir.verify import verify
from sbpc.errors import CompileError, IRError, OutputError, PassBug, UsageError
from sbpc.runtime.files import write_atomic

if TYPE_CHECKING:
    from sbpc.compiler.sbp.cost_model import CostModel


class Fact(enum.Enum):
    """What a pass leaves in the IR or the context for the steps after it."""
    STAGES = "every op placed on a pipeline chunk"
    SBP = "an nd-SBP for every value"
    BOXED = "the collectives that give every op the SBP it needs"
    LOCAL = "per-device shape arguments"
    ESTIMATES = "the memory estimates"


class Pass(Protocol):
    name: str
    needs: ClassVar[tuple[Fact, ...]]
    provides: ClassVar[tuple[Fact, ...]]

    def apply(self, graph: Graph, ctx: "CompileContext") -> Graph: ...


@dataclass
class CompileContext:
    """What passes share: options and results that are not IR."""

    verify: bool = True
    print_after: set[str] = field(default_factory=set)
    print_after_all: bool = False
    dump_dir: str | None = None
    log: TextIO = field(default_factory=lambda: sys.stderr)
    estimates: dict[str, object] = field(default_factory=dict)  # the fields of runtime.plan.Estimates
    # wall seconds per pass name, and "verify" for the verifier after each: summed over every run
    # of the pipeline in one compile (--recompute auto and the --device-memory price ladder run
    # it more than once); contexts made with dataclasses.replace share the dict
    pass_seconds: dict[str, float] = field(default_factory=dict)
    allow_replicated: bool = False  # a mesh axis may split nothing (compiler/sbp/axis_use.py)
    # the process ends right after this compile (`sbpc compile` from a shell, which leaves by
    # os._exit): the objects it made are not walked for cycles after it (compiler/gc_pause.py)
    process_exits: bool = False
    # what the passes plan with (propagation, the schedule's transfers): None is AlphaBeta;
    # `sbpc compile --cluster` gives the cluster's ClusterCost (compiler/sbp/cost_model.py)
    cost_model: CostModel | None = None


class PassManager:
    def __init__(self, passes: list[Pass], ctx: CompileContext, given: Iterable[Fact] = ()):
        """``given``: the facts the input graph already has (IR read back after some passes)."""
        names = [p.name for p in passes]
        unknown = ctx.print_after - set(names) - {"capture"}
        if unknown:
            raise UsageError(f"--print-after names unknown pass {sorted(unknown)[0]!r}",
                             hint="passes: capture, " + ", ".join(names))
        self.passes = passes
        self.ctx = ctx
        self.facts = set(given)  # once every pass has run: what the graph has
        for p in passes:
            self.require(p.name, getattr(p, "needs", ()))
            self.facts.update(getattr(p, "provides", ()))

    def require(self, step: str, needs: Iterable[Fact]) -> None:
        """``step`` (a pass, or ``lower`` after them all) needs ``needs`` of the passes before it."""
        from sbpc.compiler.passes import REGISTRY  # the passes import this module

        for fact in needs:
            if fact not in self.facts:
                makers = [name for name, p in REGISTRY.items() if fact in p.provides]
                raise CompileError(f"{step} needs {fact.value}, which no pass before it provides",
                                   hint=f"run {' or '.join(makers)} before {step}" if makers else None)

    def run(self, graph: Graph) -> Graph:
        checked = self._after("capture", graph, 0)
        for i, p in enumerate(self.passes, start=1):
            t0 = time.perf_counter()
            before = _fields(graph)
            graph = p.apply(graph, self.ctx)
            self._count(p.name, t0)
            # a pass with nothing to do returns its input, or a graph whose fields hold the same
            # objects: it was verified already (nodes are never changed in place: Node.uses
            # relies on it too)
            same = all(_same(a, b) for a, b in zip(_fields(graph)[1:], before[1:]))
            checked = self._after(p.name, graph, i, verified=same, checked=checked) or checked
        return graph

    def _count(self, name: str, t0: float) -> None:
        seconds = self.ctx.pass_seconds
        seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - t0

    def _after(self, name: str, graph: Graph, index: int, verified: bool = False,
               checked: Graph | None = None) -> Graph | None:
        """Verifies ``graph`` (unless ``verified``), only the nodes that ``checked`` (the graph
        verified last) does not hold checked alone; prints and dumps it as asked. Returns a
        shallow copy of it once verified: its fields as they were then, whatever a pass later
        assigns to the graph's."""
        done = None
        if self.ctx.verify and not verified:
            t0 = time.perf_counter()
            try:
                verify(graph, after=name, checked=checked)
            except IRError as err:
                if index == 0:  # the input: a capture's graph, or the IR a user gave `sbpc opt`
                    raise
                raise PassBug(f"pass {name!r} broke the IR: {err.message}" +
                              (f" (at {err.location})" if err.location else "")) from err
            self._count("verify", t0)
            done = copy.copy(graph)
        wants_print = self.ctx.print_after_all or name in self.ctx.print_after
        if not (wants_print or self.ctx.dump_dir):
            return done
        text = print_graph(graph)
        if wants_print:
            print(f"// ----- IR after {name} -----", file=self.ctx.log)
            print(text, file=self.ctx.log)
        if self.ctx.dump_dir:
            try:
                os.makedirs(self.ctx.dump_dir, exist_ok=True)
            except OSError as err:
                raise OutputError(f"cannot create the --dump-dir {self.ctx.dump_dir!r}: {err.strerror or err}",
                                  hint="pass a directory you can write") from err
            write_atomic(os.path.join(self.ctx.dump_dir, f"{index:02d}-{name}.sbpir"), text)
        return done


def _same(a: object, b: object) -> bool:
    """One object, or lists of the same objects (a pass that copied a list and changed nothing)."""
    if a is b:
        return True
    return type(a) is list and type(b) is list and len(a) == len(b) and all(map(operator.is_, a, b))


def _fields(graph: Graph) -> tuple:
    """The graph and its fields' objects (held, so that none is freed and its address reused)."""
    return (graph,) + tuple(getattr(graph, f.name) for f in dataclasses.fields(graph))
