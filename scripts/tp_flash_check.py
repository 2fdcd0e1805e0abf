"""Where does FlashAttention-3 under shard_map break? `python scripts/tp_flash_check.py`

On two H200s (jax 0.11.2, 2026-11-30) XLA segfaulted compiling the model step with the "flash"
backend inside shard_map. This runs, from the smallest case up, each in a child process (so a
segfault ends only that case), and prints a table:
1. FA3 alone under jax.jit (one device);
2. FA3 alone inside shard_map over the kv heads (two devices);
3. the model step, 2 layers of the qwen3-0.6b shape, "flash" backend, TP=2;
4. the same with the portable backend, TP=2;
and cases 2 and 3 again with XLA's CUDA command buffers off (suffix "-nocmdbuf"), and FA3 under
shard_map inside a `lax.scan` over layers, as the model runs it ("fa3-shard-map-scan").
"""

from __future__ import annotations

import os
import subprocess
import sys

CASES = (
    "fa3-jit",
    "fa3-shard-map",
    "fa3-shard-map-scan",
    "fa3-shard-map-nocmdbuf",
    "model-flash-tp2",
    "model-flash-tp2-nocmdbuf",
    "model-reference-tp2",
)
NO_COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer="


def run_case(case: str) -> None:
    case = case.removesuffix("-nocmdbuf")
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    from jaxllm.model.attention import get_attention_backend
    from jaxllm.model.config import PRESETS
    from jaxllm.model.flash_attention import flash_attention  # noqa: F401 (registers "flash")
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
        attend = get_attention_backend("flash")
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
        mesh = make_mesh(2)
        config = PRESETS["qwen3-0.6b"].replace(num_layers=2, attention_backend=backend)
        params = init_params(config, seed=0, mesh=mesh)
        cache = allocate_kv_cache(config, blocks, block_size, mesh=mesh)
        out, _ = jax.jit(sharded_forward(config, mesh), donate_argnums=1)(params, cache, inputs)
    print("finite:", bool(jnp.isfinite(out.astype(jnp.float32)).all()))


def main() -> None:
    if len(sys.argv) > 1:
        run_case(sys.argv[1])
        return
    rows = []
    for case in CASES:
        env = dict(os.environ)
        if case.endswith("-nocmdbuf"):
            env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {NO_COMMAND_BUFFERS}".strip()
        try:
            result = subprocess.run(
                [sys.executable, "-X", "faulthandler", __file__, case],
                env=env,
                capture_output=True,
                text=True,
                timeout=150,
            )
        except subprocess.TimeoutExpired:
            rows.append((case, "timeout (150 s)", []))
            continue
        status = "ok" if result.returncode == 0 else f"exit {result.returncode}"
        rows.append((case, status, (result.stdout + result.stderr).strip().splitlines()[-3:]))
        print(case, status, flush=True)
    for case, status, tail in rows:
        print(f"{case:26s} {status}")
        for line in tail:
            print(f"    {line[:160]}")


if __name__ == "__main__":
    main()
