"""sbp-propagate: choose an nd-SBP for every tensor.

On a mesh whose SBP axes all have size 1 every signature is valid and none moves data, so
every value is ``B`` on each axis and batch inputs are ``S(0)`` on dp. Meshes with a larger
dp/tp axis need the rule-driven, cost-based propagation of the SBP issue; until it lands they
are refused here rather than compiled wrong.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from sbpc.compiler.ir.types import Graph, InputKind
from sbpc.runtime.sbp import Broadcast, Split
from sbpc.errors import CompileError


@dataclass
class SbpPropagate:
    name: str = "sbp-propagate"

    def apply(self, graph: Graph, ctx) -> Graph:
        mesh = graph.mesh
        big = [f"{a}={mesh.size(a)}" for a in mesh.sbp_axes if mesh.size(a) > 1]
        if big:
            raise CompileError(f"mesh {mesh} needs SBP propagation across devices ({', '.join(big)}), "
                               "which is not implemented yet", hint="compile with --mesh 1 for now")
        bcast = tuple(Broadcast() for _ in mesh.sbp_axes)
        inputs = [replace(i, sbp=self._input_sbp(i.kind, mesh.sbp_axes)) for i in graph.inputs]
        nodes = [replace(n, sbp=[bcast] * len(n.outputs)) for n in graph.nodes]
        return replace(graph, inputs=inputs, nodes=nodes)

    @staticmethod
    def _input_sbp(kind: InputKind, axes: tuple[str, ...]):
        return tuple(Split(0) if kind == InputKind.BATCH and a == "dp" else Broadcast() for a in axes)
