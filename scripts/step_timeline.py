"""The engine's decode steps as a timeline, host and device side by side:

    python scripts/step_timeline.py [--json-schema] [--num-seqs 1] [--steps 12]
    python scripts/step_timeline.py --from-trace DIR --around "fill masks"  # a trace kept

Runs `--num-seqs` prompts of 512 tokens (each under bench.py's JSON schema with
`--json-schema`), traces a stretch of decode steps with JAX's profiler and prints, in ms from the
first traced step's start, what the host did (the engine's calls, annotated here: the engine
carries no annotations) and which executables the device ran, merged from their kernels; then
the device's idle share of the stretch (between kernels, and between executables), each
executable's time and the longest kernels. The trace stays in `--trace-dir` for Perfetto.
`--around LABEL` prints every host thread's events (XLA's and PjRt's too) and the device's
kernels in the few ms after one of the annotated calls, e.g. what lies between a plan's masks
and its first kernel.
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import tempfile

import jax

from jaxllm import LLM, SamplingParams, StructuredOutputsParams
from jaxllm.engine import Engine
from jaxllm.handoff import DeviceMailbox, StepwiseMasks
from jaxllm.model.logits_processors import LogitsProcessors
from jaxllm.research.bench import BENCH_SCHEMA, fixed_workload
from jaxllm.research.flags import at_least
from jaxllm.runner import ModelRunner
from jaxllm.sched import Scheduler
from jaxllm.structured import Grammars

# Host calls shown, as (class, method, label).
ANNOTATED = (
    (Engine, "step", "step"),
    (Scheduler, "schedule", "schedule"),
    (ModelRunner, "_run_forward", "dispatch forward"),
    (Engine, "_apply_in_flight", "wait + apply"),
    (Scheduler, "update", "update"),
    (Grammars, "bitmask", "fill masks"),
    (LogitsProcessors, "mask", "dispatch mask"),
    (ModelRunner, "_run_sampler", "dispatch sampler"),
    (StepwiseMasks, "first", "first masks"),
    (StepwiseMasks, "after", "advance + masks"),
    (DeviceMailbox, "_tokens", "poll tokens"),
)
# The device's kernels shown by name, the longest first.
TOP_KERNELS = 8
# Kernels closer than this (ns) to the one before, of the same module, make one span.
MERGE_NS = 20_000


def annotate() -> None:
    for cls, name, label in ANNOTATED:
        method = getattr(cls, name)

        @functools.wraps(method)
        def annotated(*args, _method=method, _label=label, **kwargs):
            with jax.profiler.TraceAnnotation(_label):
                return _method(*args, **kwargs)

        setattr(cls, name, annotated)


Span = tuple[int, int, str, str]  # start ns, end ns, "host" / "device" / a kernel's module, label


def planes(trace_dir: str) -> list:
    """The planes (host, each device) of the trace in `trace_dir`."""
    from jax.profiler import ProfileData

    [path] = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    return list(ProfileData.from_file(path).planes)


def events(trace_dir: str) -> tuple[list[Span], list[Span]]:
    """The annotated host calls and the device's executables (consecutive kernels of one module
    merged), in time order; and the device's kernels and copies themselves."""
    labels = {label for _, _, label in ANNOTATED}
    host, kernels = [], []
    for plane in planes(trace_dir):
        for line in plane.lines:
            for event in line.events:
                span = (event.start_ns, event.start_ns + event.duration_ns)
                if plane.name.startswith("/host") and event.name in labels:
                    host.append((*span, "host", event.name))
                elif plane.name.startswith("/device:GPU") and "Stream" in line.name:
                    module = str(dict(event.stats).get("hlo_module", event.name))
                    kernels.append((*span, module, event.name))
    kernels.sort()
    merged: list[list] = []
    for start, end, module, _ in kernels:
        if merged and merged[-1][3] == module and start - merged[-1][1] < MERGE_NS:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end, "device", module])
    return sorted([*host, *map(tuple, merged)]), kernels


def busy_ns(spans: list[Span], begin: int, end: int) -> int:
    """The time within [begin, end) that at least one of the (sorted) spans covers."""
    busy, cursor = 0, begin
    for start, stop, _, _ in spans:
        busy += max(0, min(stop, end) - max(start, cursor))
        cursor = max(cursor, stop)
    return busy


def report(spans: list[Span], kernels: list[Span], first_step: int, num_steps: int) -> None:
    """The spans of `num_steps` steps from `first_step` on; the device's idle share of them,
    between its kernels (every gap) and between its executables (gaps of `MERGE_NS` or more),
    counting the work of the step before that runs into the first (the host dispatches ahead)."""
    steps = [span for span in spans if span[3] == "step"]
    begin, end = steps[first_step][0], steps[first_step + num_steps][0]
    shown = [span for span in spans if begin <= span[0] < end]
    print(f"{'start ms':>9} {'end ms':>9}  {'side':6} what")
    for start, stop, side, label in shown:
        print(f"{(start - begin) / 1e6:9.3f} {(stop - begin) / 1e6:9.3f}  {side:6} {label}")
    device = [span for span in spans if span[2] == "device" and span[1] > begin]
    window = end - begin
    idle_kernels = 1 - busy_ns([k for k in kernels if k[1] > begin], begin, end) / window
    idle_executables = 1 - busy_ns(device, begin, end) / window
    print(
        f"\n{num_steps} steps, {window / num_steps / 1e6:.3f} ms a step; device idle "
        f"{idle_kernels:.1%} between kernels, {idle_executables:.1%} between executables"
    )
    by_module: dict[str, int] = collections.defaultdict(int)
    for start, stop, _, label in device:
        by_module[label] += max(0, min(stop, end) - max(start, begin))
    for module, total in sorted(by_module.items(), key=lambda item: -item[1]):
        print(f"  {module[:60]:60s} {total / num_steps / 1e6:7.3f} ms a step")
    by_kernel: dict[str, int] = collections.defaultdict(int)
    for start, stop, _, name in kernels:
        by_kernel[name] += max(0, min(stop, end) - max(start, begin))
    print(f"the {TOP_KERNELS} longest kernels:")
    for name, total in sorted(by_kernel.items(), key=lambda item: -item[1])[:TOP_KERNELS]:
        print(f"  {name[:60]:60s} {total / num_steps / 1e6:7.3f} ms a step")


def around(trace_dir: str, label: str, index: int, min_us: float = 20.0) -> None:
    """Events of every host thread (those of `min_us` or more) and the device's first 24
    kernels from the start of the `index`-th call annotated `label` to 4 ms after its end, in
    ms from its end."""
    found = []
    for plane in planes(trace_dir):
        device = plane.name.startswith("/device:GPU")
        for line in plane.lines:
            if (device and "Stream" in line.name) or plane.name.startswith("/host"):
                for event in line.events:
                    if device or event.duration_ns >= min_us * 1000:
                        found.append(
                            (event.start_ns, event.duration_ns, device, line.name, event.name)
                        )
    found.sort()
    start, duration = [(s, d) for s, d, _, _, name in found if name == label][index]
    end = start + duration
    kernels = 0
    for begin, length, device, line, name in found:
        kernels += device and begin >= start
        if start <= begin < end + 4_000_000 and kernels <= 24:
            side = "device" if device else "host"
            times = f"{(begin - end) / 1e6:8.3f} {length / 1e6:8.3f}"
            print(f"{times}  {side:6} {line[:24]:24} {name[:90]}")


def trace(args: argparse.Namespace) -> str:
    """Runs the workload twice, tracing the second run; returns the trace's folder."""
    llm = LLM(args.model, num_scheduler_steps=args.num_scheduler_steps)
    annotate()
    schema = StructuredOutputsParams(json=BENCH_SCHEMA) if args.json_schema else None
    prompts, _ = fixed_workload(args.num_seqs, 512, 0)
    # Prefill and ramp first: the stretch shown starts a third of the way in.
    traced = 3 * args.steps * llm.engine.scheduler.config.num_scheduler_steps
    params = SamplingParams(
        temperature=0.6, ignore_eos=True, max_tokens=traced, structured_outputs=schema
    )
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    trace_dir = args.trace_dir or tempfile.mkdtemp()
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # tracing every Python call would slow the host down
    with jax.profiler.trace(trace_dir, profiler_options=options):
        llm.generate(prompts, params, use_tqdm=False)
    return trace_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="random:qwen3-0.6b")
    parser.add_argument("--num-seqs", type=at_least(1), default=1)
    parser.add_argument("--steps", type=at_least(1), default=12, help="decode steps shown")
    parser.add_argument("--json-schema", action="store_true")
    parser.add_argument("--num-scheduler-steps", type=at_least(1), default=None)
    parser.add_argument("--trace-dir", default=None)
    parser.add_argument("--from-trace", default=None, help="a trace's folder: no run")
    parser.add_argument("--around", default=None, help="an annotated call's label (`around`)")
    parser.add_argument("--index", type=at_least(0), default=2, help="which call `--around` shows")
    args = parser.parse_args()
    trace_dir = args.from_trace or trace(args)
    spans, kernels = events(trace_dir)
    report(spans, kernels, first_step=args.steps, num_steps=args.steps)
    if args.around:
        around(trace_dir, args.around, args.index)
    print(f"trace: {trace_dir}")


if __name__ == "__main__":
    main()
