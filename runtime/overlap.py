"""The order of issued collectives: every ``sbpc.issue`` is waited for exactly once, after it
and inside its task; issues keep one order; nothing reads a result before its wait, nor
overwrites an input in place while it flies (gloo reads an all-gather's or reduce-scatter's
input buffer until the wait). All ranks of a stage run the same program, so
with this order a rank can only wait for a collective its peers have already issued (the
earliest waiting rank's collective was issued by every peer, which are all past it), and no
rank waits for another in a cycle. The compiler checks it after the overlap pass, and the
runtime again before any rank runs, so an edited plan fails in one line instead of hanging.
"""
from __future__ import annotations

from typing import Hashable, Iterator, Sequence

from sbpc.errors import PlanError
from sbpc.runtime.backend import OVERWRITTEN_LISTS, torch_op
from sbpc.runtime.kinds import ISSUE, WAIT


class OrderError(PlanError):
    """An issued collective waited for before it is issued, twice, or never (a deadlock)."""


def check_issue_order(program: Sequence[tuple[str, list[str], list[str], Hashable, list[str]]], *,
                      one_task: bool) -> None:
    """``program``: per instruction (op, outs, uses, task, the values it overwrites in place).
    ``one_task``: the program runs as one function (no pipeline), so a wait may be in another
    phase than its issue."""
    flying: dict[str, tuple[int, Hashable]] = {}
    reading: dict[str, set[str]] = {}  # issue -> the values it reads
    for k, (op, outs, uses, task, writes) in enumerate(program):
        for v in writes:
            w = next((w for w, vs in reading.items() if v in vs), None)
            if w is not None:
                raise OrderError(f"instruction {k} ({op}) overwrites %{v}, which %{w} sends while it is in flight",
                                 hint="the plan's issue and wait order is broken; recompile it")
        if op == ISSUE:
            flying[outs[0]] = (k, task)
            reading[outs[0]] = set(uses)
        elif op == WAIT:
            w = uses[0]
            if w not in flying:
                raise OrderError(f"deadlock: instruction {k} waits for %{w} before it is issued "
                                 f"(the peers of its group would wait for this rank forever)",
                                 hint="the plan's issue and wait order is broken; recompile it")
            at, issued_in = flying.pop(w)
            reading.pop(w)
            if not one_task and issued_in != task:
                raise OrderError(f"deadlock: %{w} is issued in task {issued_in} (instruction {at}) "
                                 f"but waited for in {task} (instruction {k})",
                                 hint="the plan's issue and wait order is broken; recompile it")
        for u in uses:
            if op != WAIT and u in flying:
                raise OrderError(f"instruction {k} ({op}) reads %{u}, a collective in flight",
                                 hint="the plan's issue and wait order is broken; recompile it")
    if flying:
        w, (at, _) = next(iter(flying.items()))
        raise OrderError(f"deadlock: %{w} issued at instruction {at} is never waited for",
                         hint="the plan's issue and wait order is broken; recompile it")


def check_plan(plan) -> None:
    """``check_issue_order`` of every stage program of ``plan``."""
    for prog in plan.stages:
        check_issue_order([(i.op, i.outs, uses(i), (i.stage, i.role), _overwritten(i)) for i in prog.instructions],
                          one_task=plan.pipeline is None)


def uses(ins) -> list[str]:
    """The values a plan instruction reads, in its args and kwargs (lists included)."""
    return _refs(ins.args) + _refs(list(ins.kwargs.values()))


def waits(instructions) -> dict[str, object]:
    """Work value of each ``sbpc.issue`` -> the ``sbpc.wait`` instruction that waits for it."""
    return {uses(i)[0]: i for i in instructions if i.op == WAIT}


def blocking(instructions) -> Iterator:
    """The instructions with each issued collective (``sbpc.issue`` ... ``sbpc.wait``) as the
    blocking call it stands for, at its issue: the collective's op, the wait's results."""
    from sbpc.runtime.kinds import Collective

    waited = waits(instructions)
    for ins in instructions:
        if ins.op == ISSUE:
            w = waited[ins.outs[0]]
            kwargs = {k: v for k, v in ins.kwargs.items() if k != "kind"}
            yield ins.model_copy(update=dict(op=Collective(ins.kwargs["kind"]).op, kwargs=kwargs, outs=w.outs,
                                             types=w.types))
        elif ins.op != WAIT:
            yield ins


def _overwritten(ins) -> list[str]:
    """What an in-place instruction writes over: its first argument (a foreach op's first list;
    fused AdamW's parameter and state lists)."""
    overload = torch_op(ins.op) if ins.args else None
    if overload is None or not overload._schema.is_mutable:
        return []
    return _refs([ins.args[k] for k in OVERWRITTEN_LISTS.get(ins.op, (0,)) if k < len(ins.args)])


def _refs(args) -> list[str]:
    out = []
    for a in args:
        if isinstance(a, list):
            out += _refs(a)
        elif hasattr(a, "ref"):
            out.append(a.ref)
    return out
