"""Research beside the engine: request workloads, the prefix-cache simulator and the benchmark.

It imports the engine; the engine never imports it. `workloads`, `mooncake`, `cache_sim` and
`cost_model` import no jax (a cache-policy experiment runs on a laptop); `bench` runs the engine
(`scripts/bench.py`), and `calibrate` times its steps (`scripts/calibrate_step_cost.py`).
"""
