"""Admission safety margin (transformers' FIFO scheduler): no new request is
admitted while fewer than a fraction of the KV blocks are free; running
requests keep decoding."""

from tests.core.fakes import (
    FakeRunner,
    InMemoryConnector,
    all_blocks_free,
    new_request,
    new_scheduler,
    prompt_of,
    run_until_done,
    step,
)

from cadence.core.outputs import KVConnectorOutput
from cadence.core.request import RequestStatus


def make(margin, **kwargs):
    kwargs.setdefault("enable_prefix_caching", False)
    return new_scheduler(admission_safety_margin=margin, num_gpu_blocks=10, **kwargs)


def test_no_new_request_under_the_margin_while_running_ones_decode():
    s = make(0.5)
    s.add_request(new_request("a", 21, max_tokens=6))  # 6 of 10 blocks: 4 free < 5
    s.add_request(new_request("b", 4, max_tokens=2))
    runner = FakeRunner()
    schedule = []
    for _ in range(8):
        so, _ = step(s, runner)
        schedule.append(dict(so.num_scheduled_tokens))
        if len(schedule) <= 5:
            assert s.requests["b"].status == RequestStatus.WAITING
    assert schedule == [
        {"a": 21}, {"a": 1}, {"a": 1}, {"a": 1}, {"a": 1}, {"a": 1},  # a decodes to the end
        {"b": 4}, {"b": 1},  # b enters once a's blocks are back
    ]
    assert all_blocks_free(s)


def test_margin_is_checked_again_before_each_admission():
    s = make(0.5)
    s.add_request(new_request("a", 16, max_tokens=2))  # 4 blocks: 6 free, still >= 5
    s.add_request(new_request("b", 8, max_tokens=2))  # 2 blocks: 4 free, under the margin
    s.add_request(new_request("c", 4, max_tokens=2))
    so, _ = step(s, FakeRunner())
    assert so.num_scheduled_tokens == {"a": 16, "b": 8}
    assert [r.request_id for r in s.waiting] == ["c"]


def test_exactly_at_the_margin_admits():
    s = make(0.4)
    s.add_request(new_request("a", 24, max_tokens=3))  # 6 blocks: 4 free == 0.4 * 10
    s.add_request(new_request("b", 4, max_tokens=3))
    so, _ = step(s, FakeRunner())
    assert so.num_scheduled_tokens == {"a": 24, "b": 4}


def test_margin_off_by_default():
    s = new_scheduler(num_gpu_blocks=10, enable_prefix_caching=False)
    assert s.config.admission_safety_margin == 0.0
    s.add_request(new_request("a", 21, max_tokens=6))
    s.add_request(new_request("b", 4, max_tokens=2))
    so, _ = step(s, FakeRunner())
    assert so.num_scheduled_tokens == {"a": 21, "b": 4}


def test_cached_free_blocks_count_as_free():
    s = make(0.5, enable_prefix_caching=True)
    runner = FakeRunner()
    s.add_request(new_request("a", 24, max_tokens=1))
    run_until_done(s, runner)
    # a's 6 blocks are cached-free: evictable, so they do not block admission.
    assert s.kv_cache_manager.num_free_blocks == 10
    s.add_request(new_request("b", 8, max_tokens=1))
    so, _ = step(s, runner)
    assert so.num_scheduled_tokens == {"b": 8}


def test_margin_avoids_the_preemptions_plain_fcfs_suffers():
    # Each request ends with 8 + 7 computed tokens = 4 blocks; 12 blocks hold three.
    def run(margin):
        s = new_scheduler(num_gpu_blocks=12, admission_safety_margin=margin, enable_prefix_caching=False)
        for i in range(4):
            s.add_request(new_request(f"r{i}", 8, max_tokens=8))
        preempted = []
        outputs = run_until_done(s, on_step=lambda so: preempted.extend(sorted(so.preempted_req_ids)))
        assert {r: sum(len(o.new_token_ids) for o in outs) for r, outs in outputs.items()} == {
            f"r{i}": 8 for i in range(4)
        }
        assert all_blocks_free(s)
        return preempted

    assert run(0.0) != []  # all four admitted at once, then they outgrow the pool
    assert run(0.6) == []  # the fourth waits (6 free < 7.2) until blocks come back


def test_forked_children_are_not_locked_out_by_their_own_blocks():
    s = make(0.5)
    s.add_request(new_request("p", 25, max_tokens=2, n=2))  # fork point 24: 6 shared blocks
    outputs = run_until_done(s, max_steps=20)
    assert {r: sum(len(o.new_token_ids) for o in outs) for r, outs in outputs.items()} == {
        "0_p": 2, "1_p": 2,
    }


def test_loaded_request_is_not_locked_out_by_its_own_blocks():
    connector = InMemoryConnector(4, load_async=True)
    s = make(0.5, kv_connector=connector)
    prompt = prompt_of("p", 25)
    connector.store(prompt)
    s.add_request(new_request("a", prompt, max_tokens=2))
    runner = FakeRunner()
    step(s, runner, KVConnectorOutput(finished_recving={"a"}))  # 6 blocks held: 4 free
    outputs = run_until_done(s, runner, max_steps=20)
    assert sum(len(o.new_token_ids) for o in outputs["a"]) == 2
