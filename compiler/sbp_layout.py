"""Candidate nd-SBP signatures of every node, with strided splits resolved.

The rule book gives 1-D signatures per op. Here they become nd-signatures (one 1-D signature
per mesh axis, every split dividing its dim evenly), and the block count of each strided
split is fixed by a whole-graph analysis: positions that one signature splits together must
share their layout, so they are joined in a union-find; a ``split``/``cat`` of k equal parts
makes its class ``S(d:k)``. A fused qkv weight hinted ``S(0)`` so becomes ``S(0:3)`` and is
sharded per head, with no collective before the ``split``.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from sbpc.compiler.hint_op import OP as HINT_OP
from sbpc.compiler.ir.types import Graph, Node, TensorType
from sbpc.compiler.sbp_rules import RuleBook, Signature
from sbpc.runtime.sbp import Broadcast, NdSbp, Partial, Split, divides

MAX_CANDIDATES = 64


@dataclass(frozen=True)
class NdSignature:
    ins: tuple[NdSbp, ...]
    outs: tuple[NdSbp, ...]
    notes: tuple[str, ...]  # one per axis


class _UnionFind:
    def __init__(self):
        self.parent: dict = {}

    def find(self, x):
        p = self.parent.setdefault(x, x)
        if p != x:
            p = self.parent[x] = self.find(p)
        return p

    def union(self, a, b):
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)


class Layouts:
    """Per-node 1-D signatures for each axis size, and the block count of every (value, dim)."""

    def __init__(self, graph: Graph, rules: RuleBook, sizes: tuple[int, ...],
                 fixed: dict[int, list[NdSignature]] | None = None):
        self.graph, self.rules, self.sizes = graph, rules, sizes
        # axis -> per-node signature already decided on that axis (the micro-batch axis)
        self.fixed = fixed or {}
        types = graph.value_types()
        self.types = types
        self.per_size: dict[int, list[list[Signature]]] = {}
        for k in sorted(set(sizes)):
            self.per_size[k] = [self._node_signatures(n, [types[u] for u in n.uses()], k) for n in graph.nodes]
        self.parts = self._strides()

    def _node_signatures(self, n: Node, in_types: list[TensorType], k: int) -> list[Signature]:
        bcast = Signature(tuple(Broadcast() for _ in in_types), tuple(Broadcast() for _ in n.outputs), "all B")
        if k == 1:
            return [bcast]
        if n.op == HINT_OP:  # identity: any layout passes through; the hint filters later
            t = n.types[0]
            choices = [Broadcast(), Partial()] + [Split(d) for d in range(len(t.shape)) if t.shape[d] % k == 0]
            return [Signature((s,), (s,), "hint") for s in choices]
        return self.rules.signatures(n, in_types, k)

    def _strides(self) -> dict[tuple[str, int], int]:
        uf, demands = _UnionFind(), {}
        for k, all_sigs in self.per_size.items():
            for n, sigs in zip(self.graph.nodes, all_sigs):
                names = list(n.uses()) + list(n.outputs)
                for sig in sigs:
                    groups: dict[int, list] = {}
                    for v, s in zip(names, sig.ins + sig.outs):
                        if isinstance(s, Split):
                            groups.setdefault(s.parts, []).append((v, s.dim))
                    # a split/cat: block counts change across the op; the rule's base form (plain
                    # splits on one side) says how many blocks the other side has
                    source = len(groups) > 1 and min(groups) == 1
                    for parts, pos in groups.items():
                        for p in pos[1:]:
                            uf.union(pos[0], p)
                        if parts > 1 and source:
                            demands.setdefault(uf.find(pos[0]), set()).add(parts)
        # demands were recorded against roots that later unions may have merged
        merged: dict = {}
        for root, parts in demands.items():
            merged.setdefault(uf.find(root), set()).update(parts)
        self._uf = uf
        return {root: next(iter(p)) for root, p in merged.items() if len(p) == 1}

    def block_count(self, value: str, dim: int) -> int:
        return self.parts.get(self._uf.find((value, dim)), 1)

    def with_strides(self, n: Node, sig: Signature) -> Signature:
        """``sig`` with each split's block count taken from the analysis; a split/cat signature
        (block counts that differ across the op) keeps the counts its rule gives."""
        names = list(n.uses()) + list(n.outputs)
        sbps = sig.ins + sig.outs
        source = len({s.parts for s in sbps if isinstance(s, Split)}) > 1
        fixed = [Split(s.dim, self.block_count(v, s.dim)) if isinstance(s, Split) and not source else s
                 for v, s in zip(names, sbps)]
        return Signature(tuple(fixed[:len(sig.ins)]), tuple(fixed[len(sig.ins):]), sig.note)

    def candidates(self, index: int) -> list[NdSignature]:
        """Every nd-signature of node ``index`` whose splits divide evenly; all-B first."""
        n = self.graph.nodes[index]
        per_axis = [[_one_axis(self.fixed[a][index], a)] if a in self.fixed else
                    list({(r := self.with_strides(n, s)).ins + r.outs: r for s in self.per_size[k][index]}.values())
                    for a, k in enumerate(self.sizes)]
        shapes = [self.types[u].shape for u in n.uses()] + [t.shape for t in n.types]
        out = []
        for combo in itertools.product(*per_axis):
            ins = tuple(tuple(sig.ins[i] for sig in combo) for i in range(len(combo[0].ins))) if combo else ()
            outs = tuple(tuple(sig.outs[i] for sig in combo) for i in range(len(combo[0].outs))) if combo else ()
            if all(divides(shape, nd, self.sizes) for shape, nd in zip(shapes, ins + outs)):
                out.append(NdSignature(ins, outs, tuple(s.note for s in combo)))
            if len(out) >= MAX_CANDIDATES:
                break
        return out


def _one_axis(c: NdSignature, a: int) -> Signature:
    """The 1-D signature an nd-signature has on axis ``a``."""
    return Signature(tuple(nd[a] for nd in c.ins), tuple(nd[a] for nd in c.outs), c.notes[a])
