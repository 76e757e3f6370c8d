"""A regression head trained with ``F.gaussian_nll_loss``: torch's loss checks its variance with
``torch.any(var < 0)`` and raises, a read of a tensor's value that capture keeps as a runtime
check (``compiler/frontend/input_checks.py``). ``var`` is the batch's own third tensor with
``given_var`` (so a step can be handed a bad one), else the head's ``exp`` of a log-variance."""
import torch
import torch.nn.functional as F


class Head(torch.nn.Module):
    def __init__(self, given_var: bool):
        super().__init__()
        self.fc = torch.nn.Linear(4, 8)
        self.given_var = given_var

    def forward(self, x, y, var):
        mu, log_var = self.fc(x).chunk(2, -1)
        return F.gaussian_nll_loss(mu, y, var if self.given_var else log_var.exp())


def build_model(given_var: bool = False, **kw):
    return Head(given_var)


def example_batch(batch_size, **kw):
    return torch.randn(batch_size, 4), torch.randn(batch_size, 4), torch.rand(batch_size, 4) + 0.1
