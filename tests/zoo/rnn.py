"""A recurrent language model of PyTorch's own ``nn.LSTM`` (two layers, bidirectional) and
``nn.GRU``, unmodified. Capture traces each time step's cell as ATen ops (oneDNN's fused LSTM
kernel is CPU-only and unsplittable, so capture turns oneDNN off); the per-step ``unbind`` of
the sequence and of a one-layer initial state are list results the plan unpacks."""
import torch
import torch.nn.functional as F


class RecurrentLM(torch.nn.Module):
    def __init__(self, vocab, hidden, layers):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, hidden)
        self.lstm = torch.nn.LSTM(hidden, hidden, num_layers=layers, bidirectional=True, batch_first=True)
        self.gru = torch.nn.GRU(2 * hidden, hidden, batch_first=True)
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, ids, labels):
        h, _ = self.lstm(self.emb(ids))
        h, _ = self.gru(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def build_model(vocab=128, hidden=32, layers=2, **kw):
    return RecurrentLM(int(vocab), int(hidden), int(layers))


def example_batch(batch_size, vocab=128, seq=5, **kw):
    ids = torch.randint(0, int(vocab), (batch_size, int(seq)))
    return ids, torch.roll(ids, -1, dims=1)
