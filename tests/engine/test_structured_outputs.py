"""Structured outputs through ``LLM`` on the default model: the grammar holds
for greedy and sampled rows, with n > 1 and under speculative decoding (which
must not change a greedy answer); a grammar that cannot compile is refused
before anything runs, or, if it reaches the engine, ends its own request only.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from cadence import LLM, SamplingParams
from cadence.core.testing import all_blocks_free
from cadence.engine.inputs import make_request
from tests.engine.preemptions import record_preemptions

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 30},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "genre": {"enum": ["drama", "comedy", "horror"]},
        "cast": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    },
    "required": ["title", "year", "genre", "cast"],
}
# The answer repeats the prompt's JSON: n-gram drafts match, so speculation runs.
ECHO_PROMPT = ('Copy this JSON exactly: {"title": "Blue Moon", "year": 1999, "genre": "drama", '
               '"cast": ["Ann", "Bob"]}\nCopy: ')


def engine(**options) -> LLM:
    return LLM(**{"dtype": "float32", "max_num_seqs": 16, "kv_cache_memory": "128MiB",
                  "max_model_len": 512, **options})


@pytest.fixture(scope="module")
def llm():
    return engine()


@pytest.fixture(scope="module")
def spec_llms():
    """(plain, speculative) engines per backend."""
    return {backend: (engine(structured_outputs_backend=backend),
                      engine(structured_outputs_backend=backend, num_speculative_tokens=3))
            for backend in ("llguidance", "xgrammar")}


def params(**kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 120,
                             "structured_outputs": {"json": SCHEMA}, **kwargs})


def test_greedy_and_sampled_rows_follow_the_schema(llm):
    prompts = [f"Describe movie number {i} as JSON." for i in range(4)]
    outputs = llm.generate(prompts, params(), use_tqdm=False)
    outputs += llm.generate(prompts, params(temperature=1.0, seed=3, n=3), use_tqdm=False)
    texts = [c.text for o in outputs for c in o.outputs]
    assert len(texts) == 4 + 4 * 3
    for output in outputs:
        for completion in output.outputs:
            assert completion.finish_reason == "stop", completion.text
            jsonschema.validate(json.loads(completion.text), SCHEMA)
    assert len(set(texts)) > 4  # the sampled rows differ


def test_structured_and_plain_requests_share_a_batch(llm):
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    before = llm.generate(["Once upon a time"], plain, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate(["Once upon a time", "Describe a movie as JSON."],
                         [plain, params()], use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == before  # the mask touched only its own row
    jsonschema.validate(json.loads(mixed[1].outputs[0].text), SCHEMA)


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_speculation_keeps_the_greedy_structured_answer(spec_llms, backend):
    plain, speculative = spec_llms[backend]
    scheduled = []
    execute = speculative.engine.core.runner.execute_model

    def spy(scheduler_output):
        if scheduler_output.scheduled_spec_decode_tokens and scheduler_output.grammar_bitmask is not None:
            scheduled.append((dict(scheduler_output.scheduled_spec_decode_tokens),
                              len(scheduler_output.grammar_bitmask)))
        return execute(scheduler_output)

    speculative.engine.core.runner.execute_model = spy
    try:
        expected = plain.generate([ECHO_PROMPT], params(), use_tqdm=False)[0].outputs[0]
        got = speculative.generate([ECHO_PROMPT], params(), use_tqdm=False)[0].outputs[0]
    finally:
        speculative.engine.core.runner.execute_model = execute
    assert got.token_ids == expected.token_ids
    jsonschema.validate(json.loads(got.text), SCHEMA)
    # Drafts ran with the grammar: one mask row per draft plus one.
    assert scheduled
    for drafts, num_rows in scheduled:
        assert num_rows == sum(1 + len(d) for d in drafts.values())


def test_a_bad_grammar_is_refused_before_anything_runs(llm):
    with pytest.raises(ValueError, match=r"^structured_outputs\.regex: "):
        llm.generate(["Hi", "Hello"], [SamplingParams(max_tokens=4),
                                       params(structured_outputs={"regex": "[a-"})], use_tqdm=False)
    assert not llm.engine.core.has_work()
    assert llm.generate(["Hi"], SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].text


def chain(num_rules: int) -> str:
    """Issue 30's grammar: ``start: r0``, ``r0: "x0" | r1``, ... (from ~3,000 rules
    it overflows llguidance's stack)."""
    rules = [f'r{i}: "x{i}" | r{i + 1}' for i in range(num_rules - 1)]
    return "\n".join(["start: r0", *rules, f'r{num_rules - 1}: "x{num_rules - 1}"'])


def assert_still_generates(llm: LLM) -> None:
    assert llm.generate(["Hi"], SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].text
    answer = llm.generate(["Yes or no?"], params(structured_outputs={"choice": ["yes", "no"]}),
                          use_tqdm=False)[0].outputs[0]
    assert answer.text in ("yes", "no")


@pytest.mark.parametrize("constraint, words", [
    ({"choice": [f"item {i}" for i in range(20_001)]},
     r"^structured_outputs\.choice: 20001 strings, .*--structured-outputs-max-choices"),
    ({"grammar": chain(2_500)}, r"^structured_outputs\.grammar: 2501 rules, .*--structured-outputs-max-rules"),
    ({"regex": r"[^\s\S]"}, r"^structured_outputs\.regex: no output satisfies"),
    ({"json": {"$defs": {"a": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}},
                               "required": ["a"]}}, "$ref": "#/$defs/a"}}, r"^structured_outputs\.json: "),
])
def test_offline_constraints_get_the_servers_limits_and_checks(llm, constraint, words):
    """The same limits (EngineConfig's structured_outputs_* options) and the same
    check in a worker process as a server's; nothing runs, and LLM goes on."""
    with pytest.raises(ValueError, match=words):
        llm.generate(["Hi", "Hello"], [SamplingParams(max_tokens=4), params(structured_outputs=constraint)],
                     use_tqdm=False)
    assert not llm.engine.core.has_work()
    assert_still_generates(llm)


def test_a_grammar_that_crashes_the_grammar_library_is_a_value_error_offline():
    """A crash (SIGSEGV) in the grammar library ends the checker's worker, not
    this process: one ValueError, and the next constraint gets a new worker."""
    llm = engine(structured_outputs_max_rules=6000)
    with pytest.raises(ValueError, match=r"^structured_outputs\.grammar: the grammar could not be "
                                         r"compiled: the grammar library crashed"):
        llm.generate(["Hi"], params(structured_outputs={"grammar": chain(5000)}), use_tqdm=False)
    assert_still_generates(llm)
    assert llm._grammars.num_worker_starts == 2


def test_a_grammar_failing_in_the_engine_ends_only_its_request(llm):
    """A grammar the front end did not check (sent to the core directly) fails
    to compile in the engine: its request ends with the error; the others run."""
    core, tokenizer = llm.engine.core, llm.tokenizer
    bad = make_request("bad", tokenizer.encode("Hi"), params(structured_outputs={"regex": "[a-"}),
                       tokenizer, 512)
    good = make_request("good", tokenizer.encode("Hi"), SamplingParams(max_tokens=5, ignore_eos=True),
                        tokenizer, 512)
    core.add_request(bad)
    core.add_request(good)
    finished = {}
    for _ in range(50):
        for outputs in core.step().values():
            for output in outputs.outputs:
                if output.finish_reason is not None:
                    finished[output.request_id] = output
        if len(finished) == 2:
            break
    assert finished["bad"].finish_reason.name == "ABORT"
    assert finished["bad"].stop_reason.startswith("structured_outputs.regex: ")
    assert finished["good"].finish_reason.name == "LENGTH"
    while core.has_work():
        core.step()
    assert all_blocks_free(core.scheduler)


def test_the_grammar_end_wins_over_min_tokens(spec_llms):
    """The grammar allows only EOS after "yes", and min_tokens forbids EOS: the
    request ends with "yes" rather than sampling from an empty distribution."""
    for plain, _ in spec_llms.values():
        output = plain.generate(["Answer:"], SamplingParams(
            temperature=0, max_tokens=10, min_tokens=5, structured_outputs={"choice": ["yes"]}),
            use_tqdm=False)[0].outputs[0]
        assert output.text == "yes"
        assert output.finish_reason == "stop"


def test_preempted_structured_requests_resume_their_grammar(llm):
    """A KV cache too small for the batch preempts requests mid-answer; each
    resumes where its grammar stood and answers as it does alone."""
    small = engine(num_gpu_blocks=14, kv_cache_memory=None, max_num_seqs=8)
    # ~45 tokens each, no shared prefix: 3 blocks a prompt, and the answers grow.
    prompts = [f"Request {i}. " + "Please describe a movie as JSON with a title, year, genre "
               "and cast. " * 3 for i in range(6)]
    alone = [llm.generate([p], params(), use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    preemptions = record_preemptions(small)
    together = small.generate(prompts, params(), use_tqdm=False)
    assert preemptions  # the cache did run out
    for output, want in zip(together, alone):
        assert output.outputs[0].token_ids == want
        jsonschema.validate(json.loads(output.outputs[0].text), SCHEMA)
