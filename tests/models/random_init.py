"""Parameters drawn the ways models in the wild draw them: torch.randn / rand / randint (whose
ATen ops take no generator unless asked), and nn.init.trunc_normal_ with bounds that reject
many draws (both of torch's sampling branches: p > 0.3 redraws from the normal, p <= 0.3
samples from a uniform with an acceptance test), and the usual module inits after them. Python
numbers read from tensors of no random origin (drop-path rates from a linspace, a test on an
arange) are what eager reads."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class M(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(8, dim) * 0.02)
        self.gain = nn.Parameter(torch.rand(dim) + 0.5)
        self.register_buffer("perm", torch.randint(0, dim, (dim,)))
        self.cls = nn.Parameter(torch.empty(1, dim))
        nn.init.trunc_normal_(self.cls, std=1.0, a=-0.5, b=0.5)  # p = 0.38: redraws until all are in
        self.proj = nn.Linear(dim, dim)
        nn.init.trunc_normal_(self.proj.weight, std=1.0, a=1.0, b=3.0)  # p = 0.16: the acceptance branch
        nn.init.trunc_normal_(self.proj.bias, std=0.02)
        self.head = nn.Linear(dim, 4)
        rates = [x.tolist() for x in torch.linspace(0, 0.3, 4).split([1, 3])]
        self.rate = rates[1][1]  # 0.2, used in forward
        self.shift = 1.0 if bool((torch.arange(dim) > dim - 2).any()) else 0.0

    def forward(self, x, y):
        h = self.proj((x + self.pos)[..., self.perm] * self.gain) + self.cls
        return F.cross_entropy(self.head(h * self.rate + self.shift).mean(1), y)


def build_model():
    return M()


def example_batch(batch_size):
    return torch.randn(batch_size, 8, 16), torch.randint(0, 4, (batch_size,))
