"""ZeRO stages 1-3 as SBP on the dp axis (compiler/passes/zero.py): parity with the single
device on a data x tensor mesh and a data x pipeline mesh, the collectives each stage emits,
and the per-device model-state bytes of the estimates."""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import replace

import pytest

from conftest import sbpc_check
from sbpc.compiler.driver import compile_captured
from sbpc.compiler.frontend.capture import capture
from sbpc.compiler.frontend.model_loader import load_model
from sbpc.compiler.frontend.optim import OptimizerConfig
from sbpc.compiler.ir.mesh import parse_mesh
from sbpc.compiler.memory_options import MemoryOptions
from sbpc.compiler.passes import Coalesce, default_pipeline
from sbpc.compiler.tools.comm_report import collectives


# ----- parity (the acceptance): the default optimizer (AdamW), 2 steps each
@pytest.mark.parametrize("mesh", ["2x2x1", "4x1x2"])
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_parity(zero, mesh):
    r = sbpc_check("examples/gpt.py", "--zero", str(zero), "--mesh", mesh, "--steps", "2", ranks="threads", timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"largest deviation .*: PASS", r.stdout), r.stdout


def test_zero3_with_tensor_and_sequence_parallel_parity():
    # ZeRO composes with Megatron's tp layouts: dp shards a dim tp does not split
    r = sbpc_check("examples/gpt.py", "--config", "examples/gpt.megatron.toml", "--set", "sp=True", "--zero", "3",
                   "--mesh", "2x2x1", "--steps", "2", ranks="threads", timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"largest deviation .*: PASS", r.stdout), r.stdout


# dp = 3 divides none of the dims of the tiny GPT's tensors but the fused qkv's 192 (hidden 64,
# vocab 256, seq 32): ZeRO pads them (zero.py). With Megatron's hints on 3x2x1 the qkv weight's
# dim 0 is tp's, so it is padded on dim 1 too. On 3x1x2 (two micro-batches, the pipeline runner)
# the qkv's dim 0 is strided in 3 blocks of 64, which dp does not divide: padded on dim 1 as well
# (it failed to compile before). (Stage 2 lies between 1 and 3; the suite stays fast.)
@pytest.mark.parametrize("zero,mesh,config", [(1, "3x1x1", None), (2, "3x1x1", None), (3, "3x1x1", None),
                                              (1, "3x2x1", "examples/gpt.megatron.toml"),
                                              (3, "3x2x1", "examples/gpt.megatron.toml"), (2, "3x1x2", None)])
def test_zero_parity_when_dp_divides_no_dim(zero, mesh, config):
    extra = ("--config", config) if config else ()
    r = sbpc_check("examples/gpt.py", *extra, "--zero", str(zero), "--mesh", mesh, "--steps", "2", ranks="threads",
                   timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"largest deviation .*: PASS", r.stdout), r.stdout


# ----- collectives and estimates, from compiles only. Data parallelism pays when tokens
# outnumber the hidden size (test_parallel.py): 2048 tokens, hidden 256.
SETS = dict(hidden=256, heads=4, vocab=256, seq=128)
BATCH = {"2x1": 16, "4x1": 16, "3x1": 12}


@pytest.fixture(scope="module")
def captured():
    """One capture per mesh serves every ZeRO stage."""
    src = load_model("examples/gpt.py", SETS)
    graphs = {m: capture(src, parse_mesh(m), b, OptimizerConfig()) for m, b in BATCH.items()}
    return src, graphs


def _plan(captured, mesh: str, zero: int, passes=None):
    src, graphs = captured
    return compile_captured(graphs[mesh], src, batch_size=BATCH[mesh], optimizer=OptimizerConfig(), passes=passes,
                            memory=MemoryOptions(zero=zero)).plan


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _layer(module: str) -> str | None:
    m = re.match(r"h\.(\d+)(\.|$)", module)
    return m.group(1) if m else None


def test_zero2_one_reduce_scatter_and_one_all_gather_per_bucket(captured):
    plan = _plan(captured, "2x1", 2)
    cs = [c for c in collectives(plan) if c.moves_data]
    full = Counter(4 * _numel(p.shape) for p in plan.params)
    # every gradient is reduce-scattered once (from its whole partial value), never all-reduced ...
    rs = [c for c in cs if c.kind == "reduce_scatter"]
    assert {c.role for c in rs} == {"bwd"} and Counter(c.nbytes for c in rs) == full
    assert not [c for c in cs if c.kind == "all_reduce" and c.role in ("bwd", "opt")]
    # ... and every updated shard all-gathered once into the parameter's layout (B)
    ag = [c for c in cs if c.kind == "all_gather" and c.role == "opt"]
    assert Counter(c.nbytes for c in ag) == Counter({n // 2: k for n, k in full.items()})
    # 7 MB of gradients: DDP's buckets, the first of 1 MB (the last layers' gradients, issued
    # while the backward goes on), then one of 25 MB: two calls of each
    assert len({c.call for c in rs}) == 2 and len({c.call for c in ag}) == 2
    first = min(c.call for c in rs)
    assert 0 < sum(c.nbytes for c in rs if c.call == first) <= 2**20
    # smaller buckets: as many calls of each, every call within the bucket size (or one tensor)
    small = [replace(p, bucket_bytes=2**20) if isinstance(p, Coalesce) else p
             for p in default_pipeline(zero=2)]
    cs = [c for c in collectives(_plan(captured, "2x1", 2, passes=small)) if c.moves_data]
    for kind, role in (("reduce_scatter", "bwd"), ("all_gather", "opt")):
        calls = Counter()
        sizes = Counter()
        for c in cs:
            if c.kind == kind and c.role == role:
                calls[c.call] += 1
                sizes[c.call] += c.nbytes if kind == "reduce_scatter" else 2 * c.nbytes
        assert len(calls) > 1, (kind, calls)
        assert all(sizes[k] <= 2**20 or calls[k] == 1 for k in calls), (kind, sizes)
    assert len({c.call for c in cs if c.kind == "reduce_scatter"}) == len({c.call for c in cs if c.kind == "all_gather"
                                                                           and c.role == "opt"})


def test_zero3_gathers_each_layer_in_forward_and_again_in_backward(captured):
    plan = _plan(captured, "2x1", 3)
    cs = [c for c in collectives(plan) if c.moves_data]
    params = {p.value: p for p in plan.params}
    for layer in ("0", "1"):
        mine = {v for v, p in params.items() if p.name.startswith(f"h.{layer}.")}
        fwd = [c.value for c in cs if c.kind == "all_gather" and c.role == "fwd" and _layer(c.module) == layer]
        bwd = [c.value for c in cs if c.kind == "all_gather" and c.role == "bwd" and _layer(c.module) == layer]
        # forward: each of the layer's 12 parameters gathered once, and nothing else gathered
        assert sorted(fwd) == sorted(mine), fwd
        # backward: gathered again (not kept from the forward): the four matmul weights and the
        # layer norms' weights and biases, which their backward reads
        weights = {v for v in mine if params[v].name.endswith("weight") and "ln" not in params[v].name}
        assert len(bwd) == len(set(bwd)) and weights <= set(bwd) <= mine, bwd
        assert len(bwd) == 8, bwd
    # gradients: reduce-scattered once each; the update stays a shard (no gather after it)
    rs = [c for c in cs if c.kind == "reduce_scatter"]
    assert Counter(c.nbytes for c in rs) == Counter(4 * _numel(p.shape) for p in plan.params)
    assert not [c for c in cs if c.role == "opt"]
    assert not [c for c in cs if c.kind == "all_reduce" and c.role in ("bwd", "opt")]
    # parameters are dp shards as graph inputs (the fused qkv strided like its q, k, v blocks)
    assert all(re.fullmatch(r"S\(0(:3)?\)", p.sbp[0]) for p in plan.params), [(p.name, p.sbp) for p in plan.params]


# fp32 AdamW per parameter: 4 bytes of parameter, 4 of gradient, 8 of state (exp_avg and
# exp_avg_sq) -- 16P; the 8-byte step counter is shared and replicated. Every tensor of this
# GPT has a dim that divides by 2 and 4, so every one is sharded and the numbers are exact:
#   stage 0: 4P + 4P + 8P            stage 2: 4P + 4P/N + 8P/N
#   stage 1: 4P + <=4P + 8P/N        stage 3: 4P/N + 4P/N + 8P/N
# Stage 1 fixes only the optimizer state; where the gradient is made is the search's choice, and
# it reduce-scatters most gradients where the backward makes them (stage 2's layout), so the
# gradient bytes lie between 4P/N and 4P.
@pytest.mark.parametrize("mesh,n", [("2x1", 2), ("4x1", 4)])
def test_model_state_bytes_shrink_as_zero_says(captured, mesh, n):
    est = {z: _plan(captured, mesh, z).estimates for z in (0, 1, 2, 3)}
    P = est[0].param_count
    assert P == 1_743_872
    step = 8
    want = {0: (4 * P, 4 * P, 8 * P), 2: (4 * P, 4 * P // n, 8 * P // n), 3: (4 * P // n, 4 * P // n, 8 * P // n)}
    for z, (params, grads, state) in want.items():
        e = est[z]
        assert (e.param_bytes, e.grad_bytes, e.optimizer_state_bytes) == (params, grads, state + step), z
    e = est[1]
    assert e.param_bytes == 4 * P and e.optimizer_state_bytes == 8 * P // n + step
    assert 4 * P // n <= e.grad_bytes <= 4 * P


# ----- dp = 3: hidden 256 and vocab 256 have no factor 3 (the fused qkv's 768 has), so most
# tensors' update runs padded (zero.py): each state is its parameter zero-padded along one dim to
# a multiple of 3, split S(d) there; the plan says its unpadded (logical) shape
def _padded(plan) -> dict[str, list[int]]:
    """Parameter name -> the shape its update runs on (its exp_avg's)."""
    return {s.name.partition(":")[2]: s.shape for s in plan.states if s.name.startswith("exp_avg:")}


def test_zero_pads_the_state_of_tensors_dp_divides_nowhere(captured):
    plan = _plan(captured, "3x1", 1)
    params = {p.name: p for p in plan.params}
    padded = _padded(plan)
    assert set(padded) == set(params)
    cut = [n for n in params if padded[n] != params[n].shape]
    assert len(cut) > len(params) // 2, cut  # all but the fused qkv's weights and biases
    for s in plan.states:
        if s.name == "step":
            continue
        p = params[s.name.partition(":")[2]]
        d = int(re.fullmatch(r"S\((\d+)\)", s.sbp[0]).group(1))  # split over dp, never left whole
        assert s.shape[d] % 3 == 0 and s.shape[d] - 3 < p.shape[d] <= s.shape[d], (s.name, s.shape, p.shape)
        assert [a for a, b in zip(s.shape, p.shape) if a != b] in ([], [s.shape[d]])
        assert s.unpadded == (p.shape if s.shape != p.shape else None), s.name
    # the parameter itself stays whole (B on dp) and unpadded, and so does its update output
    assert all(p.sbp[0] == "B" for p in plan.params)


def test_zero2_padded_gradients_one_reduce_scatter_and_one_all_gather_per_bucket(captured):
    plan = _plan(captured, "3x1", 2)
    cs = [c for c in collectives(plan) if c.moves_data]
    padded = Counter(4 * _numel(shape) for shape in _padded(plan).values())
    # every gradient is reduce-scattered once, from its whole (padded) partial value ...
    rs = [c for c in cs if c.kind == "reduce_scatter"]
    assert {c.role for c in rs} == {"bwd"} and Counter(c.nbytes for c in rs) == padded
    assert not [c for c in cs if c.kind == "all_reduce" and c.role in ("bwd", "opt")]
    # ... every updated (padded) shard all-gathered once, and the cut to the parameter is local
    ag = [c for c in cs if c.kind == "all_gather" and c.role == "opt"]
    assert Counter(c.nbytes for c in ag) == Counter({n // 3: k for n, k in padded.items()})
    # bucketed: as many calls of each as there are buckets (DDP's first small one, then 25 MB)
    assert len({c.call for c in rs}) == len({c.call for c in ag}) == 2


# Per device, fp32 AdamW: P' = the padded update's numel (P plus under 3 rows per padded tensor)
#   stage 1: 8P'/N of state       stage 2: + 4P'/N of gradient
#   stage 3: + each parameter that dp divides split (4/N), the padded ones whole
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_padded_model_state_bytes(captured, zero):
    plan = _plan(captured, "3x1", zero)
    e, n, step = plan.estimates, 3, 8
    P = e.param_count
    padded = sum(_numel(shape) for shape in _padded(plan).values())
    assert P < padded < P * 1.01
    assert e.optimizer_state_bytes - step == 8 * padded // n < 8 * P
    if zero >= 2:
        assert e.grad_bytes == 4 * padded // n
    else:
        assert 4 * padded // n <= e.grad_bytes <= 4 * P
    split = sum(_numel(p.shape) for p in plan.params if p.sbp[0] != "B")
    assert e.param_bytes == (4 * split // n + 4 * (P - split) if zero == 3 else 4 * P)


def test_zero_on_a_mesh_without_dp_warns_that_it_changes_nothing(tmp_path):
    """``--zero 3`` on ``1x4``: nothing to shard over, so the plan is the stage-0 one; the user
    is told so instead of believing the optimizer state is sharded."""
    from conftest import sbpc

    r = sbpc("compile", "examples/gpt.py", "--mesh", "1x2", "--zero", "3", "-o", str(tmp_path / "z.json"))
    assert r.returncode == 0, r.stderr
    assert "sbpc: warning: --zero 3 shards over dp, and this mesh has dp=1: it changes nothing" in r.stderr, r.stderr
    r = sbpc("compile", "examples/gpt.py", "--mesh", "2x1", "--zero", "3", "-o", str(tmp_path / "z2.json"))
    assert r.returncode == 0 and "--zero" not in r.stderr, r.stderr
