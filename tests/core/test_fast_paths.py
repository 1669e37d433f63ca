"""The per-step fast paths agree with the general ones they shortcut.

A decode whose token fits its request's last block skips taking blocks (but
still caches a block it fills); a plain one-token update skips the general
bookkeeping; blocks move in and out of the free queue in bulk; block hashes
of many blocks are computed in one pass. None of it may change a result.
"""

import msgspec
from tests.core.scheduler_sim import ModelRunnerSim, make_request, make_scheduler, model_token
from cadence.core.kv_cache import KVCacheManager
from cadence.core.kv_cache.block_pool import FreeBlockQueue, KVCacheBlock
from cadence.core.kv_cache.hashing import (
    ROOT_HASH,
    builtin_block_hash,
    extend_block_hashes,
    sha256_block_hash,
)
from cadence.core.outputs import ModelRunnerOutput
from cadence.core.request import Request
from cadence.sampling_params import SamplingParams


def decode_one(kv: KVCacheManager, request: Request, token: int, lookahead: int = 0) -> list[int] | None:
    """Schedule one decode token, then "sample" ``token`` as the scheduler would."""
    block_ids = kv.allocate_slots(request, 1, num_lookahead_tokens=lookahead)
    request.num_computed_tokens += 1
    request.append_output_token(token)
    return block_ids


def prefilled(kv: KVCacheManager, prompt: list[int]) -> Request:
    request = Request("r", prompt, SamplingParams(max_tokens=100, ignore_eos=True))
    kv.allocate_slots(request, len(prompt))
    request.num_computed_tokens = len(prompt)
    request.append_output_token(0)
    return request


def test_decodes_inside_a_block_take_nothing_and_a_filled_block_is_cached():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    request = prefilled(kv, [1, 2, 3, 4, 5])  # 5 known tokens: block 0 full, block 1 holds 1
    assert len(kv.block_pool.cached_blocks) == 1
    free_before = kv.num_free_blocks
    assert decode_one(kv, request, 7) == []  # position 5 of 8 slots
    assert decode_one(kv, request, 8) == []  # position 6
    assert kv.num_free_blocks == free_before and len(kv.block_pool.cached_blocks) == 1
    assert decode_one(kv, request, 9) == []  # position 7: block 1 now holds 8 known tokens
    assert len(kv.block_pool.cached_blocks) == 2  # cached as soon as it is full
    assert len(decode_one(kv, request, 10)) == 1  # position 8 needs a third block
    assert kv.num_free_blocks == free_before - 1
    kv.check_consistency()


def test_lookahead_slots_count_before_the_block_is_full():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    request = prefilled(kv, [1, 2, 3, 4, 5])
    assert decode_one(kv, request, 7, lookahead=1) == []  # positions 5 and 6
    assert len(decode_one(kv, request, 8, lookahead=2)) == 1  # positions 6..8: a new block


def test_the_fast_path_matches_a_fresh_manager_allocating_the_same_tokens():
    """Blocks held and blocks cached after many decodes equal one big allocation."""
    tokens = list(range(100, 137))
    kv = KVCacheManager(num_blocks=20, block_size=4)
    request = prefilled(kv, tokens[:6])
    for token in tokens[7:]:
        decode_one(kv, request, token)
    kv.allocate_slots(request, 1)  # room for the last known token, as the next step would
    other = KVCacheManager(num_blocks=20, block_size=4)
    same = Request("r", list(request.all_token_ids), SamplingParams(max_tokens=1, ignore_eos=True))
    other.allocate_slots(same, same.num_tokens)
    assert len(kv.req_to_blocks["r"]) == len(other.req_to_blocks["r"])
    assert sorted(kv.block_pool.cached_blocks) == sorted(other.block_pool.cached_blocks)


def test_popleft_n_and_extend_keep_the_queue_order():
    blocks = [KVCacheBlock(i) for i in range(6)]
    queue = FreeBlockQueue(blocks)
    taken = queue.popleft_n(4)
    assert [b.block_id for b in taken] == [0, 1, 2, 3]
    assert [b.block_id for b in queue] == [4, 5] and len(queue) == 2
    queue.extend([taken[2], taken[0]])
    assert [b.block_id for b in queue] == [4, 5, 2, 0] and len(queue) == 4
    assert queue.popleft_n(4) and len(queue) == 0 and list(queue) == []
    queue.extend([])
    assert list(queue) == []


def test_block_hashes_in_one_pass_equal_the_chained_definition():
    tokens = list(range(50))
    for hash_fn in (builtin_block_hash, sha256_block_hash):
        expected, parent = [], ROOT_HASH
        for i in range(50 // 8):
            parent = hash_fn(parent, tuple(tokens[i * 8:(i + 1) * 8]), "x")
            expected.append(parent)
        hashes: list = []
        extend_block_hashes(hashes, tokens, 2, 8, hash_fn, "x")
        extend_block_hashes(hashes, tokens, 6, 8, hash_fn, "x")  # continues the chain
        assert hashes == expected


def test_request_num_tokens_follows_every_append():
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=10))
    request.append_output_token(4)
    request.append_output_token_ids(5)
    request.append_output_token_ids([6, 7])
    assert request.num_tokens == len(request.all_token_ids) == 7
    assert request.num_output_tokens == 4 and request.output_token_ids == [4, 5, 6, 7]


class GeneralPathRunner(ModelRunnerSim):
    """The same model, with a prompt-logprobs entry for no request: the
    scheduler then takes its general path for every request."""

    def execute(self, so) -> ModelRunnerOutput:
        output = super().execute(so)
        output.prompt_logprobs_dict = {"<no request>": None}
        return output


def run_outputs(runner: ModelRunnerSim) -> list:
    s = make_scheduler(block_size=4, num_blocks=40, max_num_batched_tokens=32)
    for i in range(6):
        s.add_request(make_request(f"r{i}", list(range(10 * i, 10 * i + 10 + 3 * i)), max_tokens=5 + i))
    # Two requests that stop on a sampled token: a stop token, and EOS.
    prompt = list(range(200, 209))
    first = model_token(prompt)
    second = model_token(prompt + [first])
    s.add_request(make_request("stop", prompt, max_tokens=20, stop_token_ids=[second]))
    s.add_request(make_request("eos", list(prompt), max_tokens=20, eos_token_id=first))
    outputs = []
    while s.has_requests():
        so = s.schedule()
        result = s.update_from_output(so, runner.execute(so))
        outputs.append({client: [comparable(o) for o in eco.outputs] for client, eco in result.items()})
    return outputs


def comparable(output):
    """The output with its events' timestamps left out (they differ between runs)."""
    events = [e.type for e in output.events] if output.events else output.events
    return msgspec.structs.replace(output, events=events)


def test_plain_decode_outputs_equal_the_general_paths():
    plain, general = run_outputs(ModelRunnerSim(4)), run_outputs(GeneralPathRunner(4))
    assert plain == general
    finished = {o.request_id: o for step in plain for outs in step.values() for o in outs if o.finished}
    assert any(o.events for step in plain for outs in step.values() for o in outs)
    assert str(finished["stop"].finish_reason) == "stop" and finished["stop"].stop_reason is not None
    assert str(finished["eos"].finish_reason) == "stop" and str(finished["r0"].finish_reason) == "length"
