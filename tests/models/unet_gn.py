"""A small UNet (GroupNorm, SiLU, max-pool down, nearest upsampling, a concatenated skip): the
GroupNorm statistics are per sample, so a pipeline's micro-batches split it like any batch op."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.n1 = nn.GroupNorm(4, cout)
        self.c2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.n2 = nn.GroupNorm(4, cout)

    def forward(self, x):
        return F.silu(self.n2(self.c2(F.silu(self.n1(self.c1(x))))))


class UNet(nn.Module):
    def __init__(self, w=8):
        super().__init__()
        self.d1 = Block(3, w)
        self.d2 = Block(w, 2 * w)
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.u1 = Block(3 * w, w)
        self.out = nn.Conv2d(w, 3, 1)

    def forward(self, x, y):
        a = self.d1(x)
        b = self.d2(F.max_pool2d(a, 2))
        c = self.u1(torch.cat([self.up(b), a], dim=1))
        return F.mse_loss(self.out(c), y)


def build_model():
    return UNet()


def example_batch(batch_size):
    return torch.randn(batch_size, 3, 8, 8), torch.randn(batch_size, 3, 8, 8)
