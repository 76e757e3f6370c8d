"""A LayerNorm straight on the batch input: its backward needs no input gradient (output_mask
[False, True, True]), so that output is an empty placeholder the rules must not index."""
import torch
class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(8)
        self.lin = torch.nn.Linear(8, 8)
    def forward(self, x):
        return self.lin(self.ln(x)).square().mean()
def build_model():
    return M()
def example_batch(batch_size):
    return (torch.randn(batch_size, 6, 8),)
