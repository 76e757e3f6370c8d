"""``as_strided`` that only reshapes becomes ``view``, on the traced fx graph.

An ``as_strided`` reads its input's storage through explicit strides, which neither SBP (a
shard's storage is not the logical tensor's) nor functionalization (no inverse to scatter a
write back through) can follow. PyTorch emits it where it means a plain reshape: adaptive
average pooling to size 1 restrides its mean in place (``as_strided_``) when the input looks
channels-last (``AdaptiveAvgPool1d`` after a transpose: Swin's pooler), and that op's backward
writes the gradient through an ``as_strided`` view of a fresh zero buffer (``copy_``). Where the
input is contiguous from its storage's start and the strides are the contiguous ones of the new
shape (a size-1 dim's stride is never used), the op is ``view(x, size)``, value for value; an
in-place one that keeps the shape changes no value and is dropped. Strides come from the
trace's fake tensors (``meta["val"]``); any other ``as_strided`` is left as it is.
"""
from __future__ import annotations

import math

import torch
import torch.fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

aten = torch.ops.aten


def plain_views(graph: torch.fx.Graph) -> None:
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in (aten.as_strided.default, aten.as_strided_.default):
            continue
        base, size, stride = node.args[:3]
        offset = node.args[3] if len(node.args) > 3 else node.kwargs.get("storage_offset")
        x = base.meta.get("val") if isinstance(base, torch.fx.Node) else None
        if not isinstance(x, torch.Tensor):
            continue
        if not _reshape_of(x, list(size), list(stride), offset):
            if node.target == aten.as_strided.default and (flat := _on_contiguous(x, list(size), list(stride), offset)):
                with graph.inserting_before(node):
                    dense = graph.call_function(aten.clone.default, (base,), {"memory_format": torch.contiguous_format})
                dense.meta = {**base.meta, "val": x.clone(memory_format=torch.contiguous_format)}
                node.args = (dense, list(size), *flat)
            continue
        if node.target == aten.as_strided_.default:
            if list(x.shape) != list(size):
                continue  # a reshape in place: later readers of the input would see the new shape
            node.replace_all_uses_with(base)
        else:
            with graph.inserting_before(node):
                view = graph.call_function(aten.view.default, (base, list(size)))
            view.meta = dict(node.meta)
            node.replace_all_uses_with(view)
        graph.erase_node(node)


def _reshape_of(x: torch.Tensor, size: list, stride: list, offset) -> bool:
    if not (x.is_contiguous() and x.storage_offset() == 0 and offset in (None, 0)):
        return False
    if x.untyped_storage().nbytes() != x.numel() * x.element_size() or math.prod(size) != x.numel():
        return False  # a view into a larger storage: as_strided may read beyond it
    expected = 1
    for s, st in reversed(list(zip(size, stride))):
        if s != 1 and st != expected:
            return False
        expected *= s
    return True


def _on_contiguous(x: torch.Tensor, size: list, stride: list, offset) -> tuple[list, int] | None:
    """The strides and offset that read the same elements of ``x`` from a contiguous copy of it.
    ``x`` is a view (a transpose, a slice) whose storage the plan does not keep: after a gather,
    a copy or on a shard the same logical tensor has another layout, so strides of the original
    storage would read other elements (Longformer's overlapping chunks of a transposed tensor).
    None when the read is not strided in ``x``'s own element order, or leaves ``x``'s elements."""
    if x.is_contiguous() and x.storage_offset() == 0:
        return None  # the layout a contiguous copy has too
    with unset_fake_temporarily():  # the trace's fake mode may still be on: these are real index tensors
        return _strides_in_elements(x, size, stride, offset)


def _strides_in_elements(x: torch.Tensor, size: list, stride: list, offset) -> tuple[list, int] | None:
    numel = x.untyped_storage().nbytes() // x.element_size()
    where = torch.as_strided(torch.arange(numel), x.shape, x.stride(), x.storage_offset())
    element = torch.full((numel,), -1, dtype=torch.long)
    element[where.reshape(-1)] = torch.arange(x.numel())
    start = x.storage_offset() if offset is None else offset
    try:
        picked = element[torch.as_strided(torch.arange(numel), size, stride, start)]
    except RuntimeError:  # reads beyond the storage
        return None
    if picked.numel() == 0 or bool((picked < 0).any()):
        return None
    first = int(picked.reshape(-1)[0])
    steps = [int(picked[tuple(1 if j == d else 0 for j in range(len(size)))]) - first if n > 1 else 0
             for d, n in enumerate(size)]
    if any(st < 0 for st in steps) or not torch.equal(picked, torch.as_strided(torch.arange(x.numel()), size, steps, first)):
        return None
    return steps, first
