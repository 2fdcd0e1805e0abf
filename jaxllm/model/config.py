"""The Qwen3 model's shape and numerics: a frozen, hashable config (a static jit argument) whose
fields are checked when it is made, and the bytes its params take (`param_bytes`)."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from jaxllm.fields import Check, as_int, as_real, as_str, check_fields

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM",)
SUPPORTED_MODEL_TYPES = ("qwen3",)
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
# The least value of each size. NOTE: num_layers may be 0: the params outside the layers are
# built from such a config (`qwen3.py`).
SIZE_MINIMUMS = {
    "vocab_size": 1,
    "hidden_size": 1,
    "intermediate_size": 1,
    "num_layers": 0,
    "num_heads": 1,
    "num_kv_heads": 1,
    "head_dim": 1,
    "max_position_embeddings": 1,
}


@dataclass(frozen=True)
class Qwen3Config:
    """Shape and numerics of a Qwen3 causal LM.

    Attributes:
        dtype: parameter and activation dtype name (`SUPPORTED_DTYPES`); attention softmax,
            the residual stream and the final logits are always float32.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 40_960
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        """Raises a ValueError naming the first field out of its range."""
        check_fields(self, _CHECKS, prefix="Qwen3Config.")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"Qwen3Config.num_heads must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}), got {self.num_heads}"
            )

    @property
    def jnp_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    def replace(self, **changes: Any) -> Qwen3Config:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(
        cls, path_or_dict: str | Path | dict[str, Any], dtype: str | None = None
    ) -> Qwen3Config:
        """Reads a Hugging Face Qwen3 `config.json` (a file, its directory, or its parsed dict);
        `dtype` replaces the config's (which may then be one jaxllm does not run, e.g. float64).

        Raises:
            ValueError: not a JSON object, a required size missing, or the architecture, model
                type, a feature or (without `dtype`) the dtype not supported.
        """
        hf, name = path_or_dict, "config.json"
        if not isinstance(hf, dict):
            path = Path(hf)
            name = path / "config.json" if path.is_dir() else path
            hf = read_json(name)
        if not isinstance(hf, dict):
            raise ValueError(f"{name} must hold a JSON object, got {type(hf).__name__}")
        sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
        missing = [key for key in (*sizes, "num_attention_heads") if key not in hf]
        if missing:
            raise ValueError(f"{name} lacks {', '.join(missing)}")
        architectures = hf.get("architectures") or []
        unsupported = [a for a in architectures if a not in SUPPORTED_ARCHITECTURES]
        if unsupported:
            raise ValueError(
                f"unsupported architecture {', '.join(unsupported)}; "
                f"jaxllm supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            supported = ", ".join(SUPPORTED_MODEL_TYPES)
            raise ValueError(f"unsupported model_type {model_type!r}; jaxllm supports {supported}")
        if hf.get("attention_bias", False):
            raise ValueError("unsupported Qwen3 config: attention_bias=true")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported Qwen3 config: hidden_act={hf['hidden_act']!r}")
        # NOTE: as transformers reads them: `layer_types`, else a window from max_window_layers on.
        layer_types = hf.get("layer_types")
        if layer_types is None:
            window = hf.get("sliding_window", 4096) if hf.get("use_sliding_window") else None
            num_full = hf.get("max_window_layers", 28)
            sliding = window is not None and (num_full or 0) < hf["num_hidden_layers"]
        else:
            sliding = "sliding_attention" in layer_types
        if sliding:
            raise ValueError("unsupported Qwen3 config: sliding-window attention")
        # NOTE: as transformers reads them: `rope_scaling` (older configs) before `rope_parameters`.
        rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"unsupported Qwen3 config: rope_type={rope_type!r}")
        rotary = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        if rotary != 1:
            raise ValueError(f"unsupported Qwen3 config: partial_rotary_factor={rotary!r}")
        saved_dtype = hf.get("torch_dtype") or hf.get("dtype") or "float32"
        if dtype is None and saved_dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"{name} has dtype {saved_dtype!r}, which jaxllm does not run; pass dtype= one "
                f"of {', '.join(SUPPORTED_DTYPES)} to convert the weights"
            )
        num_heads = hf["num_attention_heads"]
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            # NOTE: a field left out takes transformers' Qwen3Config default, as in vLLM
            head_dim=hf.get("head_dim") or 128,
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10_000.0))),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=hf.get("max_position_embeddings", 32_768),
            dtype=dtype or saved_dtype,
        )


def read_json(path: str | Path) -> Any:
    """A JSON file's contents (a checkpoint's config, manifest, index ...).

    Raises:
        ValueError: the file is not valid JSON, naming it.
    """
    try:
        return json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None


def param_bytes(config: Qwen3Config, tensor_parallel_size: int = 1) -> int:
    """Bytes of one device's blocks of the params (the tree of `qwen3.py`) sharded over
    `tensor_parallel_size` devices; computed from the config alone, in constant time."""
    c, split = config, lambda size: -(-size // tensor_parallel_size)
    d, h, g = c.hidden_size, c.head_dim, c.num_heads // c.num_kv_heads
    embeddings = (1 if c.tie_word_embeddings else 2) * split(c.vocab_size) * d
    # qkv_proj [D, K, G + 2, H], o_proj [N, H, D], q_norm and k_norm [H]
    attention = d * split(c.num_kv_heads) * (g + 2) * h + split(c.num_heads) * h * d + 2 * h
    mlp = 3 * d * split(c.intermediate_size)  # gate_up_proj [D, 2, F], down_proj [F, D]
    layer = attention + mlp + 2 * d  # and attn_norm, mlp_norm [D]
    return (embeddings + c.num_layers * layer + d) * c.jnp_dtype.itemsize


_POSITIVE: Check = (as_real, lambda x: math.isfinite(x) and x > 0, "a finite number > 0")
_CHECKS: dict[str, Check] = {
    **{
        name: (as_int, lambda n, least=least: n >= least, f"an integer >= {least}")
        for name, least in SIZE_MINIMUMS.items()
    },
    "rope_theta": _POSITIVE,
    "rms_norm_eps": _POSITIVE,
    "dtype": (as_str, SUPPORTED_DTYPES.__contains__, f"one of {SUPPORTED_DTYPES}"),
}


def _preset(layers: int, hidden: int, heads: int, ffn: int, tied: bool, **more: Any) -> Qwen3Config:
    """A preset of the real vocabulary; `more` overrides 8 kv heads of 128 dims, bfloat16."""
    return Qwen3Config(
        vocab_size=151_936,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_layers=layers,
        num_heads=heads,
        tie_word_embeddings=tied,
        **({"num_kv_heads": 8, "head_dim": 128} | more),
    )


PRESETS: dict[str, Qwen3Config] = {
    # A CPU-sized model with the real vocabulary, for tests and demos.
    "qwen3-tiny": _preset(4, 256, 4, 768, tied=True, num_kv_heads=2, head_dim=64, dtype="float32"),
    "qwen3-0.6b": _preset(28, 1024, 16, 3072, tied=True),
    "qwen3-1.7b": _preset(28, 2048, 16, 6144, tied=True),
    "qwen3-4b": _preset(36, 2560, 32, 9728, tied=True),
    "qwen3-8b": _preset(36, 4096, 32, 12288, tied=False),
    "qwen3-14b": _preset(40, 5120, 40, 17408, tied=False),
    "qwen3-32b": _preset(64, 5120, 64, 25600, tied=False),
}
