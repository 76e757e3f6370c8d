"""Hugging Face GPT-2, built from a tiny config with random weights (no download). The model is
unmodified; this file adapts it to the sbpc model contract. Attention is whatever Hugging Face
picks by default (sdpa). Dropout is off so that parity with eager is exact."""
import torch
from transformers import GPT2Config, GPT2LMHeadModel


def _config(layers=2, hidden=64, heads=4, vocab=256, seq=16):
    return GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab, n_positions=seq,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)


class WithLoss(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.model = GPT2LMHeadModel(cfg)

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels, use_cache=False).loss


def build_model(**kw):
    return WithLoss(_config(**kw))


def example_batch(batch_size, **kw):
    cfg = _config(**kw)
    ids = torch.randint(0, cfg.vocab_size, (batch_size, cfg.n_positions))
    return ids, ids.clone()
