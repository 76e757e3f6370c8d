"""Modules whose output is a function of each row of their inputs alone: row-wise regions.

A mixture of experts as Hugging Face runs it (``transformers.integrations.moe``: grouped or
batched matmuls) sorts every token it is given by expert, so per-op SBP rules cannot split
it: the sort's permutation indexes the whole batch. Yet the module is a function of each
token alone (no expert capacity drops a token), so running it on any subset of the tokens
gives those tokens' rows of the whole result. Capture lists such modules in
``Graph.rowwise``; sbp-propagate splits their ops as one region (``compiler/sbp/rowwise.py``).
"""
from __future__ import annotations

import torch


def rowwise_modules(model: torch.nn.Module) -> tuple[str, ...]:
    """The paths of ``model``'s modules known to be row-wise: Hugging Face's experts classes
    (made by ``use_experts_implementation``, which gives them ``_apply_gate`` and an
    ``_is_expert_parallel`` flag) while they hold every expert, which is when no token is
    dropped (expert parallelism marks the tokens of other ranks' experts instead)."""
    return tuple(name for name, m in model.named_modules()
                 if name and getattr(m, "_is_expert_parallel", None) is False
                 and callable(getattr(type(m), "_apply_gate", None)))
