"""Async scheduling on the default model: the engine schedules step N+1
while step N executes, and every request ends exactly where the synchronous
loop ends it (greedy tokens, stop strings, max_tokens, stop tokens, n > 1,
preemption, grammars, aborts mid-flight), with every block back at the end.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from cadence import LLM, SamplingParams
from cadence.core.request import RequestStatus
from cadence.core.testing import all_blocks_free
from cadence.engine.inputs import make_request
from tests.engine.preemptions import record_preemptions

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three prime numbers:",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "Translate to French: good morning",
]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"]}


def engine(**options) -> LLM:
    return LLM(**{"dtype": "float32", "max_num_seqs": 16, "kv_cache_memory": "128MiB",
                  "max_model_len": 512, **options})


@pytest.fixture(scope="module")
def engines():
    """(synchronous, async) engines."""
    return engine(), engine(async_scheduling=True)


def token_ids(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


def test_greedy_outputs_equal_the_synchronous_loop(engines):
    sync, overlapped = engines
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (1, 2, 7, 30, 45, 60)]
    want = sync.generate(PROMPTS, params, use_tqdm=False)
    got = overlapped.generate(PROMPTS, params, use_tqdm=False)
    assert token_ids(got) == token_ids(want)
    assert [len(o.outputs[0].token_ids) for o in got] == [1, 2, 7, 30, 45, 60]
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    assert overlapped.engine.core.async_scheduling
    assert all_blocks_free(overlapped.engine.core.scheduler)


def test_stops_end_where_the_synchronous_loop_ends(engines):
    sync, overlapped = engines
    free = sync.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    # A stop string and a stop token taken from each greedy answer's middle.
    params = []
    for output in free:
        ids, text = output.outputs[0].token_ids, output.outputs[0].text
        params.append(SamplingParams(temperature=0, max_tokens=40, stop=[text[len(text) // 2:][:3]]))
        params.append(SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[ids[len(ids) // 2]]))
        params.append(SamplingParams(temperature=0, max_tokens=40, min_tokens=5, repetition_penalty=1.3))
    prompts = [p for p in PROMPTS[:3] for _ in range(3)]
    want = sync.generate(prompts, params, use_tqdm=False)
    got = overlapped.generate(prompts, params, use_tqdm=False)
    assert token_ids(got) == token_ids(want)
    assert [(c.text, c.finish_reason, c.stop_reason) for o in got for c in o.outputs] == \
        [(c.text, c.finish_reason, c.stop_reason) for o in want for c in o.outputs]
    assert sum(c.finish_reason == "stop" for o in got for c in o.outputs) >= 6
    assert all_blocks_free(overlapped.engine.core.scheduler)


def test_logprobs_and_parallel_sampling_equal_the_synchronous_loop(engines):
    sync, overlapped = engines
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3, n=3)
    want, got = (e.generate(PROMPTS[:2], params, use_tqdm=False) for e in (sync, overlapped))
    assert token_ids(got) == token_ids(want)
    for o_got, o_want in zip(got, want):
        for c_got, c_want in zip(o_got.outputs, o_want.outputs):
            assert len(c_got.logprobs) == 12
            for row_got, row_want in zip(c_got.logprobs, c_want.logprobs):
                assert row_got.keys() == row_want.keys()
                for token in row_got:
                    assert row_got[token].logprob == pytest.approx(row_want[token].logprob, abs=1e-4)


def test_preempted_requests_answer_as_in_the_synchronous_loop(engines):
    sync, _ = engines
    small = engine(num_gpu_blocks=14, kv_cache_memory=None, max_num_seqs=8, async_scheduling=True)
    prompts = [f"Request {i}. " + "Tell me a long story about a dragon and a knight. " * 3 for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=40)
    preemptions = record_preemptions(small)
    got = small.generate(prompts, params, use_tqdm=False)
    assert preemptions  # the cache did run out
    assert token_ids(got) == token_ids(sync.generate(prompts, params, use_tqdm=False))
    assert all_blocks_free(small.engine.core.scheduler)


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_grammar_requests_wait_for_their_token_in_flight(engines, backend):
    sync = engines[0] if backend == "llguidance" else engine(structured_outputs_backend=backend)
    overlapped = engine(async_scheduling=True, structured_outputs_backend=backend)
    constrained = SamplingParams(temperature=0, max_tokens=60, structured_outputs={"json": SCHEMA})
    plain = SamplingParams(temperature=0, max_tokens=30)
    prompts = ["Describe a person as JSON.", "Count to ten:", "Give me a JSON person named Bob."]
    params = [constrained, plain, constrained]
    want = sync.generate(prompts, params, use_tqdm=False)
    got = overlapped.generate(prompts, params, use_tqdm=False)
    assert token_ids(got) == token_ids(want)
    for output in (got[0], got[2]):
        answer = json.loads(output.outputs[0].text)
        assert set(answer) == {"name", "age"}
    assert all_blocks_free(overlapped.engine.core.scheduler)


def test_abort_mid_flight_frees_blocks_and_spares_the_others(engines):
    sync, overlapped = engines
    core = overlapped.engine.core
    tokenizer = overlapped.tokenizer
    params = SamplingParams(temperature=0, max_tokens=25)
    requests = [make_request(f"abort-{i}", tokenizer.encode(p), params, tokenizer, 512)
                for i, p in enumerate(PROMPTS[:3])]
    for request in requests:
        core.add_request(request)
    outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
    num_steps = 0
    while core.has_work():
        for engine_outputs in core.step().values():
            for out in engine_outputs.outputs:
                outputs[out.request_id].extend(out.new_token_ids)
        num_steps += 1
        if num_steps == 5:
            assert len(core.in_flight) == 1  # step 6 runs while we abort
            core.abort_requests(["abort-1"])
            assert requests[1].status == RequestStatus.FINISHED_ABORTED
    assert 0 < len(outputs["abort-1"]) < 25
    want = sync.generate([PROMPTS[0], PROMPTS[2]], params, use_tqdm=False)
    assert [outputs["abort-0"], outputs["abort-2"]] == [o.outputs[0].token_ids for o in want]
    assert all_blocks_free(core.scheduler)
    assert not core.in_flight


def test_the_next_step_is_scheduled_while_one_executes(engines):
    """Order, not speed: a schedule() call starts and ends inside an
    execute_model call, which runs on another thread."""
    _, overlapped = engines
    core = overlapped.engine.core
    spans: dict[str, list[tuple[float, float, int]]] = {"schedule": [], "execute": []}
    schedule, execute = core.scheduler.schedule, core.runner.execute_model

    def timed(name, fn):
        def call(*args):
            start = time.perf_counter()
            result = fn(*args)
            spans[name].append((start, time.perf_counter(), threading.get_ident()))
            return result
        return call

    core.scheduler.schedule = timed("schedule", schedule)
    core.runner.execute_model = timed("execute", execute)
    try:
        overlapped.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    finally:
        del core.scheduler.schedule, core.runner.execute_model
    main = threading.get_ident()
    assert all(thread == main for *_, thread in spans["schedule"])
    assert all(thread != main for *_, thread in spans["execute"])
    inside = [s for s in spans["schedule"] if any(e[0] < s[0] and s[1] < e[1] for e in spans["execute"])]
    assert len(inside) >= len(spans["schedule"]) // 2


def test_async_scheduling_with_speculation_is_refused():
    with pytest.raises(ValueError, match="^async_scheduling: not supported with speculative"):
        engine(async_scheduling=True, num_speculative_tokens=2)
