"""Per-step KV-read budget (transformers' cache budget): the KV tokens that
attention reads in one step (each request's context after the step, capped
by the sliding window) stay under ``max_num_kv_read_tokens``."""

from tests.core.fakes import FakeRunner, all_blocks_free, new_request, new_scheduler, run_until_done, step


def reads(s, so, window=None):
    """KV tokens read by each scheduled request (call before update_from_output)."""
    out = {}
    for req_id in so.num_scheduled_tokens:
        context = s.requests[req_id].num_computed_tokens  # already advanced by schedule()
        out[req_id] = min(context, window) if window else context
    return out


def test_waiting_requests_wait_for_read_budget():
    s = new_scheduler(max_num_kv_read_tokens=30)
    for req_id in "abc":
        s.add_request(new_request(req_id, 12, max_tokens=2))
    runner = FakeRunner()
    so, _ = step(s, runner)
    assert so.num_scheduled_tokens == {"a": 12, "b": 12}  # c would make it 36
    so, _ = step(s, runner)
    assert so.num_scheduled_tokens == {"a": 1, "b": 1}  # 13 + 13 read; c's 12 does not fit
    so, _ = step(s, runner)
    assert so.num_scheduled_tokens == {"c": 12}


def test_sliding_window_limits_what_one_request_reads():
    s = new_scheduler(max_num_kv_read_tokens=30, sliding_window=8)
    for req_id in "abc":
        s.add_request(new_request(req_id, 12, max_tokens=2))
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 12, "b": 12, "c": 12}
    assert reads(s, so, window=8) == {"a": 8, "b": 8, "c": 8}


def test_long_context_fits_under_a_window():
    s = new_scheduler(max_num_kv_read_tokens=10, sliding_window=8, max_num_batched_tokens=64)
    s.add_request(new_request("long", 40, max_tokens=3))
    s.add_request(new_request("short", 2, max_tokens=3))
    s.add_request(new_request("late", 2, max_tokens=1))
    runner = FakeRunner()
    steps = [dict(step(s, runner)[0].num_scheduled_tokens) for _ in range(5)]
    assert steps == [
        {"long": 40, "short": 2},  # reads 8 (not 40) + 2
        {"long": 1, "late": 2},  # short's 3 does not fit after long's 8; late's 2 does
        {"long": 1},  # long is done after this step
        {"short": 1},
        {"short": 1},
    ]


def test_running_request_over_the_remaining_budget_is_skipped_not_blocking():
    # Contexts x 4, y 8, z 1 read 13 in step 1. In step 2 y's 9 no longer fits after
    # x's 5, but z's 2 does: z runs past y.
    s = new_scheduler(max_num_kv_read_tokens=13)
    s.add_request(new_request("x", 4, max_tokens=3))
    s.add_request(new_request("y", 8, max_tokens=3))
    s.add_request(new_request("z", 1, max_tokens=6))
    runner = FakeRunner()
    steps = [dict(step(s, runner)[0].num_scheduled_tokens) for _ in range(5)]
    assert steps == [
        {"x": 4, "y": 8, "z": 1},
        {"x": 1, "z": 1},  # reads 5 + 2
        {"x": 1, "z": 1},  # reads 6 + 3; x is done after this step
        {"y": 1, "z": 1},  # reads 9 + 4
        {"y": 1},  # y reads 10; z's 5 does not fit
    ]


def test_every_step_stays_within_the_budget():
    s = new_scheduler(max_num_kv_read_tokens=40, max_num_batched_tokens=16, num_gpu_blocks=40)
    for i, (length, max_tokens) in enumerate([(10, 5), (3, 9), (20, 3), (7, 7), (14, 2)]):
        s.add_request(new_request(f"r{i}", length, max_tokens=max_tokens))
    totals = []
    outputs = run_until_done(s, on_step=lambda so: totals.append(sum(reads(s, so).values())))
    assert max(totals) <= 40
    assert {r: sum(len(o.new_token_ids) for o in outs) for r, outs in outputs.items()} == {
        "r0": 5, "r1": 9, "r2": 3, "r3": 7, "r4": 2,
    }
    assert all_blocks_free(s)


def test_no_read_budget_by_default():
    s = new_scheduler()
    assert s.config.max_num_kv_read_tokens is None
    for req_id in "abc":
        s.add_request(new_request(req_id, 12))
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 12, "b": 12, "c": 12}


def test_lone_request_that_outgrows_the_read_budget_still_finishes():
    s = new_scheduler(max_num_kv_read_tokens=12)
    s.add_request(new_request("a", 10, max_tokens=6))  # context reaches 15
    outputs = run_until_done(s, max_steps=30)
    assert sum(len(o.new_token_ids) for o in outputs["a"]) == 6
