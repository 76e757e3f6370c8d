"""Eager's dropout in `sbpc check` on a GPU as the plan captured it.

The capture traces the forward on CPU fake tensors, where ``at::dropout`` is its composite
form, ``noise = empty_like(x).bernoulli_(1 - p); noise.div_(1 - p); x * noise`` (also inside
SDPA with ``dropout_p > 0``, which the CPU runs in its math form). The plan draws exactly that
(``aten.bernoulli.p``), from the generator of the device it runs on. Eager on CUDA draws
otherwise from the same seed: ``at::dropout`` of a CUDA tensor is the fused
``at::native_dropout`` kernel (``is_fused_kernel_acceptable``), and SDPA with dropout picks the
flash or memory-efficient kernel, which drop inside the kernel. Either turns the Philox stream
into another mask, and the check would fail a correct plan. So on a GPU eager runs:

- ``F.dropout`` / ``torch.dropout(_)``: the composite form itself (``CompositeDropout``);
- SDPA with ``dropout_p > 0``: its math form, as on the CPU (``sdpa_kernel(MATH)``), whose
  ``at::dropout`` call (C++, below Python's functions) reaches ``aten.native_dropout``, which
  ``PlanDropout`` draws in the composite form: the same mask; the backward is
  ``native_dropout_backward``'s ``grad * mask * (1 / (1 - p))`` where the plan multiplies by
  ``mask / (1 - p)`` (an ulp apart).

On the CPU none of this is needed (eager's dropout is the composite form there), so
``plan_dropout`` adds nothing; tests/test_random.py shows each piece equals the CPU's to the bit.

The float64 twin that measures eager's own rounding error (``Eager.rounding_noise``) must draw
what float32 eager drew: ``torch.rand(..., dtype=x.dtype)`` (stochastic depth's mask) gives other
numbers in float64 from the same seed, and the twin then computes another function and cannot
stand in. ``Float32Draws`` makes every seeded random op of a float64 tensor in float32 and widens
the result.
"""
from __future__ import annotations

import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._pytree import tree_map
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

F = torch.nn.functional
_DROPOUTS = frozenset({F.dropout, torch.dropout, torch.dropout_})


@contextlib.contextmanager
def plan_dropout(device: torch.device):
    """The context eager's forward runs in on ``device``: the modes below off the CPU."""
    if device.type == "cpu":
        yield
        return
    with PlanDropout(), CompositeDropout():
        yield


def composite_dropout(x: torch.Tensor, p: float, inplace: bool = False) -> torch.Tensor:
    """``at::_dropout_impl`` (not feature, not alpha) for 0 < p < 1, training, numel > 0."""
    noise = torch.empty_like(x).bernoulli_(1 - p)
    noise.div_(1 - p)
    return x.mul_(noise) if inplace else x * noise


def _drops(x, p, training) -> bool:
    """Whether torch would take a fused kernel here: training, 0 < p < 1, a non-empty tensor;
    every other call (p of 0 or 1, eval, an invalid p: torch's own checks) goes to torch as is."""
    return isinstance(x, torch.Tensor) and bool(training) and isinstance(p, (int, float)) and 0 < p < 1 \
        and x.numel() > 0


class CompositeDropout(TorchFunctionMode):
    """``F.dropout`` / ``torch.dropout(_)`` as ``composite_dropout``; SDPA with dropout in its
    math form."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _DROPOUTS:
            x, p, training, inplace = _dropout_args(func, args, kwargs)
            if _drops(x, p, training):
                return composite_dropout(x, float(p), inplace)
        elif func is F.scaled_dot_product_attention:
            p = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)
            if isinstance(p, (int, float)) and p > 0:
                with sdpa_kernel([SDPBackend.MATH]):
                    return func(*args, **kwargs)
        return func(*args, **kwargs)


class PlanDropout(TorchDispatchMode):
    """``aten.native_dropout`` (what ``at::dropout`` calls on a GPU, from C++ too) drawn in the
    composite form; its mask is where the noise is not zero."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.native_dropout.default:
            x, p = args[0], args[1] if len(args) > 1 else kwargs["p"]
            train = args[2] if len(args) > 2 else kwargs.get("train")
            if _drops(x, p, train):
                noise = torch.empty_like(x).bernoulli_(1 - p)
                noise.div_(1 - p)
                return x * noise, noise != 0
        return func(*args, **kwargs)


def _dropout_args(func, args, kwargs) -> tuple:
    """(input, p, training, inplace) of a call of ``F.dropout(input, p=0.5, training=True,
    inplace=False)`` or ``torch.dropout(_)(input, p, train)``; None for what the call lacks
    (torch then raises its own error)."""
    if func is F.dropout:
        bound = {"p": 0.5, "training": True, "inplace": False, **dict(zip(("input", "p", "training", "inplace"), args))}
        bound.update(kwargs)
        return bound.get("input"), bound["p"], bound["training"], bound["inplace"]
    bound = {**dict(zip(("input", "p", "train"), args)), **kwargs}
    return bound.get("input"), bound.get("p"), bound.get("train"), func is torch.dropout_


class Float32Draws(TorchDispatchMode):
    """A seeded random op (``rand``, ``uniform_``, ``normal_``, ``bernoulli``, ...) asked for float64
    draws in float32, from the same generator, and widened: float32's numbers in float64, the
    generator advanced as float32 eager advanced it."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded not in func.tags or "out" in kwargs:
            return func(*args, **kwargs)
        wide = [False]

        def narrow(x):
            if isinstance(x, torch.Tensor) and x.dtype == torch.float64:
                wide[0] = True
                return x.float()
            if x is torch.float64:
                wide[0] = True
                return torch.float32
            return x

        args32, kwargs32 = tree_map(narrow, args), tree_map(narrow, kwargs)
        if not wide[0]:
            return func(*args, **kwargs)
        out = func(*args32, **kwargs32)
        if torch.Tag.inplace in func.tags:  # drawn into the float32 copy of self: back into self
            return args[0].copy_(args32[0])
        return tree_map(lambda t: t.double() if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t, out)
