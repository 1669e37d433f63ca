"""ModelRunner driven by hand-built SchedulerOutputs, checked against dense recompute."""

from __future__ import annotations

import random

import pytest
import torch

from cadence.config import SpeculativeConfig
from cadence.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from cadence.models.attention_ref import ReferenceAttention
from cadence.models.testing import random_model, tiny_config
from cadence.runner.model_runner import ModelRunner
from cadence.runner.step_sampling import accept_drafts
from cadence.runner.ngram_drafter import NgramDrafter
from cadence.sampling_params import SamplingParams

BLOCK_SIZE = 4
NUM_BLOCKS = 128
GREEDY = SamplingParams(temperature=0.0, max_tokens=None)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return random_model(tiny_config(), seed=0)


def make_runner(model, *, speculative_config=None, dtype=torch.float32):
    return ModelRunner(
        model, model.config, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, dtype=dtype,
        max_num_seqs=8, max_model_len=256, speculative_config=speculative_config,
    )


def prompt_of(seed, length):
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(length)]


@torch.inference_mode()
def dense_greedy(model, prompt, num_tokens):
    """Full recompute each token, dense attention: the obviously-right answer."""
    tokens = list(prompt)
    for _ in range(num_tokens):
        hidden = model(torch.tensor(tokens), torch.arange(len(tokens)), ReferenceAttention())
        tokens.append(int(model.compute_logits(hidden[-1:]).argmax()))
    return tokens[len(prompt):]


class HandScheduler:
    """A minimal stand-in for the real scheduler, so each test states its schedule.

    Allocates shuffled blocks, sends each request's data once then deltas, and
    absorbs the runner's sampled tokens (rolling back rejected drafts).
    """

    def __init__(self, runner, seed=0):
        self.runner = runner
        self.free_blocks = list(range(NUM_BLOCKS))
        random.Random(seed).shuffle(self.free_blocks)
        self.reqs = {}
        self.finished, self.preempted = set(), set()
        self.resumed = set()

    def add(self, req_id, prompt, params=GREEDY, *, shared_blocks=(), num_computed=0):
        self.reqs[req_id] = dict(
            prompt=list(prompt), outputs=[], params=params, computed=num_computed,
            blocks=list(shared_blocks), sent=False, drafts=[],
        )

    def tokens(self, req_id):
        req = self.reqs[req_id]
        return req["prompt"] + req["outputs"]

    def step(self, num_tokens=None, *, drafts=None):
        """Schedule ``num_tokens`` {req_id: n} (default: every request catches up)."""
        drafts = drafts or {}
        if num_tokens is None:
            num_tokens = {r: len(self.tokens(r)) - q["computed"] + len(drafts.get(r, []))
                          for r, q in self.reqs.items()}
        new_reqs, cached = [], CachedRequestData()
        for req_id, n in num_tokens.items():
            req = self.reqs[req_id]
            new_blocks = self._allocate(req, req["computed"] + n)
            if not req["sent"]:
                req["sent"] = True
                new_reqs.append(NewRequestData(
                    req_id, req["prompt"], req["params"], list(req["blocks"]), req["computed"],
                    output_token_ids=list(req["outputs"]),
                ))
                continue
            resumed = req_id in self.resumed
            self.resumed.discard(req_id)
            cached.req_ids.append(req_id)
            cached.resumed_from_preemption.append(resumed)
            cached.new_block_ids.append(list(req["blocks"]) if resumed else new_blocks)
            cached.num_computed_tokens.append(req["computed"])
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached,
            num_scheduled_tokens=dict(num_tokens), total_num_scheduled_tokens=sum(num_tokens.values()),
            scheduled_spec_decode_tokens={r: d for r, d in drafts.items() if r in num_tokens},
            finished_req_ids=self.finished, preempted_req_ids=self.preempted,
        )
        self.finished, self.preempted = set(), set()
        result = self.runner.execute_model(output)
        self._absorb(output, result)
        return result

    def _allocate(self, req, num_tokens):
        new = []
        while len(req["blocks"]) * BLOCK_SIZE < num_tokens:
            new.append(self.free_blocks.pop())
            req["blocks"].append(new[-1])
        return new

    def _absorb(self, output, result):
        for req_id, n in output.num_scheduled_tokens.items():
            req = self.reqs[req_id]
            sampled = result.sampled_token_ids[result.req_id_to_index[req_id]]
            num_drafts = len(output.scheduled_spec_decode_tokens.get(req_id, []))
            req["computed"] += n - (num_drafts + 1 - len(sampled) if num_drafts else 0)
            req["outputs"] += sampled
            if result.spec_token_ids is not None:
                req["drafts"] = result.spec_token_ids[result.req_id_to_index[req_id]]

    def finish(self, req_id):
        req = self.reqs.pop(req_id)
        self.free_blocks += req["blocks"]
        self.finished.add(req_id)

    def preempt(self, req_id, *, resend_as_new=False):
        req = self.reqs[req_id]
        self.free_blocks += req["blocks"]
        req["blocks"], req["computed"] = [], 0
        self.preempted.add(req_id)
        if resend_as_new:
            req["sent"] = False  # comes back as NewRequestData with its outputs
        else:
            self.resumed.add(req_id)

    def decode(self, num_steps, req_ids=None):
        for _ in range(num_steps):
            self.step({r: 1 for r in (req_ids or self.reqs)})

    def outputs(self, req_id):
        return self.reqs[req_id]["outputs"]


def test_greedy_matches_dense_recompute(model):
    sched = HandScheduler(make_runner(model))
    prompt = prompt_of(0, 13)
    sched.add("a", prompt)
    sched.step()
    sched.decode(9)
    assert sched.outputs("a") == dense_greedy(model, prompt, 10)


def test_chunked_prefill_matches_one_shot(model):
    prompt = prompt_of(1, 23)
    sched = HandScheduler(make_runner(model))
    sched.add("a", prompt)
    assert sched.step({"a": 7}).sampled_token_ids == [[]]
    assert sched.step({"a": 9}).sampled_token_ids == [[]]
    sched.step({"a": 7})
    sched.decode(5)
    assert sched.outputs("a") == dense_greedy(model, prompt, 6)


def test_batched_requests_equal_each_alone(model):
    prompts = {"a": prompt_of(2, 5), "b": prompt_of(3, 17), "c": prompt_of(4, 30)}
    sched = HandScheduler(make_runner(model), seed=1)
    sched.add("a", prompts["a"])
    sched.add("b", prompts["b"])
    sched.step({"a": 5, "b": 10})  # a prefills whole, b a first chunk
    sched.add("c", prompts["c"])
    sched.step({"a": 1, "b": 7, "c": 30})  # a decode + two prefills in one step
    sched.decode(6)
    for req_id, prompt in prompts.items():
        n = len(sched.outputs(req_id))
        assert sched.outputs(req_id) == dense_greedy(model, prompt, n), req_id


def test_unscheduled_request_waits_and_finished_request_leaves(model):
    runner = make_runner(model)
    sched = HandScheduler(runner)
    sched.add("a", prompt_of(5, 6))
    sched.add("b", prompt_of(6, 9))
    sched.step()
    sched.decode(3, ["a"])  # b stays in the batch, idle
    sched.finish("a")
    sched.decode(4, ["b"])
    assert "a" not in runner.requests and runner.input_batch.num_reqs == 1
    assert sched.outputs("b") == dense_greedy(model, prompt_of(6, 9), 5)


@pytest.mark.parametrize("how", ["resumed", "sent_anew"])
def test_preempt_and_resume_continues_identically(model, how):
    prompts = {"a": prompt_of(7, 11), "s": prompt_of(21, 9)}
    seeded = SamplingParams(temperature=1.0, seed=99, max_tokens=None)

    def start(sched):
        sched.add("a", prompts["a"])
        sched.add("s", prompts["s"], seeded)
        sched.add("b", prompt_of(8, 5))
        sched.step()
        sched.decode(3)

    reference = HandScheduler(make_runner(model))
    start(reference)
    reference.decode(4)

    sched = HandScheduler(make_runner(model))
    start(sched)
    for req_id in prompts:
        sched.preempt(req_id, resend_as_new=how == "sent_anew")
    sched.decode(2, ["b"])  # a and s are out of the batch
    num_known = {r: len(sched.tokens(r)) for r in prompts}
    sched.step({"a": 8, "s": 8, "b": 1})  # recompute prompt + outputs in chunks
    assert all(len(sched.outputs(r)) == 4 for r in prompts)  # nothing sampled mid-recompute
    sched.step({"a": num_known["a"] - 8, "s": num_known["s"] - 8, "b": 1})
    sched.decode(3)
    assert sched.outputs("a") == dense_greedy(model, prompts["a"], 8)
    for req_id in prompts:
        assert sched.outputs(req_id) == reference.outputs(req_id), req_id


@pytest.mark.parametrize("same_step", [False, True])
def test_prefix_computed_by_another_request(model, same_step):
    shared = prompt_of(9, 2 * BLOCK_SIZE)
    prompt_a, prompt_b = shared + prompt_of(10, 5), shared + prompt_of(11, 3)
    sched = HandScheduler(make_runner(model))
    sched.add("a", prompt_a)
    if not same_step:
        sched.step()
    a_blocks = sched.reqs["a"]["blocks"] or [sched.free_blocks.pop(), sched.free_blocks.pop()]
    sched.reqs["a"]["blocks"] = a_blocks
    # b's first two blocks are a's: their KV counts as computed for b.
    sched.add("b", prompt_b, shared_blocks=a_blocks[:2], num_computed=2 * BLOCK_SIZE)
    sched.step({"b": 3, "a": len(prompt_a)} if same_step else {"b": 3, "a": 1})
    sched.decode(4)
    assert sched.outputs("b") == dense_greedy(model, prompt_b, 5)
    assert sched.outputs("a") == dense_greedy(model, prompt_a, len(sched.outputs("a")))


def test_seeded_sampling_independent_of_batch(model):
    params = SamplingParams(temperature=1.0, top_k=50, seed=1234, max_tokens=None)
    prompt = prompt_of(12, 9)

    def run(with_others):
        sched = HandScheduler(make_runner(model), seed=3)
        if with_others:
            sched.add("x", prompt_of(13, 4), SamplingParams(temperature=0.8))
            sched.add("y", prompt_of(14, 7), SamplingParams(temperature=1.0, seed=7))
        sched.add("s", prompt, params)
        sched.step()
        sched.decode(8)
        return sched.outputs("s")

    alone = run(False)
    assert alone == run(True)
    assert len(set(alone)) > 1


def test_logprobs_and_prompt_logprobs(model):
    prompt = prompt_of(15, 10)
    params = SamplingParams(temperature=0.0, logprobs=3, prompt_logprobs=2)
    sched = HandScheduler(make_runner(model))
    sched.add("a", prompt, params)
    first = sched.step({"a": 6})
    second = sched.step({"a": 4})
    assert first.logprobs is None or first.logprobs.rows_of(0).logprob_token_ids == []
    with torch.inference_mode():
        hidden = model(torch.tensor(prompt), torch.arange(len(prompt)), ReferenceAttention())
        expected = model.compute_logits(hidden).log_softmax(-1)  # [P, V]
    rows = first.prompt_logprobs_dict["a"].logprobs + second.prompt_logprobs_dict["a"].logprobs
    ids = first.prompt_logprobs_dict["a"].logprob_token_ids + second.prompt_logprobs_dict["a"].logprob_token_ids
    assert len(rows) == len(prompt) - 1 and all(len(r) == 3 for r in rows)
    for p, (row_ids, row) in enumerate(zip(ids, rows)):
        assert row_ids[0] == prompt[p + 1]
        assert row[0] == pytest.approx(float(expected[p, prompt[p + 1]]), abs=1e-4)
    sampled = second.sampled_token_ids[0][0]
    lp = second.logprobs
    assert lp.logprob_token_ids[0][0] == sampled == lp.logprob_token_ids[0][1]
    assert lp.sampled_token_ranks == [1] and len(lp.logprobs[0]) == 4
    assert lp.logprobs[0][0] == pytest.approx(float(expected[-1].max()), abs=1e-4)


def test_every_accepted_draft_gets_its_logprobs(model):
    """A step that accepts drafts reports a logprobs row for each token it
    yields (each the target's own distribution at that position), at the
    request's offsets; a request without logprobs has no rows."""
    prompt = prompt_of(16, 8)
    truth = dense_greedy(model, prompt, 8)
    with_logprobs = SamplingParams(temperature=0.0, logprobs=2, max_tokens=None)
    sched = HandScheduler(make_runner(model))
    sched.add("plain", prompt_of(22, 5))
    sched.add("a", prompt, with_logprobs)
    sched.add("b", prompt_of(21, 6), with_logprobs)
    sched.step()
    out = sched.step(drafts={"a": truth[1:3] + [(truth[3] + 1) % 256]})  # 2 accepted + correction
    index = out.req_id_to_index
    assert out.sampled_token_ids[index["a"]] == truth[1:4]
    assert out.logprobs.rows_of(index["plain"]).logprob_token_ids == []
    assert len(out.logprobs.rows_of(index["b"]).logprob_token_ids) == 1
    rows = out.logprobs.rows_of(index["a"])
    assert [r[0] for r in rows.logprob_token_ids] == truth[1:4]
    assert all(len(r) == 3 for r in rows.logprobs)  # the sampled token, then the top 2
    sequence = prompt + truth[:3]
    with torch.inference_mode():
        hidden = model(torch.tensor(sequence), torch.arange(len(sequence)), ReferenceAttention())
        expected = model.compute_logits(hidden).log_softmax(-1)
    for j, row in enumerate(rows.logprobs):  # truth[j + 1] follows sequence[:len(prompt) + j + 1]
        assert row[0] == pytest.approx(float(expected[len(prompt) + j, truth[j + 1]]), abs=1e-4)
    assert rows.sampled_token_ranks == [1, 1, 1]


def test_empty_step_returns_empty_output(model):
    sched = HandScheduler(make_runner(model))
    out = sched.step({})
    assert out.req_ids == [] and out.sampled_token_ids == []


def test_accept_drafts():
    assert accept_drafts([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]
    assert accept_drafts([5, 6, 7], [5, 9, 7, 8]) == [5, 9]
    assert accept_drafts([5], [4, 1]) == [4]
    assert accept_drafts([], [3]) == [3]


def test_hand_made_drafts_verify_to_the_greedy_stream(model):
    prompt = prompt_of(16, 8)
    truth = dense_greedy(model, prompt, 12)
    sched = HandScheduler(make_runner(model))
    sched.add("a", prompt)
    sched.step()  # -> truth[0]
    # All right: 3 accepted + bonus.
    out = sched.step(drafts={"a": truth[1:4]})
    assert out.sampled_token_ids == [truth[1:5]]
    # Wrong at the second draft: 1 accepted + correction.
    out = sched.step(drafts={"a": [truth[5], (truth[6] + 1) % 256, truth[7]]})
    assert out.sampled_token_ids == [truth[5:7]]
    sched.decode(2)
    sched.step(drafts={"a": [(truth[9] + 1) % 256]})
    assert sched.outputs("a") == truth[:10]


def test_ngram_spec_decoding_gives_the_greedy_stream(model):
    runner = make_runner(model, speculative_config=SpeculativeConfig(num_speculative_tokens=3))
    sched = HandScheduler(runner)
    base = prompt_of(17, 6)
    prompts = {"a": base * 3, "b": prompt_of(18, 9) * 2}
    for req_id, prompt in prompts.items():
        sched.add(req_id, prompt)
    sched.step()
    num_accepted = 0
    for _ in range(12):
        drafts = {r: q["drafts"] for r, q in sched.reqs.items() if q["drafts"]}
        before = {r: len(sched.outputs(r)) for r in sched.reqs}
        sched.step(drafts=drafts)
        num_accepted += sum(len(sched.outputs(r)) - before[r] - 1 for r in sched.reqs)
    assert num_accepted > 0  # the drafter did propose tokens the model agreed with
    for req_id, prompt in prompts.items():
        out = sched.outputs(req_id)
        assert out == dense_greedy(model, prompt, len(out)), req_id


def test_random_spec_decoding_is_deterministic_with_a_seed(model):
    params = SamplingParams(temperature=0.7, seed=5, max_tokens=None)

    def run():
        runner = make_runner(model, speculative_config=SpeculativeConfig(num_speculative_tokens=2))
        sched = HandScheduler(runner)
        sched.add("a", prompt_of(19, 5) * 3, params)
        sched.step()
        for _ in range(6):
            drafts = {r: q["drafts"] for r, q in sched.reqs.items() if q["drafts"]}
            sched.step(drafts=drafts)
        return sched.outputs("a")

    assert run() == run()


def test_bfloat16_runs_and_mostly_agrees(model):
    model_bf16 = random_model(tiny_config(), dtype=torch.bfloat16, seed=0)
    sched = HandScheduler(make_runner(model_bf16, dtype=torch.bfloat16))
    prompt = prompt_of(20, 12)
    sched.add("a", prompt)
    sched.step({"a": 5})
    sched.step({"a": 7})
    sched.decode(5)
    assert sched.outputs("a") == dense_greedy(model_bf16, prompt, 6)


def test_ngram_drafter():
    drafter = NgramDrafter(num_speculative_tokens=3, min_n=1, max_n=3)
    assert drafter.propose([1, 2, 3, 4, 9, 2, 3]) == [4, 9, 2]
    # The longest n-gram wins over a more recent shorter match.
    assert drafter.propose([1, 2, 3, 7, 5, 3, 8, 1, 2, 3]) == [7, 5, 3]
    # Among equal matches, the most recent.
    assert drafter.propose([5, 1, 6, 5, 2, 7, 5]) == [2, 7, 5]
    assert drafter.propose([1, 2, 3]) == []
    assert drafter.propose([4, 4, 4, 4], max_tokens=2) == [4]  # n=3 match leaves one token
    assert drafter.propose([3, 1, 3], max_tokens=0) == []


@pytest.mark.parametrize("num_blocks,budget,spec", [(200, 64, False), (40, 16, False), (40, 24, True)])
def test_with_the_real_scheduler_greedy_equals_dense(model, num_blocks, budget, spec):
    """Chunking, prefix hits, preemption and drafts from the real scheduler change nothing."""
    from cadence.config import CacheConfig, SchedulerConfig
    from cadence.core.request import Request
    from cadence.core.sched.scheduler import Scheduler

    spec_config = SpeculativeConfig(num_speculative_tokens=3) if spec else None
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=budget, max_model_len=128),
        CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks=num_blocks),
        speculative_config=spec_config,
    )
    runner = ModelRunner(
        model, model.config, block_size=BLOCK_SIZE, num_blocks=num_blocks, dtype=torch.float32,
        max_num_seqs=6, max_model_len=128, speculative_config=spec_config,
    )
    rng = random.Random(num_blocks + budget)
    shared = prompt_of(99, 12)
    prompts = {}
    for i in range(8):
        prompt = (shared if i % 2 else []) + prompt_of(100 + i, rng.randint(3, 30))
        prompts[f"r{i}"] = prompt + prompt[:8] * (i % 3 == 0)  # some repetition for drafts
        params = SamplingParams(temperature=0.0, max_tokens=rng.randint(5, 16), ignore_eos=True)
        scheduler.add_request(Request(f"r{i}", prompts[f"r{i}"], params))
    outputs = {req_id: [] for req_id in prompts}
    while scheduler.has_unfinished_requests():
        scheduler_output = scheduler.schedule()
        runner_output = runner.execute_model(scheduler_output)
        for client_outputs in scheduler.update_from_output(scheduler_output, runner_output).values():
            for out in client_outputs.outputs:
                outputs[out.request_id] += out.new_token_ids
    for req_id, prompt in prompts.items():
        assert outputs[req_id] == dense_greedy(model, prompt, len(outputs[req_id])), req_id


def test_sliding_window_matches_dense_windowed_recompute():
    window = 6
    model = random_model(tiny_config(sliding_window=window), seed=1)

    def windowed_attention(layer_idx, q, k, v):  # whole sequence at once
        pos = torch.arange(q.shape[0])
        mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, enable_gqa=True
        )
        return out.transpose(0, 1)

    prompt = prompt_of(22, 17)
    expected = list(prompt)
    with torch.inference_mode():
        for _ in range(6):
            hidden = model(torch.tensor(expected), torch.arange(len(expected)), windowed_attention)
            expected.append(int(model.compute_logits(hidden[-1:]).argmax()))
    sched = HandScheduler(make_runner(model))
    sched.add("a", prompt)
    sched.step({"a": 11})  # a long chunk, then a short one past the window
    sched.step({"a": 6})
    sched.decode(5)
    assert sched.outputs("a") == expected[len(prompt):]


def first_token(runner, prompt, params, eos_token_id):
    new = NewRequestData("a", prompt, params, list(range(4)), 0, eos_token_id=eos_token_id)
    out = runner.execute_model(SchedulerOutput(
        scheduled_new_reqs=[new], scheduled_cached_reqs=CachedRequestData(),
        num_scheduled_tokens={"a": len(prompt)}, total_num_scheduled_tokens=len(prompt)))
    return out.sampled_token_ids[0][0]


@torch.inference_mode()
def test_min_tokens_keeps_eos_and_stop_tokens_from_being_sampled(model):
    prompt = prompt_of(11, 9)
    hidden = model(torch.tensor(prompt), torch.arange(len(prompt)), ReferenceAttention())
    ranked = model.compute_logits(hidden[-1:])[0].argsort(descending=True).tolist()
    best, second, third = ranked[:3]
    plain = SamplingParams(temperature=0.0, max_tokens=None)
    assert first_token(make_runner(model), prompt, plain, eos_token_id=best) == best
    held = SamplingParams(temperature=0.0, max_tokens=None, min_tokens=2, stop_token_ids=[second])
    # EOS (best) and the stop token (second) are masked: the third choice wins.
    assert first_token(make_runner(model), prompt, held, eos_token_id=best) == third
