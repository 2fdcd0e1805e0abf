"""Where does FlashAttention-3 under shard_map break? `python scripts/tp_flash_check.py [CASE ...]`

On two H200s (jax 0.11.2) XLA segfaulted compiling the model step with FlashAttention-3's
kernels inside shard_map. This runs each case in a child process (so a segfault ends only that
case) and prints a table. A case is a base and options joined by "+".
Bases: "fa3-jit" (FA3 alone, one device), "fa3-shard-map" (FA3 alone in shard_map over the kv
heads, two devices), "fa3-shard-map-scan" (the same inside a `lax.scan` over layers),
"model-flash-tp2" / "model-reference-tp2" (the model step, 2 layers of the qwen3-0.6b shape).
Options: "nocmdbuf" (XLA's CUDA command buffers off), "nolhs" (latency-hiding scheduler off),
"syncoll" (synchronous all-reduce/all-gather),
"1layer", "nodonate" (the cache not donated), "tp1" (the model on a one-device mesh), "vlog"
(XLA logs each HLO pass; the table shows the last ones before the end), "noshardy" (JAX lowers
for the GSPMD partitioner instead of Shardy).

Seen on two H200s (2026-11-30): every FA3-alone case compiles and runs (with and without
shard_map, scan, command buffers); the model step with "flash" at TP=2 segfaults with or without
command buffers, with one layer, without donation, with the latency-hiding scheduler or async
collectives off, and runs on a one-device mesh; with "reference" it runs. The last pass XLA
logged before the crash was "shardy-xla" (after "spmd-simplify").
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

CASES = ("model-flash-tp2", "model-flash-tp2+noshardy", "model-reference-tp2+noshardy")
XLA_OPTIONS = {
    "nocmdbuf": "--xla_gpu_enable_command_buffer=",
    "nolhs": "--xla_gpu_enable_latency_hiding_scheduler=false",
    "syncoll": "--xla_gpu_disable_async_collectives=ALLREDUCE,ALLGATHER,REDUCESCATTER",
}


def run_case(name: str) -> None:
    case, *options = name.split("+")
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    from jaxllm.model.attention import Kernels
    from jaxllm.model.config import PRESETS
    from jaxllm.model.flash_attention import flash_attention
    from jaxllm.model.inputs import ModelInputs
    from jaxllm.model.kv_cache import allocate_kv_cache
    from jaxllm.model.qwen3 import init_params, sharded_forward
    from jaxllm.model.sharding import make_mesh, shard_map

    batch, blocks, block_size, heads, kv_heads, head_dim = 8, 64, 256, 16, 8, 128
    inputs = ModelInputs(
        token_ids=jnp.arange(batch, dtype=jnp.int32),
        positions=jnp.full((batch,), 300, jnp.int32),
        slot_mapping=jnp.arange(batch, dtype=jnp.int32) * block_size * 2 + 300,
        block_tables=jnp.asarray(np.arange(batch * 2, dtype=np.int32).reshape(batch, 2)),
        context_lens=jnp.full((batch,), 301, jnp.int32),
        sample_indices=jnp.arange(batch, dtype=jnp.int32),
    )
    if case.startswith("fa3"):
        q = jnp.ones((batch, heads, head_dim), jnp.bfloat16)
        cache = jnp.ones((blocks, block_size, kv_heads, head_dim), jnp.bfloat16)
        attend = flash_attention
        if case.startswith("fa3-shard-map"):
            mesh = make_mesh(2)
            attend = shard_map(
                attend,
                mesh,
                in_specs=(P(None, "tp"), P(None, None, "tp"), P(None, None, "tp"), P()),
                out_specs=P(None, "tp"),
            )
        if case == "fa3-shard-map-scan":
            one = attend

            def attend(q, keys, values, inputs):
                def layer(x, _):
                    return one(x, keys, values, inputs).astype(x.dtype), None

                return jax.lax.scan(layer, q, None, length=2)[0]

        out = jax.jit(attend)(q, cache, cache, inputs)
    else:
        backend = case.split("-")[1]
        kernels = Kernels(backend, backend)
        mesh = make_mesh(1 if "tp1" in options else 2)
        layers = 1 if "1layer" in options else 2
        config = PRESETS["qwen3-0.6b"].replace(num_layers=layers)
        params = init_params(config, seed=0, mesh=mesh)
        cache = allocate_kv_cache(config, blocks, block_size, mesh=mesh)
        donate = () if "nodonate" in options else 1
        step = jax.jit(sharded_forward(config, mesh, kernels), donate_argnums=donate)
        out, _ = step(params, cache, inputs)
    print("finite:", bool(jnp.isfinite(out.astype(jnp.float32)).all()))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("cases", nargs="*", default=CASES, help=f"default: {' '.join(CASES)}")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # runs one case here
    args = parser.parse_args()
    if args.child is not None:
        run_case(args.child)
        return
    rows = []
    for case in args.cases:
        options = case.split("+")[1:]
        env = dict(os.environ)
        flags = [XLA_OPTIONS[option] for option in options if option in XLA_OPTIONS]
        env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""), *flags]).strip()
        if "vlog" in options:
            env.update(TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="hlo_pass_pipeline=2")
        if "noshardy" in options:
            env["JAX_USE_SHARDY_PARTITIONER"] = "false"
        try:
            result = subprocess.run(
                [sys.executable, "-X", "faulthandler", __file__, "--child", case],
                env=env,
                capture_output=True,
                text=True,
                timeout=150,
            )
        except subprocess.TimeoutExpired:
            rows.append((case, "timeout (150 s)", []))
            continue
        status = "ok" if result.returncode == 0 else f"exit {result.returncode}"
        lines = (result.stdout + result.stderr).strip().splitlines()
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], f"tp-flash-{case}.log"), "w") as log:
                log.write("\n".join(lines[-2000:]))
        if "vlog" in options:
            lines = [line for line in lines if "pass" in line.lower()] + lines[-2:]
        rows.append((case, status, lines[-8:] if "vlog" in options else lines[-3:]))
        print(case, status, flush=True)
    for case, status, tail in rows:
        print(f"{case:26s} {status}")
        for line in tail:
            print(f"    {line[:160]}")


if __name__ == "__main__":
    main()
