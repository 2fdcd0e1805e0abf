"""How the largest step's scratch memory grows with the model's layers:
`python scripts/scratch_layers.py [--models qwen3-0.6b qwen3-8b] [--layers 2 4]
[--autotune-levels 0 1]`.

Start-up sizes the KV cache from the scratch memory of the engine's largest step, compiled for
the whole model (`startup.step_scratch_bytes`). For each model this compiles that step (the
default settings' ladder) for a few layers and for all of them, and prints XLA's scratch bytes,
the seconds each compile took, and the whole model's scratch extended linearly from the first
two layer counts; with `--autotune-levels`, first the whole model at each XLA autotuning level.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from jaxllm.config import EngineConfig
from jaxllm.model.attention import Kernels
from jaxllm.model.checkpoint import load_config
from jaxllm.model.sharding import make_mesh
from jaxllm.platform import Platform
from jaxllm.sched.config import SchedulerConfig
from jaxllm.sched.plan import BucketLadder
from jaxllm.startup import resolve_defaults, step_scratch_bytes


def largest_step(model: str, platform: Platform):
    """The model's config, the default engine's largest bucket, its block size and kernels."""
    model_config = load_config(f"random:{model}", platform.dtype)
    config = resolve_defaults(EngineConfig(), model_config, platform)
    tile = platform.prefill_tile
    settings = SchedulerConfig(
        num_blocks=1,
        block_size=config.kvcache_block_size,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens // tile * tile,
        max_model_len=config.max_model_len,
        prefill_tile=tile,
        num_scheduler_steps=config.num_scheduler_steps,
    )
    kernels = platform.kernels(config.kvcache_block_size, model_config.num_kv_heads)
    ladder = BucketLadder.from_config(settings, one_width=kernels.prefill == "flash")
    largest = max(ladder.buckets(), key=lambda bucket: (bucket.num_tokens, bucket.width))
    return model_config, largest, config.kvcache_block_size, kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=["qwen3-0.6b", "qwen3-8b"])
    parser.add_argument("--layers", nargs=2, type=int, default=[2, 4])
    parser.add_argument("--autotune-levels", nargs="*", type=int, default=[])
    args = parser.parse_args()
    platform, mesh = Platform.detect(), make_mesh(1)
    rows = []
    for level in args.autotune_levels:  # the whole model, first, at each XLA autotuning level
        model_config, bucket, block_size, kernels = largest_step(args.models[0], platform)
        options = Kernels.compiler_options
        Kernels.compiler_options = lambda self, n, level=level, options=options: {
            **options(self, n),
            "xla_gpu_autotune_level": level,
        }
        start = time.perf_counter()
        scratch = step_scratch_bytes(model_config, mesh, bucket, block_size, kernels)
        rows.append((args.models[0], f"level {level}", scratch, time.perf_counter() - start))
        Kernels.compiler_options = options
        print(rows[-1], flush=True)
    for model in args.models:
        model_config, bucket, block_size, kernels = largest_step(model, platform)
        measured = {}
        for num_layers in (*args.layers, model_config.num_layers):
            config = dataclasses.replace(model_config, num_layers=num_layers)
            start = time.perf_counter()
            measured[num_layers] = step_scratch_bytes(config, mesh, bucket, block_size, kernels)
            seconds = time.perf_counter() - start
            rows.append((model, num_layers, measured[num_layers], seconds))
            print(rows[-1], bucket, flush=True)
        (few, few_bytes), (more, more_bytes) = ((n, measured[n]) for n in args.layers)
        slope = (more_bytes - few_bytes) / (more - few)
        extended = more_bytes + slope * (model_config.num_layers - more)
        rows.append((model, "extended", int(extended), 0.0))
    print(f"\n{'model':12} {'layers':>8} {'scratch MiB':>12} {'compile s':>10}")
    for model, layers, scratch, seconds in rows:
        print(f"{model:12} {layers!s:>8} {scratch / 2**20:12.1f} {seconds:10.2f}")


if __name__ == "__main__":
    main()
