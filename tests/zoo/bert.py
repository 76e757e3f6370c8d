"""Hugging Face BERT as a masked language model (bidirectional attention, token types, GELU,
tied decoder), built from a tiny config with random weights (no download). The model is
unmodified; this file adapts it to the sbpc model contract. A quarter of the positions are
masked; the loss is Hugging Face's, over the masked positions only (labels -100 elsewhere).
Attention is whatever Hugging Face picks by default. Dropout is off so that parity with eager
is exact."""
import torch
from transformers import BertConfig, BertForMaskedLM

MASK_ID = 3


def _config(layers=2, hidden=64, heads=4, ffn=128, vocab=256, seq=16):
    return BertConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                      intermediate_size=ffn, vocab_size=vocab, max_position_embeddings=seq,
                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0)


class WithLoss(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.model = BertForMaskedLM(cfg)

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels).loss


def build_model(**kw):
    return WithLoss(_config(**kw))


def example_batch(batch_size, **kw):
    cfg = _config(**kw)
    ids = torch.randint(4, cfg.vocab_size, (batch_size, cfg.max_position_embeddings))
    masked = torch.rand(ids.shape) < 0.25
    masked[:, 0] = True  # every row has a masked token
    labels = torch.where(masked, ids, torch.full_like(ids, -100))
    return torch.where(masked, torch.full_like(ids, MASK_ID), ids), labels
