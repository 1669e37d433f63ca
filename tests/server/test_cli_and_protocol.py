"""No server needed: the generated CLI, OpenAI-parameter mapping, the wire format,
and the benchmark's arithmetic."""

from __future__ import annotations

import argparse
import math

import msgspec
import pytest

from cadence.config import EngineOptions
from cadence.core.outputs import EngineCoreOutput, EngineCoreOutputs, LogprobsLists, SchedulerStats
from cadence.core.request import FinishReason, Request
from cadence.engine import wire
from cadence.sampling_params import SamplingParams
from cadence.server.bench import arrival_gaps, percentiles
from cadence.server.cli import (
    add_bench_serve_parser,
    add_serve_parser,
    build_parser,
    server_config_from_args,
    serving_engine_options,
    serving_threads,
)
from cadence.server.errors import field_of
from cadence.server.protocol import ChatCompletionRequest, CompletionRequest


def test_serve_parser_defaults_and_engine_options():
    parser = argparse.ArgumentParser(prog="cadence")
    sub = parser.add_subparsers(dest="command")
    add_serve_parser(sub)
    args = parser.parse_args(["serve", "--max-num-seqs", "4", "--no-enable-prefix-caching"])
    config = server_config_from_args(args)
    assert (config.host, config.port) == ("127.0.0.1", 8000)
    from cadence.config_cli import options_of

    options = EngineOptions.from_kwargs(**options_of(args))
    assert options.scheduler.max_num_seqs == 4 and not options.cache.enable_prefix_caching
    assert options.engine.model is None
    help_text = sub.choices["serve"].format_help()
    assert "--max-num-queued-requests" in help_text and "Token budget of one step" in help_text


def test_serve_takes_a_step_time_target_and_every_core():
    parser = argparse.ArgumentParser(prog="cadence")
    add_serve_parser(parser.add_subparsers(dest="command"))
    options = [serving_engine_options(parser.parse_args(["serve", *flags]))
               for flags in ([], ["--step-time-target-s", "0.08", "--step-time-max-wait-s", "1"],
                             ["--step-time-target-s", "0"])]
    assert [(o.scheduler.step_time_target_s, o.scheduler.step_time_target_solo_steps,
             o.scheduler.step_time_max_wait_s) for o in options] == [
        (0.045, 6.0, 0.5), (0.08, 6.0, 1.0), (0, None, None)]
    assert options[0].engine.num_threads == serving_threads()


def test_bench_parser():
    parser = argparse.ArgumentParser(prog="cadence bench")
    add_bench_serve_parser(parser.add_subparsers(dest="bench_command"))
    args = parser.parse_args(["serve", "--rate", "2", "--num-prompts", "8"])
    assert args.rate == 2.0 and args.num_prompts == 8 and args.base_url == "http://127.0.0.1:8000"
    assert build_parser().parse_args(["bench", "serve"]).rate == math.inf


def test_chat_parameter_mapping():
    body = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                                 max_completion_tokens=7, max_tokens=99, logprobs=True, top_logprobs=3,
                                 stop="END", seed=5, presence_penalty=0.5)
    params = body.to_sampling_params()
    assert (params.max_tokens, params.logprobs, params.stop, params.seed) == (7, 3, ("END",), 5)
    assert params.presence_penalty == 0.5 and params.temperature == 1.0
    assert body.conversation() == [{"role": "user", "content": "hi"}]
    assert ChatCompletionRequest(messages=[{"role": "user", "content": "x"}]).to_sampling_params().max_tokens is None


def test_completion_parameter_mapping():
    body = CompletionRequest(prompt=[[1, 2], [3]], logprobs=2, temperature=0, n=2)
    assert body.prompts() == [[1, 2], [3]]
    params = body.to_sampling_params()
    assert (params.logprobs, params.n, params.is_greedy, params.max_tokens) == (2, 2, True, 16)
    assert CompletionRequest(prompt=[5, 6]).prompts() == [[5, 6]]
    with pytest.raises(ValueError, match="^logprobs:"):
        CompletionRequest(prompt="x", logprobs=21).to_sampling_params()
    with pytest.raises(ValueError, match="suffix: not supported"):  # fields.py's rule
        CompletionRequest(prompt="x", suffix="y")
    echoed = CompletionRequest(prompt="x", echo=True, logprobs=2, prompt_logprobs=1).to_sampling_params()
    assert (echoed.logprobs, echoed.prompt_logprobs) == (2, 2)  # echo scores the prompt as logprobs asks
    assert CompletionRequest(prompt="x", echo=True, max_tokens=0).to_sampling_params().max_tokens == 1
    assert CompletionRequest(prompt="x", cache_salt="s").to_sampling_params().cache_salt == "s"


def test_field_of():
    assert field_of("temperature: must be >= 0") == "temperature"
    assert field_of("structured_outputs.choice: must not be empty") == "structured_outputs.choice"
    assert field_of("something went wrong") is None


def test_wire_roundtrip():
    params = SamplingParams(n=2, stop=["x"], logprobs=1, seed=3, cache_salt="tenant")
    request = wire.EngineCoreRequest("r", [1, 2, 3], params, 2, 123.0, priority=1)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=wire.EngineCoreRequest)
    core_request = decoded.to_request(max_model_len=10)
    assert core_request.sampling_params == params and core_request.priority == 1
    assert core_request.extra_hash_key == Request("u", [1], params).extra_hash_key  # the salt crossed
    assert core_request.extra_hash_key != Request("u", [1], SamplingParams()).extra_hash_key
    assert core_request.max_tokens == 7 and core_request.eos_token_id == 2
    outputs = EngineCoreOutputs(
        outputs=[EngineCoreOutput("r", [4], FinishReason.LENGTH,
                                  new_logprobs=LogprobsLists([[4, 5]], [[-0.1, -2.0]], [1]))],
        scheduler_stats=SchedulerStats(num_running_reqs=1, kv_cache_usage=0.25))
    kind, payload = wire.encode(wire.OUTPUTS, outputs)
    back = wire._decoders[kind].decode(payload)
    assert back.outputs[0].finish_reason is FinishReason.LENGTH
    assert back.outputs[0].new_logprobs == LogprobsLists([[4, 5]], [[-0.1, -2.0]], [1])
    assert back.scheduler_stats.kv_cache_usage == 0.25


def test_arrivals_and_percentiles():
    gaps = arrival_gaps(4.0, 4000, seed=0)
    assert abs(sum(gaps) / len(gaps) - 0.25) < 0.02
    assert arrival_gaps(math.inf, 3, 0) == [0.0, 0.0, 0.0]
    p = percentiles([float(i) for i in range(1, 101)])
    assert p["median"] == pytest.approx(50.5) and p["p99"] == pytest.approx(99.01)
