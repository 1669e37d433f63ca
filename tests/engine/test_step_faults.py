"""On the default model: a runner that raises on every step holding one request.

The engine takes the failed steps back, ends that request with the runner's
error and serves the others; the KV that the failed steps wrote (made
garbage here, as a forward that died half way leaves it) is never read
again: the same prompts afterwards, hitting the prefix cache, give the
tokens a clean engine gives (core/sched/step_faults.py).
"""

from __future__ import annotations

import pytest

from cadence import LLM, SamplingParams
from cadence.core.testing import all_blocks_free

SYSTEM = "You are a careful assistant. Answer in one short sentence, and never use lists. "
PROMPTS = [SYSTEM + p for p in ("The capital of France is", "Name a prime number.",
                                "What colour is the sky?", "Say hello in Spanish.")]
POISON_SEED = 4242  # the request the runner fails on


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def failing_on_poison(runner):
    """``runner.execute_model`` that runs the step, writes garbage where it
    wrote, and raises, whenever the poisoned request is in the step."""
    real, poisoned = runner.execute_model, set()
    block_size = runner.block_size

    def execute_model(scheduler_output):
        poisoned.update(new.req_id for new in scheduler_output.scheduled_new_reqs
                        if new.sampling_params.seed == POISON_SEED)
        output = real(scheduler_output)
        if not poisoned & scheduler_output.num_scheduled_tokens.keys():
            return output
        written = [block for new in scheduler_output.scheduled_new_reqs
                   for block in new.block_ids[new.num_computed_tokens // block_size:]]
        written += [block for ids in scheduler_output.scheduled_cached_reqs.new_block_ids for block in ids]
        runner.kv_cache.data[:, :, written] = 3.0
        raise RuntimeError("a kernel fell over")

    return execute_model


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_request_that_fails_every_step_ends_alone_and_the_cache_stays_right(monkeypatch, async_scheduling):
    llm = LLM(dtype="float32", max_num_seqs=8, kv_cache_memory="64MiB", max_model_len=512,
              async_scheduling=async_scheduling)
    params = SamplingParams(temperature=0, max_tokens=10)
    clean = llm.generate(PROMPTS, params, use_tqdm=False)
    core = llm.engine.core
    assert core.reset_prefix_cache()
    monkeypatch.setattr(core.runner, "execute_model", failing_on_poison(core.runner))
    poison = SamplingParams(temperature=0, max_tokens=10, seed=POISON_SEED)
    with pytest.raises(RuntimeError, match=r"request \S+: the model runner failed on this request: "
                                         r"RuntimeError: a kernel fell over"):
        llm.generate(PROMPTS + [SYSTEM + "Count to three."], [params] * 4 + [poison], use_tqdm=False)
    assert core.num_failed_steps >= 2 and not core.scheduler.suspects
    again = llm.generate(PROMPTS, params, use_tqdm=False)  # prefix hits on what those steps cached
    assert token_ids(again) == token_ids(clean)
    assert all_blocks_free(core.scheduler)


def test_a_request_a_failed_step_ended_is_a_server_error_not_a_bad_request():
    """The engine process marks it (``RequestError.internal``); the front end
    raises ``RequestFailed`` for it, which the server answers with a 500."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from cadence.engine import wire
    from cadence.engine.async_llm import RequestFailed
    from cadence.server.errors import install_error_handlers

    kind, payload = wire.encode(wire.REQUEST_ERROR, wire.RequestError("r", "boom", internal=True))
    assert wire.decode(kind, payload).internal and not wire.RequestError("r", "bad field").internal
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/fails")
    async def fails():
        raise RequestFailed("request r: the model runner failed on this request: RuntimeError: boom")

    response = TestClient(app, raise_server_exceptions=False).get("/fails")
    assert response.status_code == 500
    assert "the model runner failed on this request" in response.json()["error"]["message"]


def failing_once_after(runner, num_steps: int):
    """``runner.execute_model`` that runs every step, and raises after the
    ``num_steps``-th (when its requests have sampled) once."""
    real, count = runner.execute_model, [0]

    def execute_model(scheduler_output):
        output = real(scheduler_output)
        count[0] += 1
        if count[0] == num_steps:
            raise RuntimeError("a transient fault")
        return output

    return execute_model


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_seeded_streams_go_on_as_if_the_failed_step_never_ran(monkeypatch, async_scheduling):
    # The failed step drew from both seeded requests' generators before it
    # raised (and, async, the step in flight behind it drew again); taken
    # back and run again, each request's tokens are those of a clean run.
    # Batch-invariant: a request run again (recomputed, alone, beside others)
    # gets the same logits, so only its stream can change its tokens.
    llm = LLM(dtype="float32", max_num_seqs=8, kv_cache_memory="64MiB", max_model_len=512,
              async_scheduling=async_scheduling, batch_invariant="on")
    prompts = PROMPTS[:3]
    params = [SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, seed=seed, ignore_eos=True)
              for seed in (11, 12)]
    params.append(SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    clean = token_ids(llm.generate(prompts, params, use_tqdm=False))
    core = llm.engine.core
    assert core.reset_prefix_cache()
    monkeypatch.setattr(core.runner, "execute_model", failing_once_after(core.runner, 6))
    again = token_ids(llm.generate(prompts, params, use_tqdm=False))
    assert core.num_failed_steps == 1
    assert again == clean
    assert all_blocks_free(core.scheduler)
