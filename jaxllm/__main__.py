"""The command line: `python -m jaxllm generate|chat ...` (the benchmark: `scripts/bench.py`)."""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import sys
from pathlib import Path

DEFAULT_PROMPT = "The capital of France is"
SAMPLING_FLAGS = {"temperature": float, "top_p": float, "max_tokens": int}
ENGINE_FLAGS = ("dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens")
MODEL_DEFAULT = "default: the model's generation_config.json, else SamplingParams()'s"


def main(argv: list[str] | None = None) -> int:
    """The command line's exit status: 2 for a usage error, 130 after Ctrl-C, 1 when the
    reader of its output went away (`| head`), each without a traceback."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # NOTE: Python's recipe: no second error as stdout is flushed
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxllm", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    for name, help_text in (("generate", "complete prompts"), ("chat", "chat with the model")):
        sub = commands.add_parser(name, help=help_text)
        sub.set_defaults(error=sub.error)  # errors name the command's usage
        sub.add_argument(
            "prompts",
            nargs="*",
            help=f"prompts (chat: one user message each; before --choice, which needs one); "
            f"none: {DEFAULT_PROMPT!r}",
        )
        sub.add_argument("--model", default=None, help="model path, Hub id or random:<shape>")
        sub.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
        sub.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
        sub.add_argument("--max-model-len", type=int, default=None)
        sub.add_argument("--max-num-seqs", type=int, default=None)
        sub.add_argument("--max-num-batched-tokens", type=int, default=None)
        sub.add_argument(
            "--compile-at-startup",
            action="store_true",
            help="compile every bucket of the ladder first (default: only the buckets these "
            "prompts need, as they come: far quicker for a few prompts)",
        )
        for field, kind in SAMPLING_FLAGS.items():
            sub.add_argument(f"--{field.replace('_', '-')}", type=kind, help=MODEL_DEFAULT)
        sub.add_argument(
            "--seed",
            type=int,
            default=None,
            help="reproducible sampling: prompt i samples with seed SEED + i",
        )
        sub.add_argument("--ignore-eos", action="store_true", help="run to --max-tokens")
        constraint = sub.add_mutually_exclusive_group()
        constraint.add_argument(
            "--json-schema", metavar="FILE", help="outputs are instances of this JSON schema"
        )
        constraint.add_argument("--regex", help="outputs match this regular expression")
        constraint.add_argument(
            "--choice", nargs="+", help="outputs are one of these (after the prompts)"
        )
        sub.add_argument(
            "--disable-any-whitespace",
            action="store_true",
            help="--json-schema: no whitespace between JSON's tokens",
        )
        if name == "chat":
            sub.add_argument(
                "--enable-thinking",
                action=argparse.BooleanOptionalAction,
                default=None,
                help="Qwen3's thinking mode (default: the chat template's, on)",
            )

    args, rest = parser.parse_known_args(argv)
    unknown = [arg for arg in rest if arg.startswith("-")]
    if unknown:
        args.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.prompts += rest  # prompts after flags; not after --choice, whose values they extend
    if args.choice and not args.prompts:  # NOTE: --choice's values run to the next flag
        args.error("no prompt: put the prompts before --choice")
    texts = [("prompt", prompt) for prompt in args.prompts] + [("--regex", args.regex or "")]
    for name, text in texts + [("--choice", choice) for choice in args.choice or ()]:
        if not _is_utf8(text):
            args.error(f"{name} {text!r} is not UTF-8 text")
    if args.disable_any_whitespace and args.json_schema is None:
        args.error("--disable-any-whitespace applies to --json-schema only")

    from jaxllm import structured as grammars
    from jaxllm.llm import LLM
    from jaxllm.sampling_params import SamplingParams, StructuredOutputsParams

    # What the flags alone decide is refused before the engine starts (tens of seconds).
    try:
        structured = None
        if any(kind is not None for kind in (args.json_schema, args.regex, args.choice)):
            schema = None if args.json_schema is None else _read_schema(args.json_schema)
            structured = StructuredOutputsParams(
                json=schema,
                regex=args.regex,
                choice=args.choice,
                disable_any_whitespace=args.disable_any_whitespace,
            )
            grammars.check(structured)
        flags = {n: v for n in SAMPLING_FLAGS if (v := getattr(args, n)) is not None}
        flags |= dict(ignore_eos=args.ignore_eos, structured_outputs=structured)
        SamplingParams(**flags, seed=args.seed)
    except (ImportError, OSError, ValueError) as error:
        args.error(str(error))
    kwargs = {"tensor_parallel_size": args.tp, "compile_at_startup": args.compile_at_startup}
    kwargs |= {s: v for s in ENGINE_FLAGS if (v := getattr(args, s)) is not None}
    try:
        llm = LLM(args.model, **kwargs)
    except (OSError, TypeError, ValueError) as error:  # a flag out of range, a missing model
        args.error(str(error))
    except MemoryError as error:  # buffers of --max-num-seqs or --max-num-batched-tokens
        args.error(f"out of host memory starting the engine: {error or 'no detail'}")
    prompts = args.prompts or [DEFAULT_PROMPT]
    # NOTE: what the engine refuses, it refuses before any work (a prompt too long).
    try:
        params = dataclasses.replace(llm.get_default_sampling_params(), **flags)
        if args.seed is not None:
            params = [dataclasses.replace(params, seed=args.seed + i) for i in range(len(prompts))]
        if args.command == "generate":
            outputs = llm.generate(prompts, params)
        else:
            conversations = [[{"role": "user", "content": prompt}] for prompt in prompts]
            outputs = llm.chat(conversations, params, enable_thinking=args.enable_thinking)
    except (ImportError, ValueError) as error:
        args.error(str(error))
    if isinstance(sys.stdout, io.TextIOWrapper):  # text the terminal cannot show, escaped
        sys.stdout.reconfigure(errors="backslashreplace")
    for prompt, output in zip(prompts, outputs, strict=True):
        print(f"\n=== {prompt!r}\n{output.text}")
        print(f"--- {len(output.token_ids)} tokens, finish_reason={output.finish_reason}")
    return 0


def _read_schema(path: str) -> str:
    """--json-schema's file as text (UTF-8, a byte-order mark dropped).

    Raises:
        OSError: it cannot be read. ValueError: it is not UTF-8, naming the file.
    """
    try:
        return Path(path).read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise ValueError(
            f"--json-schema {path} is not UTF-8 text ({error.reason} at byte {error.start})"
        ) from None


def _is_utf8(text: str) -> bool:
    """Whether an argument decoded to text (Python keeps bytes that are not UTF-8 as lone
    surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
