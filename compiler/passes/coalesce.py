"""coalesce: fuse gradient reductions (and ZeRO's gathers of updated shards) into buckets.

Boxing reduces each partial gradient on its own where it is first needed: one blocking call
per parameter. Here the reductions of the backward and optimizer -- all-reduces, and the
reduce-scatters of ZeRO-2/3 gradients -- and the optimizer's all-gathers (ZeRO's updated
shards gathered back into the parameter's layout) are grouped by kind, axis, reduction, dtype
and stage, and cut in program order into buckets of at most ``bucket_bytes`` (25 MB, DDP's
default; the first one ``first_bucket_bytes``, 1 MB, as DDP's); a bucket becomes one ``sbpc.<kind>_coalesced`` call placed where its last member
was, and the ops that already used an earlier member's result (a transpose of a weight
gradient, ...) move after it with everything that depends on them. Every tensor is still
converted exactly once; gradients live until their bucket is reduced, as in DDP. The
forward and backward gathers of ZeRO-3 parameters are left alone: each is needed right away.
A forward all-reduce that only the step's outputs read (a one-program plan's loss, reduced
for the runner) joins the first bucket of its key: nothing in the step waits for it, so it
costs one element of that call instead of a call of its own.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, replace
from typing import ClassVar

from sbpc.compiler.pass_manager import Fact
from sbpc.compiler.ir.types import Graph, Node, Role
from sbpc.compiler.ir.mesh import MICROBATCH, Mesh
from sbpc.runtime.kinds import COALESCED, Collective
from sbpc.runtime.sbp import Broadcast

# what may share a bucket, and in which phases
_FUSED = {Collective.ALL_REDUCE: (Role.BACKWARD, Role.OPTIMIZER), Collective.REDUCE_SCATTER: (Role.BACKWARD, Role.OPTIMIZER),
          Collective.ALL_GATHER: (Role.OPTIMIZER,)}


@dataclass
class Coalesce:
    name: str = "coalesce"
    needs: ClassVar[tuple[Fact, ...]] = (Fact.BOXED,)
    provides: ClassVar[tuple[Fact, ...]] = ()
    bucket_bytes: int = 25 * 2**20
    # DDP's first bucket: the last layers' gradients come first in the backward, and a small
    # first bucket starts reducing them (overlap issues it) while the rest of the backward runs
    first_bucket_bytes: int = 2**20

    def apply(self, graph: Graph, ctx) -> Graph:
        nodes = list(graph.nodes)
        groups: dict[tuple, list[int]] = {}
        unread = _read_by_no_node(graph)
        for i, n in enumerate(nodes):
            kind = Collective.of(n.op)
            rides = kind == Collective.ALL_REDUCE and n.role == Role.FORWARD and unread.issuperset(n.outputs)
            if kind in _FUSED and (n.role in _FUSED[kind] or rides) and n.kwargs.get("axis") != MICROBATCH:
                # a per-micro-batch reduction (an activation's gradient) never shares a bucket
                # with a once-per-step one (an accumulated weight gradient)
                key = (kind, n.kwargs.get("axis"), n.kwargs.get("reduce", "sum"), n.types[0].dtype, n.stage,
                       per_microbatch(graph.mesh, n))
                groups.setdefault(key, []).append(i)
        # members by the value they reduce: fusing a bucket moves the nodes between its first and
        # last member, so the indices of a bucket of another group interleaved with it go stale
        reads = [frozenset(n.uses()) for n in nodes]  # once for every group
        readers: dict[str, list[int]] = {}
        for k, r in enumerate(reads):
            for u in r:
                readers.setdefault(u, []).append(k)
        buckets = [[nodes[i].outputs[0] for i in b] for idxs in groups.values()
                   for b in self._buckets(nodes, reads, readers, idxs) if len(b) > 1]
        program = _Program(nodes, readers)
        for bucket in buckets:
            program.fuse(bucket)
        return replace(graph, nodes=program.nodes())

    def _buckets(self, nodes: list[Node], reads: list[frozenset[str]], readers: dict[str, list[int]],
                 idxs: list[int]) -> list[list[int]]:
        """Cut in program order at the byte caps, and before a member computed from the bucket's
        (--clip-grad's norm, reduced after the gradients it sums): such members cannot share a
        call, and a bucket holding one would not fuse at all. ``reads``: each node's uses;
        ``readers``: each value's readers. What is computed from the bucket so far is followed
        from its values to their readers (a heap of indices, in program order), not found by
        a scan of the program between members: a group of the 1T plan spans ~20k nodes."""
        buckets: list[list[int]] = []
        size, tainted, pending = 0, set(), []

        def taint(values) -> None:
            for v in values:
                if v not in tainted:
                    tainted.add(v)
                    for r in readers.get(v, ()):
                        heapq.heappush(pending, r)

        for i in idxs:
            while pending and pending[0] < i:  # what reads the bucket so far, up to this member
                taint(nodes[heapq.heappop(pending)].outputs)
            nbytes = nodes[i].types[0].nbytes
            cap = self.first_bucket_bytes if len(buckets) == 1 else self.bucket_bytes
            if buckets and size + nbytes <= cap and tainted.isdisjoint(reads[i]):
                buckets[-1].append(i)
                size += nbytes
            else:
                buckets.append([i])
                size, tainted, pending = nbytes, set(), []
            taint(nodes[i].outputs)
        return buckets


class _Program:
    """The nodes as bucket after bucket is fused into them, not rebuilt nor rescanned per bucket
    (a scan of the nodes between a bucket's members, and a new list, per bucket: ~1 s for the
    129 buckets of a 1T plan). Each node has a rank that orders the program: a fused call takes
    its last member's, and what moves after it ranks between it and the node that followed it
    (tuples: ``(r,) < (r, 1) < (r, 2) < (r + 1,)``). What depends on a bucket is followed from
    its values to their readers. ``readers``: each value's readers, by index into ``nodes``."""

    def __init__(self, nodes: list[Node], readers: dict[str, list[int]]):
        self.live = {id(n): n for n in nodes}
        self.rank: dict[int, tuple[int, ...]] = {id(n): (i,) for i, n in enumerate(nodes)}
        self.producer = {o: n for n in nodes for o in n.outputs}
        self.readers = {v: [nodes[k] for k in ks] for v, ks in readers.items()}

    def fuse(self, bucket: list[str]) -> None:
        """``bucket``'s members fused at its last one; what in between depends on an earlier
        member moves after it. Left unchanged when one member depends on another (they cannot
        share a call)."""
        rank = self.rank
        members = sorted((self.producer[o] for o in bucket), key=lambda n: rank[id(n)])
        first, last = rank[id(members[0])], rank[id(members[-1])]
        member_ids = {id(n) for n in members}
        heap: list[tuple[tuple[int, ...], int, Node]] = []
        seen: set[int] = set()

        def reach(values) -> None:  # their readers after the first member, up to the last
            for v in values:
                for r in self.readers.get(v, ()):
                    k = rank[id(r)]
                    if first < k <= last and id(r) not in seen:
                        seen.add(id(r))
                        heapq.heappush(heap, (k, id(r), r))

        for n in members[:-1]:
            reach(n.outputs)
        moved: list[Node] = []
        while heap:  # in program order
            _, i, n = heapq.heappop(heap)
            if i in member_ids:
                return
            moved.append(n)
            reach(n.outputs)
        fused = _fuse(members)
        for n in members:
            for u in n.uses():
                self.readers[u] = [fused if id(r) in member_ids else r for r in self.readers[u]]
            for o in n.outputs:
                self.producer[o] = fused
            del self.live[id(n)], rank[id(n)]
        self.live[id(fused)] = fused
        rank[id(fused)] = last
        for j, n in enumerate(moved, start=1):
            rank[id(n)] = last + (j,)

    def nodes(self) -> list[Node]:
        return sorted(self.live.values(), key=lambda n: self.rank[id(n)])


def _fuse(ns: list[Node]) -> Node:
    last = ns[-1]
    kind = Collective.of(last.op)
    kwargs = {k: v for k, v in last.kwargs.items() if k not in ("dim", "parts")}
    if kind != Collective.ALL_REDUCE:  # each member's split
        kwargs.update(dims=[n.kwargs["dim"] for n in ns], parts=[n.kwargs.get("parts", 1) for n in ns])
    return replace(last, outputs=[n.outputs[0] for n in ns], op=COALESCED[kind].op, args=([n.args[0] for n in ns],),
                   kwargs=kwargs, types=[n.types[0] for n in ns], sbp=[n.sbp[0] for n in ns] if last.sbp else None,
                   sbp_in=[n.sbp_in[0] for n in ns] if last.sbp_in else None,
                   why=f"{len(ns)} {kind.value}s of the {last.role.value} phase fused into one call")


def _read_by_no_node(graph: Graph) -> set[str]:
    """Values only the step's outputs read (the loss the runner reports): reduced in the first
    gradient bucket instead of a call of their own, since nothing in the step waits for them.
    None in a pipelined plan, whose loss is a per-micro-batch sum."""
    if graph.schedule is not None:
        return set()
    read = {u for n in graph.nodes for u in n.uses()}
    return {o.value for o in graph.outputs} - read


def per_microbatch(mesh: Mesh, n: Node) -> bool:
    """Whether ``n`` reads a value that differs between micro-batches (split or partial on mb)."""
    if MICROBATCH not in mesh.sbp_axes or not n.sbp_in:
        return False
    a = mesh.sbp_axes.index(MICROBATCH)
    return any(not isinstance(nd[a], Broadcast) for nd in n.sbp_in)
