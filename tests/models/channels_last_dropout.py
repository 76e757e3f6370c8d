"""Dropout on a channels-last activation, as a segmentation head has it (SegFormer's decode
head): the input arrives channels-last, so the convolutions, batch norm and ReLU keep that
layout, and dropout's ``empty_like(x).bernoulli_`` draws its mask in ``N, H, W, C`` memory
order. Capture draws it in that order too (``compiler/frontend/random_layout.py``)."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 1)
        self.bn = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.3)
        self.cls = nn.Conv2d(8, 4, 1)

    def forward(self, x, target):
        x = x.contiguous(memory_format=torch.channels_last)
        return F.cross_entropy(self.cls(self.drop(F.relu(self.bn(self.conv(x))))), target)


def build_model():
    return Head()


def example_batch(batch_size):
    return torch.randn(batch_size, 3, 6, 6), torch.randint(0, 4, (batch_size, 6, 6))
