"""Storages: which bytes each value of a compiled graph holds on a device, and under which
term (``Term``) the memory estimate counts them.

Views share their base's storage, an in-place op's result is the storage it overwrote, a
bucket's results are pieces of one flat tensor, and an issued collective's result buffer is
made at its issue (``runtime/collectives.py``, ``runtime/dist.py``); a collective's kernel also
stages bytes of its own while it runs. A storage's term is its maker's: parameters and buffers,
optimizer state, activations (the forward's), temporaries (the backward's and the update's),
collective buffers, and gradients -- every value that carries a gradient output back to the op
that computed it (``_gradient_values``), fp16's unscale included.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from sbpc.compiler.frontend.loss_scale import scaled_gradient
from sbpc.compiler.ir.aten import overwritten, returns_alias, shares_storage
from sbpc.compiler.ir.types import Graph, InputKind, Node, OutputKind, Role
from sbpc.runtime.kinds import ISSUE, WAIT, Collective, MemoryKind
from sbpc.runtime.pipeline_tasks import ACCUMULATE, TRANSFER

# buckets whose results are pieces (views) of one flat tensor (runtime/collectives.py)
_FLAT_RESULT = frozenset({Collective.ALL_REDUCE_COALESCED.op, Collective.REDUCE_SCATTER_COALESCED.op})
# what carries a gradient to the optimizer; a cast and a pad too: under bf16 the gradient is
# accumulated in bf16 and the update reads its fp32 copy, which ZeRO zero-pads to a dp multiple
_PLUMBING = frozenset({ACCUMULATE, TRANSFER, ISSUE, WAIT, "aten.cat.default", "aten.view.default",
                       "aten._unsafe_view.default", "aten._to_copy.default", "aten.slice_backward.default"})
# issued kinds whose result buffer is made at the issue (all-gathers receive into buffers of their own)
_RESULT_AT_ISSUE = frozenset({Collective.ALL_REDUCE, Collective.ALL_REDUCE_COALESCED, Collective.REDUCE_SCATTER,
                              Collective.REDUCE_SCATTER_COALESCED})


class Term(enum.Enum):
    PARAMS = "params"
    GRADS = "grads"
    OPTIMIZER = "optimizer"
    ACTIVATIONS = "activations"
    BUFFERS = "buffers"
    TEMPORARIES = "temporaries"

    # members are singletons compared by identity: hashed by it too, in C (Enum's __hash__ is a
    # Python call, and the estimate keys ~3M dict updates by term at 1T)
    __hash__ = object.__hash__


TERMS = tuple(Term)  # iterating the Enum class runs a generator: ~90k byte-by-term dicts at 1T start from this


@dataclass
class _Storage:
    nbytes: int
    term: Term  # when held inside the task that makes it
    held_term: Term  # when held between tasks


class Storages:
    """Value -> storage (views share one), each storage's bytes per device and its term."""

    def __init__(self, graph: Graph, memory: MemoryKind = MemoryKind.DEVICE):
        """Storages in another ``memory`` than the one counted weigh nothing."""
        sizes = tuple(graph.mesh.size(a) for a in graph.mesh.sbp_axes)
        self.root: dict[str, str] = {}
        self.store: dict[str, _Storage] = {}
        self.staging: dict[int, int] = {}  # id(node) -> bytes a collective stages while it runs
        value_bytes = {i.value: i.type.local_nbytes(i.sbp, sizes) for i in graph.inputs}
        for n in graph.nodes:
            value_bytes.update(zip(n.outputs, (t.local_nbytes(nd, sizes) for t, nd in zip(n.types, n.sbp or [None] * len(n.types)))))
        grads = _gradient_values(graph)
        kind = {i.name: i.kind for i in graph.inputs}
        # the update's new values: held with the old ones until the step returns
        updates = {o.value: (Term.OPTIMIZER if kind.get(o.name) == InputKind.STATE else Term.PARAMS)
                   for o in graph.outputs_of(OutputKind.UPDATE)}
        for i in graph.inputs:
            term = {InputKind.PARAM: Term.PARAMS, InputKind.BUFFER: Term.PARAMS, InputKind.STATE: Term.OPTIMIZER,
                    InputKind.HYPER: Term.OPTIMIZER,  # the learning rate: 8 bytes, read by the update
                    InputKind.BATCH: Term.ACTIVATIONS}[i.kind]
            self.root[i.value] = i.value
            self.store[i.value] = _Storage(i.type.local_nbytes(i.sbp, sizes) if i.memory == memory else 0, term, term)
        wait_of = {n.args[0].name: n for n in graph.nodes if n.op == WAIT}
        flying: set[str] = set()  # works whose results are allocated at their issue
        for n in graph.nodes:
            firsts = n.uses()
            if n.op in (ISSUE, WAIT):
                self._overlapped(n, wait_of, flying, value_bytes, grads, graph.mesh, memory)
                continue
            over = overwritten(n)  # in place: each result is the storage it overwrote
            if over and len(over) == len(n.outputs) and all(v in self.root for v in over):
                for o, v in zip(n.outputs, over):
                    self.root[o] = self.root[v]
                continue
            if shares_storage(n.op) and firsts and firsts[0] in self.root:
                for o in n.outputs:
                    self.root[o] = self.root[firsts[0]]
                continue
            # the bytes value_bytes holds already (one function of the type and nd-SBP)
            nbytes = [value_bytes[o] for o in n.outputs] if n.memory == memory else [0] * len(n.outputs)
            staged = _staging(Collective.of(n.op), n.kwargs, [value_bytes.get(u, 0) for u in n.uses()], nbytes, graph.mesh)
            if staged and n.memory == memory:
                self.staging[id(n)] = staged
            if n.op in _FLAT_RESULT and n.outputs:  # pieces of one flat bucket
                for o in n.outputs:
                    self.root[o] = n.outputs[0]
                self.store[n.outputs[0]] = _Storage(sum(nbytes), *_terms(n, n.outputs[0], grads))
                continue
            for o, b in zip(n.outputs, nbytes):
                self.root[o] = o
                self.store[o] = _Storage(b, updates[o], updates[o]) if o in updates else _Storage(b, *_terms(n, o, grads))

    def _overlapped(self, n: Node, wait_of: dict[str, Node], flying: set[str], value_bytes: dict[str, int],
                    grads: set[str], mesh, memory: MemoryKind) -> None:
        """An issued collective's buffers, as the runtime holds them (runtime/collectives.py,
        runtime/dist.py): an all-reduce or reduce-scatter writes its result into a buffer made at
        the issue (the work's storage, which the wait's results then are, a bucket's pieces
        included: its flat copy, reduced in place), or into its input where the plan says
        ``overwrite`` (the input dies there); an all-gather receives into
        buffers made at the issue and held until the wait, which joins them into its results."""
        if n.op == WAIT:
            work = n.args[0].name
            if work in flying:
                for o in n.outputs:
                    self.root[o] = self.root[work]
                return
            for o in n.outputs:  # joined at the wait: storages of their own
                self.root[o] = o
                b = value_bytes[o] if n.memory == memory else 0
                self.store[o] = _Storage(b, *_terms(n, o, grads))
            return
        kind, work, w = Collective(n.kwargs["kind"]), n.outputs[0], wait_of[n.outputs[0]]
        on = n.memory == memory
        ins, outs = [value_bytes.get(u, 0) for u in n.uses()], [value_bytes[o] for o in w.outputs]
        staged = _staging(kind, n.kwargs, ins, outs, mesh) if on else 0
        if n.kwargs.get("overwrite") and on:  # reduced into its dead input's storage: no buffer
            self.root[work] = self.root[n.args[0].name]
            flying.add(work)
            return
        self.root[work] = work
        if kind in _RESULT_AT_ISSUE:
            flying.add(work)
            self.store[work] = _Storage(sum(outs) if on else 0, *_terms(w, w.outputs[0], grads))
            if staged:
                self.staging[id(n)] = staged
        else:
            self.store[work] = _Storage(staged, Term.BUFFERS, Term.BUFFERS)

    def nbytes(self, roots) -> int:
        return sum(self.store[r].nbytes for r in roots)

    def by_term(self, roots, held: bool) -> dict[Term, int]:
        out = dict.fromkeys(TERMS, 0)
        for r in roots:
            s = self.store[r]
            out[s.held_term if held else s.term] += s.nbytes
        return out


def _staging(kind: Collective | None, kwargs: dict, in_bytes: list[int], out_bytes: list[int], mesh) -> int:
    """Bytes a collective's kernel allocates besides its result, while it runs (runtime/collectives.py
    over gloo, runtime/dist.py): a bucket's flat copy, the received pieces of an all-gather, the
    contiguous copies of a reduce-scatter or all-to-all that does not cut dim 0."""
    axis = kwargs.get("axis")
    if kind is None or (isinstance(axis, str) and mesh.size(axis) <= 1):
        return 0
    first = in_bytes[0] if in_bytes else 0
    if kind == Collective.REDUCE_SCATTER_COALESCED:
        return sum(in_bytes)  # the flat copy of the bucket (an all-reduce's is reduced in place: its result)
    if kind == Collective.ALL_GATHER:
        return sum(out_bytes)
    if kind == Collective.ALL_GATHER_COALESCED:  # the flat shards, and the gathered flat buffer
        return sum(in_bytes) + sum(out_bytes)
    if kind == Collective.REDUCE_SCATTER:
        return first if kwargs.get("dim", 0) != 0 or kwargs.get("parts", 1) > 1 else 0
    if kind == Collective.ALL_TO_ALL:
        return 2 * first
    return 0


def _terms(n: Node, value: str, grads: set[str]) -> tuple[Term, Term]:
    if value in grads:
        return Term.GRADS, Term.GRADS
    held = Term.ACTIVATIONS if n.role in (Role.FORWARD, Role.PRE) else Term.TEMPORARIES
    if Collective.of(n.op) is not None or n.op in (TRANSFER, ISSUE, WAIT):
        return Term.BUFFERS, held
    return held, held


def _gradient_values(graph: Graph) -> set[str]:
    """The gradients and what carries them to the optimizer: walking back from each gradient
    output through accumulators, collectives, buckets, views, casts and pads, down to the op that
    computed it."""
    producer = {o: n for n in graph.nodes for o in n.outputs}
    types = graph.value_types()
    todo = [o.value for o in graph.outputs_of(OutputKind.GRAD)]
    seen: set[str] = set()
    while todo:
        v = todo.pop()
        if v in seen:
            continue
        seen.add(v)
        n = producer.get(v)
        if n is None:
            continue
        if n.op in _PLUMBING or Collective.of(n.op) is not None or returns_alias(n.op):
            todo.extend(n.uses())
        elif (scaled := scaled_gradient(n, v, types)) is not None:  # its storage is the backward's
            todo.append(scaled)
    return seen
