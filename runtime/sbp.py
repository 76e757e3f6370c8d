"""SBP values: how one mesh axis holds a logical tensor.

``S(d)`` split along tensor dim d, ``B`` broadcast, ``P`` / ``P(max)`` partial. They are
frozen, hashable, and their repr is the text-IR spelling, in the manner of JAX's
``PartitionSpec``. An nd-SBP is a tuple with one entry per non-pp mesh axis.

``S(d:k)`` is a *strided* split: dim d is read as k equal blocks laid end to end, and each
block is split over the axis; a device holds its chunk of every block, in block order. A
fused qkv projection (``[q; k; v]`` along one dim) followed by ``split`` is ``S(d:3)``, so
each device holds its heads of q, k and v. ``S(d)`` is ``S(d:1)``.

The runtime reads SBP strings from plans, so this module lives in ``runtime/`` (which never
imports the compiler); the compiler imports it from here.
"""
from __future__ import annotations

import re
import zlib
from dataclasses import dataclass

from sbpc.errors import UsageError


@dataclass(frozen=True)
class Split:
    dim: int
    parts: int = 1  # > 1: a strided split over that many blocks

    # nd-SBP tuples are dict keys in the compiler's hottest loops (a tuple hashes its items
    # each time): the hash is computed once, not per lookup. Of ints only, so it is the same
    # in every process and the order of a set of layouts (and a sum over it) is reproducible.
    def __post_init__(self):
        object.__setattr__(self, "_hash", hash((1, self.dim, self.parts)))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):  # rebuilt by the constructor: a hash is only valid in its own process
        return Split, (self.dim, self.parts)

    def __repr__(self) -> str:
        return f"S({self.dim})" if self.parts == 1 else f"S({self.dim}:{self.parts})"


@dataclass(frozen=True)
class Broadcast:
    def __hash__(self) -> int:
        return _B_HASH

    def __repr__(self) -> str:
        return "B"


@dataclass(frozen=True)
class Partial:
    reduce: str = "sum"  # "sum" or "max"

    def __post_init__(self):
        object.__setattr__(self, "_hash", hash((3, zlib.crc32(self.reduce.encode()))))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        return Partial, (self.reduce,)

    def __repr__(self) -> str:
        return "P" if self.reduce == "sum" else f"P({self.reduce})"


_B_HASH = hash((2,))
Sbp = Split | Broadcast | Partial
NdSbp = tuple[Sbp, ...]

_SBP_RE = re.compile(r"^\s*(?:S\(\s*(-?\d+)\s*(?::\s*(\d+)\s*)?\)|(B)|P(?:\((sum|max)\))?)\s*$")


def parse_sbp(text: str) -> Sbp:
    m = _SBP_RE.match(text)
    if not m or (m.group(2) is not None and int(m.group(2)) < 1):
        raise UsageError(
            f"bad SBP {text!r}",
            hint="write S(dim), S(dim:blocks), B, P or P(max), for example S(0)",
        )
    if m.group(1) is not None:
        return Split(int(m.group(1)), int(m.group(2) or 1))
    if m.group(3):
        return Broadcast()
    return Partial(m.group(4) or "sum")


def parse_nd_sbp(items: list[str]) -> NdSbp:
    return tuple(parse_sbp(s) for s in items)


def format_nd_sbp(nd: NdSbp) -> str:
    return "[" + ", ".join(repr(s) for s in nd) + "]"


def local_shape(shape: tuple[int, ...] | list[int], nd: NdSbp, sizes: tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """The shape each device holds of a logical ``shape`` laid out as ``nd`` over axes of ``sizes``.
    Splits are even (the compiler refuses uneven ones), so every device holds the same shape."""
    out = list(shape)
    for s, k in zip(nd, sizes):
        if isinstance(s, Split):
            out[s.dim] //= k
    return tuple(out)


def divides(shape: tuple[int, ...] | list[int], nd: NdSbp, sizes: tuple[int, ...] | list[int]) -> bool:
    """Whether every split of ``nd`` divides its dim evenly (block by block for strided splits)."""
    cur = list(shape)
    for s, k in zip(nd, sizes):
        if isinstance(s, Split) and k > 1:
            if s.dim >= len(cur) or cur[s.dim] % (k * s.parts):
                return False
            cur[s.dim] //= k
    return True
