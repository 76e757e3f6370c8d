"""A one-block causal language model over bytes, small enough to compile in seconds on a
pipelined mesh (tests/test_train.py): embedding, one causal attention, an MLP, the LM head."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class TinyLM(nn.Module):
    def __init__(self, vocab, hidden, seq):
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(seq, hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.mlp = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)  # one head
        x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True).squeeze(1)
        x = x + torch.relu(self.mlp(x))
        logits = self.head(x)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def build_model(vocab=256, hidden=16, seq=8):
    return TinyLM(vocab, hidden, seq)


def example_batch(batch_size, vocab=256, hidden=16, seq=8):
    return torch.randint(0, vocab, (batch_size, seq)), torch.randint(0, vocab, (batch_size, seq))
