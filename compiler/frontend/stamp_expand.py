"""The expansion of a stamped trace (``stamp.py``): every opaque layer op becomes a copy of
layer 1's forward ops, every opaque backward a copy of its backward ops, re-bound to that layer
(inputs, parameters, incoming gradients, module paths, autograd sequence numbers, the call
site's stack frames and stage scope); the marks disappear. Nodes are created in program order
with the names ``make_fx`` gives (op name and counter), so the graph is the whole trace's.
"""
from __future__ import annotations

import operator
import re
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree

from sbpc.compiler.frontend.fx_import import MODULE_KEY
from sbpc.compiler.frontend.hints import STAGE_KEY
from sbpc.compiler.frontend.stamp import IN, LAYER, LAYER_BACKWARD, MARK, MARK_GRAD, OUT, NotStampable, Stamper


def expand(gm: torch.fx.GraphModule, stamper: Stamper, state_names: list[str]) -> torch.fx.Graph:
    """The graph with every opaque layer replaced by a copy of layer 1 (module docstring).
    ``state_names``: the joint's placeholders' names (parameters, then buffers), in order.
    The graph's owning module is ``gm`` (its ``get_attr`` constants); no GraphModule is made
    of it: nothing runs it, and its Python code (fx's codegen, ~0.3 s at 1T) would go unread."""
    nodes = list(gm.graph.nodes)
    if not any(n.op == "call_function" and n.target is MARK for n in nodes):
        return gm.graph  # layer 1 never ran: nothing was marked
    if stamper.repeats:
        raise NotStampable("a layer was called more than once")
    # without stamped layers (layer 1 was no template) the rebuild only drops layer 1's marks
    t = _regions(nodes, stamper, state_names) if stamper.stamped else None
    graph = torch.fx.Graph(owning_module=gm)
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    forward_env: dict[int, dict] = {}  # layer -> template node -> its copy
    inputs: dict[int, list] = {}  # layer -> what its opaque op was given, re-bound
    sites: dict[int, tuple] = {}  # layer -> the stack frames of its call site
    # a template node's name before its counter, once for all its copies
    bases = {n: _base(graph, n) for n in t.forward + t.backward} if t else {}
    for n in nodes:
        if n.op == "call_function" and n.target in (MARK, MARK_GRAD):
            env[n] = env[n.args[2]]
        elif n.op == "call_function" and n.target is LAYER:
            k = n.args[0]
            inputs[k] = [env[x] for x in n.args[1]]
            sites[k] = t.stacks.call_site(n)
            bound = dict(zip(t.inputs, inputs[k]))
            forward_env[k] = _copy(graph, t.forward, bound, stamper.repeated.path, k, n, t, sites[k], bases)
            for j, out in enumerate(t.outputs):
                env[(n, j)] = forward_env[k][out] if out in forward_env[k] else bound[out]
        elif n.op == "call_function" and n.target is LAYER_BACKWARD:
            k = n.args[0]
            bound = dict(forward_env[k])
            given = {j for j, g in enumerate(n.args[1]) if g is not None}
            if given != set(t.incoming.values()):  # the copy's backward would drop or lack one
                raise NotStampable(f"layer {k}'s outputs get gradients {sorted(given)}, layer 1's "
                                   f"{sorted(t.incoming.values())}")
            for g, j in t.incoming.items():
                bound[g] = env[n.args[1][j]]
            bound.update(zip(t.inputs, inputs[k]))
            made = _copy(graph, t.backward, bound, stamper.repeated.path, k, n, t, sites[k], bases)
            for i, g in enumerate(t.outgoing):
                env[(n, i)] = made.get(g, bound.get(g))
        elif n.op == "call_function" and n.target is operator.getitem and n.args[0].target in (LAYER, LAYER_BACKWARD):
            env[n] = env[(n.args[0], n.args[1])]
        elif n.op in ("placeholder", "output", "get_attr"):
            env[n] = graph.node_copy(n, lambda a: env[a])
        else:
            env[n] = _create(graph, n, torch.fx.node.map_arg(n.args, env.__getitem__), torch.fx.node.map_arg(n.kwargs, env.__getitem__), _base(graph, n))
            env[n].meta = n.meta
    return graph


@dataclass
class _Regions:
    inputs: list[torch.fx.Node]  # layer 1's marked inputs, then its parameter placeholders
    outputs: list[torch.fx.Node]  # what layer 1's output marks read
    forward: list[torch.fx.Node]  # layer 1's forward ops, in order
    backward: list[torch.fx.Node]  # layer 1's backward ops, in order
    incoming: dict[torch.fx.Node, int]  # an output's gradient mark -> that output's index
    outgoing: list[torch.fx.Node]  # per input needing a gradient, the node that makes it
    seq_nrs: frozenset  # the autograd sequence numbers of layer 1's forward ops
    stacks: _Stacks


def _regions(nodes: list[torch.fx.Node], stamper: Stamper, state_names: list[str]) -> _Regions:
    t = stamper.template
    pos = {n: i for i, n in enumerate(nodes)}
    marks = [n for n in nodes if n.op == "call_function" and n.target is MARK]
    grads = [n for n in nodes if n.op == "call_function" and n.target is MARK_GRAD]
    ins = sorted((n for n in marks if n.args[0] == IN), key=lambda n: n.args[1])
    outs = sorted((n for n in marks if n.args[0] == OUT), key=lambda n: n.args[1])
    placeholders = dict(zip(state_names, [x for x in nodes if x.op == "placeholder"]))
    params = [placeholders[name] for name in stamper.repeated.param_names(1)]
    inputs = ins + params
    if len(ins) != t.arg_count or len(inputs) != len(t.ins):
        raise NotStampable("layer 1's marks do not match its inputs")
    first, last = pos[ins[-1]] + 1, pos[outs[0]] if outs else None
    if last is None or any(pos[m] < pos[ins[-1]] for m in outs):
        raise NotStampable("layer 1 has no output marks after its inputs")
    forward = nodes[first:last]
    out_grads = [n for n in grads if n.args[0] == OUT]
    in_grads = {n.args[1]: n for n in grads if n.args[0] == IN}
    if not out_grads:
        raise NotStampable("no gradient reaches layer 1")
    start = max(pos[n] for n in out_grads) + 1
    end = max((pos[n] for n in in_grads.values()), default=start)
    # layer 1's parameter gradients are made in its backward too: the region runs to the last of them
    flat_out = pytree.tree_flatten(nodes[-1].args[0])[0]  # [loss, *parameter gradients]
    grad_of = lambda name: flat_out[1 + state_names.index(name)]
    named = stamper.repeated.param_names(1)
    param_grads = [grad_of(name) for name, need in zip(named[:len(t.ins) - t.arg_count], t.needs_grad[t.arg_count:])
                   if need]
    if not all(isinstance(g, torch.fx.Node) for g in param_grads):
        raise NotStampable("a parameter of layer 1 gets no gradient")
    end = max([end] + [pos[g] + 1 for g in param_grads])
    backward = [n for n in nodes[start:end] if not (n.op == "call_function" and n.target in (MARK, MARK_GRAD))]
    incoming = {n: n.args[1] for n in out_grads}
    outgoing = []
    for i, need in enumerate(t.needs_grad[:t.arg_count]):
        if need:
            if i not in in_grads:
                raise NotStampable(f"layer 1's input {i} gets no gradient")
            outgoing.append(in_grads[i].args[2])
    outgoing += param_grads
    stage = {(m.meta.get("custom") or {}).get(STAGE_KEY) for m in ins}
    if len(stage) > 1 or any((n.meta.get("custom") or {}).get(STAGE_KEY) not in stage for n in forward):
        raise NotStampable("a stage scope inside layer 1")  # the copies' scopes are their call sites'
    seq_nrs = frozenset(n.meta.get("seq_nr") for n in forward) - {None, -1, "-1"}
    grad_mark = next((m for m, need in zip(ins, t.needs_grad) if need), ins[0])
    regions = _Regions(inputs, [m.args[2] for m in outs], forward, backward, incoming, outgoing, seq_nrs,
                       _Stacks.of(grad_mark, forward))
    _check_closed(regions)
    return regions


def _frames(stack: str | None) -> tuple[str, ...]:
    """A recorded stack trace (``File "f", line n, in fn\n    code``, outermost first) as frames."""
    return tuple(stack.split("\n  ")) if stack else ()


@dataclass
class _Stacks:
    """The copies' stack traces (which give every op its user file:line). A layer-1 op's trace is
    layer 1's call site (``prefix``) then the layer's own frames; its copy's is layer k's call
    site then the same frames. An opaque op's trace is its call site then ``machinery``, the
    custom-op call's frames, which a mark's trace ends with too."""
    prefix: tuple[str, ...]
    machinery: tuple[str, ...]
    _made: dict = field(default_factory=dict)

    @classmethod
    def of(cls, mark: torch.fx.Node, forward: list[torch.fx.Node]) -> _Stacks:
        mine = _frames(mark.meta.get("stack_trace"))
        p = len(mine)
        for n in forward:
            theirs = _frames(n.meta.get("stack_trace"))
            if theirs:
                p = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(p, len(theirs)))
        return cls(mine[:p], mine[p:])

    def call_site(self, op: torch.fx.Node) -> tuple[str, ...]:
        frames = _frames(op.meta.get("stack_trace"))
        cut = len(frames) - len(self.machinery)
        if cut < 0 or frames[cut:] != self.machinery:
            raise NotStampable("an opaque layer's stack trace does not end as layer 1's marks do")
        return frames[:cut]

    def rebase(self, stack: str | None, site: tuple[str, ...]) -> str | None:
        key = (stack, site)
        if key not in self._made:
            frames = _frames(stack)
            own = frames[:len(self.prefix)] == self.prefix
            self._made[key] = "\n  ".join(site + frames[len(self.prefix):]) if own and frames else stack
        return self._made[key]


def _check_closed(r: _Regions) -> None:
    """Layer 1's forward reads only its inputs and itself; its backward only those, its forward
    and the incoming gradients: what a copy can be re-bound to."""
    fwd = set(r.forward)
    known = set(r.inputs) | fwd
    for n in r.forward:
        for a in n.all_input_nodes:
            if a not in known:
                raise NotStampable(f"layer 1's {n.name} reads {a.name}, made outside the layer")
    known |= set(r.backward) | set(r.incoming)
    for n in r.backward:
        for a in n.all_input_nodes:
            if a not in known:
                raise NotStampable(f"layer 1's backward {n.name} reads {a.name}, made outside the layer")
    for x in r.outputs + r.outgoing:
        if x not in known:
            raise NotStampable(f"{x.name} is not made by layer 1")


def _copy(graph: torch.fx.Graph, template: list[torch.fx.Node], bound: dict, path: str, k: int,
          site: torch.fx.Node, regions: _Regions, call_site: tuple[str, ...], bases: dict) -> dict:
    """Copies of ``template`` for layer ``k``: arguments re-bound (``bound``, then the copies),
    module paths ``{path}.1...`` -> ``{path}.{k}...``, autograd sequence numbers per copy (a
    backward op finds its forward op's location by it), the stage scope and the stack frames
    of layer k's call site. ``bases``: each template node's ``_base``."""
    own = regions.seq_nrs
    made: dict = {}
    look = lambda a: made[a] if a in made else bound[a]
    old, new = f"{path}.1", f"{path}.{k}"
    stage = (site.meta.get("custom") or {}).get(STAGE_KEY) if site.target is LAYER else None
    for n in template:
        c = _create(graph, n, torch.fx.node.map_arg(n.args, look), torch.fx.node.map_arg(n.kwargs, look), bases[n])
        meta = dict(n.meta)
        custom = dict(meta.get("custom") or {})
        module = custom.get(MODULE_KEY)
        if module is not None and (module == old or module.startswith(old + ".")):
            custom[MODULE_KEY] = new + module[len(old):]
        if site.target is LAYER:
            custom.pop(STAGE_KEY, None)
            if stage is not None:
                custom[STAGE_KEY] = stage
        meta["custom"] = custom
        if meta.get("seq_nr") in own:  # (a stale one, on autograd's sums, is left as it is)
            meta["seq_nr"] = (k, meta["seq_nr"])
        if "stack_trace" in meta:
            meta["stack_trace"] = regions.stacks.rebase(meta["stack_trace"], call_site)
        c.meta = meta
        made[n] = c
    return made


def _create(graph: torch.fx.Graph, n: torch.fx.Node, args: tuple, kwargs: dict, name: str) -> torch.fx.Node:
    """``graph.create_node(n.op, n.target, args, kwargs, name)``, its arguments assigned after:
    create_node walks them with pytree to warn of raw SymInts (half of expand's time), and
    a copy of a traced node holds none."""
    c = graph.create_node(n.op, n.target, name=name)
    c.args, c.kwargs = args, kwargs
    return c


_SUFFIX = re.compile(r"_\d+$")


def _base(graph: torch.fx.Graph, n: torch.fx.Node) -> str:
    """The name make_fx gives a node before its counter: the op's name (``mm``), ``getitem``."""
    if isinstance(n.target, torch._ops.OpOverload):
        return graph._target_to_str(n.target.overloadpacket.__name__)
    if callable(n.target):
        return graph._target_to_str(n.target)
    return _SUFFIX.sub("", n.name)
