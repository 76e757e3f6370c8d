"""Execute a stage program: instructions in order, values in numbered slots.

Loading resolves every op to a kernel and every value name to a slot once, so a step is a
tight loop. Each instruction frees the values whose last use it is. A failing kernel becomes a
``RuntimeFailure`` that names the instruction and the user's source line.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from sbpc.errors import RuntimeFailure
from sbpc.runtime.backend import Backend
from sbpc.runtime.plan import DTypeArg, FloatArg, Instruction, RefArg, SymArg


class Slot(int):
    """An argument that reads the value in this slot."""


@dataclass
class _Step:
    fn: Callable
    args: list
    kwargs: dict
    outs: list[int]
    free: list[int]
    instr: Instruction
    has_refs: bool


class Program:
    def __init__(self, instructions: list[Instruction], inputs: list[str], backend: Backend):
        self.slots: dict[str, int] = {name: i for i, name in enumerate(inputs)}
        self.backend = backend
        self.steps = [self._load(ins) for ins in instructions]

    def slot(self, name: str) -> int:
        return self.slots[name]

    def _load(self, ins: Instruction) -> _Step:
        for o in ins.outs:
            self.slots.setdefault(o, len(self.slots))
        args = [self._decode(a) for a in ins.args]
        kwargs = {k: self._decode(v) for k, v in ins.kwargs.items()}
        has_refs = _contains_slot(args) or _contains_slot(list(kwargs.values()))
        return _Step(self.backend.kernel(ins.op), args, kwargs, [self.slots[o] for o in ins.outs],
                     [self.slots[f] for f in ins.free], ins, has_refs)

    def _decode(self, a: Any) -> Any:
        if isinstance(a, RefArg):
            if a.ref not in self.slots:
                raise RuntimeFailure(f"plan reads value %{a.ref} before it is defined",
                                     hint="the plan is corrupt; recompile it")
            return Slot(self.slots[a.ref])
        if isinstance(a, DTypeArg):
            return getattr(torch, a.dtype)
        if isinstance(a, SymArg):
            return self.backend.device if a.sym == "device" else getattr(torch, a.sym)
        if isinstance(a, FloatArg):
            return float(a.float)
        if isinstance(a, list):
            return [self._decode(x) for x in a]
        return a

    def run(self, env: list) -> list:
        """Run every instruction over ``env`` (inputs in their slots); returns env."""
        env.extend([None] * (len(self.slots) - len(env)))
        for st in self.steps:
            if st.has_refs:
                args = [_read(a, env) for a in st.args]
                kwargs = {k: _read(v, env) for k, v in st.kwargs.items()}
            else:
                args, kwargs = st.args, st.kwargs
            try:
                out = st.fn(*args, **kwargs)
            except Exception as err:
                raise _failure(st.instr, err) from err
            if len(st.outs) == 1:
                env[st.outs[0]] = out
            else:
                for slot, value in zip(st.outs, out):
                    env[slot] = value
            for slot in st.free:
                env[slot] = None
        return env


def _read(a, env):
    if type(a) is Slot:
        return env[a]
    if type(a) is list:
        return [_read(x, env) for x in a]
    return a


def _contains_slot(args) -> bool:
    return any(type(a) is Slot or (type(a) is list and _contains_slot(a)) for a in args)


def _failure(ins: Instruction, err: Exception) -> RuntimeFailure:
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    outs = ", ".join("%" + o for o in ins.outs) or "(in place)"
    return RuntimeFailure(f"{ins.op} -> {outs} failed: {type(err).__name__}: {first}",
                          location=str(ins.loc) if ins.loc else None,
                          hint="run `sbpc check` on the model to compare it with eager PyTorch; use --debug for the trace")
