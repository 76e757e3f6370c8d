"""Reads of a tensor's value that the trace can answer: the tensor was made in ``forward`` from
constants alone (no input, parameter or buffer reaches it), so its value is the same every step.

torch's own modules branch on such values: ``nn.TransformerEncoder`` and ``nn.TransformerDecoder``
compare the attention mask with a causal one (``bool((mask == causal).all())``) to choose their
kernel, and a mask built in ``forward`` by ``generate_square_subsequent_mask`` is such a tensor.
Under fake tensors the read has no value, and the trace would stop with "data-dependent control
flow". This mode, entered inside the traced function (above make_fx's proxy mode), sees the read
first: it evaluates the ops that made the tensor, from the graph traced so far, on real tensors,
and returns the value, which the trace then takes as a constant, as it takes a shape. A read of
anything an input reaches falls through and is refused as before.

The mode costs one Python frame per traced op, so capture traces without it first and turns it
on for a second trace only when the first stops at a read (``when_asked``).
"""
from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException
from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from sbpc.compiler.frontend.input_checks import InputChecks

# what ``x.item()``, ``bool(x)`` and ``x.tolist()`` reach the dispatcher as
_SCALAR_READS = frozenset({torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default})
# a constant's producers stay this small (a mask: full, triu, eq, all); a bigger cone is no constant
_MAX_OPS = 64


class ConstantReads(TorchDispatchMode):
    """Also answers a library's check of its input (``input_checks.py``), which it records in
    ``checks``."""

    def __init__(self) -> None:
        super().__init__()
        self.checks = InputChecks()

    @staticmethod
    def when_asked() -> "_Switch":
        return _Switch()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SCALAR_READS:
            value = _constant_value(args[0])
            if value is None:
                value = self.checks.answer(args[0])
            if value is not None:
                return value
        return func(*args, **kwargs)


class _Switch:
    """Off until a trace fails at a read of a value; then on, once. ``last``: the mode of the
    latest trace with it on (its input checks)."""

    def __init__(self) -> None:
        self.on = False
        self.last: ConstantReads | None = None

    def mode(self):
        if not self.on:
            return contextlib.nullcontext()
        self.last = ConstantReads()
        return self.last

    def retry(self, err: BaseException) -> bool:
        """Whether to trace again with the mode on: ``err`` is a value read, and it was off."""
        read = any(isinstance(e, DataDependentOutputException) for e in _chain(err))
        if read and not self.on:
            self.on = True
            return True
        return False


def _chain(err: BaseException | None):
    while err is not None:
        yield err
        err = err.__cause__ or err.__context__


def _constant_value(t: torch.Tensor) -> bool | int | float | None:
    """``t``'s one element, where it is made from constants alone; else None."""
    tracer = get_proxy_mode().tracer
    try:
        node = get_proxy_slot(t, tracer).proxy.node
    except (KeyError, RuntimeError, AttributeError):
        return None
    cone = _producers(node)
    if cone is None:
        return None
    values: dict[torch.fx.Node, object] = {}
    load = lambda a: values[a] if isinstance(a, torch.fx.Node) else a
    with _disable_current_modes():  # real tensors: neither the fake mode nor the trace sees this
        for n in sorted(cone, key=_position(node.graph)):
            args = torch.fx.node.map_aggregate(n.args, load)
            kwargs = torch.fx.node.map_aggregate(n.kwargs, load)
            values[n] = n.target(*args, **kwargs)
        result = values[node]
        return result.item() if isinstance(result, torch.Tensor) and result.numel() == 1 else None


def _producers(node: torch.fx.Node) -> set[torch.fx.Node] | None:
    """The ops ``node`` is computed from, where every one is a deterministic ATen call on
    constants (no placeholder, no attribute, no random draw); else None."""
    cone: set[torch.fx.Node] = set()
    todo = [node]
    while todo:
        n = todo.pop()
        if n in cone:
            continue
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            return None
        if torch.Tag.nondeterministic_seeded in n.target.tags or n.target._schema.is_mutable:
            return None
        cone.add(n)
        if len(cone) > _MAX_OPS:
            return None
        todo.extend(n.all_input_nodes)
    return cone


def _position(graph: torch.fx.Graph):
    order = {n: i for i, n in enumerate(graph.nodes)}
    return order.__getitem__
