"""Hugging Face BERT fine-tuned for token classification on padded rows, as a user writes it:
``BertModel`` (its pooler included, which a token-level loss never reads) under a linear head,
called with an ``attention_mask`` that pads every row but the first to its own length. Built from
a tiny config with random weights (no download); the model is unmodified.

Hugging Face prepares the mask as ``pad[arange(B)[:, None, None, None], arange(L)]``, which
``decompose`` reads as the reshape it is, so the mask splits with its batch on a pipeline; the
pooler gets no gradient, so it stays as built, as torch's AdamW leaves it (grad None).
Dropout is off so that parity with eager is exact."""
import torch
import torch.nn.functional as F
from transformers import BertConfig, BertModel

CLASSES = 5


def _config(layers=2, hidden=64, heads=4, ffn=128, vocab=256, seq=16):
    return BertConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                      intermediate_size=ffn, vocab_size=vocab, max_position_embeddings=seq,
                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0)


class TokenTagger(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.bert = BertModel(cfg)
        self.head = torch.nn.Linear(cfg.hidden_size, CLASSES)

    def forward(self, input_ids, attention_mask, labels):
        hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return F.cross_entropy(self.head(hidden).flatten(0, 1), labels.flatten(), ignore_index=-100)


def build_model(**kw):
    return TokenTagger(_config(**kw))


def example_batch(batch_size, **kw):
    cfg = _config(**kw)
    seq = cfg.max_position_embeddings
    lengths = torch.tensor([seq - (3 * i) % (seq // 2) for i in range(batch_size)])  # row 0 whole, the rest padded
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    ids = torch.randint(1, cfg.vocab_size, (batch_size, seq)) * mask  # pad_token_id 0 after each row's end
    labels = torch.where(mask > 0, torch.randint(0, CLASSES, (batch_size, seq)), torch.full_like(ids, -100))
    return ids, mask, labels
