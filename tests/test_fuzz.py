"""No internal error, ever: random small models (tests/fuzz_models.py) on random meshes either
compile or end in a one-line SbpcError with a hint. Any other exception is what the CLI reports
as exit code 3, a bug; the test fails with the seed, the mesh, the model and the traceback.

Each model is captured once and compiled on several meshes (``driver.compile_captured``):
capture is the cost, and a graph captured without stage hints serves every mesh of one batch
size. Everything is drawn from fixed seeds, so a run is deterministic; a failing case replays as

    sbpc compile tests/fuzz_models.py --set seed=S --mesh M --microbatches K --batch-size B --optimizer O

A few of the compiled cases also run, as in-process ranks (threads), against eager PyTorch.
``SBPC_FUZZ_MODELS=N`` and ``SBPC_FUZZ_FIRST=S`` sweep more (or other) models by hand.
"""
from __future__ import annotations

import io
import math
import os
import random
import time
import traceback
from dataclasses import dataclass, replace

import pytest

import fuzz_models
from conftest import ROOT
from sbpc.compiler.driver import compile_captured
from sbpc.compiler.frontend.capture import capture
from sbpc.compiler.frontend.model_loader import load_model
from sbpc.compiler.frontend.optim import OptimizerConfig
from sbpc.compiler.ir.mesh import parse_mesh
from sbpc.compiler.ir.printer import print_graph
from sbpc.compiler.pass_manager import CompileContext
from sbpc.compiler.passes import PipelineOptions
from sbpc.errors import SbpcError

MODEL_FILE = "tests/fuzz_models.py"
# The solver's cost grows with the axes (each alone, then jointly): every other model gets one
# mesh of two or three busy axes and three of one, the others four of one, to keep 200 cases
# within about four minutes.
SMALL_MESHES = ["1", "2x1", "1x2", "1x3", "3x1"]
WIDE_MESHES = ["2x2", "1x1x2", "2x1x2", "1x2x2"]
MODELS = int(os.environ.get("SBPC_FUZZ_MODELS", "50"))
FIRST = int(os.environ.get("SBPC_FUZZ_FIRST", "0"))
MESHES_PER_MODEL = 4  # 50 models x 4 meshes: 200 cases
PARITY_CASES = 10


@dataclass(frozen=True)
class Case:
    seed: int
    mesh: str
    microbatches: int
    allow_replicated: bool
    schedule: str = "1f1b"

    @property
    def pipeline(self) -> PipelineOptions:
        return PipelineOptions(schedule=self.schedule, virtual_stages=2 if self.schedule == "interleaved" else 1,
                               microbatches=self.microbatches)

    def replay(self, batch: int, optimizer: str) -> str:
        flags = " --allow-replicated" if self.allow_replicated else ""
        flags += f" --schedule {self.schedule}" if self.schedule != "1f1b" else ""
        return (f"sbpc compile {MODEL_FILE} --set seed={self.seed} --mesh {self.mesh} --microbatches "
                f"{self.microbatches} --batch-size {batch} --optimizer {optimizer}{flags}")


def draw(seed: int) -> tuple[list[Case], int, str]:
    """The meshes (with micro-batches) model ``seed`` is compiled on, its batch size, its optimizer."""
    r = random.Random(f"meshes-{seed}")
    cases = []
    wide = [r.choice(WIDE_MESHES)] if seed % 2 else []
    for mesh in r.sample(SMALL_MESHES, MESHES_PER_MODEL - len(wide)) + wide:
        pp = parse_mesh(mesh).size("pp")
        m = r.choice([pp, 2 * pp]) if pp > 1 else r.choice([1, 1, 1, 2])
        schedule = r.choice(["1f1b", "1f1b", "gpipe", "interleaved"]) if pp > 1 else "1f1b"
        cases.append(Case(seed, mesh, m, allow_replicated=r.random() < 0.75, schedule=schedule))
    # one batch serves every mesh: a multiple of each dp x micro-batches
    batch = math.lcm(4, *(parse_mesh(c.mesh).size("dp") * c.microbatches for c in cases))
    return cases, batch, r.choice(["sgd"] * 5 + ["adamw"])


@dataclass
class Outcome:
    case: Case
    plan: object = None
    error: str = ""  # the one-line SbpcError, when the case ended in one
    bug: str = ""  # anything else: the description and the traceback


def run_model(seed: int) -> list[Outcome]:
    cases, batch, opt_kind = draw(seed)
    spec = fuzz_models.describe(seed)
    optimizer = OptimizerConfig(kind=opt_kind)
    source = load_model(MODEL_FILE, {"seed": seed})

    def bug(case: Case, what: str) -> str:
        return (f"{what}\n  replay: {case.replay(batch, opt_kind)}\n  model: {spec.short()}\n"
                + traceback.format_exc())

    try:
        graph = capture(source, parse_mesh("1"), batch, optimizer)
    except SbpcError as err:
        return [judge(Outcome(c), err) for c in cases]
    except Exception as err:  # noqa: BLE001 - the point of the test: report every other exception
        return [Outcome(c, bug=bug(c, f"capture raised {type(err).__name__}")) for c in cases]
    before = print_graph(graph)
    out = []
    for case in cases:
        mesh = parse_mesh(case.mesh).with_microbatches(case.microbatches)
        ctx = CompileContext(log=io.StringIO(), allow_replicated=case.allow_replicated)
        try:
            result = compile_captured(replace(graph, mesh=mesh), source, batch_size=batch, optimizer=optimizer, ctx=ctx,
                                      pipeline=case.pipeline)
            out.append(Outcome(case, plan=result.plan))
        except SbpcError as err:
            out.append(judge(Outcome(case), err))
        except Exception as err:  # noqa: BLE001
            out.append(Outcome(case, bug=bug(case, f"compile raised {type(err).__name__}: {str(err)[:300]}")))
    # reusing one capture for every mesh is sound only if no pass changes the graph it was given
    assert print_graph(graph) == before, f"a pass mutated the captured graph of seed {seed}"
    return out


def judge(outcome: Outcome, err: SbpcError) -> Outcome:
    text = str(err)
    if "\n" in text or "hint:" not in text:
        outcome.bug = f"{type(err).__name__} is not one line with a hint: {text!r}"
    else:
        outcome.error = text
    return outcome


@pytest.fixture(scope="module")
def outcomes() -> list[Outcome]:
    os.chdir(ROOT)  # before the autouse fixture: plans record the model path relative to the root
    t0, c0 = time.perf_counter(), time.process_time()
    out = [o for seed in range(FIRST, FIRST + MODELS) for o in run_model(seed)]
    ok = sum(1 for o in out if o.plan is not None)
    errors = sum(1 for o in out if o.error)
    print(f"\nfuzz: {len(out)} cases ({MODELS} models): {ok} compiled, {errors} SbpcErrors, "
          f"{len(out) - ok - errors} internal errors, {time.perf_counter() - t0:.0f} s ({time.process_time() - c0:.0f} s CPU)")
    return out


def test_no_internal_error(outcomes):
    assert len(outcomes) >= 200 or MODELS < 50
    bugs = [o.bug for o in outcomes if o.bug]
    assert not bugs, f"{len(bugs)} of {len(outcomes)} cases raised an internal error:\n\n" + "\n\n".join(bugs)


def test_most_cases_compile(outcomes):
    """A fuzz that only ever reaches an error says nothing about the passes behind it."""
    ok = [o for o in outcomes if o.plan is not None]
    assert len(ok) >= len(outcomes) // 2, sorted({o.error.split(";")[0] for o in outcomes if o.error})


def parity_cases(outcomes) -> list[Outcome]:
    """Up to PARITY_CASES compiled cases on more than one device, one per model. Dropout stays in
    (random ops draw the logical tensor at eager's stream position, docs/sbp_rules.md), and so does
    a LayerNorm over 2 features: its output is +-1 whatever the input, so the gradients below it are
    rounding residue, which the check judges on eager's own float32 error (docs/check.md)."""
    seen, out = set(), []
    for o in outcomes:
        if o.plan is not None and o.plan.world_size > 1 and o.case.seed not in seen:
            seen.add(o.case.seed)
            out.append(o)
    return out[:PARITY_CASES]


def test_compiled_cases_match_eager(outcomes):
    from sbpc.compiler.tools.check import check_on_ranks

    picked = parity_cases(outcomes)
    assert len(picked) >= (5 if MODELS >= 50 else 1)
    failed = []
    for o in picked:
        _, batch, opt_kind = draw(o.case.seed)
        try:
            report = check_on_ranks(o.plan, OptimizerConfig(kind=opt_kind), steps=1, seed=0, tolerance=1e-5,
                                    timeout=60, ranks="threads")
        except Exception:  # noqa: BLE001 - a compiled plan must run: any error is a failure, with its replay
            failed.append(f"{o.case.replay(batch, opt_kind)}\n{traceback.format_exc()}")
            continue
        if not report.passed:
            failed.append(f"{o.case.replay(batch, opt_kind)}\n{report.table()}")
    assert not failed, "\n\n".join(failed)
