"""Where a rank sits in the mesh: its coordinate on each axis and its groups along each axis.

Plans name mesh axes ("tp"), never ranks; a rank turns an axis into the tuple of global ranks
it communicates with here. Rank order puts the first axis outermost (row-major).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from sbpc.runtime.plan import mesh_coords


@dataclass(frozen=True)
class Topology:
    axes: tuple[tuple[str, int], ...]  # (name, size) in rank order, outermost first
    rank: int = 0

    @property
    def world_size(self) -> int:
        n = 1
        for _, s in self.axes:
            n *= s
        return n

    @property
    def sbp_axes(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.axes if n != "pp")

    @cached_property
    def coords(self) -> dict[str, int]:
        """Computed once: every collective kernel asks for its group (``group``) each step."""
        return mesh_coords(list(self.axes), self.rank)

    def size(self, axis: str) -> int:
        return dict(self.axes).get(axis, 1)

    def index(self, axis: str) -> int:
        return self.coords.get(axis, 0)

    def rank_of(self, coords: dict[str, int]) -> int:
        r = 0
        for name, size in self.axes:
            r = r * size + coords.get(name, 0)
        return r

    def group(self, axis: str) -> tuple[int, ...]:
        """The global ranks along ``axis`` through this rank, in axis order."""
        return self._groups.get(axis, (self.rank,))  # an axis the mesh lacks has size 1

    @cached_property
    def _groups(self) -> dict[str, tuple[int, ...]]:
        here = self.coords
        return {a: tuple(self.rank_of({**here, a: i}) for i in range(n)) for a, n in self.axes}

    def groups(self, axis: str) -> list[tuple[int, ...]]:
        """Every group along ``axis``, each in axis order, sorted by first rank."""
        seen = {Topology(self.axes, r).group(axis) for r in range(self.world_size)}
        return sorted(seen)

    def sbp_coords(self) -> tuple[int, ...]:
        return tuple(self.index(a) for a in self.sbp_axes)

    def sbp_sizes(self) -> tuple[int, ...]:
        return tuple(self.size(a) for a in self.sbp_axes)
