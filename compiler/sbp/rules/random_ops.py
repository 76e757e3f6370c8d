"""The family of random ops: any split, each device keeping its shard of the logical draw.

A random op whose tensor arguments only carry the output's shape and dtype (``bernoulli.p``,
``rand_like``, ``uniform``, ...; ``SHAPE_ONLY``) or that has none (``rand``, ``randn``) may
split its output on any dim: its per-device form ``sbpc.random_shard`` (``runtime/rng.py``)
draws the logical tensor at eager's position in the generator's stream and keeps this
device's shard, so the values are eager's bit for bit on every mesh. Its shape-carrying
inputs may come split with it, whole, or partial (their values are never read). A random op
that reads values (``bernoulli(probs)``, ``native_dropout``, ``poisson``) stays ``B``.
"""
from __future__ import annotations

from sbpc.compiler.sbp.rules.families import family
from sbpc.compiler.sbp.rules.loops import B, Cand, Loops, letters
from sbpc.runtime.rng import RANDOM_SHARD
from sbpc.runtime.sbp import Partial, Split

# ATen overloads (packet or packet.overload) whose tensor arguments are shape carriers only
SHAPE_ONLY = ("bernoulli.p", "rand_like", "randn_like", "randint_like", "uniform", "normal_functional", "cauchy",
              "exponential", "geometric", "log_normal", "random")
# random factories: no tensor argument, the logical size is an argument
FACTORIES = ("rand.default", "randn.default", "randint.default", "randint.low", "normal.float_float")


def shape_only(op: str) -> bool:
    _, packet, overload = op.split(".")
    return packet in SHAPE_ONLY or f"{packet}.{overload}" in SHAPE_ONLY or f"{packet}.{overload}" in FACTORIES


_FUSED_DROPOUT = {"sbpc.attention": 3, "sbpc.attention_backward": 6}  # op -> position of dropout_p


def draws_randomly(n) -> bool:
    """A random op, or a fused attention that draws its dropout mask inside the kernel."""
    from sbpc.compiler.ir.aten import is_random

    if n.op in _FUSED_DROPOUT:
        pos = _FUSED_DROPOUT[n.op]
        return len(n.args) > pos and bool(n.args[pos])
    return is_random(n.op)


def reads_values(n) -> bool:
    """A random node whose draw depends on its inputs' values: it never splits, and a pipeline
    cannot replay its draw from shapes alone."""
    return draws_randomly(n) and n.op != RANDOM_SHARD and (n.op in _FUSED_DROPOUT or not shape_only(n.op))


def _random_loc(lc, *carriers):
    # the logical draw replaces the op; its carriers and size arguments stay as they are
    lc.op = RANDOM_SHARD
    lc.set.update(op=lc.node.op, shape=list(lc.node.types[0].shape), sbp=[repr(s) for s in lc.outs[0]],
                  axes=list(lc.axes))


@family("random", _random_loc)
def random(c, *carriers):
    out = c.out_shape(0)
    lets = letters(len(out))
    lp = Loops(outs=[lets])
    keys = [k for k in (c.tensor(a) for a in carriers) if k is not None]
    for key in keys:
        lp.ins[key] = list(lets)
    extra = [Cand({}, [Split(d, q)], f"draw whole, keep block {d}" + (f":{q}" if q > 1 else ""))
             for d, n in enumerate(out) if n != 1 for q in (1, *c.parts)]
    extra += [Cand({key: p}, [B], f"values of {key} unused") for key in keys for p in (Partial(), Partial("max"))]
    return lp, extra
