"""Hugging Face OPT (learned positions with an offset, pre-LayerNorm, ReLU MLP, tied head), built
from a tiny config with random weights (no download). The model is unmodified; this file adapts
it to the sbpc model contract. Attention is whatever Hugging Face picks by default. Dropout is
off so that parity with eager is exact."""
import torch
from transformers import OPTConfig, OPTForCausalLM


def _config(layers=2, hidden=64, heads=4, ffn=128, vocab=256, seq=16):
    return OPTConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads, ffn_dim=ffn,
                     word_embed_proj_dim=hidden, vocab_size=vocab, max_position_embeddings=seq,
                     dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0,
                     pad_token_id=1, bos_token_id=2, eos_token_id=2)


class WithLoss(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.model = OPTForCausalLM(cfg)

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels, use_cache=False).loss


def build_model(**kw):
    return WithLoss(_config(**kw))


def example_batch(batch_size, **kw):
    cfg = _config(**kw)
    # token 1 is the padding id: keep it out so that every position attends (no padding mask)
    ids = torch.randint(3, cfg.vocab_size, (batch_size, cfg.max_position_embeddings))
    return ids, ids.clone()
