"""Capture one layer, stamp out the copies.

A model's repeated layers (the longest ``ModuleList`` / ``Sequential`` of identical copies)
cost the same to trace each time: ``make_fx`` is ~0.25 s per 1T layer. While the joint graph is
traced, layer 0 runs as it is, layer 1 runs between identity marks (``sbpc_stamp.mark``: its
tensor inputs and outputs, and their gradients, so its forward and backward ops can be found
in the graph), and every later layer is one opaque op, ``sbpc_stamp.layer(k, inputs +
params)``, whose autograd formula is one opaque ``sbpc_stamp.layer_backward(k, grads)``.
``expand`` then rebuilds the graph in program order: each opaque op becomes a copy of layer 1's
forward ops (inputs, parameters, module paths and autograd sequence numbers re-bound to layer
k), each opaque backward a copy of layer 1's backward ops, and the marks disappear. Nodes are
named as ``make_fx`` names them (the op's name and a counter, in program order), so the graph
is the one a whole trace makes, node for node and name for name (tests/test_stamp.py).

Stamping is only tried where it cannot change the program: the copies have the same classes,
parameter and buffer shapes and no hooks of their own, and the plain attributes in which they
differ (``layer_idx``) are not read by layer 1's forward; the configuration hints every copy
alike; a layer is called with the same kinds of values as layer 1, and its outputs get
gradients where layer 1's do; layer 1's ops read nothing but its inputs and parameters.
Anything else runs that layer as it is, or traces the model again whole: slower, never wrong.
"""
from __future__ import annotations

import contextlib
import contextvars
import operator
import re
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree
from torch import nn

from sbpc.compiler.frontend.fx_import import MODULE_KEY
from sbpc.compiler.frontend.hints import STAGE_KEY, ParallelConfig

MIN_LAYERS = 4  # fewer copies trace whole: stamping saves little there

_ACTIVE: contextvars.ContextVar["Stamper | None"] = contextvars.ContextVar("sbpc_stamper", default=None)


@torch.library.custom_op("sbpc_stamp::mark", mutates_args=())
def _mark(role: int, index: int, x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@_mark.register_fake
def _(role, index, x):
    return torch.empty_like(x)


def _mark_setup(ctx, inputs, output):
    ctx.role, ctx.index = inputs[0], inputs[1]


def _mark_backward(ctx, grad):
    return None, None, _mark_grad(ctx.role, ctx.index, grad)


_mark.register_autograd(_mark_backward, setup_context=_mark_setup)


@torch.library.custom_op("sbpc_stamp::mark_grad", mutates_args=())
def _mark_grad(role: int, index: int, g: torch.Tensor) -> torch.Tensor:
    return g.clone()


@_mark_grad.register_fake
def _(role, index, g):
    return torch.empty_like(g)


@torch.library.custom_op("sbpc_stamp::layer", mutates_args=())
def _layer(k: int, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    raise RuntimeError("sbpc_stamp.layer is only traced")


@_layer.register_fake
def _(k, xs):
    return [torch.empty(m.shape, dtype=m.dtype, device=m.device) for m in _ACTIVE.get().template.outs]


def _layer_setup(ctx, inputs, output):
    ctx.k = inputs[0]
    ctx.set_materialize_grads(False)  # an output nobody differentiates gets no zeros op


def _layer_backward_formula(ctx, *grads):
    grads = grads[0] if len(grads) == 1 and isinstance(grads[0], (list, tuple)) else grads
    made = iter(_layer_backward(ctx.k, list(grads)))
    return None, [next(made) if need else None for need in _ACTIVE.get().template.needs_grad]


_layer.register_autograd(_layer_backward_formula, setup_context=_layer_setup)


@torch.library.custom_op("sbpc_stamp::layer_backward", mutates_args=())
def _layer_backward(k: int, grads: list[torch.Tensor | None]) -> list[torch.Tensor]:
    raise RuntimeError("sbpc_stamp.layer_backward is only traced")


@_layer_backward.register_fake
def _(k, grads):
    t = _ACTIVE.get().template
    return [torch.empty(m.shape, dtype=m.dtype, device=m.device) for m, need in zip(t.ins, t.needs_grad) if need]


MARK = torch.ops.sbpc_stamp.mark.default
MARK_GRAD = torch.ops.sbpc_stamp.mark_grad.default
LAYER = torch.ops.sbpc_stamp.layer.default
LAYER_BACKWARD = torch.ops.sbpc_stamp.layer_backward.default
IN, OUT = 0, 1  # mark roles


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    stride: tuple[int, ...]  # a view's layout can change what the layer traces
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorMeta:
        return cls(tuple(t.shape), tuple(t.stride()), t.dtype, t.device, t.requires_grad)


@dataclass
class Template:
    """What layer 1 was called with and returned: a later layer is stamped only when it is
    called alike (``signature``), and its opaque op returns ``outs``."""
    signature: tuple  # (input tree spec, non-tensor leaves, input tensor metas)
    ins: list[TensorMeta]  # the tensor inputs, then the layer's parameters and buffers
    outs: list[TensorMeta]
    out_spec: pytree.TreeSpec
    out_leaves: list  # the output tree's leaves, tensors replaced by None
    arg_count: int  # tensor inputs before the parameters

    @property
    def needs_grad(self) -> list[bool]:
        return [m.requires_grad for m in self.ins]


@dataclass
class Repeated:
    """The repeated layers: ``path`` is the list's module path (``h``, ``model.layers``)."""
    path: str
    layers: list[nn.Module]
    # plain attributes (submodule path, name) that differ between copies (``layer_idx``): a
    # copy is stamped only if layer 1's forward never reads them (``_Watch``)
    differ: frozenset[tuple[str, str]] = frozenset()

    def param_names(self, k: int) -> list[str]:
        """Parameters then buffers of layer ``k``, as the trace's state names them."""
        layer = self.layers[k]
        return [f"{self.path}.{k}.{n}" for n, _ in layer.named_parameters()] + \
               [f"{self.path}.{k}.{n}" for n, _ in layer.named_buffers()]


@dataclass
class Stamper:
    repeated: Repeated
    template: Template | None = None
    stamped: set[int] = field(default_factory=set)  # the layers traced as one opaque op
    repeats: bool = False  # a layer ran twice: its calls could not be told apart
    _called: set[int] = field(default_factory=set)

    @contextlib.contextmanager
    def active(self):
        token = _ACTIVE.set(self)
        originals = []
        for k, layer in enumerate(self.repeated.layers):
            if k >= 1:
                originals.append(layer)
                layer.forward = _bound(self, k, type(layer).forward.__get__(layer))
        try:
            yield self
        finally:
            for layer in originals:
                del layer.forward
            _ACTIVE.reset(token)

    def call(self, k: int, forward, args, kwargs):
        layer = self.repeated.layers[k]
        self.repeats |= k in self._called
        self._called.add(k)
        flat, spec = pytree.tree_flatten((args, kwargs))
        state = [p for _, p in layer.named_parameters()] + [b for _, b in layer.named_buffers()]
        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        signature = (spec, [None if isinstance(x, torch.Tensor) else x for x in flat],
                     [TensorMeta.of(x) for x in tensors + state])
        if k == 1:
            return self._trace_template(forward, flat, spec, state, signature)
        if self.template is None or not _same(signature, self.template.signature):
            return forward(*args, **kwargs)
        outs = _layer(k, tensors + state)
        self.stamped.add(k)
        made = iter(outs)
        leaves = [next(made) if x is None else x for x in self.template.out_leaves]
        return pytree.tree_unflatten(leaves, self.template.out_spec)

    def _trace_template(self, forward, flat, spec, state, signature):
        flat = [_mark(IN, i, x) if isinstance(x, torch.Tensor) else x
                for i, x in enumerate(flat)]
        args, kwargs = pytree.tree_unflatten(flat, spec)
        with _Watch(self.repeated.layers[1], self.repeated.differ) as watch:
            out = forward(*args, **kwargs)
        if watch.read:
            return out  # layer 1 read an attribute the copies differ in: they may trace otherwise
        leaves, out_spec = pytree.tree_flatten(out)
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        if any(not x.is_contiguous() for x in tensors):
            return out  # an opaque op's fake results are contiguous: the copies would trace otherwise
        marked = iter([_mark(OUT, j, x) for j, x in enumerate(tensors)])
        leaves = [next(marked) if isinstance(x, torch.Tensor) else x for x in leaves]
        ins = signature[2]
        self.template = Template(signature, ins, [TensorMeta.of(x) for x in tensors], out_spec,
                                 [None if isinstance(x, torch.Tensor) else x for x in leaves],
                                 len(ins) - len(state))
        return pytree.tree_unflatten(leaves, out_spec)


class _Watch:
    """While layer 1's forward runs, its attributes in ``differ`` are read through a property
    (the module's class is swapped for a subclass that has one), so that a read is seen."""

    def __init__(self, layer: nn.Module, differ):
        self.read: set[tuple[str, str]] = set()
        self._swapped = []
        by_module: dict[str, list[str]] = {}
        for path, name in differ:
            by_module.setdefault(path, []).append(name)
        self._plan = [(layer.get_submodule(path), path, names) for path, names in sorted(by_module.items())]

    def __enter__(self):
        for module, path, names in self._plan:
            cls = type(module)
            props = {name: self._property(path, name) for name in names}
            module.__class__ = type(cls.__name__, (cls,), props)
            self._swapped.append((module, cls))
        return self

    def _property(self, path: str, name: str) -> property:
        def get(module):
            self.read.add((path, name))
            return module.__dict__[name]

        def put(module, value):
            self.read.add((path, name))
            module.__dict__[name] = value
        return property(get, put)

    def __exit__(self, *exc):
        for module, cls in self._swapped:
            module.__class__ = cls
        return False


def _bound(stamper: Stamper, k: int, forward):
    def stamped_forward(*args, **kwargs):
        return stamper.call(k, forward, args, kwargs)
    return stamped_forward


def _same(a, b, depth: int = 3) -> bool:
    """Equal, or (objects compared by identity, such as a per-layer helper object or a dict of
    them) of one type with equal attributes, to a small depth."""
    try:
        if a is b or bool(a == b):
            return True
    except Exception:  # a leaf whose == is not a truth value (a tensor-like): not alike
        return False
    if isinstance(a, nn.Module) and isinstance(b, nn.Module):  # a module kept outside the tree
        return depth > 0 and _differences(a, b) == set()
    if depth == 0 or type(a) is not type(b) or isinstance(a, torch.Tensor):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k], depth - 1) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y, depth - 1) for x, y in zip(a, b))
    if type(a).__eq__ is object.__eq__ and hasattr(a, "__dict__"):
        return _same(vars(a), vars(b), depth - 1)
    return False


# ----- which layers may be stamped

def find_repeated(model: nn.Module, config: ParallelConfig, min_layers: int = MIN_LAYERS) -> Repeated | None:
    """The longest list of at least ``min_layers`` modules that are copies of one another (see
    the module docstring), or None."""
    best = None
    for path, m in model.named_modules():
        if not isinstance(m, (nn.ModuleList, nn.Sequential)) or len(m) < max(min_layers, 3):
            continue
        layers = list(m)
        if best is not None and len(layers) <= len(best.layers):
            continue
        diffs = [_differences(layers[1], x) for x in layers[:1] + layers[2:]]
        if all(d is not None for d in diffs) and _hinted_alike(path, layers, config):
            best = Repeated(path, layers, frozenset().union(*diffs))
    return best


_MODULE_FIELDS = frozenset(vars(nn.Module()))
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
          "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def _differences(a: nn.Module, b: nn.Module) -> set[tuple[str, str]] | None:
    """The plain attributes (submodule path, name) in which copy ``b`` differs from ``a``, or
    None when ``b`` is not a copy at all (other classes, parameters, buffers, hooks, a tensor
    attribute)."""
    mods_a, mods_b = list(a.named_modules()), list(b.named_modules())
    if [n for n, _ in mods_a] != [n for n, _ in mods_b] or \
            not all(_same_class(type(x), type(y)) for (_, x), (_, y) in zip(mods_a, mods_b)):
        return None
    out = set()
    for (path, x), (_, y) in zip(mods_a, mods_b):
        if any(getattr(x, h, None) or getattr(y, h, None) for h in _HOOKS):
            return None
        mine = {k: v for k, v in vars(x).items() if k not in _MODULE_FIELDS}
        theirs = {k: v for k, v in vars(y).items() if k not in _MODULE_FIELDS}
        if mine.keys() != theirs.keys() or any(isinstance(v, torch.Tensor) for v in mine.values()):
            return None
        if _tensor_metas(x) != _tensor_metas(y):
            return None
        out.update((path, k) for k in mine if not _same(mine[k], theirs[k]))
    return out


def _same_class(a: type, b: type) -> bool:
    """One class, or two made by one factory (a class defined in a function, once per layer):
    the same name, module and code of every method."""
    if a is b:
        return True
    if (a.__qualname__, a.__module__, a.__bases__) != (b.__qualname__, b.__module__, b.__bases__) or \
            vars(a).keys() != vars(b).keys():
        return False
    return all(_same_function(vars(a)[k], vars(b)[k]) if callable(vars(a)[k]) else _same(vars(a)[k], vars(b)[k], 1)
               for k in vars(a) if k not in ("__dict__", "__weakref__", "__doc__"))


def _same_function(f, g) -> bool:
    """The same function, or one made twice from one definition with equal defaults and
    closures (the factory's arguments)."""
    if f is g:
        return True
    if getattr(f, "__code__", None) is None or getattr(f, "__code__", None) is not getattr(g, "__code__", None):
        return False
    cells = lambda h: [c.cell_contents for c in h.__closure__ or ()]
    return _same(f.__defaults__, g.__defaults__, 1) and _same(cells(f), cells(g), 2)


def _tensor_metas(m: nn.Module) -> list:
    return [(n, tuple(t.shape), t.dtype, t.requires_grad) for n, t in m.named_parameters(recurse=False)] + \
           [(n, tuple(t.shape), t.dtype) for n, t in m.named_buffers(recurse=False)]


def _hinted_alike(path: str, layers: list[nn.Module], config: ParallelConfig) -> bool:
    """Every copy's submodules get the hints (``[modules]`` globs) layer 1's get."""
    for sub, _ in layers[1].named_modules():
        suffix = f".{sub}" if sub else ""
        want = config.module_hint(f"{path}.1{suffix}")
        if any(config.module_hint(f"{path}.{k}{suffix}") != want for k in range(len(layers))):
            return False
    return True


# ----- the expansion

class NotStampable(Exception):
    """Layer 1's ops read something other than its inputs and parameters (or another case the
    copies could not follow): the caller traces the model whole."""


def expand(gm: torch.fx.GraphModule, stamper: Stamper, state_names: list[str]) -> torch.fx.GraphModule:
    """The graph with every opaque layer replaced by a copy of layer 1 (module docstring).
    ``state_names``: the joint's placeholders' names (parameters, then buffers), in order."""
    nodes = list(gm.graph.nodes)
    if not any(n.op == "call_function" and n.target is MARK for n in nodes):
        return gm  # layer 1 never ran: nothing was marked
    if stamper.repeats:
        raise NotStampable("a layer was called more than once")
    # without stamped layers (layer 1 was no template) the rebuild only drops layer 1's marks
    t = _regions(nodes, stamper, state_names) if stamper.stamped else None
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    forward_env: dict[int, dict] = {}  # layer -> template node -> its copy
    inputs: dict[int, list] = {}  # layer -> what its opaque op was given, re-bound
    sites: dict[int, tuple] = {}  # layer -> the stack frames of its call site
    for n in nodes:
        if n.op == "call_function" and n.target in (MARK, MARK_GRAD):
            env[n] = env[n.args[2]]
        elif n.op == "call_function" and n.target is LAYER:
            k = n.args[0]
            inputs[k] = [env[x] for x in n.args[1]]
            sites[k] = t.stacks.call_site(n)
            bound = dict(zip(t.inputs, inputs[k]))
            forward_env[k] = _copy(graph, t.forward, bound, stamper.repeated.path, k, n, t, sites[k])
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
            made = _copy(graph, t.backward, bound, stamper.repeated.path, k, n, t, sites[k])
            for i, g in enumerate(t.outgoing):
                env[(n, i)] = made.get(g, bound.get(g))
        elif n.op == "call_function" and n.target is operator.getitem and n.args[0].target in (LAYER, LAYER_BACKWARD):
            env[n] = env[(n.args[0], n.args[1])]
        elif n.op in ("placeholder", "output", "get_attr"):
            env[n] = graph.node_copy(n, lambda a: env[a])
        else:
            env[n] = graph.create_node(n.op, n.target, _map(n.args, env.__getitem__), _map(n.kwargs, env.__getitem__), _base(graph, n))
            env[n].meta = n.meta
    return torch.fx.GraphModule(gm, graph)


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
          site: torch.fx.Node, regions: _Regions, call_site: tuple[str, ...]) -> dict:
    """Copies of ``template`` for layer ``k``: arguments re-bound (``bound``, then the copies),
    module paths ``{path}.1...`` -> ``{path}.{k}...``, autograd sequence numbers per copy (a
    backward op finds its forward op's location by it), the stage scope and the stack frames
    of layer k's call site."""
    own = regions.seq_nrs
    made: dict = {}
    look = lambda a: made[a] if a in made else bound[a]
    old, new = f"{path}.1", f"{path}.{k}"
    stage = (site.meta.get("custom") or {}).get(STAGE_KEY) if site.target is LAYER else None
    for n in template:
        c = graph.create_node(n.op, n.target, _map(n.args, look), _map(n.kwargs, look), _base(graph, n))
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


def _map(a, look):
    return torch.fx.node.map_arg(a, look)


_SUFFIX = re.compile(r"_\d+$")


def _base(graph: torch.fx.Graph, n: torch.fx.Node) -> str:
    """The name make_fx gives a node before its counter: the op's name (``mm``), ``getitem``."""
    if isinstance(n.target, torch._ops.OpOverload):
        return graph._target_to_str(n.target.overloadpacket.__name__)
    if callable(n.target):
        return graph._target_to_str(n.target)
    return _SUFFIX.sub("", n.name)
