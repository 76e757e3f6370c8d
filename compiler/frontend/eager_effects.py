"""What eager's forward and backward do beside their ops, which a trace does not record.

- A custom backward may accumulate a parameter's gradient into its ``.grad`` itself (a
  reversible layer's, RevNet's or Reformer's, recomputes its forward and calls
  ``autograd.backward`` on it): ``autograd.grad`` does not return it, ``loss.backward()`` would
  leave it in ``.grad``, so it is added to the gradient (``plus_accumulated``).
- The forward may reseed the global generator (``torch.manual_seed``, ``torch.seed``: Reformer
  reseeds its LSH hashing and dropout to draw them again in its backward). A plan draws every
  random number of a step from one stream seeded per step, which a reseed cannot enter: it is
  refused with the line that reseeds (``no_reseeding``).
"""
from __future__ import annotations

import contextlib
import os
import traceback
from unittest import mock

import torch

import sbpc.compiler
import sbpc.runtime
from sbpc.compiler.frontend.model_loader import display_path
from sbpc.errors import CaptureError


def plus_accumulated(grad: torch.Tensor | None, param: torch.Tensor) -> torch.Tensor | None:
    """``param``'s gradient as eager's ``loss.backward()`` leaves it in ``.grad``: what
    ``autograd.grad`` returned plus what a custom backward accumulated into ``.grad``. ``.grad``
    is cleared: the next trace starts without it."""
    accumulated, param.grad = param.grad, None
    if accumulated is None:
        return grad
    return accumulated if grad is None else grad + accumulated


@contextlib.contextmanager
def no_reseeding():
    """While tracing: ``torch.manual_seed`` and ``torch.seed`` raise a CaptureError naming the
    line outside torch and sbpc that called them."""
    def refuse(name: str):
        def reseed(*_args, **_kwargs):
            raise CaptureError(f"forward() reseeds the random generator ({name})",
                               location=_caller(traceback.extract_stack()[:-1]),
                               hint="a plan draws each step's random numbers from one stream seeded per step; "
                                    "draw without reseeding in forward()")
        return reseed
    with mock.patch.object(torch, "manual_seed", refuse("torch.manual_seed")), \
            mock.patch.object(torch, "seed", refuse("torch.seed")):
        yield


def _caller(stack: traceback.StackSummary) -> str | None:
    skip = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, sbpc.compiler, sbpc.runtime))
    for frame in reversed(stack):
        if not os.path.abspath(frame.filename).startswith(skip):
            return f"{display_path(frame.filename)}:{frame.lineno}"
    return None
