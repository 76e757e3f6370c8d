"""Training steps/s of an sbpc pipelined plan (mesh 1x1xP) vs torch.distributed.pipelining's
Schedule1F1B: P ranks (P = 2 and 4) over gloo.

Same model (examples/gpt.py), same batch, same micro-batch count, same seeded weights and
batches, same plain SGD (lr ``--lr``, no momentum, no weight decay, single-tensor: foreach=False)
and 1 torch thread per rank on both sides. The plan is compiled once per (mesh, M) in this
process (``compile_model`` with ``PipelineOptions(schedule="1f1b", virtual_stages=1,
microbatches=M)``) and saved to a temporary file; then each side runs as its own
``sbpc.runtime.launch.launch(P, ...)`` of P fresh processes joined over gloo:

  plan      make_runner(plan, make_backend("cpu", comm, comm.topology), seed=0) (a
            PipelineRunner); a step is runner.step(batch): the rank's 1F1B order of forward
            and backward tasks over the M micro-batches (activations and their gradients sent
            point to point), the gradient accumulation, the SGD update of the stage's
            parameters, and the loss broadcast from the last stage, returned as a float.
  pipelining
            torch.manual_seed(0); build_model(); then rank s keeps a stage module holding the
            same modules the plan put on stage s, whatever split the compiler chose (read
            from the plan's task graph: wte+wpe and the first blocks on stage 0, lm_head on
            the last; ln_f may sit on the stage before lm_head's, as the cost-balanced policy
            puts it on pp=4); a stage module's forward is gpt.py's forward cut at the stage
            (stage 0 takes idx, the others the hidden states, the last returns the logits). PipelineStage(stage_module, s, P, cpu) (shapes
            inferred on the first step), Schedule1F1B(stage, n_microbatches=M,
            loss_fn=cross-entropy mean over the micro-batch's tokens) with its default
            scale_grads=True, so the accumulated gradient is that of the mean of the M
            micro-batch losses = the global token mean (equal micro-batches), as in the plan.
            A step is opt.zero_grad(set_to_none=True); schedule.step(idx on stage 0,
            target=targets and losses=[] on the last, return_outputs=False); opt.step();
            then the last stage's mean loss broadcast to every rank and float() of it, as
            runner.step returns it.

Batches are the plan's ``BatchSource(plan, 0)``, generated before timing. Each rank runs
``--warmup`` untimed steps, barrier, the ``--steps`` timed steps, barrier; a run's time is the
slowest rank's (the rank-0 wall time between the barriers, give or take a barrier's exit).
Sides alternate over ``--rounds`` launches (plan first, then torch first, ...) and the median
run of each side is reported, with **ratio = plan steps/s / torch steps/s** (above 1: the plan
is faster). Both sides' step-0 losses are printed with their relative difference, as a check
that they train the same model (same weights, same batch, same split into micro-batches).

Default config: ``--set preset=tiny --set layers=4 --set hidden=256 --set heads=4 --set
vocab=2048 --set seq=64`` (4.2 M parameters), batch 16 (1024 tokens), meshes 1x1x2 and
1x1x4, M = 4 and 8. With P = 4 ranks on a 2-core box, the ranks share cores (both sides alike).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
DEFAULT_SETS = ["preset=tiny", "layers=4", "hidden=256", "heads=4", "vocab=2048", "seq=64"]
DEFAULT_BATCH = 16
DEFAULT_MESHES = ["1x1x2", "1x1x4"]
DEFAULT_MICROBATCHES = [4, 8]
PEER = "torch"


def sgd(lr: float):
    from sbpc.compiler.frontend.optim import OptimizerConfig

    return OptimizerConfig(kind="sgd", lr=lr, momentum=0.0, weight_decay=0.0)


def compile_pp_plan(model: str, sets: list[str], mesh: str, batch_size: int, microbatches: int, lr: float,
                    tmpdir: str) -> str:
    """Compile ``model`` for the pipelined ``mesh`` (1F1B, ``microbatches``, plain SGD) and save
    the plan; returns its path."""
    from sbpc.compiler.driver import compile_model
    from sbpc.compiler.ir.mesh import parse_mesh
    from sbpc.compiler.frontend.model_loader import load_model, parse_sets
    from sbpc.compiler.passes import PipelineOptions
    from sbpc.runtime.plan import save_plan

    start = time.perf_counter()
    plan = compile_model(load_model(model, parse_sets(sets)), parse_mesh(mesh), batch_size=batch_size,
                         optimizer=sgd(lr),
                         pipeline=PipelineOptions(schedule="1f1b", virtual_stages=1, microbatches=microbatches)).plan
    path = os.path.join(tmpdir, f"plan-{mesh}-m{microbatches}-{len(os.listdir(tmpdir))}.json")
    save_plan(plan, path)
    print(f"compiled mesh {mesh}, {microbatches} micro-batches, in {time.perf_counter() - start:.1f}s "
          f"(the schedule's bubble: {plan.pipeline.bubble:.2f})", flush=True)
    return path


HEAD = ("ln_f", "lm_head")  # gpt.py's modules after the blocks, in forward order


def plan_stages(path: str) -> list[dict]:
    """Which of gpt.py's modules the plan put on each pipeline stage: per stage ``{"embed":
    bool, "blocks": [i, ...], "ln_f": bool, "lm_head": bool}``, whatever split the compiler's
    stage policy chose (the head may be cut between ln_f and lm_head). Raises when the split is
    not one the torch side can reproduce with whole modules in forward order (e.g. a parameter
    on two stages)."""
    from sbpc.runtime.pipeline import plan_task_graph
    from sbpc.runtime.plan import load_plan

    plan = load_plan(path)
    p = plan.pipeline.stages
    if plan.pipeline.virtual_stages != 1:
        raise ValueError("the torch side builds one stage per rank (virtual_stages=1)")
    graph = plan_task_graph(plan)
    where: dict[str, set[int]] = {}
    for key, body in graph.bodies.items():  # key: (chunk, phase, ...)
        for prm in plan.params:
            if prm.value in body.inputs:
                where.setdefault(prm.name, set()).add(key[0] % p)
    stages = [{"embed": False, "blocks": [], **{h: False for h in HEAD}} for _ in range(p)]
    for name, chunks in sorted(where.items()):
        if len(chunks) != 1:
            raise ValueError(f"the plan uses parameter {name} on stages {sorted(chunks)}; the torch side cannot split so")
        s = next(iter(chunks))
        m = re.match(r"h\.(\d+)\.", name)
        if m:
            if int(m.group(1)) not in stages[s]["blocks"]:
                stages[s]["blocks"].append(int(m.group(1)))
        elif name.startswith(("wte.", "wpe.")):
            stages[s]["embed"] = True
        elif name.split(".")[0] in HEAD:
            stages[s][name.split(".")[0]] = True
    for st in stages:
        st["blocks"].sort()
    # every module on exactly one stage, and the stage never decreases along gpt.py's forward
    sequence = [[s for s, st in enumerate(stages) if st["embed"]]]
    blocks = sorted(b for st in stages for b in st["blocks"])
    sequence += [[s for s, st in enumerate(stages) if b in st["blocks"]] for b in blocks]
    sequence += [[s for s, st in enumerate(stages) if st[h]] for h in HEAD]
    placed = [s[0] for s in sequence if len(s) == 1]
    if (len(placed) != len(sequence) or placed != sorted(placed) or blocks != list(range(len(blocks)))
            or placed[-1] != p - 1):
        raise ValueError(f"the plan's stage split {stages} is not gpt.py's modules in forward order, "
                         "each on one stage, the head's last on the last stage")
    return stages


def describe_stages(stages: list[dict]) -> str:
    def one(st):
        parts = (["wte+wpe"] if st["embed"] else []) + \
                ([f"h.{st['blocks'][0]}-{st['blocks'][-1]}" if len(st["blocks"]) > 1 else f"h.{st['blocks'][0]}"]
                 if st["blocks"] else []) + [h for h in HEAD if st[h]]
        return "+".join(parts) or "(empty)"
    return " | ".join(one(st) for st in stages)


# --- ranks ---------------------------------------------------------------------------------

def _stage_module(model, spec: dict):
    """A torch.nn.Module of gpt.py's layers on one stage: forward(idx) on the first stage,
    forward(x) on the others; the last returns the logits."""
    import torch
    import torch.nn as nn

    class Stage(nn.Module):
        def __init__(self):
            super().__init__()
            if spec["embed"]:
                self.wte, self.wpe, self.drop = model.wte, model.wpe, model.drop
            self.h = nn.ModuleList(model.h[i] for i in spec["blocks"])
            for h in HEAD:
                if spec[h]:
                    setattr(self, h, getattr(model, h))

        def forward(self, x):
            if spec["embed"]:  # gpt.py's forward, up to the blocks
                pos = torch.arange(x.shape[1], device=x.device)
                x = self.drop(self.wte(x) + self.wpe(pos))
            for block in self.h:
                x = block(x)
            for h in HEAD:  # gpt.py: logits = lm_head(ln_f(x))
                if spec[h]:
                    x = getattr(self, h)(x)
            return x

    return Stage()


def _loss_fn(logits, targets):
    """gpt.py's loss on one micro-batch: cross-entropy, mean over its tokens."""
    import torch.nn.functional as F

    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def pipelining_worker(payload: dict) -> dict:
    """Launch target: one rank of torch.distributed.pipelining's Schedule1F1B."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from dp_vs_ddp import time_steps
    from sbpc.runtime.model_file import import_model_file
    from sbpc.runtime.plan import load_plan
    from sbpc.runtime.runner import BatchSource

    plan = load_plan(payload["plan"])  # for the model file, its --set values and the batches only
    rank, world = dist.get_rank(), dist.get_world_size()
    stages = payload["stages"]
    assert len(stages) == world, (len(stages), world)
    module = import_model_file(plan.model.path, "_bench_pp_")
    torch.manual_seed(0)
    model = module.build_model(**plan.model.sets).train()
    stage_mod = _stage_module(model, stages[rank])
    del model
    stage = PipelineStage(stage_mod, rank, world, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=payload["microbatches"], loss_fn=_loss_fn)
    opt = sgd(payload["lr"]).torch_optimizer([p for p in stage_mod.parameters() if p.requires_grad])
    make = BatchSource(plan, 0)
    batches = [make(i) for i in range(payload["warmup"] + payload["steps"])]
    first, last = rank == 0, rank == world - 1

    def step(batch) -> float:
        idx, targets = batch
        opt.zero_grad(set_to_none=True)
        losses: list = []
        args = (idx,) if first else ()
        if last:
            schedule.step(*args, target=targets, losses=losses, return_outputs=False)
        else:
            schedule.step(*args, return_outputs=False)
        opt.step()
        loss = torch.stack([x.detach() for x in losses]).mean() if last else torch.zeros(())
        dist.broadcast(loss, world - 1)  # every rank ends the step with the loss, as runner.step does
        return float(loss)

    seconds, losses = time_steps(step, batches, payload["warmup"], dist.barrier)
    return {"seconds": seconds, "losses": losses}


# --- parent --------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    from dp_vs_ddp import add_common_args, bench_sides, compare_sides, print_table

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p)
    p.set_defaults(steps=5, warmup=2, rounds=2)
    p.add_argument("--mesh", dest="meshes", nargs="+", default=DEFAULT_MESHES,
                   help=f"pipelined meshes dp x tp x pp (default {' '.join(DEFAULT_MESHES)}; dp = tp = 1)")
    p.add_argument("--microbatches", type=int, nargs="+", default=DEFAULT_MICROBATCHES,
                   help=f"micro-batch counts M (default {' '.join(map(str, DEFAULT_MICROBATCHES))}; at least pp)")
    p.add_argument("--lr", type=float, default=0.1, help="SGD learning rate of both sides (default 0.1)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 1 or args.rounds < 1:
        p.error("--steps, --warmup and --rounds must be at least 1")
    sets = args.sets or DEFAULT_SETS
    batch = args.batch_size or DEFAULT_BATCH
    worlds = {}
    for mesh in args.meshes:
        sizes = [int(s) for s in mesh.lower().split("x")] if re.fullmatch(r"\d+x\d+x\d+", mesh.lower()) else None
        if not sizes or sizes[0] != 1 or sizes[1] != 1 or sizes[2] < 2:
            p.error(f"--mesh {mesh}: give 1x1xP with P >= 2 (pipeline only: the torch side has no dp or tp)")
        worlds[mesh] = sizes[2]
    for mesh, world in worlds.items():
        for m in args.microbatches:
            if m < world:
                p.error(f"--microbatches {m} < pp={world}: Schedule1F1B needs at least one micro-batch per stage")
            if batch % m:
                p.error(f"--batch-size {batch} is not divisible by {m} micro-batches")
    import torch

    print(f"torch {torch.__version__}, {os.cpu_count()} cpus, load average {os.getloadavg()[0]:.2f} at start; "
          f"P ranks x 1 thread, {args.warmup} warm-up + {args.steps} timed steps, {args.rounds} rounds", flush=True)
    print(f"model: {args.model} {' '.join('--set ' + s for s in sets)} --batch-size {batch}; SGD lr {args.lr}", flush=True)
    rows, records = [], []
    with tempfile.TemporaryDirectory(prefix="sbpc-bench-") as tmp:
        for mesh, world in worlds.items():
            for m in args.microbatches:
                name = f"pp{world} M{m}"
                print(f"== {name}: mesh {mesh}, {m} micro-batches of {batch // m}", flush=True)
                plan = compile_pp_plan(args.model, sets, mesh, batch, m, args.lr, tmp)
                stages = plan_stages(plan)
                print(f"  stages (both sides): {describe_stages(stages)}", flush=True)
                payload = {"plan": plan, "steps": args.steps, "warmup": args.warmup, "timeout": args.timeout,
                           "stages": stages, "microbatches": m, "lr": args.lr}
                res = bench_sides({"plan": ("dp_vs_ddp:plan_worker", payload),
                                   PEER: ("pp_vs_pipelining:pipelining_worker", payload)},
                                  args.rounds, args.steps, world)
                rows += compare_sides(name, batch, res, PEER)
                l0, t0 = res["plan"]["losses"][0], res[PEER]["losses"][0]
                rel = abs(l0 - t0) / abs(t0)
                print(f"  step-0 loss relative difference {rel:.1e}", flush=True)
                records.append({"config": name, "mesh": mesh, "pp": world, "microbatches": m, "batch": batch,
                                "sets": sets, "stages": describe_stages(stages),
                                "plan_steps_per_s": 1 / res["plan"]["median"], "torch_steps_per_s": 1 / res[PEER]["median"],
                                "ratio_plan_over_torch": res[PEER]["median"] / res["plan"]["median"],
                                "ratio_best": res[PEER]["best"] / res["plan"]["best"],
                                "plan_runs_s_per_step": res["plan"]["runs_s_per_step"],
                                "torch_runs_s_per_step": res[PEER]["runs_s_per_step"],
                                "plan_losses": res["plan"]["losses"], "torch_losses": res[PEER]["losses"],
                                "step0_loss_rel_diff": rel})
    print_table(rows, PEER)
    print(f"load average {os.getloadavg()[0]:.2f} at end")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
                       "lr": args.lr, "results": records}, f, indent=1)
        print(f"wrote {args.json}")
    print(f"ratio={min(r[5] for r in rows if r[2] == 'plan'):.2f}")  # plan/torch steps/s, the worst config
    return 0


if __name__ == "__main__":
    sys.path.insert(0, BENCH)  # the ranks import dp_vs_ddp and this file by name
    sys.exit(main())
