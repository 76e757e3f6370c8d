"""The rule book: the SBP signatures of a node on one mesh axis, and its per-device form.

``RuleBook.load()`` reads ``ir_specs/aten.sbp``; ``signatures`` lists every valid 1-D
signature of a node (all-B first); ``localize`` rewrites a node for its chosen nd-SBPs.
"""
from __future__ import annotations

import importlib.resources
import inspect
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sbpc.compiler.ir.types import Node, Ref, TensorType
from sbpc.compiler.sbp.rules.dsl import LITERALS, Rule, parse_rules, rules_error
from sbpc.compiler.sbp.rules import nn_families, random_ops, shape_families, vocab  # noqa: F401 - register their families
from sbpc.compiler.sbp.rules.derive import derived_rule
from sbpc.compiler.sbp.rules.families import FAMILIES, LOCALIZERS, ND_CHECKS, LocCtx, SigCtx
from sbpc.compiler.sbp.rules.loops import B, Cand, enumerate_loops, norm_dim
from sbpc.errors import CompileError
from sbpc.runtime.backend import torch_op
from sbpc.runtime.sbp import NdSbp, Partial, Sbp, Split, divides

MODIFIERS = ("partial", "pmax", "unsplit")
DEFAULT_STRIDED_PARTS = (2, 3)  # block counts of strided splits offered (fused gate/up, fused qkv)


@dataclass(frozen=True)
class Signature:
    """A 1-D signature: one SBP per tensor input (``node.uses()`` order) and per output."""

    ins: tuple[Sbp, ...]
    outs: tuple[Sbp, ...]
    note: str = ""

    def __str__(self) -> str:
        return f"({', '.join(map(repr, self.ins))}) -> ({', '.join(map(repr, self.outs))})"


def op_params(op: str, rule: Rule | None = None) -> list[tuple[str, Any]]:
    """(name, default) of each parameter of ``op``: declared in the rule, else torch's schema."""
    if rule is not None and rule.params is not None:
        return [(p, None) for p in rule.params]
    kernel = torch_op(op)
    schema = getattr(kernel, "_schema", None)
    if schema is None:
        return []
    return [(a.name, a.default_value if a.has_default_value() else None) for a in schema.arguments]


def bind(node: Node, params: list[tuple[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Parameter name -> value (defaults filled in), and name -> where it sits (arg index or kwarg)."""
    values, where = {}, {}
    names = [p for p, _ in params]
    for i, a in enumerate(node.args):
        name = names[i] if i < len(names) else f"arg{i}"
        values[name], where[name] = a, i
    for k, v in node.kwargs.items():
        values[k], where[k] = v, k
    for name, default in params:
        values.setdefault(name, default)
    return values, where


def use_keys(node: Node, params: list[tuple[str, Any]]) -> list:
    """One key per ``node.uses()`` entry: the parameter name, or (name, position) in a list."""
    names = [p for p, _ in params]
    keys = []
    items = [(names[i] if i < len(names) else f"arg{i}", a) for i, a in enumerate(node.args)] + list(node.kwargs.items())
    for name, a in items:
        if isinstance(a, Ref):
            keys.append(name)
        elif isinstance(a, (list, tuple)):
            keys.extend((name, j) for j, x in enumerate(a) if isinstance(x, Ref))
    return keys


def _literals(a: Any) -> Any:
    """``a`` with every value reference blanked: signatures never depend on value names."""
    if isinstance(a, Ref):
        return Ref("")
    if isinstance(a, dict):
        return {k: _literals(v) for k, v in a.items()}
    if isinstance(a, (list, tuple)):
        return [_literals(x) for x in a]
    return a


def _check_nest(lp, c: SigCtx, rule: Rule) -> None:
    """Every tensor has one loop letter (or None) per dim: a family that miscounts is a bug, named
    here rather than surfacing as an index error somewhere in the enumeration."""
    shapes = [(key, c.shape(key), dims) for key, dims in lp.ins.items()]
    shapes += [(f"output {i}", c.out_shape(i), dims) for i, dims in enumerate(lp.outs)
               if c.node.types[i].dtype != "none"]  # an output left out (by output_mask) is always B
    for what, shape, dims in shapes:
        if len(dims) != len(shape):
            raise CompileError(f"rule family {rule.family} of {c.node.op} gives {len(dims)} dims for {what}, "
                               f"which has {len(shape)}")


class RuleBook:
    def __init__(self, rules: list[Rule], text: str = "", strided_parts: tuple[int, ...] = DEFAULT_STRIDED_PARTS,
                 derive: bool = True):
        self.rules: dict[str, Rule] = {}
        self.derive = derive  # ops without a hand rule take the class rule torch's metadata gives
        self.strided_parts = tuple(strided_parts)
        self._params: dict[str, list] = {}
        self._memo: dict = {}
        for r in rules:
            self._check(r, text)
            self.rules[r.op] = r

    @classmethod
    def load(cls, path: str | Path | None = None, strided_parts: tuple[int, ...] = DEFAULT_STRIDED_PARTS) -> "RuleBook":
        if path is None:
            text, source = importlib.resources.files("sbpc.ir_specs").joinpath("aten.sbp").read_text(), "ir_specs/aten.sbp"
        else:
            text, source = Path(path).read_text(), str(path)
        return cls.from_text(text, source, strided_parts)

    @classmethod
    def from_text(cls, text: str, source: str = "<rules>",
                  strided_parts: tuple[int, ...] = DEFAULT_STRIDED_PARTS) -> "RuleBook":
        return cls(parse_rules(text, source), text, strided_parts)

    def rule(self, op: str) -> Rule | None:
        """The rule of ``op``: the hand-written one, else the one derived from torch's metadata."""
        return self.rules.get(op) or (derived_rule(op) if self.derive else None)

    def has_rule(self, op: str) -> bool:
        return self.rule(op) is not None

    def ops(self) -> list[str]:
        """The ops with a hand-written rule."""
        return sorted(self.rules)

    def derived_ops(self) -> list[str]:
        """Every ATen overload whose rule comes from torch's metadata (a hand rule overrides it)."""
        from sbpc.compiler.sbp.rules.derive import aten_overloads

        return [op for op in aten_overloads() if op not in self.rules and derived_rule(op) is not None]

    # ------------------------------------------------------------ load-time checks

    def _check(self, r: Rule, text: str) -> None:
        def fail(line, col, what, hint=None):
            raise rules_error(r.source, line, col, what, hint, text)

        if r.op in self.rules:
            fail(r.line, r.col, f"second rule for {r.op}", f"the first is on line {self.rules[r.op].line}")
        params = op_params(r.op, r)
        if not params and r.params is None:
            fail(r.line, r.col, f"unknown op {r.op}", "torch has no such op; declare its parameters: op(a, b) = ...")
        self._params[r.op] = params
        names = {p for p, _ in params}
        if r.family not in FAMILIES:
            fail(*r.fpos, f"unknown family {r.family!r}", "families: " + ", ".join(sorted(FAMILIES)))
        try:
            inspect.signature(FAMILIES[r.family]).bind(None, *r.args)
        except TypeError:
            sig = str(inspect.signature(FAMILIES[r.family])).replace("(c, ", "(").replace("(c)", "()")
            fail(*r.fpos, f"family {r.family} takes {sig}, got {len(r.args)} arguments")
        args = list(r.args)
        for m in r.modifiers:
            if m.name not in MODIFIERS:
                fail(m.line, m.col, f"unknown modifier {m.name!r}", "modifiers: " + ", ".join(MODIFIERS))
            args += [a for g in m.groups for a in g]
        for a in args:
            if a.kind == "name" and a.value not in names and a.value not in LITERALS:
                fail(a.line, a.col, f"{r.op} has no parameter {a.value!r}",
                     "parameters: " + ", ".join(p for p, _ in params))

    # ------------------------------------------------------------ signatures

    def signatures(self, node: Node, in_types: list[TensorType], axis_size: int) -> list[Signature]:
        """Every valid signature of ``node`` on an axis of ``axis_size`` devices, all-B first.
        Memoised by what they depend on (op, literal arguments, types), so repeated layers are free."""
        key = (node.op, repr(_literals(node.args)), repr(_literals(node.kwargs)), tuple(in_types), tuple(node.types),
               axis_size, self.strided_parts)
        if key not in self._memo:
            self._memo[key] = self._signatures(node, in_types, axis_size)
        return list(self._memo[key])

    def _signatures(self, node: Node, in_types: list[TensorType], axis_size: int) -> list[Signature]:
        rule = self.rule(node.op)
        params = self._params.get(node.op) or op_params(node.op)
        keys = use_keys(node, params)
        all_b = Signature((B,) * len(keys), (B,) * len(node.types), "all B")
        if rule is None:
            return [all_b]
        values, _ = bind(node, params)
        shapes = {k: t.shape for k, t in zip(keys, in_types)}
        dtypes = {k: t.dtype for k, t in zip(keys, in_types)}
        c = SigCtx(node, values, shapes, self.strided_parts, dtypes, axis_size)
        lp, cands = FAMILIES[rule.family](c, *rule.args)
        cands = list(cands)
        if lp is not None:
            unsplit = rule.modifier("unsplit")
            if unsplit and lp.outs:
                rank = len(node.types[0].shape)
                for g in unsplit.groups:
                    v = c.value(g[0])
                    for d in ([v] if isinstance(v, int) else v or []):
                        i = norm_dim(d, rank)
                        if i is not None:
                            lp.fixed.add(lp.outs[0][i])
            _check_nest(lp, c, rule)
            cands = enumerate_loops(lp, c.shape, c.out_shape, self.strided_parts) + cands
        for mod, kind in (("partial", "sum"), ("pmax", "max")):
            m = rule.modifier(mod)
            for g in (m.groups if m else ()):
                group = [k for a in g for k in keys if k == a.value or (isinstance(k, tuple) and k[0] == a.value)]
                if not all(c.tensor(a) or isinstance(c.value(a), list) for a in g) or not group:
                    continue  # a scalar operand: the op is not linear in the tensors alone
                p = Partial(kind)
                cands.append(Cand({k: p for k in group}, [p] * len(node.types), "+".join(map(str, g)) + f" {p!r}"))
        out, seen = [all_b], {(all_b.ins, all_b.outs)}
        for cand in cands:
            sig = self._signature(cand, keys, shapes, dtypes, node, axis_size)
            if sig is not None and (sig.ins, sig.outs) not in seen:
                seen.add((sig.ins, sig.outs))
                out.append(sig)
        return out

    @staticmethod
    def _signature(cand: Cand, keys, shapes, dtypes, node: Node, k: int) -> Signature | None:
        if len(cand.outs) != len(node.types):
            return None
        ins = tuple(cand.ins.get(key, B) for key in keys)
        outs = tuple(B if t.dtype == "none" else s for s, t in zip(cand.outs, node.types))
        tensors = [(s, shapes[key], dtypes[key]) for s, key in zip(ins, keys)]
        tensors += [(s, t.shape, t.dtype) for s, t in zip(outs, node.types)]
        for s, shape, dtype in tensors:
            if isinstance(s, Split) and not divides(shape, (s,), (k,)):
                return None
            if isinstance(s, Partial) and dtype == "bool":
                return None
        return Signature(ins, outs, cand.note)

    def strides_optional(self, op: str) -> bool:
        """Whether ``op``'s strided splits are options the layout analysis offers, not block
        counts it fixes: its families map splits by the shapes and check every nd-signature
        (a view: the same dim may split plainly or inside a folded group; a repeat: the copies
        split, or each copy)."""
        rule = self.rule(op)
        return rule is not None and rule.family in ND_CHECKS

    def nd_exact(self, node: Node, in_shapes: list, ins: tuple[NdSbp, ...], outs: tuple[NdSbp, ...],
                 sizes: tuple[int, ...]) -> bool:
        """Whether 1-D signatures of ``node``, one per axis, are exact together. They are unless
        the family's mapping depends on a size an earlier axis' split changes (views)."""
        rule = self.rule(node.op)
        check = ND_CHECKS.get(rule.family) if rule is not None else None
        return check is None or check(in_shapes, [t.shape for t in node.types], ins, outs, sizes)

    # ------------------------------------------------------------ localize

    def localize(self, node: Node, in_nd: list[NdSbp], out_nd: list[NdSbp], sizes: tuple[int, ...],
                 axes: tuple[str, ...]) -> list[Node]:
        rule = self.rule(node.op)
        new = node.replace(sbp=list(out_nd), args=tuple(node.args), kwargs=dict(node.kwargs))
        if rule is None or rule.family not in LOCALIZERS:
            return [new]
        params = self._params.get(node.op) or op_params(node.op)
        values, where = bind(node, params)
        keys = use_keys(node, params)
        lc = LocCtx(node, values, dict(zip(keys, in_nd)), list(out_nd), tuple(sizes), tuple(axes))
        LOCALIZERS[rule.family](lc, *rule.args)
        args, kwargs = list(new.args), dict(new.kwargs)
        if lc.args is not None:  # a different op with its own arguments
            args, kwargs = list(lc.args), {}
        for name, v in lc.set.items():
            pos = where.get(name, name)
            if isinstance(pos, int):
                args[pos] = v
            else:
                kwargs[pos] = v
        if lc.op:
            new.op = lc.op
        if lc.masked_axes:
            kwargs["axis"] = lc.masked_axes[0] if len(lc.masked_axes) == 1 else list(lc.masked_axes)
        new.args, new.kwargs = tuple(args), kwargs
        if lc.scale == 1.0:
            return [new]
        # the scale is the first output's (a loss); the others (multilabel margin's is_target) are kept
        out = node.outputs[0]
        new.outputs = [f"{out}__unscaled", *node.outputs[1:]]
        scale = replace(node, outputs=[out], op="aten.mul.Tensor", args=(Ref(new.outputs[0]), lc.scale), kwargs={},
                        types=[node.types[0]], sbp=[out_nd[0]])
        if hasattr(scale, "sbp_in"):
            scale.sbp_in = [out_nd[0]]
        return [new, scale]
