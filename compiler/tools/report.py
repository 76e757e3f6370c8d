"""Render a plan as a standalone HTML report (jinja2 template in codegen_templates/)."""
from __future__ import annotations

import collections
from importlib import resources

import jinja2

from sbpc.runtime.files import write_atomic
from sbpc.runtime.plan import Plan


def render_report(plan: Plan) -> str:
    source = resources.files("sbpc.codegen_templates").joinpath("report.html.j2").read_text()
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    counts = collections.Counter((i.role, i.op) for s in plan.stages for i in s.instructions)
    order = {"fwd": 0, "bwd": 1, "opt": 2}
    op_counts = sorted(counts.items(), key=lambda kv: (order.get(kv[0][0], 3), -kv[1], kv[0][1]))
    return env.from_string(source).render(plan=plan, op_counts=op_counts, mib=lambda b: f"{b / 2**20:,.2f} MiB")


def write_report(plan: Plan, path: str) -> None:
    write_atomic(path, render_report(plan))
