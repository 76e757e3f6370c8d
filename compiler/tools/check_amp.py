"""The eager reference of fp16's dynamic loss scaling for `sbpc check`: torch.amp.GradScaler, put
in the plan's scale state S_t before each step, like the optimizer (docs/precision.md)."""
from __future__ import annotations

import torch

from sbpc.runtime.precision import GROWTH_TRACKER, LOSS_SCALE, SKIPPED_STEPS
from sbpc.runtime.plan import LossScaling


class LossScaler:
    """GradScaler scales eager's loss and unscales eager's gradients (loss and gradients from
    S_t); for the update, a fresh GradScaler in the same state decides the skip and the new scale
    from *the plan's* gradients (the update from the same gradients and state)."""

    def __init__(self, cfg: LossScaling):
        self.cfg = cfg
        self.state: dict[str, torch.Tensor] = {}
        self.scaler = self._scaler()

    def load(self, states: dict[str, torch.Tensor]) -> None:
        self.state = {k: states[k].clone() for k in (LOSS_SCALE, GROWTH_TRACKER, SKIPPED_STEPS)}
        self.scaler = self._scaler()

    def _scaler(self) -> torch.amp.GradScaler:
        c = self.cfg
        scaler = torch.amp.GradScaler("cpu", init_scale=c.init_scale, growth_factor=c.growth_factor,
                                      backoff_factor=c.backoff_factor, growth_interval=c.growth_interval)
        if self.state:
            scaler.load_state_dict(dict(scale=float(self.state[LOSS_SCALE]), growth_factor=c.growth_factor,
                                        backoff_factor=c.backoff_factor, growth_interval=c.growth_interval,
                                        _growth_tracker=int(self.state[GROWTH_TRACKER])))
        scaler.scale(torch.zeros(()))  # GradScaler makes its scale tensor on first use
        return scaler

    def backward(self, loss: torch.Tensor, opt: torch.optim.Optimizer) -> None:
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(opt)

    def own_step(self, opt: torch.optim.Optimizer) -> None:
        """GradScaler's step and update on eager's own gradients (``backward`` unscaled them): the
        free-running trajectory (`--free-running`), whose scale follows its own overflows."""
        self.scaler.step(opt)
        self.scaler.update()

    def step(self, opt: torch.optim.Optimizer, params: dict[str, torch.nn.Parameter],
             grads: dict[str, torch.Tensor], clip=None) -> tuple[bool, dict[str, torch.Tensor]]:
        """GradScaler.step and update on the plan's (unscaled) gradients: whether it skipped, and
        the new scale state. GradScaler decides on the gradients it unscales itself, so it is
        handed the plan's scaled back: exact, the scale being a power of two (2**16 times powers
        of the growth and backoff factors 2 and 1/2). ``clip`` (a function of no arguments)
        runs between ``unscale_`` and ``step``, where clip_grad_norm_ goes under GradScaler."""
        scaler = self._scaler()
        scale = float(self.state[LOSS_SCALE])
        for name, p in params.items():
            p.grad = (grads[name].to(p.dtype) * scale).contiguous() if name in grads else None  # dense: see check.py
        skipped = not all(bool(torch.isfinite(g).all()) for g in grads.values())  # GradScaler's own test
        if clip is not None:
            scaler.unscale_(opt)
            clip()
        scaler.step(opt)
        scaler.update()
        st = scaler.state_dict()
        return skipped, {LOSS_SCALE: torch.tensor(st["scale"], dtype=torch.float32),
                         GROWTH_TRACKER: torch.tensor(st["_growth_tracker"], dtype=torch.int32),
                         SKIPPED_STEPS: self.state[SKIPPED_STEPS] + int(skipped)}
