"""SBP values: how one mesh axis holds a logical tensor.

``S(d)`` split along tensor dim d, ``B`` broadcast, ``P`` / ``P(max)`` partial. They are
frozen, hashable, and their repr is the text-IR spelling, in the manner of JAX's
``PartitionSpec``. An nd-SBP is a tuple with one entry per non-pp mesh axis.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from sbpc.errors import UsageError


@dataclass(frozen=True)
class Split:
    dim: int

    def __repr__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True)
class Broadcast:
    def __repr__(self) -> str:
        return "B"


@dataclass(frozen=True)
class Partial:
    reduce: str = "sum"

    def __repr__(self) -> str:
        return "P" if self.reduce == "sum" else f"P({self.reduce})"


Sbp = Split | Broadcast | Partial
NdSbp = tuple[Sbp, ...]

_SBP_RE = re.compile(r"^\s*(?:S\((-?\d+)\)|(B)|P(?:\((sum|max)\))?)\s*$")


def parse_sbp(text: str) -> Sbp:
    m = _SBP_RE.match(text)
    if not m:
        raise UsageError(
            f"bad SBP {text!r}",
            hint="write S(dim), B, P or P(max), for example S(0)",
        )
    if m.group(1) is not None:
        return Split(int(m.group(1)))
    if m.group(2):
        return Broadcast()
    return Partial(m.group(3) or "sum")


def format_nd_sbp(nd: NdSbp) -> str:
    return "[" + ", ".join(repr(s) for s in nd) + "]"
