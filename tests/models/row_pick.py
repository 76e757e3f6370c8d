"""Values picked one per row by ``x[torch.arange(B), j]``: the hidden state at each row's last
real token (``j = lengths - 1``, as GPT-2's sequence classifier and CLIP's pooler pick theirs),
and the loss as the picked log-probability of each label (``j`` may be negative: the last
class as ``-1``)."""
import torch
import torch.nn as nn


class M(nn.Module):
    def __init__(self, vocab=32, dim=16, classes=5):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, ids, lengths, y):
        h = torch.tanh(self.mix(self.emb(ids)))
        rows = torch.arange(ids.shape[0])
        last = h[rows, lengths - 1]
        logp = torch.log_softmax(self.head(last), dim=-1)
        return -logp[rows, y].mean()


def build_model():
    return M()


def example_batch(batch_size):
    lengths = torch.tensor([8 - (3 * i) % 5 for i in range(batch_size)])
    y = torch.tensor([(-1 if i % 3 == 0 else i % 5) for i in range(batch_size)])
    return torch.randint(0, 32, (batch_size, 8)), lengths, y
