"""offload: ``--offload optimizer`` places the optimizer's state and update in host memory.

It is a placement, like a pipeline stage: this pass only says where each op and state lives
(``memory=host`` on the node or input); boxing derives the transfers where a value crosses
from one memory to the other (``sbpc.to_host`` / ``sbpc.to_device``), as it derives every
collective, and the runtime runs them like any other kernel. What moves, per parameter:

- the optimizer state (``exp_avg``, ``exp_avg_sq``, the step counter, fp16's scaler state) and
  the learning rate input are host memory, and every optimizer op runs there;
- the update reads a host copy of the parameter, a new optimizer state ``master:<param>``
  (ZeRO-Offload's fp32 master weights), never the device's, so a parameter does not travel to
  the host each step. It starts as a copy of the parameter; the update writes the new master,
  and the device's parameter is the same new value moved back (``to_device``);
- the gradient, made on the device, crosses once: boxing reduces it on the device (all-reduce,
  or ZeRO-2's reduce-scatter), then moves the result (the shard) to the host.

With ``--zero 1/2`` the master is split over dp like the other state (the ``zero`` pass runs
after this one), so the update runs on the shard, the updated shard moves back and the device
all-gathers it: ZeRO-Offload. The device keeps its parameters in full precision (fp32, as
``--precision`` keeps them); only the state and master copy leave it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from sbpc.compiler.ir.types import (FreshNames, Graph, GraphInput, GraphOutput, InputKind, OutputKind, Role,
                                    StateName, rename_uses)
from sbpc.compiler.memory_options import OFFLOADS
from sbpc.compiler.pass_manager import Fact
from sbpc.errors import UsageError
from sbpc.runtime.kinds import MemoryKind

MASTER = "master"  # the StateName.state of a parameter's host copy


@dataclass
class Offload:
    name: str = "offload"
    needs: ClassVar[tuple[Fact, ...]] = ()
    provides: ClassVar[tuple[Fact, ...]] = ()
    what: str = "none"  # --offload

    def __post_init__(self):
        if self.what not in OFFLOADS:
            raise UsageError(f"offload {self.what!r} is not one of {', '.join(OFFLOADS)}")

    def apply(self, graph: Graph, ctx) -> Graph:
        if self.what == "none":
            return graph
        return offload_optimizer(graph)


def offload_optimizer(graph: Graph) -> Graph:
    fresh = FreshNames(set(graph.value_types()))
    updated = {o.name: o.value for o in graph.outputs_of(OutputKind.UPDATE)}
    masters: dict[str, GraphInput] = {}  # parameter value -> its master state input
    for p in graph.inputs_of(InputKind.PARAM):
        if updated.get(p.name, p.value) != p.value:  # a parameter the optimizer changes
            masters[p.value] = GraphInput(InputKind.STATE, fresh(f"{p.value}_master"), p.type,
                                          str(StateName(MASTER, p.name)), memory=MemoryKind.HOST)
    master_of = {v: m.value for v, m in masters.items()}
    nodes = [replace(rename_uses(n, lambda u: master_of.get(u, u)), memory=MemoryKind.HOST)
             if n.role == Role.OPTIMIZER else n for n in graph.nodes]
    # the learning rate too: only the update reads it
    inputs = [replace(i, memory=MemoryKind.HOST) if i.kind in (InputKind.STATE, InputKind.HYPER) else i
              for i in graph.inputs]
    name_of = {p.value: p.name for p in graph.inputs_of(InputKind.PARAM)}
    outputs = list(graph.outputs) + [GraphOutput(OutputKind.UPDATE, updated[name_of[v]], m.name)
                                     for v, m in masters.items()]
    return replace(graph, inputs=inputs + list(masters.values()), nodes=nodes, outputs=outputs)
