"""Pooling (embedding) requests in the scheduler (issue 35 item 6), driven with
hand-built runner outputs: such a request samples nothing, finishes in the step
its prompt's last token is computed (the step whose output carries its pooled
state), frees its blocks (full ones stay cached), never gets an async
placeholder, takes prefix-cache hits only for last-token pooling and always
computes its last token."""

from cadence.core.outputs import ModelRunnerOutput
from cadence.core.request import FinishReason
from cadence.sampling_params import PoolingParams
from tests.core.fakes import all_blocks_free, flatten, new_request, new_scheduler, prompt_of

VECTOR = [0.6, 0.8]


def pooling_request(req_id, prompt, pooling_type="last"):
    return new_request(req_id, prompt, max_tokens=None, pooling=PoolingParams(type=pooling_type))


def runner_output(so, requests):
    """What a runner answers: nothing sampled for pooling requests, their vector
    in the step that reaches their prompt's end; one token for the others."""
    req_ids = list(so.num_scheduled_tokens)
    sampled, pooled = [], []
    for req_id in req_ids:
        request = requests[req_id]
        ends = request.num_computed_tokens >= request.num_tokens  # counted when scheduled
        pooled.append(VECTOR if request.is_pooling and ends else None)
        sampled.append([7] if ends and not request.is_pooling else [])
    return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled,
                             pooler_output=pooled)


def run_step(scheduler):
    so = scheduler.schedule()
    requests = dict(scheduler.requests)
    return so, flatten(scheduler.update_from_output(so, runner_output(so, requests)))


def test_finishes_with_its_prompt_over_chunks():
    s = new_scheduler(max_num_batched_tokens=4, block_size=4, enable_prefix_caching=True)
    s.add_request(pooling_request("e", 10))
    s.add_request(new_request("g", 3, max_tokens=3))
    outputs = []
    for _ in range(3):
        so, step_outputs = run_step(s)
        outputs += [o for o in step_outputs if o.request_id == "e"]
    assert [o.pooled for o in outputs] == [VECTOR]  # only with the last chunk
    (done,) = outputs
    assert done.new_token_ids == [] and done.finish_reason == FinishReason.STOP
    assert s.get_request("e") is None
    while s.has_requests():
        run_step(s)
    assert all_blocks_free(s)
    assert s.kv_cache_manager.num_cached_prefix_tokens(pooling_request("again", prompt_of("e", 10))) == 8


def test_no_async_placeholder_and_no_step_after_its_prompt():
    s = new_scheduler(max_num_batched_tokens=16, async_scheduling=True)
    s.add_request(pooling_request("e", 6))
    first = s.schedule()
    assert first.num_scheduled_tokens == {"e": 6}
    assert s.get_request("e").num_output_placeholders == 0
    second = s.schedule()  # scheduled while the first step is in flight
    assert "e" not in second.num_scheduled_tokens
    requests = {"e": s.get_request("e")}
    out = flatten(s.update_from_output(first, runner_output(first, requests)))
    assert out[0].pooled == VECTOR and s.get_request("e") is None


def test_prefix_cache_hits_only_for_last_token_pooling():
    s = new_scheduler(block_size=4, enable_prefix_caching=True)
    prompt = prompt_of("p", 12)  # three full blocks
    s.add_request(new_request("g", prompt, max_tokens=1))
    while s.has_requests():
        run_step(s)
    s.add_request(pooling_request("last", prompt))
    s.add_request(pooling_request("mean", prompt, "mean"))
    so = s.schedule()
    # A full hit but for the last block: its last token is computed again.
    assert so.num_scheduled_tokens == {"last": 4, "mean": 12}


def test_mixed_with_generation_the_kv_reads_stay_right():
    """Pooling (last and mean) and generation over shared prefixes, chunked, with
    prefix hits and preemptions (few blocks): the fake runner's shadow KV checks
    every read, pooled requests finish once with their state, the others'
    streams are what they are alone, and every block comes back."""
    from cadence.core.testing import greedy_stream
    from tests.core.fakes import FakeRunner, run_until_done

    s = new_scheduler(max_num_batched_tokens=12, block_size=4, num_gpu_blocks=9,
                      enable_prefix_caching=True)
    shared = prompt_of("shared", 9)
    prompts = {}
    for i in range(12):
        req_id = f"r{i}"
        prompts[req_id] = shared + prompt_of(req_id, 3 + i % 5)
        if i % 3 == 0:
            s.add_request(new_request(req_id, prompts[req_id], max_tokens=10))
        else:
            s.add_request(pooling_request(req_id, prompts[req_id], "last" if i % 3 == 1 else "mean"))
    outputs = run_until_done(s, FakeRunner(block_size=4, check_kv=True))
    for req_id, prompt in prompts.items():
        outs = outputs[req_id]
        if int(req_id[1:]) % 3 == 0:
            tokens = [t for o in outs for t in o.new_token_ids]
            assert tokens == greedy_stream(prompt, 10, req_id=req_id)
        else:
            assert [o.pooled for o in outs if o.pooled is not None] == [[float(len(prompt))]]
            assert outs[-1].finish_reason == FinishReason.STOP
    assert s.num_preemptions_total > 0 and all_blocks_free(s)
