"""The KV connector's runner side: options, the registry, the hooks around
each step (sync and async scheduling), and load errors turned into recompute."""

from __future__ import annotations

import argparse
import io
import random

import pytest
import torch

from cadence.config import EngineOptions, KVTransferConfig
from cadence.config_cli import add_config_options, options_of
from cadence.core.request import Request
from cadence.engine.builder import assemble_engine
from cadence.engine.kv_connectors import register_kv_connector
from cadence.models.testing import random_model, tiny_config
from cadence.sampling_params import SamplingParams

register_kv_connector("TestRecording", "tests.runner.kv_connector_fakes:RecordingScheduler",
                      "tests.runner.kv_connector_fakes:RecordingWorker")
BLOCK = 4


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_config(), seed=0)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model's steps are microseconds of math: a second intra-op
    thread only adds synchronisation (tens of ms a step on a busy machine)."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


def build(model, *, num_gpu_blocks=64, **options):
    options = EngineOptions.from_kwargs(device="cpu", dtype="float32", block_size=BLOCK,
                                        num_gpu_blocks=num_gpu_blocks, max_model_len=128, **options)
    return assemble_engine(options, model, model.config, None, log=io.StringIO())


def prompt_of(seed, length):
    rng = random.Random(seed)
    return [rng.randrange(3, 200) for _ in range(length)]


def generate(engine, prompts, max_tokens=6):
    """Greedy outputs by request id, the engine stepped to the end."""
    core = engine.core
    for req_id, prompt in prompts.items():
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        core.add_request(Request(req_id, prompt, params))
    tokens = {req_id: [] for req_id in prompts}
    for _ in range(200):
        if not core.has_work():
            break
        for outputs in core.step().values():
            for output in outputs.outputs:
                tokens[output.request_id].extend(output.new_token_ids)
    assert not core.has_work()
    return tokens


# ---------------------------------------------------------------- options


def test_kv_transfer_config_as_one_json_flag_like_vllm():
    parser = argparse.ArgumentParser()
    add_config_options(parser)
    args = parser.parse_args(["--kv-transfer-config",
                              '{"kv_connector": "TestRecording", "kv_role": "kv_consumer",'
                              ' "kv_connector_extra_config": {"a": 1}}'])
    options = EngineOptions.from_kwargs(**options_of(args))
    assert options.kv_transfer == KVTransferConfig("TestRecording", "kv_consumer", {"a": 1})


def test_kv_offload_size_is_the_offloading_connectors_shortcut():
    parser = argparse.ArgumentParser()
    add_config_options(parser)
    args = parser.parse_args(["--kv-offload-size", "2", "--kv-connector-extra-config", '{"x": 2}'])
    config = EngineOptions.from_kwargs(**options_of(args)).kv_transfer
    assert (config.kv_connector, config.kv_role, config.kv_offload_size) == ("OffloadingConnector", "kv_both", 2.0)
    assert config.extra("x") == 2
    assert EngineOptions.from_kwargs().kv_transfer is None


@pytest.mark.parametrize("options, message", [
    ({"kv_role": "kv_both"}, r"^kv_role: needs a kv_connector"),
    ({"kv_connector": "X", "kv_role": "both"}, r"^kv_role: must be one of"),
    ({"kv_offload_size": -1.0}, r"^kv_offload_size: must be > 0"),
    ({"kv_connector": "Other", "kv_offload_size": 1.0}, r"^kv_offload_size: sizes the OffloadingConnector"),
    ({"kv_transfer_config": "[1]"}, r"^kv_transfer_config: must be a JSON object"),
    ({"kv_transfer_config": "{"}, r"^kv_transfer_config: not valid JSON"),
    ({"kv_transfer_config": {"kv_conector": "X"}}, r"^kv_transfer_config: unknown field 'kv_conector'"),
    ({"kv_transfer_config": {"kv_connector": "X"}, "kv_connector": "Y"},
     r"^kv_connector: given both on its own and in kv_transfer_config"),
])
def test_bad_kv_transfer_options_are_refused_by_name(options, message):
    with pytest.raises(ValueError, match=message):
        EngineOptions.from_kwargs(**options)


def test_a_bad_json_flag_is_an_argparse_error(capsys):
    parser = argparse.ArgumentParser()
    add_config_options(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-transfer-config", "{nope"])
    assert "kv_transfer_config: not valid JSON" in capsys.readouterr().err


def test_an_unknown_connector_is_refused_by_name(model):
    with pytest.raises(ValueError, match=r"^kv_connector: unknown connector 'Nope' \(registered: .*"
                                         r"TestRecording"):
        build(model, kv_connector="Nope")


# ---------------------------------------------------------------- the hooks


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_runner_calls_the_worker_around_every_step(model, async_scheduling):
    engine = build(model, kv_connector="TestRecording", async_scheduling=async_scheduling)
    scheduler_side = engine.core.scheduler.get_kv_connector()
    worker = engine.core.runner.kv_connector
    assert worker.kv_caches is engine.core.runner.kv_cache
    assert scheduler_side.manager is engine.core.scheduler.kv_cache_manager
    assert scheduler_side.context.bytes_per_block > 0 and scheduler_side.context.seconds_per_token > 0
    generate(engine, {"a": prompt_of(0, 9), "b": prompt_of(1, 5)}, max_tokens=3)
    calls = worker.calls
    assert calls[0] == "register"
    steps = [calls[i:i + 3] for i in range(1, len(calls), 3)]
    # Each step: load (the scheduler's metadata, in order), save, finished.
    assert [s[0] for s in steps] == [("load", n) for n in range(1, len(steps) + 1)]
    assert all(s[1] == "save" and s[2][0] == "finished" for s in steps)
    assert {"a", "b"} <= set().union(*(s[2][1] for s in steps))
    engine.core.shutdown()
    assert calls[-1] == "shutdown"


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_async_load_finishes_in_an_empty_step(model, async_scheduling):
    engine = build(model, kv_connector="TestRecording", async_scheduling=async_scheduling,
                   kv_connector_extra_config={"external": ["a"]})
    tokens = generate(engine, {"a": prompt_of(0, 10)}, max_tokens=2)
    assert len(tokens["a"]) == 2
    scheduler_side = engine.core.scheduler.get_kv_connector()
    [output] = scheduler_side.outputs
    assert output.finished_recving == {"a"} and output.invalid_block_ids is None
    assert engine.core.scheduler.requests == {}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_failed_loads_are_recomputed(model, async_scheduling):
    prompts = {"a": prompt_of(0, 14), "b": prompt_of(1, 11)}
    expected = generate(build(model), prompts)
    engine = build(model, kv_connector="TestRecording", async_scheduling=async_scheduling,
                   kv_connector_extra_config={"external": ["a", "b"], "fail_loads": True})
    assert generate(engine, prompts) == expected
    scheduler = engine.core.scheduler
    [output] = scheduler.get_kv_connector().outputs
    assert output.finished_recving == {"a", "b"} and len(output.invalid_block_ids) == 3 + 2
    scheduler.kv_cache_manager.check_consistency()
    assert scheduler.kv_cache_manager.num_free_blocks == 64


def test_no_connector_no_connector_output(model):
    engine = build(model)
    assert engine.core.runner.kv_connector is None
    generate(engine, {"a": prompt_of(0, 5)}, max_tokens=2)
