"""stage-partition: give every op its pipeline stage (its placement on the pp axis).

The partition policy is a parameter: a callable ``(graph, num_stages) -> list[int]`` with one
stage per node. With one stage every op lands on stage 0; the pipeline issue adds hint-driven
and cost-balanced policies for more.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

from sbpc.compiler.ir.types import Graph
from sbpc.errors import CompileError

StagePolicy = Callable[[Graph, int], list[int]]


def single_stage(graph: Graph, num_stages: int) -> list[int]:
    if num_stages != 1:
        raise CompileError(f"pipeline parallelism (pp={num_stages}) is not implemented yet",
                           hint="use a mesh with pp=1 for now")
    return [0] * len(graph.nodes)


@dataclass
class StagePartition:
    name: str = "stage-partition"
    policy: StagePolicy = field(default=single_stage)

    def apply(self, graph: Graph, ctx) -> Graph:
        stages = self.policy(graph, graph.mesh.size("pp"))
        if len(stages) != len(graph.nodes):
            raise CompileError(f"stage policy returned {len(stages)} stages for {len(graph.nodes)} ops")
        return replace(graph, nodes=[replace(n, stage=s) for n, s in zip(graph.nodes, stages)])
