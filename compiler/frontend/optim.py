"""Optimizers as graph ops: each parameter's update is part of the compiled program.

The update rule is written once as a functional PyTorch function, traced to ATen ops once,
and stamped out per parameter. Later, ZeRO shards the state inputs with SBP like any tensor.
The math follows torch.optim's single-tensor AdamW and SGD so that ``sbpc check`` can
compare against them.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from sbpc.compiler.frontend.fx_import import import_fx
from sbpc.compiler.ir.types import (DTYPES, GraphInput, GraphOutput, InputKind, Node, OutputKind, Ref, Role, SourceLoc,
                                    StateName, TensorType, map_refs)
from sbpc.errors import CompileError
from sbpc.runtime.plan import LR

LR_VALUE = "lr"  # the learning rate input's value in the IR

_TEMPLATE_SHAPE = (3, 7)  # any shape unlikely to appear as a literal in the update math


@dataclass(frozen=True)
class OptimizerConfig:
    kind: Literal["adamw", "sgd"] = "adamw"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    momentum: float = 0.0
    # clip the gradients by their global norm to this (torch.nn.utils.clip_grad_norm_), None: never
    clip_grad: float | None = None

    @property
    def state_names(self) -> tuple[str, ...]:
        if self.kind == "adamw":
            return ("exp_avg", "exp_avg_sq")
        return ("momentum_buffer",) if self.momentum else ()

    def torch_optimizer(self, params, fused: bool = False):
        """The eager torch.optim equivalent, for `sbpc check`: the single-tensor algorithm the
        traced update reproduces, or with ``fused`` torch's fused AdamW kernel (a plan whose
        update the fuse-adamw pass made that kernel)."""
        if self.kind == "adamw":
            return torch.optim.AdamW(params, lr=self.lr, betas=self.betas, eps=self.eps,
                                     weight_decay=self.weight_decay, foreach=False, fused=fused)
        return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum,
                               weight_decay=self.weight_decay, foreach=False)


def _adamw(cfg: OptimizerConfig):
    b1, b2 = cfg.betas

    def update(param, grad, exp_avg, exp_avg_sq, step, lr):
        # The learning rate is the step's input (f64, as torch's Python float), so every
        # product with it is torch's: 1 - lr * wd and lr / (1 - b1^t) in float64, and the
        # bias corrections in float64 too, as torch computes them in Python: 1 - 0.999**t
        # cancels badly in float32.
        s = _as_param_scalar(param)
        param = param * s(1 - lr * cfg.weight_decay)
        exp_avg = torch.lerp(exp_avg, grad, 1 - b1)
        exp_avg_sq = torch.addcmul(exp_avg_sq * b2, grad, grad, value=1 - b2)
        step_size = lr / (1 - torch.pow(b1, step))
        denom = exp_avg_sq.sqrt() / s(torch.sqrt(1 - torch.pow(b2, step))) + cfg.eps
        # (value * t1) / t2 + self: the order of torch's addcdiv kernel, so rounding matches.
        return param + (s(-step_size) * exp_avg) / denom, exp_avg, exp_avg_sq

    return update


def _as_param_scalar(param: torch.Tensor):
    """What a float64 0-d scalar must be to meet ``param`` as torch.optim's Python float does.
    A tensor of any rank converts it to its own dtype; a 0-d parameter would meet it as an
    equal, and torch promotes 0-d f32 with 0-d f64 to f64 (a step a rounding away from
    torch.optim's, e.g. weight_norm(dim=None)'s scalar g): the scalar is cast for those."""
    return (lambda t: t.to(param.dtype)) if param.dim() == 0 else (lambda t: t)


def _sgd(cfg: OptimizerConfig):
    # torch.add(x, y, alpha=a) is one kernel computing fma(y, a, x): one rounding where
    # x + a * y rounds twice, so the plan says add-with-alpha wherever torch's SGD does
    # (grad.add(param, alpha=wd), buf.mul_(m).add_(grad)). The step's -lr is a tensor, which
    # alpha cannot be: addcmul(p, d_p, -lr) is the same single rounding (torch's SGD itself
    # takes it for a tensor lr; bit for bit add(p, d_p, alpha=-lr), measured on 4M entries).
    def update(param, grad, *state_step_lr):
        *state, _step, lr = state_step_lr
        d_p = torch.add(grad, param, alpha=cfg.weight_decay) if cfg.weight_decay else grad
        if cfg.momentum:
            d_p = state[0] * cfg.momentum + d_p  # torch starts buf at d_p; zeros*m + d_p is that
        return (torch.addcmul(param, d_p, _as_param_scalar(param)(-lr)), *((d_p,) if cfg.momentum else ()))

    return update


@lru_cache(maxsize=None)
def _template(cfg: OptimizerConfig, dtype: str, zero_d: bool = False):
    """The update traced once per optimizer and parameter dtype, and once more for 0-d
    parameters (``_as_param_scalar``), whose template is their own: it names no shape to stamp."""
    update = _adamw(cfg) if cfg.kind == "adamw" else _sgd(cfg)
    shape = () if zero_d else _TEMPLATE_SHAPE
    example = [torch.zeros(shape, dtype=getattr(torch, DTYPES[dtype])) for _ in range(2 + len(cfg.state_names))]
    # the step counter and the learning rate: two tensors (one object twice would trace as one input)
    example += [torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)]
    tpl = import_fx(make_fx(lambda *a: update(*a))(*example).graph)
    for n in tpl.nodes if not zero_d else ():  # stamping per parameter only rewrites types, so no op may name a shape
        if any(isinstance(a, list) and tuple(a) == shape for a in (*n.args, *n.kwargs.values())):
            raise CompileError(f"the {cfg.kind} update uses a shape literal ({n.op}); it cannot be stamped per parameter")
    return tpl


def append_optimizer(cfg: OptimizerConfig, params: list[tuple[str, str, TensorType, str, SourceLoc | None]],
                     inputs: list[GraphInput], nodes: list[Node], outputs: list[GraphOutput]) -> None:
    """Add state inputs, update ops and update outputs for ``(fqn, value, type, grad, loc)`` params,
    and the learning rate input every update reads.

    A parameter's update ops carry its module path and the line that created it."""
    step_in, step_out = "opt_step", "opt_step_next"
    step_type = TensorType((), "f64")
    inputs.append(GraphInput(InputKind.STATE, step_in, step_type, str(StateName("step"))))
    inputs.append(lr_input())
    nodes.append(Node([step_out], "aten.add.Tensor", (Ref(step_in), 1), {}, [step_type], Role.OPTIMIZER))
    outputs.append(GraphOutput(OutputKind.UPDATE, step_out, str(StateName("step"))))
    # the template's nodes retyped for a parameter's type, once per type: a 1T model has ~1,500
    # parameters of a handful of types, and ~30,000 update ops
    stencils: dict[TensorType, list[tuple]] = {}
    for i, (fqn, value, ttype, grad, loc) in enumerate(params):
        tpl = _template(cfg, ttype.dtype, ttype.shape == ())
        loc = SourceLoc(fqn.rpartition(".")[0], loc.file, loc.line) if loc else None
        states = [(f"{s}_{i}", str(StateName(s, fqn))) for s in cfg.state_names]
        for sval, sname in states:
            inputs.append(GraphInput(InputKind.STATE, sval, ttype, sname))
        given = dict(zip((tpl.names[p] for p in tpl.placeholders),
                         [value, grad, *(s for s, _ in states), step_out, LR_VALUE]))
        prefix = f"opt{i}_"
        rename = lambda v: given[v] if v in given else prefix + v  # the template's own values get the prefix
        if ttype not in stencils:
            stencils[ttype] = _stencil(tpl, ttype)
        for outs, op, args, kwargs, types, flat in stencils[ttype]:
            args = tuple([Ref(rename(a.name)) if type(a) is Ref else a for a in args]) if flat \
                else map_refs(args, rename)
            nodes.append(Node([prefix + o for o in outs], op, args, map_refs(kwargs, rename), list(types),
                              Role.OPTIMIZER, loc=loc))
        results = [rename(tpl.names[o]) for o in tpl.outputs]
        outputs.append(GraphOutput(OutputKind.UPDATE, results[0], fqn))
        outputs.extend(GraphOutput(OutputKind.UPDATE, r, sname) for r, (_, sname) in zip(results[1:], states))


def _stencil(tpl, ttype: TensorType) -> list[tuple]:
    """Per template node: its outputs, op, arguments, keyword arguments, types for a parameter
    of ``ttype``, and whether its arguments are a flat tuple (of values and scalars), which a
    parameter's copy renames without ``map_refs``' walk."""
    flat = lambda args: type(args) is tuple and not any(isinstance(a, (list, tuple, dict)) for a in args)
    return [(n.outputs, n.op, n.args, n.kwargs, [_retype(t, ttype) for t in n.types], flat(n.args))
            for n in tpl.nodes]


def lr_input() -> GraphInput:
    """The learning rate: a per-step input (``Runner.step(lr=)``; the plan's ``optimizer.lr``
    when none is given), f64 as torch's Python float, B on every axis (the default SBP)."""
    return GraphInput(InputKind.HYPER, LR_VALUE, TensorType((), "f64"), LR)


def _retype(t: TensorType, param: TensorType) -> TensorType:
    if t.shape == _TEMPLATE_SHAPE:
        return TensorType(param.shape, t.dtype)
    if t.shape == ():
        return t
    raise CompileError(f"optimizer template produced an unexpected shape {t.shape}")
