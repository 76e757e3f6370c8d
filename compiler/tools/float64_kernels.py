"""Float64 kernels for the reference copy of ``sbpc check`` where torch has none.

``sbpc check`` measures eager's own rounding error against a float64 copy of the model
(``check.py``'s ``rounding_noise``). Some kernels have no float64 implementation on CPU:
``torch._grouped_mm``, which Hugging Face's mixture-of-experts layers call (forward and
backward), accepts float32, bfloat16 and float16 only. Without the copy, a bf16 check has no
measure of eager's error and judges every gradient on the float32 floor, so a correct plan
that sums in another order fails. ``Float64Kernels`` computes those ops in float64 from
their definition: one matmul per group.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_GROUPED_MM = torch.ops.aten._grouped_mm.default


class Float64Kernels(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _GROUPED_MM and args[0].dtype == torch.float64:
            return _grouped_mm(*args, **kwargs)
        return func(*args, **kwargs)


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch._grouped_mm`` by its definition: ``offs`` (cumulative group ends) groups the rows
    of a 2-D ``a`` (one matrix of ``b`` each), the inner dim of two 2-D operands (one result
    each), or the columns of a 2-D ``b``; without it, a batched matmul. Rows or columns past
    the last group stay zero."""
    if offs is None:
        out = torch.bmm(a, b)
    else:
        bounds = [0] + offs.tolist()
        spans = list(enumerate(zip(bounds[:-1], bounds[1:])))
        if a.dim() == 2 and b.dim() == 3:
            out = a.new_zeros(a.shape[0], b.shape[-1])
            for g, (s, e) in spans:
                out[s:e] = a[s:e] @ b[g]
        elif a.dim() == 2 and b.dim() == 2:
            out = a.new_zeros(len(spans), a.shape[0], b.shape[-1])
            for g, (s, e) in spans:
                out[g] = a[:, s:e] @ b[s:e]
        else:  # a 3-D, b 2-D: b's columns grouped
            out = a.new_zeros(a.shape[1], b.shape[-1])
            for g, (s, e) in spans:
                out[:, s:e] = a[g] @ b[:, s:e]
    if bias is not None:
        out = out + bias
    return out if out_dtype is None else out.to(out_dtype)
