"""The transformers reference every numerics test compares with: tiny random Qwen3 models.

Importable from any test package (pytest puts `tests/` on sys.path for the packages under it).
"""

from __future__ import annotations

import torch
import transformers


def random_qwen3(
    *,
    vocab_size: int,
    hidden: int,
    layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    tied: bool,
    max_position_embeddings: int = 512,
    rope_theta: float = 10_000.0,
    seed: int = 0,
) -> transformers.Qwen3ForCausalLM:
    """A float32 transformers Qwen3 (eager attention) with every weight random.

    Weights are 0.1 * N(0, 1) and norm scales 1 + 0.1 * N(0, 1), so logits are far from flat and
    greedy tokens are not decided by rounding.
    """
    torch.manual_seed(seed)
    config = transformers.Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden + 32,
        num_hidden_layers=layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        tie_word_embeddings=tied,
        rope_parameters={"rope_theta": rope_theta, "rope_type": "default"},
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        attn_implementation="eager",
    )
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn_like(param)
            param.copy_(1 + 0.1 * noise if "norm" in name else 0.1 * noise)
    return model
