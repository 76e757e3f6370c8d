"""``sbpc.trunc_normal_``: ``torch.nn.init.trunc_normal_`` as one op of an init program.

torch draws a truncated normal by rejection: it redraws until every value lies within the
bounds, a loop whose count depends on the values drawn (``if not mask.any()``), which capture,
on fake tensors, cannot unroll (ViT, ConvNeXt and Swin initialise with it). So capture records
the whole call as this op (``compiler/frontend/init_record.py``), and the runtime runs torch's
own function on the init program's seeded generator: eager's values bit for bit, and the
generator left where eager's is.
"""
from __future__ import annotations

import torch
from torch.nn import init as _init

TRUNC_NORMAL = "sbpc.trunc_normal_.default"
# bound at import, before capture redirects torch.nn.init's name to the op below
_draw = _init._no_grad_trunc_normal_


@torch.library.custom_op("sbpc::trunc_normal_", mutates_args=("tensor",), tags=(torch.Tag.nondeterministic_seeded,),
                         schema="(Tensor(a!) tensor, float mean, float std, float a, float b, *, "
                                "Generator? generator=None) -> ()")
def _trunc_normal_(tensor, mean, std, a, b, *, generator=None):
    _draw(tensor, mean, std, a, b, generator=generator)


@_trunc_normal_.register_fake
def _(tensor, mean, std, a, b, *, generator=None):
    return None


def trunc_normal_(tensor: torch.Tensor, mean: float, std: float, a: float, b: float,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """What capture puts in place of ``torch.nn.init._no_grad_trunc_normal_`` (same signature)."""
    if generator is not None:  # the user's own generator: the plan cannot replay its stream
        return _draw(tensor, mean, std, a, b, generator=generator)
    torch.ops.sbpc.trunc_normal_.default(tensor, float(mean), float(std), float(a), float(b))
    return tensor
