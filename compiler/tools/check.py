"""`sbpc check`: run the plan and eager PyTorch from the same seed and compare them.

Per step it compares the loss, every gradient and every updated parameter. The deviation of a
tensor is ``max|plan - eager| / max|eager|`` (denominator floored at 1e-12); the check passes
when the largest deviation over all steps and tensors is within the tolerance. Before the
first step it also compares the plan's replayed init with eager ``torch.manual_seed(seed);
build_model()``, which must agree bit for bit.

On a mesh of many devices every rank runs the plan on its shards; gradients and parameters
are gathered back to logical tensors (``Runner.gather``) and rank 0 compares them with eager
PyTorch on the whole batch. ``check_on_ranks`` spawns the ranks over gloo (or runs them as
threads of this process: ``ranks="threads"``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sbpc.compiler.frontend.model_loader import ModelSource
from sbpc.compiler.frontend.optim import OptimizerConfig
from sbpc.runtime.plan import Plan
from sbpc.runtime.runner import BatchSource, Runner, make_runner, step_seed


@dataclass
class Deviation:
    value: float = 0.0
    tensor: str = ""

    def update(self, name: str, a: torch.Tensor, b: torch.Tensor) -> None:
        d = rel_dev(a, b)
        if d > self.value or not self.tensor:
            self.value, self.tensor = d, name


@dataclass
class StepRow:
    step: str
    loss_plan: float | None
    loss_eager: float | None
    loss: Deviation
    grads: Deviation
    params: Deviation


@dataclass
class CheckReport:
    rows: list[StepRow] = field(default_factory=list)
    tolerance: float = 1e-5

    @property
    def worst(self) -> tuple[float, str]:
        best = (0.0, "")
        for r in self.rows:
            for kind, d in (("loss", r.loss), ("grad", r.grads), ("param", r.params)):
                if d.value >= best[0] and d.tensor:
                    best = (d.value, f"step {r.step}, {kind} {d.tensor}")
        return best

    @property
    def passed(self) -> bool:
        return self.worst[0] <= self.tolerance

    def table(self) -> str:
        lines = [f"{'step':>5}  {'loss (plan)':>13}  {'loss (eager)':>13}  {'loss dev':>9}  {'max grad dev':>12}  "
                 f"{'max param dev':>13}  worst tensor"]
        for r in self.rows:
            fmt = lambda x: f"{x:13.8f}" if x is not None else f"{'-':>13}"
            worst = max((r.grads, r.params), key=lambda d: d.value)
            lines.append(f"{r.step:>5}  {fmt(r.loss_plan)}  {fmt(r.loss_eager)}  {r.loss.value:9.2e}  "
                         f"{r.grads.value:12.2e}  {r.params.value:13.2e}  {worst.tensor}")
        value, where = self.worst
        verdict = "PASS" if self.passed else "FAIL"
        lines.append(f"largest deviation {value:.2e} ({where}); tolerance {self.tolerance:.0e}: {verdict}")
        return "\n".join(lines)


def rel_dev(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    if a.shape != b.shape:
        return float("inf")
    return float((a - b).abs().max() / max(float(b.abs().max()), 1e-12)) if b.numel() else 0.0


def run_check(plan: Plan, source: ModelSource | None, runner: Runner, optimizer: OptimizerConfig, *,
              steps: int, seed: int, tolerance: float) -> CheckReport | None:
    """Every rank calls this (the gathers are collectives); rank 0, which alone needs ``source``,
    runs eager PyTorch and returns the report, the others return None."""
    lead = runner.topology.rank == 0
    weights = runner.logical_weights()
    batches = BatchSource(plan, seed)
    if not lead:
        for step in range(steps):
            runner.step(batches(step), rng_seed=step_seed(seed, step), keep_grads=True)
            runner.logical_params()
        return None
    report = CheckReport(tolerance=tolerance)
    torch.manual_seed(seed)
    model = source.build().train()
    init = Deviation()
    eager_state = dict(model.named_parameters()) | dict(model.named_buffers())
    for name, t in weights.items():
        init.update(name, t, eager_state[name])
    report.rows.append(StepRow("init", None, None, Deviation(), Deviation(), init))
    with torch.no_grad():
        for name, t in weights.items():
            eager_state[name].copy_(t)
    opt = optimizer.torch_optimizer([p for p in model.parameters() if p.requires_grad])
    for step in range(steps):
        batch = batches(step)
        result = runner.step(batch, rng_seed=step_seed(seed, step), keep_grads=True)
        params = runner.logical_params()
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(step_seed(seed, step))
        loss = model(*batch)
        loss.backward()
        row = StepRow(str(step), result.loss, float(loss.detach()), Deviation(), Deviation(), Deviation())
        row.loss.update("loss", torch.tensor(result.loss), loss.detach())
        named = dict(model.named_parameters())
        for name, g in result.grads.items():
            row.grads.update(name, g, named[name].grad)
        opt.step()
        for name, p in params.items():
            row.params.update(name, p, named[name])
        report.rows.append(row)
    return report


def check_worker(payload: dict) -> CheckReport | None:
    """One rank of a multi-device check (a ``runtime.launch`` target)."""
    from sbpc.compiler.frontend.model_loader import load_model
    from sbpc.runtime.backend import make_backend
    from sbpc.runtime.dist import init_distributed
    from sbpc.runtime.plan import load_plan

    plan = load_plan(payload["plan"])
    comm = init_distributed(plan, timeout=payload["timeout"])
    runner = make_runner(plan, make_backend("cpu", comm, comm.topology), seed=payload["seed"])
    source = load_model(plan.model.path, dict(plan.model.sets)) if comm.topology.rank == 0 else None
    return run_check(plan, source, runner, payload["optimizer"], steps=payload["steps"], seed=payload["seed"],
                     tolerance=payload["tolerance"])


def check_on_ranks(plan: Plan, optimizer: OptimizerConfig, *, steps: int, seed: int, tolerance: float,
                   timeout: float = 300, ranks: str = "processes") -> CheckReport:
    """Run ``check_worker`` on one local process per device of the plan's mesh (gloo), or with
    ``ranks="threads"`` on one thread per device of this process (``runtime.threads``)."""
    import os
    import tempfile

    from sbpc.runtime.launch import launch
    from sbpc.runtime.plan import save_plan

    with tempfile.TemporaryDirectory(prefix="sbpc-check-") as tmp:
        path = os.path.join(tmp, "plan.json")
        save_plan(plan, path)
        payload = dict(plan=path, optimizer=optimizer, steps=steps, seed=seed, tolerance=tolerance, timeout=timeout)
        return launch(plan.world_size, "sbpc.compiler.tools.check:check_worker", payload, timeout=timeout,
                      ranks=ranks)[0]
