"""Where start-up goes: imports, the backend, each phase of `LLM(...)`, and every trace, lowering
and XLA compilation (from `jax.monitoring`), cold (an empty compilation cache) then warm.

Each run is a process of its own; the cold one gets a fresh `$JAXLLM_COMPILATION_CACHE`, which
the warm one reuses. A table per run, then the JSON of both (`--json`).

    python scripts/startup_profile.py --model random:qwen3-0.6b --json startup.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "compile",
}


def union_seconds(spans: list[tuple[float, float]]) -> float:
    """The wall time covered by `spans` (start, end), overlaps counted once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        total += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return total


def program_label(lowered) -> str:
    """A compiled program's name and the shapes of its integer inputs (which name its bucket);
    `time_compiles` numbers the programs of one label (e.g. a sampler's modes)."""
    import jax

    shapes = [
        "x".join(map(str, info.shape)) or "1"
        for info in jax.tree.leaves(lowered.args_info)
        if info.dtype.kind in "iu"
    ]
    return f"{lowered._lowering._name}[{','.join(shapes[:3])}]"


def time_compiles(programs: dict[str, float]) -> None:
    """Records each `Lowered.compile`'s seconds in `programs`, by `program_label`."""
    import jax

    compile_lowered = jax.stages.Lowered.compile

    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return compile_lowered(self, *args, **kwargs)
        finally:
            label = program_label(self)
            label += f" #{sum(name.startswith(label) for name in programs) + 1}"
            programs[label] = time.perf_counter() - start

    jax.stages.Lowered.compile = timed


def profile(model: str) -> dict:
    """One start-up in this process, with its timings."""
    marks = {"process": time.perf_counter()}
    import jax

    programs: dict[str, float] = {}
    time_compiles(programs)

    marks["import jax"] = time.perf_counter()
    jax.devices()
    marks["backend"] = time.perf_counter()
    import jaxllm.startup  # noqa: F401  (the engine's imports: the tokenizer's, the model's)

    marks["import jaxllm"] = time.perf_counter()
    spans = defaultdict(list)

    def on_span(event: str, start: float, end: float, **kwargs) -> None:
        if event in EVENTS:
            spans[EVENTS[event], str(kwargs.get("fun_name", ""))].append((start, end))

    jax.monitoring.register_event_time_span_listener(on_span)
    from jaxllm import LLM

    start = time.time()
    llm = LLM(model)
    marks["LLM(...)"] = time.perf_counter()
    steps = list(marks)
    by_kind = defaultdict(lambda: [0, 0.0])
    for (kind, name), intervals in spans.items():
        by_kind[kind, name][0] += len(intervals)
        by_kind[kind, name][1] += sum(end - begin for begin, end in intervals)
    kinds = {kind for kind, _ in spans}
    return {
        "model": model,
        "marks_s": {b: marks[b] - marks[a] for a, b in itertools.pairwise(steps)},
        "phases_s": llm.startup_seconds,
        "num_executables": llm.engine.runner.num_executables,
        "num_loaded": llm.engine.runner.executables.num_loaded,
        "torch_imported": "torch" in sys.modules,
        "wall_s": {
            kind: union_seconds([s for (k, _), v in spans.items() if k == kind for s in v])
            for kind in kinds
        },
        "first_event_s": min((s for v in spans.values() for s, _ in v), default=start) - start,
        "events": {f"{kind} {name}": counts for (kind, name), counts in sorted(by_kind.items())},
        "programs_s": dict(sorted(programs.items(), key=lambda item: -item[1])),
    }


def report(run: str, result: dict) -> None:
    print(
        f"--- {run}: {result['model']}, {result['num_executables']} executables, "
        f"{result['num_loaded']} loaded unlowered (jaxllm.executables)"
    )
    for name, seconds in {**result["marks_s"], **result["phases_s"]}.items():
        print(f"{name:>28} {seconds:7.2f} s")
    print(f"{'torch imported':>28} {result['torch_imported']}")
    for kind, wall in sorted(result["wall_s"].items()):
        events = [v for k, v in result["events"].items() if k.startswith(kind + " ")]
        busy = sum(seconds for _, seconds in events)
        count = sum(n for n, _ in events)
        print(f"{kind:>28} {count:4d} x, {busy:7.2f} s busy, {wall:7.2f} s wall")
    slowest = sorted(result["events"].items(), key=lambda item: -item[1][1])[:8]
    for name, (count, seconds) in slowest:
        print(f"{name[:60]:>60} {count:3d} x {seconds:7.2f} s")
    print("slowest compiles (wall, on the compiling threads):")
    for name, seconds in list(result["programs_s"].items())[:12]:
        print(f"{name[:60]:>60} {seconds:7.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random:qwen3-0.6b")
    parser.add_argument("--json", help="write both runs here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(profile(args.model)))
        return
    cache = tempfile.mkdtemp(prefix="jaxllm-startup-")
    env = {**os.environ, "JAXLLM_COMPILATION_CACHE": cache}
    results = {}
    for run in ("cold", "warm"):
        start = time.perf_counter()
        child = subprocess.run(
            [sys.executable, __file__, "--model", args.model, "--child"],
            env=env,
            check=True,
            stdout=subprocess.PIPE,
            text=True,
        )
        results[run] = json.loads(child.stdout.strip().splitlines()[-1])
        results[run]["process_s"] = time.perf_counter() - start
        report(run, results[run])
        print(f"{'the whole process':>28} {results[run]['process_s']:7.2f} s")
    if args.json:
        with open(args.json, "w") as file:
            json.dump(results, file, indent=1)


if __name__ == "__main__":
    main()
