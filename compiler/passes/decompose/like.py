"""The one way a rewrite of ``decompose`` makes a node: a copy of the node it replaces (role, stage,
source location) with new results, op and arguments, and no SBP yet (propagation decides it)."""
from __future__ import annotations

from dataclasses import replace

from sbpc.compiler.ir.types import Node


def like(n: Node, outputs: list[str], op: str, args, types, kwargs=None) -> Node:
    return replace(n, outputs=outputs, op=op, args=tuple(args), kwargs=kwargs or {}, types=types, sbp=None)
