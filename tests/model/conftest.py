"""Tiny random Qwen3 checkpoints written by transformers, and their reference logits."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from hf_reference import random_qwen3

from jaxllm.model.checkpoint import load_params
from jaxllm.model.config import Qwen3Config
from jaxllm.model.qwen3 import Params

VOCAB_SIZE = 256

# name -> (tied, q heads, kv heads, head dim, hidden, layers, max shard size or None)
SHAPES = {
    "tied-mqa": (True, 4, 1, 64, 128, 2, None),
    "untied-gqa": (False, 4, 2, 128, 96, 3, None),
    "tied-mha-sharded": (True, 2, 2, 64, 128, 2, "100KB"),
}


def make_hf_model(
    tied: bool, num_heads: int, num_kv_heads: int, head_dim: int, hidden: int, layers: int, seed=0
) -> transformers.Qwen3ForCausalLM:
    """A float32 HF Qwen3 with every weight random (norm scales around 1), eager attention."""
    return random_qwen3(
        vocab_size=VOCAB_SIZE,
        hidden=hidden,
        layers=layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        tied=tied,
        seed=seed,
    )


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


@pytest.fixture(scope="session", params=list(SHAPES))
def hf_model(request, tmp_path_factory) -> HFModel:
    tied, heads, kv_heads, head_dim, hidden, layers, shard = SHAPES[request.param]
    model = make_hf_model(tied, heads, kv_heads, head_dim, hidden, layers)
    path = tmp_path_factory.mktemp(request.param)
    if shard:
        model.save_pretrained(path, max_shard_size=shard)
    else:
        model.save_pretrained(path)
    config, params = load_params(path, dtype="float32")
    return HFModel(request.param, path, model, config, params)
