"""``sbpc.check_input``: a library's check of its input, kept as an op of the step.

torch's ``F.gaussian_nll_loss`` raises ``ValueError`` when ``torch.any(var < 0)``: a read of a
tensor's value that capture cannot trace (``compiler/frontend/input_checks.py`` says when it
takes such a read for a check). The check becomes this op on the loss: it raises the library's
error when any element of ``bad`` is true, and otherwise returns the loss, so the plan refuses
the step that eager refuses, on that step's values. A pure op (its result is the loss), so no
pass has to keep it alive.
"""
from __future__ import annotations

import torch

CHECK_INPUT = "sbpc.check_input.default"


@torch.library.custom_op("sbpc::check_input", mutates_args=())
def _check_input(x: torch.Tensor, bad: torch.Tensor, message: str) -> torch.Tensor:
    if bool(bad.any()):
        raise ValueError(message)
    return x.clone()


@_check_input.register_fake
def _(x, bad, message):
    return torch.empty_like(x)
