"""The deviations of `sbpc check` (docs/check.md): a largest elementwise difference as a fraction
of a scale; the check passes when the largest over steps and tensors is within the tolerance.

  loss      |plan - eager| / max(|eager|, n_loss / NOISE_RESOLUTION), n_loss = |eager - eager in
            float64|, eager's own error of the loss (float32's, or under autocast bf16's/fp16's,
            there at least LOW_NOISE_FLOOR u |eager|)
  gradient  max|plan - eager| / max(max|eager|, GRAD_FLOOR * G, n / NOISE_RESOLUTION), G = the
            step's largest eager gradient entry over all parameters, n = max|eager - eager in
            float64|, eager's own float32 error of the tensor (under autocast bf16's/fp16's, at
            least LOW_NOISE_FLOOR u max|eager|)
  update    parameter: max|plan - torch| / max(max|torch - p_t|, eps(dtype) * max|torch|),
            the size of torch's step (floored at the parameter's own resolution);
            optimizer state: max|plan - torch| / max|torch|
            buffer (after the step's forward, from the plan's S_t buffers: BatchNorm's running
            statistics): max|plan - torch| / max(max|torch|, n / NOISE_RESOLUTION), n its
            max|eager - eager in float64|

Every difference is taken in double precision (complex128 for a complex tensor).
"""
from __future__ import annotations

import torch

# A gradient is compared on its own scale unless that is below 1e-3 of the step's largest
# gradient entry: a tensor whose gradient is zero in exact arithmetic carries only rounding
# noise (measured ~1e-10 G on examples/gpt.py), which no scale of its own can judge.
GRAD_FLOOR = 1e-3
# ... nor below the scale at which eager's own float32 gradient means anything: eager is run in
# float64 too, and a tensor whose float32 gradient eager gets right only to n (an ill-conditioned
# one: the layers under a LayerNorm over two features) is judged on n / NOISE_RESOLUTION, so at
# the default tolerance a plan may differ from eager by 33 n. A well-conditioned gradient carries
# n of 1e-7 to 7e-7 of its size (measured on the zoo), so this term is at most about twice its
# own scale; an ill-conditioned one carries up to 1e-3 of it.
NOISE_RESOLUTION = 3e-7
# Under autocast, eager's own error of a value is one draw of bf16's or fp16's rounding, and a
# draw can come out far below its usual size: a bf16 loss of 1.26 came within 5.9e-7 of float64
# (u/8000) at one step and 7.3e-4 (u/8) at the next, and a correct 2x1x2 plan 1.2e-4 away failed
# on the first. So the noise of a low-precision value is at least LOW_NOISE_FLOOR u of its size
# (u: the dtype's unit roundoff): at the default tolerance it may differ from eager by about u/2
# of its size. A gradient's measured n is 1 to 2 u of its scale (docs/check.md): the floor binds
# only on such an unlucky draw, or where no float64 twin measured anything.
LOW_NOISE_FLOOR = 1 / 64


def deviation(a: torch.Tensor, b: torch.Tensor, scale: float) -> float:
    """``max|a - b| / scale`` in float64 (inf for a shape mismatch; 0 when they are equal). On
    ``a``'s device: the plan's loss comes as a number (a CPU tensor of it) and eager's is on
    the GPU, which ``torch.equal`` (the nan test) refuses."""
    a, b = wide(a), wide(b).to(a.device)
    if a.shape != b.shape:
        return float("inf")
    diff = float((a - b).abs().max()) if b.numel() else 0.0
    if diff != diff:  # a nan where the other side has a number (or another nan): never a match
        return 0.0 if bool(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0), b.nan_to_num(0))) \
            else float("inf")
    return diff / scale if diff else 0.0


def low_precision_noise(measured: float, size: float, dtype: torch.dtype) -> float:
    """Eager's own error of a value of ``size`` computed under autocast in ``dtype`` (``measured``
    by the float64 twin, 0 where none ran), floored at LOW_NOISE_FLOOR u of its size; in float32,
    ``measured`` as it is."""
    if dtype == torch.float32:
        return measured
    return max(measured, LOW_NOISE_FLOOR * torch.finfo(dtype).eps / 2 * size)


def amax(t: torch.Tensor) -> float:
    return float(wide(t).abs().max()) if t.numel() else 0.0


def wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in double precision for comparing: complex128 for a complex tensor (``.double()``
    would drop its imaginary part, and a wrong one would pass unseen)."""
    return t.detach().to(torch.complex128 if t.is_complex() else torch.float64)


def grad_deviations(plan: dict[str, torch.Tensor], eager: dict[str, torch.Tensor],
                    noise: dict[str, float] | None = None) -> dict[str, float]:
    """Each gradient's deviation: on its own scale, floored at GRAD_FLOOR of the step's largest
    eager gradient entry G (over all parameters, not only those compared) and at eager's own
    float32 rounding error of the tensor (``noise``: max|float32 - float64|) / NOISE_RESOLUTION."""
    big = max((amax(g) for g in eager.values()), default=0.0)
    noise = noise or {}
    return {name: deviation(g, eager[name], max(amax(eager[name]), GRAD_FLOOR * big,
                                                noise.get(name, 0.0) / NOISE_RESOLUTION, 1e-30))
            for name, g in plan.items()}


def update_deviation(plan: torch.Tensor, eager: torch.Tensor, before: torch.Tensor) -> float:
    """A new parameter's deviation as a fraction of eager's step ``eager - before``, floored at the
    parameter's resolution (eps of its dtype times its largest entry)."""
    return deviation(plan, eager, update_scale(eager, before))


def update_scale(eager: torch.Tensor, before: torch.Tensor) -> float:
    step = amax(wide(eager) - wide(before))
    return max(step, torch.finfo(eager.dtype).eps * amax(eager), 1e-30)
