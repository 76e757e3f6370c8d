"""Prove the rule book on torch's OpInfo database (the samples torch tests itself with).

For each OpInfo of ``op_db`` (cpu, float32), every sample runs once forward and, where the op
has a gradient, once backward, under a dispatch mode that records each ATen call with its
real arguments and results. Each call with a non-trivial rule becomes an ``Instance`` (one
IR node on real values) and every signature the rule book offers for it is checked by
execution on simulated axes (``validate.check``). Used by tests/test_opdb.py and
bench/opdb_coverage.py.
"""
from __future__ import annotations

import hashlib
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sbpc.compiler.frontend.fx_import import UnsupportedArg, convert_literal
from sbpc.compiler.ir.types import DTYPE_BY_TORCH_NAME, Node, Ref, Role, TensorType
from sbpc.compiler.sbp.rules.book import RuleBook
from sbpc.compiler.sbp.rules.validate import Instance, Outcome, check
from sbpc.runtime.backend import torch_op

SIZES = (2, 3)  # odd sizes catch uneven-split mistakes


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls: list[tuple[Any, tuple, dict, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        snap = lambda a: a.detach().clone() if isinstance(a, torch.Tensor) else a  # later ops may mutate
        before = (torch.utils._pytree.tree_map(snap, args), torch.utils._pytree.tree_map(snap, kwargs))
        out = func(*args, **kwargs)
        self.calls.append((func, *before, torch.utils._pytree.tree_map(snap, out)))
        return out


def _ttype(t: torch.Tensor) -> TensorType:
    name = str(t.dtype).removeprefix("torch.")
    if name not in DTYPE_BY_TORCH_NAME or t.layout != torch.strided or t.is_quantized or t.is_complex():
        raise UnsupportedArg(f"a {t.dtype} {t.layout} tensor")
    return TensorType(tuple(t.shape), DTYPE_BY_TORCH_NAME[name])


def to_instance(func, args: tuple, kwargs: dict, out: Any, origin: str) -> Instance | None:
    """The recorded call as an IR node on its real values, or None when the IR cannot hold it."""
    if func.namespace != "aten" or func._schema.is_mutable:
        return None
    values: list[torch.Tensor] = []

    def conv(a):
        if isinstance(a, torch.Tensor):
            _ttype(a)
            values.append(a)
            return Ref(f"x{len(values) - 1}")
        if isinstance(a, (list, tuple)):
            return [conv(x) for x in a]
        return convert_literal(a)

    try:
        node_args = tuple(conv(a) for a in args)
        node_kwargs = {k: conv(v) for k, v in kwargs.items()}
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        if not all(o is None or isinstance(o, torch.Tensor) for o in outs):
            return None
        types = [TensorType((), "none") if o is None else _ttype(o) for o in outs]
    except UnsupportedArg:  # complex or sparse tensors, generators, symbolic values
        return None
    op = f"aten.{func._schema.name.split('::')[1]}.{func._overloadname}"
    node = Node([f"out{i}" for i in range(len(outs))], op, node_args, node_kwargs, types, Role.FORWARD)
    return Instance(node, [_ttype(v) for v in values], values, outs, origin)


def trace_sample(opinfo, sample, origin: str) -> list[Instance]:
    """The ATen calls of one sample, forward and (where it has a gradient) backward."""
    return trace(opinfo.op, (sample.input, *sample.args), sample.kwargs, origin)


def trace(fn, args: tuple, kwargs: dict, origin: str) -> list[Instance]:
    """The ATen calls of ``fn(*args, **kwargs)``, forward and, for the inputs that require a
    gradient, backward."""
    rec = _Recorder()
    with rec:
        out = fn(*args, **kwargs)
        leaves = [t for t in torch.utils._pytree.tree_leaves(out)
                  if isinstance(t, torch.Tensor) and t.requires_grad and t.dtype.is_floating_point]
        wrt = [t for t in torch.utils._pytree.tree_leaves([args, kwargs])
               if isinstance(t, torch.Tensor) and t.requires_grad]
        if leaves and wrt:
            g = torch.Generator().manual_seed(0)
            grads = [torch.randn(t.shape, generator=g, dtype=t.dtype) for t in leaves]
            torch.autograd.grad(leaves, wrt, grads, allow_unused=True)
    insts = []
    for i, call in enumerate(rec.calls):
        inst = to_instance(*call, origin=f"{origin} call {i}")
        if inst is not None:
            insts.append(inst)
    return insts


def opinfos(select: str = "all") -> list:
    """The OpInfos of ``op_db`` that run on cpu in float32. ``select="ci"``: a fixed, deterministic
    fifth of them (by a hash of the name), the subset the default CI test sweeps."""
    from torch.testing._internal.common_methods_invocations import op_db

    out = []
    for o in op_db:
        if torch.float32 not in o.supported_dtypes("cpu"):
            continue
        if select == "ci" and hashlib.sha1(f"{o.name}.{o.variant_test_name}".encode()).digest()[0] % 5:
            continue
        out.append(o)
    return out


def nontrivial(book: RuleBook, op: str) -> bool:
    rule = book.rule(op)
    return rule is not None and rule.family != "broadcast_only"


@dataclass
class Sweep:
    outcomes: list[Outcome] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # signature enumeration that raised
    seen: set = field(default_factory=set)  # ATen overloads the samples called
    samples: int = 0

    @property
    def failures(self) -> list[str]:
        return self.errors + [str(o) for o in self.outcomes if o.error]

    def validated(self) -> set[str]:
        """Overloads with a non-B signature checked on some sample, and no failure anywhere."""
        bad = {o.instance.node.op for o in self.outcomes if o.error} | {e.split(" ", 1)[0] for e in self.errors}
        nonb = {o.instance.node.op for o in self.outcomes
                if any(repr(s) != "B" for s in (*o.signature.ins, *o.signature.outs))}
        return nonb - bad


def sweep(book: RuleBook, infos: Iterable, max_samples: int | None = None, sizes=SIZES) -> Sweep:
    result = Sweep()
    keys: set = set()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny kernels
    warnings.simplefilter("ignore")  # deprecation notices of the ops under test
    try:
        for o in infos:
            name = o.name + (f".{o.variant_test_name}" if o.variant_test_name else "")
            try:
                samples = list(o.sample_inputs("cpu", torch.float32, requires_grad=o.supports_autograd))
            except Exception:  # noqa: BLE001 - a sample generator torch itself skips on this build
                continue
            for j, sample in enumerate(samples[:max_samples]):
                try:
                    insts = trace_sample(o, sample, f"{name} sample {j}")
                except Exception:  # noqa: BLE001 - the sample fails in eager torch too: nothing to prove
                    continue
                result.samples += 1
                for inst in insts:
                    result.seen.add(inst.node.op)
                    if not nontrivial(book, inst.node.op):
                        continue
                    key = (inst.node.op, tuple(inst.in_types), tuple(inst.node.types), repr(_literals(inst.node)))
                    if key in keys:
                        continue
                    keys.add(key)
                    _check_instance(book, inst, sizes, result)
    finally:
        torch.set_num_threads(threads)
    return result


def _literals(n: Node) -> Any:
    return [a for a in (*n.args, *n.kwargs.items()) if not isinstance(a, Ref)]


def _check_instance(book: RuleBook, inst: Instance, sizes, result: Sweep) -> None:
    for k in sizes:
        try:
            sigs = book.signatures(inst.node, inst.in_types, k)
        except Exception as err:  # noqa: BLE001 - a family that cannot read this instance is a bug
            result.errors.append(f"{inst.node.op} ({inst.origin}) k={k}: signatures raised "
                                 f"{type(err).__name__}: {err}")
            continue
        for j, sig in enumerate(sigs):
            try:
                err = check(book, inst, sig, k, seed=j)
            except Exception as e:  # noqa: BLE001 - the outputs could not even be put together
                err = f"{type(e).__name__}: {e}"
            result.outcomes.append(Outcome(inst, k, sig, err))


def dtensor_overloads() -> set[str]:
    """The ATen overloads DTensor registers a sharding strategy or rule for, in this torch."""
    from torch.distributed.tensor import DTensor
    import torch.distributed.tensor._ops  # noqa: F401 - registers the strategies

    prop = DTensor._op_dispatcher.sharding_propagator
    ops: set = set()
    for table in ("op_strategy_funcs", "op_single_dim_strategy_funcs", "op_to_rules"):
        ops |= set(getattr(prop, table, {}))
    return {f"aten.{o._schema.name.split('::')[1]}.{o._overloadname}" for o in ops
            if getattr(o, "namespace", None) == "aten"}


@dataclass
class Coverage:
    hand: int  # ATen overloads with a non-trivial hand-written rule
    derived: int  # ... with a non-trivial rule derived from torch's metadata
    seen: int  # ... with a non-trivial rule that the op_db samples called
    validated: int  # ... of those, checked with a non-B signature and never wrong
    dtensor: int  # ATen overloads DTensor registers a strategy for
    dtensor_functional: int  # ... of those, the functional ones (no in-place or out= form), the IR's kind

    @property
    def total(self) -> int:
        return self.hand + self.derived

    def table(self) -> str:
        rows = [("ATen overloads with a non-trivial rule", self.total),
                ("  hand-written (ir_specs/aten.sbp)", self.hand),
                ("  derived from torch metadata", self.derived),
                ("  called by the op_db samples", self.seen),
                ("  validated by the sweep (every signature, k=2 and 3)", self.validated),
                ("DTensor: overloads with a registered strategy", self.dtensor),
                ("  functional (not in-place, not out=), the kind the IR holds", self.dtensor_functional)]
        return "\n".join(f"{name:<62} {n:>6}" for name, n in rows)


def coverage(book: RuleBook, result: Sweep) -> Coverage:
    hand = [op for op in book.ops() if op.startswith("aten.") and nontrivial(book, op)]
    derived = [op for op in book.derived_ops() if nontrivial(book, op)]
    seen = {op for op in result.seen if nontrivial(book, op)}
    dt = dtensor_overloads()
    functional = [op for op in dt if (k := torch_op(op)) is not None and not k._schema.is_mutable]
    return Coverage(len(hand), len(derived), len(seen), len(result.validated() & seen), len(dt), len(functional))
