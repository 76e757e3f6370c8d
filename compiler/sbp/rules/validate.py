"""Prove SBP rules by execution.

For an op instance with real input values (recorded by running the single-device program
node by node), every signature the rule book offers on an axis of k devices is checked: the
inputs are cut into k shards as the signature says (``S`` with ``runtime.sharding``, ``B``
copied, ``P`` as random summands, ``P(max)`` as one holder per element and smaller values
elsewhere), the localized node runs on each simulated rank (rank-aware kernels see a
topology with that rank's coordinate), and the outputs put back together with
``runtime.sharding.combine`` must equal the logical outputs.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from sbpc.compiler.ir.types import DTYPES, DType, Node, Ref, Sym, TensorType
from sbpc.compiler.sbp.rules.book import RuleBook, Signature
from sbpc.runtime.backend import make_backend
from sbpc.runtime.sbp import Partial, Split, local_shape
from sbpc.runtime.shard_ops import KERNELS
from sbpc.runtime.sharding import combine, take_chunk
from sbpc.runtime.topology import Topology

AXIS = "tp"
RANDOM_SEED = 1234


@dataclass
class Instance:
    node: Node
    in_types: list[TensorType]  # one per use
    ins: list[torch.Tensor]  # one per use
    outs: list[torch.Tensor | None]  # logical outputs
    origin: str = ""


@dataclass
class Outcome:
    instance: Instance
    k: int
    signature: Signature
    error: str | None = None  # None: the signature holds

    def __str__(self) -> str:
        n = self.instance.node
        where = f"{n.op} ({self.instance.origin} %{n.outputs[0] if n.outputs else '?'}) k={self.k} {self.signature}"
        return where + (f": {self.error}" if self.error else ": ok")


@dataclass
class Report:
    outcomes: list[Outcome] = field(default_factory=list)

    @property
    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.error]

    def coverage(self) -> dict[str, tuple[int, int, int]]:
        """op -> (signatures checked, non-all-B signatures offered, non-all-B signatures that held)."""
        out: dict[str, tuple[int, int, int]] = {}
        for o in self.outcomes:
            op = o.instance.node.op
            nonb = any(repr(s) != "B" for s in (*o.signature.ins, *o.signature.outs))
            n, offered, held = out.get(op, (0, 0, 0))
            out[op] = (n + 1, offered + nonb, held + (nonb and o.error is None))
        return out


# ------------------------------------------------------------------ running nodes

def _arg(a: Any, env: dict[str, Any]) -> Any:
    if isinstance(a, Ref):
        return env[a.name]
    if isinstance(a, DType):
        return getattr(torch, DTYPES[a.name])
    if isinstance(a, Sym):
        return torch.device("cpu") if a.name == "device" else getattr(torch, a.name)
    if isinstance(a, (list, tuple)):
        return type(a)(_arg(x, env) for x in a)
    return a


@functools.lru_cache(maxsize=None)
def _cpu():
    return make_backend("cpu")


def _kernel(op: str, topology: Topology | None):
    if op in KERNELS:
        return functools.partial(KERNELS[op], SimpleNamespace(topology=topology or Topology(((AXIS, 1),))))
    return _cpu().kernel(op)


def is_random(op: str) -> bool:
    from sbpc.compiler.ir.aten import is_random as random_op
    return random_op(op)


def run_node(n: Node, env: dict[str, Any], topology: Topology | None = None) -> None:
    """Run one node on ``env`` (value name -> tensor), storing its outputs there."""
    if is_random(n.op):
        torch.manual_seed(RANDOM_SEED)
    out = _kernel(n.op, topology)(*_arg(n.args, env), **{k: _arg(v, env) for k, v in n.kwargs.items()})
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    for name, v in zip(n.outputs, outs):
        env[name] = v


def record(nodes: list[Node], inputs: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Every value of a single-device program, by running it node by node, each as it was
    made: a later in-place op (the optimizer's, ``passes/inplace.py``) overwrites the storage,
    not the record of what the earlier readers read."""
    env = dict(inputs)
    made = {v: _snapshot(x) for v, x in inputs.items()}
    for n in nodes:
        run_node(n, env)
        made.update((o, _snapshot(env.get(o))) for o in n.outputs)
    return made


def _snapshot(x):
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, (list, tuple)):
        return type(x)(_snapshot(y) for y in x)
    return x


def instances(nodes: list[Node], types: dict[str, TensorType], env: dict[str, Any], origin: str,
              book: RuleBook | None = None, sizes=(2, 4), seen: set | None = None) -> list[Instance]:
    """One instance per distinct op use of a recorded program: by (op, input types, literal
    arguments), or with ``book`` by (op, dtypes, ranks, signatures on axes of ``sizes``), so
    instances differing only in sizes that admit the same signatures are checked once."""
    out, seen = [], set() if seen is None else seen
    for n in nodes:
        uses = list(n.uses())
        if book is not None:
            ins = [types[u] for u in uses]
            shape = tuple((t.dtype, len(t.shape)) for t in [*ins, *n.types])
            key = (n.op, shape, tuple(tuple(map(str, book.signatures(n, ins, k))) for k in sizes))
        else:
            key = (n.op, tuple(str(types[u]) for u in uses), repr(_strip(n.args)), repr(_strip(n.kwargs)))
        if key in seen:
            continue
        seen.add(key)
        out.append(Instance(n, [types[u] for u in uses], [env[u] for u in uses], [env.get(o) for o in n.outputs], origin))
    return out


def _strip(a: Any) -> Any:
    if isinstance(a, Ref):
        return "%"
    if isinstance(a, dict):
        return {k: _strip(v) for k, v in a.items()}
    if isinstance(a, (list, tuple)):
        return [_strip(x) for x in a]
    return a


# ------------------------------------------------------------------ sharding inputs

def _summands(v: torch.Tensor, k: int, g: torch.Generator) -> list[torch.Tensor]:
    if v.dtype.is_floating_point:
        finite = v[v.isfinite()]
        scale = min(float(finite.abs().mean()) if finite.numel() else 1.0, 1e4) + 1e-3
        parts = [torch.randn(v.shape, generator=g, dtype=v.dtype) * scale * v.isfinite() for _ in range(k - 1)]
    else:
        parts = [torch.randint(-5, 5, v.shape, generator=g).to(v.dtype) for _ in range(k - 1)]
    last = v - sum(parts) if parts else v
    return [*parts, last]


def _maxima(v: torch.Tensor, k: int, g: torch.Generator) -> list[torch.Tensor]:
    holder = torch.randint(0, k, v.shape, generator=g)
    out = []
    for r in range(k):
        if v.dtype.is_floating_point:
            u = torch.rand(v.shape, generator=g, dtype=v.dtype) * 0.8 + 0.1
            smaller = v * u if bool((v > 0).all()) else v - u * (v.abs().nan_to_num(0, 0, 0) + 1)
        else:
            smaller = v - torch.randint(1, 5, v.shape, generator=g).to(v.dtype)
        out.append(torch.where(holder == r, v, smaller))
    return out


def shard(v: torch.Tensor, sbp, k: int, g: torch.Generator) -> list[torch.Tensor]:
    if isinstance(sbp, Split):
        return [take_chunk(v, sbp, r, k).contiguous() for r in range(k)]
    if isinstance(sbp, Partial):
        return _summands(v, k, g) if sbp.reduce == "sum" else _maxima(v, k, g)
    return [v] * k


# ------------------------------------------------------------------ checking

def deviation(a: torch.Tensor, b: torch.Tensor, scale: float = 0.0) -> float:
    """max|a - b| over the largest magnitude of b (or ``scale``, whichever is larger: the
    magnitude the partial values or the inputs had, since reassociation error grows with it)."""
    if a.shape != b.shape:
        return float("inf")
    if not b.dtype.is_floating_point:
        return 0.0 if torch.equal(a, b) else float("inf")
    a, b = a.double(), b.double()
    same = (a == b) | (a.isnan() & b.isnan())
    diff = torch.where(same, torch.zeros_like(a), (a - b).abs()).nan_to_num(float("inf"))
    finite = b[b.isfinite()]
    denom = max(float(finite.abs().max()) if finite.numel() else 0.0, scale, 1e-12)
    return float(diff.max()) / denom if diff.numel() else 0.0


def _rename_uses(n: Node) -> tuple[Node, list[str]]:
    names: list[str] = []

    def walk(a):
        if isinstance(a, Ref):
            names.append(f"__in{len(names)}")
            return Ref(names[-1])
        if isinstance(a, (list, tuple)):
            return type(a)(walk(x) for x in a)
        return a

    args = walk(n.args)
    kwargs = {k: walk(v) for k, v in n.kwargs.items()}
    return Node(list(n.outputs), n.op, args, kwargs, list(n.types), n.role, n.loc, n.stage, n.sbp), names


def check(book: RuleBook, inst: Instance, sig: Signature, k: int, seed: int = 0, tol: float = 1e-5) -> str | None:
    """None when ``sig`` of ``inst`` computes the logical outputs on k simulated ranks, else why not.

    A deviation in float32 or lower may be rounding alone (partial sums of a result that
    cancels to about zero, partial values in bfloat16): such an instance is checked again in
    float64, where rounding is a billion times smaller and a wrong rule still deviates."""
    err = _check(book, inst, sig, k, seed, tol)
    if err is None or "deviates" not in err:
        return err
    wide = _in_float64(inst)
    return err if wide is None or _check(book, wide, sig, k, seed, tol) is not None else None


def _in_float64(inst: Instance) -> Instance | None:
    """``inst`` with its float inputs in float64 and its logical outputs recomputed from them."""
    low = [v.is_floating_point() and v.dtype != torch.float64 for v in inst.ins]
    if not any(low):
        return None
    ins = [v.double() if lo else v for v, lo in zip(inst.ins, low)]
    node, names = _rename_uses(inst.node)
    env = dict(zip(names, _snapshot(ins)))  # an in-place op overwrites its copy, not the instance
    try:
        run_node(node, env)
    except Exception:  # noqa: BLE001 - the op has no float64 kernel: the float32 verdict stands
        return None
    return Instance(inst.node, inst.in_types, ins, [env.get(o) for o in node.outputs], inst.origin)


def _check(book: RuleBook, inst: Instance, sig: Signature, k: int, seed: int, tol: float) -> str | None:
    g = torch.Generator().manual_seed(seed)
    node, names = _rename_uses(inst.node)
    shards = [shard(v, s, k, g) for v, s in zip(inst.ins, sig.ins)]
    try:
        local = book.localize(node, [(s,) for s in sig.ins], [(s,) for s in sig.outs], (k,), (AXIS,))
    except Exception as err:  # noqa: BLE001 - reported as a failed signature
        return f"localize failed: {type(err).__name__}: {err}"
    wants = inst.outs
    if is_random(node.op):
        # the logical draw at the stream position every simulated rank starts from (a recorded
        # output came from another position); each rank must then hold its shard of that draw
        env = dict(zip(names, _snapshot(inst.ins)))
        run_node(node, env)
        wants = [env.get(o) for o in node.outputs]
    per_rank = []
    for r in range(k):
        env = {nm: _snapshot(sh[r]) for nm, sh in zip(names, shards)}  # B shards are one tensor
        topo = Topology(((AXIS, k),), rank=r)
        try:
            for n in local:
                run_node(n, env, topo)
        except Exception as err:  # noqa: BLE001
            return f"rank {r}: {type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
        per_rank.append([env.get(o) for o in node.outputs])
    for i, (t, s, want) in enumerate(zip(node.types, sig.outs, wants)):
        if t.dtype == "none" or want is None:
            continue
        got = [rank[i] for rank in per_rank]
        shape = local_shape(t.shape, (s,), (k,))
        if any(tuple(x.shape) != shape for x in got):
            return f"output {i}: local shape {tuple(got[0].shape)}, expected {shape}"
        value = combine(got, s)
        if value.dtype != want.dtype:
            return f"output {i}: dtype {value.dtype}, expected {want.dtype}"
        if "empty" in node.op:
            continue  # values of empty_like are undefined
        scale = 0.0
        if isinstance(s, Partial) and value.dtype.is_floating_point:
            scale = max(float(x.nan_to_num(0.0, 0.0, 0.0).abs().max()) if x.numel() else 0.0 for x in got)
        dev = deviation(value, want, scale)
        if dev > tol:
            return f"output {i} ({s!r}) deviates by {dev:.2e}"
    return None


def validate(book: RuleBook, insts: list[Instance], sizes=(2, 4), seed: int = 0) -> Report:
    """Check every signature of every instance on 1-D axes of each size."""
    report = Report()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny kernels: threads only add overhead
    try:
        for inst in insts:
            for k in sizes:
                for j, sig in enumerate(book.signatures(inst.node, inst.in_types, k)):
                    err = check(book, inst, sig, k, seed=seed + j)
                    report.outcomes.append(Outcome(inst, k, sig, err))
    finally:
        torch.set_num_threads(threads)
    return report
