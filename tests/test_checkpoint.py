"""Checkpoints (runtime/checkpoint.py, docs/checkpoints.md): every rank writes its shards, one
index maps them to logical tensors; a resume on any mesh or layout reads only its regions and
continues the run: bit for bit on the same plan, within 1e-5 relative on another."""
from __future__ import annotations

import contextlib
import io
import itertools
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT
from sbpc.compiler.driver import compile_model
from sbpc.compiler.frontend.hints import load_config
from sbpc.compiler.frontend.model_loader import load_model
from sbpc.compiler.frontend.optim import OptimizerConfig
from sbpc.compiler.ir.mesh import parse_mesh
from sbpc.compiler.memory_options import MemoryOptions
from sbpc.compiler.passes import PipelineOptions
from sbpc.errors import OutputError
from sbpc.runtime.checkpoint import logical_tensors
from sbpc.runtime.checkpoint_index import INDEX, LATEST, shard_regions
from sbpc.runtime.kinds import Precision
from sbpc.runtime.launch import launch
from sbpc.runtime.plan import save_plan
from sbpc.runtime.sbp import Broadcast, Split
from sbpc.runtime.sharding import local_shard

TIMEOUT = 60
GPT = {"hidden": 32, "heads": 2, "vocab": 64, "seq": 16, "layers": 1}
ODD = {**GPT, "hidden": 34, "vocab": 66}  # dp=4 divides no dim of most tensors: ZeRO pads their states


def _compile(tmp: Path, name: str, model: str, mesh: str, sets=None, microbatches: int = 1, zero: int = 0,
             megatron: bool = False, precision: str = "fp32", batch_size: int = 8) -> str:
    plan = compile_model(load_model(model, sets or {}), parse_mesh(mesh), batch_size=batch_size,
                         optimizer=OptimizerConfig(), pipeline=PipelineOptions(microbatches=microbatches),
                         memory=MemoryOptions(zero=zero, precision=Precision(precision)),
                         config=load_config("examples/gpt.megatron.toml") if megatron else None).plan
    path = tmp / f"{name}.json"
    save_plan(plan, str(path))
    return str(path)


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    os.chdir(ROOT)
    tmp = tmp_path_factory.mktemp("plans")
    return {
        "2x1x2": _compile(tmp, "2x1x2", "examples/gpt.py", "2x1x2", GPT, microbatches=2),
        "1x2x2": _compile(tmp, "1x2x2", "examples/gpt.py", "1x2x2", GPT, microbatches=2, megatron=True),
        "4x1x1": _compile(tmp, "4x1x1", "examples/gpt.py", "4x1x1", GPT),
        "1": _compile(tmp, "1", "examples/gpt.py", "1", GPT),
    }


def run(plan: str, steps: int, *, world: int, **kw) -> list[float]:
    """`sbpc run PLAN --steps STEPS` with its ranks as threads of this process; rank 0's losses."""
    payload = {"plan": plan, "steps": steps, "seed": 0, "backend": "cpu", "weights": None, "save": None,
               "save_every": None, "keep": 0, "resume": None, "threads": None, "timeout": TIMEOUT, "debug": False,
               "trace": None, **kw}
    return launch(world, "sbpc.runtime.cli:run_rank", payload, timeout=TIMEOUT, on_output=lambda r, line: None,
                  ranks="threads")[0]["losses"]


def cli(*args: str) -> subprocess.CompletedProcess:
    """`sbpc ARGS` in this process."""
    from sbpc.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(["sbpc", *args], code, out.getvalue(), err.getvalue())


def rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) / abs(x) for x, y in zip(a, b))


# ----- the regions of a shard are the shard

def test_the_regions_of_every_shard_are_what_local_shard_cuts():
    """For random nd-SBPs (plain and interleaved splits, nested on one dim, broadcasts) and
    ZeRO-style end padding, the regions of each device's shard hold exactly its elements."""
    rng = random.Random(0)
    for _ in range(200):
        sizes = tuple(rng.choice([1, 2, 3]) for _ in range(rng.randint(1, 3)))
        ndim = rng.randint(1, 3)
        nd = tuple(Split(rng.randrange(ndim), rng.choice([1, 1, 2, 3])) if rng.random() < 0.7 else Broadcast()
                   for _ in sizes)
        shape = [1] * ndim
        for s, k in zip(nd, sizes):
            if isinstance(s, Split):
                shape[s.dim] *= k * s.parts
        shape = [n * rng.choice([1, 2]) for n in shape]
        logical = [max(1, n - rng.choice([0, 0, 1])) for n in shape]
        t = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)
        inside = torch.zeros(shape, dtype=torch.bool)
        inside[tuple(slice(0, n) for n in logical)] = True
        for coords in itertools.product(*[range(k) for k in sizes]):
            shard, mask = local_shard(t, nd, coords, sizes), local_shard(inside, nd, coords, sizes)
            seen = torch.zeros_like(mask)
            for r in shard_regions(shape, logical, nd, coords, sizes):
                dst = tuple(slice(a, a + n) for a, n in zip(r.at, r.length))
                assert torch.equal(shard[dst], t[tuple(slice(o, o + n) for o, n in zip(r.offset, r.length))])
                assert not seen[dst].any()
                seen[dst] = True
            assert torch.equal(seen, mask), (nd, sizes, coords)


# ----- save and resume

def test_resume_continues_the_run_on_the_same_plan_and_on_other_layouts(plans, tmp_path):
    """The issue's figure at a small scale: save after step 3 on 2x1x2; resume on the same
    plan (bit for bit), on 1x2x2 (Megatron tp: interleaved qkv) and on 4x1x1."""
    full = run(plans["2x1x2"], 6, world=4)
    assert run(plans["2x1x2"], 6, world=4) == full  # same plan and seed: bit-identical run to run
    ckpt = tmp_path / "ckpt"
    assert run(plans["2x1x2"], 3, world=4, save=str(ckpt)) == full[:3]
    index = json.loads((ckpt / "step_00000003" / INDEX).read_text())
    assert sorted(index["files"]) == [f"rank0000{r}.safetensors" for r in range(4)]
    assert index["train"]["step"] == 3 and (ckpt / LATEST).read_text().strip() == "step_00000003"
    # replicated over dp: each tensor is written once, by the dp=0 rank of the stage that updates it
    # (pp is the outermost axis: ranks 0 and 2)
    assert {s["file"] for e in index["tensors"].values() for s in e["shards"]} == {"rank00000.safetensors",
                                                                                  "rank00002.safetensors"}
    assert run(plans["2x1x2"], 6, world=4, resume=str(ckpt)) == full[3:]
    assert rel(run(plans["1x2x2"], 6, world=4, resume=str(ckpt)), full[3:]) < 1e-5
    assert rel(run(plans["4x1x1"], 6, world=4, resume=str(ckpt)), full[3:]) < 1e-5


def test_zero_on_and_off_with_padded_states(tmp_path):
    """ZeRO-1 on dp=4 pads the states of tensors dp divides nowhere; a checkpoint stores only
    their logical part, and resumes into a plan without ZeRO (and back) continue the run."""
    zero = _compile(tmp_path, "zero", "examples/gpt.py", "4x1x1", ODD, zero=1)
    plain = _compile(tmp_path, "plain", "examples/gpt.py", "2", ODD)
    full = run(zero, 5, world=4)
    run(zero, 2, world=4, save=str(tmp_path / "z"))
    index = json.loads((tmp_path / "z" / "step_00000002" / INDEX).read_text())
    padded = index["tensors"]["exp_avg:wte.weight"]
    assert padded["shape"] == [66, 34] and len(padded["shards"]) == 4  # 68 rows padded, 17 a rank, cut at 66
    assert [s["regions"][0]["length"][0] for s in padded["shards"]] == [17, 17, 17, 15]
    assert rel(run(plain, 5, world=2, resume=str(tmp_path / "z")), full[2:]) < 1e-5
    run(plain, 3, world=2, resume=str(tmp_path / "z"), save=str(tmp_path / "p"))
    assert rel(run(zero, 5, world=4, resume=str(tmp_path / "p")), full[3:]) < 1e-5


def test_fp16_loss_scale_and_skipped_steps_are_carried(tmp_path):
    """The fp16 scaler's states are optimizer states: after an overflow (step 0 skipped, the
    scale halved) a resume, here onto one device, goes on with the halved scale."""
    two = _compile(tmp_path, "two", "tests/models/fp16_overflow.py", "2", precision="fp16", batch_size=4)
    one = _compile(tmp_path, "one", "tests/models/fp16_overflow.py", "1", precision="fp16", batch_size=4)
    full = run(two, 4, world=2)
    run(two, 2, world=2, save=str(tmp_path / "c"))
    states = dict(logical_tensors(str(tmp_path / "c"), kinds=("state",)))
    assert float(states["loss_scale"]) == 2.0**15 and int(states["skipped_steps"]) == 1
    assert run(two, 4, world=2, resume=str(tmp_path / "c")) == full[2:]
    proc = cli("run", one, "--steps", "4", "--resume", str(tmp_path / "c"))
    assert proc.returncode == 0, proc.stderr
    assert rel([float(x) for x in re.findall(r"lm loss: (\S+) \|", proc.stdout, re.M)], full[2:]) < 1e-5
    assert "1 of 4 steps skipped" in proc.stdout and "loss scale 32768" in proc.stdout


def test_running_statistics_the_forward_writes_are_saved_and_resumed(tmp_path):
    """BatchNorm's running statistics are buffers the step writes (docs/buffers.md): a checkpoint
    holds their values after the last step, and a run resumed from it (here on a pipeline of
    another layout) carries them on, so its buffers after step 6 are the straight run's."""
    model = "tests/models/resnet_bn.py"
    pipe = _compile(tmp_path, "pipe", model, "2x1x2")
    flat = _compile(tmp_path, "flat", model, "2")
    run(pipe, 3, world=4, save=str(tmp_path / "c"))
    saved = dict(logical_tensors(str(tmp_path / "c"), kinds=("buffer",)))
    assert int(saved["layer2.down.1.num_batches_tracked"]) == 3
    assert not torch.equal(saved["bn.running_var"], torch.ones_like(saved["bn.running_var"]))
    run(flat, 6, world=2, resume=str(tmp_path / "c"), save=str(tmp_path / "resumed"))
    run(pipe, 6, world=4, save=str(tmp_path / "straight"))
    resumed = dict(logical_tensors(str(tmp_path / "resumed"), kinds=("buffer",)))
    straight = dict(logical_tensors(str(tmp_path / "straight"), kinds=("buffer",)))
    assert int(resumed["bn.num_batches_tracked"]) == 6 and set(resumed) == set(straight)
    for name, t in straight.items():
        assert torch.allclose(resumed[name].double(), t.double(), rtol=1e-4, atol=1e-6), name


def test_the_data_position_is_resumed(plans, tmp_path):
    """On a token file the loader's position (epoch, sample) is saved and restored: the resumed
    run reads the batches the uninterrupted one read, and goes on across the epoch boundary."""
    import numpy as np

    data = tmp_path / "tokens.npy"
    np.save(data, np.random.default_rng(0).integers(0, 64, 16 * 8 * 3 + 1).astype(np.uint16))  # 3 steps an epoch
    full = run(plans["4x1x1"], 5, world=4, data=str(data))
    run(plans["4x1x1"], 2, world=4, data=str(data), save=str(tmp_path / "c"))
    index = json.loads((tmp_path / "c" / "step_00000002" / INDEX).read_text())
    assert index["train"]["data"] == {"epoch": 0, "index": 16}
    assert run(plans["4x1x1"], 5, world=4, data=str(data), resume=str(tmp_path / "c")) == full[2:]


def test_keep_rotates_and_latest_names_the_newest(plans, tmp_path):
    proc = cli("run", plans["1"], "--steps", "5", "--save", str(tmp_path), "--save-every", "2", "--keep", "2")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000004", "step_00000005"]
    assert (tmp_path / LATEST).read_text().strip() == "step_00000005"
    assert "saved checkpoint of step 4" in proc.stdout


def test_a_crash_mid_save_leaves_the_previous_checkpoint_latest(plans, tmp_path, monkeypatch):
    """Rank 1 fails while writing the checkpoint of step 4: the directory of step 2 stays the
    newest complete one, the half-written one is a .tmp- directory no reader takes, and a
    resume continues from step 2."""
    import sbpc.runtime.checkpoint as ck

    full = run(plans["4x1x1"], 4, world=4)
    write = ck._write_rank

    def dies_on_rank_1(runner, tmp):
        if runner.backend.communicator.rank == 1 and "step_00000004" in tmp:
            raise OSError(28, "No space left on device")
        return write(runner, tmp)

    monkeypatch.setattr(ck, "_write_rank", dies_on_rank_1)
    with pytest.raises(OutputError, match=r"rank 1: cannot write checkpoint .*step_00000004: No space left on device"):
        run(plans["4x1x1"], 4, world=4, save=str(tmp_path), save_every=2)
    monkeypatch.undo()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [".tmp-step_00000004", "latest", "step_00000002"], names
    assert not (tmp_path / ".tmp-step_00000004" / INDEX).exists()
    assert run(plans["4x1x1"], 4, world=4, resume=str(tmp_path)) == full[2:]


def test_a_killed_rank_ends_the_run_and_a_resume_reproduces_it_bit_for_bit(tmp_path):
    """Real processes: rank 1 dies (os._exit) in step 4 of 6; the run ends at once naming it;
    resuming from the last complete checkpoint (step 4) gives the uninterrupted losses."""
    plan = _compile(tmp_path, "dies", "tests/models/dies.py", "2")
    full = run(plan, 6, world=2)  # threads: gloo's results bit for bit on two ranks (tests/test_threads.py)
    exe = Path(sys.executable).parent / "sbpc"
    start = time.monotonic()
    proc = subprocess.run([str(exe), "run", plan, "--steps", "6", "--save", str(tmp_path / "c"), "--save-every", "2",
                           "--timeout", "30"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "SBPC_TEST_DIE": "1:5"})
    took = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr
    assert re.search(r"rank 1 exited with code 9", proc.stderr), proc.stderr
    assert took < 60, took
    assert (tmp_path / "c" / LATEST).read_text().strip() == "step_00000004"
    proc = cli("run", plan, "--steps", "6", "--resume", str(tmp_path / "c"))
    assert proc.returncode == 0, proc.stderr
    assert [float(x) for x in re.findall(r"lm loss: (\S+) \|", proc.stdout, re.M)] == pytest.approx(full[4:], rel=1e-5)
    assert run(plan, 6, world=2, resume=str(tmp_path / "c")) == full[4:]


# ----- export

def test_export_loads_into_the_plain_model(plans, tmp_path):
    from safetensors.torch import load_file, load_model as load_into_module

    from sbpc.runtime.model_file import import_model_file

    run(plans["2x1x2"], 2, world=4, save=str(tmp_path / "c"))
    proc = cli("export", str(tmp_path / "c"), "-o", str(tmp_path / "model.safetensors"))
    assert proc.returncode == 0, proc.stderr
    model = import_model_file("examples/gpt.py", "_gpt_export").build_model(**GPT)
    load_into_module(model, str(tmp_path / "model.safetensors"))  # strict; the tied head shares wte
    exported = load_file(str(tmp_path / "model.safetensors"))
    state = dict(logical_tensors(str(tmp_path / "c")))
    assert set(exported) == set(state) and all(torch.equal(exported[k], state[k]) for k in state)
    missing, unexpected = model.load_state_dict(exported, strict=False)
    assert not unexpected and all(model.state_dict()[k] is not None for k in missing)


def test_export_of_hugging_face_gpt2_loads_with_from_pretrained(tmp_path):
    from transformers import GPT2LMHeadModel

    from sbpc.runtime.model_file import import_model_file

    sets = {"layers": 1, "hidden": 32, "heads": 2, "vocab": 64, "seq": 8}
    plan = _compile(tmp_path, "hf", "examples/hf_gpt2.py", "1", sets, batch_size=2)
    assert cli("run", plan, "--steps", "1", "--save", str(tmp_path / "c")).returncode == 0
    hf = tmp_path / "hf"
    hf.mkdir()
    proc = cli("export", str(tmp_path / "c"), "-o", str(hf / "model.safetensors"), "--strip", "model.")
    assert proc.returncode == 0, proc.stderr
    import_model_file("examples/hf_gpt2.py", "_hf_export")._config(**sets).save_pretrained(hf)
    model = GPT2LMHeadModel.from_pretrained(hf)
    state = dict(logical_tensors(str(tmp_path / "c")))
    for name, t in model.state_dict().items():
        if f"model.{name}" in state:
            assert torch.equal(t, state[f"model.{name}"]), name
    assert torch.equal(model.lm_head.weight, state["model.transformer.wte.weight"])  # tied


# Bad checkpoints (missing, truncated or corrupt shards, a missing or other-schema index, another
# model, a --resume DIR that does not exist, bad --save/--keep/export arguments) are rows of the
# bad-input corpus, tests/test_bad_input.py ("ckpt-*", "export-*").
