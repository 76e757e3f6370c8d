"""recompute: activation checkpointing, forward ops cloned into the backward.

The joint graph keeps every forward value the backward reads (its *saved* values) alive from
the forward to the backward. This pass picks regions of forward ops; each saved value a region
makes is recomputed instead: its producers, back to values made outside the region (kept),
are cloned as backward ops right before the first backward op that reads any of them, and
the backward reads the clones. The originals then die after their last forward use and the
clones after their last backward use (``memory_plan.last_uses``, which the lowering's frees
follow), so only the region's inputs stay alive across the step.

- ``full``: a region is a layer, the forward ops of one repeated block (``h.3``, by
  ``layer_key``, as stage partition groups them). Values another unit's forward reads (the
  layer's input and output, the residual stream) are kept; everything else of the layer that
  the backward reads is recomputed.
- ``selective`` (Korthikanti et al. 2022): a region is the attention core around each softmax:
  back through cheap ops to and including the score matmul (q @ k^T), forward through cheap
  ops up to (not including) the matmul with v. Its inputs (q, k, v, the mask) are kept;
  the s x s tensors (scores, probabilities) are recomputed. A fused attention
  (``sbpc.attention``, flash-style) already saves only its output and log-sum-exp, so there
  is nothing for selective to recompute in it.

The pass runs after boxing and coalesce: the clones are copies of nodes that already carry
their nd-SBP and their collectives, so a region with a tensor-parallel all-reduce redoes that
all-reduce in the backward (as Megatron's full recompute reruns the layer), and the cloned
collectives (role bwd) are not fused into gradient buckets. Localize, schedule (which cuts
the clones into the backward task of their chunk and proves the order deadlock-free) and the
memory plan all see the clones like any other op.

Random ops (dropout) are never cloned: a second draw would give another mask and shift the
RNG stream. Their results stay saved and a region stops at them.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from sbpc.compiler.ir.aten import is_random
from sbpc.compiler.ir.types import FreshNames, Graph, Node, Role, rename_uses
from sbpc.compiler.pass_manager import Fact
from sbpc.compiler.pipelining.stage_policy import flops, layer_key
from sbpc.runtime.kinds import Collective, Recompute as Mode

SOFTMAX = ("aten._softmax.default", "aten._safe_softmax.default", "aten.softmax.int")
SCORES = ("aten.bmm.default", "aten.baddbmm.default")  # q @ k^T; a linear layer's mm/addmm stays kept


@dataclass
class Recompute:
    name: str = "recompute"
    needs: ClassVar[tuple[Fact, ...]] = (Fact.BOXED,)
    provides: ClassVar[tuple[Fact, ...]] = ()
    mode: Mode = Mode.NONE

    def __post_init__(self):
        self.mode = Mode(self.mode)  # the golden tests name it as text
        if self.mode == Mode.AUTO:
            raise ValueError("recompute auto is resolved to none, selective or full before the pass runs")

    def apply(self, graph: Graph, ctx) -> Graph:
        if self.mode == Mode.NONE:
            return graph
        regions = layer_regions(graph) if self.mode == Mode.FULL else attention_regions(graph)
        return clone_into_backward(graph, regions, self.mode)


def _unit(n: Node) -> str | None:
    """The repeated block a forward op belongs to (``h.3``), or None."""
    if n.role != Role.FORWARD or n.loc is None:
        return None
    key = layer_key(n.loc.module)
    return key if key.rsplit(".", 1)[-1].isdigit() else None


def layer_regions(graph: Graph) -> list[set[int]]:
    """One region per layer: its forward ops, random ones left out."""
    by_unit: dict[str, set[int]] = {}
    for i, n in enumerate(graph.nodes):
        u = _unit(n)
        if u is not None and not is_random(n.op):
            by_unit.setdefault(u, set()).add(i)
    return list(by_unit.values())


def _cheap(n: Node, types) -> bool:
    """Worth recomputing instead of keeping: no matmul, no draw, no communication."""
    return flops(n, types) == 0 and not is_random(n.op) and Collective.of(n.op) is None


def attention_regions(graph: Graph) -> list[set[int]]:
    """Around each softmax of a layer: the cheap ops of its unit back to and including the
    score matmul, and forward up to the matmul that reads the probabilities."""
    nodes, types = graph.nodes, graph.value_types()
    producer, readers = graph.producers(), graph.users()
    regions = []
    for s, n in enumerate(nodes):
        if n.op not in SOFTMAX or _unit(n) is None:
            continue
        unit, region = _unit(n), {s}
        back = [u for u in n.uses() if u in producer]
        while back:
            p = producer[back.pop()]
            m = nodes[p]
            if p in region or _unit(m) != unit or is_random(m.op) or Collective.of(m.op) is not None:
                continue
            if flops(m, types) == 0:
                region.add(p)
                back.extend(u for u in m.uses() if u in producer)
            elif m.op in SCORES:  # the scores, a matmul of two activations, end the walk
                region.add(p)
        ahead = list(n.outputs)
        while ahead:
            for r in readers.get(ahead.pop(), []):
                m = nodes[r]
                if r not in region and _unit(m) == unit and _cheap(m, types):
                    region.add(r)
                    ahead.extend(m.outputs)
        regions.append(region)
    return regions


def clone_into_backward(graph: Graph, regions: list[set[int]], mode: Mode) -> Graph:
    """Each region's saved values recomputed by clones placed before their first backward reader."""
    nodes = graph.nodes
    producer, readers = graph.producers(), graph.users()
    fresh = FreshNames(set(graph.value_types()))
    insert: dict[int, list[Node]] = {}  # backward position -> clones to put before it
    rename: dict[int, dict[str, str]] = {}  # backward reader -> saved value -> its clone
    for region in regions:
        made = {o for i in region for o in nodes[i].outputs}
        saved = []
        for v in sorted(made, key=lambda v: producer[v]):
            rs = [nodes[r] for r in readers.get(v, [])]
            unit = _unit(nodes[producer[v]])
            if any(r.role == Role.FORWARD and _unit(r) != unit for r in rs):
                continue  # another unit's forward reads it (a layer's output): it is kept anyway
            if any(r.role == Role.BACKWARD for r in rs):
                saved.append(v)
        if not saved:
            continue
        need: set[int] = set()
        stack = [producer[v] for v in saved]
        while stack:
            i = stack.pop()
            if i in need:
                continue
            need.add(i)
            stack.extend(producer[u] for u in nodes[i].uses() if u in made)
        first = min(r for v in saved for r in readers[v] if nodes[r].role == Role.BACKWARD)
        names: dict[str, str] = {}
        clones = []
        for i in sorted(need):
            n = nodes[i]
            outs = [fresh(f"{o}_rc") for o in n.outputs]
            names.update(zip(n.outputs, outs))
            clones.append(replace(rename_uses(n, lambda u: names.get(u, u)), outputs=outs, role=Role.BACKWARD,
                                  why=f"{mode.value} recompute of {n.op} for the backward"
                                      + (f" ({n.why})" if n.why else "")))
        insert.setdefault(first, []).extend(clones)
        for v in saved:
            for r in readers[v]:
                if nodes[r].role == Role.BACKWARD:
                    rename.setdefault(r, {})[v] = names[v]
    out: list[Node] = []
    for i, n in enumerate(nodes):
        out.extend(insert.get(i, ()))
        if i in rename:
            n = rename_uses(n, lambda u, m=rename[i]: m.get(u, u))
        out.append(n)
    return replace(graph, nodes=out)
