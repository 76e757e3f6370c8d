"""The `sbpc` command: its parser, and the commands that compile, check and run (compile,
memory, inspect, run, train, corpus, launch, check, export, opt, schema); the planning
commands (diff, report, explain, simulate, search) are in `cli_plans.py`."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

from sbpc.errors import UsageError, guarded_main
from sbpc.runtime.cli import (ArgumentParser, add_run_arguments, add_train_arguments, check_training_flags, leave,
                              run_command, schedule_of, seed_arg)
from sbpc.runtime.corpus import DEFAULT_MAX_BYTES
from sbpc.runtime.kinds import Precision
from sbpc.compiler.tools.compile_flags import add_model_arguments, compile_from_args, memory_options_of
from sbpc.cli_plans import cmd_diff, cmd_explain, cmd_report, cmd_search, cmd_simulate, write_report_file


def cmd_compile(args) -> int:
    from sbpc.runtime.plan import save_plan

    result, _, _ = compile_from_args(args)
    save_plan(result.plan, args.output)
    est, t = result.plan.estimates, result.timings
    print(f"compiled {args.model} for mesh {args.mesh}: {est.instructions} instructions, "
          f"{est.param_count:,} parameters, capture {t['capture']:.1f}s, total {t['total']:.1f}s -> {args.output} "
          f"({os.path.getsize(args.output) / 1e6:.1f} MB)")
    if args.trace:
        if result.plan.pipeline is None:
            raise UsageError("--trace needs a pipelined plan (a pp axis or --microbatches above 1)",
                             hint="a one-stage plan is one firing per step; use `sbpc run --trace` for its timeline")
        from sbpc.compiler.tools.pipeline_report import write_simulated_trace

        sim = write_simulated_trace(result.plan, args.trace)
        print(f"wrote the simulated timeline ({len(sim.timeline)} firings, bubble {sim.bubble():.3f}) to {args.trace}")
    return 0


def cmd_memory(args) -> int:
    from sbpc.compiler.frontend.hints import load_config
    from sbpc.compiler.tools.memory_report import memory_json, memory_table

    result, _, _ = compile_from_args(args, enforce_budget=False)
    budget = memory_options_of(args, load_config(args.config) if args.config else None).device_memory
    if args.output is not None:
        from sbpc.runtime.plan import save_plan

        save_plan(result.plan, args.output)
    roles = result.plan.estimates.roles
    print(json.dumps(memory_json(roles, budget), indent=1) if args.json else memory_table(roles, budget, args.mesh))
    return 0


def cmd_inspect(args) -> int:
    from sbpc.compiler.ir.printer import print_graph
    from sbpc.compiler.raise_plan import raise_plan
    from sbpc.runtime.plan import load_plan

    if args.html:  # the same page as `sbpc report`
        return write_report_file(args.plan, args.html, "--html")
    plan = load_plan(args.plan)
    if args.collectives:
        from sbpc.compiler.tools.comm_report import summary, table

        print(table(plan))
        print(summary(plan))
        return 0
    if args.schedule:
        from sbpc.compiler.tools.pipeline_report import schedule_text

        print(schedule_text(plan))
        return 0
    if args.ranks:
        for rank in range(plan.world_size):
            coords = ", ".join(f"{k}={v}" for k, v in plan.coords(rank).items())
            print(f"rank {rank}: {coords}")
        return 0
    graph = raise_plan(plan)
    if not args.init:
        graph.init, graph.init_outputs = [], []
    sys.stdout.write(print_graph(graph))
    e = plan.estimates
    print(f"// {e.instructions} instructions; params {e.param_bytes / 2**20:.1f} MiB, grads {e.grad_bytes / 2**20:.1f} MiB, "
          f"optimizer state {e.optimizer_state_bytes / 2**20:.1f} MiB, peak activations {e.peak_activation_bytes / 2**20:.1f} MiB")
    return 0


def _lr_list(text: str) -> tuple[float, ...]:
    """``--lr-schedule 1e-3,5e-4``: finite learning rates >= 0 (argparse turns the error into exit 2)."""
    try:
        lrs = tuple(float(x) for x in text.split(","))
    except ValueError:
        lrs = ()
    if not lrs or not all(math.isfinite(x) and x >= 0 for x in lrs):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of learning rates >= 0 "
                                         "(e.g. 1e-3,5e-4,2.5e-4)")
    return lrs


def _steps(text: str) -> int:
    """``--steps``: a count of steps >= 1 (0 or fewer would check the init alone and say PASS)."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a step count >= 1 (e.g. 3, the default)")
    return n


def _positive(what: str, zero: bool):
    """A finite float > 0 (>= 0 where ``zero``): ``--tolerance``, ``--timeout``."""
    def parse(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            x = math.nan
        if not math.isfinite(x) or x < 0 or (x == 0 and not zero):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return x
    return parse


def cmd_check(args) -> int:
    from sbpc.compiler.tools.check import check_on_ranks, run_check
    from sbpc.runtime.backend import make_backend
    from sbpc.runtime.runner import make_runner

    from sbpc.runtime.cli import check_backend

    if args.backend != "cpu" and args.ranks == "threads":
        raise UsageError(f"--ranks threads runs on the cpu backend only, not {args.backend}",
                         hint=f"use --ranks processes (one process per GPU) with --backend {args.backend}")
    check_backend(args.backend, 1)  # a GPU at all, before the compile
    result, source, optimizer = compile_from_args(args)
    check_backend(args.backend, result.plan.world_size, result.plan)
    if result.plan.world_size > 1:
        report = check_on_ranks(result.plan, optimizer, steps=args.steps, seed=args.seed, tolerance=args.tolerance,
                                timeout=args.timeout, ranks=args.ranks, free_running=args.free_running,
                                backend=args.backend, lrs=args.lr_schedule)
    else:
        runner = make_runner(result.plan, make_backend(args.backend), seed=args.seed)
        report = run_check(result.plan, source, runner, optimizer, steps=args.steps, seed=args.seed,
                           tolerance=args.tolerance, free_running=args.free_running, lrs=args.lr_schedule)
    print(f"sbpc check {args.model} on mesh {args.mesh}: {args.steps} steps, {args.optimizer}, seed {args.seed}")
    print(report.table())
    return 0 if report.passed else 1


def cmd_train(args) -> int:
    """Compile in memory, as `sbpc check` does, then train the plan as `sbpc run` would."""
    import tempfile

    from sbpc.runtime.plan import save_plan

    check_training_flags(args)  # before the compile: its minute is not spent on a typo
    schedule_of(args, args.lr)
    result, _, _ = compile_from_args(args)
    est, t = result.plan.estimates, result.timings
    print(f"compiled {args.model} for mesh {args.mesh}: {est.param_count:,} parameters, {est.instructions} instructions "
          f"in {t['total']:.1f}s; training {args.steps} steps", flush=True)
    with tempfile.TemporaryDirectory(prefix="sbpc-train-") as tmp:  # spawned ranks read the plan from a file
        args.plan = os.path.join(tmp, "plan.json")
        save_plan(result.plan, args.plan)
        return run_command(args)


def cmd_corpus(args) -> int:
    from sbpc.runtime.corpus import build_corpus

    if args.max_bytes < 1:
        raise UsageError(f"--max-bytes {args.max_bytes} must be positive", hint="the default is 4 MiB: --max-bytes 4194304")
    path = build_corpus(args.output, args.max_bytes)
    with open(path + ".json") as f:
        meta = json.load(f)
    print(f"wrote {meta['tokens']:,} byte-level tokens from {meta['files']} files of the {meta['source']} "
          f"to {path}")
    return 0


def cmd_opt(args) -> int:
    """Parse text IR, run passes over it, print the result (like mlir-opt / xdsl-opt)."""
    from sbpc.compiler.ir.parser import parse_graph
    from sbpc.compiler.ir.printer import print_graph
    from sbpc.compiler.ir.verify import verify
    from sbpc.compiler.pass_manager import CompileContext
    from sbpc.compiler.passes import REGISTRY

    if not os.path.isfile(args.file):
        raise UsageError(f"IR file {args.file!r} does not exist", hint="pass a .sbpir file, e.g. one from --dump-dir")
    with open(args.file) as f:
        graph = parse_graph(f.read(), source=args.file)
    verify(graph, after="parse")
    names = [n.strip() for n in args.passes.split(",") if n.strip()]
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:
        raise UsageError(f"unknown pass {unknown[0]!r}", hint="passes: " + ", ".join(REGISTRY))
    ctx = CompileContext()
    for name in names:
        graph = REGISTRY[name]().apply(graph, ctx)
        verify(graph, after=name)
    sys.stdout.write(print_graph(graph))
    return 0


def cmd_launch(args) -> int:
    from sbpc.compiler.tools.launch_script import LaunchSpec, render_launch, write_script
    from sbpc.runtime.files import check_output_path
    from sbpc.runtime.plan import load_plan

    if args.output is not None:
        check_output_path(args.output, "launch script (--output)")
    spec = LaunchSpec(plan_path=args.plan, nodes=args.nodes, emit=args.emit, master_addr=args.master_addr,
                      master_port=args.master_port, ifname=args.ifname, backend=args.backend, workdir=os.getcwd())
    plan = load_plan(args.plan)
    text = render_launch(plan, spec)
    if args.output is None:
        sys.stdout.write(text)
        return 0
    write_script(args.output, text)
    per_node = plan.world_size // args.nodes
    run = args.output if os.path.dirname(args.output) else f"./{args.output}"
    how = (f"run it on every node: {run} --node-rank K" if args.emit == "torchrun"
           else f"submit it: sbatch {args.output}")
    print(f"wrote {args.output}: {plan.world_size} ranks on {args.nodes} node(s) x {per_node}; {how} [sbpc-run flags]")
    return 0


def cmd_export(args) -> int:
    from sbpc.runtime.checkpoint import export

    directory, count = export(args.checkpoint, args.output, strip=args.strip)
    print(f"wrote {count} tensors of {directory} to {args.output}")
    return 0


def cmd_schema(args) -> int:
    from sbpc.runtime.plan import Plan

    print(json.dumps(Plan.model_json_schema(), indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="sbpc", description="Compile single-device PyTorch training into a distributed plan.")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compile", help="compile a model file into a plan")
    add_model_arguments(c)
    c.add_argument("-o", "--output", default="plan.json", help="plan file to write (default plan.json)")
    c.add_argument("--trace", metavar="FILE", help="write the pipeline's simulated timeline (unit cost; Chrome/Perfetto JSON)")
    c.set_defaults(fn=cmd_compile, quick_exit=True)
    mm = sub.add_parser("memory", help="estimate the memory of every rank role (pp stage) before launch")
    add_model_arguments(mm)
    mm.add_argument("--json", action="store_true", help="print a JSON list: role, params, grads, optimizer, activations, "
                                                       "buffers, temporaries, total (bytes per device) and fits")
    mm.add_argument("-o", "--output", help="also write the plan")
    mm.set_defaults(fn=cmd_memory, quick_exit=True)
    i = sub.add_parser("inspect", help="print a plan as text IR")
    i.add_argument("plan")
    i.add_argument("--init", action="store_true", help="also print the init region (weight construction)")
    i.add_argument("--ranks", action="store_true", help="print the rank -> mesh coordinate map instead")
    i.add_argument("--html", metavar="FILE", help="write the HTML report of `sbpc report` to FILE instead")
    i.add_argument("--collectives", action="store_true", help="list the plan's collectives (phase, axis, bytes, op) instead")
    i.add_argument("--schedule", action="store_true", help="print the pipeline schedule (per-stage firing order, regsts, "
                                                         "bubble) instead")
    i.set_defaults(fn=cmd_inspect, quick_exit=True)
    d = sub.add_parser("diff", help="compare two plans by meaning: SBP changes, collectives, bytes, memory, step time")
    d.add_argument("a", help="the plan compared from")
    d.add_argument("b", help="the plan compared to")
    d.add_argument("--json", action="store_true", help="print the diff as JSON (the PlanDiff model, every change) instead")
    d.add_argument("--all", action="store_true", help="list every changed name, not the first few of each change")
    d.add_argument("--cluster", metavar="NAME|FILE", help="predict the step times with `sbpc simulate` on this cluster "
                                                         "(default: the compiler's cost model)")
    d.set_defaults(fn=cmd_diff, quick_exit=True)
    h = sub.add_parser("report", help="write a standalone HTML report of a plan: rank map, stages, timeline, memory, "
                                      "communication")
    h.add_argument("plan")
    h.add_argument("-o", "--output", default="report.html", help="HTML file to write (default report.html)")
    h.add_argument("--cluster", metavar="NAME|FILE", help="add `sbpc simulate`'s prediction on this cluster")
    h.set_defaults(fn=cmd_report, quick_exit=True)
    r = sub.add_parser("run", help="train a plan on --data, or on synthetic batches")
    add_run_arguments(r)
    r.set_defaults(fn=run_command)
    t = sub.add_parser("train", help="compile a model in memory and train it (on --data, or synthetic batches)")
    add_model_arguments(t)
    add_train_arguments(t)
    t.set_defaults(fn=cmd_train, clip_grad=1.0)  # Megatron's default for a training run; --clip-grad inf: report only
    cp = sub.add_parser("corpus", help="build the offline corpus: the Python standard library's sources as byte tokens")
    cp.add_argument("-o", "--output", required=True, metavar="DIR", help="directory to write stdlib-<version>.bin into")
    cp.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES, help="cap on the corpus size in bytes "
                                                                          "(default 4 MiB)")
    cp.set_defaults(fn=cmd_corpus)
    la = sub.add_parser("launch", help="write the script that starts a plan's ranks on several nodes (torchrun, slurm)")
    la.add_argument("plan")
    la.add_argument("--nodes", type=int, required=True, help="nodes; each runs world size / nodes ranks")
    la.add_argument("--emit", choices=["torchrun", "slurm"], required=True,
                    help="torchrun: a script to run on every node with --node-rank K; slurm: an sbatch job (srun)")
    la.add_argument("-o", "--output", help="write the script here (executable) instead of printing it")
    la.add_argument("--master-addr", help="address of node 0 (default: 127.0.0.1 on one node, slurm's first node, "
                                          "else $MASTER_ADDR when the script runs)")
    la.add_argument("--master-port", type=int, default=29500, help="rendezvous port on node 0 (default 29500)")
    la.add_argument("--ifname", help="network interface for NCCL and gloo (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME)")
    la.add_argument("--backend", default="cpu", help="the ranks' backend: cpu (gloo, default) or cuda (one GPU per rank)")
    la.set_defaults(fn=cmd_launch)
    k = sub.add_parser("check", help="verify each step of the plan against eager PyTorch from the same state")
    add_model_arguments(k)
    k.add_argument("--steps", type=_steps, default=3)
    k.add_argument("--seed", type=seed_arg, default=0)
    k.add_argument("--tolerance", type=_positive("a deviation >= 0 (e.g. 1e-5, the default)", zero=True), default=1e-5, help="max deviation allowed (default 1e-5; docs/check.md)")
    k.add_argument("--free-running", action="store_true",
                   help="also run eager on its own trajectory and print both loss curves (a report, not the verdict)")
    k.add_argument("--lr-schedule", metavar="LR,LR,...", type=_lr_list,
                   help="the learning rate of each step, the last repeating (default: --lr every step); the plan "
                        "takes it as its step input, torch.optim as param_groups' lr")
    k.add_argument("--timeout", type=_positive("a number of seconds > 0 (e.g. 300, the default)", zero=False), default=300, help="seconds any rank may wait on another (default 300)")
    k.add_argument("--backend", default="cpu", help="run the plan and eager PyTorch on cpu (default) or cuda "
                                                    "(one GPU per rank; eager on the first)")
    k.add_argument("--ranks", choices=["processes", "threads"], default="processes",
                   help="run the ranks of a multi-device check as gloo processes (default) or as threads of this "
                        "process (no interpreter per rank; for quick checks, see docs/runtime.md)")
    k.set_defaults(fn=cmd_check)
    e = sub.add_parser("explain", help="say why a value or parameter of a plan has its SBP")
    e.add_argument("plan")
    e.add_argument("tensor", help="a parameter name (h.0.attn.c_attn.weight) or a value (%%addmm)")
    e.set_defaults(fn=cmd_explain, quick_exit=True)
    sm = sub.add_parser("simulate", help="predict a plan's step on a cluster: time, throughput, MFU, bubble, comm")
    sm.add_argument("plan")
    sm.add_argument("--cluster", required=True, metavar="NAME|FILE",
                    help="a preset (dgx-a100-80g, dgx-h100, h200) or a cluster TOML file (docs/cost_model.md)")
    sm.add_argument("--json", action="store_true", help="print the result as JSON (step_time_s, tokens_per_s, "
                                                       "tflops_per_device, mfu, bubble, comm, roles, ...)")
    sm.add_argument("--trace", metavar="FILE", help="also write the simulated timeline (Chrome/Perfetto JSON)")
    sm.add_argument("--attention", choices=["flash", "materialized"], default="flash",
                    help="the attention kernel: flash (fused, default) or materialized (s x s scores in memory, "
                         "as Megatron-LM before flash attention)")
    sm.add_argument("--attention-dropout", type=float, metavar="P",
                    help="price the attention ops as having dropout P on their probabilities (materialized: a "
                         "dropout kernel over the scores; default: the plan's own)")
    sm.add_argument("--layers", type=int, metavar="N",
                    help="the plan's repeated layer (h.0, h.1, ...) stands for N identical layers (docs/cost_model.md)")
    sm.set_defaults(fn=cmd_simulate, quick_exit=True)
    se = sub.add_parser("search", help="find the fastest strategy (mesh, micro-batches, schedule, ZeRO, recompute) for a "
                                       "model on N devices of a cluster")
    se.add_argument("model", help="model file; it must define config(**kw) with layers, hidden, heads, vocab, seq "
                                  "(examples/gpt.py)")
    se.add_argument("--set", dest="sets", action="append", metavar="KEY=VALUE", help="keyword argument for the model "
                                                                                  "(repeatable)")
    se.add_argument("--devices", type=int, required=True, help="devices to plan for")
    se.add_argument("--cluster", required=True, metavar="NAME|FILE", help="a preset (dgx-a100-80g, dgx-h100, h200) or "
                                                                          "a cluster TOML file")
    se.add_argument("--batch-size", type=int, help="global batch size (default: --devices, one sequence per device)")
    se.add_argument("--config", help="parallel config whose [params] and [modules] hints every strategy compiles with "
                                     "(e.g. examples/gpt.megatron.toml)")
    se.add_argument("--precision", choices=[x.value for x in Precision], default="fp32", help="compute precision "
                                                                                              "(default fp32)")
    se.add_argument("--device-memory", metavar="BYTES", help="memory per device a strategy must fit (default: the "
                                                             "cluster's)")
    se.add_argument("--meshes", metavar="DxTxP,...", help="only these meshes, e.g. 8x1x1,2x4x1")
    se.add_argument("--top", type=int, default=4, help="strategies to compile and simulate, the fastest by the "
                                                       "estimate (default 4)")
    se.add_argument("--attention", choices=["flash", "materialized"], default="flash",
                    help="the attention kernel the simulation prices (as `sbpc simulate`)")
    se.add_argument("--attention-dropout", type=float, metavar="P", help="price attention with dropout P (as `sbpc "
                                                                         "simulate`)")
    se.add_argument("--json", action="store_true", help="print the result as JSON (rows: rank, mesh, micro_batch, "
                                                       "microbatches, schedule, zero, recompute, step_time_s, ...)")
    se.add_argument("-o", "--output", help="write the winner's plan (the one simulated; docs/search.md)")
    se.add_argument("--config-out", metavar="FILE", help="write the winner as a parallel config for `sbpc compile "
                                                         "--config`")
    se.set_defaults(fn=cmd_search, quick_exit=True)
    x = sub.add_parser("export", help="write a checkpoint's consolidated logical weights to one .safetensors file")
    x.add_argument("checkpoint", help="a --save directory (its newest complete checkpoint) or one step_* directory")
    x.add_argument("-o", "--output", default="model.safetensors", help="file to write (default model.safetensors)")
    x.add_argument("--strip", metavar="PREFIX", help="keep only the tensors whose names start with PREFIX, without it "
                                                     "(model. for examples/hf_gpt2.py, so from_pretrained finds its names)")
    x.set_defaults(fn=cmd_export)
    s = sub.add_parser("schema", help="print the JSON Schema of the plan format")
    s.set_defaults(fn=cmd_schema)
    o = sub.add_parser("opt", help="run passes over a text-IR file and print the result")
    o.add_argument("file", help="a .sbpir file")
    o.add_argument("-p", "--passes", default="", help="comma-separated pass names, e.g. normalize,cse,dce")
    o.set_defaults(fn=cmd_opt)
    for sp in (c, mm, i, d, h, r, t, cp, la, k, e, sm, se, x, s, o):
        sp.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def _run(argv: list[str] | None, exits: bool = False) -> tuple[argparse.Namespace, int]:
    """``exits``: the process ends after a ``quick_exit`` command (``console_main``)."""
    args = build_parser().parse_args(argv)
    args.process_exits = exits and getattr(args, "quick_exit", False)
    return args, leave(guarded_main(lambda: args.fn(args), args.debug))


def main(argv: list[str] | None = None) -> int:
    return _run(argv)[1]


def console_main() -> None:
    """The ``sbpc`` console script. A command that only computes and writes files (compile,
    simulate, search, ...) ends with ``os._exit`` once its output is flushed: tearing down an
    interpreter that imported torch and built a large graph takes 0.5-1.5 s, a twentieth of a
    1T compile's wall time, and frees nothing anyone needs; for the same reason its compile
    leaves the objects it made unwalked by the cyclic collector (``CompileContext.process_exits``,
    ~1 s at 1T). Commands that start ranks or threads (run, train, check, launch) exit
    normally; ``main`` (what tests call) always does."""
    args, code = _run(None, exits=True)
    if args.process_exits:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe (`| head`): nothing more to say
                pass
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    console_main()
