"""A recurrent scan written the way RWKV's and RecurrentGemma's CPU paths write it: step t's
state is stored into a slice of a tensor made by ``zeros_like`` (``out[:, t] = ...``).

autograd's backward of such a write (``CopySlices``) makes the gradient's buffer with
``new_empty_strided`` and copies into it: ``normalize`` makes that a plain ``new_empty``, so
on a pipeline the buffer splits with the micro-batches instead of needing the whole batch.
"""
import torch
import torch.nn.functional as F


class Scan(torch.nn.Module):
    def __init__(self, d=16, classes=5):
        super().__init__()
        self.inp = torch.nn.Linear(d, d)
        self.rec = torch.nn.Linear(d, d, bias=False)
        self.head = torch.nn.Linear(d, classes)

    def forward(self, x, y):
        u = self.inp(x)
        out = torch.zeros_like(u)
        state = torch.zeros_like(u[:, 0])
        for t in range(u.shape[1]):
            state = torch.tanh(u[:, t] + self.rec(state))
            out[:, t] = state
        return F.cross_entropy(self.head(out.mean(1)), y)


def build_model():
    return Scan()


def example_batch(batch_size):
    return torch.randn(batch_size, 6, 16), torch.randint(0, 5, (batch_size,))
