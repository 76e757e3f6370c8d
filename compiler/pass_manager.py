"""The pass manager: named passes, IR verification after each, LLVM-style IR dumps.

A pass is an object with a kebab-case ``name`` and ``apply(graph, ctx) -> graph``. Options are
dataclass fields; policies (cost models, partitioners) are passed in, never hard-wired.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Protocol, TextIO

from sbpc.compiler.ir.printer import print_graph
from sbpc.compiler.ir.types import Graph
from sbpc.compiler.ir.verify import verify
from sbpc.errors import OutputError, UsageError
from sbpc.runtime.files import write_atomic


class Pass(Protocol):
    name: str

    def apply(self, graph: Graph, ctx: "CompileContext") -> Graph: ...


@dataclass
class CompileContext:
    """What passes share: options and results that are not IR."""

    verify: bool = True
    print_after: set[str] = field(default_factory=set)
    print_after_all: bool = False
    dump_dir: str | None = None
    log: TextIO = field(default_factory=lambda: sys.stderr)
    estimates: dict[str, int] = field(default_factory=dict)
    allow_replicated: bool = False  # a mesh axis may split nothing (compiler/sbp/axis_use.py)


class PassManager:
    def __init__(self, passes: list[Pass], ctx: CompileContext):
        names = [p.name for p in passes]
        unknown = ctx.print_after - set(names) - {"capture"}
        if unknown:
            raise UsageError(f"--print-after names unknown pass {sorted(unknown)[0]!r}",
                             hint="passes: capture, " + ", ".join(names))
        self.passes = passes
        self.ctx = ctx

    def run(self, graph: Graph) -> Graph:
        self._after("capture", graph, 0)
        for i, p in enumerate(self.passes, start=1):
            graph = p.apply(graph, self.ctx)
            self._after(p.name, graph, i)
        return graph

    def _after(self, name: str, graph: Graph, index: int) -> None:
        if self.ctx.verify:
            verify(graph, after=name)
        wants_print = self.ctx.print_after_all or name in self.ctx.print_after
        if not (wants_print or self.ctx.dump_dir):
            return
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
