"""What a step reads from the KV cache: the shadow-cache oracle of ``FakeRunner``.

A prefix-cache hit must hold KV that some step handed to the runner wrote.
The exact scenario of issue 30: a priority request displaces a running one
in the very step that allocated (and, before the fix, registered in the
prefix cache) blocks for its next prefill chunk; the displaced request later
found those never-written blocks as hits.
"""

import pytest

from cadence.core.request import RequestStatus
from cadence.core.testing import (
    FakeRunner,
    KVContentError,
    ShadowKV,
    greedy_stream,
    new_request,
    new_scheduler,
    step,
    token_streams,
    run_until_done,
)


def _displacement_scheduler():
    return new_scheduler(
        policy="priority", max_num_seqs=1, enable_prefix_caching=True, block_size=4,
        max_num_batched_tokens=16, long_prefill_token_threshold=16, num_gpu_blocks=64,
        max_model_len=256,
    )


def test_displaced_request_never_hits_blocks_its_taken_back_step_allocated():
    s = _displacement_scheduler()
    runner = FakeRunner(block_size=4, check_kv=True)
    a = new_request("a", 31, max_tokens=4, priority=1, ignore_eos=True)
    s.add_request(a)
    so, _ = step(s, runner)  # positions 0-15 of A
    assert so.num_scheduled_tokens == {"a": 16}
    s.add_request(new_request("b", 30, max_tokens=30, priority=0, ignore_eos=True))
    so, _ = step(s, runner)  # A's next chunk is allocated, then B displaces A
    assert so.num_scheduled_tokens == {"b": 16} and so.preempted_req_ids == {"a"}
    # Nothing of the taken-back chunk (positions 16-27) may be a cache hit.
    hits, num_hit_tokens = s.kv_cache_manager.get_computed_blocks(a)
    assert num_hit_tokens == 16
    resumed_at = []

    def on_step(so):
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id == "a" and cached.resumed_from_preemption[i]:
                resumed_at.append(cached.num_computed_tokens[i])

    outputs = token_streams(run_until_done(s, runner, on_step=on_step))
    assert outputs["a"] == greedy_stream(a.prompt_token_ids, 4)
    assert resumed_at == [16]  # what A computed before it was displaced, no more
    assert runner.shadow_kv.num_reads_checked > 0


def test_preemption_inside_one_schedule_call_registers_nothing_unwritten():
    # Two running requests; the second needs a block, none is free: the first
    # (scheduled earlier in the same call, with a freshly allocated block) is
    # the victim. Its new block must not enter the prefix cache.
    s = new_scheduler(max_num_seqs=4, block_size=4, num_gpu_blocks=9, max_num_batched_tokens=64,
                      enable_prefix_caching=True)
    runner = FakeRunner(block_size=4, check_kv=True)
    s.add_request(new_request("x", 15, max_tokens=20, ignore_eos=True))
    s.add_request(new_request("y", 15, max_tokens=20, ignore_eos=True))
    preempted = []
    outputs = run_until_done(s, runner, on_step=lambda so: preempted.extend(so.preempted_req_ids))
    assert preempted, "the workload must preempt"
    for req_id in ("x", "y"):
        prompt = new_request(req_id, 15).prompt_token_ids
        assert token_streams(outputs)[req_id] == greedy_stream(prompt, 20)


def test_oracle_catches_a_block_that_no_step_wrote():
    shadow = ShadowKV(block_size=4)
    shadow.write([3, 5], [10, 11, 12, 13, 14, 15], 0, 4)  # positions 0-3 in block 3
    shadow.check_reads("r", [3, 5], [10, 11, 12, 13, 14, 15], 4)
    with pytest.raises(KVContentError, match="block 5 offset 0, which holds nothing written"):
        shadow.check_reads("r", [3, 5], [10, 11, 12, 13, 14, 15], 6)
    shadow.write([7], [99, 98, 97, 96], 0, 4)
    with pytest.raises(KVContentError, match="holds token 99, not token 10"):
        shadow.check_reads("q", [7], [10, 11, 12, 13], 4)


def test_aborted_request_in_flight_leaves_only_written_blocks_cached():
    # Async scheduling: a request aborted while a step that writes its blocks is
    # in flight. Those blocks were handed to the runner, so they may be hits.
    s = new_scheduler(block_size=4, num_gpu_blocks=64, max_num_batched_tokens=8,
                      enable_prefix_caching=True, async_scheduling=True)
    runner = FakeRunner(block_size=4, check_kv=True)
    prompt = list(range(1000, 1024))
    s.add_request(new_request("a", prompt, max_tokens=4, ignore_eos=True))
    first = s.schedule()
    in_flight = (first, runner.execute(first))
    second = s.schedule()
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    s.update_from_output(*in_flight)
    s.update_from_output(second, runner.execute(second))
    s.add_request(new_request("b", prompt, max_tokens=4, ignore_eos=True))
    outputs = token_streams(run_until_done(s, runner))
    assert outputs["b"] == greedy_stream(prompt, 4)
