"""Prefill/decode disaggregation between two engines in this process (a tiny
random model, KV over ZMQ on loopback): the decode engine's greedy tokens
equal one engine's; failed, late and unwanted transfers end in a local
recompute or a free, never a hang; no block leaks on either side."""

from __future__ import annotations

import io
import random
import socket
import time

import pytest

from cadence.config import EngineOptions
from cadence.core.request import Request, RequestStatus
from cadence.core.kv_transfer.pd_connector import PDOptions, check_kv_transfer_params
from cadence.engine.builder import assemble_engine
from cadence.engine.kv_connectors import kv_transfer_params_checker
from cadence.models.testing import random_model, tiny_config
from cadence.sampling_params import SamplingParams

BLOCK = 4
NUM_BLOCKS = 64
MAX_TOKENS = 6
STEP_DEADLINE_S = 20.0


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_config(), seed=0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build(model, role=None, async_scheduling=False, **extra):
    options = dict(device="cpu", dtype="float32", block_size=BLOCK, num_gpu_blocks=NUM_BLOCKS,
                   max_model_len=128, async_scheduling=async_scheduling)
    if role is not None:
        options["kv_transfer_config"] = {"kv_connector": "PDConnector", "kv_role": role,
                                         "kv_connector_extra_config": extra}
    engine = assemble_engine(EngineOptions.from_kwargs(**options), model, model.config, None,
                             log=io.StringIO())
    return engine.core


@pytest.fixture(params=[False, True], ids=["sync", "async-scheduling"])
def pair(model, request):
    """(prefill core, decode core), the decode side's fetches bounded by 2 s."""
    port = free_port()
    prefill = build(model, "kv_producer", async_scheduling=request.param, kv_port=port)
    decode = build(model, "kv_consumer", async_scheduling=request.param, transfer_timeout_s=2.0)
    yield prefill, decode
    for core in (prefill, decode):
        core.shutdown()


def prompt_of(seed, length):
    rng = random.Random(seed)
    return [rng.randrange(3, 200) for _ in range(length)]


def add(core, req_id, prompt, max_tokens=MAX_TOKENS, kv_transfer_params=None):
    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            extra_args=extra)
    core.add_request(Request(req_id, prompt, params))


def run(*cores, deadline_s=STEP_DEADLINE_S):
    """Step every core until none has work; (tokens, final outputs) by request id."""
    tokens, finals = {}, {}
    deadline = time.monotonic() + deadline_s
    while any(core.has_work() for core in cores):
        assert time.monotonic() < deadline, "the engines did not come to rest"
        for core in cores:
            if not core.has_work():
                continue
            for outputs in core.step().values():
                for out in outputs.outputs:
                    tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                    if out.finish_reason is not None:
                        finals[out.request_id] = out
            core.scheduler.kv_cache_manager.check_consistency()
        time.sleep(0.001)
    return tokens, finals


def at_rest(core) -> bool:
    return not core.scheduler.requests and core.scheduler.kv_cache_manager.usage == 0.0


def prefill_remotely(prefill, req_id, prompt):
    """The prefill engine's kv_transfer_params for ``prompt`` (its blocks held)."""
    add(prefill, req_id, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    for _ in range(50):
        for outputs in prefill.step().values():
            for out in outputs.outputs:
                if out.finish_reason is not None:
                    assert out.kv_transfer_params is not None
                    return out.kv_transfer_params
    raise AssertionError("the prefill did not finish")


@pytest.fixture(scope="module")
def reference(model):
    """One engine's greedy tokens for the prompts of these tests."""
    core = build(model)
    prompts = {f"r{n}": prompt_of(n, n) for n in (1, 4, 13, 30)}
    for req_id, prompt in prompts.items():
        add(core, req_id, prompt)
    tokens, _ = run(core)
    return prompts, tokens


def test_decode_engine_generates_what_one_engine_does(pair, reference):
    prefill, decode = pair
    prompts, expected = reference
    for req_id, prompt in prompts.items():
        params = prefill_remotely(prefill, req_id, prompt)
        assert params["remote_num_tokens"] == len(prompt)
        assert params["remote_block_ids"]
        add(decode, req_id, prompt, kv_transfer_params=params)
    tokens, finals = run(prefill, decode)
    assert tokens == expected
    for req_id, prompt in prompts.items():
        # Loaded: only the last prompt token was computed on the decode side.
        assert finals[req_id].num_cached_tokens == len(prompt) - 1
    assert at_rest(prefill) and at_rest(decode)


def test_a_failed_transfer_recomputes_the_prompt(model, reference):
    """Nobody serves at the address: the load fails by its deadline, the blocks
    are marked invalid, the decode engine computes the prompt itself."""
    prompts, expected = reference
    decode = build(model, "kv_consumer", transfer_timeout_s=0.5)
    prompt = prompts["r13"]
    params = {"do_remote_prefill": True, "remote_request_id": "gone", "remote_host": "127.0.0.1",
              "remote_port": free_port(), "remote_block_ids": [1, 2, 3, 4],
              "remote_num_tokens": len(prompt), "remote_block_size": BLOCK,
              "remote_prompt_digest": _digest(prompt), "remote_engine_id": "x"}
    add(decode, "r13", prompt, kv_transfer_params=params)
    start = time.monotonic()
    tokens, finals = run(decode)
    assert time.monotonic() - start < 5
    assert tokens["r13"] == expected["r13"]
    assert finals["r13"].num_cached_tokens == 0
    assert at_rest(decode)
    decode.shutdown()


def test_unpulled_blocks_are_freed_after_the_hold_timeout(model, reference):
    prompts, expected = reference
    port = free_port()
    prefill = build(model, "kv_producer", kv_port=port, hold_timeout_s=0.3)
    params = prefill_remotely(prefill, "r30", prompts["r30"])
    assert prefill.scheduler.kv_cache_manager.usage > 0  # held for a decoder
    start = time.monotonic()
    run(prefill)  # steps (paced) until the hold expires
    assert 0.2 < time.monotonic() - start < 5
    assert at_rest(prefill)
    # A decoder that comes late is told at once; it computes the prompt itself.
    decode = build(model, "kv_consumer", transfer_timeout_s=5.0)
    add(decode, "r30", prompts["r30"], kv_transfer_params=params)
    start = time.monotonic()
    tokens, finals = run(prefill, decode)
    assert time.monotonic() - start < 4
    assert tokens["r30"] == expected["r30"] and finals["r30"].num_cached_tokens == 0
    assert at_rest(decode)
    for core in (prefill, decode):
        core.shutdown()


def test_another_prompt_is_computed_locally_and_frees_the_peer(pair, reference):
    prefill, decode = pair
    prompts, expected = reference
    params = prefill_remotely(prefill, "x", prompts["r13"][:-1] + [7])
    add(decode, "r13", prompts["r13"], kv_transfer_params=params)
    tokens, finals = run(prefill, decode, deadline_s=5.0)  # far below the 120 s hold
    assert tokens["r13"] == expected["r13"] and finals["r13"].num_cached_tokens == 0
    assert at_rest(prefill) and at_rest(decode)


def test_abort_while_loading_leaks_nothing(pair, reference):
    prefill, decode = pair
    prompts, _ = reference
    params = prefill_remotely(prefill, "r30", prompts["r30"])
    add(decode, "r30", prompts["r30"], kv_transfer_params=params)
    decode.step()
    assert decode.scheduler.requests["r30"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    decode.abort_requests(["r30"])
    run(prefill, decode)
    assert at_rest(prefill) and at_rest(decode)


def test_a_decode_engine_pulls_only_what_it_has_not_cached(pair, reference):
    prefill, decode = pair
    prompts, expected = reference
    prompt = prompts["r30"]
    add(decode, "warm", prompt[:13], max_tokens=1)  # caches 3 blocks of the prompt
    run(decode)
    params = prefill_remotely(prefill, "r30", prompt)
    transport = decode.runner.kv_connector.transport
    pulled = []
    fetch = transport.fetch
    transport.fetch = lambda address, req_id, block_ids, timeout_s: (
        pulled.append(block_ids) or fetch(address, req_id, block_ids, timeout_s))
    add(decode, "r30", prompt, kv_transfer_params=params)
    tokens, finals = run(prefill, decode)
    assert tokens["r30"] == expected["r30"]
    assert finals["r30"].num_cached_tokens == len(prompt) - 1
    assert pulled == [params["remote_block_ids"][3:]]  # 30 tokens: blocks 3..7
    assert at_rest(prefill) and at_rest(decode)


def test_a_taken_kv_port_is_named(model):
    port = free_port()
    first = build(model, "kv_producer", kv_port=port)
    with pytest.raises(ValueError, match="kv_connector_extra_config.kv_port: cannot serve"):
        build(model, "kv_producer", kv_port=port)
    first.shutdown()


def test_params_are_checked():
    with pytest.raises(ValueError, match="kv_transfer_params: do_remote_prefill needs"):
        check_kv_transfer_params({"do_remote_prefill": True}, "kv_consumer")
    with pytest.raises(ValueError, match="kv_transfer_params: do_remote_decode asks a prefill"):
        check_kv_transfer_params({"do_remote_decode": True}, "kv_consumer")
    with pytest.raises(ValueError, match="kv_transfer_params: must be an object"):
        check_kv_transfer_params([1], "kv_both")
    with pytest.raises(ValueError, match="kv_connector_extra_config.kv_prot: unknown"):
        PDOptions.from_extra({"kv_prot": 1})
    with pytest.raises(ValueError, match="kv_connector_extra_config.hold_timeout_s"):
        PDOptions.from_extra({"hold_timeout_s": 0})
    assert kv_transfer_params_checker(None) is None


def test_an_engine_without_the_connector_refuses_params(model):
    core = build(model)
    with pytest.raises(ValueError, match="kv_transfer_params"):
        add(core, "a", [5, 6, 7], kv_transfer_params={"do_remote_decode": True})
    assert not core.has_work()


def _digest(prompt):
    from cadence.core.kv_transfer.pd_connector import prompt_digest
    return prompt_digest(prompt)


def test_a_random_mix_leaks_nothing_and_keeps_greedy_tokens(model):
    """Requests loaded from the peer, computed alone, pointed at a dead peer,
    and aborted, interleaved; the caches stay consistent every step."""
    rng = random.Random(7)
    prompts = {f"m{i}": prompt_of(100 + i, rng.randint(1, 40)) for i in range(12)}
    plain = build(model)
    for req_id, prompt in prompts.items():
        add(plain, req_id, prompt)
    expected, _ = run(plain)
    prefill = build(model, "kv_producer", kv_port=free_port(), hold_timeout_s=2.0)
    decode = build(model, "kv_consumer", transfer_timeout_s=0.5)
    kinds = dict(zip(prompts, ["pulled", "alone", "dead-peer", "aborted"] * 3))
    for req_id, prompt in prompts.items():
        params = None
        if kinds[req_id] in ("pulled", "aborted"):
            params = prefill_remotely(prefill, req_id, prompt)
        elif kinds[req_id] == "dead-peer":
            params = {**prefill_remotely(prefill, req_id, prompt), "remote_port": free_port()}
        add(decode, req_id, prompt, kv_transfer_params=params)
    first = [out for outputs in decode.step().values() for out in outputs.outputs]
    decode.abort_requests([r for r, kind in kinds.items() if kind == "aborted"])
    tokens, _ = run(prefill, decode)
    for out in reversed(first):
        tokens[out.request_id] = out.new_token_ids + tokens.get(out.request_id, [])
    for req_id, kind in kinds.items():
        if kind != "aborted":
            assert tokens[req_id] == expected[req_id], (req_id, kind)
    assert at_rest(prefill) and at_rest(decode)
    for core in (plain, prefill, decode):
        core.shutdown()
