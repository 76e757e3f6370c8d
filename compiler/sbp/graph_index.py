"""The graph's structure as the SBP search reads it, found once per graph and shared by every
solver of it (one per mesh axis, and the joint one): who uses what, the backward, the values
kept for it, the gradients' tails, and how often each op runs a step."""
from __future__ import annotations

from dataclasses import dataclass, field

from sbpc.compiler.ir.aten import hyper_only, shares_storage
from sbpc.compiler.ir.types import Graph, Role

Use = tuple[str, tuple[int, ...]]  # a value an op uses, with the positions it takes it at


@dataclass(frozen=True)
class GraphIndex:
    """The graph's structure, shared by every solver of one graph (one per mesh axis, and the
    joint one)."""
    uses: list[list[str]]  # per op: the values it uses, by position
    producer: dict[str, int]  # value -> the op that makes it
    consumers: dict[str, list[int]]  # value -> the ops that read it, each once
    at: list[list[Use]]  # per op: each value it uses once, with its positions
    backward: frozenset[int]  # the backward's ops
    # forward values a backward op reads (kept from the forward to the backward), each with
    # whether its bytes are its own (False: a view of a saved value, whose storage is counted there)
    saved: dict[str, bool]
    reads: dict[str, list[tuple[int, int]]]  # value -> (op, position) of each use of it, in program order
    hyper: list[bool]  # per op: computed from hyperparameters alone (aten.hyper_only)
    bucketed: frozenset[str]  # the values that serve one gradient (gradient_tail)
    # the optimizer's ops, which run once a step; every other op runs once per micro-batch
    once: frozenset[int]
    step_read: frozenset[str]  # the values only the optimizer reads (their conversions run once a step)
    # the layer-class weights solvers found (Solver._weigh), by what they depend on
    weighs: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, graph: Graph) -> GraphIndex:
        uses = [list(n.uses()) for n in graph.nodes]
        at: list[list[Use]] = []
        reads: dict[str, list[tuple[int, int]]] = {}
        consumers: dict[str, list[int]] = {}  # Graph.users, found on the way
        for i, us in enumerate(uses):
            pos: dict[str, list[int]] = {}
            for p, u in enumerate(us):
                pos.setdefault(u, []).append(p)
                reads.setdefault(u, []).append((i, p))
            at.append([(v, tuple(ps)) for v, ps in pos.items()])
            for v in pos:
                consumers.setdefault(v, []).append(i)
        backward = frozenset(i for i, n in enumerate(graph.nodes) if n.role == Role.BACKWARD)
        read_back = {u for i in backward for u in uses[i]}
        root: dict[str, str] = {}
        for i, n in enumerate(graph.nodes):
            for o in n.outputs:
                root[o] = root.get(uses[i][0], uses[i][0]) if shares_storage(n.op) and uses[i] else o
        saved = {o: root[o] == o or root[o] not in read_back for n in graph.nodes if n.role == Role.FORWARD
                 for o in n.outputs if o in read_back}
        once = frozenset(i for i, n in enumerate(graph.nodes) if n.role == Role.OPTIMIZER)
        step_read = frozenset(v for v, cs in consumers.items() if once.issuperset(cs))
        return cls(uses, graph.producers(), consumers, at, backward, saved, reads, hyper_only(graph),
                   gradient_tail(graph, consumers), once, step_read)


def gradient_tail(graph: Graph, consumers: dict[str, list[int]]) -> frozenset[str]:
    """The backward's values that serve one parameter's gradient alone: the gradient itself (what
    the optimizer reads) and what only it is computed from (a weight gradient before its
    transpose, a norm weight's products before their sum). Their reductions are what
    ``coalesce`` buckets and ``overlap`` issues while the backward goes on: nothing else in the
    backward waits for them. An activation's gradient is not among them even though the whole
    backward ends in gradients: the gradients of every layer below are computed from it, so its
    reduction blocks the backward where it is needed, one call of its own."""
    nodes = graph.nodes
    # per backward value, the gradient it serves: a value the optimizer reads, or _MANY
    serves: dict[str, str] = {}
    for n in reversed(nodes):  # consumers come later in program order
        if n.role != Role.BACKWARD:
            continue
        for o in n.outputs:
            readers = consumers.get(o, [])
            got = {o} if any(nodes[c].role == Role.OPTIMIZER for c in readers) else set()
            for c in readers:
                if nodes[c].role == Role.BACKWARD:
                    got.update(serves.get(x, _MANY) for x in nodes[c].outputs)
                elif nodes[c].role != Role.OPTIMIZER:
                    got.add(_MANY)
            serves[o] = got.pop() if len(got) == 1 else _MANY
    return frozenset(v for v, g in serves.items() if g != _MANY)


_MANY = ""  # no value is named "": a value serving several gradients, or none
