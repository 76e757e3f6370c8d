"""Which layers may be traced once and stamped out (``stamp.py``).

``find_repeated`` picks the longest ``ModuleList`` / ``Sequential`` of at least ``MIN_LAYERS``
modules that are copies of one another: the same classes (or classes made by one factory:
same name, method code and closures), parameters and buffers, no tensor attributes, no hooks of
their own, the same ``[modules]`` hints for every copy. The plain attributes in which copies
differ (``layer_idx``) are returned too: ``stamp.py`` stamps only if layer 1's forward never
reads them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from sbpc.compiler.frontend.hints import ParallelConfig

MIN_LAYERS = 4  # fewer copies trace whole: stamping saves little there


@dataclass
class Repeated:
    """The repeated layers: ``path`` is the list's module path (``h``, ``model.layers``)."""
    path: str
    layers: list[nn.Module]
    # plain attributes (submodule path, name) that differ between copies (``layer_idx``): a
    # copy is stamped only if layer 1's forward never reads them (``_Watch``)
    differ: frozenset[tuple[str, str]] = frozenset()

    def param_names(self, k: int) -> list[str]:
        """Parameters then buffers of layer ``k``, as the trace's state names them."""
        layer = self.layers[k]
        return [f"{self.path}.{k}.{n}" for n, _ in layer.named_parameters()] + \
               [f"{self.path}.{k}.{n}" for n, _ in layer.named_buffers()]


def find_repeated(model: nn.Module, config: ParallelConfig, min_layers: int = MIN_LAYERS) -> Repeated | None:
    """The longest list of at least ``min_layers`` modules that are copies of one another (see
    the module docstring), or None."""
    best = None
    for path, m in model.named_modules():
        if not isinstance(m, (nn.ModuleList, nn.Sequential)) or len(m) < max(min_layers, 3):
            continue
        layers = list(m)
        if best is not None and len(layers) <= len(best.layers):
            continue
        diffs = [_differences(layers[1], x) for x in layers[:1] + layers[2:]]
        if all(d is not None for d in diffs) and _hinted_alike(path, layers, config):
            best = Repeated(path, layers, frozenset().union(*diffs))
    return best


_MODULE_FIELDS = frozenset(vars(nn.Module()))
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
          "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def _differences(a: nn.Module, b: nn.Module) -> set[tuple[str, str]] | None:
    """The plain attributes (submodule path, name) in which copy ``b`` differs from ``a``, or
    None when ``b`` is not a copy at all (other classes, parameters, buffers, hooks, a tensor
    attribute)."""
    mods_a, mods_b = list(a.named_modules()), list(b.named_modules())
    if [n for n, _ in mods_a] != [n for n, _ in mods_b] or \
            not all(_same_class(type(x), type(y)) for (_, x), (_, y) in zip(mods_a, mods_b)):
        return None
    out = set()
    for (path, x), (_, y) in zip(mods_a, mods_b):
        if any(getattr(x, h, None) or getattr(y, h, None) for h in _HOOKS):
            return None
        mine = {k: v for k, v in vars(x).items() if k not in _MODULE_FIELDS}
        theirs = {k: v for k, v in vars(y).items() if k not in _MODULE_FIELDS}
        if mine.keys() != theirs.keys() or any(isinstance(v, torch.Tensor) for v in mine.values()):
            return None
        if _tensor_metas(x) != _tensor_metas(y):
            return None
        out.update((path, k) for k in mine if not same(mine[k], theirs[k]))
    return out


def _same_class(a: type, b: type) -> bool:
    """One class, or two made by one factory (a class defined in a function, once per layer):
    the same name, module and code of every method."""
    if a is b:
        return True
    if (a.__qualname__, a.__module__, a.__bases__) != (b.__qualname__, b.__module__, b.__bases__) or \
            vars(a).keys() != vars(b).keys():
        return False
    return all(_same_function(vars(a)[k], vars(b)[k]) if callable(vars(a)[k]) else same(vars(a)[k], vars(b)[k], 1)
               for k in vars(a) if k not in ("__dict__", "__weakref__", "__doc__"))


def _same_function(f, g) -> bool:
    """The same function, or one made twice from one definition with equal defaults and
    closures (the factory's arguments)."""
    if f is g:
        return True
    if getattr(f, "__code__", None) is None or getattr(f, "__code__", None) is not getattr(g, "__code__", None):
        return False
    cells = lambda h: [c.cell_contents for c in h.__closure__ or ()]
    return same(f.__defaults__, g.__defaults__, 1) and same(cells(f), cells(g), 2)


def _tensor_metas(m: nn.Module) -> list:
    return [(n, tuple(t.shape), t.dtype, t.requires_grad) for n, t in m.named_parameters(recurse=False)] + \
           [(n, tuple(t.shape), t.dtype) for n, t in m.named_buffers(recurse=False)]


def _hinted_alike(path: str, layers: list[nn.Module], config: ParallelConfig) -> bool:
    """Every copy's submodules get the hints (``[modules]`` globs) layer 1's get."""
    for sub, _ in layers[1].named_modules():
        suffix = f".{sub}" if sub else ""
        want = config.module_hint(f"{path}.1{suffix}")
        if any(config.module_hint(f"{path}.{k}{suffix}") != want for k in range(len(layers))):
            return False
    return True


def same(a, b, depth: int = 3) -> bool:
    """Equal, or (objects compared by identity, such as a per-layer helper object or a dict of
    them) of one type with equal attributes, to a small depth."""
    try:
        if a is b or bool(a == b):
            return True
    except Exception:  # a leaf whose == is not a truth value (a tensor-like): not alike
        return False
    if isinstance(a, nn.Module) and isinstance(b, nn.Module):  # a module kept outside the tree
        return depth > 0 and _differences(a, b) == set()
    if depth == 0 or type(a) is not type(b) or isinstance(a, torch.Tensor):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k], depth - 1) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y, depth - 1) for x, y in zip(a, b))
    if type(a).__eq__ is object.__eq__ and hasattr(a, "__dict__"):
        return same(vars(a), vars(b), depth - 1)
    return False
