"""Eager's dropout in `sbpc check` as the plan captured it, on every device.

The capture traces the forward on CPU fake tensors, where ``at::dropout`` is its composite
form: ``noise = empty_like(x).bernoulli_(1 - p); noise.div_(1 - p); x * noise``. The plan
draws exactly that (``aten.bernoulli.p``), from the generator of the device it runs on. On
CUDA, eager ``F.dropout`` takes another kernel instead (``at::native_dropout``, chosen by
``is_fused_kernel_acceptable`` for a CUDA tensor with 0 < p < 1): a fused kernel that turns
the same Philox stream into another mask, so eager and the plan would drop different elements
from one seed and the check would fail a correct plan. Here eager runs the composite form on
every device; on the CPU that is what ``at::dropout`` runs anyway (bit for bit, tested), on
CUDA it is torch's own non-fused dropout, drawn from the CUDA generator the plan draws from.
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

_DROPOUTS = frozenset({torch.nn.functional.dropout, torch.dropout, torch.dropout_})


def composite_dropout(x: torch.Tensor, p: float, training: bool, inplace: bool) -> torch.Tensor:
    """``at::_dropout_impl`` (not feature, not alpha) for 0 < p < 1, training, numel > 0."""
    noise = torch.empty_like(x).bernoulli_(1 - p)
    noise.div_(1 - p)
    return x.mul_(noise) if inplace else x * noise


class CompositeDropout(TorchFunctionMode):
    """Within it, ``F.dropout`` / ``torch.dropout(_)`` run ``composite_dropout`` wherever the
    fused kernel would take them; every other call (p of 0 or 1, eval, an empty tensor, an
    invalid p: torch's own checks) goes to torch unchanged."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _DROPOUTS:
            x, p, training, inplace = _dropout_args(func, args, kwargs)
            if isinstance(x, torch.Tensor) and training and isinstance(p, (int, float)) and 0 < p < 1 and x.numel():
                return composite_dropout(x, float(p), training, inplace)
        return func(*args, **kwargs)


def _dropout_args(func, args, kwargs) -> tuple:
    """(input, p, training, inplace) of a call of ``F.dropout(input, p=0.5, training=True,
    inplace=False)`` or ``torch.dropout(_)(input, p, train)``; None for what the call lacks
    (torch then raises its own error)."""
    if func is torch.nn.functional.dropout:
        bound = {"p": 0.5, "training": True, "inplace": False, **dict(zip(("input", "p", "training", "inplace"), args))}
        bound.update(kwargs)
        return bound.get("input"), bound["p"], bound["training"], bound["inplace"]
    bound = {**dict(zip(("input", "p", "train"), args)), **kwargs}
    return bound.get("input"), bound.get("p"), bound.get("train"), func is torch.dropout_
