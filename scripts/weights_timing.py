"""What a training loop waits for between rollouts: `update_params` from arrays already on the
device, `sleep` (device memory freed), `wake_up` and the first generate after it, and the
compilations during all of it; then how far the training forward's bf16 logprobs lie from the
engine's. One JSON record.

    python scripts/weights_timing.py [--model random:qwen3-8b] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import numpy as np

from jaxllm import LLM, SamplingParams
from jaxllm.model.training import sequence_logprobs
from jaxllm.research.bench import count_compilations


def device_bytes_in_use() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_in_use")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="default: the platform's embedded model")
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.7,
        help="the engine's share of device memory; the rest holds the trainer's new weights",
    )
    args = parser.parse_args(argv)

    llm = LLM(args.model, gpu_memory_utilization=args.gpu_memory_utilization)
    prompts = [list(range(100 + i, 164 + i)) for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=0)
    llm.generate(prompts, params, use_tqdm=False)  # every executable of the timed calls ready

    # New weights already on the devices, placed as the engine's: a trainer's after its step.
    new = jax.tree.map(lambda x: x * 1.001, llm.params)
    jax.block_until_ready(new)
    compilations = count_compilations()
    start = time.perf_counter()
    llm.update_params(new)
    jax.block_until_ready(llm.params)
    update_s = time.perf_counter() - start

    before_sleep = device_bytes_in_use()
    kv_bytes = sum(x.nbytes for x in jax.tree.leaves(llm.engine.runner.kv_cache))
    start = time.perf_counter()
    llm.sleep()
    sleep_s = time.perf_counter() - start
    after_sleep = device_bytes_in_use()
    start = time.perf_counter()
    llm.wake_up()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wake_and_generate_s = time.perf_counter() - start
    num_compilations = len(compilations)

    # The training forward (bf16 on a GPU) against the engine's logprobs of the same tokens.
    tokens = np.array([p + o.token_ids for p, o in zip(prompts, outputs, strict=True)])
    forward = jax.jit(sequence_logprobs, static_argnums=1)
    trained = np.asarray(forward(llm.params, llm.model_config, tokens))[:, len(prompts[0]) - 1 :]
    completions = [output.outputs[0] for output in outputs]
    engine = np.array(
        [
            [entries[t].logprob for t, entries in zip(c.token_ids, c.logprobs, strict=True)]
            for c in completions
        ]
    )
    freed = None if before_sleep is None else before_sleep - after_sleep
    record = {
        "model": llm.model,
        "device": jax.devices()[0].device_kind,
        "jax_version": jax.__version__,
        "dtype": str(jax.tree.leaves(llm.params)[0].dtype),
        "update_params_s": update_s,
        "sleep_s": sleep_s,
        "kv_cache_bytes": kv_bytes,
        "device_bytes_freed_by_sleep": freed,
        "freed_share_of_kv_cache": None if freed is None else freed / kv_bytes,
        "wake_up_and_generate_s": wake_and_generate_s,
        "compilations_in_update_sleep_wake_generate": num_compilations,
        "training_forward_vs_engine_logprobs_max_abs": float(np.abs(trained - engine).max()),
        "training_forward_vs_engine_logprobs_mean_abs": float(np.abs(trained - engine).mean()),
    }
    print(json.dumps(record, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
