"""bench/run_vs_eager.py's sides: what a step leaves behind in the process it shares."""
import importlib.util
import sys

import pytest

from conftest import ROOT
from sbpc.compiler.frontend.model_loader import load_model
from sbpc.compiler.frontend.optim import OptimizerConfig


@pytest.mark.parametrize("variant", ["single", "fused"])
def test_an_eager_step_keeps_no_gradients_past_its_end(monkeypatch, variant):
    """The plan's runner lets its gradients go when its step returns; eager's step drops them at
    its end too. Kept until the next eager step, they sat where eager's backward had put them
    while the plan stepped, and the plan grew the heap around them: fresh pages faulted in every
    step (about 400 a step on the mid config, none with this)."""
    spec = importlib.util.spec_from_file_location("run_vs_eager", ROOT / "bench" / "run_vs_eager.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "run_vs_eager", bench)  # its dataclasses look their module up there
    spec.loader.exec_module(bench)
    source = load_model("examples/gpt.py", {})
    built = []
    build = source.build
    monkeypatch.setattr(source, "build", lambda: built.append(build()) or built[-1])
    step = bench.eager_stepper(source, OptimizerConfig(), variant)
    (model,) = built
    before = [p.detach().clone() for p in model.parameters()]
    loss = step(source.batch(4))
    assert isinstance(loss, float)
    assert all(p.grad is None for p in model.parameters())
    assert any(not p.equal(b) for p, b in zip(model.parameters(), before))  # the update ran before the drop
