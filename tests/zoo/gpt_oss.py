"""Hugging Face GPT-OSS (a mixture of experts with expert biases, a clamped SwiGLU of
interleaved gate and up columns, attention sinks, sliding-window layers), built from a tiny
config with random weights (no download), used as it is: a dict batch and its output's loss.
Its experts are split as a row-wise region on dp and micro-batches (compiler/sbp/rowwise.py)."""
import torch
from transformers import GptOssConfig, GptOssForCausalLM


def _config(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=256, seq=16, experts=4, top_k=2):
    return GptOssConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                        num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=ffn, vocab_size=vocab,
                        max_position_embeddings=seq, sliding_window=seq // 2, num_local_experts=experts,
                        num_experts_per_tok=top_k, pad_token_id=0, bos_token_id=0, eos_token_id=0, use_cache=False)


def build_model(**kw):
    return GptOssForCausalLM(_config(**kw))


def example_batch(batch_size, **kw):
    cfg = _config(**kw)
    ids = torch.randint(0, cfg.vocab_size, (batch_size, cfg.max_position_embeddings))
    return {"input_ids": ids, "labels": ids.clone()}
