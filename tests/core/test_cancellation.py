"""Thread-safe cancellation: ``Scheduler.cancel_request`` may be called from
any thread; the cancellation is applied at the start of the next step."""

import random
import threading

from tests.core.fakes import FakeRunner, all_blocks_free, flatten, new_request, new_scheduler, step

from cadence.core.request import RequestStatus


def test_cancel_is_applied_at_the_next_step():
    s = new_scheduler()
    s.add_request(new_request("a", 9, max_tokens=8))
    s.add_request(new_request("b", 5, max_tokens=8))
    runner = FakeRunner()
    step(s, runner)
    a = s.requests["a"]
    a_blocks = s.kv_cache_manager.get_block_ids("a")
    assert len(a_blocks) == 3
    s.cancel_request("a")
    assert a.status == RequestStatus.RUNNING  # nothing happens until the step
    assert s.get_num_unfinished_requests() == 2
    so, outputs = step(s, runner)
    assert so.num_scheduled_tokens == {"b": 1}
    assert so.finished_req_ids == {"a"}
    assert a.status == RequestStatus.FINISHED_ABORTED
    assert s.kv_cache_manager.get_block_ids("a") == []
    assert [o.request_id for o in outputs] == ["b"]
    assert s.get_request_counts() == (1, 0)
    assert s.kv_cache_manager.num_free_blocks == 64 - 2  # only b's 2 blocks are owned


def test_cancel_a_waiting_request():
    s = new_scheduler(max_num_seqs=1)
    s.add_request(new_request("a", 4, max_tokens=3))
    s.add_request(new_request("b", 4, max_tokens=3))
    runner = FakeRunner()
    step(s, runner)
    b = s.requests["b"]
    assert b.status == RequestStatus.WAITING
    s.cancel_request("b")
    so, _ = step(s, runner)
    assert b.status == RequestStatus.FINISHED_ABORTED
    assert so.finished_req_ids == {"b"}
    assert len(s.waiting) == 0
    assert "b" not in s.requests


def test_cancel_of_unknown_or_finished_ids_is_ignored():
    s = new_scheduler()
    s.add_request(new_request("a", 4, max_tokens=1))
    runner = FakeRunner()
    step(s, runner)  # a finishes
    s.cancel_request("a")
    s.cancel_request("nobody")
    so, _ = step(s, runner)
    assert so.finished_req_ids == {"a"}  # reported once, for finishing on its own
    assert all_blocks_free(s)


def test_cancel_while_its_step_is_in_flight_drops_the_token():
    s = new_scheduler(async_scheduling=True)
    s.add_request(new_request("a", 8, max_tokens=10))
    runner = FakeRunner()
    so1 = s.schedule()
    out1 = runner.execute(so1)
    s.cancel_request("a")
    request = s.requests["a"]
    so2 = s.schedule()  # applies the cancel
    assert so2.num_scheduled_tokens == {}
    assert so2.finished_req_ids == {"a"}
    assert request.status == RequestStatus.FINISHED_ABORTED
    assert flatten(s.update_from_output(so1, out1)) == []
    assert request.output_token_ids == []
    assert all_blocks_free(s)


def test_cancellations_from_many_threads_while_stepping():
    s = new_scheduler(max_num_batched_tokens=32, num_gpu_blocks=1200, max_num_seqs=8, max_model_len=4096)
    rng = random.Random(1234)
    requests = {}
    for i in range(40):
        request = new_request(f"r{i}", rng.randint(1, 20), max_tokens=rng.randint(1, 12))
        requests[request.request_id] = request
        s.add_request(request)
    ids = sorted(requests)
    targets = [rng.sample(ids, 15) for _ in range(4)]  # overlapping: some ids cancelled twice
    # A request that only a cancel can end keeps the engine stepping until the last one.
    sentinel = new_request("sentinel", 3, max_tokens=100_000)
    requests["sentinel"] = sentinel
    s.add_request(sentinel)
    targets[0].append("sentinel")
    ids.append("sentinel")
    cancelled = {req_id for chunk in targets for req_id in chunk}
    start = threading.Barrier(5)
    errors = []

    def canceller(chunk, seed):
        local = random.Random(seed)
        try:
            start.wait()
            for req_id in chunk:
                threading.Event().wait(local.random() * 0.002)
                s.cancel_request(req_id)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=canceller, args=(chunk, n)) for n, chunk in enumerate(targets)]
    for thread in threads:
        thread.start()
    start.wait()
    runner = FakeRunner()
    tokens = {req_id: [] for req_id in ids}
    for _ in range(20_000):
        if not s.has_requests() and not any(t.is_alive() for t in threads):
            break
        _, outputs = step(s, runner)
        s.kv_cache_manager.check_consistency()
        for out in outputs:
            tokens[out.request_id].extend(out.new_token_ids)
    for thread in threads:
        thread.join()
    step(s, runner)  # apply any cancel that came after the last step
    assert errors == []
    assert not s.has_requests()
    for req_id, request in requests.items():
        max_tokens = request.sampling_params.max_tokens
        if request.status == RequestStatus.FINISHED_ABORTED:
            assert req_id in cancelled
            assert len(tokens[req_id]) < max_tokens
        else:
            assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED, req_id
            assert len(tokens[req_id]) == max_tokens
        assert tokens[req_id] == request.output_token_ids
    assert all(requests[r].status == RequestStatus.FINISHED_LENGTH_CAPPED for r in set(ids) - cancelled)
    assert sentinel.status == RequestStatus.FINISHED_ABORTED
    assert all_blocks_free(s)
    assert s.requests == {}
