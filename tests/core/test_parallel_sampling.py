"""Parallel sampling (n > 1): the parent computes the prompt's leading full
blocks once, then forks into children "{i}_{parent}" that share those blocks
and each compute the short tail themselves."""

import zlib

import pytest
from tests.core.fakes import (
    FakeRunner,
    all_blocks_free,
    greedy_token,
    new_request,
    new_scheduler,
    prompt_of,
    ref_counts,
    run_pipelined,
    run_until_done,
    step,
)

from cadence.core.request import FinishReason, RequestStatus

CHILDREN = ["0_p", "1_p", "2_p"]


def per_child_token(req_id, tokens):
    """Children sample differently (as with temperature > 0)."""
    return greedy_token(req_id, tokens) + zlib.crc32(req_id.encode()) % 50


def test_parent_computes_the_leading_full_blocks_once():
    s = new_scheduler()
    s.add_request(new_request("p", 10, max_tokens=3, n=3))
    assert list(s.requests) == ["p"]
    so, outputs = step(s, FakeRunner())
    # 10 tokens, block 4: fork point 8 (two full blocks); the tail 8..9 is each child's.
    assert so.num_scheduled_tokens == {"p": 8}
    [new] = so.scheduled_new_reqs
    assert new.block_ids == [0, 1]
    assert outputs == []  # the parent never samples
    assert "p" not in s.requests
    # Children that fit under max_num_seqs run at once (never waiting while holding blocks).
    assert [r.request_id for r in s.running] == CHILDREN and len(s.waiting) == 0
    for child_id in CHILDREN:
        child = s.requests[child_id]
        assert child.status == RequestStatus.RUNNING
        assert child.num_computed_tokens == 8
        assert child.parent_request_id == "p"
        assert s.kv_cache_manager.get_block_ids(child_id) == [0, 1]
    assert ref_counts(s, [0, 1]) == [3, 3]  # the parent's reference went with it
    s.kv_cache_manager.check_consistency()


def test_children_beyond_max_num_seqs_wait_without_blocks():
    s = new_scheduler(max_num_seqs=2)
    s.add_request(new_request("p", 10, max_tokens=3, n=3))
    step(s, FakeRunner())
    assert [r.request_id for r in s.running] == ["0_p", "1_p"]
    assert [r.request_id for r in s.waiting] == ["2_p"]
    assert s.kv_cache_manager.get_block_ids("2_p") == [] and s.requests["2_p"].num_computed_tokens == 0
    assert ref_counts(s, [0, 1]) == [2, 2]
    run_until_done(s, FakeRunner())
    assert all_blocks_free(s)


def test_children_share_the_prompt_blocks_and_compute_their_own_tail():
    s = new_scheduler()
    s.add_request(new_request("p", 10, max_tokens=3, n=3, seed=7))
    runner = FakeRunner(per_child_token)
    step(s, runner)
    so, outputs = step(s, runner)
    assert so.finished_req_ids == {"p"}  # the runner drops the parent
    assert so.num_scheduled_tokens == {c: 2 for c in CHILDREN}
    new = {n.req_id: n for n in so.scheduled_new_reqs}
    assert list(new) == CHILDREN
    assert [new[c].block_ids for c in CHILDREN] == [[0, 1, 2], [0, 1, 3], [0, 1, 4]]
    assert all(new[c].num_computed_tokens == 8 for c in CHILDREN)
    assert all(new[c].parent_request_id == "p" for c in CHILDREN)
    assert [new[c].sampling_params.n for c in CHILDREN] == [1, 1, 1]
    assert [new[c].sampling_params.seed for c in CHILDREN] == [7, 8, 9]
    assert ref_counts(s, [0, 1, 2, 3, 4]) == [3, 3, 1, 1, 1]
    assert [(o.request_id, o.parent_request_id) for o in outputs] == [(c, "p") for c in CHILDREN]
    assert len({o.new_token_ids[0] for o in outputs}) == 3


def test_children_run_to_completion_and_free_every_block():
    s = new_scheduler()
    prompt = prompt_of("p", 10)
    s.add_request(new_request("p", prompt, max_tokens=4, n=3))
    outputs = run_until_done(s, FakeRunner(per_child_token))
    assert sorted(outputs) == CHILDREN
    for child_id, outs in outputs.items():
        tokens = list(prompt)
        for _ in range(4):
            tokens.append(per_child_token(child_id, tokens))
        assert [t for o in outs for t in o.new_token_ids] == tokens[10:]
        assert outs[-1].finish_reason == FinishReason.LENGTH
        assert all(o.parent_request_id == "p" for o in outs)
    assert all_blocks_free(s)
    assert s.forks.expand(["p"]) == ["p"]  # no live children left


def test_aborting_the_parent_id_aborts_the_children():
    s = new_scheduler()
    s.add_request(new_request("p", 10, max_tokens=5, n=3))
    runner = FakeRunner()
    step(s, runner)
    step(s, runner)  # children running
    children = [s.requests[c] for c in CHILDREN]
    s.finish_requests("p", RequestStatus.FINISHED_ABORTED)
    assert [c.status for c in children] == [RequestStatus.FINISHED_ABORTED] * 3
    assert not s.has_unfinished_requests()
    so, _ = step(s, runner)
    assert so.finished_req_ids == set(CHILDREN)
    assert all_blocks_free(s)


def test_cancel_request_of_the_parent_cancels_waiting_children():
    s = new_scheduler()
    s.add_request(new_request("p", 10, max_tokens=5, n=3))
    runner = FakeRunner()
    step(s, runner)  # forked: children wait, holding the shared blocks
    children = [s.requests[c] for c in CHILDREN]
    s.cancel_request("p")
    so, _ = step(s, runner)
    assert so.num_scheduled_tokens == {}
    assert [c.status for c in children] == [RequestStatus.FINISHED_ABORTED] * 3
    assert all_blocks_free(s)


def test_abort_before_the_fork_aborts_the_parent():
    s = new_scheduler(max_num_batched_tokens=4)
    s.add_request(new_request("p", 10, max_tokens=5, n=2))
    runner = FakeRunner()
    step(s, runner)  # 4 of the 8 tokens before the fork point
    parent = s.requests["p"]
    s.finish_requests("p", RequestStatus.FINISHED_ABORTED)
    assert parent.status == RequestStatus.FINISHED_ABORTED
    so, _ = step(s, runner)
    assert so.num_scheduled_tokens == {}
    assert set(s.requests) == set()
    assert all_blocks_free(s)


def test_a_finished_child_leaves_its_siblings_running():
    s = new_scheduler()
    s.add_request(new_request("p", 10, max_tokens=6, n=3, stop_token_ids=[999]))
    runner = FakeRunner(lambda rid, toks: 999 if rid == "1_p" else greedy_token(rid, toks))
    step(s, runner)
    _, outputs = step(s, runner)
    assert {o.request_id: o.finish_reason for o in outputs} == {
        "0_p": None, "1_p": FinishReason.STOP, "2_p": None,
    }
    assert ref_counts(s, [0, 1]) == [2, 2]
    s.finish_requests("p", RequestStatus.FINISHED_ABORTED)
    assert s.requests == {}
    assert all_blocks_free(s)


@pytest.mark.parametrize("length, forks_at_once", [(1, True), (4, True), (5, False)])
def test_short_prompts_fork_at_once(length, forks_at_once):
    s = new_scheduler()
    s.add_request(new_request("p", length, max_tokens=2, n=2))
    runner = FakeRunner()
    so, outputs = step(s, runner)
    if forks_at_once:
        # Nothing to share: the children are the requests from the start.
        assert so.num_scheduled_tokens == {"0_p": length, "1_p": length}
        assert [o.parent_request_id for o in outputs] == ["p", "p"]
    else:
        assert so.num_scheduled_tokens == {"p": 4}
        assert outputs == []
    outputs = run_until_done(s, runner)
    assert sorted(outputs) == ["0_p", "1_p"]
    assert all_blocks_free(s)


def test_short_prompt_children_are_aborted_by_the_parent_id():
    s = new_scheduler()
    s.add_request(new_request("p", 3, max_tokens=5, n=2))
    assert sorted(s.requests) == ["0_p", "1_p"]
    s.finish_requests("p", RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished_requests()


def test_parent_keeps_computing_something_after_a_prefix_hit():
    s = new_scheduler()
    prompt = prompt_of("p", 10)
    runner = FakeRunner()
    s.add_request(new_request("warm", prompt, max_tokens=1))
    run_until_done(s, runner)  # both full blocks of the prompt are cached
    s.add_request(new_request("p", prompt, max_tokens=2, n=2))
    so, _ = step(s, runner)
    assert so.num_scheduled_tokens == {"p": 4}  # one block hit; the parent computes 4..8
    assert so.scheduled_new_reqs[0].num_computed_tokens == 4
    so, _ = step(s, runner)
    assert so.num_scheduled_tokens == {"0_p": 2, "1_p": 2}
    assert all(s.requests[c].num_cached_tokens == 4 for c in ("0_p", "1_p"))


def two_families(s):
    s.add_request(new_request("p", prompt_of("p", 13), max_tokens=6, n=3))
    s.add_request(new_request("q", prompt_of("q", 6), max_tokens=8, n=2))


def streams(outputs):
    return {r: [t for o in outs for t in o.new_token_ids] for r, outs in outputs.items()}


def test_outputs_survive_preemption_and_async_scheduling():
    roomy = new_scheduler(num_gpu_blocks=64)
    two_families(roomy)
    expected = streams(run_until_done(roomy, FakeRunner(per_child_token)))
    assert sorted(expected) == ["0_p", "0_q", "1_p", "1_q", "2_p"]
    assert {r: len(t) for r, t in expected.items()} == {"0_p": 6, "1_p": 6, "2_p": 6, "0_q": 8, "1_q": 8}

    tight = new_scheduler(num_gpu_blocks=8)
    two_families(tight)
    preempted = []
    got = run_until_done(
        tight, FakeRunner(per_child_token), on_step=lambda so: preempted.extend(so.preempted_req_ids)
    )
    assert preempted != []
    assert streams(got) == expected
    assert all_blocks_free(tight)

    pipelined = new_scheduler(num_gpu_blocks=64, async_scheduling=True)
    two_families(pipelined)
    assert streams(run_pipelined(pipelined, FakeRunner(per_child_token))) == expected
    assert all_blocks_free(pipelined)


@pytest.mark.parametrize("num_blocks, prefix_caching", [(6, True), (7, False)])
def test_tight_pool_finishes_like_separate_requests(num_blocks, prefix_caching):
    # Each child alone needs at most 5 blocks.
    separate = new_scheduler(num_gpu_blocks=num_blocks, enable_prefix_caching=prefix_caching)
    for i in range(3):
        separate.add_request(new_request(f"{i}_p", prompt_of("p", 13), max_tokens=6))
    for i in range(2):
        separate.add_request(new_request(f"{i}_q", prompt_of("q", 6), max_tokens=8))
    expected = streams(run_until_done(separate, FakeRunner(per_child_token)))

    forked = new_scheduler(num_gpu_blocks=num_blocks, enable_prefix_caching=prefix_caching)
    two_families(forked)
    assert streams(run_until_done(forked, FakeRunner(per_child_token), max_steps=300)) == expected
    assert all_blocks_free(forked)


def test_a_child_preempted_in_the_step_that_first_sends_it_starts_as_new():
    # Priority policy: the worst request is a child of "r2", scheduled (and so
    # first sent) earlier in the same step in which a better request needs its
    # blocks. The runner never saw it, so it must come back as a new request,
    # never as "resumed" (a real runner has no state for it).
    s = new_scheduler(num_gpu_blocks=6, max_num_batched_tokens=16, block_size=4,
                      enable_prefix_caching=True, policy="priority")
    s.add_request(new_request("r0", prompt_of("r0", 3), max_tokens=4, priority=0, arrival_time=0))
    s.add_request(new_request("r1", prompt_of("r1", 2), max_tokens=3, n=3, priority=0, arrival_time=1))
    s.add_request(new_request("r2", prompt_of("r2", 6), max_tokens=6, n=4, priority=2, arrival_time=2))
    streams = run_until_done(s, FakeRunner(), max_steps=300)  # the runner asserts it knows every request
    assert s.num_preemptions_total > 0
    assert set(streams) == {"r0", "0_r1", "1_r1", "2_r1", "0_r2", "1_r2", "2_r2", "3_r2"}
    assert all_blocks_free(s)
