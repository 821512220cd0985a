"""A tiny Qwen2 model folder vLLM's CPU backend serves: head_dim 64 (vLLM CPU refuses 6, 8 and 16),
GQA (4 query heads, 2 key/value heads), untied lm_head, a vocabulary of 300 (padded to 320 rows,
160 per rank at TP 2), q/k/v biases; seeded random weights (biases and norms too), float32.

    python tests_vllm/make_qwen2.py OUT_DIR [--seed N]
"""

from __future__ import annotations

import argparse


def make(out: str, seed: int = 0) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=128,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, dtype="float32")
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            p.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.08 * noise)
    model.save_pretrained(out)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    make(a.out, a.seed)
