"""Row-wise regions: the ops of a module that is a function of each row of its inputs alone,
split as one.

A mixture of experts sorts the tokens it is given by expert and indexes them with that
permutation; no per-op rule splits such a sort, so the layer would run on the whole batch on
every dp rank, and a pipeline could not split it into micro-batches. But the module is a
function of each token alone (``compiler/frontend/rowwise_modules.py`` says which modules
promise it), so a device that runs the module's ops on its own tokens, as if they were the
whole batch, computes its tokens' rows of the whole result. On a batch axis (dp, mb) the
region's ops are split that way, the ops of its forward and of its backward alike:

- a **row** value (its dim 0 counts the region's rows, or the rows times a factor that its
  inputs have: a token's top-k pairs) is ``S(0)``;
- a value made from row values that has no rows of its own is ``P``: what this device's rows
  contribute (the tokens per expert, an expert's weight gradient);
- any other value (the experts' weights, what is made of them alone) is ``B``.

Inside the region these layouts describe each device's local program, not slices of the
single-device values (a device sorts its own tokens). At the region's edges they are exact:
its inputs are its module's arguments, rows (``S(0)``: each device takes its rows) and
parameters (``B``), and what leaves it is a row value (``S(0)``), one made of parameters alone
(``B``), or a sum over the rows (``P``: a weight gradient, checked to come from a sum through
linear ops alone). A region whose edges or arguments do not fit this is not split (its ops
keep their own rules), and why is kept for ``refused``.

``localize`` gives a region's ops the local sizes in the arguments that spell the rows (view
and factory sizes, ``arange``'s end): the analysis refuses a region with a row count anywhere
else in its arguments.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace

from sbpc.compiler.frontend.hint_op import OP as HINT_OP
from sbpc.compiler.ir.mesh import MICROBATCH, POSITIONAL_AXES
from sbpc.compiler.ir.types import Graph, InputKind, Node, Ref, Role, TensorType, users
from sbpc.compiler.sbp.rules import Signature
from sbpc.runtime.sbp import Broadcast, Partial, Split, local_shape


class Kind(enum.Enum):
    ROW = "row"  # S(0) on a split axis
    PARTIAL = "partial"  # P
    WHOLE = "whole"  # B


_LAYOUT = {Kind.ROW: Split(0), Kind.PARTIAL: Partial(), Kind.WHOLE: Broadcast()}
# the axes a region splits: data parallelism, in space and in time
BATCH_AXES = (POSITIONAL_AXES[0], MICROBATCH)

# where an op spells a size list (argument position); localize makes it the local one
_SIZE_LISTS = {"aten.view.default": 1, "aten._unsafe_view.default": 1, "aten.reshape.default": 1,
               "aten.expand.default": 1, "aten.zeros.default": 0, "aten.ones.default": 0, "aten.full.default": 0,
               "aten.empty.memory_format": 0, "aten.new_zeros.default": 1, "aten.new_ones.default": 1,
               "aten.new_empty.default": 1, "aten.new_full.default": 1,
               "aten.slice_backward.default": 1, "aten.select_backward.default": 1}
_ARANGE = "aten.arange.default"  # arange(end): a device's positions are its own, 0 to its rows
# ops whose int arguments size a dim they name: fine where that dim is not the rows'
_DIM_AT = {"aten.split.Tensor": 2, "aten.split_with_sizes.default": 2, "aten.narrow.default": 1,
           "aten.slice.Tensor": 1, "aten.select.int": 1}
# results that sum over the rows of a row input: an expert's weight gradient, the tokens per
# expert; ``aten.sum.dim_IntList`` where it sums dim 0, and an accumulating ``index_put`` into
# a tensor without rows (_sums_rows). A value that leaves the region partial must be one of
# these, through linear ops that keep the sum
_SUMS = {("transformers.grouped_mm_fallback_backward.default", 1), ("aten.histc.default", 0)}
# ops after which dim 0 no longer counts the rows when it did: it is reduced (moves: _keeps_rows)
_REDUCES = {"aten.amax.default", "aten.amin.default", "aten.sum.dim_IntList", "aten.mean.dim", "aten.max.dim",
            "aten.min.dim", "aten.argmax.default", "aten.argmin.default", "aten.logsumexp.default",
            "aten.var.correction", "aten.std.correction", "aten.var_mean.correction", "aten.prod.dim_int",
            "aten.any.dim", "aten.all.dim", "aten.linalg_vector_norm.default"}
_MATMULS = {"aten.mm.default", "aten.bmm.default", "aten.matmul.default", "aten.addmm.default"}
_LINEAR = {"aten.transpose.int", "aten.t.default", "aten.permute.default", "aten.view.default",
           "aten.reshape.default", "aten._unsafe_view.default", "aten.clone.default", "aten._to_copy.default",
           "aten.squeeze.dim", "aten.unsqueeze.default", "aten.alias.default"}


@dataclass(frozen=True)
class Region:
    module: str
    rows: int  # the row count of its inputs (the tokens)
    members: frozenset[int]  # node indices


@dataclass(frozen=True)
class Regions:
    """The row-wise regions of a graph, and each of their values' kind."""
    regions: tuple[Region, ...] = ()
    kind: dict[str, Kind] = field(default_factory=dict)
    of_node: dict[int, Region] = field(default_factory=dict)  # node index -> its region
    refused: tuple[tuple[str, str], ...] = ()  # (module, why) of each region not split

    def axes(self, region: Region, axis_names: tuple[str, ...], sizes: tuple[int, ...]) -> frozenset[int]:
        """The axes that split ``region``: the batch axes of more than one device, micro-batches
        first (their split is decided first), as long as their devices together divide its rows."""
        order = sorted((a for a, name in enumerate(axis_names) if name in BATCH_AXES and sizes[a] > 1),
                       key=lambda a: axis_names[a] != MICROBATCH)
        out, parts = set(), 1
        for a in order:
            if region.rows % (parts * sizes[a]) == 0:
                out.add(a)
                parts *= sizes[a]
        return frozenset(out)

    def signature(self, node: Node, split: bool) -> Signature:
        """Node's 1-D signature on an axis that splits its region (``split``) or not (all B)."""
        if not split:
            return Signature(tuple(Broadcast() for _ in node.uses()), tuple(Broadcast() for _ in node.outputs),
                             "row-wise region, whole")
        kind = self.kind
        return Signature(tuple(_LAYOUT[kind[u]] for u in node.uses()), tuple(_LAYOUT[kind[o]] for o in node.outputs),
                         "row-wise region")


def region_of(node: Node, modules: tuple[str, ...] | frozenset[str]) -> str | None:
    """The row-wise module (of ``modules``: ``Graph.rowwise``) whose region ``node`` is one of:
    its forward and backward ops. Not its parameters' updates, which carry its path too, nor
    hints, which pin a layout where the region meets the rest (ZeRO's on a weight gradient).
    ``modules`` as a set makes this a lookup per enclosing module path."""
    if not modules or node.loc is None or node.role not in (Role.FORWARD, Role.BACKWARD) or node.op == HINT_OP:
        return None
    path = node.loc.module
    while path:
        if path in modules:
            return path
        path = path.rpartition(".")[0]
    return None


def find_regions(graph: Graph, types: dict[str, TensorType]) -> Regions:
    if not graph.rowwise:
        return Regions()
    # what does not depend on the batch (parameters, and what is made of them alone: ZeRO-3's
    # gathered weights, autocast's casts) is the same on every device: never rows
    batchy = {i.value for i in graph.inputs if i.kind == InputKind.BATCH}
    modules, owner = frozenset(graph.rowwise), {}
    for i, n in enumerate(graph.nodes):
        if any(u in batchy for u in n.uses()):
            batchy.update(n.outputs)
        m = region_of(n, modules)
        if m is not None:
            owner[i] = m
    consumers, read_out = users(graph.nodes), {o.value for o in graph.outputs}
    _absorb(graph.nodes, owner, consumers, read_out)
    members_of: dict[str, list[int]] = {}
    for i, m in sorted(owner.items()):
        members_of.setdefault(m, []).append(i)
    regions, kinds, of_node, refused = [], {}, {}, []
    for module in graph.rowwise:
        members = members_of.get(module)
        if not members:
            continue
        found = _analyse(graph, module, members, types, batchy, consumers, read_out)
        if isinstance(found, str):
            refused.append((module, found))
            continue
        region, kind = found
        regions.append(region)
        kinds.update(kind)
        of_node.update((i, region) for i in members)
    return Regions(tuple(regions), kinds, of_node, tuple(refused))


def _absorb(nodes: list[Node], owner: dict[int, str], consumers: dict[str, list[int]], read_out: set[str]) -> None:
    """Adds to ``owner`` the ops between a region's ops that carry no module of it: the
    backward's sums of a value's gradients (autograd accumulates where a region value is read
    twice, at the loss's line), whose inputs and readers are all one region's. They carry no
    module, so localize gives them their rules' local form, which for a sum is the same op."""
    made = {o: owner[i] for i in owner for o in nodes[i].outputs}
    grew = True
    while grew:  # a chain of such ops joins one op a round
        grew = False
        for i, n in enumerate(nodes):
            uses = n.uses()
            if i in owner or not uses or n.role not in (Role.FORWARD, Role.BACKWARD) or n.op == HINT_OP:
                continue
            regions = {made.get(u) for u in uses}
            if len(regions) != 1 or None in regions or any(o in read_out for o in n.outputs):
                continue
            m = regions.pop()
            readers = [c for o in n.outputs for c in consumers.get(o, ())]
            if readers and all(owner.get(c) == m for c in readers):
                owner[i] = m
                made.update((o, m) for o in n.outputs)
                grew = True


def _analyse(graph: Graph, module: str, members: list[int], types: dict[str, TensorType], batchy: set[str],
             consumers: dict[str, list[int]], read_out: set[str]) -> tuple[Region, dict[str, Kind]] | str:
    """The region of ``module``'s ops and the kind of each of its values, or why it cannot be one.
    ``batchy``: the values that depend on the batch (the others are whole on every device)."""
    nodes, inside = graph.nodes, set(members)
    made = {o for i in members for o in nodes[i].outputs}
    edges = list(dict.fromkeys(u for i in members for u in nodes[i].uses() if u not in made))
    row_edges = [u for u in edges if u in batchy]
    counts = {types[u].shape[0] if types[u].shape else None for u in row_edges}
    if len(counts) != 1 or None in counts:
        return f"its inputs do not share one row count ({sorted(map(str, counts))})"
    rows = counts.pop()
    if rows < 2:
        return "it has one row"
    # a row value's dim 0 is the rows times a factor its inputs have (top-k pairs: [T, k] -> [T*k])
    factors = {1} | {math.prod(types[u].shape[1:d]) for u in row_edges for d in range(2, len(types[u].shape) + 1)}
    row_sizes = {rows * f for f in factors}
    # a tensor of the experts' shape whose dim 0 could be read as rows: refused, not guessed at
    for u in edges:
        if u not in batchy and types[u].shape and types[u].shape[0] in row_sizes:
            return f"%{u}'s dim 0 ({types[u].shape[0]}) equals a row count"
    kind = {u: Kind.ROW if u in batchy else Kind.WHOLE for u in edges}
    for i in members:
        n = nodes[i]
        why = _unlocalizable(n, row_sizes)
        if why:
            return why
        ins = [kind[u] for u in n.uses()]
        keeps = _keeps_rows(n, kind, types)
        for pos, (o, t) in enumerate(zip(n.outputs, n.types)):
            rowlike = bool(t.shape) and t.shape[0] in row_sizes
            if _sums_rows(n, pos, kind):
                kind[o] = Kind.PARTIAL
            elif rowlike and ((Kind.ROW in ins and keeps) or not ins):
                kind[o] = Kind.ROW
            elif ins and any(k != Kind.WHOLE for k in ins):
                kind[o] = Kind.PARTIAL
            else:
                kind[o] = Kind.WHOLE
    producer = {o: i for i in members for o in nodes[i].outputs}
    for o in made:
        leaves = o in read_out or any(c not in inside for c in consumers.get(o, ()))
        if leaves and kind[o] == Kind.PARTIAL and not _a_sum(o, producer, nodes, kind):
            n = nodes[producer[o]]
            return f"{n.op} -> %{o} leaves it made from its rows but not as a sum over them"
    return Region(module, rows, frozenset(members)), kind


def _a_sum(value: str, producer: dict[str, int], nodes: list[Node], kind: dict[str, Kind]) -> bool:
    """Whether ``value`` is a sum over the region's rows: a summing op's result, through ops
    linear in it (views, transposes, casts)."""
    while True:
        n = nodes[producer[value]]
        if _sums_rows(n, n.outputs.index(value), kind):
            return True
        if n.op not in _LINEAR or not n.uses() or n.uses()[0] not in producer or kind[n.uses()[0]] != Kind.PARTIAL:
            return False
        value = n.uses()[0]


def _keeps_rows(n: Node, kind: dict[str, Kind], types: dict[str, TensorType]) -> bool:
    """Whether dim 0 of ``n``'s results still counts the rows of its row input: not where the
    op moves that dim (a transpose), reduces it (a max over the rows) or contracts it (a matmul
    whose left operand is not the rows)."""
    uses = n.uses()
    if n.op in _MATMULS:
        return kind[uses[-2 if n.op == "aten.addmm.default" else 0]] == Kind.ROW
    rank = max(1, len(types[uses[0]].shape)) if uses else 1
    if n.op == "aten.t.default":
        return rank < 2
    if n.op == "aten.permute.default":
        return n.args[1][0] % rank == 0
    if n.op in ("aten.transpose.int", "aten.movedim.int"):  # dim 0 stays where neither dim named is 0
        a, b = n.args[1] % rank, n.args[2] % rank
        return a == b or 0 not in (a, b)
    if n.op in _REDUCES:
        dims = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
        if dims is None or dims == []:
            return False
        dims = [dims] if isinstance(dims, int) else dims
        return 0 not in [d % max(1, rank) for d in dims]
    return True


def _sums_rows(n: Node, pos: int, kind: dict[str, Kind]) -> bool:
    """Whether result ``pos`` of ``n`` sums over the rows of a row input (see ``_SUMS``)."""
    uses = n.uses()
    if not any(kind[u] == Kind.ROW for u in uses):
        return False
    if (n.op, pos) in _SUMS:
        return True
    if n.op == "aten.sum.dim_IntList":
        rank = len(n.types[0].shape) + (0 if len(n.args) > 2 and n.args[2] is True else len(n.args[1]))
        return 0 in [d % max(1, rank) for d in n.args[1]]
    if n.op == "aten.index_put.default":  # accumulated into a tensor without rows: batched experts' weights
        return len(n.args) > 3 and n.args[3] is True and kind[uses[0]] == Kind.WHOLE
    return False


def _unlocalizable(n: Node, row_sizes: set[int]) -> str | None:
    """Why ``n``'s arguments cannot be made a device's own: a row count where localize does not
    make it the local one (a scalar that happens to equal the rows included: refused, not guessed)."""
    skip: set[int] = set()
    if n.op in _SIZE_LISTS:
        skip.add(_SIZE_LISTS[n.op])
    elif n.op == _ARANGE:
        skip.add(0)
    elif n.op in _DIM_AT:  # a dim counted from the end is not the rows' (dim 0) on a rank above one
        dim = n.args[_DIM_AT[n.op]] if len(n.args) > _DIM_AT[n.op] else n.kwargs.get("dim", 0)
        rank = len(n.types[0].shape) + (n.op == "aten.select.int") if n.types else 0
        if isinstance(dim, int) and rank > 1 and dim % rank != 0:
            return None
    for p, a in enumerate(n.args):
        if p not in skip and any(v in row_sizes for v in _ints(a)):
            return f"{n.op} has a row count in its arguments"
    if any(v in row_sizes for v in _ints(list(n.kwargs.values()))):
        return f"{n.op} has a row count in its arguments"
    return None


def _ints(a) -> list[int]:
    if isinstance(a, bool) or isinstance(a, Ref):
        return []
    if isinstance(a, int):
        return [a]
    if isinstance(a, (list, tuple)):
        return [v for x in a for v in _ints(x)]
    return []


def localize_rowwise(n: Node, sizes: tuple[int, ...]) -> Node:
    """A region op with the local sizes in the arguments that spell its rows."""
    if n.op == _ARANGE:
        return replace(n, args=(local_shape(n.types[0].shape, n.sbp[0], sizes)[0], *n.args[1:]))
    at = _SIZE_LISTS.get(n.op)
    if at is None or len(n.args) <= at:
        return n
    shape, local = n.types[0].shape, local_shape(n.types[0].shape, n.sbp[0], sizes)
    spelled = [lo if v == g else v for v, g, lo in zip(n.args[at], shape, local)] + list(n.args[at][len(shape):])
    return replace(n, args=(*n.args[:at], spelled, *n.args[at + 1:]))
