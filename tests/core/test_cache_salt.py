"""vLLM's ``cache_salt``: requests share cached prefix blocks only when their
salts are equal (no salt shares with no salt), so one tenant cannot learn
another's prompts from cache hits."""

import msgspec
import pytest

from cadence.core.kv_cache import BlockStored
from cadence.core.request import LoRARequest, extra_hash_key_of
from cadence.core.testing import (
    FakeRunner, all_blocks_free, new_request, new_scheduler, prompt_of, run_until_done,
)
from cadence.sampling_params import SamplingParams

PROMPT = prompt_of("shared", 17)  # four full blocks of 4, and one token more


def cached_then_query(first_salt, second_salt, **second):
    """Run a request with ``first_salt`` to the end (its blocks stay cached), then
    ask how many tokens of the same prompt under ``second_salt`` are cached."""
    s = new_scheduler(block_size=4, enable_kv_cache_events=True)
    s.add_request(new_request("first", PROMPT, cache_salt=first_salt))
    run_until_done(s)
    assert all_blocks_free(s)
    later = new_request("second", PROMPT, cache_salt=second_salt, **second)
    _, num_cached = s.kv_cache_manager.get_computed_blocks(later)
    return num_cached, s


@pytest.mark.parametrize("first, second", [(None, None), ("tenant-a", "tenant-a")])
def test_equal_salts_share_cached_blocks(first, second):
    num_cached, _ = cached_then_query(first, second)
    assert num_cached == 16


@pytest.mark.parametrize("first, second", [
    ("tenant-a", "tenant-b"), ("tenant-a", None), (None, "tenant-a"), ("a", "A"),
])
def test_different_salts_never_share(first, second):
    num_cached, _ = cached_then_query(first, second)
    assert num_cached == 0


def test_salt_and_adapter_both_count():
    num_cached, _ = cached_then_query("tenant-a", "tenant-a", lora_id=3)
    assert num_cached == 0
    assert extra_hash_key_of(None, None) is None  # unsalted, base model: as before
    lora = LoRARequest("adapter", 3)
    keys = {extra_hash_key_of(adapter, salt) for adapter in (None, lora) for salt in (None, "x", "y")}
    assert len(keys) == 6


def test_a_salted_request_in_the_scheduler_counts_no_foreign_hits():
    s = new_scheduler(block_size=4)
    runner = FakeRunner(block_size=4, check_kv=True)  # one shadow KV cache for all runs
    s.add_request(new_request("a", PROMPT))
    run_until_done(s, runner)
    cached = {}
    s.add_request(new_request("salted", PROMPT, cache_salt="tenant-b"))
    s.add_request(new_request("plain", PROMPT))
    run_until_done(s, runner, on_step=lambda _: cached.update(
        {r.request_id: r.num_cached_tokens for r in s.requests.values()}))
    # Both ran after "a" had finished: only the unsalted one found its blocks.
    assert cached == {"salted": 0, "plain": 16}
    s.add_request(new_request("salted-again", PROMPT, cache_salt="tenant-b"))
    _, num_cached = s.kv_cache_manager.get_computed_blocks(s.requests["salted-again"])
    assert num_cached == 16  # "salted" left its own blocks, under its salt


def test_n_above_one_keeps_the_salt_in_every_sample():
    s = new_scheduler(block_size=4)
    s.add_request(new_request("p", PROMPT, n=3, cache_salt="tenant-a"))
    run_until_done(s)
    plain = new_request("plain", PROMPT)
    assert s.kv_cache_manager.get_computed_blocks(plain) == ([], 0)
    salted = new_request("salted", PROMPT, cache_salt="tenant-a")
    assert s.kv_cache_manager.get_computed_blocks(salted)[1] == 16


def test_events_carry_a_digest_of_the_salt_not_the_salt():
    _, s = cached_then_query("a-secret-salt", "a-secret-salt")
    stored = [e for e in s.take_kv_events() if isinstance(e, BlockStored)]
    assert stored
    for event in stored:
        assert "a-secret-salt" not in str(event.extra_key)
        # A router rebuilds hashes from the event after msgpack: the key stays hashable.
        again = msgspec.msgpack.decode(msgspec.msgpack.encode(event), type=BlockStored)
        hash(again.extra_key)


@pytest.mark.parametrize("salt", ["", 5, "x" * 1025, "\ud800"])
def test_a_bad_salt_is_refused_naming_the_field(salt):
    with pytest.raises(ValueError, match="^cache_salt: "):
        SamplingParams(cache_salt=salt)
