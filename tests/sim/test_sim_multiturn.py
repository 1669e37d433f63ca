"""Multi-turn conversations: the workload, the trace fields, and the loop that
sends a later turn after the previous one ended, its history in the prompt."""

import argparse
import json

import pytest
from tests.sim.sim_helpers import LinearCost, configs

from cadence.sim.cli import add_simulate_parser
from cadence.sim.replicas import ReplicaFleet
from cadence.sim.runner import FILLER_TOKEN_ID
from cadence.sim.simulator import Simulator
from cadence.sim.workload import RequestSpec, SyntheticWorkload, read_trace, write_trace

CHAT = dict(num_requests=300, rate=20, prefix_groups=3, prefix_fraction=1.0, prefix_tokens=64,
            prompt_len="lognormal:96:0.3", turn_prompt_len="lognormal:24:0.5", output_len="uniform:8:24",
            think_time="exponential:0.5", max_len=1500, seed=2)


def simulate(specs, **options):
    options.setdefault("max_model_len", 2048)
    simulator = Simulator(*configs(**options), LinearCost())
    added = {}
    add_request = simulator.core.add_request

    def recording_add(request):  # the prompts as the engine got them
        added[int(request.request_id)] = list(request.prompt_token_ids)
        add_request(request)

    simulator.core.add_request = recording_add
    return simulator.run(specs), added


def conversation(spec_lengths, think=1.0, conversation_id=0):
    """Specs of one conversation from (prompt_tokens, output_tokens) per turn."""
    return [RequestSpec(0.0, prompt, output, conversation=conversation_id, turn=turn,
                        think_time_s=think if turn else 0.0)
            for turn, (prompt, output) in enumerate(spec_lengths)]


# ---------------------------------------------------------------- the workload


def test_turns_string_requests_into_conversations_whose_prompts_grow_by_the_history():
    specs = SyntheticWorkload(turns="uniform:2:5", **CHAT).generate()
    assert len(specs) == CHAT["num_requests"]
    by_conversation = {}
    for spec in specs:
        by_conversation.setdefault(spec.conversation, []).append(spec)
    assert max(len(turns) for turns in by_conversation.values()) == 5
    for turns in by_conversation.values():
        assert [s.turn for s in turns] == list(range(len(turns)))
        first = turns[0]
        for before, spec in zip(turns, turns[1:]):
            assert spec.prompt_tokens > before.prompt_tokens + before.output_tokens  # a new message
            assert spec.think_time_s > 0
            # One conversation: one system prompt, client and arrival (the earliest a turn may come).
            assert (spec.prefix_group, spec.prefix_tokens, spec.client, spec.arrival_time) == \
                   (first.prefix_group, first.prefix_tokens, first.client, first.arrival_time)
    assert all(s.prompt_tokens <= CHAT["max_len"] for s in specs)


def test_single_turns_leave_the_workload_as_it_was():
    plain = SyntheticWorkload(**CHAT).generate()
    assert all(s.conversation is None and s.turn == 0 for s in plain)
    # The conversations' own random stream: turn 0 of each is the single request it replaces.
    turn0 = [s for s in SyntheticWorkload(turns="fixed:3", **CHAT).generate() if s.turn == 0]
    assert [(s.prompt_tokens, s.output_tokens, s.prefix_group) for s in turn0] == \
           [(s.prompt_tokens, s.output_tokens, s.prefix_group) for s in plain[::3]][:len(turn0)]


def test_conversations_start_at_rate_over_mean_turns():
    specs = SyntheticWorkload(turns="fixed:4", **{**CHAT, "num_requests": 4000}).generate()
    starts = [s.arrival_time for s in specs if s.turn == 0]
    assert len(starts) == 1000
    assert starts[-1] / len(starts) == pytest.approx(4 / CHAT["rate"], rel=0.1)


def test_workload_options_are_checked():
    with pytest.raises(ValueError, match="turns"):
        SyntheticWorkload(turns="many")
    with pytest.raises(ValueError, match="think_time"):
        SyntheticWorkload(think_time="exponential:-1")
    with pytest.raises(ValueError, match="turn_prompt_len"):
        SyntheticWorkload(turn_prompt_len="fixed")
    with pytest.raises(ValueError, match="conversation"):
        RequestSpec(0.0, 10, 1, turn=1)


def test_the_trace_carries_the_conversation_fields(tmp_path):
    specs = SyntheticWorkload(turns="uniform:1:4", **CHAT).generate()
    path = tmp_path / "chat.jsonl"
    write_trace(path, specs)
    assert read_trace(path) == specs
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert all({"conversation", "turn", "think_time_s"} <= set(row) for row in rows)
    write_trace(path, SyntheticWorkload(**CHAT).generate())  # single requests: no such fields
    assert not any("conversation" in line for line in path.read_text().splitlines())


# ---------------------------------------------------------------- the loop


def test_a_later_turn_holds_the_previous_prompt_and_the_tokens_it_generated():
    specs = conversation([(40, 6), (40 + 6 + 10, 5), (56 + 5 + 3, 4)])
    result, prompts = simulate(specs)
    assert all(result.recorder.finished)
    # The simulated runner's tokens are the filler token; a real model's would be its samples.
    assert prompts[1][:46] == prompts[0] + [FILLER_TOKEN_ID] * 6
    assert prompts[2][:61] == prompts[1] + [FILLER_TOKEN_ID] * 5
    assert [len(p) for p in prompts.values()] == [s.prompt_tokens for s in specs]
    new_messages = prompts[1][46:], prompts[2][61:]
    assert len(new_messages[0]) == 10 and len(new_messages[1]) == 3
    # A new message is the turn's own: it opens with an id of its own (what
    # follows is the maker's run filler), found nowhere in the history before it.
    assert new_messages[0][0] not in prompts[0] and new_messages[1][0] not in prompts[1]
    assert new_messages[0][0] != new_messages[1][0]


def test_a_later_turn_arrives_think_time_after_the_previous_turns_last_token():
    specs = conversation([(40, 6), (56, 5), (64, 4)], think=2.5)
    result, _ = simulate(specs)
    recorder = result.recorder
    for turn in (1, 2):
        assert recorder.arrival[turn] == pytest.approx(recorder.last_token[turn - 1] + 2.5)
        assert recorder.first_token[turn] > recorder.arrival[turn]


def test_a_later_turn_never_arrives_before_its_arrival_time():
    specs = conversation([(40, 2), (50, 2)], think=0.0)
    specs[1] = RequestSpec(30.0, 50, 2, conversation=0, turn=1)
    result, _ = simulate(specs)
    assert result.recorder.arrival[1] == 30.0


def test_shared_prefixes_and_histories_hit_the_prefix_cache():
    single = SyntheticWorkload(**CHAT).generate()
    chat = SyntheticWorkload(turns="uniform:2:6", **CHAT).generate()
    single_hits = simulate(single)[0].summary()["prefix_hit_rate"]
    result, _ = simulate(chat)
    assert single_hits > 0.5  # the system prompts (64 of ~96 tokens), less the first of each group
    assert result.summary()["prefix_hit_rate"] > single_hits + 0.1  # and now the histories
    # Nothing is evicted from this cache: a later turn finds all its history's full
    # blocks but the one holding the last output token (sampled, never computed).
    for index, spec in enumerate(chat):
        if spec.turn:
            before = chat[index - 1]
            history = before.prompt_tokens + before.output_tokens
            assert result.recorder.num_cached[index] >= (history - 1) // 16 * 16


def test_a_refused_turn_ends_its_conversation():
    # Turn 2 is too long for the context, so turns 2 and 3 never run.
    specs = conversation([(40, 6), (56, 5), (100, 4), (110, 2)], conversation_id=7)
    result, prompts = simulate(specs, max_model_len=96)
    assert result.recorder.rejected == [False, False, True, True]
    assert sorted(prompts) == [0, 1] and all(result.recorder.finished[:2])


def test_conversations_are_checked_when_the_run_starts():
    gap = conversation([(40, 6), (56, 5)]) + [RequestSpec(0.0, 80, 2, conversation=0, turn=3)]
    with pytest.raises(ValueError, match=r"conversation 0: turns must be 0, 1, \.\.\."):
        simulate(gap)
    short = conversation([(40, 6), (46, 5)])  # no room for a new message
    with pytest.raises(ValueError, match="new message"):
        simulate(short)


def test_fleets_refuse_later_turns():
    fleet = ReplicaFleet(2, "round_robin", *configs(), LinearCost())
    with pytest.raises(ValueError, match="data_parallel_size: multi-turn"):
        fleet.run(conversation([(40, 6), (56, 5)]))


def test_the_cli_generates_the_options_and_saves_them_in_the_trace(tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="cadence")
    add_simulate_parser(parser.add_subparsers(dest="command", required=True))
    trace = tmp_path / "chat.jsonl"
    args = parser.parse_args(["simulate", "--policy", "fcfs,lpm", "--num-requests", "120", "--rate", "20",
                              "--prefix-groups", "2", "--prefix-fraction", "1", "--prefix-tokens", "64",
                              "--prompt-len", "fixed:96", "--turns", "uniform:2:4", "--turn-prompt-len",
                              "fixed:16", "--output-len", "fixed:8", "--think-time", "fixed:0.5",
                              "--save-trace", str(trace)])
    assert args.func(args) == 0
    assert "prefix hit rate" in capsys.readouterr().out
    assert max(spec.turn for spec in read_trace(trace)) == 3
