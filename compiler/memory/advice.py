"""When a plan does not fit ``--device-memory``: the cheapest change that makes it fit.

The changes are tried cheapest first and each one is re-estimated by compiling under it (the
estimate is the compiler's, so a change is named only when the plan it gives fits on every
role). The ranking is by the usual cost of each change, not a priced comparison:

1. ZeRO 1, then 2: the gradient all-reduce becomes a reduce-scatter + all-gather of the same bytes;
2. selective recompute: a few percent more compute (softmax, dropout, attention scores);
3. ZeRO 3: parameters gathered per layer, half again the dp traffic;
4. full recompute: a second forward of every layer (a third more compute);
5. optimizer offload: every gradient and updated parameter crosses the host link each step,
   and the update runs on the host's cores;
6. a mesh with the same devices and twice the tp, then twice the pp (dp halved): more tp
   traffic, a longer pipeline bubble;
7. twice the tp, then twice the pp, on twice the devices.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from sbpc.compiler.ir.mesh import KNOWN_AXES, MICROBATCH, Mesh
from sbpc.compiler.memory_options import MemoryOptions
from sbpc.runtime.kinds import Recompute
from sbpc.runtime.plan import RoleMemory

_TERMS = ("params", "grads", "optimizer", "activations", "buffers", "temporaries")


@dataclass(frozen=True)
class Change:
    label: str  # as the user writes it: "--zero 1", "--mesh 3x16x64"
    mesh: Mesh
    memory: MemoryOptions


def mesh_text(mesh: Mesh) -> str:
    """``--mesh`` text of ``mesh``: ``d x t x p`` when it has only those axes, else ``name=size,...``."""
    axes = dict(mesh.device_axes)
    if set(axes) <= {"dp", "tp", "pp"}:
        return "x".join(str(axes.get(a, 1)) for a in ("dp", "tp", "pp"))
    return ",".join(f"{n}={s}" for n, s in mesh.device_axes)


def _with(mesh: Mesh, **sizes: int) -> Mesh:
    axes = dict(mesh.device_axes) | sizes
    return Mesh(tuple((n, axes[n]) for n in KNOWN_AXES if n in axes)).with_microbatches(mesh.size(MICROBATCH))


def candidates(mesh: Mesh, memory: MemoryOptions) -> list[Change]:
    """The changes to try, cheapest first."""
    out: list[Change] = []
    order = [("zero", 1), ("zero", 2), ("recompute", Recompute.SELECTIVE), ("zero", 3), ("recompute", Recompute.FULL)]
    rank = {Recompute.NONE: 0, Recompute.SELECTIVE: 1, Recompute.FULL: 2}
    for key, value in order:
        if key == "zero" and (memory.zero >= value or mesh.size("dp") == 1):
            continue
        if key == "recompute" and rank.get(memory.recompute, 3) >= rank[value]:
            continue
        out.append(Change(f"--{key} {getattr(value, 'value', value)}", mesh, replace(memory, **{key: value})))
    if memory.offload == "none":
        out.append(Change("--offload optimizer", mesh, replace(memory, offload="optimizer")))
    dp, tp, pp = mesh.size("dp"), mesh.size("tp"), mesh.size("pp")
    meshes = []
    if dp % 2 == 0:
        meshes += [_with(mesh, dp=dp // 2, tp=tp * 2), _with(mesh, dp=dp // 2, pp=pp * 2)]
    meshes += [_with(mesh, tp=tp * 2), _with(mesh, pp=pp * 2)]
    for m in meshes:
        out.append(Change(f"--mesh {mesh_text(m)}", m, memory))
    return out


def biggest_term(role: RoleMemory) -> tuple[str, int]:
    return max(((t, getattr(role, t)) for t in _TERMS), key=lambda x: x[1])


def first_fit(changes: list[Change], estimate: Callable[[Change], list[RoleMemory] | None],
              budget: int) -> tuple[Change, list[RoleMemory]] | None:
    """The first change whose estimate fits ``budget`` on every role (``estimate`` returns None
    for a change the model or batch cannot take, e.g. heads that do not split over a larger tp)."""
    for change in changes:
        roles = estimate(change)
        if roles is not None and all(r.total <= budget for r in roles):
            return change, roles
    return None


def gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"
