"""The persistent batch: rows added, removed and condensed; one step's flat inputs."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cadence.runner.input_batch import InputBatch, RequestState
from cadence.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_batch(max_num_reqs=4):
    return InputBatch(
        max_num_reqs=max_num_reqs, max_model_len=64, max_blocks_per_req=16, block_size=BLOCK_SIZE
    )


def make_state(req_id, prompt, blocks, num_computed=0, outputs=()):
    return RequestState(
        req_id=req_id, prompt_token_ids=list(prompt), sampling_params=SamplingParams(),
        generator=None, block_ids=list(blocks), num_computed_tokens=num_computed,
        output_token_ids=list(outputs),
    )


def assert_rows_match_states(batch):
    """Every row's arrays mirror its RequestState exactly."""
    for row, state in enumerate(batch.states):
        assert batch.req_id_to_row[state.req_id] == row
        assert batch.known_token_ids(row).tolist() == state.prompt_token_ids + state.output_token_ids
        assert batch.block_table[row, : batch.num_blocks[row]].tolist() == state.block_ids
        assert batch.num_computed_tokens[row] == state.num_computed_tokens
    assert len(batch.req_id_to_row) == batch.num_reqs


def test_remove_moves_the_last_row_into_the_hole():
    batch = make_batch()
    for i, req_id in enumerate("abc"):
        batch.add(make_state(req_id, [10 * i + j for j in range(3 + i)], [i, 7 + i]))
    batch.remove("a")
    assert [s.req_id for s in batch.states] == ["c", "b"]
    assert_rows_match_states(batch)
    batch.remove("b")  # the last row: nothing moves
    assert [s.req_id for s in batch.states] == ["c"]
    assert_rows_match_states(batch)


def test_deltas_update_rows_and_states_together():
    batch = make_batch()
    row = batch.add(make_state("a", [1, 2, 3], [5]))
    batch.append_token_ids(row, [9])
    batch.append_block_ids(row, [6, 2])
    batch.set_num_computed_tokens(row, 3)
    assert_rows_match_states(batch)
    batch.replace_block_ids(row, [11])
    assert batch.states[row].block_ids == [11]
    assert_rows_match_states(batch)


def test_prepare_inputs_for_a_mixed_step():
    batch = make_batch()
    # a: prompt of 10, 4 computed, a chunk of 3 (no sample).
    batch.add(make_state("a", range(100, 110), [7, 3, 9], num_computed=4))
    # b: 6 known (5 prompt + 1 output), 5 computed: one decode token.
    batch.add(make_state("b", range(200, 205), [2, 8], num_computed=5, outputs=[42]))
    # c: 3 known, 2 computed; last token + 2 drafts.
    batch.add(make_state("c", range(300, 303), [4, 6], num_computed=2))
    step = batch.prepare_inputs({"c": 3, "a": 3, "b": 1}, {"c": [55, 56]})
    assert step.req_ids == ["a", "b", "c"]  # batch order, not dict order
    assert step.query_start_loc.tolist() == [0, 3, 4, 7]
    assert step.positions.tolist() == [4, 5, 6, 5, 2, 3, 4]
    assert step.input_ids.tolist() == [104, 105, 106, 42, 302, 55, 56]
    # slot = block_table[pos // 4] * 4 + pos % 4
    assert step.slot_mapping.tolist() == [12, 13, 14, 33, 18, 19, 24]
    assert step.seq_lens.tolist() == [7, 6, 5]
    assert step.does_sample.tolist() == [False, True, True]
    assert step.logits_indices.tolist() == [3, 4, 5, 6]
    assert step.num_drafts.tolist() == [0, 0, 2]
    # Drafts are not known tokens.
    assert batch.num_tokens[2] == 3


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 7), st.integers(1, 5)), max_size=40))
def test_random_adds_and_removes_keep_rows_consistent(ops):
    batch = make_batch(max_num_reqs=8)
    next_id = 0
    for is_add, pick, length in ops:
        if is_add and batch.num_reqs < batch.max_num_reqs:
            prompt = [next_id * 10 + j for j in range(length)]
            batch.add(make_state(f"r{next_id}", prompt, list(range(next_id, next_id + length))))
            next_id += 1
        elif batch.num_reqs:
            victim = batch.states[pick % batch.num_reqs].req_id
            batch.remove(victim)
            assert victim not in batch
        else:
            continue
        assert_rows_match_states(batch)
