"""Shared fixtures: compiled example plans (cached per session) and CLI runners."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
MODELS = Path(__file__).resolve().parent / "models"
EXAMPLE_FILES = ["gpt.py", "mlp.py", "hf_gpt2.py"]


@pytest.fixture(autouse=True)
def _run_from_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # plans record model paths relative to where they were compiled


_compiled: dict = {}


def compile_example(name: str, **kw):
    """Compile examples/<name> once per session for mesh 1 (cached by arguments)."""
    from sbpc.compiler.driver import compile_model
    from sbpc.compiler.ir.mesh import parse_mesh
    from sbpc.compiler.frontend.model_loader import load_model
    from sbpc.compiler.frontend.optim import OptimizerConfig

    key = (name, repr(sorted(kw.items())))
    if key not in _compiled:
        os.chdir(ROOT)
        optimizer = kw.pop("optimizer", OptimizerConfig())
        source = load_model(f"examples/{name}", kw.pop("sets", {}))
        _compiled[key] = (compile_model(source, parse_mesh("1"), batch_size=kw.pop("batch_size", 4),
                                        optimizer=optimizer), source, optimizer)
    return _compiled[key]


def sbpc(*args: str, timeout: int = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run the installed `sbpc` console script as a user would (``env`` adds to the environment)."""
    exe = Path(sys.executable).parent / "sbpc"
    return subprocess.run([str(exe), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **env} if env else None)


RANKS = ("threads", "processes")


def sbpc_check(*args: str, ranks: str = "threads", timeout: int = 900) -> subprocess.CompletedProcess:
    """`sbpc check ARGS --ranks RANKS`. ``processes``: the console script as a user runs it,
    spawning one gloo process per rank. ``threads``: the same command run in this process, its
    ranks as threads (runtime/threads.py): no interpreter for the command nor for any rank.
    ``timeout`` bounds the subprocess; in process, every wait of a rank is bounded by --timeout."""
    if ranks == "processes":
        return sbpc("check", *args, "--ranks", "processes", timeout=timeout)
    if ranks != "threads":
        raise ValueError(f"ranks must be one of {RANKS}, not {ranks!r}")
    import contextlib
    import io

    from sbpc.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["check", *args, "--ranks", "threads", "--timeout", str(timeout)])
    return subprocess.CompletedProcess(["sbpc", "check", *args], code, out.getvalue(), err.getvalue())


def collective_op(x) -> str:
    """The op of a plan instruction or IR node, an overlapped collective seen as what it does:
    the overlap pass's ``sbpc.issue(kind=K)`` is ``sbpc.K`` (its ``sbpc.wait`` stays itself)."""
    from sbpc.runtime.kinds import ISSUE, Collective

    return Collective(x.kwargs["kind"]).op if x.op == ISSUE else x.op


def input_ref(ins) -> str:
    """The value a plan instruction's first tensor argument names."""
    return ins.args[0].ref


def drop_collective(plan, pick, stage: int = 0):
    """``plan`` with the first collective that ``pick`` accepts replaced by a copy of its input,
    as if it were lost (each rank keeps its own part). An issued one loses its ``sbpc.issue``,
    and its ``sbpc.wait`` becomes the copy (freeing what the issue freed)."""
    from sbpc.runtime.kinds import ISSUE
    from sbpc.runtime.overlap import waits

    program = plan.stages[stage]
    ins = list(program.instructions)
    k = next(i for i, x in enumerate(ins) if pick(x))
    copy = {"op": "aten.clone.default", "args": ins[k].args[:1], "kwargs": {}}
    if ins[k].op == ISSUE:
        work = ins[k].outs[0]
        wait = waits(ins)[work]
        j = next(i for i, x in enumerate(ins) if x is wait)
        ins[j] = ins[j].model_copy(update={**copy, "free": ins[k].free + [f for f in ins[j].free if f != work]})
        del ins[k]
    else:
        ins[k] = ins[k].model_copy(update=copy)
    stages = list(plan.stages)
    stages[stage] = program.model_copy(update={"instructions": ins})
    return plan.model_copy(update={"stages": stages})


def input_gradient_all_reduce(plan, stage: int = 0):
    """A ``pick`` for ``drop_collective``: a backward all-reduce of a matmul's partial result,
    the gradient of a column-parallel linear's input (Megatron's classic lost all-reduce)."""
    made_by = {o: x.op for x in plan.stages[stage].instructions for o in x.outs}
    return lambda x: (collective_op(x) == "sbpc.all_reduce" and x.role == "bwd"
                      and made_by.get(input_ref(x)) == "aten.mm.default")


def tcp_store(world: int):
    """A real torch TCPStore master on a free port (the NCCL unique-id exchange's transport)."""
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def tcp_client(master):
    """A client of ``tcp_store``'s master, as another rank holds it."""
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=10))
