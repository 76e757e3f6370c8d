"""Layer classes: the nodes of repeated layers that SBP propagation decides together.

Transformer layers are copies of one another. Two nodes are in one class when they have the
same op, literal arguments, aliasing of their uses, input and output types and role, and a
module path that is the same once its layer indices are blanked (``h.17.attn.c_attn`` and
``h.3.attn.c_attn`` are both ``h.#.attn.c_attn``), and when they are the k-th node of that
(blanked module, role) group in their own layer. The optimizer nodes of a layer's parameters
carry the parameter's module path, so they repeat too. An op of no module whose producers
are in exactly one layer (autograd's sum of the gradients of a residual) is in that layer.
The copies of a hyperparameter op on each pipeline chunk (Adam's bias corrections) are a
class whose layers are the chunks.

Each class with at least ``min_members`` members (in as many different layers) gets a
representative in its middle layer, so that the representative's neighbours are layers as
well: whatever it costs there is what it costs in every layer but the first and the last.
Propagation decides the representative and copies the decision to the members; a member
whose candidate signatures differ from the representative's is taken out of its class
(``LayerClasses.drop``) and decided on its own.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from sbpc.compiler.ir.aten import hyper_only
from sbpc.compiler.ir.types import Graph, Node, Ref, TensorType

_CHUNK_COPY = "<chunk>"  # the blanked module of per-chunk copies (no module path has "<")
_INDEX = re.compile(r"(?:(?<=\.)|^)\d+(?=\.|$)")


def blank_layers(module: str) -> tuple[str, tuple[int, ...]]:
    """``("h.#.attn", (17,))`` for ``"h.17.attn"``: the path with layer indices blanked, and them."""
    return _INDEX.sub("#", module), tuple(int(m) for m in _INDEX.findall(module))


def _shape_of(a, refs: dict[str, int]):
    """An argument with every value reference replaced by the index of its first use."""
    if isinstance(a, Ref):
        return ("%", refs.setdefault(a.name, len(refs)))
    if isinstance(a, dict):
        return tuple((k, _shape_of(v, refs)) for k, v in a.items())
    if isinstance(a, (list, tuple)):
        return (type(a).__name__,) + tuple(_shape_of(x, refs) for x in a)
    return repr(a)


def node_key(n: Node, in_types: tuple) -> tuple:
    """What two nodes of one class share, apart from where they are."""
    refs: dict[str, int] = {}
    return (n.op, n.role, _shape_of(n.args, refs), _shape_of(n.kwargs, refs), in_types, tuple(n.types))


@dataclass
class LayerClasses:
    rep: list[int]  # node -> the representative it follows (itself when it is one, or in no class)
    members: dict[int, list[int]] = field(default_factory=dict)  # representative -> members, itself included

    @property
    def tied(self) -> int:
        """Nodes that follow another."""
        return sum(len(m) - 1 for m in self.members.values())

    def copy(self) -> "LayerClasses":
        return LayerClasses(list(self.rep), {r: list(m) for r, m in self.members.items()})

    def active(self) -> list[int]:
        """The nodes that are decided: representatives and nodes in no class, in program order."""
        return [i for i, r in enumerate(self.rep) if r == i]

    def drop(self, idx: int) -> None:
        """Take a member (not a representative) out of its class."""
        r = self.rep[idx]
        if r == idx:
            return
        self.members[r].remove(idx)
        self.rep[idx] = idx
        if len(self.members[r]) == 1:
            del self.members[r]


def layer_classes(graph: Graph, min_members: int = 3, types: dict[str, TensorType] | None = None,
                  hyper: list[bool] | None = None) -> LayerClasses:
    """The layer classes of ``graph`` (see the module docstring). ``types`` (``graph.value_types()``)
    and ``hyper`` (``hyper_only(graph)``): what the caller found already (each is a walk of the graph)."""
    types = graph.value_types() if types is None else types
    hyper = hyper_only(graph) if hyper is None else hyper
    groups: dict[tuple, list[tuple[tuple[int, ...], int]]] = {}
    seen: dict[tuple, int] = {}
    layer_of: dict[str, tuple[int, ...]] = {}  # value -> the layer whose module path made it
    blanked: dict[str, tuple[str, tuple[int, ...]]] = {}  # module -> blank_layers(module): ops share modules
    for idx, n in enumerate(graph.nodes):
        module = n.loc.module if n.loc else ""
        if module not in blanked:
            blanked[module] = blank_layers(module)
        blank, layer = blanked[module]
        if layer:
            layer_of.update(dict.fromkeys(n.outputs, layer))
        elif hyper[idx] and n.stage is not None:
            # a pipeline chunk's copy of a hyperparameter op (per_chunk_hyper_ops): the copies
            # are a class across chunks, so that every layer's update reads its chunk's copy
            # as the representative reads its own, and is priced with it
            blank, layer = _CHUNK_COPY, (n.stage,)
        else:
            # an op of no module inside a layer (autograd's sum of a residual's gradients):
            # the layer of its producers, when they name exactly one
            named = {layer_of[u] for u in n.uses() if u in layer_of}
            if len(named) != 1:
                continue
            layer = named.pop()
        k = seen.get((blank, n.role, layer), 0)
        seen[(blank, n.role, layer)] = k + 1
        key = (blank, k, node_key(n, tuple(types[u] for u in n.uses())))
        groups.setdefault(key, []).append((layer, idx))
    rep = list(range(len(graph.nodes)))
    members: dict[int, list[int]] = {}
    for group in groups.values():
        layers = [layer for layer, _ in group]
        if len(group) < min_members or len(set(layers)) != len(layers):
            continue
        group.sort()
        r = group[len(group) // 2][1]
        members[r] = sorted(idx for _, idx in group)
        for _, idx in group:
            rep[idx] = r
    return LayerClasses(rep, members)
