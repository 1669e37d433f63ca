"""Invariants on random workloads (hypothesis).

Every step: the token budget and max_num_seqs hold; every block is free,
cached-free or owned, with reference counts equal to its owners. At the end:
all blocks free, usage 0. Greedy streams do not depend on the budget,
chunking, prefix caching, preemption or speculative acceptance.
"""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.core.scheduler_sim import ModelRunnerSim, expected_stream, make_request, make_scheduler, model_token, step
from cadence.config import SpeculativeConfig
from cadence.core.request import RequestStatus

BLOCK_SIZE = 4


@st.composite
def workloads(draw):
    num_requests = draw(st.integers(1, 10))
    shared = draw(st.lists(st.integers(100, 130), min_size=0, max_size=12))
    requests = []
    for i in range(num_requests):
        own = draw(st.lists(st.integers(100, 130), min_size=1, max_size=30))
        prompt = (shared if draw(st.booleans()) else []) + own
        requests.append({
            "id": f"r{i}",
            "prompt": prompt,
            "max_tokens": draw(st.integers(1, 12)),
            "arrival_step": draw(st.integers(0, 8)),
            "abort_step": draw(st.none() | st.integers(0, 20)),
            "priority": draw(st.integers(0, 3)),
        })
    longest = max(len(r["prompt"]) + r["max_tokens"] for r in requests)
    min_blocks = -(-longest // BLOCK_SIZE) + 1
    return {
        "requests": requests,
        "budget": draw(st.integers(4, 80)),
        "max_num_seqs": draw(st.integers(1, 8)),
        "num_blocks": draw(st.integers(min_blocks, min_blocks + 40)),
        "prefix_caching": draw(st.booleans()),
        "policy": draw(st.sampled_from(["fcfs", "priority"])),
        "num_spec": draw(st.integers(0, 3)),
        "draft_accuracy": draw(st.integers(0, 3)),
        "long_prefill_threshold": draw(st.sampled_from([0, 0, 5])),
    }


def make_drafter(num_spec, accuracy):
    """Drafts whose first ``accuracy`` tokens are right, the rest wrong."""
    def draft(req_id, tokens):
        seq, out = list(tokens), []
        for i in range(num_spec):
            tok = model_token(seq) if i < accuracy else 1
            out.append(tok)
            seq.append(tok)
        return out
    return draft


def run_workload(w):
    spec = SpeculativeConfig(num_speculative_tokens=w["num_spec"]) if w["num_spec"] else None
    s = make_scheduler(
        max_num_seqs=w["max_num_seqs"], max_num_batched_tokens=w["budget"],
        num_blocks=w["num_blocks"], block_size=BLOCK_SIZE, prefix_caching=w["prefix_caching"],
        policy=w["policy"], speculative_config=spec,
        long_prefill_token_threshold=w["long_prefill_threshold"],
    )
    runner = ModelRunnerSim(
        BLOCK_SIZE, draft_fn=make_drafter(w["num_spec"], w["draft_accuracy"]) if spec else None
    )
    pending = sorted(w["requests"], key=lambda r: r["arrival_step"])
    streams, finished = {}, {}
    aborted = set()
    for step_index in range(2000):
        while pending and pending[0]["arrival_step"] <= step_index:
            r = pending.pop(0)
            s.add_request(make_request(r["id"], r["prompt"], max_tokens=r["max_tokens"],
                                       priority=r["priority"], arrival_time=step_index))
        for r in w["requests"]:
            if r["abort_step"] == step_index and r["id"] not in finished and r["id"] in s.requests:
                s.finish_requests(r["id"], RequestStatus.FINISHED_ABORTED)
                aborted.add(r["id"])
        if not pending and not s.has_requests():
            break
        so, outputs = step(s, runner)
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        assert so.total_num_scheduled_tokens <= w["budget"]
        assert len(so.num_scheduled_tokens) <= w["max_num_seqs"]
        s.kv_cache_manager.check_consistency()
        for out in outputs:
            streams.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                finished[out.request_id] = out.finish_reason
    else:
        raise AssertionError("workload did not finish")
    kv = s.kv_cache_manager
    assert kv.num_free_blocks == kv.block_pool.num_blocks and kv.usage == 0
    assert not kv.req_to_blocks and not s.requests
    return streams, aborted


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_keep_invariants_and_greedy_streams(w):
    streams, aborted = run_workload(w)
    for r in w["requests"]:
        if r["id"] in aborted:
            expected = expected_stream(r["prompt"], r["max_tokens"])
            assert streams.get(r["id"], []) == expected[: len(streams.get(r["id"], []))]
            continue
        assert streams[r["id"]] == expected_stream(r["prompt"], r["max_tokens"]), r["id"]


@settings(max_examples=40, deadline=None)
@given(workloads(), st.integers(4, 80), st.integers(4, 80))
def test_streams_equal_across_budgets_and_caching(w, budget_a, budget_b):
    w = dict(w, requests=[dict(r, abort_step=None) for r in w["requests"]])
    first, _ = run_workload(dict(w, budget=budget_a, prefix_caching=True))
    second, _ = run_workload(dict(w, budget=budget_b, prefix_caching=False, num_spec=0))
    assert first == second
