"""`sbpc launch`: render the scripts that start a plan's ranks on several nodes (jinja2
templates in codegen_templates/: torchrun per node, or one slurm sbatch job).

Ranks fill nodes in blocks: node n holds ranks n*d .. n*d+d-1 (d = devices per node), which is
torchrun's and srun's block order. tp is the innermost mesh axis (runtime/plan.py's rank order),
so a tp group stays inside a node whenever d is a multiple of tp; a layout where it would not
is reported, since its all-reduces would then cross the network every layer.
"""
from __future__ import annotations

import os
import shlex
import stat
from dataclasses import dataclass
from importlib import resources

import jinja2

from sbpc.errors import UsageError
from sbpc.runtime.backend import check_backend_name
from sbpc.runtime.files import atomic_path
from sbpc.runtime.plan import Plan

EMITTERS = {"torchrun": "launch.torchrun.sh.j2", "slurm": "launch.slurm.sh.j2"}
DEFAULT_PORT = 29500


@dataclass(frozen=True)
class LaunchSpec:
    plan_path: str  # as the user gave it: the script cds to ``workdir`` first
    nodes: int
    emit: str  # a key of EMITTERS
    master_addr: str | None = None  # None: 127.0.0.1 on one node, else from the environment (slurm: the first node)
    master_port: int = DEFAULT_PORT
    ifname: str | None = None  # the network interface for NCCL and gloo; None: theirs to pick
    backend: str = "cpu"
    workdir: str = "."  # where the plan's model path resolves: sbpc launch's working directory


@dataclass(frozen=True)
class RankPlace:
    rank: int
    node: int
    local: int
    coords: str  # "dp=1, tp=0"


def check_spec(plan: Plan, spec: LaunchSpec) -> None:
    """Refuse, in one line each, what would not start: a node count that does not divide the
    ranks, a port out of range, an empty or spaced address or interface, an unknown backend.
    (``emit`` comes from the command line's choices, the keys of EMITTERS.)"""
    world = plan.world_size
    if spec.nodes < 1 or world % spec.nodes:
        valid = ", ".join(str(n) for n in range(1, world + 1) if world % n == 0)
        raise UsageError(f"--nodes {spec.nodes} does not divide the plan's {world} ranks into equal nodes",
                         hint=f"valid --nodes for this plan: {valid}")
    if not 1 <= spec.master_port <= 65535:
        raise UsageError(f"--master-port {spec.master_port} is not a TCP port", hint="pick a free port in 1-65535, e.g. 29500")
    for flag, value in (("--master-addr", spec.master_addr), ("--ifname", spec.ifname)):
        if value is not None and (not value or value.split() != [value]):
            raise UsageError(f"{flag} {value!r} is empty or has spaces",
                             hint="a host name or address" if flag == "--master-addr" else "an interface name, e.g. eth0")
    check_backend_name(spec.backend)


def rank_places(plan: Plan, nodes: int) -> list[RankPlace]:
    per_node = plan.world_size // nodes
    return [RankPlace(r, r // per_node, r % per_node, ", ".join(f"{k}={v}" for k, v in plan.coords(r).items()))
            for r in range(plan.world_size)]


def split_axes(plan: Plan, nodes: int) -> list[str]:
    """The mesh axes whose groups of one rank span nodes (``tp`` only: dp, cp and pp are expected
    to cross the network), each as ``tp=4``."""
    per_node = plan.world_size // nodes
    tp = next((a.size for a in plan.mesh if a.name == "tp"), 1)
    return [f"tp={tp}"] if tp > 1 and per_node % tp else []


def render_launch(plan: Plan, spec: LaunchSpec) -> str:
    check_spec(plan, spec)
    templates = resources.files("sbpc.codegen_templates")
    env = jinja2.Environment(loader=jinja2.FunctionLoader(lambda name: templates.joinpath(name).read_text()),
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True,
                             keep_trailing_newline=True)
    env.filters["q"] = lambda value: shlex.quote(str(value))
    mesh = ", ".join(f"{a.name}={a.size}" for a in plan.mesh)
    return env.get_template(EMITTERS[spec.emit]).render(
        spec=spec, plan=plan, mesh=mesh, per_node=plan.world_size // spec.nodes, ranks=rank_places(plan, spec.nodes),
        spanning=split_axes(plan, spec.nodes), version=plan.sbpc_version,
        model=os.path.splitext(os.path.basename(plan.model.path))[0])


def write_script(path: str, text: str) -> None:
    """Atomically, and executable (a script one runs as ``./launch.sh``)."""
    with atomic_path(path) as tmp:
        with open(tmp, "w") as f:
            f.write(text)
        os.chmod(tmp, os.stat(tmp).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
