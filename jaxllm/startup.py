"""Start-up: from a model name and the settings to a serving `Engine`.

`start_engine` reads the model's config and settles the settings, then runs the phases in order,
each timed (`Engine.startup_seconds`): size the KV cache from the free device memory (the
largest step compiled for its scratch memory), compile the ladder's executables (unless left to
the first steps) or load them from the persistent compilation cache while the weights load
(and the tokenizer, from the start), allocate the KV cache, and run each executable once.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import jax
from jax.sharding import Mesh

from jaxllm.config import EngineConfig
from jaxllm.engine import Engine
from jaxllm.executables import ExecutableStore
from jaxllm.generation_config import default_sampling_params, eos_token_ids
from jaxllm.model.attention import Kernels
from jaxllm.model.checkpoint import (
    RANDOM_PREFIX,
    check_checkpoint,
    check_fits,
    check_params_fit,
    load_config,
    load_params,
)
from jaxllm.model.config import Qwen3Config, param_bytes
from jaxllm.model.kv_cache import gap_bytes, kv_cache_bytes_per_block, kv_cache_shapes
from jaxllm.model.qwen3 import COMPILER_OPTIONS, sharded_forward, sharded_param_shapes
from jaxllm.model.sharding import make_mesh, partitioner_for, replicated
from jaxllm.platform import CPU_KV_CACHE_BYTES, Platform
from jaxllm.runner import ModelRunner
from jaxllm.sampling_params import SamplingParams
from jaxllm.sched import Bucket, BucketLadder, Scheduler, SchedulerConfig
from jaxllm.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

COMPILATION_CACHE_ENV = "JAXLLM_COMPILATION_CACHE"
DEFAULT_COMPILATION_CACHE = "~/.cache/jaxllm/xla"
EXECUTABLES_DIR = "jaxllm-executables"  # the runner's programs, in the compilation cache
# NOTE: the longest sequence when none is asked for (the model's limit, if lower): longer ones
# widen the block tables of every step.
DEFAULT_MAX_MODEL_LEN = 4096


def configure_compilation_cache() -> Path | None:
    """Turns on JAX's persistent compilation cache, for the process, in `$JAXLLM_COMPILATION_CACHE`
    (default ~/.cache/jaxllm/xla), unless that is "" or the process set a cache already (then a
    different `$JAXLLM_COMPILATION_CACHE` gets a warning); returns the cache's directory (None:
    no cache, with a warning where the directory cannot be made)."""
    directory = os.path.expanduser(os.environ.get(COMPILATION_CACHE_ENV, DEFAULT_COMPILATION_CACHE))
    if directory and not jax.config.jax_compilation_cache_dir:
        try:
            Path(directory).mkdir(parents=True, exist_ok=True)
        except OSError as error:  # e.g. a read-only home: every program compiled, none kept
            logger.warning("no compilation cache (set %s): %s", COMPILATION_CACHE_ENV, error)
            return None
        jax.config.update("jax_compilation_cache_dir", directory)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    cache = jax.config.jax_compilation_cache_dir
    if COMPILATION_CACHE_ENV in os.environ and directory and cache != directory:
        logger.warning(
            "%s=%s is not used: this process's compilation cache is %s already (jax's "
            "jax_compilation_cache_dir, set by an earlier LLM or by you)",
            COMPILATION_CACHE_ENV, directory, cache,
        )  # fmt: skip
    return Path(cache) if cache else None


def check_model(model: object) -> None:
    """Refuses what `LLM`'s model argument cannot be, before any work.

    Raises:
        TypeError: not a path, a string or None.
        ValueError: an empty string.
    """
    if model is not None and not isinstance(model, str | os.PathLike):
        raise TypeError(f"model must be a path, a Hub id or None, got {type(model).__name__}")
    if model is not None and not os.fspath(model):
        raise ValueError(
            "model is an empty string: pass a model directory, a Hub id, 'random:<shape>' "
            "or None (the embedded default)"
        )


def resolve_model(model: str) -> str:
    """A local directory or `random:<shape>` for `model`; Hub ids are downloaded if possible."""
    if model.startswith(RANDOM_PREFIX):
        return model
    local = Path(model).expanduser()
    if local.is_dir():  # NOTE: as `LLM.save` writes it
        return str(local)
    if local.exists():
        raise FileNotFoundError(f"model path {model!r} is not a directory")
    looks_like_hub_id = model.count("/") == 1 and not model.startswith((".", "/", "~"))
    if not looks_like_hub_id:
        raise FileNotFoundError(f"model path {model!r} does not exist")
    try:
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
        return snapshot_download(model, allow_patterns=patterns)
    except Exception as error:
        raise FileNotFoundError(
            f"model {model!r} is not a local directory and could not be downloaded from the "
            f"Hugging Face Hub ({type(error).__name__}: {error}); pass a local path or "
            "random:<shape>"
        ) from error


@contextlib.contextmanager
def timed_phase(seconds: dict[str, float], name: str) -> Iterator[None]:
    """Adds the block's wall time to `seconds[name]` and logs it."""
    start = time.perf_counter()
    yield
    elapsed = time.perf_counter() - start
    seconds[name] = seconds.get(name, 0.0) + elapsed
    logger.info("%s: %.1f s", name, elapsed)


def resolve_defaults(config: EngineConfig, model: Qwen3Config, platform: Platform) -> EngineConfig:
    """`config` with the settings it leaves to the model and the platform filled in.

    Raises:
        ValueError: max_model_len beyond the model's max_position_embeddings.
    """
    limit = model.max_position_embeddings
    max_model_len = config.max_model_len or min(DEFAULT_MAX_MODEL_LEN, limit)
    if max_model_len > limit:
        raise ValueError(
            f"max_model_len={max_model_len} is more than the model's max_position_embeddings "
            f"({limit}); lower it, or leave it None"
        )
    compile_at_startup = config.compile_at_startup
    return dataclasses.replace(
        config,
        max_model_len=max_model_len,
        num_scheduler_steps=config.num_scheduler_steps or platform.num_scheduler_steps,
        compile_at_startup=platform.gpu if compile_at_startup is None else compile_at_startup,
    )


def engine_settings(
    model: str | os.PathLike | None, kwargs: dict, platform: Platform
) -> tuple[str, EngineConfig]:
    """The model to load and its settings: None is the platform's default model, with the
    platform's default engine kwargs under the given ones."""
    if model is None:
        return platform.default_model, EngineConfig(**(platform.default_engine_kwargs | kwargs))
    return os.fspath(model), EngineConfig(**kwargs)


def check_settings(
    model: str, config: EngineConfig, platform: Platform
) -> tuple[str, Qwen3Config, EngineConfig, Mesh]:
    """(path, model config, `config` with its defaults, mesh): what start-up checks before it
    reads a weight or compiles, so that a caller can check before it drops another engine.

    Raises:
        ValueError: max_model_len beyond the model, a tensor-parallel size the devices or the
            model cannot take, params larger than the devices' memory (checked before the
            checkpoint's tensors), num_kvcache_blocks too few for one max_model_len request.
        CheckpointError: a checkpoint whose tensors do not fit its config.
        FileNotFoundError: a model that is neither a directory nor downloadable.
    """
    path, dtype = resolve_model(model), config.dtype or platform.dtype
    model_config = load_config(path, dtype)
    config = resolve_defaults(config, model_config, platform)
    mesh = make_mesh(config.tensor_parallel_size)
    # NOTE: against the devices' whole memory (another engine may hold it until this one
    # starts), before the tensors' check, which grows with the layers
    check_params_fit(model_config, mesh, whole=True)
    check_checkpoint(path, dtype)
    if config.num_kvcache_blocks:
        check_room(config.num_kvcache_blocks, config)
    return path, model_config, config, mesh


def check_room(num_blocks: int, config: EngineConfig) -> None:
    """Raises ValueError where a KV cache of `num_blocks` cannot hold one max_model_len
    request."""
    block_size, max_model_len = config.kvcache_block_size, config.max_model_len
    if num_blocks * block_size < max_model_len:
        raise ValueError(
            f"the KV cache holds {num_blocks} blocks of {block_size} tokens "
            f"({num_blocks * block_size} tokens), less than one request of max_model_len="
            f"{max_model_len}; raise num_kvcache_blocks (or gpu_memory_utilization), or lower "
            "max_model_len"
        )


def start_engine(model: str, config: EngineConfig, platform: Platform) -> Engine:
    """A ready engine for `model` (a directory, a Hub id or "random:<shape>").

    Raises:
        ValueError: an unsupported model, a tensor-parallel size that does not divide it, or a
            KV cache too small for one max_model_len request.
        CheckpointError: a checkpoint whose tensors do not fit its config (before any compile).
        FileNotFoundError: a model that is neither a directory nor downloadable.
    """
    cache = configure_compilation_cache()
    seconds: dict[str, float] = {}
    phase = functools.partial(timed_phase, seconds)
    path, model_config, config, mesh = check_settings(model, config, platform)
    dtype = config.dtype or platform.dtype
    check_params_fit(model_config, mesh)
    block_size = config.kvcache_block_size
    kernels = platform.kernels(block_size, model_config.num_kv_heads // config.tensor_parallel_size)
    tile = platform.prefill_tile
    settings = SchedulerConfig(
        num_blocks=1,  # settled below, once the ladder tells the largest step
        block_size=block_size,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=max(tile, config.max_num_batched_tokens // tile * tile),
        max_model_len=config.max_model_len,
        prefill_tile=tile,
        enable_prefix_caching=config.enable_prefix_caching,
        num_scheduler_steps=config.num_scheduler_steps,
    )
    # NOTE: FA3 reads only each sequence's context, so its tables are padded to the widest
    # (fewer executables, the same work); the portable attention gathers whole tables.
    ladder = BucketLadder.from_config(settings, one_width=kernels.prefill == "flash")
    largest = max(ladder.buckets(), key=lambda bucket: (bucket.num_tokens, bucket.width))
    is_random = path.startswith(RANDOM_PREFIX)
    defaults = SamplingParams() if is_random else default_sampling_params(path)
    # NOTE: the device's memory before this engine's weights (the KV cache is sized from it)
    memory = jax.local_devices()[0].memory_stats() or {}
    params_bytes = param_bytes(model_config, config.tensor_parallel_size)
    per_block = kv_cache_bytes_per_block(
        model_config, block_size, tensor_parallel_size=config.tensor_parallel_size
    )
    if config.num_kvcache_blocks:
        check_fits(
            f"the params and the KV cache ({config.num_kvcache_blocks} blocks of {block_size} "
            "tokens)",
            params_bytes + config.num_kvcache_blocks * per_block,
            mesh,
        )
    rows = ladder.max_sampled_rows
    check_fits(
        f"the params and the gap below the KV cache (token bitmasks of {rows} rows, "
        f"max_num_seqs={config.max_num_seqs})",
        params_bytes + gap_bytes(rows, model_config.vocab_size),
        mesh,
    )
    # NOTE: the programs compile from the shapes of the weights and the KV cache, so the weights
    # load on a thread while they compile, once the KV cache is sized; the tokenizer from the
    # start (seconds to build where it is not cached yet; a model directory's imports torch
    # where torch is installed).
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        loaded_tokenizer = pool.submit(load_tokenizer, None if is_random else path)
        with phase("size the KV cache"):
            scratch = None
            if platform.gpu and not config.num_kvcache_blocks:
                scratch = step_scratch_bytes(model_config, mesh, largest, block_size, kernels)
            num_blocks = config.num_kvcache_blocks or fit_num_blocks(
                config, model_config, scratch, largest, platform, memory, params_bytes, per_block
            )
        if not config.num_kvcache_blocks:  # NOTE: a given count is checked with the settings
            check_room(num_blocks, config)
        load = functools.partial(load_params, path, dtype=dtype, seed=config.seed, mesh=mesh)
        # NOTE: with several processes the weights are placed by collectives across them, which
        # each process runs on its main thread, before anything else. Under TP with custom
        # kernels the ladder's compile switches the process to GSPMD meanwhile: the weights are
        # placed by their shardings alone, the same under either partitioner.
        if jax.process_count() == 1:
            loaded_params = pool.submit(load)
        else:
            loaded_params = concurrent.futures.Future()
            loaded_params.set_result(load())
        runner = ModelRunner(
            model_config,
            sharded_param_shapes(model_config, mesh),
            kernels=kernels,
            mesh=mesh,
            num_blocks=num_blocks,
            block_size=block_size,
            max_sampled_rows=ladder.max_sampled_rows,
            max_logprobs=config.max_logprobs,
            processed_logprobs=config.logprobs_mode == "processed_logprobs",
            num_processor_slots=config.max_num_seqs,
            processor_rows=tuple(
                sorted({bucket.num_sampled for bucket in ladder.buckets()})
                if config.compile_at_startup
                else ()
            ),
            # NOTE: with one process only; programs over several processes' devices are not
            # stored, JAX's cache keeps them
            executables=ExecutableStore(cache / EXECUTABLES_DIR, mesh.devices.flat)
            if cache is not None and jax.process_count() == 1
            else None,
        )
        if config.compile_at_startup:
            with phase("compile"):
                runner.compile_ladder(ladder.buckets())
        with phase("load weights"):  # what is left of it
            runner.update_params(loaded_params.result()[1])
        with phase("load the tokenizer"):
            tokenizer = loaded_tokenizer.result()
    with phase("allocate the KV cache"):
        runner.wake_up()
    if config.compile_at_startup:
        with phase("warm up"):
            runner.warm_up()
    # NOTE: Qwen3's generation config stops on <|im_end|> and <|endoftext|>; so does the
    # embedded default.
    if is_random:
        eos = (tokenizer.eos_token_id, tokenizer.pad_token_id)
    else:
        eos = eos_token_ids(tokenizer, path)
    settings = dataclasses.replace(
        settings, num_blocks=num_blocks, eos_token_ids=tuple(int(t) for t in eos if t is not None),
        stepwise_masks=runner.mailbox is not None,
    )  # fmt: skip
    scheduler = Scheduler(settings, ladder=ladder, eviction_policy=config.eviction_policy)
    return Engine(config, scheduler, runner, tokenizer, seconds, defaults)


def fit_num_blocks(
    config: EngineConfig,
    model_config: Qwen3Config,
    scratch: int | None,
    largest: Bucket,
    platform: Platform,
    memory: dict[str, int],
    params_bytes: int,
    per_block: int,
) -> int:
    """KV blocks of `per_block` bytes that fit in `gpu_memory_utilization` of the device (its
    `memory_stats()` before the params were placed) beside the params and `scratch`, the memory
    of the `largest` step (`step_scratch_bytes`; None: an estimate); on a CPU, the blocks of
    max_num_seqs max_model_len requests within `CPU_KV_CACHE_BYTES`."""
    blocks_per_seq = -(-config.max_model_len // config.kvcache_block_size)
    if not platform.gpu:
        wanted = config.max_num_seqs * blocks_per_seq
        return max(blocks_per_seq, min(wanted, CPU_KV_CACHE_BYTES // max(per_block, 1)))
    limit = memory.get("bytes_limit", 0) * config.gpu_memory_utilization
    if scratch is None:  # no account from XLA: a generous estimate (logits, MLP, attention)
        c = model_config
        scratch = largest.num_tokens * (c.hidden_size * 8 + c.intermediate_size * 6) * 4
        scratch += config.max_num_seqs * c.vocab_size * 4 * 4
    # NOTE: the sampler's scratch is small beside the largest step's and comes out of the 10%
    # margin.
    free = limit - scratch - memory.get("bytes_in_use", 0) - params_bytes
    return max(1, int(free // max(per_block, 1)))  # NOTE: 0 bytes a block: a model of no layers


def step_scratch_bytes(
    config: Qwen3Config, mesh: Mesh, bucket: Bucket, block_size: int, kernels: Kernels
) -> int | None:
    """Device memory one step of `bucket` needs beside the params and the KV cache (per device).

    Measured by compiling the step over a one-block cache: XLA's own account of the step's
    temporary buffers, plus its logits output. None where the backend gives no account.
    """

    forward = jax.jit(
        sharded_forward(config, mesh, kernels), donate_argnums=1, compiler_options=COMPILER_OPTIONS
    )
    cache = kv_cache_shapes(config, 1, block_size, mesh)
    on_mesh = replicated(mesh)
    inputs = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on_mesh), bucket.padding()[0]
    )
    with partitioner_for(mesh, kernels.custom_calls):
        lowered = forward.lower(sharded_param_shapes(config, mesh), cache, inputs)
        compiled = lowered.compile(kernels.compiler_options(bucket.num_tokens))
    analysis = compiled.memory_analysis()
    if analysis is None:
        return None
    logits = bucket.num_sampled * config.vocab_size * 4
    return int(analysis.temp_size_in_bytes) + 2 * logits
