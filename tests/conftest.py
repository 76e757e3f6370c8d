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


def sbpc(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run the installed `sbpc` console script as a user would."""
    exe = Path(sys.executable).parent / "sbpc"
    return subprocess.run([str(exe), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


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
