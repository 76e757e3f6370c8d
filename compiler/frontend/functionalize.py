"""Rewrite in-place ops on private temporaries into their out-of-place forms.

Eager kernels often build a fresh tensor and fill it in place: CPU dropout is
``empty_like`` + ``bernoulli_`` + ``div_``. When the mutated tensor is a temporary that nobody
else can observe (not a graph input, not a view, no views of it), ``x.op_(...)`` followed by
uses of ``x`` is the same as ``x2 = op(x, ...)`` followed by uses of ``x2``. Anything else
stays in place, and the verifier then refuses it with the user's line.
"""
from __future__ import annotations

from dataclasses import replace

from sbpc.compiler.ir.aten import functional_variant, returns_alias
from sbpc.compiler.ir.types import Node, Ref, rename_uses


def functionalize(nodes: list[Node], inputs: set[str]) -> tuple[list[Node], dict[str, str]]:
    """The rewritten nodes, and the renaming that graph outputs must follow too."""
    viewed = _aliased_values(nodes)
    rename: dict[str, str] = {}

    def resolve(name: str) -> str:
        while name in rename:  # x -> x after bernoulli_ -> x after div_ ...
            name = rename[name]
        return name

    out = []
    for n in nodes:
        n = rename_uses(n, resolve)
        target = n.args[0].name if n.args and isinstance(n.args[0], Ref) else None
        functional = functional_variant(n.op) if target and not n.outputs[1:] else None
        if functional and target not in inputs and target not in viewed:
            fresh = f"{n.outputs[0]}_f" if n.outputs else f"{target}_f{len(out)}"
            if n.outputs:
                rename[n.outputs[0]] = fresh  # the in-place op's own result aliases its input
            rename[target] = fresh
            n = replace(n, op=functional, outputs=[fresh], types=n.types or [_type_of(out, target)])
        out.append(n)
    return out, {old: resolve(old) for old in rename}


def _type_of(nodes: list[Node], name: str):
    for n in reversed(nodes):
        if name in n.outputs:
            return n.types[n.outputs.index(name)]
    raise KeyError(name)


def _aliased_values(nodes: list[Node]) -> set[str]:
    """Values that are views, or have views: mutating them in place is observable elsewhere."""
    out = set()
    for n in nodes:
        if returns_alias(n.op):
            out.update(n.outputs)
            out.update(a.name for a in n.args[:1] if isinstance(a, Ref))
    return out
