"""Random ops on a mesh: every device keeps its shard of eager's draw.

A random op whose output is split (``sbpc.random_shard``) draws the *logical* tensor from
torch's generator and keeps this device's shard (``sharding.local_shard``, over the plan's
axes, the micro-batch axis included), so the values are eager's bit for bit and the generator
advances exactly as eager's does. Only the op's output shape and dtype enter a draw (the
rule book gives this kernel only ops whose tensor arguments carry nothing else:
``bernoulli.p``, ``rand_like``, ``uniform``, ...), so the draw runs on empty carriers.

Where every rank runs every random op of the step in program order (one stage, one
micro-batch), the global generator, seeded before the step, is at eager's position for each
op. A pipeline breaks that: a stage does not run the draws of the stages before it, and the
micro-batches of a step interleave. So a pipelined rank first replays the step's draws
(``replay``: every random op of every stage, in eager order, at logical size) and records
the generator state before each (the CPU mt19937 state, 5 KB); op ``draw`` then restores its
state, draws the logical tensor and keeps its micro-batch's and device's slice. Cost per
step and rank: the random work of the whole model once, plus a logical draw per random op
and micro-batch of its stage (m + 1 draws where eager does one); memory: 5 KB per random op.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sbpc.runtime.backend import torch_op
from sbpc.runtime.plan import DTYPES, ComplexArg, DTypeArg, FloatArg, Instruction, RefArg, SymArg, complex_value
from sbpc.runtime.sbp import parse_nd_sbp
from sbpc.runtime.sharding import local_shard

RANDOM_SHARD = "sbpc.random_shard"


def _draw(op: str, args, kwargs: dict, shape: list[int]) -> torch.Tensor:
    """``op`` on the logical shape: each tensor argument is an empty carrier of that shape."""
    fn = torch_op(op)
    args = [torch.empty(shape, dtype=a.dtype, device=a.device) if isinstance(a, torch.Tensor) else a for a in args]
    return fn(*args, **kwargs)


def random_shard(backend, *args, op: str, shape: list[int], sbp: list[str], axes: list[str], draw: int | None = None,
                 **kwargs) -> torch.Tensor:
    """This device's shard (nd-SBP ``sbp`` over ``axes``) of ``op``'s logical draw."""
    from sbpc.runtime.collectives import axis_group

    states = getattr(backend, "rng_states", None)
    if draw is not None and states is not None:
        saved = torch.get_rng_state()
        torch.set_rng_state(states[draw])
        try:
            out = _draw(op, args, kwargs, shape)
        finally:
            torch.set_rng_state(saved)
    else:
        out = _draw(op, args, kwargs, shape)
    coords, sizes = [], []
    for a in axes:
        group, index = axis_group(backend, a)
        coords.append(index)
        sizes.append(len(group))
    return local_shard(out, parse_nd_sbp(sbp), tuple(coords), tuple(sizes))


@dataclass(frozen=True)
class Draw:
    """One random op of the step, as eager runs it: op, literal arguments, logical output."""

    op: str
    args: tuple
    kwargs: dict
    shape: list[int]
    dtype: torch.dtype


def draws(instructions: list[Instruction]) -> list[Draw]:
    """The step's draws in eager order, from the ``random_shard`` instructions of every stage."""
    mine = {}
    for ins in instructions:
        if ins.op == RANDOM_SHARD and ins.kwargs.get("draw") is not None:
            kw = dict(ins.kwargs)
            op, shape, draw = kw.pop("op"), kw.pop("shape"), kw.pop("draw")
            kw.pop("sbp"), kw.pop("axes")
            dtype = getattr(torch, DTYPES[ins.types[0].dtype])
            mine.setdefault(draw, Draw(op, tuple(_literal(a) for a in ins.args),
                                       {k: _literal(v) for k, v in kw.items()}, list(shape), dtype))
    return [mine[k] for k in sorted(mine)]


def replay(step_draws: list[Draw]) -> list[torch.Tensor]:
    """The generator state before each draw, drawing them all from the current state (the
    step's seed) in order; the generator ends where eager's does after the step's forward."""
    states = []
    for d in step_draws:
        states.append(torch.get_rng_state())
        carriers = [torch.empty(d.shape, dtype=d.dtype) if isinstance(a, _Carrier) else a for a in d.args]
        _draw(d.op, carriers, d.kwargs, d.shape)
    return states


class _Carrier:
    """Stands for a tensor argument of a draw: only its shape (the output's) and dtype matter."""


def _literal(a: Any) -> Any:
    if isinstance(a, RefArg):
        return _Carrier()
    if isinstance(a, list):
        return [_literal(x) for x in a]
    if isinstance(a, DTypeArg):
        return getattr(torch, a.dtype)
    if isinstance(a, SymArg):
        return torch.device("cpu") if a.sym == "device" else getattr(torch, a.sym)
    if isinstance(a, FloatArg):
        return float(a.float)
    if isinstance(a, ComplexArg):
        return complex_value(a)
    return a
