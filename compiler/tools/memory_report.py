"""`sbpc memory`: the estimate of every rank role as a table or JSON (compiler/memory/estimate.py)."""
from __future__ import annotations

from sbpc.runtime.plan import RoleMemory

COLUMNS = ("params", "grads", "optimizer", "activations", "buffers", "temporaries", "total")  # on the device


def memory_json(roles: list[RoleMemory], budget: int | None) -> list[dict]:
    """One object per role: the columns in bytes per device, and whether it fits (true without a budget)."""
    return [{"role": r.role, **{c: getattr(r, c) for c in COLUMNS}, "fits": budget is None or r.total <= budget,
             "host": r.host, "ranks": r.ranks, "peak_at": r.peak_at, "in_flight": r.in_flight} for r in roles]


def size_text(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def memory_table(roles: list[RoleMemory], budget: int | None, mesh: str) -> str:
    head = ["role", "ranks", "peak at", "in flight", *COLUMNS, "fits", "host"]
    rows = [[r.role, str(r.ranks), r.peak_at, str(r.in_flight), *(size_text(getattr(r, c)) for c in COLUMNS),
             "-" if budget is None else ("yes" if r.total <= budget else "NO"), size_text(r.host)] for r in roles]
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    line = lambda cells: "  ".join(c.rjust(w) if i > 0 else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    worst = max(roles, key=lambda r: r.total)
    tail = f"per device on mesh {mesh}; the fullest role is {worst.role} with {size_text(worst.total)}"
    if budget is not None:
        n = sum(r.total > budget for r in roles)
        tail += f"; --device-memory {size_text(budget)}: " + ("every role fits" if n == 0 else (f"{n} roles do not fit" if n > 1 else "1 role does not fit"))
    return "\n".join([line(head), *map(line, rows), tail])
