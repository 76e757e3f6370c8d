"""Execute a program: the instruction list becomes one generated Python function.

Loading turns ``%v = op(%a, 2, dtype=f32)`` into the line ``v7 = k3(v1, 2, dtype=c0)`` of a
straight-line function over local variables (as torch.fx does for a GraphModule), and ``del``s
each value after its last use. A step is then one call: no per-instruction interpretation.
When a kernel fails, the line number of the generated frame tells which instruction it was,
and the ``RuntimeFailure`` names it with the user's source line.
"""
from __future__ import annotations

import linecache
import math
from typing import Any, Callable

import torch

from sbpc.errors import RuntimeFailure
from sbpc.runtime.backend import Backend, returns_list, torch_op
from sbpc.runtime.kinds import MemoryKind
from sbpc.runtime.plan import ComplexArg, DTypeArg, FloatArg, Instruction, RefArg, SymArg, complex_value

_FIRST_LINE = 3  # generated source: "def ...", unpacking of inputs, then one line per instruction


class Program:
    def __init__(self, instructions: list[Instruction], inputs: list[str], outputs: list[str], backend: Backend,
                 *, generator: torch.Generator | None = None, name: str = "program"):
        self.instructions = instructions
        self.backend = backend
        self.generator = generator
        self.slots: dict[str, int] = {}
        self.constants: list[Any] = []
        self.kernels: list[Callable] = []
        self._device = backend.device  # of the instruction being generated
        self._same = _undone_transposes(instructions, outputs)
        ins_vars = ", ".join(self._var(n) for n in inputs)
        body = [self._line(k, ins) for k, ins in enumerate(instructions)]
        outs = ", ".join(self._use(n, "program output") for n in outputs)
        src = [f"def {name}(inputs, k, c):",
               f"    {ins_vars}{',' if len(inputs) == 1 else ''} = inputs" if inputs else "    pass",
               *body, f"    return [{outs}]"]
        self.source = "\n".join(src) + "\n"
        self.filename = f"<sbpc {name} {id(self):x}>"
        linecache.cache[self.filename] = (len(self.source), None, self.source.splitlines(True), self.filename)
        scope: dict[str, Any] = {}
        exec(compile(self.source, self.filename, "exec"), scope)
        self._fn = scope[name]

    def run(self, inputs: list) -> list:
        try:
            return self._fn(inputs, self.kernels, self.constants)
        except Exception as err:
            raise self._failure(err) from err

    def _line(self, k: int, ins: Instruction) -> str:
        if k in self._same:  # a transpose undone: the same tensor, no call
            src = self._use(self._same[k], "argument")
            line = f"{self._var(ins.outs[0])} = {src}"
            dead = [self._use(f, "free") for f in ins.free]
            return f"    {line}" + (f"; del {', '.join(dead)}" if dead else "")
        kernel = self.backend.kernel(ins.op)
        # an OpOverload's __call__ is one Python frame around its C++ operator: call that directly
        self.kernels.append(getattr(kernel, "_op", kernel))
        # `#device` is the device of the instruction's memory: the cpu for the offloaded optimizer's
        self._device = self.backend.device if ins.memory == MemoryKind.DEVICE else torch.device("cpu")
        args = [self._arg(a) for a in ins.args]
        args += [f"{k}={self._arg(v)}" for k, v in ins.kwargs.items()]
        # the op's own schema: an in-place op that returns nothing runs through a wrapper (`_first_argument`)
        schema = getattr(kernel, "_schema", None) or getattr(torch_op(ins.op), "_schema", None)
        if self.generator is not None and schema is not None and any(a.name == "generator" for a in schema.arguments):
            args.append(f"generator={self._const(self.generator)}")
        call = f"k[{len(self.kernels) - 1}]({', '.join(args)})"
        outs = [self._var(o) for o in ins.outs]
        listed = len(outs) > 1 or returns_list(ins.op)  # a list of one tensor is unpacked too
        target = (", ".join(outs) + "," if listed else outs[0]) if outs else ""
        line = f"{target} = {call}" if target else call
        dead = [self._use(f, "free") for f in ins.free]
        return f"    {line}" + (f"; del {', '.join(dead)}" if dead else "")

    def _var(self, name: str) -> str:
        self.slots[name] = len(self.slots)
        return f"v{self.slots[name]}"

    def _use(self, name: str, what: str) -> str:
        if name not in self.slots:
            raise RuntimeFailure(f"plan reads value %{name} ({what}) before it is defined", hint="the plan is corrupt; recompile it")
        return f"v{self.slots[name]}"

    def _const(self, value: Any) -> str:
        self.constants.append(value)
        return f"c[{len(self.constants) - 1}]"

    def _arg(self, a: Any) -> str:
        if isinstance(a, RefArg):
            return self._use(a.ref, "argument")
        if isinstance(a, list):
            return "[" + ", ".join(self._arg(x) for x in a) + "]"
        if isinstance(a, DTypeArg):
            return self._const(getattr(torch, a.dtype))
        if isinstance(a, SymArg):
            return self._const(self._device if a.sym == "device" else getattr(torch, a.sym))
        if isinstance(a, FloatArg) or (isinstance(a, float) and not math.isfinite(a)):
            return self._const(float(a.float if isinstance(a, FloatArg) else a))
        if isinstance(a, ComplexArg):
            return self._const(complex_value(a))
        return repr(a)  # int, finite float, bool, None, str: repr round-trips exactly

    def _failure(self, err: Exception) -> Exception:
        if isinstance(err, RuntimeFailure):
            return err
        tb, line = err.__traceback__, None
        while tb is not None:
            if tb.tb_frame.f_code.co_filename == self.filename:
                line = tb.tb_lineno
            tb = tb.tb_next
        index = line - _FIRST_LINE if line is not None else -1
        if not 0 <= index < len(self.instructions):
            return err
        ins = self.instructions[index]
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        outs = ", ".join("%" + o for o in ins.outs) or "(in place)"
        return RuntimeFailure(f"{ins.op} -> {outs} failed: {type(err).__name__}: {first}",
                              location=str(ins.loc) if ins.loc else None,
                              hint="if eager PyTorch raises the same there (under torch.autocast for --precision "
                                   "bf16/fp16), fix that line of the model; if not, the plan is wrong: report it "
                                   "(`sbpc check` compares the two); --debug shows the trace")


_TRANSPOSES = frozenset({"aten.t.default", "aten.transpose.int"})


def _swap(ins: Instruction) -> tuple[int, int] | None:
    """The two dims a transpose swaps, from its result's rank (None for ``t`` of a 0-d or 1-d tensor, a no-op)."""
    rank = len(ins.types[0].shape) if ins.types else None
    if ins.op == "aten.t.default":
        return (0, 1) if rank == 2 else None
    if rank is None or len(ins.args) != 3 or not all(isinstance(a, int) for a in ins.args[1:]):
        return (-1, -1)  # not understood: never matches
    return tuple(sorted(a % rank for a in ins.args[1:]))


def _undone_transposes(instructions: list[Instruction], outputs: list[str]) -> dict[int, str]:
    """Instructions that need no kernel call, by index -> the value they are: ``t(t(x))`` and a
    transpose of the same two dims' transpose give a view with ``x``'s sizes and strides, so the
    line binds ``x`` itself (the backward's weight gradients are such pairs: 51 of the 376
    instructions of a 4-layer GPT step). The inner transpose is skipped too where the outer one
    is its only reader (it binds ``x`` and the outer binds that); otherwise ``x`` must still be
    alive at the outer one (not freed before it)."""
    made = {o: k for k, ins in enumerate(instructions) for o in ins.outs}
    readers: dict[str, int] = {}
    for ins in instructions:
        for a in [*ins.args, *ins.kwargs.values()]:
            for r in (a if isinstance(a, list) else [a]):
                if isinstance(r, RefArg):
                    readers[r.ref] = readers.get(r.ref, 0) + 1
    for o in outputs:
        readers[o] = readers.get(o, 0) + 1
    freed = {f: k for k, ins in enumerate(instructions) for f in ins.free}
    same: dict[int, str] = {}
    for k, ins in enumerate(instructions):
        if ins.op not in _TRANSPOSES or not ins.args or not isinstance(ins.args[0], RefArg) or len(ins.outs) != 1:
            continue
        inner_at = made.get(ins.args[0].ref)
        if inner_at is None:
            continue
        inner = instructions[inner_at]
        if inner.op not in _TRANSPOSES or not isinstance(inner.args[0], RefArg) or _swap(inner) != _swap(ins) \
                or _swap(ins) in (None, (-1, -1)):
            continue
        if inner_at in same:  # a chain of three or more: only pairs are undone
            continue
        x = inner.args[0].ref
        if readers.get(ins.args[0].ref) == 1:
            same[inner_at] = x
            same[k] = ins.args[0].ref
        elif freed.get(x, len(instructions)) >= k:
            same[k] = x
    return same
