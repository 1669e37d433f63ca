"""The importable names and fields of DESIGN.md's contract."""

import dataclasses
import inspect

import msgspec
import pytest

from cadence.compile import compiled_modules
from cadence.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from cadence.core.kv_cache import KVCacheManager
from cadence.core.outputs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    ModelRunnerOutput,
    PrefixCacheStats,
    SchedulerStats,
    SpecDecodingStats,
)
from cadence.core.request import Request, RequestStatus
from cadence.core.sched.interface import SchedulerInterface
from cadence.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from cadence.core.sched.scheduler import Scheduler
from cadence.sampling_params import SamplingParams

INTERFACE_METHODS = {
    "schedule", "update_from_output", "add_request", "finish_requests",
    "get_num_unfinished_requests", "has_unfinished_requests", "has_finished_requests",
    "has_requests", "reset_prefix_cache", "get_request_counts", "make_stats", "shutdown",
    "get_kv_connector",
}


def fields_of(cls) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(cls.__struct_fields__)


def test_scheduler_interface_has_exactly_the_contract_methods():
    public = {name for name, _ in inspect.getmembers(SchedulerInterface, inspect.isroutine)
              if not name.startswith("_")}
    assert public == INTERFACE_METHODS
    assert issubclass(Scheduler, SchedulerInterface)
    with pytest.raises(TypeError):
        SchedulerInterface()  # abstract (compiled: a trait, which cannot be created either)
    if "cadence.core.sched.interface" not in compiled_modules():
        abstract = SchedulerInterface.__abstractmethods__
        assert {"schedule", "update_from_output", "add_request", "finish_requests"} <= abstract


def test_request_fields_and_methods():
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=2), eos_token_id=0,
                  arrival_time=5.0, priority=3, client_index=1, lora_request=None)
    assert req.status == RequestStatus.WAITING
    assert (req.num_computed_tokens, req.num_tokens, req.num_prompt_tokens) == (0, 3, 3)
    req.spec_token_ids = [9, 9]
    assert req.num_tokens_with_spec == 5
    req.append_output_token_ids(4)
    req.append_output_token_ids([5, 6])
    assert req.output_token_ids == [4, 5, 6]
    assert req.all_token_ids == [1, 2, 3, 4, 5, 6]
    assert (req.priority, req.arrival_time, req.stop_reason) == (3, 5.0, None)
    assert not req.is_finished() and req.get_finished_reason() is None
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert req.is_finished() and str(req.get_finished_reason()) == "length"
    assert hasattr(req, "num_cached_tokens")


def test_request_status_names():
    names = {"WAITING", "WAITING_FOR_FSM", "WAITING_FOR_REMOTE_KVS", "RUNNING", "PREEMPTED",
             "FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED", "FINISHED_ABORTED", "FINISHED_IGNORED"}
    assert names == set(RequestStatus.__members__)
    finished = {s for s in RequestStatus if RequestStatus.is_finished(s)}
    assert {s.name for s in finished} == {n for n in names if n.startswith("FINISHED")}


def test_output_field_names():
    assert {"scheduled_new_reqs", "scheduled_cached_reqs", "num_scheduled_tokens",
            "total_num_scheduled_tokens", "scheduled_spec_decode_tokens",
            "scheduled_encoder_inputs", "num_common_prefix_blocks", "finished_req_ids",
            "free_encoder_input_ids", "structured_output_request_ids", "grammar_bitmask",
            "kv_connector_metadata"} <= fields_of(SchedulerOutput)
    assert {"req_id", "prompt_token_ids", "sampling_params", "block_ids",
            "num_computed_tokens", "lora_request"} <= fields_of(NewRequestData)
    assert {"req_ids", "resumed_from_preemption", "new_token_ids", "new_block_ids",
            "num_computed_tokens"} <= fields_of(CachedRequestData)
    assert {"req_ids", "req_id_to_index", "sampled_token_ids", "spec_token_ids", "logprobs",
            "prompt_logprobs_dict", "pooler_output", "kv_connector_output",
            "num_nans_in_logits"} <= fields_of(ModelRunnerOutput)
    assert {"outputs", "scheduler_stats", "finished_requests"} <= fields_of(EngineCoreOutputs)
    assert {"request_id", "new_token_ids", "finish_reason", "stop_reason", "new_logprobs",
            "num_cached_tokens", "events", "kv_transfer_params"} <= fields_of(EngineCoreOutput)
    assert {"num_running_reqs", "num_waiting_reqs", "kv_cache_usage", "prefix_cache_stats",
            "spec_decoding_stats", "num_corrupted_reqs"} <= fields_of(SchedulerStats)
    assert {"reset", "requests", "queries", "hits"} <= fields_of(PrefixCacheStats)
    assert {"num_spec_tokens", "num_drafts", "num_draft_tokens", "num_accepted_tokens",
            "num_accepted_tokens_per_pos"} <= fields_of(SpecDecodingStats)


def test_engine_core_outputs_round_trip_msgpack():
    out = EngineCoreOutputs(outputs=[EngineCoreOutput("a", [1, 2], num_cached_tokens=4)])
    data = msgspec.msgpack.encode(out)
    back = msgspec.msgpack.decode(data, type=EngineCoreOutputs)
    assert back.outputs[0].request_id == "a" and back.outputs[0].new_token_ids == [1, 2]


def test_configs_and_constructor():
    sc = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128)
    assert sc.enable_chunked_prefill and sc.long_prefill_token_threshold == 0 and sc.policy == "fcfs"
    assert sc.admission_safety_margin == 0 and not sc.prefill_first and sc.max_num_kv_read_tokens is None
    cc = CacheConfig(num_gpu_blocks=10)
    assert cc.block_size == 16 and cc.enable_prefix_caching
    spec = SpeculativeConfig(num_speculative_tokens=2)
    assert spec.method == "ngram"
    s = Scheduler(sc, cc, speculative_config=spec, lora_config=None, kv_connector=None,
                  structured_output_manager=None, log_stats=False, include_finished_set=False)
    assert isinstance(s.kv_cache_manager, KVCacheManager)
    assert s.get_request_counts() == (0, 0) and s.make_stats() is None
    assert s.get_kv_connector() is None and not s.has_requests()


def test_kv_cache_manager_api():
    kv = KVCacheManager(num_blocks=8, block_size=4, max_model_len=64)
    req = Request("r", list(range(10)), SamplingParams())
    blocks, num_hit = kv.get_computed_blocks(req)
    assert (blocks, num_hit) == ([], 0)
    new_ids = kv.allocate_slots(req, 10)
    assert len(new_ids) == 3 and kv.get_block_ids("r") == new_ids
    assert kv.usage == 3 / 8
    assert kv.allocate_slots(req, 40) is None  # 50 tokens need 13 blocks
    assert kv.get_block_ids("r") == new_ids  # nothing changed
    assert not kv.reset_prefix_cache()
    kv.free(req)
    assert kv.usage == 0 and kv.reset_prefix_cache()
    assert kv.take_events() == []
