"""Start-up on a CPU, as the README states it: `LLM(path)` on a Hugging Face Qwen3 directory of the
tests' tiny shape, with every setting left to its default, then a first `generate` of 8 tokens.

Needs torch and transformers (the test extra) to write the directory. By default the
compilation cache starts empty, as on a fresh machine (`--warm`: jaxllm's usual cache).

    python scripts/cpu_startup.py
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time


def save_tiny_qwen3(path: str) -> None:
    """A random Qwen3 of the tests' shape (tests/support/hf.py), saved by transformers."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
    )
    transformers.Qwen3ForCausalLM(config).save_pretrained(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warm", action="store_true", help="use the usual compilation cache")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        save_tiny_qwen3(os.path.join(directory, "model"))
        if not args.warm:
            os.environ["JAXLLM_COMPILATION_CACHE"] = os.path.join(directory, "xla")
        start = time.perf_counter()
        from jaxllm import LLM, SamplingParams

        imported = time.perf_counter()
        llm = LLM(os.path.join(directory, "model"))
        ready = time.perf_counter()
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        output = llm.generate([1, 2, 3, 4], params, use_tqdm=False)[0]
        done = time.perf_counter()
    assert len(output.token_ids) == 8
    print(f"import jaxllm    {imported - start:6.1f} s")
    print(f"LLM(path)        {ready - imported:6.1f} s  ({llm.num_kvcache_blocks} KV blocks)")
    print(f"first generate   {done - ready:6.1f} s  (8 tokens, {llm.num_executables} executables)")
    print(f"total            {done - start:6.1f} s")


if __name__ == "__main__":
    main()
