"""Data-parallel options that need no engine: what is refused (naming the
option), and what each local replica is given."""

from __future__ import annotations

import asyncio

import pytest

from cadence.config import EngineOptions
from cadence.engine.dp_client import (
    DPAsyncLLM, check_dp_options, combine_results, local_replica_options, make_async_llm,
    uses_replicas,
)
from cadence.engine.async_llm import AsyncLLM
from cadence.engine.llm import LLM
from cadence.sampling_params import SamplingParams


def options(**kwargs) -> EngineOptions:
    return EngineOptions.from_kwargs(model=None, **kwargs)


@pytest.mark.parametrize("kwargs, field", [
    (dict(data_parallel_size=2, tensor_parallel_size=2), "tensor_parallel_size"),
    (dict(data_parallel_size=2, distributed_executor_backend="ray", device="cuda:1"), "device"),
    (dict(data_parallel_size=2, enable_kv_cache_events=True), "enable_kv_cache_events"),
    (dict(data_parallel_size=2, kv_offload_size=1.0), "kv_transfer_config"),
])
def test_what_data_parallelism_cannot_combine_is_refused(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        check_dp_options(options(**kwargs))


@pytest.mark.parametrize("kwargs, field", [
    (dict(data_parallel_size=0), "data_parallel_size"),
    (dict(distributed_executor_backend="slurm"), "distributed_executor_backend"),
    (dict(dp_routing="random"), "dp_routing"),
    (dict(dp_load_margin_tokens=-1), "dp_load_margin_tokens"),
])
def test_bad_values_are_refused_naming_the_option(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        options(**kwargs)


def test_offline_generation_refuses_replicas():
    with pytest.raises(ValueError, match="^data_parallel_size:"):
        LLM(data_parallel_size=2)


def test_one_engine_without_ray_is_the_plain_front_end():
    assert not uses_replicas(options())
    assert not uses_replicas(options(distributed_executor_backend="mp"))
    assert uses_replicas(options(distributed_executor_backend="ray"))
    assert uses_replicas(options(data_parallel_size=2))
    llm = make_async_llm(options())
    assert type(llm) is AsyncLLM
    asyncio.run(llm.shutdown())  # its sockets; no engine was started


def test_local_replicas_on_cuda_get_a_gpu_each():
    two = options(data_parallel_size=2, device="cuda")
    assert [local_replica_options(two, rank).engine.device for rank in (0, 1)] == ["cuda:0", "cuda:1"]
    cpu = options(data_parallel_size=2, device="cpu")
    assert local_replica_options(cpu, 1) is cpu


def test_a_data_parallel_front_end_sums_the_replicas_utility_results():
    assert combine_results([True, True]) is True and combine_results([True, False]) is False
    assert combine_results([{"n": 1, "name": "a"}, {"n": 2, "name": "a"}]) == {"n": 3, "name": "a"}
    assert combine_results([1, "x"]) == [1, "x"]


def test_a_data_parallel_front_end_starts_with_every_replica_on_the_router():
    llm = DPAsyncLLM(options(data_parallel_size=3, dp_routing="least_loaded"))
    assert [replica.rank for replica in llm.replicas] == [0, 1, 2]
    assert llm.router.policy == "least_loaded" and llm.router.num_replicas == 3
    assert len({replica.input_address for replica in llm.replicas}) == 3
    asyncio.run(llm.shutdown())
    assert not llm.is_alive


def test_a_salted_request_is_routed_by_its_own_salts_cached_blocks():
    """The router hashes a prompt with the key the replicas' blocks carry (adapter
    and cache salt): a salted prompt goes where that salt's blocks are, and the
    same prompt without a salt, or with another, is not drawn there."""
    from cadence.core.kv_cache import KVCacheManager
    from cadence.core.testing import new_request

    llm = DPAsyncLLM(options(data_parallel_size=3, dp_routing="cache_aware", block_size=4))
    prompt = list(range(100, 116))  # four full blocks
    manager = KVCacheManager(num_blocks=64, block_size=4, enable_caching=True,
                             enable_kv_cache_events=True)
    cached = new_request("cached", prompt, max_tokens=1, cache_salt="tenant-a")
    manager.get_computed_blocks(cached)
    assert manager.allocate_slots(cached, len(prompt)) is not None
    llm.router.absorb_kv_events(2, manager.take_events())
    sent: dict[str, int] = {}
    for replica in llm.replicas:
        replica.add_request = lambda request_id, *args, rank=replica.rank, **kwargs: sent.update(
            {request_id: rank})
    try:
        for request_id, salt in (("same", "tenant-a"), ("none", None), ("other", "tenant-b")):
            llm.add_request(request_id, prompt + [7], SamplingParams(max_tokens=1, cache_salt=salt))
        assert sent["same"] == 2 and llm.router.routed["same"].num_cached_tokens == 16
        assert llm.router.routed["none"].num_cached_tokens == 0 and sent["none"] != 2
        assert llm.router.routed["other"].num_cached_tokens == 0 and sent["other"] != 2
    finally:
        asyncio.run(llm.shutdown())
