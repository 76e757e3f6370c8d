"""Hugging Face Mixtral (a sparse mixture of experts: 4 experts, 2 per token; GQA, RoPE, RMSNorm),
built from a tiny config with random weights (no download), used as it is: a dict batch and the
loss of its output. The experts run as Hugging Face picks by default."""
import torch
from transformers import MixtralConfig, MixtralForCausalLM


def _config(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256, seq=16, experts=4, top_k=2):
    return MixtralConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, intermediate_size=ffn, vocab_size=vocab,
                         max_position_embeddings=seq, num_local_experts=experts, num_experts_per_tok=top_k,
                         pad_token_id=0, bos_token_id=0, eos_token_id=0, use_cache=False)


def build_model(**kw):
    return MixtralForCausalLM(_config(**kw))


def example_batch(batch_size, **kw):
    cfg = _config(**kw)
    ids = torch.randint(0, cfg.vocab_size, (batch_size, cfg.max_position_embeddings))
    return {"input_ids": ids, "labels": ids.clone()}
