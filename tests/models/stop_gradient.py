"""A BYOL-style pair of branches: the target under ``torch.no_grad`` and detached, compared by
cosine similarity; a class-weighted cross-entropy with its weights in a non-persistent buffer;
Mish and Hardswish. Under bf16 on 2x1x2 its eager loss of the first step (seed 0) came within
u/8000 of float64 by luck, and a correct plan failed on that scale (deviation.LOW_NOISE_FLOOR)."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class StopGradient(nn.Module):
    def __init__(self):
        super().__init__()
        self.online = nn.Sequential(nn.Linear(16, 32), nn.Mish(), nn.Linear(32, 16))
        self.target = nn.Sequential(nn.Linear(16, 32), nn.Hardswish(), nn.Linear(32, 16))
        self.cls = nn.Linear(16, 4)
        self.register_buffer("class_weight", torch.tensor([1.0, 2.0, 0.5, 1.5]), persistent=False)

    def forward(self, x, label):
        p = self.online(x)
        with torch.no_grad():
            t = self.target(x + 0.1)
        similarity = F.cosine_similarity(p, t.detach(), dim=-1).mean()
        return F.cross_entropy(self.cls(p), label, weight=self.class_weight) - similarity


def build_model():
    return StopGradient()


def example_batch(batch_size):
    return torch.randn(batch_size, 16), torch.randint(0, 4, (batch_size,))
