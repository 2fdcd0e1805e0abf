"""Constrained rows in plans of several decode steps, every step under its own mask from the host
while the plan runs (`jaxllm.handoff`): the same tokens as one step a plan. Through device
memory on an NVIDIA GPU; through host callbacks, the same steps, on a CPU."""

from __future__ import annotations

from unittest import mock

import pytest
from support.engine import assert_idle, gpu_kernel_settings

from jaxllm import SamplingParams, StructuredOutputsParams

PROMPTS = ["Answer:", "Q", "Go on", "x"]
CONSTRAINTS = [
    StructuredOutputsParams(
        json={"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
        disable_any_whitespace=True,
    ),
    StructuredOutputsParams(regex="[a-z ]{0,40}x"),
    StructuredOutputsParams(choice=["ab c", "d"]),
    StructuredOutputsParams(regex="a[a-z]{0,40}"),
]


@pytest.fixture(scope="module", params=["host", pytest.param("device", marks=pytest.mark.gpu)])
def llms(request, text_model):
    """`text_llm`'s model at one step a plan, and at 4 with the mailbox of the param's kind."""
    from jaxllm import LLM

    settings = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256)
    settings |= dict(kvcache_block_size=16, num_kvcache_blocks=64, compile_at_startup=False)
    with gpu_kernel_settings(mailbox=request.param):
        return tuple(LLM(text_model, num_scheduler_steps=k, **settings) for k in (1, 4))


def assert_as_one_step(one_step, several, params: list[SamplingParams]) -> None:
    """`several` samples PROMPTS under `params` as `one_step` does, in plans of several steps."""
    decode = several.engine.stats.decode
    passes, plans = decode.forward_passes, decode.steps
    expected = one_step.generate(PROMPTS, params, use_tqdm=False)
    outputs = several.generate(PROMPTS, params, use_tqdm=False)
    for alone, output in zip(expected, outputs, strict=True):
        assert output.outputs[0].token_ids == alone.outputs[0].token_ids
        assert output.outputs[0].finish_reason == alone.outputs[0].finish_reason
    assert decode.forward_passes - passes > decode.steps - plans
    assert_idle(several)


@pytest.mark.parametrize("temperature", [0.0, 0.6, 1.0])
@pytest.mark.parametrize("constraint", CONSTRAINTS, ids=["json", "regex", "choice", "widening"])
def test_plans_of_several_steps_sample_what_one_step_plans_do(llms, constraint, temperature):
    one_step, several = llms
    assert several.engine.runner.mailbox is not None
    params = [
        SamplingParams(
            temperature=temperature, max_tokens=60, seed=seed, structured_outputs=constraint
        )
        for seed in range(len(PROMPTS))
    ]
    assert_as_one_step(one_step, several, params)


def test_a_free_request_beside_constrained_ones_samples_as_alone(llms):
    _, several = llms
    free = SamplingParams(temperature=1.0, max_tokens=40, seed=7)
    constrained = SamplingParams(
        temperature=1.0, max_tokens=40, seed=1, structured_outputs=CONSTRAINTS[1]
    )
    alone = several.generate(["Go on"], free, use_tqdm=False)[0]
    both = several.generate(["Go on", "Q"], [free, constrained], use_tqdm=False)
    assert both[0].outputs[0].token_ids == alone.outputs[0].token_ids
    assert_idle(several)


def test_rows_with_top_k_and_top_p_take_plans_of_several_steps(llms):
    """A mailbox masks each step as its own, whatever filters the draw: Qwen3's sampling
    defaults (top-k 20, top-p 0.95), as one step a plan."""
    one_step, several = llms
    qwen3 = dict(temperature=0.6, top_k=20, top_p=0.95, max_tokens=40)
    constraint = CONSTRAINTS[1]
    params = [
        SamplingParams(**qwen3, seed=seed, structured_outputs=constraint)
        for seed in range(len(PROMPTS))
    ]
    assert_as_one_step(one_step, several, params)


def test_stop_strings_and_several_completions_end_as_at_one_step(llms):
    """A stop string ends a row inside a plan of several steps (on a GPU, the plan after it,
    dispatched before, drops the row's tokens); two completions a request, each under its own
    grammar: as one step a plan."""
    one_step, several = llms
    settings = dict(temperature=1.0, max_tokens=60, n=2, stop=["e"])
    params = [
        SamplingParams(**settings, seed=seed, structured_outputs=CONSTRAINTS[1])
        for seed in range(len(PROMPTS))
    ]

    def ends(outputs) -> list[tuple]:
        completions = [completion for output in outputs for completion in output.outputs]
        return [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in completions]

    decode = several.engine.stats.decode
    passes, plans = decode.forward_passes, decode.steps
    expected = ends(one_step.generate(PROMPTS, params, use_tqdm=False))
    assert ends(several.generate(PROMPTS, params, use_tqdm=False)) == expected
    assert any(stop == "e" for *_, stop in expected)
    assert decode.forward_passes - passes > decode.steps - plans
    assert_idle(several)


def test_a_plan_dropped_in_flight_leaves_the_next_requests_as_at_one_step(llms):
    """`reset_prefix_cache` drops the plan a `generate` left in flight (its tokens change
    nothing); the mailbox is done with it before the next requests' plans start."""
    one_step, several = llms
    params = [
        SamplingParams(temperature=1.0, max_tokens=40, seed=seed, structured_outputs=CONSTRAINTS[0])
        for seed in range(len(PROMPTS))
    ]
    several.generate(PROMPTS, params, use_tqdm=False)
    assert several.reset_prefix_cache()
    assert_as_one_step(one_step, several, params)


@pytest.mark.parametrize("kind", ["host", pytest.param("device", marks=pytest.mark.gpu)])
def test_each_mailbox_program_runs_on_padding_before_a_plan(text_model, kind):
    """Compiled at a first constrained plan of several steps, every mailbox program runs once on
    padding (a plan of no sequences) before that plan runs."""
    from jaxllm import LLM

    settings = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256)
    settings |= dict(kvcache_block_size=16, num_kvcache_blocks=64, compile_at_startup=False)
    with gpu_kernel_settings(mailbox=kind):
        llm = LLM(text_model, num_scheduler_steps=4, **settings)
    runner, runs = llm.engine.runner, []
    run_steps = runner._run_steps
    with mock.patch.object(runner, "_run_steps", autospec=True) as spy:
        spy.side_effect = lambda *args: runs.append((*args[:2], args[-1])) or run_steps(*args)
        params = SamplingParams(max_tokens=20, structured_outputs=CONSTRAINTS[1])
        llm.generate(PROMPTS, params, use_tqdm=False)
    compiled = {(bucket, mode) for bucket, mode, mailbox in runner._multi_step_executables}
    first = next(i for i, (*_, stepwise) in enumerate(runs) if stepwise._plan.seqs)
    assert sorted([(bucket, mode) for bucket, mode, _ in runs[:first]], key=str) == sorted(
        compiled, key=str
    )
    assert_idle(llm)
