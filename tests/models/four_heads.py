"""One attention block, 4 heads of hidden 64, separate q/k/v: no dim divides by 3."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self, hidden=64, heads=4, seq=8):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden) for _ in range(4))
        self.up, self.down = nn.Linear(hidden, 2 * hidden), nn.Linear(2 * hidden, hidden)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (f(x).view(b, t, self.heads, c // self.heads).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.o(y)
        return (x + self.down(F.gelu(self.up(x)))).pow(2).sum()


def build_model():
    return Net()


def example_batch(batch_size):
    return (torch.randn(batch_size, 8, 64),)
