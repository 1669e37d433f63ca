"""KV connector hooks: external prefix hits, async loads in
WAITING_FOR_REMOTE_KVS, delayed frees while sending, per-step metadata."""

from tests.core.fakes import (
    FakeRunner,
    InMemoryConnector,
    all_blocks_free,
    new_request,
    new_scheduler,
    prompt_of,
    ref_counts,
    run_until_done,
    step,
)

from cadence.core.outputs import KVConnectorOutput
from cadence.core.request import FinishReason, RequestStatus

BLOCK = 4


def make(connector, **kwargs):
    kwargs.setdefault("num_gpu_blocks", 16)
    return new_scheduler(kv_connector=connector, block_size=BLOCK, **kwargs)


def test_external_hits_reduce_the_tokens_computed():
    connector = InMemoryConnector(BLOCK)
    s = make(connector)
    prompt = prompt_of("p", 18)
    connector.store(prompt)
    s.add_request(new_request("a", prompt, max_tokens=2))
    runner = FakeRunner()
    so, outputs = step(s, runner)
    # 18 tokens: 4 full blocks (16 tokens) come from the connector, 2 are computed.
    assert so.num_scheduled_tokens == {"a": 2}
    [new] = so.scheduled_new_reqs
    assert new.num_computed_tokens == 16
    assert len(new.block_ids) == 5
    request = s.requests["a"]
    assert request.num_cached_tokens == 16
    assert request.num_computed_tokens == 18
    assert connector.match_calls == [("a", 0)]
    assert connector.alloc_calls == [("a", new.block_ids, 16)]
    assert so.kv_connector_metadata == {"step": 1, "loads": [("a", new.block_ids, 16)]}
    assert [o.new_token_ids != [] for o in outputs] == [True]
    assert outputs[0].num_cached_tokens == 16


def test_external_hits_start_after_the_local_ones():
    connector = InMemoryConnector(BLOCK)
    s = make(connector)
    prompt = prompt_of("p", 18)
    runner = FakeRunner()
    s.add_request(new_request("warm", prompt[:9], max_tokens=1))  # caches 2 blocks locally
    run_until_done(s, runner)
    connector.store(prompt)
    connector.match_calls.clear()
    s.add_request(new_request("a", prompt, max_tokens=2))
    so, _ = step(s, runner)
    assert connector.match_calls == [("a", 8)]  # asked beyond the 8 local tokens
    assert so.num_scheduled_tokens == {"a": 2}
    [new] = so.scheduled_new_reqs
    assert new.num_computed_tokens == 16
    assert s.requests["a"].num_cached_tokens == 16
    assert connector.alloc_calls[-1] == ("a", new.block_ids, 8)


def test_no_external_hit_computes_everything():
    connector = InMemoryConnector(BLOCK)
    s = make(connector)
    connector.store(prompt_of("other", 16))
    s.add_request(new_request("a", 10, max_tokens=2))
    so, _ = step(s, FakeRunner())
    assert so.num_scheduled_tokens == {"a": 10}
    assert s.requests["a"].num_cached_tokens == 0
    assert connector.alloc_calls == [("a", so.scheduled_new_reqs[0].block_ids, 0)]
    assert so.kv_connector_metadata["loads"] == []


def test_async_load_waits_for_remote_kvs_holding_its_blocks():
    connector = InMemoryConnector(BLOCK, load_async=True)
    s = make(connector)
    prompt = prompt_of("p", 18)
    connector.store(prompt)
    s.add_request(new_request("a", prompt, max_tokens=2))
    s.add_request(new_request("b", 6, max_tokens=8))
    runner = FakeRunner()
    request = s.requests["a"]

    so, _ = step(s, runner)
    assert so.num_scheduled_tokens == {"b": 6}  # b runs while a's KV arrives
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    held = s.kv_cache_manager.get_block_ids("a")
    assert len(held) == 4  # room for the 16 external tokens
    assert ref_counts(s, held) == [1, 1, 1, 1]
    assert so.kv_connector_metadata["loads"] == [("a", held, 16)]
    assert request.num_computed_tokens == 0

    so, _ = step(s, runner)  # still loading
    assert "a" not in so.num_scheduled_tokens
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert s.kv_cache_manager.get_block_ids("a") == held

    # The load finishes during a step; a runs from the next one.
    so, _ = step(s, runner, KVConnectorOutput(finished_recving={"a"}))
    assert "a" not in so.num_scheduled_tokens
    assert connector.connector_outputs[-1].finished_recving == {"a"}
    so, outputs = step(s, runner)
    assert so.num_scheduled_tokens == {"b": 1, "a": 2}
    [new] = so.scheduled_new_reqs
    assert (new.req_id, new.num_computed_tokens) == ("a", 16)
    assert new.block_ids[:4] == held and len(new.block_ids) == 5
    assert request.status == RequestStatus.RUNNING
    assert request.num_cached_tokens == 16
    assert connector.match_calls == [("a", 0), ("b", 0)]  # a is not asked again after its load
    assert [o.request_id for o in outputs if o.new_token_ids] == ["b", "a"]


def test_loaded_blocks_enter_the_prefix_cache():
    connector = InMemoryConnector(BLOCK, load_async=True)
    s = make(connector)
    prompt = prompt_of("p", 18)
    connector.store(prompt)
    s.add_request(new_request("a", prompt, max_tokens=1))
    runner = FakeRunner()
    step(s, runner, KVConnectorOutput(finished_recving={"a"}))
    run_until_done(s, runner)
    s.add_request(new_request("again", prompt, max_tokens=2))
    so, _ = step(s, runner)
    # 4 local hits: nothing left for the connector, nothing to load.
    assert connector.match_calls[-1] == ("again", 16)
    assert so.num_scheduled_tokens == {"again": 2}
    assert s.requests["again"].status == RequestStatus.RUNNING


def test_abort_while_waiting_for_remote_kvs_frees_its_blocks():
    connector = InMemoryConnector(BLOCK, load_async=True)
    s = make(connector)
    prompt = prompt_of("p", 18)
    connector.store(prompt)
    s.add_request(new_request("a", prompt))
    step(s, FakeRunner())
    assert s.kv_cache_manager.num_free_blocks == 12
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished_requests()
    assert all_blocks_free(s)
    assert connector.finished_calls == [("a", [0, 1, 2, 3])]


def test_delayed_free_keeps_blocks_until_sent():
    connector = InMemoryConnector(BLOCK, delay_free=True)
    s = make(connector)
    s.add_request(new_request("a", 10, max_tokens=2))
    runner = FakeRunner()
    step(s, runner)
    block_ids = s.kv_cache_manager.get_block_ids("a")
    assert len(block_ids) == 3
    _, outputs = step(s, runner)
    [out] = outputs
    assert out.finish_reason == FinishReason.LENGTH
    assert out.kv_transfer_params == {"remote_block_ids": block_ids}
    assert connector.finished_calls == [("a", block_ids)]
    assert not s.has_unfinished_requests()
    # Finished, but its blocks stay owned while the connector sends them.
    for _ in range(2):
        so, _ = step(s, runner)
        assert s.kv_cache_manager.get_block_ids("a") == block_ids
        assert ref_counts(s, block_ids) == [1, 1, 1]
        assert s.kv_cache_manager.num_free_blocks == 16 - 3
    assert so.num_scheduled_tokens == {}
    step(s, runner, KVConnectorOutput(finished_sending={"a"}))
    assert s.kv_cache_manager.get_block_ids("a") == []
    assert all_blocks_free(s)
    assert "a" not in s.requests


def test_without_delay_blocks_are_freed_on_finish():
    connector = InMemoryConnector(BLOCK)
    s = make(connector)
    s.add_request(new_request("a", 10, max_tokens=1))
    _, outputs = step(s, FakeRunner())
    assert outputs[0].kv_transfer_params is None
    assert all_blocks_free(s)


def test_build_connector_meta_is_called_every_step():
    connector = InMemoryConnector(BLOCK)
    s = make(connector)
    s.add_request(new_request("a", 6, max_tokens=2))
    runner = FakeRunner()
    metas = []
    for _ in range(4):  # prefill, decode, an empty step reporting the finish, an idle step
        so, _ = step(s, runner)
        metas.append(so.kv_connector_metadata)
    assert [m["step"] for m in metas] == [1, 2, 3, 4]
    assert connector.meta_calls[2].finished_req_ids == {"a"}
    assert connector.meta_calls[3].num_scheduled_tokens == {}


def test_get_kv_connector_and_shutdown():
    connector = InMemoryConnector(BLOCK)
    s = make(connector)
    assert s.get_kv_connector() is connector
    s.shutdown()
    assert connector.shut_down
    assert new_scheduler().get_kv_connector() is None


def test_connector_fed_by_finished_requests_serves_later_ones():
    connector = InMemoryConnector(BLOCK, save_on_finish=True)
    s = make(connector, enable_prefix_caching=False)
    prompt = prompt_of("p", 13)
    runner = FakeRunner()
    s.add_request(new_request("first", prompt, max_tokens=1))
    first = run_until_done(s, runner)
    s.add_request(new_request("second", prompt, max_tokens=1))
    second = s.requests["second"]
    so, outputs = step(s, runner)
    assert so.num_scheduled_tokens == {"second": 1}  # 12 of 13 tokens from the connector
    assert second.num_cached_tokens == 12
    assert outputs[0].num_cached_tokens == 12
    assert first["first"][0].num_cached_tokens == 0
