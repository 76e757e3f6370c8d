"""Per-pixel cross-entropy, as a segmentation model computes it:
``cross_entropy(logits[N, C, *S], target[N, *S])``, some targets ``ignore_index``. Torch
lowers it through ``nll_loss2d_forward``/``backward`` (``[N, C, L]`` and ``[N, C, D, H, W]``
too, viewed as ``[N, C, 1, prod(S)]``). ``dims`` picks how many spatial dims, ``classes`` and
``width`` the head's and the body's channels, ``weighted`` adds class weights, and
``reduction`` is ``mean``, ``sum`` or ``none`` (the per-pixel loss, weighted by a fixed map and
then averaged)."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

_CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
_SIZE = {1: (16,), 2: (6, 6), 3: (3, 4, 4)}


class Seg(nn.Module):
    def __init__(self, dims: int, classes: int, width: int, weighted: bool, reduction: str):
        super().__init__()
        conv = _CONV[dims]
        self.body = nn.Sequential(conv(3, width, 3, padding=1), nn.ReLU(), conv(width, width, 3, padding=1), nn.ReLU())
        self.head = conv(width, classes, 1)
        self.register_buffer("class_weight", torch.linspace(0.5, 2.0, classes) if weighted else None)
        # reduction none: a fixed per-pixel weight, so each pixel's loss counts on its own
        self.register_buffer("pixel_weight", torch.linspace(0.2, 1.8, math.prod(_SIZE[dims])).reshape(_SIZE[dims]))
        self.reduction = reduction

    def forward(self, x, target):
        logits = self.head(self.body(x))
        loss = F.cross_entropy(logits, target, weight=self.class_weight, ignore_index=-1, reduction=self.reduction)
        return (loss * self.pixel_weight).mean() if self.reduction == "none" else loss


def build_model(dims: int = 2, classes: int = 6, width: int = 8, weighted: bool = False,
                reduction: str | None = "mean", **kw):
    return Seg(dims, classes, width, weighted, reduction or "none")  # --set reduction=none arrives as None


def example_batch(batch_size, dims: int = 2, classes: int = 6, **kw):
    size = _SIZE[dims]
    target = torch.randint(0, classes, (batch_size, *size))
    # ignored pixels spread unevenly over the batch: the first sample has most of them, so a
    # per-shard mean would differ from the global one
    ignored = torch.rand(batch_size, *size) < torch.linspace(0.6, 0.0, batch_size).reshape(-1, *[1] * len(size))
    return torch.randn(batch_size, 3, *size), target.masked_fill(ignored, -1)
