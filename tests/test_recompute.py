"""Activation recompute (compiler/passes/recompute.py): which ops are cloned into the backward,
that their collectives are redone, that the peak estimate drops, and parity with eager.

Compiles share one capture per (model, mesh, config); each ``sbpc check`` runs its ranks as
threads of this process."""
from collections import Counter

import pytest

from conftest import collective_op, sbpc_check
from sbpc.compiler.driver import compile_captured
from sbpc.compiler.frontend.capture import capture
from sbpc.compiler.frontend.hints import load_config
from sbpc.compiler.frontend.model_loader import load_model
from sbpc.compiler.frontend.optim import OptimizerConfig
from sbpc.compiler.ir.mesh import parse_mesh
from sbpc.compiler.ir.types import Role
from sbpc.compiler.memory_options import MemoryOptions
from sbpc.compiler.pipelining.stage_policy import layer_key
from sbpc.errors import CompileError
from sbpc.runtime.kinds import WAIT, Recompute

GPT, GPT_MEGATRON = "examples/gpt.py", "examples/gpt.megatron.toml"
HF_GPT2, HF_GPT2_MEGATRON = "examples/hf_gpt2.py", "examples/hf_gpt2.megatron.toml"  # eager attention: explicit softmax
OPT = OptimizerConfig()
_captured: dict = {}


def _compile(model: str, mesh: str, config: str | None, mode: str, device_memory: int | None = None, **sets):
    key = (model, mesh, config, tuple(sorted(sets.items())))
    if key not in _captured:
        source = load_model(model, sets)
        _captured[key] = (capture(source, parse_mesh(mesh), 4, OPT, load_config(config) if config else None), source)
    graph, source = _captured[key]
    return compile_captured(graph, source, batch_size=4, optimizer=OPT,
                            memory=MemoryOptions(recompute=Recompute(mode), device_memory=device_memory))


def _clones(result):
    """The recomputed ops: backward ops whose results are clones of forward values."""
    return [n for n in result.graph.nodes if n.role == Role.BACKWARD and n.outputs and
            all(o.endswith("_rc") or "_rc_" in o for o in n.outputs)]


def _per_layer(nodes):
    out: dict[str, Counter] = {}
    for n in nodes:
        out.setdefault(layer_key(n.loc.module), Counter())[collective_op(n)] += 1
    return out


def test_full_recomputes_each_layer_and_redoes_its_tp_all_reduce():
    none, full = _compile(GPT, "1x2", GPT_MEGATRON, "none"), _compile(GPT, "1x2", GPT_MEGATRON, "full")
    clones = _clones(full)
    assert len(full.graph.nodes) - len(none.graph.nodes) == len(clones)
    layers = _per_layer(clones)
    assert sorted(layers) == ["h.0", "h.1"]  # blocks only: not the embeddings, ln_f, the head or the loss
    for ops in layers.values():
        # what the block's backward reads, back to its kept input: ln_1, c_attn, attention, c_proj and its
        # all-reduce (ln_2 reads their sum), ln_2, c_fc, gelu. The MLP's c_proj and all-reduce make only the
        # block's output, which the next block keeps: no backward op reads them, so they are not redone.
        assert ops["aten.native_layer_norm.default"] == 2
        assert ops["aten.addmm.default"] == 3
        assert ops["sbpc.attention"] == 1 and ops["aten.gelu.default"] == 1
        assert ops["sbpc.all_reduce"] == 1
    fwd_all_reduce = lambda r: sum(collective_op(n) == "sbpc.all_reduce" and n.role == Role.FORWARD for n in r.graph.nodes)
    assert fwd_all_reduce(full) == fwd_all_reduce(none) == 2 * 2  # Megatron: 2 per layer forward
    # the redone all-reduce carries the forward's SBPs ([dp, tp]: P -> B on tp)
    ar = next(n for n in clones if collective_op(n) == "sbpc.all_reduce")
    result = next((n for n in clones if n.op == WAIT and list(n.uses()) == ar.outputs), ar)  # an issued one's
    assert ar.kwargs["axis"] == "tp" and [repr(s) for s in ar.sbp_in[0]] == ["B", "P"] and \
        [repr(s) for s in result.sbp[0]] == ["B", "B"]
    assert full.plan.estimates.peak_activation_bytes < none.plan.estimates.peak_activation_bytes


def test_selective_recomputes_the_attention_core_of_an_explicit_softmax():
    none, sel = _compile(HF_GPT2, "1x2", HF_GPT2_MEGATRON, "none"), _compile(HF_GPT2, "1x2", HF_GPT2_MEGATRON, "selective")
    clones = _clones(sel)
    assert len(sel.graph.nodes) - len(none.graph.nodes) == len(clones)
    layers = _per_layer(clones)
    assert sorted(layers) == ["model.transformer.h.0", "model.transformer.h.1"]
    for ops in layers.values():
        # q @ k^T, its view, the scale, the mask add, softmax, and the expand/view the matmul with v reads
        # (views are reshapes after localize; the redone mask add writes over the scaled scores,
        # which die there: the inplace pass's backward add_)
        assert ops == Counter({"aten.bmm.default": 1, "aten.reshape.default": 2, "aten.mul.Tensor": 1,
                               "aten.add_.Tensor": 1, "aten._softmax.default": 1, "aten.expand.default": 1})
    # matmul outputs (the linear layers) are kept, and so are their tp all-reduces
    assert not any(n.op in ("aten.addmm.default", "aten.mm.default") or n.op.startswith("sbpc.all_") for n in clones)
    assert sel.plan.estimates.peak_activation_bytes < none.plan.estimates.peak_activation_bytes


def test_selective_recomputes_nothing_in_fused_attention():
    """sbpc.attention (flash-style) saves only its output and log-sum-exp: no s x s tensor to drop."""
    none, sel = _compile(GPT, "1x2", GPT_MEGATRON, "none"), _compile(GPT, "1x2", GPT_MEGATRON, "selective")
    assert _clones(sel) == [] and len(sel.graph.nodes) == len(none.graph.nodes)


def test_auto_picks_the_least_recompute_that_fits():
    """At seq 256 activations dominate the tiny GPT's peak (at seq 32 the update's new values do,
    and recompute cannot move it)."""
    peak = lambda r: max(role.total for role in r.plan.estimates.roles)
    run = lambda mode, budget=None: _compile(GPT, "1x2", GPT_MEGATRON, mode, device_memory=budget, seq=256)
    none, full = peak(run("none")), peak(run("full"))
    assert full < 0.6 * none
    auto = lambda budget: run("auto", budget)
    assert len(_clones(auto(none))) == 0  # none fits: nothing recomputed
    chosen = auto(full)  # only full fits (selective recomputes nothing in gpt.py's fused attention)
    assert len(_clones(chosen)) == len(_clones(run("full"))) > 0 and peak(chosen) == full
    with pytest.raises(CompileError, match=r"no --recompute mode fits --device-memory .*: with full recompute stage 0 needs"):
        auto(full - 1)


@pytest.mark.parametrize("mode,config", [("full", None), ("full", GPT_MEGATRON), ("selective", GPT_MEGATRON)])
def test_gpt_parity_on_2x2x2(mode, config):
    """The acceptance: gpt.py on dp x tp x pp = 2x2x2 (pipelined: the clones run in the backward
    task of their chunk, the schedule's deadlock proof covers their collectives). Selective
    without the config is the same plan as none (nothing to recompute in fused attention)."""
    args = [GPT, "--mesh", "2x2x2", "--recompute", mode, "--steps", "2"] + (["--config", config] if config else [])
    r = sbpc_check(*args)
    assert r.returncode == 0 and "PASS" in r.stdout, r.stdout + r.stderr


def test_selective_parity_explicit_softmax():
    r = sbpc_check(HF_GPT2, "--mesh", "1x2", "--config", HF_GPT2_MEGATRON, "--recompute", "selective", "--steps", "2")
    assert r.returncode == 0 and "PASS" in r.stdout, r.stdout + r.stderr
