"""A mixture-of-experts layer as Hugging Face's MoE models run it (``torch._grouped_mm`` over
tokens sorted by expert, group offsets from the routing): not capturable with static shapes."""
import torch


class Moe(torch.nn.Module):
    def __init__(self, dim: int = 8, experts: int = 2):
        super().__init__()
        self.router = torch.nn.Linear(dim, experts)
        self.experts = torch.nn.Parameter(torch.randn(experts, dim, dim) / dim ** 0.5)

    def forward(self, x):
        choice = self.router(x).argmax(-1)
        order = choice.argsort()
        counts = torch.histc(choice.float(), bins=self.experts.shape[0], min=0, max=self.experts.shape[0] - 1)
        offsets = counts.cumsum(0).to(torch.int32)
        out = torch._grouped_mm(x[order], self.experts, offs=offsets)
        return out.pow(2).mean()


def build_model():
    return Moe()


def example_batch(batch_size):
    return (torch.randn(batch_size, 8),)
