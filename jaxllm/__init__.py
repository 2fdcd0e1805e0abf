"""jaxllm: a small, fast offline LLM inference engine for Qwen3 models, written in JAX.

The host side (`jaxllm.cache`, `jaxllm.sched`, `jaxllm.sampling_params`) imports no jax, so the
engine's names below are imported lazily: `import jaxllm.cache` stays light.
"""

from typing import TYPE_CHECKING

from jaxllm.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from jaxllm.llm import LLM
    from jaxllm.notebook import generate
    from jaxllm.outputs import CompletionOutput, Logprob, RequestOutput

__all__ = [
    "LLM",
    "CompletionOutput",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "generate",
]
__version__ = "0.1.0"

_LAZY = {
    "LLM": "jaxllm.llm",
    "generate": "jaxllm.notebook",
    **dict.fromkeys(("CompletionOutput", "Logprob", "RequestOutput"), "jaxllm.outputs"),
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jaxllm' has no attribute {name!r}")
