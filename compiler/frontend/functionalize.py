"""Rewrite in-place ops on private temporaries, and on views of them, into out-of-place ops.

Eager kernels and model code often build a fresh tensor and fill it in place: CPU dropout is
``empty_like`` + ``bernoulli_`` + ``div_``; T5's ``_shift_right`` is ``new_zeros``, then
``shifted[..., 1:] = ids[..., :-1]`` (a ``copy_`` into a slice view), ``shifted[..., 0] = start``
and ``masked_fill_``. A tensor nobody outside the graph can observe (a *base*: not a graph
input, nor a view of one) is a sequence of values, one per write:

* ``x.op_(...)`` on the base is ``x2 = op(x, ...)``, and later reads of ``x`` read ``x2``;
* ``v.op_(...)`` on a view ``v`` of the base (a chain of view ops from it) is ``v2 = op(v, ...)``
  scattered back up the chain (``slice_scatter``, ``select_scatter``, a reshape ...) into the
  base's next value;
* a view read after its base changed is made again from the base's current value (its view
  ops replayed), as eager's view would show the new data.

A write through a view whose op has no inverse here, and any write to a graph input (or a view
of one), stays in place; capture and the verifier then refuse it with the user's line.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from sbpc.compiler.ir.aten import defaults_for, functional_variant, returns_alias, shares_storage
from sbpc.compiler.ir.types import FreshNames, Node, Ref, Role, TensorType, rename_uses

# A chain: the names of the view results from a base to an alias (the base itself: empty)
Chain = tuple[str, ...]
# view ops whose inverse is a reshape back to the parent's shape (the same elements, in order)
_RESHAPES = frozenset({"aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.alias.default",
                       "aten.detach.default", "aten.unsqueeze.default", "aten.squeeze.dim", "aten.squeeze.dims",
                       "aten.squeeze.default"})
_TRANSPOSES = frozenset({"aten.t.default", "aten.transpose.int"})
# the view ops `_inverse` can put a written result back through
_INVERTIBLE = _RESHAPES | _TRANSPOSES | frozenset({
    "aten.slice.Tensor", "aten.select.int", "aten.unbind.int", "aten.split.Tensor", "aten.split_with_sizes.default",
    "aten.permute.default"})


def functionalize(nodes: list[Node], inputs: set[str], outputs: frozenset[str] = frozenset()
                  ) -> tuple[list[Node], dict[str, str]]:
    """The rewritten nodes, and the renaming that the graph's ``outputs`` must follow (a value
    overwritten later maps to its last version)."""
    f = _Functionalizer(inputs, FreshNames({o for n in nodes for o in n.outputs} | set(inputs)))
    for n in nodes:
        f.visit(n)
    return f.out, {o: f.read(o) for o in outputs | f.written if f.read(o) != o}


@dataclass
class _Functionalizer:
    inputs: set[str]
    fresh: FreshNames  # new value names, clear of every name in use
    out: list[Node] = field(default_factory=list)
    types: dict[str, TensorType] = field(default_factory=dict)
    alias: dict[str, tuple[str, Chain]] = field(default_factory=dict)  # view result -> (base, chain)
    view_of: dict[str, tuple[Node, int]] = field(default_factory=dict)  # view result -> (its op, result index)
    version: dict[str, int] = field(default_factory=dict)  # base -> writes so far
    made: dict[tuple[str, int, Chain], str] = field(default_factory=dict)  # (base, version, chain) -> value
    written: set[str] = field(default_factory=set)  # the bases and views written
    role: Role = Role.FORWARD  # of the op being visited: a view made again for it runs where it does

    def read(self, name: str) -> str:
        """The value that stands for ``name`` now (a view made again if its base changed)."""
        base, chain = self.alias.get(name, (name, ()))
        if not self.version.get(base):
            return name
        return self._materialize(base, chain)

    def visit(self, n: Node) -> None:
        target = n.args[0].name if n.args and isinstance(n.args[0], Ref) else None
        self.role = n.role
        if any(self.read(u) != u for u in n.uses()):  # most ops read nothing written: no copy of them
            n = rename_uses(n, self.read)
        self.types.update(zip(n.outputs, n.types))
        functional = functional_variant(n.op) if target and not n.outputs[1:] else None
        if functional and self._write(n, target, functional):
            return
        if target is not None and (shares_storage(n.op) or (n.outputs[1:] and returns_alias(n.op))):
            base, chain = self.alias.get(target, (target, ()))
            for k, o in enumerate(n.outputs):
                self.alias[o] = (base, chain + (o,))
                self.view_of[o] = (n, k)
                self.made[(base, self.version.get(base, 0), chain + (o,))] = o
        self.out.append(n)

    def _write(self, n: Node, target: str, functional: str) -> bool:
        """``n`` writes ``target`` in place: emit it out of place and scatter the result into the
        base's next value. False (nothing emitted) where that cannot be done."""
        base, chain = self.alias.get(target, (target, ()))
        if base in self.inputs or any(self.view_of[v][0].op not in _INVERTIBLE for v in chain):
            return False
        fresh = self.fresh(f"{n.outputs[0]}_f" if n.outputs else f"{target}_f{len(self.out)}")
        ttype = n.types[0] if n.types else self.types[target]
        self.out.append(replace(n, op=functional, args=defaults_for(n.op, functional, n.args), outputs=[fresh], types=[ttype]))
        self.types[fresh] = ttype
        value = fresh
        for k in range(len(chain) - 1, -1, -1):  # up the chain: each parent gets the new part
            parent = self._materialize(base, chain[:k])
            view, index = self.view_of[chain[k]]
            value = self._emit(f"{chain[k]}_scatter", *_inverse(view, index, Ref(parent), Ref(value),
                                                                 self.types[parent]), self.types[parent], n)
        version = self.version.get(base, 0) + 1
        self.version[base] = version
        self.made[(base, version, ())] = value
        self.made[(base, version, chain)] = fresh
        self.written.update((base, target))
        for o in n.outputs:  # the in-place op's own result is the written tensor
            self.alias[o] = (base, chain)
        return True

    def _materialize(self, base: str, chain: Chain) -> str:
        key = (base, self.version.get(base, 0), chain)
        if not chain:
            return self.made.get(key, base)  # the base as made, before any write
        if key not in self.made:
            parent = self._materialize(base, chain[:-1])
            view, index = self.view_of[chain[-1]]
            outs = [self.fresh(f"{o}_v{key[1]}") for o in view.outputs]
            self.out.append(replace(view, args=(Ref(parent), *view.args[1:]), outputs=outs, role=self.role))
            self.types.update(zip(outs, view.types))
            self.made[key] = outs[index]
        return self.made[key]

    def _emit(self, name: str, op: str, args: tuple, ttype: TensorType, write: Node) -> str:
        fresh = self.fresh(name)
        self.out.append(Node([fresh], op, args, {}, [ttype], write.role, loc=write.loc))
        self.types[fresh] = ttype
        return fresh

def _inverse(view: Node, index: int, parent: Ref, value: Ref, parent_type: TensorType) -> tuple[str, tuple]:
    """The op and arguments that put ``value`` (result ``index`` of ``view``, written) back into
    ``parent``: the parent's next value."""
    a = view.args
    arg = lambda k, default: a[k] if len(a) > k else default
    if view.op == "aten.slice.Tensor":
        return "aten.slice_scatter.default", (parent, value, arg(1, 0), arg(2, None), arg(3, None), arg(4, 1))
    if view.op == "aten.select.int":
        return "aten.select_scatter.default", (parent, value, a[1], a[2])
    if view.op == "aten.unbind.int":
        return "aten.select_scatter.default", (parent, value, arg(1, 0), index)
    if view.op in ("aten.split.Tensor", "aten.split_with_sizes.default"):
        dim = arg(2, 0) % len(parent_type.shape)
        start = sum(t.shape[dim] for t in view.types[:index])
        return "aten.slice_scatter.default", (parent, value, dim, start, start + view.types[index].shape[dim], 1)
    if view.op in _TRANSPOSES:
        return view.op, (value, *a[1:])  # its own inverse
    if view.op == "aten.permute.default":
        dims = [d % len(parent_type.shape) for d in a[1]]
        return "aten.permute.default", (value, sorted(range(len(dims)), key=dims.__getitem__))
    return "aten.reshape.default", (value, list(parent_type.shape))
