"""The init program replays ``build_model``'s draws on its own seeded generator: the weights are
eager's ``torch.manual_seed(s); build_model()`` bit for bit, whatever the process's global
generator holds (ranks draw nothing from it during init)."""
from __future__ import annotations

import pytest
import torch

from sbpc.compiler.driver import compile_model
from sbpc.compiler.frontend.capture import capture
from sbpc.compiler.frontend.model_loader import load_model
from sbpc.compiler.frontend.optim import OptimizerConfig
from sbpc.compiler.ir.mesh import parse_mesh
from sbpc.runtime.backend import make_backend
from sbpc.errors import ModelError
from sbpc.runtime.weights import init_weights

MODEL = "tests/models/random_init.py"


def test_init_replays_factories_and_truncated_normals_bit_for_bit():
    source = load_model(MODEL, {})
    plan = compile_model(source, parse_mesh("1"), batch_size=4, optimizer=OptimizerConfig()).plan
    ops = [i.op for i in plan.init.instructions]
    # torch.randn / rand / randint draw from the init program's generator, not the global one
    assert {"aten.randn.generator", "aten.rand.generator", "aten.randint.low_generator"} <= set(ops), ops
    # each truncated normal is one op, not its rejection loop (unrolling it needs the values)
    assert ops.count("sbpc.trunc_normal_.default") == 3, ops
    for seed in (0, 7):
        torch.manual_seed(1234)  # the global generator elsewhere: the init must not read it
        weights = init_weights(plan, make_backend("cpu"), seed)
        torch.manual_seed(seed)
        eager = source.build()
        for name, value in [*eager.named_parameters(), *eager.named_buffers()]:
            assert torch.equal(weights[name], value), (seed, name)


def test_model_reads_numbers_computed_in_build():
    source = load_model(MODEL, {})
    graph = capture(source, parse_mesh("1"), 4, OptimizerConfig())
    torch.manual_seed(0)
    eager = source.build()
    assert eager.rate == pytest.approx(0.2) and eager.shift == 1.0
    scalars = {a for n in graph.nodes for a in n.args if isinstance(a, float)}
    assert eager.rate in scalars and eager.shift in scalars, scalars  # eager's numbers, bit for bit


def test_number_of_a_random_tensor_in_build_is_refused(tmp_path):
    """Its value would depend on the seed, and the plan serves every seed: a clean error."""
    model = tmp_path / "model.py"
    model.write_text("import torch\n"
                     "def build_model():\n"
                     "    return torch.nn.Linear(2, 2) if torch.rand(1).item() > 2 else None\n"
                     "def example_batch(batch_size):\n"
                     "    return (torch.randn(batch_size, 2),)\n")
    with pytest.raises(ModelError, match="DataDependentOutputException"):
        capture(load_model(str(model)), parse_mesh("1"), 4, OptimizerConfig())
