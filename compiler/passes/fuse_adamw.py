"""fuse-adamw: a one-program plan's whole AdamW update as one call of torch's fused kernel.

The traced update (``compiler/frontend/optim.py``) is ten tensor ops per parameter; the
``inplace`` pass makes them in-place ``_foreach_*`` calls, still ten passes over the memory of
every parameter and state, two of them allocating. ``aten._fused_adamw_`` (what
``torch.optim.AdamW(fused=True)`` calls) does the same update in one pass per tensor and
allocates nothing. This pass finds, for every parameter, the exact expression the template
traces,

    p' = p * (1 - lr*wd) + (-(lr / (1 - b1^t)) * m') / (sqrt(v') / sqrt(1 - b2^t) + eps)
    m' = lerp(m, g, 1 - b1)        v' = addcmul(v * b2, g, g, value=1 - b2)      t = step + 1

with the same constants for all parameters (``lr`` is the step's learning rate input), and
replaces all of them by one ``_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], [t] * n,
lr=%lr, beta1=, ...)`` whose results are the overwritten parameter, exp_avg and exp_avg_sq lists
(``compiler/ir/aten.py::overwritten``). The kernel takes ``lr`` as a number: the runtime reads
the 0-d input's value (runtime/backend.py), so the kernel computes what torch.optim's
``AdamW(fused=True)`` computes from ``param_groups[i]["lr"]``. It is all or nothing: if one parameter's update is anything else (SGD, a loss
scale's skip, another dtype), nothing is fused, so `sbpc check` compares the whole update with
one eager optimizer (``OptimizerSpec.fused``; docs/check.md says why that is sound).

The kernel overwrites p, m and v, so it applies where the ``inplace`` pass could overwrite them:
one-program plans (no schedule), parameters and states the step owns, no reader of their old
values after the update and no reader of the new ones inside the step (a ZeRO plan gathers its
updated shards in the step: not fused, its gathers overlap the per-parameter update instead).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from sbpc.compiler.ir.types import Graph, InputKind, Node, OutputKind, Ref, Role
from sbpc.compiler.pass_manager import Fact
from sbpc.runtime.backend import FUSED_ADAMW


@dataclass
class FuseAdamW:
    name: str = "fuse-adamw"
    needs: ClassVar[tuple[Fact, ...]] = (Fact.SBP,)
    provides: ClassVar[tuple[Fact, ...]] = ()

    def apply(self, graph: Graph, ctx) -> Graph:
        if graph.schedule is not None:
            return graph
        found = _match_all(graph)
        return graph if found is None else _rewrite(graph, *found)


@dataclass(frozen=True)
class _Update:
    """One parameter's matched update: the values it reads and makes, and its nodes' indices."""
    p: str
    g: str
    m: str
    v: str
    p_new: str
    m_new: str
    v_new: str
    nodes: frozenset[int]


@dataclass(frozen=True)
class _Hyper:
    lr: str  # the learning rate input
    beta1: float
    beta2: float
    weight_decay: float
    eps: float
    step: str  # the incremented step counter every parameter's bias correction reads


class _Matcher:
    def __init__(self, graph: Graph):
        self.graph = graph
        self.nodes = graph.nodes
        self.made = {o: i for i, n in enumerate(graph.nodes) for o in n.outputs}
        self.kind = {i.value: i.kind for i in graph.inputs}
        self.types = graph.value_types()

    def node(self, value, op: str) -> tuple[int, Node] | None:
        """The node that makes ``value`` if it is an optimizer ``op`` with one result."""
        if not isinstance(value, Ref) or value.name not in self.made:
            return None
        i = self.made[value.name]
        n = self.nodes[i]
        if n.op != op or n.role != Role.OPTIMIZER or len(n.outputs) != 1:
            return None
        return i, n

    def number(self, a) -> float | None:
        return float(a) if isinstance(a, (int, float)) and not isinstance(a, bool) else None

    def state(self, a) -> str | None:
        return a.name if isinstance(a, Ref) and self.kind.get(a.name) == InputKind.STATE else None

    def lr(self, a) -> str | None:
        return a.name if isinstance(a, Ref) and self.kind.get(a.name) == InputKind.HYPER else None

    def uncast(self, value) -> tuple:
        """What ``value`` casts, and the cast's node, where a 0-d parameter's template casts a
        scalar to the parameter's dtype (``optim._as_param_scalar``); else ``value`` itself."""
        cast = self.node(value, "aten._to_copy.default")
        return (cast[1].args[0], [cast[0]]) if cast else (value, [])

    def bias_power(self, value) -> tuple[float, str, list[int]] | None:
        """``1 - b ** t`` as ``rsub(pow(b, t), 1)``: (b, t, its two nodes)."""
        r = self.node(value, "aten.rsub.Scalar")
        if r is None or r[1].args[1:] != (1,) or r[1].kwargs:
            return None
        pw = self.node(r[1].args[0], "aten.pow.Scalar")
        if pw is None or not isinstance(pw[1].args[1], Ref) or self.number(pw[1].args[0]) is None:
            return None
        return self.number(pw[1].args[0]), pw[1].args[1].name, [r[0], pw[0]]

    def update(self, p: str, p_new: str) -> tuple[_Update, _Hyper, list[int]] | None:
        """The parameter ``p``'s update to ``p_new`` if it is the AdamW template; with the
        constants it uses and the scalar nodes (possibly shared with other parameters) it reads."""
        add = self.node(Ref(p_new), "aten.add.Tensor")
        if add is None or add[1].kwargs or len(add[1].args) != 2:
            return None
        decay = self.node(add[1].args[0], "aten.mul.Tensor")
        q = self.node(add[1].args[1], "aten.div.Tensor")
        if decay is None or q is None or decay[1].args[0] != Ref(p):
            return None
        # the decay factor 1 - lr * wd: rsub(mul(lr, wd), 1)
        factor_value, casts = self.uncast(decay[1].args[1])
        factor = self.node(factor_value, "aten.rsub.Scalar")
        lr_wd = self.node(factor[1].args[0], "aten.mul.Tensor") if factor and factor[1].args[1:] == (1,) else None
        if lr_wd is None or self.lr(lr_wd[1].args[0]) is None or self.number(lr_wd[1].args[1]) is None:
            return None
        num = self.node(q[1].args[0], "aten.mul.Tensor")
        den = self.node(q[1].args[1], "aten.add.Tensor")
        if num is None or den is None or den[1].kwargs or self.number(den[1].args[1]) is None:
            return None
        scaled = self.node(den[1].args[0], "aten.div.Tensor")
        if scaled is None:
            return None
        root = self.node(scaled[1].args[0], "aten.sqrt.default")
        if root is None:
            return None
        v2 = self.node(root[1].args[0], "aten.addcmul.default")
        m2 = self.node(num[1].args[1], "aten.lerp.Scalar")
        if v2 is None or m2 is None:
            return None
        g = m2[1].args[1]
        vb = self.node(v2[1].args[0], "aten.mul.Tensor")
        if vb is None or not isinstance(g, Ref) or v2[1].args[1:] != (g, g) or set(v2[1].kwargs) != {"value"}:
            return None
        m, v = self.state(m2[1].args[0]), self.state(vb[1].args[0])
        b2_mul, lerp_w, sq_w = self.number(vb[1].args[1]), self.number(m2[1].args[2]), self.number(v2[1].kwargs["value"])
        if m is None or v is None or None in (b2_mul, lerp_w, sq_w):
            return None
        # the step size: neg(div(lr, 1 - b1 ** t)); the second moment's correction: sqrt(1 - b2 ** t)
        neg_value, neg_cast = self.uncast(num[1].args[0])
        neg = self.node(neg_value, "aten.neg.default")
        step_lr = self.node(neg[1].args[0], "aten.div.Tensor") if neg else None
        bc1 = self.bias_power(step_lr[1].args[1]) if step_lr else None
        sq_value, sq_cast = self.uncast(scaled[1].args[1])
        sq_bc2 = self.node(sq_value, "aten.sqrt.default")
        bc2 = self.bias_power(sq_bc2[1].args[0]) if sq_bc2 else None
        lr = self.lr(step_lr[1].args[0]) if step_lr else None
        if bc1 is None or bc2 is None or lr is None or bc1[1] != bc2[1] or lr != self.lr(lr_wd[1].args[0]):
            return None
        b1, b2, eps, wd = bc1[0], bc2[0], self.number(den[1].args[1]), self.number(lr_wd[1].args[1])
        if lerp_w != 1 - b1 or sq_w != 1 - b2 or b2_mul != b2:
            return None
        m_new, v_new = m2[1].outputs[0], v2[1].outputs[0]
        own = frozenset({add[0], decay[0], q[0], num[0], den[0], scaled[0], root[0], v2[0], m2[0], vb[0]})
        scalars = [factor[0], lr_wd[0], neg[0], step_lr[0], *bc1[2], sq_bc2[0], *bc2[2], *casts, *neg_cast, *sq_cast]
        return (_Update(p, g.name, m, v, p_new, m_new, v_new, own), _Hyper(lr, b1, b2, wd, eps, bc1[1]), scalars)


def _match_all(graph: Graph) -> tuple[list[_Update], _Hyper, set[int]] | None:
    match = _Matcher(graph)
    params = {i.name: i.value for i in graph.inputs if i.kind == InputKind.PARAM}
    updates = {o.name: o.value for o in graph.outputs if o.kind == OutputKind.UPDATE}
    if not params or set(params) - set(updates):
        return None
    found, hyper, scalars = [], None, set()
    for name, p in params.items():
        got = match.update(p, updates[name])
        if got is None or (hyper is not None and got[1] != hyper):
            return None  # all or nothing: one eager optimizer must describe the whole update
        found.append(got[0])
        hyper = got[1]
        scalars.update(got[2])
    types = match.types
    dtype = types[found[0].p].dtype
    state_updates = {o.value for o in graph.outputs if o.kind == OutputKind.UPDATE}
    if any(types[x].dtype != dtype or types[x].shape != types[u.p].shape
           for u in found for x in (u.p, u.g, u.m, u.v)) or types[hyper.step].shape != ():
        return None
    if not all(u.m_new in state_updates and u.v_new in state_updates for u in found):
        return None
    mine = set().union(*(u.nodes for u in found))
    at = max(mine)
    readers: dict[str, list[int]] = {}
    for i, n in enumerate(graph.nodes):
        for x in n.uses():
            readers.setdefault(x, []).append(i)
    graph_out = {o.value for o in graph.outputs}
    for u in found:
        # the old values: read by nothing after the update, and no graph output
        if any(r > at and r not in mine for x in (u.p, u.m, u.v) for r in readers.get(x, ())) or \
                {u.p, u.m, u.v} & graph_out:
            return None
        # the new values: read by nothing in the step but the update itself
        if any(r not in mine for x in (u.p_new, u.m_new, u.v_new) for r in readers.get(x, ())):
            return None
    memory = {graph.nodes[i].memory for i in mine}
    if len(memory) != 1:
        return None
    return found, hyper, scalars


def _rewrite(graph: Graph, found: list[_Update], hyper: _Hyper, scalars: set[int]) -> Graph:
    nodes = graph.nodes
    mine = set().union(*(u.nodes for u in found))
    at = max(mine)
    sbp = {i.value: i.sbp for i in graph.inputs} | {o: s for n in nodes if n.sbp for o, s in zip(n.outputs, n.sbp)}
    step = Ref(hyper.step)
    outputs = [u.p_new for u in found] + [u.m_new for u in found] + [u.v_new for u in found]
    types = graph.value_types()
    first = nodes[min(mine)]
    fused = Node(outputs=outputs, op=FUSED_ADAMW,
                 args=([Ref(u.p) for u in found], [Ref(u.g) for u in found], [Ref(u.m) for u in found],
                       [Ref(u.v) for u in found], [], [step] * len(found)),
                 kwargs=dict(lr=Ref(hyper.lr), beta1=hyper.beta1, beta2=hyper.beta2, weight_decay=hyper.weight_decay,
                             eps=hyper.eps, amsgrad=False, maximize=False),
                 types=[types[o] for o in outputs], role=Role.OPTIMIZER, stage=first.stage, memory=first.memory,
                 sbp=[sbp[o] for o in outputs] if all(o in sbp for o in outputs) else None,
                 why=f"torch's fused AdamW: the update of {len(found)} parameters in one kernel")
    uses = list(fused.uses())
    if all(sbp.get(x) is not None for x in uses):  # boxed: each use gets what its producer made
        fused = replace(fused, sbp_in=[sbp[x] for x in uses])
    kept = [n if i != at else fused for i, n in enumerate(nodes) if i not in mine or i == at]
    # the bias corrections the parameters shared: dropped once nothing reads them
    dead = {o for i in scalars for o in nodes[i].outputs}
    while True:
        read = {x for n in kept for x in n.uses()} | {o.value for o in graph.outputs}
        keep = [n for n in kept if not (n.outputs and set(n.outputs) <= dead and not set(n.outputs) & read)]
        if len(keep) == len(kept):
            return replace(graph, nodes=kept)
        kept = keep
