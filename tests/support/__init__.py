"""Helpers the tests share (fixtures live in the conftest files). `tests/` is on sys.path, so
tests import them as `from support.hf import random_qwen3`.

- `support.hf`: tiny random transformers Qwen3 models and saved checkpoints (the reference).
- `support.inputs`: `ModelInputs` for chunks of sequences, a small config, relative error.
- `support.sampling`: the exact distribution of a sampler, and the check that draws match it.
- `support.engine`: the engine tests' shared settings, engine construction, `assert_idle`.
- `support.sched`: scheduler factories, the fake device and the step plan's contract.
- `support.blocks`: a sequence admitted to a block pool as the scheduler does.
- `support.repo`: the checkout's root, and what importing a part of it loads.
"""
