"""A loss that is not a plain mean: cross-entropy plus a multi-label BCE-with-logits (class
weights and positive weights) plus a constant. The constant makes the loss a once-a-step value
on a pipeline (it is added after the sum over micro-batches), and BCE needs its own rule to
split with the micro-batches."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Heads(nn.Module):
    def __init__(self, offset: float):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.cls = nn.Linear(32, 10)
        self.tags = nn.Linear(32, 5)
        self.register_buffer("tag_weight", torch.linspace(0.5, 1.5, 5))
        self.register_buffer("pos_weight", torch.linspace(1.0, 3.0, 5))
        self.offset = offset

    def forward(self, x, y, tags):
        h = self.body(x)
        loss = self.offset + F.cross_entropy(self.cls(h), y)
        return loss + F.binary_cross_entropy_with_logits(self.tags(h), tags, weight=self.tag_weight,
                                                         pos_weight=self.pos_weight)


def build_model(offset: float = 1.0, **kw):
    return Heads(float(offset))


def example_batch(batch_size, **kw):
    return torch.randn(batch_size, 16), torch.randint(0, 10, (batch_size,)), (torch.rand(batch_size, 5) > 0.5).float()
