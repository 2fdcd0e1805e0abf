"""The transformers reference every numerics test compares with: tiny random Qwen3 models, and
the saved checkpoints the model and engine tests load (`hf_model`, `checkpoint` fixtures)."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import transformers

from jaxllm.model.checkpoint import load_params
from jaxllm.model.config import Qwen3Config
from jaxllm.model.qwen3 import Params

# The vocabulary of the tiny checkpoints (`hf_model`, `checkpoint`).
VOCAB_SIZE = 256


def random_qwen3(
    *,
    vocab_size: int = VOCAB_SIZE,
    hidden: int = 64,
    layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    tied: bool = False,
    max_position_embeddings: int = 512,
    rope_theta: float = 10_000.0,
    seed: int = 0,
) -> transformers.Qwen3ForCausalLM:
    """A float32 transformers Qwen3 (eager attention) with every weight random.

    Weights are 0.1 * N(0, 1) and norm scales 1 + 0.1 * N(0, 1), so logits are far from flat and
    greedy tokens are not decided by rounding. The defaults are the engine tests' checkpoint
    (`checkpoint` fixture): 2 layers of hidden size 64, 4 query heads and 2 kv heads of 32, an
    untied LM head, 512 positions.
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


@dataclass
class HFModel:
    """A saved HF checkpoint, its torch model, and the jaxllm config and params loaded from it."""

    name: str
    path: Path
    torch_model: transformers.Qwen3ForCausalLM
    config: Qwen3Config
    params: Params

    def reference_logits(self, token_ids: list[int]) -> np.ndarray:
        """[len(token_ids), V] float32 logits of transformers over the whole sequence."""
        with torch.no_grad():
            return self.torch_model(torch.tensor([token_ids])).logits[0].numpy()


@dataclass
class Checkpoint:
    """A saved transformers checkpoint and its torch model."""

    path: Path
    torch_model: transformers.Qwen3ForCausalLM

    def greedy(self, prompt: list[int], num_tokens: int, **settings) -> list[int]:
        """transformers' greedy continuation of exactly `num_tokens` tokens (`settings`: more
        arguments of `generate`, e.g. repetition_penalty or logits_processor)."""
        with torch.no_grad():
            out = self.torch_model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False,
                max_new_tokens=num_tokens,
                min_new_tokens=num_tokens,
                pad_token_id=0,
                **settings,
            )
        return out[0, len(prompt) :].tolist()

    def last_logits(self, prompt: list[int]) -> np.ndarray:
        """[V] float64 logits of transformers at the prompt's last position."""
        with torch.no_grad():
            logits = self.torch_model(torch.tensor([prompt])).logits[0, -1]
        return logits.double().numpy()

    def with_generation_config(self, directory: Path, **fields) -> Path:
        """A copy of the checkpoint in `directory` with these generation_config.json fields."""
        shutil.copytree(self.path, directory)
        (directory / "generation_config.json").write_text(json.dumps(fields))
        return directory


def save_hf_model(name: str, path: Path, max_shard_size: str | None = None, **shape) -> HFModel:
    """`random_qwen3(**shape)` saved to `path` by transformers (in shards of at most
    `max_shard_size`, if given), and loaded back by jaxllm in float32."""
    model = random_qwen3(**shape)
    if max_shard_size:
        model.save_pretrained(path, max_shard_size=max_shard_size)
    else:
        model.save_pretrained(path)
    config, params = load_params(path, dtype="float32")
    return HFModel(name, path, model, config, params)


def save_checkpoint(path: Path, **shape) -> Checkpoint:
    """`random_qwen3(**shape)` saved to `path` by transformers."""
    model = random_qwen3(**shape)
    model.save_pretrained(path)
    return Checkpoint(path, model)
