"""Workloads: synthetic distributions, JSONL traces, prompt tokens."""

import json

import pytest

from cadence.sim.workload import PromptMaker, RequestSpec, SyntheticWorkload, read_trace, write_trace


def test_trace_jsonl_round_trip(tmp_path):
    specs = SyntheticWorkload(num_requests=50, rate=5, prefix_groups=3, priorities="0,1,2",
                              num_clients=4, seed=7).generate()
    path = tmp_path / "trace.jsonl"
    write_trace(path, specs)
    assert read_trace(path) == specs
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert all({"arrival_time", "prompt_tokens", "output_tokens"} <= set(row) for row in rows)
    assert any("prefix_group" in row for row in rows) and any("prefix_group" not in row for row in rows)


def test_trace_with_only_the_required_fields_and_defaults(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"arrival_time": 1.5, "prompt_tokens": 10, "output_tokens": 3}\n\n'
                    '{"arrival_time": 0.5, "prompt_tokens": 8, "output_tokens": 2, "prefix_group": 4, "client": 2}\n')
    assert read_trace(path) == [
        RequestSpec(0.5, 8, 2, prefix_group=4, prefix_tokens=4, client=2),  # sorted by arrival
        RequestSpec(1.5, 10, 3),
    ]
    path.write_text('{"arrival_time": 1.5, "prompt_tokens": 10}\n')
    with pytest.raises(ValueError, match="output_tokens"):
        read_trace(path)


def test_synthetic_is_seeded_and_follows_its_rate():
    workload = SyntheticWorkload(num_requests=4000, rate=20, seed=1)
    specs = workload.generate()
    assert specs == workload.generate()
    assert specs != SyntheticWorkload(num_requests=4000, rate=20, seed=2).generate()
    times = [s.arrival_time for s in specs]
    assert times == sorted(times) and times[0] == 0.0
    assert times[-1] / len(times) == pytest.approx(1 / 20, rel=0.05)
    mean_prompt = sum(s.prompt_tokens for s in specs) / len(specs)
    assert mean_prompt == pytest.approx(512, rel=0.1)


def test_gamma_arrivals_are_burstier_than_poisson():
    def gap_cv(arrival, burstiness):
        specs = SyntheticWorkload(num_requests=4000, rate=10, arrival=arrival, burstiness=burstiness).generate()
        gaps = [b.arrival_time - a.arrival_time for a, b in zip(specs, specs[1:])]
        mean = sum(gaps) / len(gaps)
        return (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5 / mean

    assert gap_cv("poisson", 1.0) == pytest.approx(1.0, abs=0.1)
    assert gap_cv("gamma", 0.25) == pytest.approx(2.0, abs=0.3)  # cv = 1/sqrt(shape)


def test_length_distributions():
    specs = SyntheticWorkload(num_requests=500, prompt_len="fixed:77", output_len="uniform:5:9").generate()
    assert {s.prompt_tokens for s in specs} == {77}
    assert {s.output_tokens for s in specs} == set(range(5, 10))
    with pytest.raises(ValueError, match="length distribution"):
        SyntheticWorkload(prompt_len="zipf:2")


def test_prompt_maker_shares_group_prefixes_only():
    maker = PromptMaker()
    a = maker.make(0, RequestSpec(0, 40, 1, prefix_group=1, prefix_tokens=30))
    b = maker.make(1, RequestSpec(0, 50, 1, prefix_group=1, prefix_tokens=30))
    c = maker.make(2, RequestSpec(0, 50, 1, prefix_group=2, prefix_tokens=30))
    d = maker.make(3, RequestSpec(0, 50, 1))
    assert (len(a), len(b), len(c), len(d)) == (40, 50, 50, 50)
    # Prompts share leading ids exactly as far as their group prefix.
    assert _common_prefix(a, b) == 30
    assert _common_prefix(a, c) == _common_prefix(a, d) == _common_prefix(c, d) == 0
    assert _common_prefix(b[30:], maker.make(4, RequestSpec(0, 50, 1, prefix_group=1, prefix_tokens=30))[30:]) == 0


def test_simulated_outputs_never_continue_a_prompt_run():
    """A request whose prompt is a group prefix cut short must not find the
    rest of that prefix in its own outputs."""
    from cadence.sim.runner import FILLER_TOKEN_ID

    maker = PromptMaker()
    short = maker.make(0, RequestSpec(0, 20, 8, prefix_group=1, prefix_tokens=20))
    whole = maker.make(1, RequestSpec(0, 40, 1, prefix_group=1, prefix_tokens=30))
    assert _common_prefix(short + [FILLER_TOKEN_ID] * 8, whole) == 20


def _common_prefix(x: list[int], y: list[int]) -> int:
    n = 0
    while n < min(len(x), len(y)) and x[n] == y[n]:
        n += 1
    return n


def test_prompt_maker_for_a_real_vocabulary_is_reproducible():
    spec = RequestSpec(0, 64, 1, prefix_group=0, prefix_tokens=16)
    tokens = PromptMaker(1000, seed=3).make(5, spec)
    assert tokens == PromptMaker(1000, seed=3).make(5, spec)
    assert all(100 <= t < 1000 for t in tokens)
