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

aten = torch.ops.aten


def plain_views(graph: torch.fx.Graph) -> None:
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in (aten.as_strided.default, aten.as_strided_.default):
            continue
        base, size, stride = node.args[:3]
        offset = node.args[3] if len(node.args) > 3 else node.kwargs.get("storage_offset")
        x = base.meta.get("val") if isinstance(base, torch.fx.Node) else None
        if not isinstance(x, torch.Tensor) or not _reshape_of(x, list(size), list(stride), offset):
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
