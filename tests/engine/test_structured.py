"""Structured outputs (`StructuredOutputsParams`): on random weights only the constraint makes
an output valid, so every output at temperature 1 over many seeds must satisfy it."""

from __future__ import annotations

import _thread
import concurrent.futures
import functools
import importlib
import json
import math
import re
import threading
import time

import jsonschema
import pytest
from support.engine import assert_idle

from jaxllm import SamplingParams, StructuredOutputsParams
from jaxllm.matchers import EXTRA_HINT

pytest.importorskip("llguidance")

NUM_SEEDS = 16
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def sample_all(llm, constraint: StructuredOutputsParams, max_tokens: int = 64, **settings):
    """One constrained completion per seed, all in one batch."""
    params = [
        SamplingParams(
            temperature=1.0, max_tokens=max_tokens, seed=seed, structured_outputs=constraint,
            **settings,
        )
        for seed in range(NUM_SEEDS)
    ]  # fmt: skip
    outputs = llm.generate(["Answer:"] * NUM_SEEDS, params, use_tqdm=False)
    return [output.outputs[0] for output in outputs]


def test_json_schema_outputs_validate(text_llm):
    constraint = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    completions = sample_all(text_llm, constraint)
    for completion in completions:
        assert completion.finish_reason == "stop"
        jsonschema.validate(json.loads(completion.text), SCHEMA)
    assert len({c.text for c in completions}) > NUM_SEEDS // 2  # sampled, not forced


def test_json_keys_follow_the_schema_order(text_llm):
    schema = {
        "type": "object",
        "properties": {"zeta": {"type": "boolean"}, "alpha": {"type": "boolean"}},
        "required": ["zeta", "alpha"],
        "additionalProperties": False,
    }
    constraint = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    for completion in sample_all(text_llm, constraint)[:4]:
        assert list(json.loads(completion.text)) == ["zeta", "alpha"]


def test_json_schema_with_whitespace_is_a_valid_prefix_or_whole(text_llm):
    """Any whitespace allowed: random weights may spend the whole budget on it; what stopped
    validates."""
    completions = sample_all(text_llm, StructuredOutputsParams(json=json.dumps(SCHEMA)))
    for completion in completions:
        if completion.finish_reason == "stop":
            jsonschema.validate(json.loads(completion.text), SCHEMA)
        else:
            assert completion.finish_reason == "length"
            assert completion.text.lstrip()[:1] in ("", "{")


def test_regex_outputs_match(text_llm):
    pattern = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
    for completion in sample_all(text_llm, StructuredOutputsParams(regex=pattern)):
        assert completion.finish_reason == "stop"
        assert re.fullmatch(pattern, completion.text)


def test_choice_outputs_are_choices(text_llm):
    choices = ["yes", "no", "maybe not", "🙂"]
    completions = sample_all(text_llm, StructuredOutputsParams(choice=choices))
    assert all(c.finish_reason == "stop" and c.text in choices for c in completions)
    assert len({c.text for c in completions}) > 1


def test_a_grammar_that_ends_on_the_last_token_allowed_stops(text_llm):
    """Its end stands for the eos vLLM would sample after it: "stop" on the last token
    max_tokens allows too, as a stop token would; cut short, "length"."""
    choices = ["yes", "no"]  # one token each, or two ("ye" "s", "n" "o")
    completions = sample_all(text_llm, StructuredOutputsParams(choice=choices), max_tokens=1)
    assert {c.finish_reason for c in completions if c.text in choices} == {"stop"}
    assert {c.finish_reason for c in completions if c.text not in choices} == {"length"}
    longer = sample_all(text_llm, StructuredOutputsParams(regex="[0-9]{40}"), max_tokens=2)
    assert all(c.finish_reason == "length" and len(c.token_ids) == 2 for c in longer)


def test_thousands_of_choices_are_choices(text_llm):
    """Past 2,000 choices, one rule of an alternative each failed in llguidance's parser."""
    choices = [f"item{index}" for index in range(2500)]
    completions = sample_all(text_llm, StructuredOutputsParams(choice=choices), max_tokens=16)
    assert all(c.finish_reason == "stop" and c.text in choices for c in completions)
    assert len({c.text for c in completions}) > 1


def test_grammar_outputs_parse(text_llm):
    grammar = 'start: "maybe " NUMBER | "yes" | "no"\nNUMBER: /[1-9][0-9]?/'
    for completion in sample_all(text_llm, StructuredOutputsParams(grammar=grammar)):
        assert completion.finish_reason == "stop"
        assert re.fullmatch(r"maybe [1-9][0-9]?|yes|no", completion.text)


def test_json_object_outputs_are_objects(text_llm):
    constraint = StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    completions = sample_all(text_llm, constraint, max_tokens=96)
    stopped = [c for c in completions if c.finish_reason == "stop"]
    assert stopped
    assert all(isinstance(json.loads(c.text), dict) for c in stopped)


def test_a_free_request_beside_constrained_ones_samples_as_alone(text_llm):
    free = SamplingParams(temperature=1.0, max_tokens=12, seed=5, ignore_eos=True)
    (alone,) = text_llm.generate(["Once upon a time"], free, use_tqdm=False)
    choice = StructuredOutputsParams(choice=["left", "right"])
    constrained = SamplingParams(temperature=1.0, max_tokens=8, seed=1, structured_outputs=choice)
    outputs = text_llm.generate(
        ["Go", "Once upon a time", "Turn"], [constrained, free, constrained], use_tqdm=False
    )
    assert outputs[1].token_ids == alone.token_ids
    assert outputs[0].text in ("left", "right") and outputs[2].text in ("left", "right")


def test_choices_hold_with_logprobs_and_penalties(text_llm):
    """With logprobs (of the masked logits, as vLLM's raw ones) or penalties (applied after
    the mask), the outputs follow the grammar, and each token's logprob is reported."""
    constraint = StructuredOutputsParams(choice=["north", "south", "east", "west"])
    for settings in ({"logprobs": 3}, {"repetition_penalty": 1.3, "presence_penalty": 0.5}):
        for completion in sample_all(text_llm, constraint, max_tokens=16, **settings):
            assert completion.text in constraint.choice and completion.finish_reason == "stop"
            if "logprobs" in settings:
                assert len(completion.logprobs) == len(completion.token_ids)
                for token, entries in zip(completion.token_ids, completion.logprobs, strict=True):
                    assert token in entries and entries[token].logprob <= 0
                # the first token's likeliest are the grammar's: each starts a choice
                for first, entry in completion.logprobs[0].items():
                    text = text_llm.tokenizer.decode([first])
                    allowed = any(choice.startswith(text) for choice in constraint.choice)
                    assert allowed or entry.logprob == -math.inf, (text, entry)


def test_allowed_tokens_narrow_the_grammar_and_never_empty_it(text_llm):
    """allowed_token_ids narrow a grammar's tokens; where none of them fits the grammar (the
    end of text after "yes", or no choice at all), the grammar's tokens are sampled."""
    choices = ["yes", "no", "maybe"]
    constraint = StructuredOutputsParams(choice=choices)
    encode = functools.partial(text_llm.tokenizer.encode, add_special_tokens=False)
    for allowed, expected in ((encode("yes"), {"yes"}), (encode(" zebra"), set(choices))):
        completions = sample_all(text_llm, constraint, max_tokens=8, allowed_token_ids=allowed)
        assert all(c.finish_reason == "stop" and c.text in expected for c in completions)


def test_a_stop_string_ends_a_constrained_output_early(text_llm):
    constraint = StructuredOutputsParams(choice=["apple pie", "banana split", "cherry tart"])
    completions = sample_all(text_llm, constraint, max_tokens=16, stop=[" "])
    assert all(
        c.finish_reason == "stop" and c.text in ("apple", "banana", "cherry") for c in completions
    )


def test_constrained_outputs_at_tp2_equal_tp1(text_llm, make_text_llm):
    """The same seeds give the same constrained outputs with the model over two devices."""
    constraint = StructuredOutputsParams(regex="[a-f]{3,9}")
    at_tp2 = make_text_llm(tensor_parallel_size=2)
    texts = [[c.text for c in sample_all(llm, constraint)] for llm in (text_llm, at_tp2)]
    assert texts[0] == texts[1]
    assert all(re.fullmatch("[a-f]{3,9}", text) for text in texts[1])


def test_processed_logprobs_are_of_the_masked_logits(make_text_llm):
    """logprobs_mode="processed_logprobs": the tokens the grammar bans are at -inf, so the top
    entries past the allowed ones are -inf; the first token starts a choice."""
    llm = make_text_llm(max_model_len=128, logprobs_mode="processed_logprobs")
    choices = ["yes", "no"]
    constraint = StructuredOutputsParams(choice=choices)
    for completion in sample_all(llm, constraint, max_tokens=8, logprobs=20):
        assert completion.text in choices
        first = completion.logprobs[0]
        allowed = [entry for entry in first.values() if entry.logprob > float("-inf")]
        assert 0 < len(allowed) < len(first)
        assert all(any(c.startswith(e.decoded_token) for c in choices) for e in allowed)


def test_the_step_planned_while_masks_fill_survives_aborts_and_new_requests(text_llm):
    """A constrained step plans the next one while its forward pass runs; requests aborted
    or added before that plan runs change nothing for the others."""
    engine = text_llm.engine
    free = SamplingParams(temperature=1.0, max_tokens=10, seed=3, ignore_eos=True)
    (alone,) = text_llm.generate(["A late request"], free, use_tqdm=False)
    pattern = "[a-z]{12}"
    regex = SamplingParams(
        temperature=1.0, max_tokens=20, seed=0,
        structured_outputs=StructuredOutputsParams(regex=pattern),
    )  # fmt: skip
    tokenize = text_llm.tokenizer.encode
    constrained = engine.new_request(tokenize("Spell:"), regex)
    doomed = engine.new_request(tokenize("Soon aborted"), free)
    for request in (constrained, doomed):
        engine.add(request)
    finished = []
    while engine._next_plan is None:
        assert engine.has_unfinished()
        finished += engine.step()
    engine.abort(doomed.request_id)
    late = engine.new_request(tokenize("A late request"), free)
    engine.add(late)
    while engine.has_unfinished():
        finished += engine.step()
    by_id = {output.request_id: output.outputs[0] for output in finished}
    assert by_id.keys() == {constrained.request_id, late.request_id}
    assert re.fullmatch(pattern, by_id[constrained.request_id].text)
    assert by_id[late.request_id].token_ids == alone.outputs[0].token_ids
    assert_idle(text_llm)


def test_constrained_completions_survive_preemption(make_text_llm):
    """A cache of few blocks preempts running sequences; each matcher keeps its state while its
    sequence is recomputed."""
    llm = make_text_llm(num_kvcache_blocks=6, max_model_len=96)
    pattern = r"(ab|cd){10,40}"
    params = [
        SamplingParams(
            temperature=1.0, max_tokens=40, seed=seed, n=2,
            structured_outputs=StructuredOutputsParams(regex=pattern),
        )
        for seed in range(4)
    ]  # fmt: skip
    outputs = llm.generate([[7] * 40] * 4, params, use_tqdm=False)  # 3 blocks each
    assert llm.engine.scheduler.num_preemptions > 0
    for output in outputs:
        for completion in output.outputs:
            assert completion.finish_reason == "stop"
            assert re.fullmatch(pattern, completion.text)


@pytest.fixture(scope="module")
def make_text_llm(text_model):
    """make_text_llm(**settings) -> a new LLM of `text_llm`'s model, with `settings`."""
    from jaxllm import LLM

    def make(**settings):
        return LLM(
            text_model, max_num_seqs=4, max_num_batched_tokens=64, kvcache_block_size=16,
            compile_at_startup=False, **settings,
        )  # fmt: skip

    return make


def test_a_model_directory_with_a_tokenizer_of_its_own(tmp_path):
    """A Hugging Face tokenizer of the model's directory (bytes only, no merges: every
    character is a token of its own), not the embedded one."""
    from support.hf import save_checkpoint
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from jaxllm import LLM

    vocab = {char: i for i, char in enumerate(bytes_to_unicode().values())}
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|end|>")
    save_checkpoint(tmp_path, vocab_size=320)
    tokenizer.save_pretrained(tmp_path)
    llm = LLM(
        str(tmp_path), max_num_seqs=4, max_num_batched_tokens=64, kvcache_block_size=16,
        compile_at_startup=False, dtype="float32",
    )  # fmt: skip
    assert len(llm.tokenizer) == 257
    pattern = "[0-9]{2}-[a-z]{3}"
    for completion in sample_all(llm, StructuredOutputsParams(regex=pattern), max_tokens=16):
        assert completion.finish_reason == "stop" and re.fullmatch(pattern, completion.text)
        assert len(completion.token_ids) == 6  # a token a character; nothing can follow


def test_each_spec_compiles_once(text_llm):
    grammars = text_llm.engine.grammars
    constraint = StructuredOutputsParams(regex="[a-c]{5}")
    first = grammars.compile(constraint)
    assert grammars.compile(StructuredOutputsParams(regex="[a-c]{5}")) is first
    assert grammars.compile(StructuredOutputsParams(regex="[a-c]{6}")) is not first


def test_only_the_specs_used_last_stay_compiled(text_llm, monkeypatch):
    """A spec per request does not grow the cache without bound: the least recently used
    go first; one compiled again works as before."""
    monkeypatch.setattr("jaxllm.structured.COMPILED_GRAMMARS", 3)
    grammars = text_llm.engine.grammars
    specs = [StructuredOutputsParams(regex=f"[a-c]{{{n}}}") for n in range(1, 6)]
    first = grammars.compile(specs[0])
    for spec in specs[1:3]:
        grammars.compile(spec)
    assert grammars.compile(specs[0]) is first  # used again: now the newest
    for spec in specs[3:]:
        grammars.compile(spec)
    assert len(grammars._compiled) == 3 and grammars.compile(specs[0]) is first
    assert grammars.compile(specs[1]) is not grammars.compile(specs[3])
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=8, structured_outputs=specs[1])
    (output,) = text_llm.generate(["Q"], params, use_tqdm=False)  # compiled again
    assert re.fullmatch("[a-c]{2}", output.outputs[0].text)
    assert_idle(text_llm)


def test_a_grammar_still_compiling_holds_back_no_one(text_llm, monkeypatch):
    engine = text_llm.engine
    grammars = engine.grammars
    held: concurrent.futures.Future = concurrent.futures.Future()
    real = grammars._compiler.submit
    monkeypatch.setattr(grammars._compiler, "submit", lambda *args, **kwargs: held)
    constraint = StructuredOutputsParams(regex="(held){2}")
    slow = SamplingParams(temperature=1.0, max_tokens=8, seed=0, structured_outputs=constraint)
    free = SamplingParams(temperature=1.0, max_tokens=6, seed=0, ignore_eos=True)
    waiting = engine.new_request([100, 101, 102], slow)
    engine.add(waiting)
    runs = engine.new_request([100, 101, 102], free)
    engine.add(runs)
    finished = []
    while not finished:
        finished += engine.step()
    assert [output.request_id for output in finished] == [runs.request_id]
    assert engine.scheduler.waiting[0].seq_id == waiting.request_id  # never admitted
    held.set_result(real(*held_args(grammars, constraint)).result())
    while engine.has_unfinished():
        finished += engine.step()
    assert finished[-1].request_id == waiting.request_id
    assert finished[-1].outputs[0].text == "heldheld"


def test_ctrl_c_ends_a_wait_for_a_grammar_still_compiling(text_llm, monkeypatch):
    """With nothing else to run, generate waits for a grammar's compile, and Ctrl-C (held back
    while a step runs) ends the wait; once compiled, the spec serves again."""
    grammars = text_llm.engine.grammars
    loaded = SamplingParams(max_tokens=1, structured_outputs=StructuredOutputsParams(regex="a"))
    text_llm.generate("x", loaded, use_tqdm=False)  # llguidance and the buckets ready
    held: concurrent.futures.Future = concurrent.futures.Future()
    real, wait = grammars._compiler.submit, grammars.wait
    monkeypatch.setattr(grammars._compiler, "submit", lambda *args, **kwargs: held)
    constraint = StructuredOutputsParams(regex="(wait){2}")
    compiled = threading.Timer(
        5.0, lambda: held.set_result(real(*held_args(grammars, constraint)).result())
    )

    def interrupted_wait(waiting):
        _thread.interrupt_main()  # Ctrl-C as the step starts to wait
        wait(waiting)

    monkeypatch.setattr(grammars, "wait", interrupted_wait)
    params = SamplingParams(max_tokens=8, structured_outputs=constraint)
    start = time.perf_counter()
    compiled.start()
    with pytest.raises(KeyboardInterrupt):
        text_llm.generate("x", params, use_tqdm=False)
    assert time.perf_counter() - start < 2.0  # not at the compile's end
    monkeypatch.setattr(grammars, "wait", wait)
    compiled.join()
    [output] = text_llm.generate("x", params, use_tqdm=False)
    assert output.outputs[0].text == "waitwait"
    assert_idle(text_llm)


def held_args(grammars, constraint):
    return grammars._build, constraint, grammars._library().grammar(constraint)


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(json={"type": "foo"}), r"(?s)StructuredOutputsParams.json is invalid: .*foo"),
        (dict(regex="(ab"), r"(?s)StructuredOutputsParams.regex is invalid: .*unclosed group"),
        (
            dict(grammar="start: missing"),
            r"(?s)StructuredOutputsParams.grammar is invalid: .*missing",
        ),
    ],
)
def test_invalid_specs_are_refused_before_any_work(text_llm, settings, message):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**settings))
    steps_before = text_llm.engine.stats.decode.steps + text_llm.engine.stats.prefill.steps
    with pytest.raises(ValueError, match=message):
        text_llm.generate(["fine", "also fine"], [SamplingParams(max_tokens=2), params])
    stats = text_llm.engine.stats
    assert stats.decode.steps + stats.prefill.steps == steps_before
    assert text_llm.generate("still works", SamplingParams(max_tokens=2), use_tqdm=False)


def test_a_grammar_that_fails_while_it_runs_stops_its_request_with_a_warning(text_llm, caplog):
    """A regex that validates but whose lexer gives up on the first token (too many states):
    the request stops, as in vLLM, and the log says why; the others run on."""
    failing = StructuredOutputsParams(regex="a{99999999}")
    params = [
        SamplingParams(seed=0, max_tokens=12, structured_outputs=failing),
        SamplingParams(seed=0, max_tokens=12, ignore_eos=True),
    ]
    with caplog.at_level("WARNING", logger="jaxllm.sched.sequence"):
        stopped, free = text_llm.generate(["Hi", "Hi"], params, use_tqdm=False)
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) < 12
    (record,) = [r for r in caplog.records if "its grammar failed" in r.getMessage()]
    assert "\n" not in record.getMessage()  # the library's state and grammar left out
    assert free.finish_reason == "length" and len(free.token_ids) == 12
    assert_idle(text_llm)


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(), "exactly one of .* got none"),
        (dict(regex="a", choice=["a"]), "exactly one of .* got regex, choice"),
        (dict(choice=[]), r"choice must be a non-empty list of strings, got \[\]"),
        (dict(choice=["a", 1]), "choice must be a non-empty list of strings"),
        (dict(json="{not json"), "json is not valid JSON"),
        (dict(json={"enum": {"a"}}), "json is not valid JSON: Object of type set"),
        (dict(json={("a",): 1}), "json is not valid JSON: keys must be"),
        (dict(json=3), "json must be a dict or its JSON text"),
        (dict(json_object="yes"), "json_object must be True or False"),
    ],
)
def test_malformed_params_name_the_field(settings, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**settings)


def test_missing_extra_names_it(text_llm, monkeypatch):
    grammars = text_llm.engine.grammars
    monkeypatch.setattr(grammars, "_llguidance", None)
    real_import = importlib.import_module

    def without_llguidance(name, *args):
        if name.startswith("llguidance"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args)

    monkeypatch.setattr(importlib, "import_module", without_llguidance)
    params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a"]))
    with pytest.raises(ImportError, match=re.escape(EXTRA_HINT)):
        text_llm.generate("x", params, use_tqdm=False)
    monkeypatch.undo()
    assert text_llm.generate("x", SamplingParams(max_tokens=1), use_tqdm=False)


def test_mask_time_and_late_steps_are_counted(text_llm):
    before = text_llm.engine.stats.snapshot()
    sample_all(text_llm, StructuredOutputsParams(regex="[a-z]{8}"))
    stats = text_llm.engine.stats.since(before)
    assert stats["decode_masks_ms_per_step"] > 0
    assert 0 <= stats["decode_masks_late_steps"] <= stats["decode_steps"] > 0


def test_a_failure_while_masks_fill_waits_for_the_forward_pass(text_llm, monkeypatch):
    """The forward pass runs on a thread of its own while the masks fill; when filling them
    fails, the step waits for it (it replaces the KV cache) before the engine resets, and the
    LLM keeps working."""
    runner, grammars = text_llm.engine.runner, text_llm.engine.grammars
    run_forward, finished = runner._run_forward, []

    def slow_forward(*args):
        time.sleep(0.3)
        logits = run_forward(*args)
        finished.append(True)
        return logits

    def failing_bitmask(plan):
        raise RuntimeError("mask filling failed")

    monkeypatch.setattr(runner, "_run_forward", slow_forward)
    monkeypatch.setattr(grammars, "bitmask", failing_bitmask)
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="a+"))
    with pytest.raises(RuntimeError, match="mask filling failed"):
        text_llm.generate("x", params, use_tqdm=False)
    assert finished  # before the error reached the caller
    monkeypatch.undo()
    [output] = text_llm.generate("x", params, use_tqdm=False)
    assert re.fullmatch("a+", output.outputs[0].text)
    assert_idle(text_llm)


@pytest.fixture(scope="module")
def multi_step_llm(make_text_llm):
    """`text_llm` with 4 decode steps a plan: without a mailbox (a CPU's default), constrained
    rows take plans of one step."""
    return make_text_llm(max_model_len=256, num_scheduler_steps=4)


# A free-text field.
TEXT = StructuredOutputsParams(
    json={"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
    disable_any_whitespace=True,
)


def decode_plans(llm) -> tuple[int, int]:
    """The decode plans the engine ran so far, and their forward passes."""
    return llm.engine.stats.decode.steps, llm.engine.stats.decode.forward_passes


def test_without_a_mailbox_constrained_rows_take_one_step_plans(text_llm, multi_step_llm):
    """They sample as at one step a plan, where free rows would take plans of four."""
    params = SamplingParams(temperature=0.8, max_tokens=40, seed=3, structured_outputs=TEXT)
    assert multi_step_llm.engine.runner.mailbox is None
    steps, passes = decode_plans(multi_step_llm)
    [several] = multi_step_llm.generate("Answer:", params, use_tqdm=False)
    [alone] = text_llm.generate("Answer:", params, use_tqdm=False)
    assert several.outputs[0].token_ids == alone.outputs[0].token_ids
    after = decode_plans(multi_step_llm)
    assert after[0] > steps and after[1] - passes == after[0] - steps
    free = SamplingParams(temperature=0.8, max_tokens=40, seed=3, ignore_eos=True)
    multi_step_llm.generate("Answer:", free, use_tqdm=False)
    end = decode_plans(multi_step_llm)
    assert end[1] - after[1] > end[0] - after[0]  # the free row's plans of several steps


def test_free_plans_after_constrained_ones_are_unmasked(text_llm, multi_step_llm):
    """No mask outlives its plan: free rows beside constrained ones, and free rows' plans of
    several steps after them, sample from every token, as at one step a plan."""
    digits = StructuredOutputsParams(regex="[0-9]{100}")  # narrow masks to the end
    constrained = SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=digits)
    free = SamplingParams(temperature=1.0, max_tokens=30, seed=5, ignore_eos=True)
    multi_step_llm.generate(["Answer:"] * 2, constrained, use_tqdm=False)
    prompts, params = ["Answer:", "Q"], [constrained, free]
    for several, alone in zip(
        multi_step_llm.generate(prompts, params, use_tqdm=False)
        + multi_step_llm.generate(["Q"], free, use_tqdm=False),
        text_llm.generate(prompts, params, use_tqdm=False)
        + text_llm.generate(["Q"], free, use_tqdm=False),
        strict=True,
    ):
        assert several.outputs[0].token_ids == alone.outputs[0].token_ids
    assert_idle(multi_step_llm)


def test_constrained_rows_at_tp2_sample_what_one_step_plans_do(text_llm, make_text_llm):
    """Tensor parallelism has no mailbox: constrained rows take plans of one step there."""
    params = [
        SamplingParams(temperature=0.6, max_tokens=48, seed=seed, structured_outputs=TEXT)
        for seed in range(4)
    ]
    at_tp2 = make_text_llm(tensor_parallel_size=2, num_scheduler_steps=4)
    one_step, several = (llm.generate(["Answer:"] * 4, params, use_tqdm=False)
                         for llm in (text_llm, at_tp2))  # fmt: skip
    for alone, output in zip(one_step, several, strict=True):
        assert output.outputs[0].token_ids == alone.outputs[0].token_ids
    steps, passes = decode_plans(at_tp2)
    assert at_tp2.engine.runner.mailbox is None and steps == passes > 0
    assert_idle(at_tp2)
