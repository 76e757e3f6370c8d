"""Hugging Face DeBERTa-v2 as a masked language model (disentangled attention: content-to-position
and position-to-content scores from a shared relative position table, log buckets; the word
embedding tied to the decoder), built from a tiny config with random weights (no download). The
model is unmodified; this file adapts it to the sbpc model contract. On a pipeline the tied
embedding's update is sent between the stages, which the update's grouping must respect
(tests/test_inplace.py). Dropout is off so that parity with eager is exact."""
import torch
from transformers import DebertaV2Config, DebertaV2ForMaskedLM

MASK_ID = 3


def _config(layers=2, hidden=64, heads=4, ffn=128, vocab=128, seq=16):
    return DebertaV2Config(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                           intermediate_size=ffn, vocab_size=vocab, max_position_embeddings=2 * seq,
                           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0,
                           relative_attention=True, position_buckets=8, pos_att_type=["p2c", "c2p"],
                           max_relative_positions=seq, position_biased_input=False)


class WithLoss(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.model = DebertaV2ForMaskedLM(cfg)

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels).loss


def build_model(**kw):
    return WithLoss(_config(**kw))


def example_batch(batch_size, seq=16, **kw):
    ids = torch.randint(4, _config(**kw).vocab_size, (batch_size, seq))
    masked = torch.rand(ids.shape) < 0.25
    masked[:, 0] = True  # every row has a masked token
    labels = torch.where(masked, ids, torch.full_like(ids, -100))
    return torch.where(masked, torch.full_like(ids, MASK_ID), ids), labels
