"""LoRA in the scheduler: at most ``max_loras`` distinct adapters per batch."""

from tests.core.fakes import FakeRunner, all_blocks_free, new_request, new_scheduler, prompt_of, run_until_done, step

from cadence.core.request import RequestStatus


def adapters_in(scheduler, so) -> set[int]:
    """Distinct adapter ids among the requests scheduled in ``so``."""
    ids = set()
    for req_id in so.num_scheduled_tokens:
        request = scheduler.requests.get(req_id)
        lora = request.lora_request if request is not None else None  # finished: left
        if lora is not None:
            ids.add(lora.lora_int_id)
    return ids


def test_one_adapter_per_step_with_max_loras_1():
    s = new_scheduler(max_loras=1)
    for req_id, lora in [("a", 1), ("b", 2), ("c", 1), ("d", 2)]:
        s.add_request(new_request(req_id, 8, max_tokens=3, lora_id=lora))
    runner = FakeRunner()
    so, _ = step(s, runner)
    assert so.num_scheduled_tokens == {"a": 8, "c": 8}
    assert [n.lora_request.lora_int_id for n in so.scheduled_new_reqs] == [1, 1]
    assert [r.request_id for r in s.waiting] == ["b", "d"]
    assert s.requests["b"].status == RequestStatus.WAITING

    per_step: list[set[int]] = []
    outputs = run_until_done(s, runner, on_step=lambda so: per_step.append(adapters_in(s, so)))
    assert all(len(ids) <= 1 for ids in per_step)
    # a and c decode twice more, then b and d run 3 steps; a last empty step reports them finished.
    assert per_step == [{1}, {1}, {2}, {2}, {2}, set()]
    assert {r: len([t for o in outs for t in o.new_token_ids]) for r, outs in outputs.items()} == {
        "a": 2, "c": 2, "b": 3, "d": 3,
    }
    assert all_blocks_free(s)


def test_requests_of_one_adapter_and_base_requests_batch_together():
    s = new_scheduler(max_loras=1)
    s.add_request(new_request("a", 6, lora_id=7))
    s.add_request(new_request("base", 6))  # no adapter: never limited
    s.add_request(new_request("b", 6, lora_id=7))
    s.add_request(new_request("other", 6, lora_id=8))
    s.add_request(new_request("c", 6, lora_id=7))
    so, _ = step(s, FakeRunner())
    assert so.num_scheduled_tokens == {"a": 6, "base": 6, "b": 6, "c": 6}
    assert adapters_in(s, so) == {7}
    assert [r.request_id for r in s.waiting] == ["other"]


def test_skipped_requests_keep_their_queue_order():
    s = new_scheduler(max_loras=1)
    for req_id, lora in [("a", 1), ("b", 2), ("c", 3), ("d", 1), ("e", 2), ("f", 3)]:
        s.add_request(new_request(req_id, 4, max_tokens=1, lora_id=lora))
    runner = FakeRunner()
    order = []
    for _ in range(3):
        so, outs = step(s, runner)
        order.append(list(so.num_scheduled_tokens))
        assert all(o.finish_reason is not None for o in outs)  # max_tokens=1: done at once
        if s.waiting:
            # The skipped ones are back at the head, in arrival order.
            waiting = [r.request_id for r in s.waiting]
            assert waiting == sorted(waiting)
    assert order == [["a", "d"], ["b", "e"], ["c", "f"]]
    assert not s.has_unfinished_requests()


def test_max_loras_2_admits_two_adapters():
    s = new_scheduler(max_loras=2)
    for req_id, lora in [("a", 1), ("b", 2), ("c", 3), ("d", 2), ("e", 1)]:
        s.add_request(new_request(req_id, 4, lora_id=lora))
    so, _ = step(s, FakeRunner())
    assert list(so.num_scheduled_tokens) == ["a", "b", "d", "e"]
    assert adapters_in(s, so) == {1, 2}
    assert [r.request_id for r in s.waiting] == ["c"]


def test_without_lora_config_adapters_are_not_limited():
    s = new_scheduler()
    for req_id, lora in [("a", 1), ("b", 2), ("c", 3)]:
        s.add_request(new_request(req_id, 4, lora_id=lora))
    so, _ = step(s, FakeRunner())
    assert adapters_in(s, so) == {1, 2, 3}


def test_prefix_cache_is_not_shared_across_adapters():
    s = new_scheduler(max_loras=2)
    prompt = prompt_of("shared", 12)
    runner = FakeRunner()
    s.add_request(new_request("first", prompt, max_tokens=1, lora_id=1))
    run_until_done(s, runner)
    s.add_request(new_request("other_adapter", prompt, max_tokens=1, lora_id=2))
    s.add_request(new_request("same_adapter", prompt, max_tokens=1, lora_id=1))
    so, _ = step(s, runner)
    # 12 tokens, block 4: at most 2 full blocks can hit (one token is always computed).
    assert so.num_scheduled_tokens == {"other_adapter": 12, "same_adapter": 4}
    new = {n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs}
    assert new == {"other_adapter": 0, "same_adapter": 8}


def test_running_requests_also_respect_max_loras():
    # The KV-read budget skips running request a (adapter 1) while c reads most of it;
    # b (adapter 2) is admitted meanwhile. Once c is done, a and b both fit.
    s = new_scheduler(max_loras=1, max_num_kv_read_tokens=40)
    s.add_request(new_request("c", 24, max_tokens=3))
    s.add_request(new_request("a", 14, max_tokens=10, lora_id=1))
    s.add_request(new_request("b", 4, max_tokens=10, lora_id=2))
    runner = FakeRunner()
    for _ in range(8):
        so, _ = step(s, runner)
        assert len(adapters_in(s, so)) <= 1, dict(so.num_scheduled_tokens)



def test_prefix_cache_never_shares_blocks_across_adapters():
    """The adapter is in every block hash: equal tokens under another adapter
    (or the base model) have other KV, so they never hit; the same adapter does."""
    s = new_scheduler(max_loras=3)
    tokens = prompt_of("shared", 9)  # two full blocks of 4
    runner = FakeRunner()
    s.add_request(new_request("a", tokens, max_tokens=8, lora_id=1))
    step(s, runner)  # a's prompt is computed: its full blocks are cached
    computed = {}
    for req_id, lora in [("b", 2), ("base", None), ("a-again", 1)]:
        s.add_request(new_request(req_id, tokens, max_tokens=8, lora_id=lora))
        so, _ = step(s, runner)
        computed[req_id] = next(n.num_computed_tokens for n in so.scheduled_new_reqs if n.req_id == req_id)
    assert computed == {"b": 0, "base": 0, "a-again": 8}
