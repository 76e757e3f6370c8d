"""A reversible block (RevNet, Reformer): the forward keeps no activations and the backward
recomputes them, accumulating the parameters' gradients into .grad itself."""
import torch
from torch import nn


class _Reversible(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, f, g):
        x1, x2 = x.chunk(2, dim=-1)
        y1 = x1 + f(x2)
        y2 = x2 + g(y1)
        ctx.f, ctx.g = f, g
        y = torch.cat([y1, y2], -1)
        ctx.save_for_backward(y.detach())
        return y

    @staticmethod
    def backward(ctx, dy):
        y, = ctx.saved_tensors
        y1, y2 = y.chunk(2, dim=-1)
        dy1, dy2 = dy.chunk(2, dim=-1)
        with torch.enable_grad():
            y1 = y1.detach().requires_grad_()
            gy1 = ctx.g(y1)
            torch.autograd.backward(gy1, dy2)  # g's parameter gradients land in their .grad
        with torch.no_grad():
            x2 = y2 - gy1
            dx1 = dy1 + y1.grad
        with torch.enable_grad():
            x2 = x2.detach().requires_grad_()
            fx2 = ctx.f(x2)
            torch.autograd.backward(fx2, dx1)
        return torch.cat([dx1, dy2 + x2.grad], -1), None, None


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.f, self.g = nn.Linear(8, 8), nn.Linear(8, 8)
        self.inp, self.head = nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.head(_Reversible.apply(self.inp(x), self.f, self.g)), y)


def build_model(warm_up: bool = False):
    m = M()
    if warm_up:  # a step before compile leaves .grad behind, which the plan's gradients must not take in
        m(*example_batch(2)).backward()
    return m


def example_batch(batch_size, warm_up: bool = False):
    return torch.randn(batch_size, 16), torch.randint(0, 4, (batch_size,))
