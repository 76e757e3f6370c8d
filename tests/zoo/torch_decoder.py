"""A decoder-only language model built from PyTorch's own ``nn.TransformerEncoderLayer``
(batch_first, a causal mask, post-LayerNorm, ReLU), with learned positions and an untied head.
The layers are unmodified torch modules; dropout is off so that parity with eager is exact."""
import torch
from torch import nn


class TorchDecoder(nn.Module):
    def __init__(self, layers=2, hidden=64, heads=4, ffn=128, vocab=256, seq=16):
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(seq, hidden)
        layer = nn.TransformerEncoderLayer(hidden, heads, dim_feedforward=ffn, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, input_ids, labels):
        seq = input_ids.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(seq, device=input_ids.device)
        pos = torch.arange(seq, device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(pos)
        x = self.encoder(x, mask=mask, is_causal=True)
        logits = self.head(x)
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def build_model(**kw):
    return TorchDecoder(**kw)


def example_batch(batch_size, seq=16, vocab=256, **kw):
    ids = torch.randint(0, vocab, (batch_size, seq))
    return ids, ids.clone()
