"""Mesh axes that can split nothing: an error listing the sizes that can, unless replication is wanted.

An axis of k > 1 devices *can split nothing* when no forward op of the model has, in the rule
book, a signature with a split on an axis of k devices that divides its tensors (the
candidates ``Layouts`` gives the solver): every device along the axis would hold the same data
and do the same work, a k-fold redundancy the user almost never means (``tp=3`` on a model of 4
heads and hidden 64). That is an error unless ``--allow-replicated``
(``CompileContext.allow_replicated``) is given, and it lists the valid sizes: 1 and every
divisor up to ``MAX_PROBE`` of the model's tensor dims at which some forward op can split.
Forward ops only: an elementwise optimizer update can split any parameter with a dim divisible
by k, which says nothing about how the model divides.

An axis that *can* split but on which the solver split no tensor (no parameter, state, batch
input or op input or result is ``S`` on it: the cost model found replication cheaper, as it
may for a tiny model) compiles, with a warning.
"""
from __future__ import annotations

from sbpc.compiler.frontend.hint_op import OP as HINT_OP
from sbpc.compiler.ir.types import Graph, Role
from sbpc.compiler.sbp.layout import Layouts
from sbpc.compiler.sbp.rules import RuleBook
from sbpc.errors import CompileError
from sbpc.runtime.sbp import Split

MAX_PROBE = 64  # largest axis size listed as valid


def check_axes_split(graph: Graph, rules: RuleBook, allow_replicated: bool, log) -> None:
    """Raise for the first axis of more than one device that can split nothing; warn for one
    that can but was left replicated."""
    for a, name in enumerate(graph.mesh.sbp_axes):
        k = graph.mesh.size(name)
        if k == 1 or allow_replicated or _splits_something(graph, a):
            continue
        if _can_split(graph, rules, a, k):
            print(f"sbpc: warning: {name}={k} splits no tensor of the model: the cost model found replicating every "
                  f"op cheaper than any split, so the {k} devices of {name} all do the same work", file=log)
            continue
        listed = ", ".join(map(str, valid_sizes(graph, rules, a)))
        raise CompileError(f"{name}={k} splits no tensor of the model: no forward op of it can split its tensors "
                           f"over {k} devices; valid {name}: {listed}",
                           hint=f"use one of those sizes, or pass --allow-replicated to run {name} replicated")


def _splits_something(graph: Graph, a: int) -> bool:
    if any(i.sbp is not None and isinstance(i.sbp[a], Split) for i in graph.inputs):
        return True
    return any(isinstance(nd[a], Split) for n in graph.nodes for nd in (n.sbp or []) + (n.sbp_in or []))


def _can_split(graph: Graph, rules: RuleBook, a: int, k: int) -> bool:
    sizes = tuple(k if b == a else 1 for b in range(len(graph.mesh.sbp_axes)))
    lay = Layouts(graph, rules, sizes)
    return any(isinstance(nd[a], Split) for i, n in enumerate(graph.nodes) if n.role == Role.FORWARD and n.op != HINT_OP
               for c in lay.candidates(i) for nd in c.ins + c.outs)


def valid_sizes(graph: Graph, rules: RuleBook, a: int) -> list[int]:
    """1 and every size up to MAX_PROBE at which a forward op of ``graph`` can split on axis ``a``."""
    dims = {d for t in graph.value_types().values() for d in t.shape}
    probes = sorted({k for d in dims for k in range(2, min(d, MAX_PROBE) + 1) if d % k == 0})
    return [1] + [k for k in probes if _can_split(graph, rules, a, k)]
