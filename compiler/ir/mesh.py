"""Device meshes: named axes, parsing of ``--mesh``, and the rank <-> coordinate map.

"axis" is always a mesh axis; "dim" always a tensor dimension. Positional meshes follow the
``d x m x p`` notation: ``4`` is dp=4, ``4x8`` is dp x tp, ``4x8x4`` is dp x tp x pp.
Rank order puts pp outermost and tp innermost, so tp ranks are contiguous (inside a node).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from sbpc.errors import UsageError
from sbpc.runtime.plan import mesh_coords

POSITIONAL_AXES = ("dp", "tp", "pp")
# "mb" is the micro-batch axis: a split of the batch over time, not over devices. It exists
# only inside the compiler (added by ``with_microbatches``), so SBP propagation and boxing
# treat micro-batching like data parallelism; the schedule pass turns its reductions into
# gradient accumulation. Users set it with --microbatches, never in --mesh.
KNOWN_AXES = ("pp", "mb", "dp", "cp", "tp")  # rank order: outermost first
MICROBATCH = "mb"
USER_AXES = tuple(a for a in KNOWN_AXES if a != MICROBATCH)
_HINT = "write 4x8x4 (dp x tp x pp) or dp=2,tp=2,pp=2; axes: " + ", ".join(USER_AXES)


@dataclass(frozen=True)
class Mesh:
    """An n-D device grid; ``axes`` are (name, size) pairs in rank order, outermost first."""

    axes: tuple[tuple[str, int], ...]

    def __post_init__(self) -> None:
        names = [n for n, _ in self.axes]
        for name, size in self.axes:
            if name not in KNOWN_AXES:
                raise UsageError(f"unknown mesh axis {name!r}", hint=_HINT)
            if size < 1:
                raise UsageError(f"mesh axis {name}={size} must be at least 1", hint=_HINT)
        if len(set(names)) != len(names):
            raise UsageError(f"mesh names an axis twice: {','.join(names)}", hint=_HINT)
        order = [KNOWN_AXES.index(n) for n in names]
        if order != sorted(order):
            raise UsageError("mesh axes out of rank order", hint=f"order them {', '.join(KNOWN_AXES)}")

    @property
    def device_axes(self) -> tuple[tuple[str, int], ...]:
        """The axes that are devices: all but the micro-batch axis."""
        return tuple((n, s) for n, s in self.axes if n != MICROBATCH)

    @property
    def microbatches(self) -> int:
        return self.size(MICROBATCH)

    def with_microbatches(self, m: int) -> "Mesh":
        """This mesh with ``m`` micro-batches per step (no ``mb`` axis when ``m`` is 1)."""
        if m < 1:
            raise UsageError(f"--microbatches {m} must be at least 1", hint="use --microbatches 1 or more")
        axes = dict(self.device_axes) | ({MICROBATCH: m} if m > 1 else {})
        return Mesh(tuple((n, axes[n]) for n in KNOWN_AXES if n in axes))

    @property
    def world_size(self) -> int:
        return math.prod(s for _, s in self.device_axes)

    def size(self, axis: str) -> int:
        return dict(self.axes).get(axis, 1)

    @property
    def sbp_axes(self) -> tuple[str, ...]:
        """Axes that carry an SBP entry: every axis but pp (pp is placement)."""
        return tuple(n for n, _ in self.axes if n != "pp")

    @property
    def sequential_axes(self) -> frozenset[int]:
        """The indices in ``sbp_axes`` of the axes whose parts run one after another (the
        micro-batches), not side by side on devices."""
        return frozenset(a for a, name in enumerate(self.sbp_axes) if name == MICROBATCH)

    def coords(self, rank: int) -> dict[str, int]:
        if not 0 <= rank < self.world_size:
            raise UsageError(f"rank {rank} is outside a mesh of {self.world_size} devices",
                             hint=f"ranks count from 0 to {self.world_size - 1}")
        return mesh_coords(list(self.device_axes), rank)

    def rank(self, coords: dict[str, int]) -> int:
        r = 0
        for name, size in self.device_axes:
            r = r * size + coords.get(name, 0)
        return r

    def rank_map(self) -> list[tuple[int, dict[str, int]]]:
        return [(r, self.coords(r)) for r in range(self.world_size)]

    def __str__(self) -> str:
        return ",".join(f"{n}={s}" for n, s in self.axes)


def parse_mesh(text: str) -> Mesh:
    """Parse ``4x8x4``, ``2``, or ``dp=2,tp=2,pp=2`` into a Mesh."""
    text = text.strip()
    if not text:
        raise UsageError("empty --mesh", hint=_HINT)
    if "=" in text:
        pairs = []
        for part in text.split(","):
            name, _, size = part.partition("=")
            pairs.append((name.strip(), _parse_size(size, text)))
        _check_names([n for n, _ in pairs], text)
        by_name = dict(pairs)
        return Mesh(tuple((n, by_name[n]) for n in USER_AXES if n in by_name))
    sizes = [_parse_size(s, text) for s in text.lower().split("x")]
    if len(sizes) > len(POSITIONAL_AXES):
        raise UsageError(f"mesh {text!r} has {len(sizes)} axes, positional form takes at most 3", hint=_HINT)
    named = dict(zip(POSITIONAL_AXES, sizes))
    return Mesh(tuple((n, named[n]) for n in KNOWN_AXES if n in named))


def _check_names(names: list[str], text: str) -> None:
    for n in names:
        if n not in USER_AXES:
            raise UsageError(f"unknown mesh axis {n!r} in {text!r}", hint=_HINT)
    if len(set(names)) != len(names):
        raise UsageError(f"mesh {text!r} names an axis twice", hint=_HINT)


def _parse_size(token: str, text: str) -> int:
    token = token.strip()
    if not token.isdigit() or int(token) < 1:
        raise UsageError(f"bad mesh size {token!r} in {text!r}", hint=_HINT)
    return int(token)
