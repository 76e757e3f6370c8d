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
from sbpc.runtime.backend import Backend
from sbpc.runtime.kinds import MemoryKind
from sbpc.runtime.plan import DTypeArg, FloatArg, Instruction, RefArg, SymArg

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
        ins_vars = ", ".join(self._var(n) for n in inputs)
        body = [self._line(ins) for ins in instructions]
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

    def _line(self, ins: Instruction) -> str:
        kernel = self.backend.kernel(ins.op)
        # an OpOverload's __call__ is one Python frame around its C++ operator: call that directly
        self.kernels.append(getattr(kernel, "_op", kernel))
        # `#device` is the device of the instruction's memory: the cpu for the offloaded optimizer's
        self._device = self.backend.device if ins.memory == MemoryKind.DEVICE else torch.device("cpu")
        args = [self._arg(a) for a in ins.args]
        args += [f"{k}={self._arg(v)}" for k, v in ins.kwargs.items()]
        schema = getattr(kernel, "_schema", None)
        if self.generator is not None and schema is not None and any(a.name == "generator" for a in schema.arguments):
            args.append(f"generator={self._const(self.generator)}")
        call = f"k[{len(self.kernels) - 1}]({', '.join(args)})"
        outs = [self._var(o) for o in ins.outs]
        target = (outs[0] if len(outs) == 1 else ", ".join(outs) + ",") if outs else ""
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
                              hint="run `sbpc check` on the model to compare it with eager PyTorch; use --debug for the trace")
