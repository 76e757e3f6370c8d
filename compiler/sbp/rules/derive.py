"""Rules for whole classes of ATen ops, derived from torch's own metadata.

An overload's rule follows from what torch records about it: ``torch.Tag.pointwise`` says the
op maps element to element under broadcasting (``elementwise`` over its tensor arguments, read
from the schema); a reduction's schema names its ``dim`` list and ``keepdim``; a scan names
its ``dim``. What metadata cannot say is where an op is linear (a ``P`` input stays ``P``) or
non-decreasing (``P(max)`` stays ``P(max)``): the tables below state it per op, and the op
database sweep (tests/test_opdb.py) proves every signature they add by execution.

A rule written in ``ir_specs/aten.sbp`` overrides the derived one; ops with side effects
(in-place, ``out=``) get no rule, since the IR is functional.
"""
from __future__ import annotations

import functools

import torch

from sbpc.compiler.sbp.rules.dsl import Arg, Modifier, Rule
from sbpc.runtime.backend import torch_op

SOURCE = "<derived from torch metadata>"

# Linear: groups of tensor parameters the op is linear in jointly (every other tensor B).
# A group naming a parameter that is a scalar in some overload is skipped there (x + 1 is
# not linear in x), so one entry serves the Tensor and Scalar overloads alike.
LINEAR: dict[str, tuple[tuple[str, ...], ...]] = {
    "neg": (("self",),), "positive": (("self",),), "clone": (("self",),), "alias": (("self",),),
    "detach": (("self",),), "lift_fresh": (("self",),), "lift_fresh_copy": (("self",),),
    "alias_copy": (("self",),), "deg2rad": (("self",),), "rad2deg": (("self",),),
    "add": (("self", "other"),), "sub": (("self", "other"),), "rsub": (("self", "other"),),
    "mul": (("self",), ("other",)), "div.Tensor": (("self",),), "div.Scalar": (("self",),),
    "true_divide": (("self",),),
    "where.self": (("self", "other"),), "masked_fill.Tensor": (("self", "value"),),
    "lerp": (("self", "end"),), "addcmul": (("self", "tensor1"), ("self", "tensor2")),
    "addcdiv": (("self", "tensor1"),), "fill.Tensor": (("value",),),
}

# Non-decreasing in these groups (every other tensor B): max over devices commutes with the
# op. Only ops defined on the whole line: a device's smaller partial max may be any value
# (-inf for an empty block), so log and sqrt, which turn it into nan, are not listed.
_UNARY_MONOTONE = ("exp", "exp2", "expm1", "tanh", "sigmoid", "relu", "erf", "atan", "asinh", "sinh",
                   "floor", "ceil", "trunc", "round", "sign", "clamp", "clamp_min", "clamp_max", "hardtanh",
                   "hardsigmoid", "clone", "alias", "detach", "lift_fresh", "lift_fresh_copy", "alias_copy", "deg2rad", "rad2deg", "positive")
MONOTONE: dict[str, tuple[tuple[str, ...], ...]] = {
    **{op: (("self",),) for op in _UNARY_MONOTONE},
    "add": (("self",),), "sub": (("self",),), "where.self": (("self", "other"),),
    "maximum": (("self",), ("other",), ("self", "other")), "max.other": (("self",), ("other",), ("self", "other")),
    "minimum": (("self",), ("other",)), "min.other": (("self",), ("other",)),
    "masked_fill": (("self",),), "masked_fill.Tensor": (("self", "value"),),
}

# Elementwise by meaning though not tagged pointwise; the backward ones are grad * f'(x).
ELEMENTWISE = ("masked_fill.Tensor", "alias", "detach", "lift_fresh", "lift_fresh_copy", "fill", "copy", "rsub",
               "floor_divide", "hardswish", "alias_copy")
POINTWISE_BACKWARD = ("hardtanh_backward", "leaky_relu_backward", "elu_backward", "softplus_backward",
                      "hardsigmoid_backward", "hardswish_backward", "mish_backward", "log_sigmoid_backward",
                      "rrelu_with_noise_backward", "softshrink_backward", "hardshrink_backward")

# Reductions over a dim list: how a split reduced dim combines ("none": it may not split).
REDUCTIONS = {
    "sum": "sum", "nansum": "sum", "mean": "mean", "count_nonzero": "sum", "amax": "max", "max": "max",
    "amin": "none", "min": "none", "prod": "none", "var": "none", "std": "none", "var_mean": "none",
    "std_mean": "none", "any": "none", "all": "none", "argmax": "none", "argmin": "none",
    "logsumexp": "none", "linalg_vector_norm": "none", "norm": "none", "nanmean": "mean", "aminmax": "none",
    "median": "none", "nanmedian": "none", "mode": "none", "kthvalue": "none",
}
REDUCE_LINEAR = {"sum": "partial", "mean": "partial", "nanmean": None, "amax": "pmax", "max": "pmax"}

# Scans along one dim: that dim may not split; cumsum is linear.
SCANS = {"cumsum": True, "cumprod": False, "logcumsumexp": False, "cummax": False, "cummin": False,
         "sort": False, "topk": False}


def _lookup(table: dict, op: str):
    _, packet, overload = op.split(".")
    return table.get(f"{packet}.{overload}", table.get(packet))


def _name(v: str) -> Arg:
    return Arg("name", v, 0, 0)


def _rule(op: str, family: str, args: list[Arg], **mods: tuple[tuple[str, ...], ...]) -> Rule:
    modifiers = tuple(Modifier(m, tuple(tuple(_name(p) for p in g) for g in groups), 0, 0)
                      for m, groups in mods.items() if groups)
    return Rule(op, None, family, tuple(args), modifiers, SOURCE, 0, 0)


def _tensor_params(schema) -> list[str] | None:
    """Names of the schema's tensor parameters; None when it takes a tensor list."""
    out = []
    for a in schema.arguments:
        t = str(a.type)
        if "List[Tensor]" in t or "List[Optional[Tensor]]" in t:
            return None
        if t in ("Tensor", "Optional[Tensor]"):
            out.append(a.name)
    return out


@functools.lru_cache(maxsize=None)
def derived_rule(op: str) -> Rule | None:
    """The class rule of ATen overload ``op`` ("aten.silu.default"), or None when torch's
    metadata places it in no class this module knows."""
    kernel = torch_op(op)
    if kernel is None or not op.startswith("aten."):
        return None
    schema = kernel._schema
    if schema.is_mutable or any(r.alias_info is not None and r.alias_info.is_write for r in schema.returns):
        return None
    if not schema.returns or any(str(r.type) != "Tensor" for r in schema.returns):
        return None
    params = [a.name for a in schema.arguments]
    if any(a.name == "dim" and "Dimname" in str(a.type) for a in schema.arguments):
        return None  # named dims: the IR has none
    tensors = _tensor_params(schema)
    if tensors is None or not tensors:
        return None
    if torch.Tag.nondeterministic_seeded in kernel.tags:
        from sbpc.compiler.sbp.rules.random_ops import shape_only

        if shape_only(op):  # each device keeps its shard of the logical draw
            return _rule(op, "random", [_name(t) for t in tensors])
        return _rule(op, "broadcast_only", [])  # reads values: every rank draws the whole tensor
    _, packet, _ = op.split(".")
    if packet == "_to_copy":
        return _rule(op, "convert", [_name("self")])
    if packet in POINTWISE_BACKWARD or (packet.endswith("_backward") and torch.Tag.pointwise in kernel.tags):
        return _rule(op, "elementwise", [_name(t) for t in tensors], partial=((tensors[0],),))
    if torch.Tag.pointwise in kernel.tags or _lookup({e: 1 for e in ELEMENTWISE}, op):
        return _rule(op, "elementwise", [_name(t) for t in tensors],
                     partial=_lookup(LINEAR, op) or (), pmax=_lookup(MONOTONE, op) or ())
    if packet in REDUCTIONS and params[0] == "self" and tensors == ["self"]:
        kind = REDUCTIONS[packet]
        if kind == "max" and len(schema.returns) > 1:
            kind = "none"  # max.dim: the indices of the maxima do not combine by max
        dim = _name("dim") if "dim" in params else _name("none")
        keepdim = _name("keepdim") if "keepdim" in params else _name("false")
        lin = REDUCE_LINEAR.get(packet) if kind != "none" else None
        return _rule(op, "reduce", [_name("self"), dim, keepdim, Arg("str", kind, 0, 0)],
                     **({lin: (("self",),)} if lin else {}))
    if packet in SCANS and "dim" in params and tensors == ["self"]:
        return _rule(op, "elementwise", [_name("self")], unsplit=(("dim",),),
                     partial=(("self",),) if SCANS[packet] else ())
    return None


@functools.lru_cache(maxsize=None)
def aten_overloads() -> tuple[str, ...]:
    """Every ATen overload registered with the dispatcher, as IR op names."""
    out = []
    for name in torch._C._dispatch_get_all_op_names():
        if name.startswith("aten::"):
            packet, _, overload = name[len("aten::"):].partition(".")
            out.append(f"aten.{packet}.{overload or 'default'}")
    return tuple(sorted(set(out)))
