"""Encoder inputs (multimodal items): a per-step encoder budget, scheduling
when the token range first overlaps an item, and an encoder cache shared by
content hash and freed once consumed."""

import pytest
from tests.core.fakes import FakeRunner, all_blocks_free, new_request, new_scheduler, run_until_done, step

from cadence.core.request import RequestStatus


def test_item_over_the_remaining_budget_stops_the_step_before_its_placeholder():
    s = new_scheduler(max_num_encoder_input_tokens=10)
    s.add_request(new_request("a", 24, mm=[(4, 6), (14, 6)]))
    runner = FakeRunner()
    so, _ = step(s, runner)
    # Item 0 (6 tokens) fits the budget of 10; item 1 (6 more) does not: stop at 14.
    assert so.num_scheduled_tokens == {"a": 14}
    assert so.scheduled_encoder_inputs == {"a": [0]}
    so, _ = step(s, runner)
    assert so.num_scheduled_tokens == {"a": 10}
    assert so.scheduled_encoder_inputs == {"a": [1]}
    so, _ = step(s, runner)
    assert so.num_scheduled_tokens == {"a": 1}
    assert so.scheduled_encoder_inputs == {}


def test_budget_is_shared_by_the_requests_of_a_step():
    s = new_scheduler(max_num_encoder_input_tokens=10)
    s.add_request(new_request("a", 12, mm=[(2, 6)]))
    s.add_request(new_request("b", 12, mm=[(3, 6)]))
    runner = FakeRunner()
    so, _ = step(s, runner)
    assert so.num_scheduled_tokens == {"a": 12, "b": 3}  # b stops before its item
    assert so.scheduled_encoder_inputs == {"a": [0]}
    so, _ = step(s, runner)
    assert so.num_scheduled_tokens == {"a": 1, "b": 9}
    assert so.scheduled_encoder_inputs == {"b": [0]}


def test_item_is_scheduled_in_the_step_whose_range_first_overlaps_it():
    s = new_scheduler(max_num_batched_tokens=8)
    s.add_request(new_request("a", 20, mm=[(10, 4)]))
    runner = FakeRunner()
    encoded = []
    for _ in range(3):
        so, _ = step(s, runner)
        encoded.append((so.num_scheduled_tokens["a"], so.scheduled_encoder_inputs.get("a")))
    # [0, 8) misses the item; [8, 16) overlaps it; [16, 20) is past it.
    assert encoded == [(8, None), (8, [0]), (4, None)]


def test_encoder_output_is_shared_by_mm_hash_across_requests():
    s = new_scheduler(max_num_encoder_input_tokens=10, enable_prefix_caching=False)
    s.add_request(new_request("a", 12, mm=[(2, 6)], mm_hashes=["img"]))
    s.add_request(new_request("b", 12, mm=[(4, 6)], mm_hashes=["img"]))
    runner = FakeRunner()
    so, _ = step(s, runner)
    assert so.num_scheduled_tokens == {"a": 12, "b": 12}
    assert so.scheduled_encoder_inputs == {"a": [0]}  # encoded once, used by both
    assert so.free_encoder_input_ids == []
    so, _ = step(s, runner)
    assert so.scheduled_encoder_inputs == {}
    assert so.free_encoder_input_ids == ["img"]  # both consumed it in the step before
    assert s.encoder_cache_manager.num_free_slots == 10


def test_cached_output_is_reused_by_a_later_request_while_still_held():
    # a holds "img" (its placeholder is not consumed yet) when b needs it.
    s = new_scheduler(max_num_batched_tokens=16, max_num_encoder_input_tokens=8)
    s.add_request(new_request("a", 24, mm=[(12, 8)], mm_hashes=["img"]))
    s.add_request(new_request("b", 10, mm=[(0, 8)], mm_hashes=["img"]))
    runner = FakeRunner()
    so, _ = step(s, runner)
    assert so.num_scheduled_tokens == {"a": 16}
    assert so.scheduled_encoder_inputs == {"a": [0]}
    so, _ = step(s, runner)
    assert so.num_scheduled_tokens == {"a": 8, "b": 8}
    assert so.scheduled_encoder_inputs == {}  # b reads the cached "img"
    assert so.free_encoder_input_ids == []
    so, _ = step(s, runner)
    assert so.free_encoder_input_ids == ["img"]


def test_consumed_inputs_are_freed_in_the_next_output():
    s = new_scheduler(max_num_batched_tokens=8)
    s.add_request(new_request("a", 20, mm=[(2, 4), (12, 4)]))
    runner = FakeRunner()
    freed = []
    for _ in range(4):
        so, _ = step(s, runner)
        freed.append(so.free_encoder_input_ids)
    # Item 0 is consumed in step 1, item 1 in step 2; each is freed in the following output.
    assert freed == [[], ["a#0"], ["a#1"], []]
    assert s.encoder_cache_manager.num_free_slots == 8


def test_encoder_cache_size_limits_items_held_at_once():
    s = new_scheduler(encoder_cache_size=6, enable_prefix_caching=False)
    s.add_request(new_request("a", 12, mm=[(2, 6)], mm_hashes=["img-a"]))
    s.add_request(new_request("b", 12, mm=[(2, 6)], mm_hashes=["img-b"]))
    runner = FakeRunner()
    so, _ = step(s, runner)
    assert so.num_scheduled_tokens == {"a": 12, "b": 2}
    assert so.scheduled_encoder_inputs == {"a": [0]}
    so, _ = step(s, runner)
    assert so.num_scheduled_tokens == {"a": 1, "b": 10}
    assert so.scheduled_encoder_inputs == {"b": [0]}
    assert so.free_encoder_input_ids == ["img-a"]


@pytest.mark.parametrize("disable_chunked_mm_input", [False, True])
def test_disable_chunked_mm_input_never_splits_an_item(disable_chunked_mm_input):
    s = new_scheduler(max_num_batched_tokens=8, disable_chunked_mm_input=disable_chunked_mm_input)
    s.add_request(new_request("a", 20, mm=[(6, 8)]))
    runner = FakeRunner()
    steps = []
    for _ in range(3):
        so, _ = step(s, runner)
        steps.append((so.num_scheduled_tokens["a"], so.scheduled_encoder_inputs.get("a")))
    if disable_chunked_mm_input:
        # Stop before the item, then take it whole.
        assert steps == [(6, None), (8, [0]), (6, None)]
    else:
        assert steps == [(8, [0]), (8, None), (4, None)]


def test_finished_request_releases_its_encoder_cache():
    s = new_scheduler(max_num_batched_tokens=10)
    s.add_request(new_request("a", 20, mm=[(8, 6)]))
    runner = FakeRunner()
    so, _ = step(s, runner)
    assert so.scheduled_encoder_inputs == {"a": [0]}
    assert s.encoder_cache_manager.num_free_slots == 10 - 6  # not consumed yet
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    so, _ = step(s, runner)
    assert so.free_encoder_input_ids == ["a#0"]
    assert so.finished_req_ids == {"a"}
    assert s.encoder_cache_manager.num_free_slots == 10
    assert all_blocks_free(s)


def test_multimodal_requests_run_to_completion_without_leaks():
    s = new_scheduler(max_num_batched_tokens=8, max_num_encoder_input_tokens=6, num_gpu_blocks=24)
    requests = [
        new_request("a", 20, mm=[(2, 4), (10, 6)], max_tokens=3),
        new_request("b", 14, mm=[(0, 6)], mm_hashes=["shared"], max_tokens=3),
        new_request("c", 16, mm=[(8, 6)], mm_hashes=["shared"], max_tokens=3),
    ]
    positions = {r.request_id: r.mm_positions for r in requests}
    for request in requests:
        s.add_request(request)
    encoded = []

    def check(so):
        assert set(so.scheduled_encoder_inputs) <= set(so.num_scheduled_tokens)
        num_encoder_tokens = sum(
            positions[req_id][i].length
            for req_id, items in so.scheduled_encoder_inputs.items() for i in items
        )
        assert num_encoder_tokens <= 6
        encoded.extend((req_id, i) for req_id, items in so.scheduled_encoder_inputs.items() for i in items)

    outputs = run_until_done(s, on_step=check)
    assert {r: sum(len(o.new_token_ids) for o in outs) for r, outs in outputs.items()} == {
        "a": 3, "b": 3, "c": 3,
    }
    # Each item is encoded once, except "shared", which c needs after b released it.
    assert sorted(encoded) == [("a", 0), ("a", 1), ("b", 0), ("c", 0)]
    assert s.encoder_cache_manager.num_free_slots == 6
    assert all_blocks_free(s)


def test_request_preempted_in_the_step_has_no_scheduled_encoder_inputs():
    # 4 blocks of 4 tokens; a 24-token prompt in chunks of 8: the third chunk, which
    # reaches the item at 16, cannot get blocks and a preempts itself.
    s = new_scheduler(max_num_batched_tokens=8, num_gpu_blocks=4, enable_prefix_caching=False)
    s.add_request(new_request("a", 24, mm=[(16, 4)]))
    runner = FakeRunner()
    step(s, runner)
    step(s, runner)
    so, _ = step(s, runner)
    assert so.preempted_req_ids == {"a"}
    assert so.num_scheduled_tokens == {}
    assert so.scheduled_encoder_inputs == {}
    assert s.encoder_cache_manager.num_free_slots == 8


def test_request_refused_by_the_kv_read_budget_has_no_scheduled_encoder_inputs():
    s = new_scheduler(max_num_kv_read_tokens=20)
    s.add_request(new_request("a", 12))
    s.add_request(new_request("b", 12, mm=[(2, 4)]))
    so, _ = step(s, FakeRunner())
    assert so.num_scheduled_tokens == {"a": 12}  # b would read 12 more: over 20
    assert so.scheduled_encoder_inputs == {}
    assert s.encoder_cache_manager.num_free_slots == 64
