"""Pipeline stage assignment: hints in code and config, the cost-balanced partition, the rules."""
from __future__ import annotations

import re
from dataclasses import replace

import pytest

from sbpc.compiler.frontend.capture import capture
from sbpc.compiler.frontend.hints import PipelineConfig, glob_match, load_config
from sbpc.compiler.ir.types import Graph, InputKind, OutputKind, Role
from sbpc.compiler.ir.verify import verify
from sbpc.compiler.ir.mesh import parse_mesh
from sbpc.compiler.frontend.model_loader import load_model
from sbpc.compiler.frontend.optim import OptimizerConfig
from sbpc.compiler.pass_manager import CompileContext, PassManager
from sbpc.compiler.passes import CommonSubexpressionElimination, DeadCodeElimination, Decompose, Normalize
from sbpc.compiler.passes.stage_partition import StagePartition, param_chunks, stage_summary
from sbpc.compiler.pipelining.stage_policy import CostBalanced, RooflineCost, layer_key, profile
from sbpc.errors import CompileError, UsageError

STAGED_MODEL = '''
import torch, torch.nn as nn, torch.nn.functional as F
import sbpc

class Net(nn.Module):
    def __init__(self, first=0, last=1, loss=None):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.h = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.head = nn.Linear(16, 32)
        self.first, self.last, self.loss = first, last, loss

    def forward(self, idx, targets):
        with sbpc.stage(self.first):
            x = self.h[0](self.emb(idx))
        x = torch.relu(self.h[2](torch.relu(self.h[1](x))))
        with sbpc.stage(self.last):
            logits = self.head(torch.relu(self.h[3](x)))
        if self.loss is None:
            return F.cross_entropy(logits.view(-1, 32), targets.view(-1))
        with sbpc.stage(self.loss):
            return F.cross_entropy(logits.view(-1, 32), targets.view(-1))

def build_model(**kw):
    return Net(**kw)

def example_batch(batch_size, **kw):
    return torch.randint(0, 32, (batch_size, 8)), torch.randint(0, 32, (batch_size, 8))
'''

_captured: dict = {}


def captured(path: str, mesh: str = "1x1x2", config: str | None = None, **sets) -> Graph:
    """The graph up to stage-partition (cached): capture, then the passes before it."""
    key = (path, mesh, config, repr(sorted(sets.items())))
    if key not in _captured:
        cfg = load_config(config) if config else None
        graph = capture(load_model(path, sets), parse_mesh(mesh), 4, OptimizerConfig(), cfg)
        # verify=False: capture leaves partial placement (the hints) that stage-partition completes
        _captured[key] = PassManager([Normalize(), Decompose(), CommonSubexpressionElimination(), DeadCodeElimination()],
                                     CompileContext(verify=False)).run(graph)
    return _captured[key]


def partition(graph: Graph, mesh: str | None = None, **kw) -> Graph:
    if mesh is not None:
        graph = replace(graph, mesh=parse_mesh(mesh))
    out = StagePartition(**kw).apply(graph, CompileContext())
    verify(out, after="stage-partition")
    return out


def check_rules(g: Graph, chunks: int) -> None:
    """The placement rules, checked here independently of the pass's own check."""
    made = {o: n for n in g.nodes for o in n.outputs}
    for n in g.nodes:
        assert n.stage is not None and 0 <= n.stage < chunks, n
        for u in n.uses():
            src = made.get(u)
            if src is not None and src.role == n.role == Role.FORWARD:
                assert src.stage <= n.stage, (src, n)
            if src is not None and src.role == n.role == Role.BACKWARD:
                assert src.stage >= n.stage, (src, n)
    assert made[g.outputs_of(OutputKind.LOSS)[0].value].stage == chunks - 1
    assert {n.stage for n in g.nodes if n.role == Role.FORWARD} == set(range(chunks))
    # a block is never cut in two (an enclosing module such as model.transformer may be)
    fwd_chunks: dict = {}
    for n in g.nodes:
        if n.role == Role.FORWARD and n.loc is not None and n.loc.module:
            fwd_chunks.setdefault(layer_key(n.loc.module), set()).add(n.stage)
    assert all(len(c) == 1 for k, c in fwd_chunks.items() if k.split(".")[-1].isdigit()), fwd_chunks
    # a backward matmul runs where its forward module does
    for n in g.nodes:
        heavy = n.op in ("aten.mm.default", "aten.addmm.default", "aten.bmm.default", "sbpc.attention_backward",
                         "aten.embedding_dense_backward.default")
        if n.role == Role.BACKWARD and heavy and n.loc is not None and n.loc.module:
            chunks_of_module = fwd_chunks[layer_key(n.loc.module)]
            assert len(chunks_of_module) > 1 or chunks_of_module == {n.stage}, n
    # an optimizer op is where its parameter is first read
    first = {}
    for n in g.nodes:
        for u in n.uses():
            if n.role == Role.FORWARD:
                first.setdefault(u, n.stage)
    params = {i.name: i.value for i in g.inputs_of(InputKind.PARAM)}
    hyper_made = {i.value for i in g.inputs_of(InputKind.HYPER)}  # and what is computed from them alone
    for n in g.nodes:
        if n.role == Role.OPTIMIZER and all(u in hyper_made for u in n.uses()):
            hyper_made.update(n.outputs)
            continue  # shared by every parameter (cse): on each chunk that reads it, checked below
        if n.role == Role.OPTIMIZER and n.loc is not None and n.loc.module + ".weight" in params:
            assert n.stage == first[params[n.loc.module + ".weight"]], n
    # an op computed from hyperparameters alone is never read on another chunk (it is copied there)
    made = {o: n for n in g.nodes for o in n.outputs}
    for n in g.nodes:
        for u in n.uses():
            if u in hyper_made and u in made:
                assert made[u].stage == n.stage, (made[u], n)


def most_expensive(g: Graph, chunks: int) -> tuple[float, float, float]:
    """Compute of the heaviest chunk, the ideal (total / chunks) and the heaviest layer."""
    cost = RooflineCost()
    per_chunk = profile(g, [n.stage for n in g.nodes], chunks, cost).compute
    keys = sorted({layer_key(n.loc.module) for n in g.nodes if n.role == Role.FORWARD and n.loc is not None})
    group = [keys.index(layer_key(n.loc.module)) if n.role == Role.FORWARD and n.loc is not None else None
             for n in g.nodes]
    per_layer = profile(g, group, len(keys), cost).compute
    return max(per_chunk), sum(per_chunk) / chunks, max(per_layer)


@pytest.mark.parametrize("model,sets", [("gpt.py", {}), ("gpt.py", {"layers": 3}), ("gpt.py", {"layers": 4}),
                                        ("hf_gpt2.py", {})], ids=["gpt2", "gpt3", "gpt4", "hf_gpt2"])
@pytest.mark.parametrize("pp", [2, 4])
def test_examples_partition_by_the_rules_and_balance(model, sets, pp):
    g = partition(captured(f"examples/{model}", **sets), mesh=f"1x1x{pp}")
    check_rules(g, pp)
    worst, ideal, layer = most_expensive(g, pp)
    # balanced: no chunk costs more than 1.5x the even share, unless one layer alone does
    assert worst <= 1.5 * max(ideal, layer), (worst, ideal, layer, stage_summary(g))
    assert len(stage_summary(g)) == pp


def test_uneven_layer_counts():
    g = partition(captured("examples/gpt.py", layers=3), mesh="1x1x2")
    blocks = {n.loc.module.split(".")[1]: n.stage for n in g.nodes if n.loc and n.loc.module.startswith("h.")}
    assert sorted(blocks.values()) in ([0, 0, 1], [0, 1, 1])
    g = partition(captured("examples/gpt.py"), mesh="1x1x4")  # 2 blocks + embedding + head on 4 stages
    chunk = {layer_key(n.loc.module): n.stage for n in g.nodes if n.role == Role.FORWARD and n.loc and n.loc.module}
    assert chunk["wte"] == 0 and chunk["lm_head"] == 3 and chunk["h.0"] < chunk["h.1"]


def test_one_stage_places_everything_on_zero():
    g = partition(captured("examples/gpt.py", mesh="1"))
    assert {n.stage for n in g.nodes} == {0}


def test_virtual_stages_multiply_the_chunks():
    g = partition(captured("examples/gpt.py", layers=4), mesh="1x1x2", virtual_stages=2)
    check_rules(g, 4)
    lines = stage_summary(g)
    assert "chunk 2 (pp stage 0)" in lines[2] and "chunk 3 (pp stage 1)" in lines[3]


def test_microbatches_in_flight_move_layers_off_the_first_stage():
    """1F1B: stage 0 holds the activations of min(p, m) micro-batches, the last stage one. With
    room to trade time for memory (a chunk may take twice the fastest), memory moves blocks."""
    graph = captured("examples/gpt.py", layers=12, seq=256)
    policy = CostBalanced(time_slack=1.0)
    blocks = lambda g: [sum(1 for n in g.nodes if n.stage == c and n.op == "sbpc.attention") for c in range(4)]
    assert blocks(partition(graph, mesh="1x1x4", microbatches=1, policy=policy)) == [3, 3, 3, 3]
    many = partition(graph, mesh="1x1x4", microbatches=8, policy=policy)
    assert blocks(many)[0] < 3 < blocks(many)[3]
    assert "x 4 in flight" in stage_summary(many, microbatches=8)[0]


def test_a_uniform_stack_gets_layers_over_pp_per_stage():
    """Megatron's partition, found by the default policy: 16 blocks on pp 8 are 2 per stage, the
    embedding on the first and the head on the last, though the first stage keeps 8 micro-batches
    in flight and the last 1 (memory does not trade the step time; pricing it as a weighted
    term gave [1, 2, 2, 2, 2, 2, 2, 3] here). A small vocabulary keeps the head cheaper than a
    block, as at 1T (at 1.3B the head costs two blocks and rightly gets a stage of its own)."""
    g = partition(captured("examples/gpt.py", layers=16, hidden=2048, heads=16, vocab=2048, seq=1024), mesh="1x1x8",
                  microbatches=16)
    check_rules(g, 8)
    chunk = {layer_key(n.loc.module): n.stage for n in g.nodes if n.role == Role.FORWARD and n.loc and n.loc.module}
    assert [sum(1 for k, c in chunk.items() if k.startswith("h.") and c == s) for s in range(8)] == [2] * 8
    assert chunk["wte"] == 0 and chunk["lm_head"] == 7


def test_the_policy_costs_each_backward_op_in_the_chunk_it_runs_in():
    """The policy prices a partition before the pass places the backward; both must agree.
    Autograd's sums of the residual stream's gradient carry the loss's source line: costed by
    that line alone they all fell on the last chunk (2 per layer; at 1T's 128 layers the loss
    chunk cost 0.8 of a block, so the fastest partition needed 3 blocks on a stage and memory
    then took blocks off the early ones: 1 per stage there, 3 on stages 40-62)."""
    g = partition(captured("examples/gpt.py", layers=8), mesh="1x1x4")
    forward_only = [n.stage if n.role == Role.FORWARD else None for n in g.nodes]
    as_costed, as_placed = (profile(g, groups, 4, RooflineCost()) for groups in (forward_only, [n.stage for n in g.nodes]))
    # forward and backward op counts per chunk agree exactly; the policy leaves out only the
    # update's shared scalar ops (AdamW's step count), which the pass puts on chunk 0
    assert [o[:2] for o in as_costed.ops] == [o[:2] for o in as_placed.ops]
    assert as_costed.compute == pytest.approx(as_placed.compute, rel=1e-4)
    residual_sums = [n for n in g.nodes if n.role == Role.BACKWARD and n.op == "aten.add.Tensor" and n.loc
                     and n.loc.module == ""]
    assert len(residual_sums) >= 8 and {n.stage for n in residual_sums} == {0, 1, 2, 3}


def test_tied_weights_are_reported():
    g = partition(captured("examples/hf_gpt2.py"), mesh="1x1x4")
    chunks = param_chunks(g)
    assert chunks["model_transformer_wte_weight"] == {0, 3}  # the embedding and the tied lm_head
    assert all(len(c) == 1 for v, c in chunks.items() if v != "model_transformer_wte_weight")


def test_summary_names_modules_and_costs():
    lines = stage_summary(partition(captured("examples/hf_gpt2.py"), mesh="1x1x2"))
    assert re.match(r"chunk 0 \(pp stage 0\): model\.transformer\.wte \.\. model\.transformer\.h\.0; \d+ fwd", lines[0])
    assert re.search(r"model\.lm_head; .*compute [\d.]+ us; activations .* in flight; params\+state .*; sends", lines[1])


def _model(tmp_path, text=STAGED_MODEL) -> str:
    path = tmp_path / "staged.py"
    path.write_text(text)
    return str(path)


def test_in_code_hints_are_kept_and_completed(tmp_path):
    for pp in (2, 4):
        g = partition(captured(_model(tmp_path), mesh=f"1x1x{pp}", last=pp - 1))
        check_rules(g, pp)
        chunk = {layer_key(n.loc.module): n.stage for n in g.nodes if n.role == Role.FORWARD and n.loc and n.loc.module}
        assert chunk["emb"] == chunk["h.0"] == 0 and chunk["h.3"] == chunk["head"] == pp - 1
        assert chunk["h.1"] <= chunk["h.2"]


def test_hints_are_ignored_without_a_pipeline(tmp_path):
    g = captured(_model(tmp_path), mesh="1", last=5)
    assert all(n.stage is None for n in g.nodes)


def test_stage_is_a_no_op_in_plain_pytorch(tmp_path):
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("staged", _model(tmp_path))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    loss = mod.build_model(last=7)(*mod.example_batch(2))
    assert loss.dim() == 0 and torch.isfinite(loss)


def test_hint_against_the_data_flow_is_an_error(tmp_path):
    graph = captured(_model(tmp_path), first=1, last=0)
    with pytest.raises(CompileError) as err:
        partition(graph)
    assert re.search(r"aten\.\w+\.default is hinted to chunk 0 but depends on aten\.\w+\.default \(h\.0 @ .*staged\.py:15\), "
                     r"which is in the later chunk 1: forward values only flow to the same or a later chunk "
                     r"\(at h\.3 @ .*staged\.py:18\); hint: check the sbpc\.stage scopes", str(err.value)), str(err.value)


@pytest.mark.parametrize("sets,pattern", [
    ({"last": 5}, r"aten\.\w+\.default is hinted to chunk 5, but there are 2 chunks \(pp=2 x 1 virtual stages\) "
                  r"\(at h\.3 @ .*staged\.py:18\)"),
    ({"loss": 0}, r"the loss \(aten\.[\w.]+\) is hinted to chunk 0, but it is computed in the last chunk, 1"),
])
def test_impossible_hints(tmp_path, sets, pattern):
    with pytest.raises(CompileError) as err:
        partition(captured(_model(tmp_path), **sets))
    assert re.search(pattern, str(err.value)), str(err.value)


def test_more_chunks_than_layer_units_is_an_error(tmp_path):
    with pytest.raises(CompileError, match=r"pp=64 needs a layer unit per pipeline stage, but the model has only \d+ "
                                           r"to cut between \(emb, h\.0, .*\); the maximum pp is \d+; hint: pipeline"):
        partition(captured(_model(tmp_path)), mesh="1x1x64")


def test_bad_stage_index_in_code_names_the_line(tmp_path):
    with pytest.raises(UsageError, match=r"sbpc\.stage\(\) takes a chunk index \(an integer >= 0\), not -1 \(at .*staged\.py:14\)"):
        captured(_model(tmp_path), first=-1)


def _config(tmp_path, text: str) -> str:
    path = tmp_path / "pp.toml"
    path.write_text(text)
    return str(path)


def test_config_stages_and_pipeline(tmp_path):
    path = _config(tmp_path, '[stages]\n"h.0-1" = 0\n"h.2-3" = 1\n"head" = 1\n\n'
                             '[pipeline]\nmicrobatches = 8\nschedule = "1f1b"\n')
    cfg = load_config(path)
    assert cfg.pipeline == PipelineConfig(microbatches=8, schedule="1f1b", virtual_stages=None, source=path)
    assert cfg.stage_hint("emb") is None and cfg.stage_hint("h.1").chunk == 0
    assert cfg.stage_hint("h.1.attn.c_proj").chunk == 0  # a submodule: its innermost named ancestor decides
    assert cfg.stage_hint("h.3").chunk == 1 and cfg.stage_hint("h.3").source.endswith("pp.toml:3")
    plain = _model(tmp_path, STAGED_MODEL.replace("with sbpc.stage(self.first):", "if True:")
                   .replace("with sbpc.stage(self.last):", "if True:"))
    g = partition(captured(plain, config=path))
    check_rules(g, 2)
    chunk = {layer_key(n.loc.module): n.stage for n in g.nodes if n.role == Role.FORWARD and n.loc and n.loc.module}
    assert chunk == {"emb": 0, "h.0": 0, "h.1": 0, "h.2": 1, "h.3": 1, "head": 1}


def test_shipped_gpt_pp_config():
    cfg = load_config("examples/gpt.pp.toml")
    assert cfg.pipeline.microbatches and cfg.pipeline.schedule == "1f1b"
    g = partition(captured("examples/gpt.py", config="examples/gpt.pp.toml"))
    check_rules(g, 2)
    chunk = {layer_key(n.loc.module): n.stage for n in g.nodes if n.role == Role.FORWARD and n.loc and n.loc.module}
    assert chunk["h.0"] == 0 and chunk["h.1"] == 1 and chunk["lm_head"] == 1


def test_stage_globs_take_numeric_ranges():
    assert glob_match("h.3", "h.0-5") and glob_match("h.10", "h.8-11") and not glob_match("h.6", "h.0-5")
    assert glob_match("model.h.2.attn", "model.h.0-3.*") and not glob_match("h.x", "h.0-5")
    assert glob_match("h.0.attn.c_proj.weight", "h.0-1.**") and glob_match("h.1", "h.*")


@pytest.mark.parametrize("text,pattern", [
    ('[stages]\n"h.0-5" = -1\n', r"\[stages\] 'h\.0-5' must be a chunk index \(an integer >= 0\), not -1.*pp\.toml:2"),
    ('[stages]\n"h.*" = "first"\n', r"\[stages\] 'h\.\*' must be a chunk index.*not 'first'"),
    ('[stages]\n"h.5-0" = 1\n', r"\[stages\] 'h\.5-0' has an empty range '5-0'.*pp\.toml:2.*hint: write the smaller index first: 0-5"),
    ('[pipeline]\nmicrobatches = 0\n', r"\[pipeline\] microbatches must be an integer >= 1, not 0.*pp\.toml:2"),
    ('[pipeline]\nvirtual_stages = 1.5\n', r"\[pipeline\] virtual_stages must be an integer >= 1, not 1\.5"),
    ('[pipeline]\n\nschedule = "zb"\n', r"schedule must be one of 1f1b, gpipe, interleaved, not 'zb'.*pp\.toml:3"),
    ('[pipeline]\nchunks = 2\n', r"\[pipeline\] has unknown key 'chunks'.*pp\.toml:2.*hint: keys: microbatches, schedule"),
    ('[pipeline]\nschedule = "1f1b"\nvirtual_stages = 2\n',
     r"schedule = '1f1b' does not go with virtual_stages = 2.*pp\.toml:3.*hint: virtual stages"),
    ('stages = 3\n', r"\[stages\] must be a table"),
])
def test_config_errors(tmp_path, text, pattern):
    with pytest.raises(UsageError) as err:
        load_config(_config(tmp_path, text))
    assert re.search(pattern, str(err.value)), str(err.value)


def test_stage_glob_that_matches_no_module(tmp_path):
    path = _config(tmp_path, '[stages]\n"blocks.0-3" = 0\n')
    with pytest.raises(UsageError, match=r"module glob 'blocks\.0-3' matches no module.*pp\.toml:2"):
        captured(_model(tmp_path), config=path)
