"""The memory estimate: model state against ZeRO's formulas, activations against Korthikanti's,
and the pipeline's in-flight micro-batches (bench/memory_vs_estimate.py compares with real runs)."""
from __future__ import annotations

import pytest

from sbpc.compiler.driver import compile_model
from sbpc.compiler.frontend.model_loader import load_model
from sbpc.compiler.frontend.optim import OptimizerConfig
from sbpc.compiler.ir.mesh import parse_mesh
from sbpc.compiler.memory.estimate import estimate_memory
from sbpc.compiler.passes import PipelineOptions

STEP_COUNTER = 8  # AdamW's one shared f64 step counter, on every stage that updates


def _compile(model: str, mesh: str, sets: dict, batch: int = 4, microbatches: int | None = None, **kw):
    m = parse_mesh(mesh)
    source = load_model(f"examples/{model}", sets)
    return compile_model(source, m, batch_size=batch, optimizer=OptimizerConfig(),
                         pipeline=PipelineOptions(microbatches=microbatches or m.size("pp")), **kw)


@pytest.mark.parametrize("mesh", ["1", "2x1x1", "1x2x1"])
def test_fp32_adamw_model_state_is_16_bytes_per_parameter(mesh):
    result = _compile("gpt.py", mesh, {"preset": "tiny"})
    (role,) = result.plan.estimates.roles
    p = result.plan.estimates.param_count
    tp = parse_mesh(mesh).size("tp")
    state = role.param_bytes + role.grad_bytes + role.optimizer_bytes - STEP_COUNTER
    # under tp the layer norms and row-parallel biases stay replicated: count them from the shard table
    replicated = sum(x.numel for x in _replicated_on_tp(result)) if tp > 1 else 0
    assert state == 16 * ((p - replicated) // tp + replicated)
    assert role.total == sum((role.params, role.grads, role.optimizer, role.activations, role.buffers, role.temporaries))
    assert role.params == role.param_bytes and role.optimizer == role.optimizer_bytes  # held all step


def _replicated_on_tp(result):
    from sbpc.runtime.sbp import Broadcast

    axes = result.graph.mesh.sbp_axes
    t = axes.index("tp")
    return [i.type for i in result.graph.inputs if i.kind.value == "param" and isinstance(i.sbp[t], Broadcast)]
