"""Candidate nd-SBP signatures of every node, with strided splits resolved.

The rule book gives 1-D signatures per op. Here they become nd-signatures (one 1-D signature
per mesh axis, every split dividing its dim evenly), and the block count of each strided
split is fixed by a whole-graph analysis: positions that one signature splits together must
share their layout, so they are joined in a union-find (``_find``); a ``split``/``cat`` of k equal parts
makes its class ``S(d:k)``. A fused qkv weight hinted ``S(0)`` so becomes ``S(0:3)`` and is
sharded per head, with no collective before the ``split``.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from sbpc.compiler.frontend.hint_op import OP as HINT_OP
from sbpc.compiler.ir.mesh import MICROBATCH
from sbpc.compiler.ir.types import Graph, Node, Role, TensorType
from sbpc.compiler.sbp.rowwise import Regions, find_regions
from sbpc.compiler.sbp.rules import RuleBook, Signature
from sbpc.runtime.sbp import Broadcast, NdSbp, Partial, Split, divides

MAX_CANDIDATES = 64


class Layout(tuple):
    """An nd-SBP as the search keeps it: a plain tuple in every way (equal to one, hashing as
    one, printed as one) whose hash is computed once. The search keys its dicts and sets by
    nd-SBPs millions of times, and a tuple hashes each of its SBPs (a Python call each) on every
    lookup. ``Layouts.intern`` makes one per distinct nd-SBP."""

    def __new__(cls, nd: NdSbp) -> Layout:
        self = tuple.__new__(cls, nd)
        self._hash = tuple.__hash__(self)
        return self

    def __hash__(self) -> int:
        return self._hash


@dataclass(frozen=True)
class NdSignature:
    ins: tuple[NdSbp, ...]
    outs: tuple[NdSbp, ...]
    notes: tuple[str, ...]  # one per axis


class Layouts:
    """Per-node 1-D signatures for each axis size, and the block count of every (value, dim)."""

    def __init__(self, graph: Graph, rules: RuleBook, sizes: tuple[int, ...],
                 fixed: dict[int, list[NdSignature]] | None = None, rep: list[int] | None = None,
                 memo: dict | None = None):
        self.graph, self.rules, self.sizes = graph, rules, sizes
        # axis -> per-node signature already decided on that axis (the micro-batch axis)
        self.fixed = fixed or {}
        # rep: node -> the node of its layer class whose signatures it shares (layer_classes);
        # memo: what Layouts of one graph share (value types, per-size signatures, stride
        # patterns, interned layouts)
        self._memo = memo if memo is not None else {}
        if "types" not in self._memo:
            self._memo["types"] = graph.value_types()
        self.types = self._memo["types"]
        if "rowwise" not in self._memo:
            self._memo["rowwise"] = find_regions(graph, self.types)
        # row-wise regions (sbp/rowwise.py): their ops take the region's signature, not their rules
        self.regions: Regions = self._memo["rowwise"]
        self._region_axes = {r.module: self.regions.axes(r, graph.mesh.sbp_axes, sizes) for r in self.regions.regions}
        if "names" not in self._memo:  # per node: its uses, then its outputs (a signature's positions)
            self._memo["names"] = [n.uses() + tuple(n.outputs) for n in graph.nodes]
        self._names: list[tuple[str, ...]] = self._memo["names"]
        self._layouts = self._memo.setdefault("layouts", {})  # nd-SBP -> its one Layout (intern)
        self._sbps = self._memo.setdefault("sbps", {})  # SBP -> its one copy
        self.per_size: dict[int, list[list[Signature]]] = {}
        for k in sorted(set(sizes)):
            key = ("per_size", k)
            if key not in self._memo:
                self._memo[key] = self._all_signatures(k, rep)
            self.per_size[k] = self._memo[key]
        # an axis of size one splits nothing, so it adds nothing to the stride analysis: the
        # solvers of one graph whose other sizes agree share it
        key = ("strides", tuple(k for k in sorted(self.per_size) if k > 1))
        if key not in self._memo:
            self._memo[key] = self._strides()
        self._split_at, self._counts = self._memo[key]
        self._node_counts: dict[int, tuple] = {}  # _block_counts, once asked
        # the micro-batch axis: an optimizer op runs once a step, so there it sees every value
        # whole (a gradient accumulated over the micro-batches), never one micro-batch's part
        self.sequential = frozenset(a for a, name in enumerate(graph.mesh.sbp_axes) if name == MICROBATCH)

    def _all_signatures(self, k: int, rep: list[int] | None) -> list[list[Signature]]:
        """Every node's 1-D signatures for axis size ``k``. A node of a layer class shares its
        representative's list (same op, literals, aliasing and types: the same signatures)."""
        nodes, types = self.graph.nodes, self.types
        out: list = [None] * len(nodes)
        for i, n in enumerate(nodes):
            if i in self.regions.of_node:  # its signatures are its region's (candidates); none of its rule's
                out[i] = [self.regions.signature(n, split=False)]
            elif rep is None or rep[i] == i:
                out[i] = self._node_signatures(n, [types[u] for u in n.uses()], k)
        if rep is not None:
            for i, r in enumerate(rep):
                if r != i:
                    out[i] = out[r]
        return out

    def _node_signatures(self, n: Node, in_types: list[TensorType], k: int) -> list[Signature]:
        bcast = Signature(tuple(Broadcast() for _ in in_types), tuple(Broadcast() for _ in n.outputs), "all B")
        if k == 1:
            return [bcast]
        if n.op == HINT_OP:  # identity: any layout passes through; the hint filters later
            t = n.types[0]
            choices = [Broadcast(), Partial()] + [Split(d) for d in range(len(t.shape)) if t.shape[d] % k == 0]
            return [Signature((s,), (s,), "hint") for s in choices]
        return self.rules.signatures(n, in_types, k)

    def _strides(self) -> tuple[list[tuple], dict[tuple[str, int], tuple[int, ...]]]:
        """Per node, the (position, dim) pairs some of its signatures split; and the block counts
        of every (value, dim) of more than one block, or offered more: the fixed one first."""
        uf: dict = {}  # (value, dim) -> its parent in the union-find of layout classes (_find)
        demands, options = [], []
        patterns = self._memo.setdefault("patterns", {})
        split_ats: list[tuple] = []
        for n, names, *lists in zip(self.graph.nodes, self._names, *(self.per_size[k] for k in sorted(self.per_size))):
            key = tuple(map(id, lists))
            found = patterns.get(key)
            if found is None:
                found = patterns[key] = (_pattern(lists), lists)  # the lists stay alive: ids stay unique
            unions, wants, split_at = found[0]
            split_ats.append(split_at)
            if not unions and not wants:
                continue
            for p, d, q, e in unions:
                a, b = _find(uf, (names[p], d)), _find(uf, (names[q], e))
                if a != b:
                    uf[b] = a
            # a view's strided split follows the shapes (an inner dim of a folded group), and
            # the same dim may also split plainly: it offers a block count, it does not fix one.
            # So does a repeat's (each copy split, or the copies: a batch folded in front of
            # Bloom's alibi heads); fixed, its count took the plain split from the whole batch
            weak = self.rules.strides_optional(n.op)
            for p, d, parts in wants:
                (options if weak else demands).append(((names[p], d), parts))
        # demands resolve against the final classes
        merged: dict = {}
        for at, parts in demands:
            merged.setdefault(_find(uf, at), set()).add(parts)
        parts = {root: next(iter(p)) for root, p in merged.items() if len(p) == 1}
        offered: dict = {}
        for at, c in options:
            offered.setdefault(_find(uf, at), set()).add(c)
        counts, of_class = {}, {}
        for x in list(uf):
            r = _find(uf, x)
            found = of_class.get(r)
            if found is None:
                first = parts.get(r, 1)
                more = tuple(sorted(offered.get(r, set()) - {first}))
                found = of_class[r] = (first, *more) if first != 1 or more else ()
            if found:
                counts[x] = found
        return split_ats, counts

    def intern(self, nd: NdSbp) -> Layout:
        """The one ``Layout`` of ``nd`` (made of the one copy of each of its SBPs): equal
        layouts are then one object, so comparing them stops at identity."""
        found = self._layouts.get(nd)
        if found is None:
            found = self._layouts[nd] = Layout(tuple(self._sbps.setdefault(s, s) for s in nd))
        return found

    def block_count(self, value: str, dim: int) -> int:
        return self._counts.get((value, dim), (1,))[0]

    def with_strides(self, n: Node, sig: Signature) -> list[Signature]:
        """``sig`` with each split's block count taken from the analysis, once per count its
        class is offered (the fixed one first); a split/cat signature (block counts that differ
        across the op) keeps the counts its rule gives."""
        sbps = sig.ins + sig.outs
        splits = [(v, s) for v, s in zip(n.uses() + tuple(n.outputs), sbps) if isinstance(s, Split)]
        if not splits or len({s.parts for _, s in splits}) > 1:
            return [sig]
        v0, s0 = splits[0]  # one class: a signature of one block count joins its split positions
        out = []
        for c in self._counts.get((v0, s0.dim), (1,)):
            fixed = [Split(s.dim, c) if isinstance(s, Split) else s for s in sbps]
            out.append(Signature(tuple(fixed[:len(sig.ins)]), tuple(fixed[len(sig.ins):]), sig.note))
        return out

    def same_candidates(self, i: int, j: int) -> bool:
        """Whether nodes ``i`` and ``j`` (of one layer class) have the same candidates: the same
        1-D signatures, the same decided axes and the same block counts at every position."""
        if any(f[i] != f[j] for f in self.fixed.values()):
            return False
        if self.regions.of_node and (i in self.regions.of_node or j in self.regions.of_node):
            return self._region_signature(i) == self._region_signature(j)
        if any(sigs[i] is not sigs[j] and sigs[i] != sigs[j] for sigs in self.per_size.values()):
            return False
        return not self._split_at[i] or self._block_counts(i) == self._block_counts(j)

    def _block_counts(self, i: int) -> tuple:
        """The block counts of node ``i``'s values at the (position, dim) pairs some of its
        signatures split (``_split_at``)."""
        found = self._node_counts.get(i)
        if found is None:
            names, counts = self._names[i], self._counts
            found = self._node_counts[i] = tuple(counts.get((names[p], d)) for p, d in self._split_at[i])
        return found

    def exact(self, index: int, ins: tuple[NdSbp, ...], outs: tuple[NdSbp, ...]) -> bool:
        """Whether node ``index`` computes its op exactly with these nd-SBPs: every split divides
        its dim, and the one-axis signatures hold together (a view's flat blocks, counted on the
        shard the earlier axes leave). Every nd-signature the solver may pick passes here."""
        n = self.graph.nodes[index]
        shapes = [self.types[u].shape for u in n.uses()] + [t.shape for t in n.types]
        return all(divides(shape, nd, self.sizes) for shape, nd in zip(shapes, ins + outs)) and \
            (index in self.regions.of_node or self.rules.nd_exact(n, shapes[:len(ins)], ins, outs, self.sizes))

    def _region_signature(self, index: int) -> tuple | None:
        """Per axis, the 1-D signature of a row-wise region's op (None: not in one)."""
        region = self.regions.of_node.get(index)
        if region is None:
            return None
        n, split = self.graph.nodes[index], self._region_axes[region.module]
        return tuple(self.regions.signature(n, a in split) for a in range(len(self.sizes)))

    def candidates(self, index: int) -> list[NdSignature]:
        """Every nd-signature of node ``index`` whose splits divide evenly; all-B first."""
        n = self.graph.nodes[index]
        once = Signature(tuple(Broadcast() for _ in n.uses()), tuple(Broadcast() for _ in n.outputs), "once a step")
        region = self._region_signature(index)
        per_axis = [[_one_axis(self.fixed[a][index], a)] if a in self.fixed else
                    [region[a]] if region is not None else
                    [once] if a in self.sequential and k > 1 and n.role == Role.OPTIMIZER else
                    list({r.ins + r.outs: r for s in self.per_size[k][index] for r in self.with_strides(n, s)}.values())
                    for a, k in enumerate(self.sizes)]
        out = []
        for combo in itertools.product(*per_axis):
            ins = tuple(self.intern(tuple(sig.ins[i] for sig in combo)) for i in range(len(combo[0].ins))) if combo else ()
            outs = tuple(self.intern(tuple(sig.outs[i] for sig in combo)) for i in range(len(combo[0].outs))) if combo else ()
            if self.exact(index, ins, outs):
                out.append(NdSignature(ins, outs, tuple(s.note for s in combo)))
            if len(out) >= MAX_CANDIDATES:
                break
        return out


def _find(parent: dict, x):
    """The root of ``x``'s class in the union-find ``parent`` (element -> its parent; a new
    element is a class of its own), halving the path on the way."""
    p = parent.setdefault(x, x)
    while p != x:
        g = parent[p]
        parent[x] = g
        x, p = g, parent[g]
    return x


def _pattern(lists) -> tuple[tuple, tuple]:
    """What a node's signature lists ask of the stride analysis, by position: the (position,
    dim) pairs that share a layout, the block counts a split/cat demands, and every (position,
    dim) some signature splits."""
    unions, wants, split_at = set(), set(), set()
    for sigs in lists:
        for sig in sigs:
            groups: dict[int, list] = {}
            for p, s in enumerate(sig.ins + sig.outs):
                if isinstance(s, Split):
                    groups.setdefault(s.parts, []).append((p, s.dim))
                    split_at.add((p, s.dim))
            # a split/cat: block counts change across the op; the rule's base form (plain
            # splits on one side) says how many blocks the other side has
            source = len(groups) > 1 and min(groups) == 1
            for parts, pos in groups.items():
                for q in pos[1:]:
                    unions.add(pos[0] + q)
                if parts > 1 and source:
                    wants.add(pos[0] + (parts,))
    return tuple(sorted(unions)), tuple(sorted(wants)), tuple(sorted(split_at))


def _one_axis(c: NdSignature, a: int) -> Signature:
    """The 1-D signature an nd-signature has on axis ``a``."""
    return Signature(tuple(nd[a] for nd in c.ins), tuple(nd[a] for nd in c.outs), c.notes[a])
