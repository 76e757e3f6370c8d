"""The GPU check: one script, one GPU, a few minutes. Fails loudly (exit 1) without a GPU.

    pip install -e '.[cuda]'            # with a CUDA build of torch
    python bench/gpu_check.py           # --quick: a small GPT instead of the 1.3B preset

1. parity: `sbpc check examples/gpt.py --backend cuda` (the plan against eager PyTorch, both
   on this GPU, fp32, docs/check.md), for the tiny GPT and the MLP; the GPT also with dropout,
   in bf16, and in fp16 with the optimizer offloaded to the CPU;
2. NCCL on one rank: a one-rank NCCL communicator (``runtime.nccl.self_communicator``) runs
   all_reduce, all_gather, reduce_scatter and all_to_all on its communication stream, and a
   send to itself with the matching receive (in one NCCL group call, as NCCL requires), in
   fp32 and bf16, each compared with what the collective must give on one rank;
3. speed: steps/s of the plan vs eager PyTorch for gpt.py's 1.3B preset in bf16 (autocast's
   casts, fp32 master weights, AdamW; eager under CUDA autocast with AdamW(fused=True)), with
   model TFLOP/s (Megatron's count: 72 B s l h^2 (1 + s/6h + V/12lh), no recompute) and MFU
   against the device's dense bf16 peak (H100/H200: 989 TFLOP/s; --peak-tflops otherwise).

The last line is ``ratio=<plan steps/s / eager steps/s>``. Any part that fails is named and the
script exits 1 after the others ran.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0,
                    "L4": 121.0, "A10": 125.0, "RTX 4090": 165.0}  # dense, no sparsity


PARITY = (  # model, flags of `sbpc check --backend cuda`
    ("examples/gpt.py", []),
    ("examples/mlp.py", []),
    ("examples/gpt.py", ["--set", "dropout=0.1"]),  # eager draws the plan's masks (compiler/tools/check_dropout.py)
    ("examples/gpt.py", ["--precision", "bf16"]),
    # the optimizer on the CPU (pinned copies) beside CUDA parameters, and fp16's loss scaling
    ("examples/gpt.py", ["--precision", "fp16", "--offload", "optimizer"]),
)


def fail(message: str) -> None:
    print(f"gpu_check: FAIL: {message}", flush=True)


def parity(args) -> bool:
    ok = True
    for model, sets in PARITY:
        cmd = [sys.executable, "-m", "sbpc.cli", "check", model, "--backend", "cuda", "--steps", "3", *sets]
        print("$", " ".join(cmd[2:]), flush=True)
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
        print(proc.stdout + proc.stderr, end="", flush=True)
        if proc.returncode != 0:
            fail(f"parity of {model} {' '.join(sets)} on cuda (exit {proc.returncode})".replace("  ", " "))
            ok = False
    return ok


def nccl_one_rank() -> bool:
    from sbpc.runtime.nccl import self_communicator

    comm = self_communicator(torch.device("cuda", torch.cuda.current_device()))
    ok = True
    try:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.arange(24, device=comm.device, dtype=torch.float32).reshape(4, 6).to(dtype)
            results = {
                "all_reduce": (comm.all_reduce_async(x, (0,)).wait(), x),
                "all_reduce max": (comm.all_reduce_async(x, (0,), "max").wait(), x),
                "all_gather dim 1": (comm.all_gather_async(x, (0,), 1).wait(), x),
                "reduce_scatter dim 0": (comm.reduce_scatter_async(x, (0,), 0).wait(), x),
                "all_to_all 1 -> 0": (comm.all_to_all_async(x, (0,), 1, 0).wait(), x),
                "send/recv to self": (comm.self_transfer(x), x),
            }
            torch.cuda.synchronize()
            for name, (got, want) in results.items():
                same = got.shape == want.shape and bool(torch.equal(got, want))
                print(f"nccl world size 1, {str(dtype).removeprefix('torch.'):>8}: {name:<22} "
                      f"{'ok' if same else 'WRONG'}", flush=True)
                if not same:
                    fail(f"NCCL {name} in {dtype} on one rank gave {got.tolist()}")
                    ok = False
    finally:
        comm.close()
    return ok


def model_flops(cfg: dict, batch: int) -> float:
    """Megatron-LM's FLOPs of one training step (forward + backward, no recompute)."""
    b, s, layers, h, v = batch, cfg["seq"], cfg["layers"], cfg["hidden"], cfg["vocab"]
    return 72.0 * b * s * layers * h * h * (1 + s / (6 * h) + v / (12 * layers * h))


def peak_tflops(args) -> float | None:
    if args.peak_tflops:
        return args.peak_tflops
    name = torch.cuda.get_device_name()
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_BF16_TFLOPS[key]
    return None


def speed(args) -> float | None:
    from sbpc.compiler.driver import compile_model
    from sbpc.compiler.frontend.model_loader import load_model
    from sbpc.compiler.frontend.optim import OptimizerConfig
    from sbpc.compiler.ir.mesh import parse_mesh
    from sbpc.compiler.memory_options import MemoryOptions
    from sbpc.runtime.backend import make_backend
    from sbpc.runtime.kinds import Precision
    from sbpc.runtime.runner import BatchSource, Runner

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import gpt

    sets = {"preset": args.preset} if not args.quick else {"preset": "small", "layers": 4}
    cfg = gpt.config(**sets)
    opt = OptimizerConfig()
    t0 = time.perf_counter()
    source = load_model(os.path.join(ROOT, "examples", "gpt.py"), sets)
    plan = compile_model(source, parse_mesh("1"), batch_size=args.batch, optimizer=opt,
                         memory=MemoryOptions(precision=Precision.BF16)).plan
    print(f"compiled gpt.py {sets} batch {args.batch} bf16 in {time.perf_counter() - t0:.1f}s", flush=True)
    runner = Runner(plan, make_backend("cuda"), seed=0)
    make = BatchSource(plan, 0)
    batches = [make(i) for i in range(args.warmup + args.steps)]
    device = runner.backend.device

    torch.manual_seed(0)
    model = source.build().train().to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay,
                                  fused=True)

    def eager_step(forward):
        """One bf16 autocast training step of ``forward`` (the model, or its torch.compile)."""
        def step(batch):
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = forward(*(t.to(device, non_blocking=True) for t in batch))
            loss.backward()
            optimizer.step()
            return float(loss.detach())
        return step

    sides = {"plan": lambda batch: runner.step(batch).loss, "eager": eager_step(model)}
    if args.compile:
        sides["torch.compile"] = eager_step(torch.compile(model))
    for name, step in sides.items():
        for batch in batches[:args.warmup]:
            step(batch)
        print(f"warmed up {name}", flush=True)
    times = {name: [] for name in sides}
    order = list(sides)
    for _ in range(args.rounds):
        for name in order:
            torch.cuda.synchronize()
            start = time.perf_counter()
            for batch in batches[args.warmup:]:
                sides[name](batch)
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - start) / args.steps)
        order.reverse()
    flops, peak = model_flops(cfg, args.batch), peak_tflops(args)
    print(f"{torch.cuda.get_device_name()}: peak {peak or '?'} TFLOP/s dense bf16; "
          f"{flops / 1e12:.1f} TFLOP per step (model FLOPs)", flush=True)
    print(f"{'side':<14} {'s/step':>8} {'steps/s':>8} {'TFLOP/s':>8} {'MFU':>6}")
    rate = {}
    for name, t in times.items():
        sec = statistics.median(t)
        rate[name] = 1 / sec
        tflops = flops / sec / 1e12
        mfu = f"{tflops / peak:6.1%}" if peak else "     ?"
        print(f"{name:<14} {sec:8.3f} {1 / sec:8.2f} {tflops:8.1f} {mfu}", flush=True)
    print(f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB (plan and eager resident together)")
    return rate["plan"] / rate["eager"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="1.3b", help="gpt.py preset for the speed part (default 1.3b)")
    p.add_argument("--batch", type=int, default=8, help="batch size of the speed part (default 8)")
    p.add_argument("--quick", action="store_true", help="speed on a 4-layer GPT-small instead (a small GPU)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per block (default 10)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--compile", action="store_true", help="also time torch.compile of the eager step")
    p.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak, for MFU")
    p.add_argument("--timeout", type=float, default=600, help="seconds for each parity check")
    args = p.parse_args()
    if not torch.cuda.is_available():
        fail(f"no CUDA GPU visible to torch {torch.__version__} (CUDA build: {torch.version.cuda or 'none'}); "
             "this check needs one GPU and a CUDA build of torch")
        return 1
    print(f"gpu_check on {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)
    failed = []
    for name, part in (("parity", lambda: parity(args)), ("nccl", nccl_one_rank)):
        try:
            if not part():
                failed.append(name)
        except Exception as err:  # noqa: BLE001 - report every part
            fail(f"{name}: {type(err).__name__}: {err}")
            failed.append(name)
    ratio = float("nan")
    try:
        ratio = speed(args)
    except Exception as err:  # noqa: BLE001
        fail(f"speed: {type(err).__name__}: {err}")
        failed.append("speed")
    print(f"gpu_check: {'FAIL (' + ', '.join(failed) + ')' if failed else 'PASS'}")
    print(f"ratio={ratio:.3f}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
