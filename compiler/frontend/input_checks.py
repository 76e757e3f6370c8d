"""A library's check of its input, read as a runtime assertion instead of a branch.

torch's ``F.gaussian_nll_loss`` validates its variance with ``elif torch.any(var < 0): raise
ValueError(...)``: a read of a tensor's value, which the fake tensors of a capture do not have
("data-dependent control flow"). The branch only decides whether to raise: on any input the
loss accepts, it is not taken. So when a read is

- on a line of an installed library (torch, Hugging Face: under site-packages; not the user's
  own code, whose branches stay refused: which way one goes is the model's meaning), and
- the whole test of an ``if`` or ``elif`` (``if T:`` or ``if not T:``, or the last operand of
  an ``and``/``or`` whose other operands no tensor decides; no chained comparison; the read the
  branch's own truth test, not a ``bool()`` inside it) whose body only raises,

``ConstantReads`` answers the value that passes, and the check is recorded: at the end of the
traced step the loss goes through ``sbpc.check_input(loss, bad, message)``
(``runtime/input_checks.py``), which raises the library's error at run time when any element of
``bad`` is true (a ``ValueError`` with the library's text and lines). A plan therefore refuses
the step eager refuses, on that step's values. In an ``and``/``or`` the operands before the
last are predicates no tensor decides (``labels is not None and labels.max() >= vocab``,
Hugging Face's CTC heads), decided by the trace's own values, so the last operand is the test's
truth. ``bad`` is the test's tensor (negated
for ``if not T``); a full ``any`` is dropped for the elements it reads, and ``max(y) >= c`` made
``y >= c`` (``unreduce``), so the check splits with them (each rank checks its block, a
micro-batch its rows) instead of gathering them. The check runs where the loss is made: a bad
value that a kernel cannot take either (a label past the classes) fails in that kernel first.
"""
from __future__ import annotations

import ast
import dis
import functools
import linecache
import os
import site
import sys
import sysconfig
from dataclasses import replace

import torch

import sbpc.compiler
from sbpc.compiler.frontend.fx_import import caller_location
from sbpc.compiler.frontend.model_loader import display_path
from sbpc.compiler.ir.types import Ref, TensorType, producers
from sbpc.runtime.input_checks import CHECK_INPUT

_TORCH = os.path.dirname(torch.__file__) + os.sep
# the frames between a Python-level read (``if T:``) and the dispatch mode that answers it
_MACHINERY = tuple(_TORCH + p for p in ("_dynamo", "_compile.py", "utils/_python_dispatch.py", "_subclasses", "fx",
                                        "overrides.py", "_ops.py", "_tensor.py"))
_SBPC = os.path.dirname(sbpc.compiler.__file__) + os.sep
_LIBRARIES = tuple({os.path.abspath(p) + os.sep for p in (*site.getsitepackages(), site.getusersitepackages(),
                                                          sysconfig.get_paths()["purelib"], _TORCH)})


class InputChecks:
    """The checks answered while tracing one step: (bad, the error's text and lines)."""

    def __init__(self) -> None:
        self.checks: list[tuple[torch.Tensor, str]] = []

    def answer(self, t: torch.Tensor) -> bool | None:
        """The passing value of the read of ``t`` when it is a library's input check (and the
        check recorded), else None."""
        if t.dtype != torch.bool or t.numel() != 1:
            return None
        frame = _reader(sys._getframe(1))
        if frame is None or not _installed(frame.f_code.co_filename) or not _branches(frame):
            return None
        found = _raising_test(frame.f_code.co_filename, frame.f_lineno)
        if found is None:
            return None
        negated, message = found
        where = f"{display_path(frame.f_code.co_filename)}:{frame.f_lineno}"
        caller = caller_location()
        where += f", called at {caller.file}:{caller.line}" if caller is not None else ""
        self.checks.append((torch.logical_not(t) if negated else t, f"{message} ({where})"))
        return negated

    def apply(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` through every check recorded (outside autograd: the gradients are the loss's)."""
        for bad, message in self.checks:
            loss = torch.ops.sbpc.check_input.default(loss.detach(), bad, message)
        return loss


def _reader(frame):
    """The frame that read the value: the first outside torch's dispatch machinery and sbpc."""
    while frame is not None:
        name = os.path.abspath(frame.f_code.co_filename)
        if not name.startswith(_MACHINERY) and not name.startswith(_SBPC):
            return frame
        frame = frame.f_back
    return None


def _installed(filename: str) -> bool:
    """Whether ``filename`` is an installed library's (torch, Hugging Face: under site-packages),
    not the user's own code."""
    return os.path.abspath(filename).startswith(_LIBRARIES)


def _branches(frame) -> bool:
    """Whether the frame reads the value to branch on it (``if T:``), not inside the test
    (``if f(bool(T)):``, ``if T.item() > 0:``): its instruction is a conditional jump (or, from
    Python 3.13, the truth test before one)."""
    op = _instructions(frame.f_code).get(frame.f_lasti)
    return op is not None and (op.startswith("POP_JUMP") or op == "TO_BOOL")


@functools.lru_cache(maxsize=256)
def _instructions(code) -> dict[int, str]:
    return {i.offset: i.opname for i in dis.get_instructions(code)}


def _raising_test(filename: str, line: int) -> tuple[bool, str] | None:
    """(whether the test is negated, the error's text) when ``line`` is in the test of an
    ``if``/``elif`` that is one value (``T`` or ``not T``) and whose body is one ``raise``."""
    tree = _parse(filename)
    if tree is None:
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and node.test.lineno <= line <= node.test.end_lineno:
            if len(node.body) != 1 or not isinstance(node.body[0], ast.Raise) or node.body[0].exc is None:
                return None
            test, negated = node.test, False
            if isinstance(test, ast.BoolOp):  # ``labels is not None and labels.max() >= V``
                *before, test = test.values
                if not all(_static(v) for v in before):  # a tensor's truth there: the read may be of it
                    return None
            if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
                test, negated = test.operand, True
            if isinstance(test, (ast.BoolOp, ast.UnaryOp, ast.IfExp)) or \
                    (isinstance(test, ast.Compare) and len(test.ops) > 1):  # the jump tests a part of it
                return None
            return negated, _message(node.body[0].exc)
    return None


def _static(e: ast.expr) -> bool:
    """Whether ``e`` is a Python predicate no tensor's value decides (``x is not None``,
    ``isinstance(x, T)``): ahead of the read in an ``and``/``or``, it was decided by the trace's
    own values (the last operand is then the test's whole truth)."""
    if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.Not):
        return _static(e.operand)
    if isinstance(e, ast.Compare):
        return all(isinstance(op, (ast.Is, ast.IsNot)) for op in e.ops)
    return isinstance(e, ast.Call) and isinstance(e.func, ast.Name) and e.func.id in ("isinstance", "hasattr", "callable")


def _message(exc: ast.expr) -> str:
    """The raised error's text as the source says it (``var has negative entry/entries``), or
    the raise's expression when it is not a literal."""
    if isinstance(exc, ast.Call) and exc.args and isinstance(exc.args[0], ast.Constant) and isinstance(exc.args[0].value, str):
        return exc.args[0].value
    return ast.unparse(exc)


@functools.lru_cache(maxsize=64)
def _parse(filename: str) -> ast.Module | None:
    source = "".join(linecache.getlines(filename))
    try:
        return ast.parse(source, filename) if source else None
    except (SyntaxError, ValueError):
        return None


# a comparison of a whole tensor's extreme with a number: ``max(x) >= c`` iff some ``x >= c``
_OF_EXTREME = {"aten.ge.Scalar": "aten.max.default", "aten.gt.Scalar": "aten.max.default",
               "aten.le.Scalar": "aten.min.default", "aten.lt.Scalar": "aten.min.default"}


def unreduce(nodes: list, types: dict) -> list:
    """``check_input(x, any(m))`` -> ``check_input(x, m)``, and ``check_input(x, max(y) >= c)``
    -> ``check_input(x, y >= c)`` (``min`` with ``<=``, ``<``): the same verdict, from elements
    that split with their tensor. ``types``: every value's type (the new comparison's shape)."""
    made = producers(nodes)
    out = []
    for n in nodes:
        if n.op == CHECK_INPUT and isinstance(n.args[1], Ref) and n.args[1].name in made:
            p = nodes[made[n.args[1].name]]
            bad = None
            if p.op == "aten.any.default":
                bad = p.args[0]
            elif _OF_EXTREME.get(p.op) and isinstance(p.args[0], Ref) and p.args[0].name in made \
                    and nodes[made[p.args[0].name]].op == _OF_EXTREME[p.op]:
                y = nodes[made[p.args[0].name]].args[0]
                bad = Ref(f"{p.outputs[0]}_each")
                out.append(replace(p, outputs=[bad.name], args=(y, *p.args[1:]),
                                   types=[TensorType(types[y.name].shape, "bool")]))
            if bad is not None:
                n = replace(n, args=(n.args[0], bad, *n.args[2:]))
        out.append(n)
    return out
