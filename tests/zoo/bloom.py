"""Hugging Face Bloom (ALiBi position biases instead of position embeddings, a LayerNorm after the
word embeddings, fused query-key-value, tanh GELU, tied head), built from a tiny config with random
weights (no download). The model is unmodified; this file adapts it to the sbpc model contract.
Its alibi is made of constants repeated over the batch (``[batch*heads, 1, seq]``) and added to the
scores of the batch and heads folded into one dim, which data parallelism must split by batch.
Dropout is off (Bloom's default) so that parity with eager is exact."""
import torch
from transformers import BloomConfig, BloomForCausalLM


def _config(layers=2, hidden=64, heads=4, vocab=256):
    return BloomConfig(n_layer=layers, hidden_size=hidden, n_head=heads, vocab_size=vocab,
                       hidden_dropout=0.0, attention_dropout=0.0, pad_token_id=0, bos_token_id=0, eos_token_id=0)


class WithLoss(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.model = BloomForCausalLM(cfg)

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels, use_cache=False).loss


def build_model(seq=16, **kw):  # the sequence length is the batch's alone (no position table)
    return WithLoss(_config(**kw))


def example_batch(batch_size, seq=16, **kw):
    cfg = _config(**kw)
    ids = torch.randint(0, cfg.vocab_size, (batch_size, seq))
    return ids, ids.clone()
