"""Distillation: the loss is the KL divergence of a student's distribution from a teacher's,
two close distributions, so the loss (about 1e-2) is the small residue of terms of about 2:
float32 resolves it only to about 1e-5 of itself, in eager and in any plan alike."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Distill(nn.Module):
    def __init__(self, classes: int):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.student = nn.Linear(32, classes)
        self.teacher = nn.Linear(32, classes)

    def forward(self, x):
        h = self.body(x)
        return F.kl_div(F.log_softmax(self.student(h), -1), F.softmax(self.teacher(h.detach()), -1),
                        reduction="batchmean")


def build_model(classes: int = 10):
    return Distill(classes)


def example_batch(batch_size, **kw):
    return (torch.randn(batch_size, 16),)
