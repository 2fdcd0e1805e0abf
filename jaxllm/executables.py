"""The runner's compiled programs on disk, keyed by what they are compiled from, not by their
HLO: a warm start loads each one without tracing or lowering it. JAX's persistent compilation
cache keys on the lowered module, so a start-up that hits it still traces and lowers every
program on the main thread (docs/performance.md); it keeps every other program of the process.

A key hashes all a program depends on: this process's environment (`environment`: the jaxllm
source, the versions of jax, its plugins, flax and numpy, XLA_FLAGS, jax's config, the devices)
and what the runner gives (`ExecutableStore.key`): the program's function and what it closes
over (`depends_on`: the model's settings only for the model's programs), the abstract values
(shape, dtype, weak type, sharding) and static values of its arguments, and XLA's options.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import importlib.metadata
import logging
import os
import pickle
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import jax
from jax._src import config as jax_config
from jax.experimental import serialize_executable
from jax.sharding import Mesh

logger = logging.getLogger(__name__)
# What serializing a program raises where it cannot be stored: not on this backend, or one
# holding a Python object (a host callback) that does not pickle.
UNSTORABLE = (ValueError, NotImplementedError, TypeError, AttributeError, pickle.PickleError)

# The distributions whose versions go into every key: jax, jaxlib and their plugins, flax,
# numpy, ml_dtypes, FlashAttention-3's.
_DISTRIBUTIONS = re.compile(r"jax.*|flax|numpy|ml.dtypes|flash.attn.*", re.IGNORECASE)
# NOTE: a folder of programs is deleted after this many days unopened; not at once, so that two
# environments in turn (two checkouts, two versions of jax) keep their programs.
STALE_DAYS = 7


def environment() -> str:
    """A hash of what every program of this process depends on beyond its own arguments."""
    parts = (_installation(), os.environ.get("XLA_FLAGS", ""), sorted(jax.config.values.items()))
    return hashlib.sha256(repr(parts).encode()).hexdigest()


@functools.cache
def _installation() -> str:
    """A hash of the jaxllm source, the versions of what compiles it and the devices."""
    package = Path(__file__).parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + path.read_bytes())
    versions = sorted(
        (dist.metadata["Name"].lower(), dist.version)
        for dist in importlib.metadata.distributions()
        if _DISTRIBUTIONS.fullmatch(dist.metadata["Name"] or "")
    )
    devices = [(d.id, d.platform, d.device_kind, d.process_index) for d in jax.devices()]
    digest.update(repr((versions, devices, jax.devices()[0].client.platform_version)).encode())
    return digest.hexdigest()


def depends_on(jitted: Any, settings: tuple, mesh: Mesh) -> tuple:
    """What a jitted partial over `mesh` depends on besides its arguments: its function's name,
    the values it closes over, and the mesh; `settings` where it closes over a function (a
    model's forward pass, made of those settings) or is not a partial of a plain function.

    NOTE: so a program that closes over plain values alone (a sampler) is shared by the models
    that compile it alike, e.g. two sizes of one vocabulary.
    """
    closed, bound = jitted.__wrapped__, settings
    if isinstance(closed, functools.partial) and getattr(closed.func, "__closure__", 1) is None:
        values = (*closed.args, *closed.keywords.values())
        bound = settings if any(map(callable, values)) else (closed.args, closed.keywords)
    return jitted.__name__, bound, mesh, mesh.device_ids.tolist()


def _abstract(leaf: Any) -> Any:
    """What a program's compilation sees of an argument leaf."""
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        sharding = repr(getattr(leaf, "sharding", None))
        return (tuple(leaf.shape), str(leaf.dtype), getattr(leaf, "weak_type", False), sharding)
    return repr(leaf)


def _delete_stale(directory: Path) -> None:
    """Deletes the folders in `directory` that no store has opened for `STALE_DAYS`."""
    for folder in directory.iterdir():
        with contextlib.suppress(OSError):  # another process may be deleting it too
            if time.time() - folder.stat().st_mtime > STALE_DAYS * 24 * 3600:
                shutil.rmtree(folder)


@functools.cache
def _jax_cache_hits() -> threading.local:
    """Per thread, in `count`, the programs JAX's persistent cache returned (from its events;
    one listener for the process)."""
    hits = threading.local()

    def on_event(event: str, **kwargs: Any) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            hits.count = getattr(hits, "count", 0) + 1

    jax.monitoring.register_event_listener(on_event)
    return hits


def _no_jax_cache_writes() -> contextlib.AbstractContextManager:
    """On this thread, JAX's persistent cache keeps no program it compiles (JAX writes those
    that took at least `jax_persistent_cache_min_compile_time_secs`)."""
    # NOTE: jax's configuration states are thread-local as context managers (a private API)
    state = getattr(jax_config, "persistent_cache_min_compile_time_secs", None)
    return contextlib.nullcontext() if state is None else state(float("inf"))


class ExecutableStore:
    """Compiled programs in a folder of `directory` for this environment, one file a key;
    without a directory, or with one it cannot make, none (every program compiled, nothing
    kept). Folders no store has opened for `STALE_DAYS` are deleted: their environment is
    likely gone (an older jaxllm, jax or device).

    Loading runs code from the files (pickles): the directory must be as trusted as the
    program.

    Attributes:
        num_loaded: programs loaded, not compiled.
    """

    def __init__(self, directory: str | Path | None = None, devices: Sequence = ()) -> None:
        self.directory = None
        if directory is not None:
            folder = Path(directory) / environment()[:16]
            try:
                folder.mkdir(parents=True, exist_ok=True)
                os.utime(folder)  # opened now
            except OSError as error:  # e.g. a read-only cache: every program compiled
                logger.warning("no store of executables in %s: %s", directory, error)
            else:
                self.directory = folder
                _delete_stale(folder.parent)
        self.devices = list(devices)
        self.num_loaded = 0
        self._lock = threading.Lock()  # programs load on the runner's compiling threads

    def key(self, *parts: Any) -> str:
        """The key of a program: `parts` name it (the runner's settings, the program, its
        arguments: arrays and `ShapeDtypeStruct`s by abstract value, the rest by repr)."""
        if self.directory is None:
            return ""
        leaves, tree = jax.tree.flatten(parts)
        described = (str(tree), [_abstract(leaf) for leaf in leaves])
        return hashlib.sha256((environment() + repr(described)).encode()).hexdigest()

    def __contains__(self, key: str) -> bool:
        return self.directory is not None and self._path(key).exists()

    def load(self, key: str) -> jax.stages.Compiled | None:
        """The program stored under `key`; None (and a warning) if it cannot be loaded."""
        try:
            payload, in_tree, out_tree = pickle.loads(self._path(key).read_bytes())
            compiled = serialize_executable.deserialize_and_load(
                payload, in_tree, out_tree, execution_devices=self.devices
            )
        except Exception as error:  # a truncated or stale file: the program is compiled again
            logger.warning("could not load the stored executable %s: %s", key[:12], error)
            return None
        with self._lock:
            self.num_loaded += 1
        return compiled

    def compile(self, lowered: jax.stages.Lowered, options: dict, key: str) -> jax.stages.Compiled:
        """Compiles `lowered` with XLA `options` and stores it under `key` (not in JAX's
        persistent cache), unless JAX's cache had it.

        NOTE: serialized again, a program read from JAX's cache can lose its kernels (XLA:CPU:
        "Function ... not found" when it runs), so only programs compiled here are stored.
        """
        if self.directory is None:
            return lowered.compile(options)
        hits = _jax_cache_hits()
        before = getattr(hits, "count", 0)
        with _no_jax_cache_writes():
            compiled = lowered.compile(options)
        if getattr(hits, "count", 0) == before:
            self._save(key, compiled)
        return compiled

    def build(
        self,
        programs: Iterable[tuple[str, Callable[[], jax.stages.Lowered], dict]],
        threads: int,
        done: Callable[[int, jax.stages.Compiled], None],
    ) -> None:
        """Loads or compiles each program `(key, lower, options)` on `threads` threads, calling
        `done(index, executable)` here as each is ready. A program not stored under `key` is
        lowered here while those before it compile (or load) on the threads; one that fails to
        load is compiled again."""
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            futures = {}
            for index, (key, lower, options) in enumerate(programs):
                if key in self:
                    future = pool.submit(self.load, key)
                else:
                    future = pool.submit(self.compile, lower(), options, key)
                futures[future] = index, key, lower, options
            for future in concurrent.futures.as_completed(futures):
                index, key, lower, options = futures[future]
                # NOTE: a stored program that failed to load (None) is compiled again
                done(index, future.result() or self.compile(lower(), options, key))

    def _save(self, key: str, compiled: jax.stages.Compiled) -> None:
        try:
            record = pickle.dumps(serialize_executable.serialize(compiled))
        except UNSTORABLE as error:
            logger.warning("could not store an executable: %s", error)
            return
        # NOTE: written whole, then renamed: a reader sees all of it or nothing
        temporary = self._path(key).with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            temporary.write_bytes(record)
            temporary.replace(self._path(key))
        except OSError as error:  # e.g. the folder deleted by a process of another environment
            logger.warning("could not store an executable: %s", error)

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}.executable"
