"""Parameters the loss does not reach: a pooler whose output the forward computes and drops
(as Hugging Face's BERT pooler under a token-level loss) and a head never called. torch.optim
skips a parameter whose grad is None, so both stay as built; the plan takes them as buffers."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class M(nn.Module):
    def __init__(self, vocab=32, dim=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.pooler = nn.Linear(dim, dim)
        self.unused_head = nn.Linear(dim, 3)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids, labels):
        h = torch.tanh(self.emb(ids))
        pooled = self.pooler(h[:, 0])  # computed, never read by the loss
        del pooled
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def build_model():
    return M()


def example_batch(batch_size):
    ids = torch.randint(0, 32, (batch_size, 8))
    return ids, ids.roll(-1, 1)
