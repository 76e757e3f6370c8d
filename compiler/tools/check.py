"""`sbpc check`: verify each training step of the plan against eager PyTorch as a function of
its inputs (the method and why its tolerance is sound: docs/check.md).

The plan runs freely from its seeded init. At every step t, eager PyTorch is put in the plan's
state S_t (parameters and optimizer state, gathered to logical tensors: exact, a gather only
concatenates shards and copies replicas) and
  - runs forward and backward on the step's batch: the plan's loss and gradients are compared
    with eager's from the same parameters and batch;
  - runs torch.optim's step on the plan's gradients from S_t: the plan's new parameters and
    optimizer state are compared with torch's, from the same gradients and state.
With ``--clip-grad`` the plan's global gradient norm is compared with torch's
(``get_total_norm``) of the plan's gradients, and torch.optim's step runs on those gradients
clipped by the plan's norm (``clip_grads_with_norm_``, clip_grad_norm_'s second half): the norm
is a sum over every gradient entry that a sharded plan adds in another order, and Adam turns a
coefficient a few ulps off into 1e-5 of the step (measured 7.4e-6 on gpt.py 1x2, from a norm
1.4e-7 off), so the norm is judged as a reduction and the update as a function of it.
Step t+1 starts from the plan's S_{t+1} again, so no deviation accumulates and none is
amplified: Adam divides by a gradient's own magnitude, so a gradient that is zero in exact
arithmetic (a key bias under softmax) makes two correct programs take opposite full-size steps
from rounding noise alone, which a free-running comparison mistakes for a wrong plan.

The deviations and their scales: ``compiler/tools/deviation.py``. Before the first step the plan's replayed init is compared with eager ``torch.manual_seed(seed);
build_model()``; they agree bit for bit. ``free_running=True`` also runs eager on its own
trajectory and reports both loss curves side by side: a report, not part of the verdict.

On a mesh of many devices every rank runs the plan on its shards and rank 0 compares the
logical tensors with eager PyTorch on the whole batch. ``check_on_ranks`` spawns the ranks over
gloo (or runs them as threads of this process: ``ranks="threads"``).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_map

from sbpc.compiler.frontend.capture import plan_buffers, plan_tensors
from sbpc.compiler.frontend.model_loader import ModelSource
from sbpc.compiler.frontend.optim import OptimizerConfig
from sbpc.compiler.ir.types import StateName
from sbpc.runtime.kinds import Precision
from sbpc.runtime.model_file import call_forward, loss_of
from sbpc.runtime.plan import Plan, PrecisionSpec
from sbpc.runtime.precision import COMPUTE_DTYPE, LOSS_SCALE, autocast
from sbpc.compiler.tools.check_amp import LossScaler
from sbpc.compiler.tools.check_dropout import Float32Draws, plan_dropout
from sbpc.compiler.tools.float64_kernels import Float64Kernels
from sbpc.compiler.tools.deviation import (NOISE_RESOLUTION, amax, deviation, grad_deviations, low_precision_noise,
                                           update_deviation, update_scale)
from sbpc.runtime.runner import BatchSource, Runner, make_runner, step_seed

# The float64 run stands for exact arithmetic only while it computes the same function: a loss
# further than this from float32's (another dropout mask, a dtype-dependent branch) turns the
# noise term off for the step, which only makes the check stricter.
SAME_FUNCTION = 1e-4
# ... and under bf16 or fp16 this: the loss is computed in float32 from low-precision logits,
# measured within 2e-5 of float64 on examples/gpt.py (bf16, tp 2); another dropout mask moves it
# by far more.
SAME_FUNCTION_LOW = 1e-2


@dataclass
class Deviation:
    value: float = 0.0
    tensor: str = ""

    def update(self, name: str, value: float) -> None:
        if value > self.value or not self.tensor:
            self.value, self.tensor = value, name


@dataclass
class StepRow:
    step: str
    loss_plan: float | None
    loss_eager: float | None
    loss: Deviation
    grads: Deviation
    update: Deviation


@dataclass
class FreeRunning:
    """Eager PyTorch on its own trajectory from the same init, next to the plan's (a report)."""
    losses_plan: list[float] = field(default_factory=list)
    losses_eager: list[float] = field(default_factory=list)
    params: Deviation = field(default_factory=Deviation)  # after the last step, relative to max|eager|

    def table(self) -> str:
        lines = ["free-running (a report, not the verdict: each side follows its own trajectory)",
                 f"{'step':>5}  {'loss (plan)':>13}  {'loss (eager)':>13}  {'difference':>10}"]
        for i, (a, b) in enumerate(zip(self.losses_plan, self.losses_eager)):
            lines.append(f"{i:>5}  {a:13.8f}  {b:13.8f}  {a - b:10.2e}")
        lines.append(f"after {len(self.losses_plan)} steps the parameters differ by up to {self.params.value:.2e} "
                     f"of the tensor's largest entry ({self.params.tensor or '-'})")
        return "\n".join(lines)


@dataclass
class CheckReport:
    rows: list[StepRow] = field(default_factory=list)
    tolerance: float = 1e-5
    free: FreeRunning | None = None
    notes: list[str] = field(default_factory=list)  # how the verdict was reached, where it differs
    skipped_steps: int = 0  # fp16: steps whose gradients overflowed, skipped by plan and eager alike
    loss_scale: float | None = None  # fp16: the plan's scale after the last step
    clip_grad: float | None = None  # --clip-grad: the max norm
    clip_coefs: list[float] = field(default_factory=list)  # per step: clip_grad_norm_'s coefficient, clamped at 1

    @property
    def worst(self) -> tuple[float, str]:
        best = (0.0, "")
        for r in self.rows:
            for kind, d in (("loss", r.loss), ("grad", r.grads), ("update", r.update)):
                if d.value >= best[0] and d.tensor:
                    best = (d.value, f"step {r.step}, {kind} {d.tensor}")
        return best

    @property
    def passed(self) -> bool:
        return self.worst[0] <= self.tolerance

    def table(self) -> str:
        lines = [f"{'step':>5}  {'loss (plan)':>13}  {'loss (eager)':>13}  {'loss dev':>9}  {'max grad dev':>12}  "
                 f"{'max update dev':>14}  worst tensor"]
        for r in self.rows:
            fmt = lambda x: f"{x:13.8f}" if x is not None else f"{'-':>13}"
            worst = max((r.grads, r.update), key=lambda d: d.value)
            lines.append(f"{r.step:>5}  {fmt(r.loss_plan)}  {fmt(r.loss_eager)}  {r.loss.value:9.2e}  "
                         f"{r.grads.value:12.2e}  {r.update.value:14.2e}  {worst.tensor}")
        if self.free is not None:
            lines.append(self.free.table())
        if self.loss_scale is not None:
            lines.append(f"fp16 loss scaling: {self.skipped_steps} of {len(self.rows) - 1} steps skipped "
                         f"(gradients overflowed), plan and eager alike; scale now {self.loss_scale:g}")
        if self.clip_grad is not None:
            clipped = sum(c < 1.0 for c in self.clip_coefs)
            lines.append(f"gradient clipping at norm {self.clip_grad:g}: {clipped} of {len(self.clip_coefs)} steps "
                         f"clipped (smallest coefficient {min(self.clip_coefs, default=1.0):.3g}); the plan's norm "
                         f"is compared as a gradient")
        lines += [f"note: {n}" for n in self.notes]
        value, where = self.worst
        verdict = "PASS" if self.passed else "FAIL"
        lines.append(f"largest deviation {value:.2e} ({where}); tolerance {self.tolerance:.0e}: {verdict}")
        return "\n".join(lines)


def step_device(opt: torch.optim.Optimizer, p) -> torch.device:
    """Where torch.optim keeps ``p``'s step count: with the parameter for a fused (or capturable)
    AdamW, whose CUDA kernel reads it there, else on the CPU (``Adam._init_group``)."""
    fused = opt.defaults.get("fused") or opt.defaults.get("capturable")
    return p.device if fused else torch.device("cpu")


class Eager:
    """The eager model and its torch.optim optimizer, put in a given state before each step. Under
    bf16 or fp16 the forward runs in torch.autocast, and fp16 scales the loss with a
    torch.amp.GradScaler in the plan's scale (docs/precision.md)."""

    def __init__(self, source: ModelSource, optimizer: OptimizerConfig, seed: int,
                 precision: PrecisionSpec = PrecisionSpec(), device: torch.device = torch.device("cpu"),
                 fused: bool = False, keys: tuple[str, ...] | list[str] = ()):
        """``keys``: forward()'s keyword names of the batch inputs (the plan's ``batch_keys``)."""
        torch.manual_seed(seed)
        self.keys = tuple(keys)
        self.model = source.build().train().to(device)  # built on the CPU, as the plan's init is
        self.device = device
        self.named = dict(self.model.named_parameters())
        # the plan's update is torch's fused AdamW kernel (plan.optimizer.fused): the same kernel here
        self.opt = optimizer.torch_optimizer([p for p in self.model.parameters() if p.requires_grad], fused=fused)
        self.kind = optimizer.kind
        self.clip_grad = optimizer.clip_grad
        self.norms: list[float] = []  # clip_grad_norm_'s total norm of each step it clipped
        self.precision = precision
        self.scaler = LossScaler(precision.loss_scaling) if precision.loss_scaling else None
        self.buffers_before: dict[str, torch.Tensor] = {}

    def forward_backward(self, batch, seed: int) -> torch.Tensor:
        self.opt.zero_grad(set_to_none=True)
        # the buffers the forward starts from (it may update them): the float64 twin starts there too
        self.buffers_before = {n: b.detach().clone() for n, b in plan_buffers(self.model)}
        return _forward_backward(self.model, self.on_device(batch), seed, self.precision.compute, self.scaler, self.opt,
                                 self.keys)

    def on_device(self, batch):
        return tree_map(lambda x: x.to(self.device) if isinstance(x, torch.Tensor) else x, batch)

    def rounding_noise(self, batch, seed: int, loss: torch.Tensor
                       ) -> tuple[dict[str, float], dict[str, float], float, str | None]:
        """Eager's own error of each gradient just computed, max|eager - float64| (float32's, or
        under autocast bf16's or fp16's), of each floating-point buffer the forward wrote, and of
        the loss, from a float64 copy of the model in the same state (without autocast);
        ({}, {}, 0, why) where that copy cannot stand in."""
        try:
            twin = copy.deepcopy(self.model, _detached_attributes(self.model)).double()
            twin.zero_grad(set_to_none=True)  # the copy took float32's gradients along
            with torch.no_grad():
                for name, b in plan_buffers(twin):
                    b.copy_(self.buffers_before[name])
            # float32 eager's random numbers (stochastic depth's torch.rand); kernels torch has
            # only for narrower dtypes (grouped matmuls) from their definition
            with Float32Draws(), Float64Kernels():
                loss64 = _forward_backward(twin, tree_map(_to_double, self.on_device(batch)), seed, keys=self.keys)
        except Exception as e:  # the user's model need not run in float64: judge without the term
            return {}, {}, 0.0, f"no float64 reference ({type(e).__name__}: {str(e).splitlines()[0][:80]})"
        same = SAME_FUNCTION if self.precision.compute == Precision.FP32 else SAME_FUNCTION_LOW
        if abs(float(loss64) - float(loss)) > same * max(abs(float(loss64)), 1e-12):
            return {}, {}, 0.0, (f"no float64 reference (its loss {float(loss64):.8g} is not "
                             f"{self.precision.compute}'s {float(loss):.8g})")
        twins, twin_buffers = dict(twin.named_parameters()), dict(plan_buffers(twin))
        return ({name: deviation(p.grad, twins[name].grad, 1.0) for name, p in self.named.items()
                 if p.grad is not None and twins[name].grad is not None},
                {name: deviation(b, twin_buffers[name], 1.0) for name, b in plan_buffers(self.model)
                 if b.is_floating_point()}, abs(float(loss64) - float(loss)), None)

    def load(self, params: dict[str, torch.Tensor], states: dict[str, torch.Tensor],
             buffers: dict[str, torch.Tensor]) -> None:
        """Parameters, buffers and optimizer state from the plan's logical tensors (``exp_avg:<fqn>``,
        ``step``, fp16's scale state)."""
        if self.scaler is not None:
            self.scaler.load(states)
        own_buffers = plan_tensors(self.model)
        with torch.no_grad():
            for name, t in params.items():
                self.named[name].copy_(t)
            for name, t in buffers.items():
                own_buffers[name].copy_(t)
        step = states.get(str(StateName("step")))
        for name, p in self.named.items():
            state = {kind: states[str(StateName(kind, name))].to(p.device, copy=True) for kind in self._kinds()
                     if str(StateName(kind, name)) in states}
            if self.kind == "adamw":
                state["step"] = torch.tensor(float(step), dtype=torch.float32, device=step_device(self.opt, p))
            self.opt.state[p] = state

    def clip(self, norm: float | None = None) -> None:
        """torch.nn.utils.clip_grad_norm_ over the gradients the step is about to use (nothing
        without ``clip_grad``): its two halves, the total norm (which joins ``norms``) and the
        scaling by a total norm, ``norm`` where given (the plan's: the update from the same
        gradients and the same norm, see run_check), else its own."""
        if self.clip_grad is None:
            return
        params = [p for p in self.named.values() if p.grad is not None]
        own = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0, foreach=False)
        self.norms.append(float(own))
        total = own if norm is None else torch.tensor(norm, dtype=own.dtype)
        torch.nn.utils.clip_grads_with_norm_(params, self.clip_grad, total, foreach=False)

    def set_lr(self, lr: float) -> None:
        """The next step's learning rate, as a schedule sets it."""
        for group in self.opt.param_groups:
            group["lr"] = lr

    def state_of(self, name: str) -> dict[str, torch.Tensor]:
        st = self.opt.state[self.named[name]]
        return {str(StateName(k, name)): st[k] for k in self._kinds() if k in st}

    def _kinds(self) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq") if self.kind == "adamw" else ("momentum_buffer",)


def _forward_backward(model: torch.nn.Module, batch, seed: int, precision: Precision = Precision.FP32,
                      scaler: LossScaler | None = None, opt=None, keys: tuple[str, ...] = ()) -> torch.Tensor:
    torch.manual_seed(seed)  # dropout masks: the plan seeds its step the same way
    device = next(model.parameters(), torch.empty(0)).device
    with autocast(precision, device.type), plan_dropout(device):  # on a GPU, the plan's dropout masks
        loss = loss_of(call_forward(model, batch, keys))
    if scaler is None:
        loss.backward()
    else:
        scaler.backward(loss, opt)
    return loss.detach()


def _finite(tensors) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _detached_attributes(model: torch.nn.Module) -> dict[int, torch.Tensor]:
    """A deepcopy memo copying each tensor a module keeps as a plain attribute and computed with
    autograd (the old ``nn.utils.weight_norm``'s and ``spectral_norm``'s ``weight``, which their
    forward pre-hooks compute again) detached: deepcopy refuses tensors that are not graph leaves."""
    return {id(t): t.detach().clone() for m in model.modules() for t in vars(m).values()
            if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter) and t.grad_fn is not None}


def _to_double(x):
    return x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def step_lr(lrs: tuple[float, ...] | None, step: int) -> float | None:
    """The learning rate of ``step`` under ``--lr-schedule`` (the last one repeats); None: the
    plan's compiled ``optimizer.lr``."""
    return lrs[min(step, len(lrs) - 1)] if lrs else None


def run_check(plan: Plan, source: ModelSource | None, runner: Runner, optimizer: OptimizerConfig, *,
              steps: int, seed: int, tolerance: float, free_running: bool = False,
              lrs: tuple[float, ...] | None = None) -> CheckReport | None:
    """Every rank calls this (the gathers are collectives); rank 0, which alone needs ``source``,
    runs eager PyTorch and returns the report, the others return None. ``lrs``: the learning
    rate of each step (the last repeats), given to the plan as its step input and to torch.optim
    as ``param_groups[i]["lr"]``, as a schedule sets it."""
    lead = runner.topology.rank == 0
    weights = runner.logical_weights()
    params, states = {n: weights[n] for n in (p.name for p in plan.params) if n in weights}, runner.logical_states()
    buffers = {b.name: weights[b.name] for b in plan.buffers if b.name in weights}
    batches = BatchSource(plan, seed)
    if not lead:
        for step in range(steps):
            runner.step(batches(step), rng_seed=step_seed(seed, step), keep_grads=True, lr=step_lr(lrs, step))
            runner.logical_params(), runner.logical_states(), runner.replica_spread(), runner.logical_buffers()
        return None
    report = CheckReport(tolerance=tolerance, clip_grad=optimizer.clip_grad)
    device = runner.backend.device
    eager = Eager(source, optimizer, seed, plan.precision, device, fused=plan.optimizer.fused,
                  keys=plan.model.batch_keys)
    eager_state = plan_tensors(eager.model)
    init = Deviation()
    for name, t in weights.items():
        init.update(name, deviation(t, eager_state[name], max(amax(eager_state[name]), 1e-12)))
    report.rows.append(StepRow("init", None, None, Deviation(), Deviation(), init))
    with torch.no_grad():
        for name, t in weights.items():
            eager_state[name].copy_(t)
    free = None
    if free_running:
        free, report.free = Eager(source, optimizer, seed, plan.precision, device, fused=plan.optimizer.fused,
                  keys=plan.model.batch_keys), FreeRunning()
    for step in range(steps):
        batch = batches(step)
        lr = step_lr(lrs, step)
        result = runner.step(batch, rng_seed=step_seed(seed, step), keep_grads=True, lr=lr)
        new_params, new_states, spreads = runner.logical_params(), runner.logical_states(), runner.replica_spread()
        new_buffers = runner.logical_buffers()
        row = StepRow(str(step), result.loss, None, Deviation(), Deviation(), Deviation())
        report.rows.append(row)
        # loss and gradients from the plan's parameters S_t
        eager.load(params, states, buffers)
        loss = eager.forward_backward(batch, step_seed(seed, step))
        row.loss_eager = float(loss)
        refs = {name: p.grad if p.grad is not None else torch.zeros_like(p) for name, p in eager.named.items()}
        finite = _finite(refs.values())
        noise, buffer_noise, loss_noise, why = (eager.rounding_noise(batch, step_seed(seed, step), loss) if finite
                                                else ({}, {}, 0.0, None))
        # the buffers after the forward (BatchNorm's running statistics), from the same S_t and
        # batch; on eager's own error too (a running mean that is zero in exact arithmetic, of
        # a BatchNorm after a BatchNorm, is rounding noise, which a dp split sums in another order)
        eager_buffers = plan_tensors(eager.model)
        for name, got in new_buffers.items():
            ref = eager_buffers[name]
            scale = max(amax(ref), buffer_noise.get(name, 0.0) / NOISE_RESOLUTION, 1e-30)
            row.update.update(name, deviation(got, ref, scale))
        for b in plan.written_buffers:
            if b.name not in new_buffers:
                row.update.update(f"{b.name} (the plan returned none)", float("inf"))
        low = COMPUTE_DTYPE[plan.precision.compute]  # a low-precision draw of rounding may be unluckily small
        noise = {name: low_precision_noise(noise.get(name, 0.0), amax(g), low) for name, g in refs.items()}
        loss_noise = low_precision_noise(loss_noise, abs(float(loss)), low)
        # the loss too is judged on eager's own error where that is above its size: under
        # autocast (a tp split reassociates the low-precision logits), and in float32 a loss
        # that is the small residue of large terms (a KL divergence of close distributions)
        loss_scale = max(abs(float(loss)), 1e-12, loss_noise / NOISE_RESOLUTION)
        row.loss.update("loss", deviation(torch.tensor(result.loss), loss, loss_scale))
        note = why and why + ": gradients judged on their scale and the floor alone"
        if note and note not in report.notes:  # once, though every step finds it
            report.notes.append(note)
        if finite:
            for name, dev in grad_deviations(result.grads, refs, noise).items():
                row.grads.update(name, dev)
        else:  # fp16 overflowed in eager: the plan's gradients must overflow too, and the step be skipped
            report.notes.append(f"step {step}: eager's scaled gradients overflow, and so must the plan's")
            row.grads.update("overflow (the plan's gradients are finite)",
                             0.0 if not _finite(result.grads.values()) else float("inf"))
        for name in sorted({n for n, p in eager.named.items() if p.grad is not None} - set(result.grads)):
            row.grads.update(f"{name} (the plan returned none)", float("inf"))
        for name in sorted(set(params) - set(new_params)):
            row.update.update(f"{name} (the plan returned none)", float("inf"))
        # the update from the plan's gradients and state S_t (backward changed neither), at the step's lr
        eager.set_lr(plan.optimizer.lr if lr is None else lr)
        skipped = False
        if eager.scaler is None:
            # dense, as the plan's update reads them (backend._fused_adamw): torch's fused CPU
            # kernel reads a gradient in memory order, so a channels-last one the plan returned
            # (ConvNeXt's downsampling conv) would step the wrong entries of the reference
            for name, p in eager.named.items():
                p.grad = result.grads[name].to(p.dtype).contiguous() if name in result.grads else None
            eager.clip(result.grad_norm)
            eager.opt.step()
        else:
            clip = (lambda: eager.clip(result.grad_norm)) if eager.clip_grad is not None else None
            skipped, scale_state = eager.scaler.step(eager.opt, eager.named, result.grads, clip=clip)
            for sname, sref in scale_state.items():
                row.update.update(sname, deviation(new_states[sname], sref, max(amax(sref), 1e-30)))
                row.update.update(f"{sname} across ranks", spreads.get(sname, 0.0) / max(amax(sref), 1e-30))
            if skipped:
                report.skipped_steps += 1
        # the plan's norm of the gradients it returned against torch's of them: a sum over every
        # gradient entry, judged as a gradient is; the update above clipped by the plan's norm
        if eager.clip_grad is not None:
            norm = eager.norms[-1]
            got = float("nan") if result.grad_norm is None else result.grad_norm
            row.grads.update("grad norm", deviation(torch.tensor(got), torch.tensor(norm), max(abs(norm), 1e-30)))
            report.clip_coefs.append(min(1.0, eager.clip_grad / (norm + 1e-6)))
        for name, new in new_params.items():
            ref = eager.named[name].detach()
            row.update.update(name, update_deviation(new, ref, params[name]))
            row.update.update(f"{name} across ranks", spreads.get(name, 0.0) / update_scale(ref, params[name]))
            for sname, sref in eager.state_of(name).items():
                if sname in new_states:
                    row.update.update(sname, deviation(new_states[sname], sref, max(amax(sref), 1e-30)))
                    row.update.update(f"{sname} across ranks", spreads.get(sname, 0.0) / max(amax(sref), 1e-30))
        step_name = str(StateName("step"))
        if step_name in new_states:
            row.update.update(step_name, deviation(new_states[step_name], states[step_name] + (0 if skipped else 1), 1.0))
        params, states, buffers = new_params, new_states, new_buffers
        if LOSS_SCALE in states:
            report.loss_scale = float(states[LOSS_SCALE])
        if free is not None:
            report.free.losses_plan.append(result.loss)
            report.free.losses_eager.append(float(free.forward_backward(batch, step_seed(seed, step))))
            free.set_lr(plan.optimizer.lr if lr is None else lr)
            free.clip()
            free.opt.step() if free.scaler is None else free.scaler.own_step(free.opt)
    if free is not None:
        for name, p in params.items():
            report.free.params.update(name, deviation(p, free.named[name], max(amax(free.named[name]), 1e-12)))
    return report


def check_worker(payload: dict) -> CheckReport | None:
    """One rank of a multi-device check (a ``runtime.launch`` target)."""
    from sbpc.compiler.frontend.model_loader import load_model
    from sbpc.runtime.backend import make_backend
    from sbpc.runtime.dist import init_distributed
    from sbpc.runtime.plan import load_plan

    plan = load_plan(payload["plan"])
    backend = payload.get("backend", "cpu")
    comm = init_distributed(plan, timeout=payload["timeout"], backend=backend)
    runner = make_runner(plan, make_backend(backend, comm, comm.topology), seed=payload["seed"])
    source = load_model(plan.model.path, dict(plan.model.sets)) if comm.topology.rank == 0 else None
    return run_check(plan, source, runner, payload["optimizer"], steps=payload["steps"], seed=payload["seed"],
                     tolerance=payload["tolerance"], free_running=payload["free_running"], lrs=payload["lrs"])


def check_on_ranks(plan: Plan, optimizer: OptimizerConfig, *, steps: int, seed: int, tolerance: float,
                   timeout: float = 300, free_running: bool = False, ranks: str = "processes",
                   backend: str = "cpu", lrs: tuple[float, ...] | None = None) -> CheckReport:
    """Run ``check_worker`` on one local process per device of the plan's mesh (gloo), or with
    ``ranks="threads"`` on one thread per device of this process (``runtime.threads``)."""
    import os
    import tempfile

    from sbpc.runtime.launch import launch
    from sbpc.runtime.plan import save_plan

    with tempfile.TemporaryDirectory(prefix="sbpc-check-") as tmp:
        path = os.path.join(tmp, "plan.json")
        save_plan(plan, path)
        payload = dict(plan=path, optimizer=optimizer, steps=steps, seed=seed, tolerance=tolerance, timeout=timeout,
                       free_running=free_running, backend=backend, lrs=lrs)
        return launch(plan.world_size, "sbpc.compiler.tools.check:check_worker", payload, timeout=timeout,
                      ranks=ranks)[0]
