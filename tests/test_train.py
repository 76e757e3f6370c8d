"""Training on data: the loader (files, order, resume, sharding), the LR schedule, the FLOPs of
the log, and `sbpc run --data` on in-process ranks (docs/training.md)."""
from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch

from conftest import MODELS

from sbpc.errors import DataError, UsageError
from sbpc.runtime.data import (LmLayout, LmLoader, LoaderState, Tokens, check_data, DataOptions, lm_layout, open_tokens,
                               plan_vocab)
from sbpc.runtime.lr_schedule import DecayStyle, LrSchedule
from sbpc.runtime.plan import ModelRef

TINY = str(MODELS / "tiny_lm.py")
B, SEQ, HIDDEN, VOCAB = 8, 8, 16, 256


def _layout(batch=4, seq=5, offsets=(0, 1)) -> LmLayout:
    return LmLayout(batch, seq, offsets, (torch.int64,) * len(offsets))


def _tokens(n=203) -> Tokens:
    return Tokens("mem", np.arange(n, dtype=np.uint16) % 251, "test")


def _draw(loader, n):
    return [tuple(t.clone() for t in loader.next()) for _ in range(n)]


# ----- the schedule


def test_lr_schedule_warms_up_linearly_then_decays_by_cosine_to_the_floor():
    s = LrSchedule(lr=1.0, min_lr=0.1, warmup_steps=4, decay_steps=14)
    assert [s(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s(4) == 1.0  # the decay starts at the peak
    assert s(9) == pytest.approx(0.1 + 0.9 * 0.5)  # half way: cos(pi/2)
    assert s(14) == s(100) == 0.1
    assert LrSchedule(lr=1.0, warmup_steps=2, decay_steps=6, style=DecayStyle.LINEAR)(4) == pytest.approx(0.5)
    assert LrSchedule(lr=0.3)(10**6) == 0.3  # no decay asked: constant


def test_lr_schedule_refuses_a_decay_that_ends_inside_the_warmup():
    with pytest.raises(UsageError, match="ends before the warmup"):
        LrSchedule(lr=1.0, warmup_steps=10, decay_steps=5)
    with pytest.raises(UsageError, match="--min-lr 2 must be between 0 and --lr 1"):
        LrSchedule(lr=1.0, min_lr=2.0)


# ----- the loader


def test_windows_give_inputs_and_next_token_targets():
    loader = LmLoader(_tokens(), _layout(), seed=0)
    ids, targets = loader.next()
    assert ids.shape == targets.shape == (4, 5)
    assert torch.equal(targets[:, :-1], ids[:, 1:])  # the targets are the inputs one token later
    assert all(int(row[0]) % 5 == 0 for row in ids)  # windows start at multiples of seq


def test_the_order_is_a_seeded_permutation_per_epoch():
    loader = LmLoader(_tokens(), _layout(), seed=0)
    assert loader.windows == 40  # (203 - 6) // 5 + 1
    starts = [int(ids[r, 0]) // 5 for ids, _ in _draw(loader, 10) for r in range(4)]
    assert sorted(starts) == list(range(40))  # one epoch: every window once
    again = [int(ids[r, 0]) // 5 for ids, _ in _draw(LmLoader(_tokens(), _layout(), seed=0), 10) for r in range(4)]
    other = [int(ids[r, 0]) // 5 for ids, _ in _draw(LmLoader(_tokens(), _layout(), seed=1), 10) for r in range(4)]
    assert starts == again and starts != other
    assert loader.state() == LoaderState(epoch=1, index=0)


def test_restore_continues_exactly_mid_epoch_and_across_the_epoch_boundary():
    whole = _draw(LmLoader(_tokens(), _layout(batch=3), seed=7), 20)  # 40 windows: batches straddle epochs
    first = LmLoader(_tokens(), _layout(batch=3), seed=7)
    _draw(first, 6)
    saved = LoaderState.model_validate(json.loads(json.dumps(first.state().model_dump())))  # as a checkpoint keeps it
    assert saved == LoaderState(epoch=0, index=18)
    resumed = LmLoader(_tokens(), _layout(batch=3), seed=7)
    resumed.restore(saved)
    rest = _draw(resumed, 14)
    for a, b in zip(whole[6:], rest):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_labels_equal_to_the_inputs_when_the_model_shifts_them():
    ids, labels = LmLoader(_tokens(), _layout(offsets=(0, 0)), seed=0).next()
    assert torch.equal(ids, labels)


# ----- files


def test_npy_bin_and_text_files(tmp_path):
    ids = np.array([1, 2, 300, 65535], dtype=np.uint16)
    np.save(tmp_path / "t.npy", ids)
    assert open_tokens(str(tmp_path / "t.npy")).ids.tolist() == ids.tolist()
    ids.astype(np.uint32).tofile(tmp_path / "t.bin")
    assert open_tokens(str(tmp_path / "t.bin"), dtype="uint32").ids.tolist() == ids.tolist()
    (tmp_path / "t.bin.json").write_text('{"dtype": "uint32"}')
    assert open_tokens(str(tmp_path / "t.bin")).ids.tolist() == ids.tolist()  # the sidecar names the dtype
    (tmp_path / "t.txt").write_text("hé")
    assert open_tokens(str(tmp_path / "t.txt")).ids.tolist() == [104, 0xC3, 0xA9]  # UTF-8 bytes


@pytest.mark.parametrize("make, flags, message", [
    (lambda p: p.write_bytes(b""), {}, r"is empty"),
    (lambda p: None, {}, r"does not exist"),
    (lambda p: p.write_bytes(b"\0" * 7), {"dtype": "uint16"}, r"has 7 bytes, not a whole number of uint16 tokens"),
    (lambda p: p.write_bytes(b"\0" * 8), {}, r"dtype of raw token file .* is unknown"),
])
def test_bad_token_files_are_data_errors(tmp_path, make, flags, message):
    path = tmp_path / "t.bin"
    make(path)
    with pytest.raises(DataError, match=message):
        open_tokens(str(path), **flags)


def test_a_float_npy_and_non_utf8_text_are_refused(tmp_path):
    np.save(tmp_path / "f.npy", np.zeros(4, dtype=np.float32))
    with pytest.raises(DataError, match=r"is a float32 array .* 1-D uint16 or uint32"):
        open_tokens(str(tmp_path / "f.npy"))
    (tmp_path / "x.txt").write_bytes(b"ok \xff")
    with pytest.raises(DataError, match=r"byte 3 is not UTF-8"):
        open_tokens(str(tmp_path / "x.txt"))


def test_a_tokenizers_json_file_tokenizes_text(tmp_path, monkeypatch):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tok = tokenizers.Tokenizer(WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(tmp_path / "tok.json"))
    (tmp_path / "t.txt").write_text("hello world hello there")
    assert open_tokens(str(tmp_path / "t.txt"), tokenizer=str(tmp_path / "tok.json")).ids.tolist() == [1, 2, 1, 0]
    monkeypatch.setitem(__import__("sys").modules, "tokenizers", None)  # as if not installed
    with pytest.raises(UsageError, match="--tokenizer needs the `tokenizers` package"):
        open_tokens(str(tmp_path / "t.txt"), tokenizer=str(tmp_path / "tok.json"))


def test_the_stdlib_corpus_is_deterministic_and_byte_level(tmp_path):
    from sbpc.runtime.corpus import build_corpus

    a = build_corpus(str(tmp_path / "a"), max_bytes=200_000)
    b = build_corpus(str(tmp_path / "b"), max_bytes=200_000)
    assert open(a, "rb").read() == open(b, "rb").read()
    tokens = open_tokens(a)  # the sidecar names the dtype
    assert tokens.ids.size == 200_000 and int(tokens.ids.max()) < 256
    assert bytes(tokens.ids[:200].astype(np.uint8)).decode().startswith('"""')  # Python source


# ----- with a plan: vocabulary, sharding, FLOPs, a run


@pytest.fixture(scope="module")
def tiny_plan(tmp_path_factory):
    from sbpc.compiler.driver import compile_model
    from sbpc.compiler.frontend.model_loader import load_model
    from sbpc.compiler.frontend.optim import OptimizerConfig
    from sbpc.compiler.ir.mesh import parse_mesh
    from sbpc.compiler.passes import PipelineOptions
    from sbpc.runtime.plan import save_plan

    plan = compile_model(load_model(TINY, {}), parse_mesh("2x1x2"), batch_size=B,
                         optimizer=OptimizerConfig(lr=1e-2, clip_grad=1.0), pipeline=PipelineOptions(microbatches=2)).plan
    path = tmp_path_factory.mktemp("plan") / "tiny.json"
    save_plan(plan, str(path))
    return plan, str(path)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from sbpc.runtime.corpus import build_corpus

    return build_corpus(str(tmp_path_factory.mktemp("corpus")), max_bytes=300_000)


def test_a_token_beyond_the_vocabulary_is_an_error_naming_file_id_and_vocab(tiny_plan, tmp_path):
    plan, _ = tiny_plan
    assert plan_vocab(plan) == VOCAB  # the rows of the embedding the ids index
    ids = np.arange(100, dtype=np.uint16) % 200
    ids[57] = 300
    np.save(tmp_path / "ids.npy", ids)
    with pytest.raises(DataError, match=r"token id 300 at position 57 of '.*ids\.npy' is beyond the model's "
                                        r"vocabulary of 256"):
        check_data(plan, DataOptions(path=str(tmp_path / "ids.npy")))


def test_each_rank_reads_its_slice_of_the_global_batch(tiny_plan):
    """The local batch a rank builds is the cut the runner makes of the global batch: on 2x1x2
    with 2 micro-batches, dp rank d holds rows {2d, 2d+1} of micro-batch 0 and {4+2d, 4+2d+1}."""
    from sbpc.runtime.backend import make_backend
    from sbpc.runtime.pipeline import PipelineRunner
    from sbpc.runtime.thread_launch import launch_threads
    from sbpc.runtime import dist

    plan, _ = tiny_plan
    layout = _layout(batch=B, seq=SEQ)

    def rank(_):
        comm = dist.init_distributed(plan, timeout=60)
        runner = PipelineRunner(plan, make_backend("cpu", comm), seed=0)
        whole = LmLoader(_tokens(2000), layout, seed=3)
        mine = LmLoader(_tokens(2000), layout, seed=3, cut=runner.batch_part)
        out = []
        for _ in range(3):
            g, part = whole.next(), mine.next()
            assert all(torch.equal(runner.batch_part(t, i), p) for i, (t, p) in enumerate(zip(g, part.tensors)))
            out.append((comm.rank, [int(x) for x in part.tensors[0][:, 0]], [int(x) for x in g[0][:, 0]]))
        return out

    results = launch_threads(4, rank, None, timeout=60)
    for per_rank in results:
        for r, rows, whole in per_rank:
            d = plan.coords(r)["dp"]
            assert rows == [whole[i] for i in (2 * d, 2 * d + 1, 4 + 2 * d, 5 + 2 * d)]


def test_model_flops_count_the_matmuls_and_attention_of_the_forward_three_times(tiny_plan):
    from sbpc.runtime.flops import step_flops

    plan, _ = tiny_plan
    tokens = B * SEQ
    forward = 2 * tokens * HIDDEN * 3 * HIDDEN + 2 * tokens * HIDDEN * HIDDEN + 2 * tokens * HIDDEN * VOCAB \
        + 4 * B * SEQ * SEQ * HIDDEN
    assert step_flops(plan) == 3 * forward


def test_sbpc_run_on_the_corpus_lowers_the_loss_and_logs_megatrons_keys(tiny_plan, corpus, tmp_path, capsys):
    from sbpc.cli import main

    _, path = tiny_plan
    metrics = tmp_path / "m.jsonl"
    assert main(["run", path, "--ranks", "threads", "--data", corpus, "--steps", "30", "--log-interval", "10",
                 "--lr-warmup-steps", "5", "--lr-decay-steps", "30", "--min-lr", "1e-3",
                 "--metrics", str(metrics), "--timeout", "120"]) == 0
    out = capsys.readouterr().out
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [x["iteration"] for x in lines] == [10, 20, 30]
    assert [x["consumed samples"] for x in lines] == [80, 160, 240]
    schedule = LrSchedule(lr=1e-2, min_lr=1e-3, warmup_steps=5, decay_steps=30)
    assert [x["learning rate"] for x in lines] == [schedule(9), schedule(19), schedule(29)]  # the step's own rate
    assert all(x["grad norm"] > 0 for x in lines)  # the plan clips, so it reports the norm
    assert lines[-1]["lm loss"] < lines[0]["lm loss"] - 0.3 and lines[0]["lm loss"] < math.log(VOCAB), lines
    assert set(lines[0]) == {"iteration", "consumed samples", "elapsed time per iteration (ms)",
                             "throughput per device (TFLOP/s/device)", "learning rate", "global batch size", "lm loss",
                             "loss scale", "grad norm", "number of skipped iterations", "number of nan iterations"}
    logged = re.findall(r"^ iteration +(\d+)/ +30 \| consumed samples: +(\d+) \| elapsed time per iteration \(ms\): "
                        r"[\d.]+ \| throughput per device \(TFLOP/s/device\): \S+ \| learning rate: \S+ \| "
                        r"global batch size: +8 \| lm loss: (\S+) \| loss scale: 1\.0 \| grad norm: [\d.]+ \| "
                        r"number of skipped iterations: +0 \| number of nan iterations: +0 \|$", out, re.M)
    assert [(int(i), float(loss)) for i, _, loss in logged] == [(x["iteration"], pytest.approx(x["lm loss"], rel=1e-6))
                                                                for x in lines]
    assert re.search(r"^memory after step 1 \(MiB per rank, resident set of the process\): r0:\S+ r1:\S+ r2:\S+ r3:\S+; "
                     r"estimated \(plan tensors only, docs/memory\.md\): stage 0:\S+ stage 1:\S+$", out, re.M), out


# ----- the other sources, the log's parts


def test_a_model_files_batches_resume_by_drawing_again():
    from types import SimpleNamespace

    from sbpc.runtime.data import ModelBatches

    def batches(path, batch_size, seed, scale=1):
        gen = torch.Generator().manual_seed(seed)
        while True:
            yield torch.randint(0, 9, (batch_size, 3), generator=gen) * scale, torch.zeros(batch_size)

    plan = SimpleNamespace(model=ModelRef(batch_size=2, sets={"scale": 10}, path="m.py"))
    first = ModelBatches(batches, "data", plan, seed=5)
    whole = [first.next() for _ in range(5)]
    assert int(whole[0][0].max()) % 10 == 0  # the --set values reach batches()
    again = ModelBatches(batches, "data", plan, seed=5)
    again.restore(LoaderState(index=3))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(whole[3:], [again.next(), again.next()]))


def test_a_hugging_face_dict_batch_takes_windows_and_a_mask_of_ones():
    """tests/zoo/mistral.py's batch is {input_ids, attention_mask, labels=input_ids}: the ids
    and the labels get the same window (the model shifts), the mask is ones, by its name."""
    from sbpc.compiler.driver import compile_model
    from sbpc.compiler.frontend.model_loader import load_model
    from sbpc.compiler.frontend.optim import OptimizerConfig
    from sbpc.compiler.ir.mesh import parse_mesh
    from sbpc.runtime.data import _example, model_module

    plan = compile_model(load_model("tests/zoo/mistral.py"), parse_mesh("1"), batch_size=2,
                         optimizer=OptimizerConfig()).plan
    assert plan.model.batch_keys == ["input_ids", "attention_mask", "labels"]
    layout = lm_layout(plan, _example(model_module(plan), plan))
    assert layout.offsets == (0, None, 0) and layout.span == layout.seq == 16
    ids, mask, labels = LmLoader(_tokens(), layout, seed=0).next()
    assert torch.equal(ids, labels) and torch.equal(mask, torch.ones(2, 16, dtype=torch.int64))
    assert not torch.equal(ids[:, 1:], ids[:, :-1])  # real windows, not a constant


def test_a_model_files_dict_batches_are_taken_by_the_plans_keyword_names():
    """batches() may yield dicts in any order: they reach the plan in example_batch's order
    (plan.model.batch_keys); a batch without one of the names is a clear error."""
    from types import SimpleNamespace

    from sbpc.errors import ModelError
    from sbpc.runtime.data import ModelBatches

    def batches(path, batch_size, seed):
        yield {"labels": torch.ones(batch_size), "input_ids": torch.zeros(batch_size, 3)}
        yield {"input_ids": torch.zeros(batch_size, 3)}

    plan = SimpleNamespace(model=ModelRef(batch_size=2, path="m.py", batch_keys=["input_ids", "labels"]))
    loader = ModelBatches(batches, "data", plan, seed=0)
    ids, labels = loader.next()
    assert ids.shape == (2, 3) and torch.equal(labels, torch.ones(2))
    with pytest.raises(ModelError, match="gave a batch without 'labels'"):
        loader.next()


def test_the_launcher_turns_rank_zeros_progress_lines_into_its_bar():
    import io

    from sbpc.runtime.train_log import PROGRESS_MARK, ProgressRelay

    out = io.StringIO()
    relay = ProgressRelay(out)
    relay.line("before the first step\n")
    relay.line(f"{PROGRESS_MARK}1 4 5.5\n")
    relay.line(" iteration        1/       4 | ...\n")
    relay.line(f"{PROGRESS_MARK}4 4 3.25\n")
    relay.close()
    text = out.getvalue()
    assert PROGRESS_MARK not in text and "before the first step\n" in text and " iteration        1/" in text
    assert "4/4" in text and "lm loss 3.2500" in text  # tqdm's bar, drawn by the launcher


def test_tensorboard_without_its_package_is_a_usage_error(tmp_path, monkeypatch):
    from sbpc.runtime.train_log import LogOptions, check_log_options

    monkeypatch.setitem(__import__("sys").modules, "torch.utils.tensorboard", None)
    with pytest.raises(UsageError, match="--tensorboard needs the tensorboard package"):
        check_log_options(LogOptions(tensorboard=str(tmp_path / "tb")))


def test_model_flops_count_a_mixture_of_experts_active_experts():
    """Mixtral (tests/zoo/mixtral.py): its projections, router, attention and head, and the
    experts' grouped products over the token-expert pairs (each token meets its top-k experts
    only), the forward three times."""
    from sbpc.compiler.driver import compile_model
    from sbpc.compiler.frontend.model_loader import load_model
    from sbpc.compiler.frontend.optim import OptimizerConfig
    from sbpc.compiler.ir.mesh import parse_mesh
    from sbpc.runtime.flops import step_flops

    batch = 4
    plan = compile_model(load_model("tests/zoo/mixtral.py", {}), parse_mesh("1"), batch_size=batch,
                         optimizer=OptimizerConfig()).plan
    tokens, hidden, kv, experts, vocab, ffn, top_k, seq, heads, head_dim = batch * 16, 64, 32, 4, 256, 128, 2, 16, 4, 16
    pairs = tokens * top_k
    layer = 2 * tokens * hidden * (2 * hidden + 2 * kv + experts) + 4 * batch * heads * seq * seq * head_dim \
        + 2 * pairs * hidden * 2 * ffn + 2 * pairs * ffn * hidden
    assert step_flops(plan) == 3 * (2 * layer + 2 * tokens * hidden * vocab)
