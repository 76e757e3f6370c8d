"""Record how a model builds its parameters and buffers, so the runtime can replay it.

While ``build_model()`` runs under FakeTensorMode, this dispatch mode records every ATen op:
factories (``empty``, ``arange``), in-place fills (``normal_``, ``uniform_``, ``fill_``) and
the math that builds buffers such as causal masks. The runtime replays the recording with a
generator seeded from the run's seed. Replaying with seed ``s`` gives bit for bit the weights
of ``torch.manual_seed(s); build_model()``, because the random ops run in the same order.
"""
from __future__ import annotations

from dataclasses import dataclass
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from sbpc.compiler.frontend.fx_import import MAX_CONSTANT_NUMEL, caller_location, convert_arg, tensor_type
from sbpc.compiler.ir.types import DType, GraphOutput, Node, OutputKind, Ref, Role, SourceLoc
from sbpc.errors import CaptureError
from sbpc.runtime import init_ops


@dataclass
class _Recorded:
    op: str
    args: tuple
    kwargs: dict
    outputs: list[str]
    out_tensors: list[torch.Tensor]
    arg_tensors: list[torch.Tensor]
    mutates: bool
    random: bool
    loc: SourceLoc | None = None
    # the call itself, to evaluate it on real tensors (``_evaluate``); None for a constant
    call: tuple | None = None  # (func, args, kwargs, every result tensor in order)


# what ``x.item()``, ``x.tolist()`` and ``bool(x)`` reach the dispatcher as
_SCALAR_READS = frozenset({torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default})


class InitRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[_Recorded] = []
        self.names: dict[int, str] = {}
        self.keep: list[torch.Tensor] = []  # holds tensors alive so their id() is never reused
        self._ops: dict = {}  # OpOverload -> (name, mutates, random)

    def _name(self, t: torch.Tensor) -> str:
        key = id(t)
        if key not in self.names:
            self.names[key] = f"i{len(self.names)}"
            self.keep.append(t)
        return self.names[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SCALAR_READS:
            value = self._evaluate(args[0])
            if value is not None:
                with unset_fake_temporarily():
                    return value.item()
        out = func(*args, **kwargs)
        flat_in: list[torch.Tensor] = []
        _tensors(args, flat_in)
        _tensors(kwargs, flat_in)
        flat_out: list[torch.Tensor] = []
        _tensors(out, flat_out)
        ins = {id(t) for t in flat_in}
        fresh = [t for t in flat_out if id(t) not in ins]
        for t in flat_in:
            if id(t) not in self.names:
                self._record_constant(t)
        conv = lambda a: Ref(self._name(a)) if isinstance(a, torch.Tensor) else convert_arg(a, None)
        rec_args = tuple(_map(conv, a) for a in args)
        rec_kwargs = {k: _map(conv, v) for k, v in kwargs.items()}
        op = self._ops.get(func)
        if op is None:  # per op, not per call: a 1T model's build records ~7,000 calls of ~20 ops
            random = torch.Tag.nondeterministic_seeded in func.tags
            op = self._ops[func] = (str(_seeded(func) if random else func), func._schema.is_mutable, random)
        name, mutates, random = op
        self.ops.append(_Recorded(name, rec_args, rec_kwargs, [self._name(t) for t in fresh], fresh, flat_in,
                                  mutates, random, caller_location(), (func, args, kwargs, flat_out)))
        return out

    def _evaluate(self, t: torch.Tensor) -> torch.Tensor | None:
        """The real value of fake tensor ``t``, by running the recorded ops it depends on, when
        none of them draws random numbers (then every seed gives the same value) and each is small:
        ``[x.item() for x in torch.linspace(0, rate, depth)]``, the drop-path rates of ConvNeXt,
        Swin and timm models, which fake tensors alone cannot tell. None otherwise."""
        needed = {_storage(t)}
        chain: list[_Recorded] = []
        for rec in reversed(self.ops):
            if _writes(rec) & needed:
                if rec.random or any(o.numel() > MAX_CONSTANT_NUMEL for o in rec.out_tensors):
                    return None
                chain.append(rec)
                needed |= {_storage(a) for a in rec.arg_tensors}
        real: dict[int, torch.Tensor] = {}
        for rec in reversed(chain):
            if rec.call is None:  # a constant: its value is recorded
                real[id(rec.out_tensors[0])] = rec.out_tensors[0].constant.clone()
                continue
            func, args, kwargs, fakes = rec.call
            for a in rec.arg_tensors:
                if id(a) not in real:
                    return None  # a tensor this recording did not see made
            swap = lambda a: real[id(a)] if isinstance(a, torch.Tensor) else a
            with unset_fake_temporarily():
                out = func(*tree_map(swap, args), **tree_map(swap, kwargs))
            values: list[torch.Tensor] = []
            _tensors(out, values)
            real.update((id(f), v) for f, v in zip(fakes, values))
        return real.get(id(t))

    def _record_constant(self, t: torch.Tensor) -> None:
        """A tensor made from Python data (``torch.tensor(0)``): its values travel in the plan."""
        value = getattr(t, "constant", None) if isinstance(t, FakeTensor) else t
        if value is None or value.numel() > MAX_CONSTANT_NUMEL:
            return  # unknown: an op that needs it fails the init region below, naming the op
        ttype = tensor_type(value)
        with unset_fake_temporarily():
            values = value.flatten().tolist()
        self.ops.append(_Recorded("sbpc.constant", (values, list(value.shape)),
                                  {"dtype": DType(ttype.dtype)}, [self._name(t)], [t], [], False, False))

    def to_init_region(self, named: list[tuple[str, torch.Tensor]]) -> tuple[list[Node], list[GraphOutput]]:
        """Nodes that build ``named`` tensors (params and buffers), dead ops removed."""
        by_storage: dict[int, list[tuple[str, torch.Tensor]]] = {}
        for rec in self.ops:
            for value, out in zip(rec.outputs, rec.out_tensors):
                by_storage.setdefault(_storage(out), []).append((value, out))
        outputs = [GraphOutput(OutputKind.INIT, _find(name, t, by_storage), name) for name, t in named]
        needed = {_storage(t) for _, t in named}
        kept: list[_Recorded] = []
        for rec in reversed(self.ops):
            # Random ops stay even when unused: dropping one would shift the RNG stream.
            if _writes(rec) & needed or rec.random:
                kept.append(rec)
                needed |= {_storage(t) for t in rec.arg_tensors}
        kept.reverse()
        defined = {o for rec in kept for o in rec.outputs}
        nodes = []
        for rec in kept:
            for ref in _refs(rec.args, rec.kwargs):
                if ref not in defined:
                    raise CaptureError(f"the init of the model uses a tensor sbpc did not see created ({rec.op})",
                                       hint="create parameters with torch factories and init functions, or load weights with --weights")
            nodes.append(Node(outputs=rec.outputs, op=rec.op, args=rec.args, kwargs=rec.kwargs,
                              types=[tensor_type(t) for t in rec.out_tensors], role=Role.INIT, loc=rec.loc))
        return nodes, outputs


def whole_draws():
    """While ``build_model`` runs: ``torch.nn.init.trunc_normal_`` records as one op
    (``sbpc.trunc_normal_``, ``runtime/init_ops.py``), not as its rejection loop, whose count the
    fake tensors cannot tell. Its module attribute is the one name every caller reaches it through
    (Hugging Face keeps its own reference to the public function, which looks it up)."""
    return mock.patch.object(torch.nn.init, "_no_grad_trunc_normal_", init_ops.trunc_normal_)


def _seeded(func):
    """The overload of random op ``func`` that draws from a given generator (``randn.default`` ->
    ``randn.generator``, ``randint.low`` -> ``randint.low_generator``): the init program draws from
    its own generator, seeded with the run's seed, which the runtime passes to an op that takes
    one; ``torch.randn(16, 64)`` recorded as ``randn.default`` would draw from the process's
    global generator instead, differently on every rank, and leave the seeded stream behind."""
    names = [a.name for a in func._schema.arguments]
    if "generator" in names:
        return func
    packet = func.overloadpacket
    for overload in packet.overloads():
        candidate = getattr(packet, overload)
        args = [a.name for a in candidate._schema.arguments]
        if "generator" in args and [a for a in args if a != "generator"] == names:
            return candidate
    raise CaptureError(f"{func} draws random numbers in build_model from torch's global generator, which the "
                       "plan's init cannot replay", hint="draw with torch.nn.init functions or torch.randn/rand, "
                       "or load the weights with --weights")


def _find(name: str, t: torch.Tensor, by_storage: dict) -> str:
    """The first recorded value that is exactly ``t`` (same storage, shape, strides, offset)."""
    for value, out in by_storage.get(_storage(t), ()):
        if _same_view(out, t):
            return value
    raise CaptureError(f"cannot tell how {name!r} was built: it is a view into a larger tensor",
                       hint="make each parameter its own tensor, or load weights with --weights")


def _writes(rec: _Recorded) -> set[int]:
    """The storages op ``rec`` writes: its results', and its arguments' when it works in place."""
    writes = {_storage(t) for t in rec.out_tensors}
    if rec.mutates:
        writes |= {_storage(t) for t in rec.arg_tensors}
    return writes


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (_storage(a) == _storage(b) and a.shape == b.shape and a.stride() == b.stride()
            and a.storage_offset() == b.storage_offset() and a.dtype == b.dtype)


def _tensors(a, into: list[torch.Tensor]) -> None:
    """The tensors in an op's arguments or results (nested lists, tuples, dicts), in order."""
    if isinstance(a, torch.Tensor):
        into.append(a)
    elif isinstance(a, (list, tuple)):
        for x in a:
            _tensors(x, into)
    elif isinstance(a, dict):
        for x in a.values():
            _tensors(x, into)


def _map(fn, a):
    if isinstance(a, (list, tuple)):
        return [_map(fn, x) for x in a]
    return fn(a)


def _refs(args, kwargs):
    """The value names a recorded op reads. Its arguments nest only in lists (``_map``), so a plain
    walk finds them: pytree's flatten, which builds a tree spec too, took most of
    ``to_init_region``'s time at 1T (~7,000 ops)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, Ref):
            yield a.name
        elif isinstance(a, list):
            yield from _refs(a, {})
