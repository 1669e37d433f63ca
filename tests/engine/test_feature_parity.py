"""Every scheduling and KV-cache feature, on the default model, gives the
plain run's greedy tokens (issue 30).

One fixed workload (``WAVES``: eight prompts of 6 to 167 tokens, three of
them sharing a system prompt of four KV blocks, arriving at fixed steps; 24
new tokens each, float32, greedy, ``ignore_eos``) runs on a plain engine (no prefix
caching, no chunking limits, a cache that never runs out, synchronous) and
then with each feature switched on, one at a time and all together. Every
request's token ids must equal the plain run's, and every run asserts that
its feature really engaged (a hit, a chunk, a cap that held a prompt back, a
displacement, a preemption, a swap, a tier load, an accepted draft, an
overlapped step, a P/D pull): without that, a run could pass vacuously.

Async scheduling is refused with speculative decoding, and one engine has
one KV connector (the host tier or P/D), so "all together" is three runs:
everything with async scheduling, everything with n-gram drafts, and P/D
with everything but the tier and a small cache (see ``PD``).

The whole module is the slice ``make test`` runs: about 35 s on two idle
cores (one engine per run, ~2-3 s each).
"""

from __future__ import annotations

import dataclasses
import time

import pytest

from cadence import LLM, SamplingParams
from cadence.core.outputs import EngineCoreOutput, SchedulerStats
from cadence.core.request import RequestStatus
from cadence.core.testing import all_blocks_free
from cadence.engine.inputs import make_request
from tests.runner.test_pd_disaggregation import free_port

NUM_NEW_TOKENS = 24
SYSTEM = (
    "You are a careful assistant for a school science club. Answer clearly, in complete "
    "sentences, and explain the reasoning behind each answer step by step, with one "
    "concrete example that a curious twelve-year-old could try at home or observe outside, "
    "and say which part of the explanation is the most important to remember. Question:"
)
STORY = ("The old lighthouse stood on the northern cliff for more than a century, guiding "
         "fishing boats home through fog and storms. ") * 6


def flood(first: int) -> str:
    """A prompt of ~160 tokens sharing no block with the others."""
    items = (f"Item {i}: a crate of {i * 7 % 13} apples shipped to harbour {i % 5}."
             for i in range(first, first + 9))
    return "Copy this list: " + " ".join(items)


@dataclasses.dataclass(frozen=True)
class Arrival:
    """A request added once ``at_step`` steps of its wave computed something."""

    req_id: str
    text: str
    priority: int = 1
    at_step: int = 0
    max_tokens: int = NUM_NEW_TOKENS


# A wave starts once the engine is idle. Wave 1 runs concurrently: two long
# prompts at once (caps), one sharing the system prompt three steps later
# (a prefix hit), a better priority six steps in (displacement at a small
# max_num_seqs). Wave 2 floods a small cache (two prompts of ~170 tokens),
# so the system prompt's blocks are evicted from it; wave 3 asks for them
# again (a host-tier hit).
WAVES = [
    [Arrival("sky", SYSTEM + " Why is the sky blue?"),
     Arrival("haiku", "Write a haiku about the sea."),
     Arrival("story", "Summarise this story: " + STORY),
     Arrival("plants", SYSTEM + " How do plants make food?", at_step=3),
     Arrival("fib", "def fibonacci(n):", priority=0, at_step=6)],
    [Arrival("flood-a", flood(0), max_tokens=2), Arrival("flood-b", flood(9), max_tokens=2)],
    [Arrival("tides", SYSTEM + " Why do we have tides?")],
]
THRESHOLD = 32  # long_prefill_token_threshold: a prompt over 32 tokens is long
SMALL_CACHE = 16  # blocks of 16 tokens: wave 1 needs ~27, so requests are preempted
# Wave 1 fits (no preemption); wave 2's 22 blocks then evict the system prompt's.
TIER_RUN_CACHE = 24
TIER_GIB = 0.1  # ~140 of the default model's float32 blocks: the whole workload's
WAVE_DEADLINE_S = 300.0  # a wave takes seconds: more is a hang


def engine(**options) -> LLM:
    """The plain engine, ``options`` switching features on."""
    return LLM(**{"dtype": "float32", "max_num_seqs": 8, "num_gpu_blocks": 64,
                  "enable_prefix_caching": False, "max_model_len": 256, **options})


# ---------------------------------------------------------------- the driver


@dataclasses.dataclass
class Step:
    """What one ``schedule()`` decided, and what it found."""

    num_scheduled_tokens: dict[str, int]
    admitted: set[str]  # requests that were waiting (new, preempted or loading)
    prefilling: set[str]  # requests that got prompt tokens
    long_prefilling: set[str]  # those whose prompt is over THRESHOLD
    preempted: set[str]
    outranked: bool  # a waiting request had a better priority than a running one
    num_in_flight: int  # steps already executing when it was scheduled (async)


@dataclasses.dataclass
class Run:
    tokens: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    finals: dict[str, EngineCoreOutput] = dataclasses.field(default_factory=dict)
    stats: list[SchedulerStats] = dataclasses.field(default_factory=list)
    steps: list[Step] = dataclasses.field(default_factory=list)
    prompt_lens: dict[str, int] = dataclasses.field(default_factory=dict)

    def absorb(self, step_outputs) -> None:
        for outputs in step_outputs.values():
            if outputs.scheduler_stats is not None:
                self.stats.append(outputs.scheduler_stats)
            for out in outputs.outputs:
                self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finish_reason is not None:
                    self.finals[out.request_id] = out

    def total(self, field: str) -> int:
        return sum(getattr(s, field) for s in self.stats)

    def prefix_hits(self) -> int:
        return sum(s.prefix_cache_stats.hits for s in self.stats)

    def tier_hits(self) -> int:
        return sum(s.connector_prefix_cache_stats.hits for s in self.stats
                   if s.connector_prefix_cache_stats is not None)

    def accepted_drafts(self) -> int:
        return sum(s.spec_decoding_stats.num_accepted_tokens for s in self.stats
                   if s.spec_decoding_stats is not None)

    def preempted(self) -> set[str]:
        return set().union(*(s.preempted for s in self.steps))


def record_steps(core, run: Run) -> None:
    """Wrap the scheduler's ``schedule()`` so each call appends a ``Step``."""
    scheduler = core.scheduler
    schedule = scheduler.schedule

    def recording_schedule():
        before = {req_id: (r.num_computed_tokens, r.num_prompt_tokens, r.status)
                  for req_id, r in scheduler.requests.items()}
        waiting = [r.priority for r in scheduler.requests.values()
                   if r.status != RequestStatus.RUNNING and not r.is_finished()]
        running = [r.priority for r in scheduler.running]
        outranked = bool(waiting and running) and min(waiting) < max(running)
        num_in_flight = len(core.in_flight)
        output = schedule()
        scheduled = output.num_scheduled_tokens
        admitted = {r for r in scheduled if before[r][2] != RequestStatus.RUNNING}
        prefilling = {r for r in scheduled if before[r][0] < before[r][1]}
        run.steps.append(Step(dict(scheduled), admitted, prefilling,
                              {r for r in prefilling if before[r][1] > THRESHOLD},
                              set(output.preempted_req_ids), outranked, num_in_flight))
        return output

    scheduler.schedule = recording_schedule


def add(llm: LLM, arrival: Arrival, *, req_id: str | None = None, max_tokens: int | None = None,
        kv_transfer_params: dict | None = None) -> int:
    """Add ``arrival`` to the engine; its number of prompt tokens."""
    token_ids = llm.tokenizer.encode(arrival.text, add_special_tokens=False)
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens or arrival.max_tokens, ignore_eos=True,
        extra_args={"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None)
    llm.engine.core.add_request(make_request(
        req_id or arrival.req_id, token_ids, params, llm.tokenizer, llm.engine.max_model_len,
        priority=arrival.priority))
    return len(token_ids)


def drive(llm: LLM, waves=WAVES) -> Run:
    """Step the engine through ``waves``; every block free at the end."""
    core, run = llm.engine.core, Run()
    record_steps(core, run)
    for wave in waves:
        step_through(run, core, wave, lambda arrival: add(llm, arrival))
    assert all_blocks_free(core.scheduler)
    return run


def step_through(run: Run, core, wave: list[Arrival], add_one, beside=None, until_finished=False) -> None:
    """Add ``wave``'s requests at their steps (at once when the engine is
    idle) and step ``core`` (and ``beside``, a peer engine) until both rest,
    or ``until_finished``: until every request of the wave finished."""
    pending = sorted(wave, key=lambda a: a.at_step)
    deadline = time.monotonic() + WAVE_DEADLINE_S
    first_step = len(run.steps)
    while True:
        assert time.monotonic() < deadline, f"the engines did not come to rest in {WAVE_DEADLINE_S} s"
        # Steps that computed something: those waiting only for a transfer do not count.
        step = sum(1 for s in run.steps[first_step:] if s.num_scheduled_tokens)
        while pending and (pending[0].at_step <= step or not core.has_work()):
            arrival = pending.pop(0)
            run.prompt_lens[arrival.req_id] = add_one(arrival)
        if until_finished and all(a.req_id in run.finals for a in wave):
            return
        if not core.has_work() and (beside is None or not beside.has_work()):
            return
        if core.has_work():
            run.absorb(core.step())
        if beside is not None and beside.has_work():
            beside.step()
            time.sleep(0.001)  # the transfers run on threads of their own


# ---------------------------------------------------------------- P/D


def drive_pd(producer: LLM, consumer: LLM, waves=WAVES) -> tuple[Run, Run]:
    """Each wave prefilled on the producer (one token, its blocks held), then
    decoded on the consumer from the pulled KV. (consumer's run, producer's run)."""
    run, prefills = Run(), Run()
    record_steps(consumer.engine.core, run)
    record_steps(producer.engine.core, prefills)
    for wave in waves:
        # Its blocks stay held for the consumer: the producer never rests here.
        step_through(prefills, producer.engine.core, [dataclasses.replace(a, at_step=0) for a in wave],
                     lambda arrival: add(producer, arrival, max_tokens=1,
                                         kv_transfer_params={"do_remote_decode": True}),
                     until_finished=True)
        remote = {a.req_id: prefills.finals[a.req_id].kv_transfer_params for a in wave}
        # The producer steps beside the consumer: it serves the pulls, then frees the blocks.
        step_through(run, consumer.engine.core, wave,
                     lambda arrival: add(consumer, arrival, kv_transfer_params=remote[arrival.req_id]),
                     beside=producer.engine.core)
    for llm in (producer, consumer):
        assert all_blocks_free(llm.scheduler)
    return run, prefills


# ---------------------------------------------------------------- the runs


@pytest.fixture(scope="module")
def plain() -> Run:
    run = drive(engine())
    arrivals = [a for wave in WAVES for a in wave]
    assert [len(run.tokens[a.req_id]) for a in arrivals] == [a.max_tokens for a in arrivals]
    # What the features below must change: several long prompts prefill in one
    # step, one step gives a prompt more than THRESHOLD tokens, nothing is preempted.
    assert max(len(s.long_prefilling) for s in run.steps) >= 2
    assert max(n for s in run.steps for n in s.num_scheduled_tokens.values()) > THRESHOLD
    assert not run.preempted()
    return run


def assert_same_tokens(run: Run, plain: Run) -> None:
    for req_id, want in plain.tokens.items():
        got = run.tokens.get(req_id)
        if got != want:
            first = next((i for i, (a, b) in enumerate(zip(got or [], want)) if a != b),
                         min(len(got or []), len(want)))
            pytest.fail(f"{req_id}: token {first} differs ({(got or [])[first:first + 4]} "
                        f"vs the plain run's {want[first:first + 4]})")
    assert run.tokens.keys() == plain.tokens.keys()


def engaged_prefix_caching(run):
    assert run.prefix_hits() > 0
    assert run.finals["plants"].num_cached_tokens >= 48  # the system prompt's blocks


def engaged_chunking(run):
    prompt_chunks = [n for s in run.steps for r, n in s.num_scheduled_tokens.items() if r in s.prefilling]
    assert max(prompt_chunks) <= THRESHOLD
    assert sum(1 for s in run.steps if "story" in s.prefilling) >= 4  # ~150 tokens, in chunks of 32


def engaged_caps(run):
    assert max(len(s.prefilling) for s in run.steps) <= 2
    assert max(len(s.long_prefilling) for s in run.steps) == 1


def engaged_displacement(run):
    # A step that preempts for blocks admits nobody: a step that preempted a
    # request and admitted another displaced it ("fib", priority 0, the others 1).
    assert any(s.preempted and "fib" in s.admitted for s in run.steps)
    assert "fib" not in run.preempted()


def engaged_preemption(run):
    # Preempted because blocks ran out: in a step where nobody could displace
    # (no waiting request outranked a running one).
    assert any(s.preempted and not s.outranked for s in run.steps)


def engaged_swap(run):
    assert run.total("num_swapped_preemptions") > 0


def engaged_tier(run):
    # At least one of the system prompt's blocks came back from the tier.
    assert run.tier_hits() >= 16
    assert run.finals["tides"].num_cached_tokens >= 48


def engaged_no_preemption(run):
    # The tier run's hits are then prefix lookups only (a recomputed victim finds its blocks there too).
    assert not run.preempted()


def engaged_async(run):
    assert max(s.num_in_flight for s in run.steps) >= 1  # scheduled while a step executed


def engaged_drafts(run):
    assert run.accepted_drafts() > 0


def engaged_pd(run):
    # Every prompt was pulled: the consumer computed only its last token.
    assert {r: f.num_cached_tokens for r, f in run.finals.items()} == \
        {r: n - 1 for r, n in run.prompt_lens.items()}


CHUNKING = dict(long_prefill_token_threshold=THRESHOLD, max_num_batched_tokens=64)
CAPS = dict(long_prefill_token_threshold=THRESHOLD, max_num_partial_prefills=2, max_long_partial_prefills=1)
PRIORITY = dict(policy="priority", max_num_seqs=2)
TIER = dict(enable_prefix_caching=True, kv_offload_size=TIER_GIB)
SPEC = dict(num_speculative_tokens=3, draft_acceptance_floor=0.0)

ONE_AT_A_TIME = {
    "prefix-caching": (dict(enable_prefix_caching=True), [engaged_prefix_caching]),
    "chunked-prefill-threshold": (CHUNKING, [engaged_chunking]),
    "partial-prefill-caps": (CAPS, [engaged_caps]),
    "priority-displacement": (PRIORITY, [engaged_displacement]),
    "recompute-preemption": (dict(num_gpu_blocks=SMALL_CACHE), [engaged_preemption]),
    "swap-preemption": (dict(num_gpu_blocks=SMALL_CACHE, kv_offload_size=TIER_GIB, preemption_mode="swap"),
                        [engaged_preemption, engaged_swap]),
    "host-tier": ({**TIER, "num_gpu_blocks": TIER_RUN_CACHE}, [engaged_tier, engaged_no_preemption]),
    "async-scheduling": (dict(async_scheduling=True), [engaged_async]),
    "ngram-speculative": (SPEC, [engaged_drafts]),
}
# Three seats (not PRIORITY's two) so that the small cache also runs out.
ALL = {**CHUNKING, **CAPS, **PRIORITY, **TIER, "max_num_seqs": 3, "num_gpu_blocks": SMALL_CACHE}
ALL_CHECKS = [engaged_prefix_caching, engaged_chunking, engaged_caps, engaged_displacement,
              engaged_preemption, engaged_tier]
TOGETHER = {
    "all-with-async-and-swap": ({**ALL, "async_scheduling": True, "preemption_mode": "swap"},
                                ALL_CHECKS + [engaged_swap, engaged_async]),
    "all-with-ngram-and-recompute": ({**ALL, **SPEC, "preemption_mode": "recompute"},
                                     ALL_CHECKS + [engaged_drafts]),
}


@pytest.mark.parametrize("name", list(ONE_AT_A_TIME) + list(TOGETHER))
def test_greedy_tokens_equal_the_plain_run(plain, name):
    options, checks = {**ONE_AT_A_TIME, **TOGETHER}[name]
    run = drive(engine(**options))
    assert_same_tokens(run, plain)
    for check in checks:
        check(run)


def pd_pair(producer_options, consumer_options) -> tuple[LLM, LLM]:
    port = free_port()
    producer = engine(kv_transfer_config={"kv_connector": "PDConnector", "kv_role": "kv_producer",
                                          "kv_connector_extra_config": {"kv_port": port}},
                      **producer_options)
    consumer = engine(kv_transfer_config={"kv_connector": "PDConnector", "kv_role": "kv_consumer",
                                          "kv_connector_extra_config": {"transfer_timeout_s": 30.0}},
                      **consumer_options)
    return producer, consumer


def engaged_prefix_hits(run):
    assert run.prefix_hits() > 0


def displacements_seat_the_displacer(run):
    # "fib" (priority 0, the others 1) loads its KV before it can run: until
    # its load is in it waits for a seat rather than displace (the seat would
    # go to nobody, or to a request of the victim's priority). Whether its load
    # lands while the seats are full depends on the transfer's timing, so a
    # displacement may or may not happen; the consumer's cache never runs out,
    # so any preemption is one, and "fib" takes the seat in that very step.
    assert "fib" in run.finals and "fib" not in run.preempted()
    assert all("fib" in s.admitted for s in run.steps if s.preempted)


# name: (producer's options, consumer's options, producer's checks, consumer's checks).
# P/D and the host tier are both KV connectors: an engine has one. A small
# cache is left out: which requests a consumer runs together depends on when
# their transfers land, so no run could be sure to preempt.
PD = {
    "pd": ({}, {}, [], [engaged_pd]),
    "pd-with-all-but-the-tier": (
        {**CHUNKING, **CAPS, "enable_prefix_caching": True, "async_scheduling": True},
        {**PRIORITY, "enable_prefix_caching": True, "async_scheduling": True},
        [engaged_chunking, engaged_caps, engaged_prefix_hits, engaged_async],
        [engaged_pd, displacements_seat_the_displacer, engaged_async]),
}


@pytest.fixture(scope="module")
def pd_runs():
    """The P/D runs by name, each run once: (consumer's run, producer's run)."""
    runs = {}

    def get(name):
        if name not in runs:
            producer_options, consumer_options, _, _ = PD[name]
            producer, consumer = pd_pair(producer_options, consumer_options)
            try:
                runs[name] = drive_pd(producer, consumer)
            finally:
                for llm in (producer, consumer):
                    llm.engine.core.shutdown()
        return runs[name]

    return get


@pytest.mark.parametrize("name", list(PD))
def test_pd_greedy_tokens_equal_the_plain_run(plain, pd_runs, name):
    run, prefills = pd_runs(name)
    _, _, producer_checks, consumer_checks = PD[name]
    assert_same_tokens(run, plain)
    for check in producer_checks:
        check(prefills)
    for check in consumer_checks:
        check(run)
