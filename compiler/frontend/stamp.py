"""Capture one layer, stamp out the copies.

A model's repeated layers (``repeated_layers.find_repeated``) cost the same to trace each time:
``make_fx`` is ~0.25 s per 1T layer. While the joint graph is traced, layer 0 runs as it is,
layer 1 runs between identity marks (``sbpc_stamp.mark``: its tensor inputs and outputs, and
their gradients, so its forward and backward ops can be found in the graph), and every later
layer called like layer 1 is one opaque op, ``sbpc_stamp.layer(k, inputs + params)``, whose
autograd formula is one opaque ``sbpc_stamp.layer_backward(k, grads)``. ``stamp_expand.expand``
then turns the opaque ops into copies of layer 1's, so the graph is the one a whole trace makes,
node for node and name for name (tests/test_stamp.py).

Stamping is only tried where it cannot change the program: the copies are alike
(``repeated_layers``) and the plain attributes in which they differ (``layer_idx``) are not read
by layer 1's forward (``_Watch``); a layer is called with the same kinds of values as layer 1,
and its outputs get gradients where layer 1's do; layer 1's ops read nothing but its inputs and
parameters. Anything else runs that layer as it is, or traces the model again whole
(``NotStampable``): slower, never wrong.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from sbpc.compiler.frontend.repeated_layers import Repeated, same

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
    with _no_stack_traces():  # expand replaces the op and its getitems by layer 1's copies
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


@contextlib.contextmanager
def _no_stack_traces():
    """make_fx records no stack trace for the nodes made inside: it costs ~0.1 ms per node
    (a traceback with each frame's source line), and an opaque backward op has a getitem per
    gradient, none of which the expanded graph keeps."""
    tracer = getattr(get_proxy_mode(), "tracer", None)
    was = getattr(tracer, "record_stack_traces", False)
    if tracer is not None:
        tracer.record_stack_traces = False
    try:
        yield
    finally:
        if tracer is not None:
            tracer.record_stack_traces = was


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
        if self.template is None or not same(signature, self.template.signature):
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


class NotStampable(Exception):
    """Layer 1's ops read something other than its inputs and parameters (or another case the
    copies could not follow): the caller traces the model whole."""
