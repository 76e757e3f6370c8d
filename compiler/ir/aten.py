"""What the compiler asks of an operator, answered from its torch schema and tags.

``sbpc.*`` ops have no torch schema: they are pure, deterministic and alias nothing, but for
``sbpc.random_shard`` (a device's shard of a random draw), which draws as its op does.
"""
from __future__ import annotations

from functools import lru_cache

import torch

from sbpc.compiler.ir.types import Graph, InputKind, Role
from sbpc.runtime.backend import OVERWRITTEN_LISTS, torch_op
from sbpc.runtime.rng import RANDOM_SHARD

# a backward's gradient accumulation (two contributions to one gradient summed) and the
# in-place form the inplace pass gives it where the first contribution dies there
ACCUMULATE = "aten.add.Tensor"
ACCUMULATE_IN_PLACE = "aten.add_.Tensor"


@lru_cache(maxsize=None)
def is_mutating(op: str) -> bool:
    overload = torch_op(op)
    return overload is not None and overload._schema.is_mutable


@lru_cache(maxsize=None)
def is_random(op: str) -> bool:
    """Draws from the RNG: two calls are two draws, and dropping one shifts the stream."""
    if op == RANDOM_SHARD:
        return True
    overload = torch_op(op)
    return overload is not None and torch.Tag.nondeterministic_seeded in overload.tags


@lru_cache(maxsize=None)
def returns_alias(op: str) -> bool:
    """A view op: its result shares storage with its first input."""
    overload = torch_op(op)
    if overload is None or overload._schema.is_mutable:
        return False
    return any(r.alias_info is not None for r in overload._schema.returns)


# ops whose result shares its first input's storage although their schema says nothing (aot emits them)
_VIEWS_TOO = frozenset({"aten._unsafe_view.default"})


def shares_storage(op: str) -> bool:
    """The result lives in its first input's storage: a schema view, or one aot emits without the annotation."""
    return op in _VIEWS_TOO or returns_alias(op)


@lru_cache(maxsize=None)
def functional_variant(op: str) -> str | None:
    """``aten.bernoulli_.float`` -> ``aten.bernoulli.p``: the out-of-place overload taking the same arguments."""
    overload = torch_op(op)
    if overload is None or not overload._schema.is_mutable:
        return None
    ns, packet, _ = op.split(".")
    if not packet.endswith("_") or packet.startswith("_"):
        return None
    return _pure_overload(ns, packet[:-1], overload, skip=())


@lru_cache(maxsize=None)
def out_functional(op: str) -> str | None:
    """``aten.div.out`` -> ``aten.div.Tensor``: the out-of-place overload taking the same
    arguments but the one ``out=`` tensor it writes (``F.normalize(..., out=buf)`` in spectral
    normalization's power iteration). None for ops that write anything else."""
    overload = torch_op(op)
    if overload is None:
        return None
    written = [a for a in overload._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if [(a.name, a.kwarg_only) for a in written] != [("out", True)]:
        return None
    ns, packet, _ = op.split(".")
    return _pure_overload(ns, packet, overload, skip=("out",))


def defaults_for(op: str, variant: str, args: tuple) -> tuple:
    """``args`` of ``op`` for its ``variant`` (``functional_variant``): the
    positional arguments ``variant`` requires but ``op`` defaulted, and a trace therefore left
    out, written out. ``x.bernoulli_(0.5)`` traces as ``bernoulli_.float(x)``, whose ``p=0.5``
    default ``bernoulli.p`` lacks (F.dropout(p=0.5) draws its mask so)."""
    given = torch_op(op)._schema.arguments
    wanted = [a for a in torch_op(variant)._schema.arguments if not a.kwarg_only]
    missing = wanted[len(args):]
    if not missing or all(a.has_default_value() for a in missing):
        return args
    defaults = {a.name: a.default_value for a in given if a.has_default_value()}
    return (*args, *(defaults[a.name] for a in missing))


def _pure_overload(ns: str, packet: str, overload, skip: tuple[str, ...]) -> str | None:
    """The overload of ``ns.packet`` that mutates nothing and takes ``overload``'s arguments
    (those named in ``skip`` left out), as ``"ns.packet.name"``; None if there is none."""
    ops = getattr(getattr(torch.ops, ns), packet, None)
    if ops is None:
        return None
    signature = lambda schema: [(a.name, str(a.type)) for a in schema.arguments if a.name not in skip]
    args = signature(overload._schema)
    for name in ops.overloads():
        candidate = getattr(ops, name)
        if not candidate._schema.is_mutable and signature(candidate._schema) == args:
            return f"{ns}.{packet}.{name}"
    return None


def overwritten(n) -> list[str]:
    """The values an in-place op of the step writes over (the ``inplace`` pass makes them): its
    first argument, for a ``_foreach_*_`` op the first list, for torch's fused AdamW (the
    ``fuse-adamw`` pass) the parameter, exp_avg and exp_avg_sq lists. Its results are those
    storages, in that order."""
    if not is_mutating(n.op) or not n.args:
        return []
    refs = []
    for k in OVERWRITTEN_LISTS.get(n.op, (0,)):
        a = n.args[k] if k < len(n.args) else None
        refs += a if isinstance(a, list) else [a]
    return [r.name for r in refs] if refs and all(hasattr(r, "name") for r in refs) else []


def hyper_only(graph: Graph) -> list[bool]:
    """Per op: an optimizer op computed from hyperparameters and constants alone (the step's
    bias corrections, SGD's -lr), pure and not random. Its value is the same on every rank and
    chunk, so a pipeline computes it on each chunk that reads it (``per_chunk_hyper_ops``)."""
    hyper = {i.value for i in graph.inputs_of(InputKind.HYPER)}
    producer = graph.producers()
    pure = [False] * len(graph.nodes)
    for k, n in enumerate(graph.nodes):
        pure[k] = (n.role == Role.OPTIMIZER and bool(n.outputs) and not is_random(n.op) and not is_mutating(n.op)
                   and all(u in hyper or (u in producer and pure[producer[u]]) for u in n.uses()))
    return pure
