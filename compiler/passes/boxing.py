"""boxing: insert the communication that gives every op the SBP it asked for.

After propagation each op records what it needs of each input (``sbp_in``). Where the
producer made something else, the steps of ``boxing_plan`` (one collective, slice or mask
per mesh axis) are inserted right before the first op that needs it; later ops needing the
same conversion reuse the result. A collective carries the source location of the op whose
result it converts (the row-parallel matmul, not the layer norm after it), and its ``why``
names the op that needed it (a parameter split over dp, ZeRO-3, and an activation the
propagation's memory term says so of, ``Graph.regather``, are converted again in each phase
rather than kept from the forward to the backward). Updated parameters and optimizer state are converted back
to their input layout at the end of the step. ``sbpc.hint`` ops, their job done, disappear.
A partial loss of a one-task plan (the global mean of a data-parallel step, summed over dp) is
reduced right where it is made and leaves the step reduced: ``coalesce`` then puts that
all-reduce in the first gradient bucket (nothing in the step reads it; where there is no bucket
the overlap pass issues it at the end of the forward and waits for it at the end of the step),
where the runner would otherwise stop every rank for a blocking all-reduce after the update.

Memory is part of the placement (``--offload optimizer`` puts the optimizer on the host): where
a consumer's memory is not its input's, a ``to_host`` or ``to_device`` transfer joins the
steps. Collectives run in device memory, so a value bound for the host is converted on the
device first and moved last, and one coming from the host moves first; a host-to-host
conversion that communicates goes through the device (a local slice stays on the host).
The pass ends by verifying that every consumer receives exactly the SBP and memory it expects.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from sbpc.compiler.pass_manager import Fact
from sbpc.compiler.sbp.boxing_plan import plan_boxing
from sbpc.compiler.frontend.hint_op import OP as HINT_OP
from sbpc.compiler.ir.mesh import MICROBATCH
from sbpc.compiler.ir.types import FreshNames, Graph, InputKind, Node, OutputKind, Ref, Role
from sbpc.compiler.ir.verify import verify_boxed
from sbpc.runtime.kinds import Collective, MemoryKind
from sbpc.runtime.sbp import Broadcast, NdSbp, Partial, Split, format_nd_sbp

HOST, DEVICE = MemoryKind.HOST, MemoryKind.DEVICE


@dataclass
class Boxing:
    name: str = "boxing"
    needs: ClassVar[tuple[Fact, ...]] = (Fact.SBP,)
    provides: ClassVar[tuple[Fact, ...]] = (Fact.BOXED,)

    def apply(self, graph: Graph, ctx) -> Graph:
        return _Inserter(graph).run()


class _Inserter:
    def __init__(self, graph: Graph):
        self.g = graph
        self.axes = graph.mesh.sbp_axes
        self.sizes = tuple(graph.mesh.size(a) for a in self.axes)
        self.sequential = graph.mesh.sequential_axes
        self.sbp: dict[str, NdSbp] = {i.value: i.sbp for i in graph.inputs}
        self.mem: dict[str, MemoryKind] = {i.value: i.memory for i in graph.inputs}
        self.types = graph.value_types()
        self.boxed: dict[tuple[str, NdSbp], str] = {}
        self.rename: dict[str, str] = {}
        self.fresh = FreshNames(set(self.types))
        self.made_at = {v: graph.nodes[i].loc for v, i in graph.producers().items()}
        self.out: list[Node] = []
        # a pipeline's loss is each micro-batch's, reduced by the runner across stages
        pipelined = MICROBATCH in self.axes or graph.mesh.size("pp") > 1
        losses = graph.outputs_of(OutputKind.LOSS)
        self.loss = losses[0].value if losses and not pipelined else None
        self.reduced_loss: str | None = None
        # parameters split over dp (ZeRO-3): gathered again in each phase, never kept from the
        # forward to the backward (that is the memory ZeRO-3 saves)
        dp = self.axes.index("dp") if "dp" in self.axes else None
        self.regather = {i.value for i in graph.inputs if i.kind == InputKind.PARAM and dp is not None
                         and i.sbp is not None and isinstance(i.sbp[dp], Split) and self.sizes[dp] > 1}
        # and the activations whose kept conversion sbp-propagate's memory term found dearer
        # than converting them again in the backward (a sequence-parallel input gathered twice)
        self.regather |= graph.regather

    def run(self) -> Graph:
        for n in self.g.nodes:
            n = _rename_positions(n, [self.rename.get(u, u) for u in n.uses()])
            if n.op == HINT_OP:  # pins an SBP, not a memory: the value stays where it is
                src = n.args[0].name
                need = n.sbp_in[0] if n.sbp_in else self.sbp.get(src)
                self.rename[n.outputs[0]] = self.convert(src, need, n, self.mem.get(src, DEVICE)) \
                    if need is not None else src
                if n.outputs[0] in self.regather:  # what the hinted value is regathered as
                    self.regather.add(self.rename[n.outputs[0]])
                continue
            if n.sbp_in is not None:
                n = _rename_positions(n, [self.convert(u, need, n) for u, need in zip(n.uses(), n.sbp_in)])
            elif any(self.mem.get(u, DEVICE) != n.memory for u in n.uses()):
                n = _rename_positions(n, [self.convert(u, self.sbp.get(u), n) for u in n.uses()])
            self.out.append(n)
            for o in n.outputs:
                self.mem[o] = n.memory
            for o, nd in zip(n.outputs, n.sbp or []):
                self.sbp[o] = nd
            if self.loss in n.outputs:
                self.reduced_loss = self._reduce_loss(n)
        outputs = [replace(o, value=self.rename.get(o.value, o.value)) for o in self.g.outputs]
        if self.reduced_loss is not None:
            outputs = [replace(o, value=self.reduced_loss) if o.kind == OutputKind.LOSS else o for o in outputs]
        outputs = self._restore_layouts(outputs)
        by_value: dict[str, list[tuple]] = {}  # the conversions of each value, in the order they were made
        for (value, need, memory, _), name in self.boxed.items():
            by_value.setdefault(value, []).append((need, memory, name))
        outputs = [self._reduced_gradient(o, by_value.get(o.value, ())) for o in outputs]
        graph = replace(self.g, nodes=self.out, outputs=outputs, regather=frozenset())
        if all(n.sbp is not None for n in graph.nodes) and all(i.sbp is not None for i in graph.inputs):
            verify_boxed(graph)
        return graph

    def convert(self, value: str, need: NdSbp | None, consumer: Node, memory: MemoryKind | None = None) -> str:
        """``value`` as ``need`` in ``memory`` (default: the consumer's)."""
        have, mem = self.sbp.get(value), self.mem.get(value, DEVICE)
        memory = consumer.memory if memory is None else memory
        if have is None or need is None:
            have = need = have or need
        if have == need and mem == memory:
            return value
        key = (value, need, memory, self._phase(value, consumer))
        if key in self.boxed:
            return self.boxed[key]
        why = f"boxing {format_nd_sbp(have)} -> {format_nd_sbp(need)} of %{value} for {consumer.op}" \
            if have is not None else f"%{value} for {consumer.op}"
        steps = plan_boxing(have, need, self.types[value], self.sizes, self.sequential) if have != need else []
        through_device = mem == HOST and any(s.kind.moves_data for s in steps)  # collectives run on the device
        cur = (value, have)
        if mem == HOST and (memory == DEVICE or through_device):
            cur = self._emit(cur, Collective.TO_DEVICE.op, {}, have, DEVICE, consumer, value, why)
            mem = DEVICE
        for step in steps:
            cur = self._emit(cur, step.op, {"axis": self.axes[step.axis], **dict(step.kwargs)}, step.after, mem,
                             consumer, value, why)
        if mem == DEVICE and memory == HOST:
            cur = self._emit(cur, Collective.TO_HOST.op, {}, need, HOST, consumer, value, why)
        self.boxed[key] = cur[0]
        return cur[0]

    def _emit(self, cur: tuple[str, NdSbp], op: str, kwargs: dict, after: NdSbp, memory: MemoryKind, consumer: Node,
              value: str, why: str) -> tuple[str, NdSbp]:
        """One step of a conversion of ``value``, from ``cur`` (name, SBP) to ``after`` in ``memory``."""
        name = self.fresh(f"{value}_{op.rpartition('.')[2]}")
        self.out.append(Node(
            [name], op, (Ref(cur[0]),), kwargs, [self.types[value]], consumer.role,
            loc=self.made_at.get(value) or consumer.loc, stage=consumer.stage,
            sbp=[after] if after is not None else None, sbp_in=[cur[1]] if cur[1] is not None else None, why=why,
            memory=memory))
        self.sbp[name], self.mem[name] = after, memory
        self.types[name] = self.types[value]
        self.made_at[name] = self.made_at.get(value)
        return name, after

    def _phase(self, value: str, consumer: Node) -> Role | None:
        """Conversions are shared by all consumers, except a regathered value's: per phase."""
        if value not in self.regather:
            return None
        return Role.FORWARD if consumer.role == Role.PRE else consumer.role

    def _reduce_loss(self, made: Node) -> str | None:
        """The loss reduced over the axes it is partial on, emitted right after ``made`` (its
        producer). Only the step's output reads it: the backward keeps reading the partial loss,
        so it does not wait for the reduction."""
        have = self.sbp.get(self.loss)
        if have is None or not any(isinstance(s, Partial) for s in have):
            return None
        need = tuple(Broadcast() if isinstance(s, Partial) else s for s in have)
        anchor = Node([], "loss", (), {}, [], made.role, loc=made.loc, stage=made.stage, memory=made.memory)
        return self.convert(self.loss, need, anchor)

    def _restore_layouts(self, outputs):
        """An updated param/state/buffer must leave the step in the layout it came in with (a
        buffer's new value, made by the forward, is converted in the forward)."""
        by_name = {i.name: i for i in self.g.inputs if i.kind in (InputKind.PARAM, InputKind.STATE, InputKind.BUFFER)}
        made_on = {o: n.stage for n in self.out for o in n.outputs}  # the program so far; SSA: one maker each
        fixed = []
        for o in outputs:
            src = by_name.get(o.name) if o.kind == OutputKind.UPDATE else None
            moved = src is not None and self.mem.get(o.value, DEVICE) != src.memory
            if src is not None and (moved or src.sbp is not None and self.sbp.get(o.value) not in (None, src.sbp)):
                role = Role.FORWARD if src.kind == InputKind.BUFFER else Role.OPTIMIZER
                anchor = Node([], "update", (), {}, [], role, stage=self._stage_of(o.value, made_on),
                              memory=src.memory)
                o = replace(o, value=self.convert(o.value, src.sbp, anchor))
            fixed.append(o)
        return fixed

    def _reduced_gradient(self, o, conversions):
        """A partial gradient that is reduced for the optimizer leaves the step reduced: the same
        logical tensor, and the partial then dies at its reduction instead of living to the end
        of the step next to its reduced copy (twice the gradient's bytes). ``conversions``: the
        (need, memory, name) of ``o``'s value made so far, in order."""
        have = self.sbp.get(o.value)
        if o.kind != OutputKind.GRAD or have is None or not any(isinstance(s, Partial) for s in have):
            return o
        mem = self.mem.get(o.value, DEVICE)
        reduced = next((name for need, memory, name in conversions
                        if memory == mem and need is not None and not any(isinstance(s, Partial) for s in need)), None)
        return o if reduced is None else replace(o, value=reduced)

    def _stage_of(self, value: str, made_on: dict):
        """The chunk that makes ``value`` (its conversion runs there too; the last one for an
        input). ``made_on``: value -> the chunk of its maker."""
        made = made_on.get(value)
        return made if made is not None else (self.out[-1].stage if self.out else None)



def _rename_positions(n: Node, new: list[str]) -> Node:
    """``n`` with its i-th tensor use renamed to ``new[i]`` (uses are in ``Node.uses`` order);
    ``n`` itself where nothing is renamed, as for most nodes (nodes are never changed in place)."""
    if n.uses() == tuple(new):
        return n
    it = iter(new)
    args = tuple(_next_refs(a, it) for a in n.args)
    kwargs = {k: _next_refs(v, it) for k, v in n.kwargs.items()}
    return n.replace(args=args, kwargs=kwargs)


def _next_refs(a, it):
    """``a`` with each ``Ref`` (through lists and tuples) renamed to the next name of ``it``. A
    module function, not a closure: a recursive closure is a reference cycle, left to the
    cyclic collector (which the passes pause) with the names it holds."""
    if isinstance(a, Ref):
        return Ref(next(it))
    if isinstance(a, (list, tuple)):
        return type(a)(_next_refs(x, it) for x in a)
    return a
