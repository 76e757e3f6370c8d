"""fp16's dynamic loss scaling as graph ops: what ``torch.amp.GradScaler`` does, as part of the
compiled step (docs/precision.md).

The capture multiplies the loss by the scale before the backward (``GradScaler.scale``), so the
joint graph's gradients are scaled. Here, around the optimizer:

- ``append_unscale``: each gradient times ``1 / scale`` (the reciprocal in float64, as
  ``GradScaler.unscale_``), and the count of non-finite entries of the scaled gradients, summed
  over all of them (``_amp_foreach_non_finite_check_and_unscale_``). A count over a split or
  partial gradient is partial like any sum, so boxing makes it whole: every rank of every
  stage sees the same verdict.
- ``append_skip``: every updated parameter and optimizer state (the step counter included)
  keeps its old value when the count is not zero (``GradScaler.step`` skips ``optimizer.step``),
  and the scale and its growth tracker change as ``_amp_update_scale_`` changes them; the
  skipped steps are counted in a state of their own, which ``sbpc run`` reports.

The scale, the growth tracker and the skip count are optimizer-state-like inputs and outputs
(``loss_scale``, ``growth_tracker``, ``skipped_steps``) that every rank holds whole.
"""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from sbpc.compiler.frontend.fx_import import import_fx
from sbpc.compiler.ir.types import (DTYPES, GraphInput, GraphOutput, InputKind, Node, OutputKind, Ref, Role,
                                    StateName, TensorType, map_refs)
from sbpc.runtime.plan import LossScaling
from sbpc.runtime.precision import GROWTH_TRACKER, LOSS_SCALE, SKIPPED_STEPS

STATE_TYPES = {LOSS_SCALE: TensorType((), "f32"), GROWTH_TRACKER: TensorType((), "i32"),
               SKIPPED_STEPS: TensorType((), "i64")}  # GradScaler's dtypes for the first two


def scale_input() -> GraphInput:
    """The scale, read by the capture's ``loss * scale`` and by the unscale."""
    return GraphInput(InputKind.STATE, LOSS_SCALE, STATE_TYPES[LOSS_SCALE], str(StateName(LOSS_SCALE)))


def append_unscale(grads: list[tuple[str, TensorType]], nodes: list[Node]) -> tuple[str, list[str]]:
    """Ops that unscale ``(value, type)`` gradients; returns the non-finite count and the
    unscaled gradients' values."""

    def unscale(scale, *gs):
        inv = scale.double().reciprocal().float()
        unscaled = [g * inv for g in gs]
        # torch tests the scaled gradients; testing the unscaled ones is the same test while the
        # scale is at least 1 (a finite value times inv <= 1 stays finite, inf and nan stay), and
        # reads each parameter's gradient, so a pipeline stage counts its own
        bad = sum(torch.isfinite(g).logical_not().sum() for g in unscaled)
        return (bad, *unscaled)

    outs = splice(unscale, [(LOSS_SCALE, STATE_TYPES[LOSS_SCALE]), *grads], "unscale", nodes)
    return outs[0], outs[1:]


_SCALAR_MULS = frozenset({"aten.mul.Tensor", "aten.mul_.Tensor", "aten._foreach_mul.Tensor", "aten._foreach_mul_.Tensor"})


def scaled_gradient(n: Node, value: str, types: dict[str, TensorType]) -> str | None:
    """The gradient that optimizer op ``n`` multiplies by a 0-d tensor to make ``value`` (the
    unscale's ``g * inv``, or clipping's coefficient; of a foreach call, ``value`` is the i-th
    result), else None. Who asks: ZeRO-2 pins a gradient where the backward makes it, and the
    memory estimate counts that storage as a gradient, whatever multiplies it afterwards."""
    if n.role != Role.OPTIMIZER or n.op not in _SCALAR_MULS or len(n.args) < 2:
        return None
    first, factor = n.args[0], n.args[1]
    if not (isinstance(factor, Ref) and factor.name in types and types[factor.name].shape == ()):
        return None
    x = first[n.outputs.index(value)] if isinstance(first, (list, tuple)) else first
    return x.name if isinstance(x, Ref) else None


def append_skip(cfg: LossScaling, found: str, inputs: list[GraphInput], nodes: list[Node],
                outputs: list[GraphOutput]) -> None:
    """Keep every update's old value where ``found`` (the non-finite count) is not zero, then
    update the scale, its growth tracker and the skip count (new inputs and outputs)."""
    old_of = {i.name: i for i in inputs if i.kind in (InputKind.PARAM, InputKind.STATE)}
    updates = [o for o in outputs if o.kind == OutputKind.UPDATE]
    for name in (GROWTH_TRACKER, SKIPPED_STEPS):
        inputs.append(GraphInput(InputKind.STATE, name, STATE_TYPES[name], str(StateName(name))))
    types = {i.value: i.type for i in inputs}

    def keep_old(found, *pairs):
        skip = found > 0
        return tuple(torch.where(skip, old, new) for old, new in zip(pairs[::2], pairs[1::2]))

    pairs = [v for o in updates for v in ((old_of[o.name].value, old_of[o.name].type), (o.value, old_of[o.name].type))]
    kept = splice(keep_old, [(found, TensorType((), "i64")), *pairs], "skip", nodes)
    outputs[:] = [o for o in outputs if o.kind != OutputKind.UPDATE] + \
        [GraphOutput(OutputKind.UPDATE, v, o.name) for o, v in zip(updates, kept)]

    def update_scale(found, scale, tracker, skipped):
        # _amp_update_scale_: back off on an overflow; grow after growth_interval clean steps
        # when the grown scale is finite
        skip = found > 0
        successful = tracker + 1
        grow = successful == cfg.growth_interval
        grown = scale * cfg.growth_factor
        grown = torch.where(torch.isfinite(grown), grown, scale)
        new_scale = torch.where(skip, scale * cfg.backoff_factor, torch.where(grow, grown, scale))
        new_tracker = torch.where(skip | grow, torch.zeros_like(tracker), successful)
        return new_scale, new_tracker, skipped + skip.to(skipped.dtype)

    state = [(LOSS_SCALE, types[LOSS_SCALE]), (GROWTH_TRACKER, types[GROWTH_TRACKER]),
             (SKIPPED_STEPS, types[SKIPPED_STEPS])]
    new = splice(update_scale, [(found, TensorType((), "i64")), *state], "scaler", nodes)
    outputs.extend(GraphOutput(OutputKind.UPDATE, v, name) for v, (name, _) in zip(new, state))


def splice(fn, args: list[tuple[str, TensorType]], prefix: str, nodes: list[Node]) -> list[str]:
    """Trace ``fn`` on fake tensors of the ``(value, type)`` arguments and append its ops,
    reading those values, as optimizer ops; returns the values of its results."""
    with FakeTensorMode():
        fakes = [torch.empty(t.shape, dtype=getattr(torch, DTYPES[t.dtype])) for _, t in args]
    traced = import_fx(make_fx(fn, tracing_mode="fake")(*fakes).graph)
    rename = dict(zip((traced.names[p] for p in traced.placeholders), (v for v, _ in args)))
    for n in traced.nodes:
        rename.update({o: f"{prefix}_{o}" for o in n.outputs})
        nodes.append(Node([rename[o] for o in n.outputs], n.op, map_refs(n.args, rename.__getitem__),
                          map_refs(n.kwargs, rename.__getitem__), n.types, Role.OPTIMIZER))
    return [rename[traced.names[o]] for o in traced.outputs]
