"""Thinking budgets (issue 35 item 2): after N thinking tokens the scheduler's
bitmask forces the end of the thinking, then the answer's grammar applies.

The state alone (``ThinkingBudget``), then the scheduler with a fake runner
that samples only what each bitmask row allows: drafts, async scheduling,
preemption and n > 1 go through the same grammar path."""

from __future__ import annotations

import numpy as np
import pytest
from tests.core.fakes import FakeRunner, greedy_token, new_request, new_scheduler, run_pipelined, run_until_done

from cadence.config import SpeculativeConfig
from cadence.core.sched.structured_output import StructuredOutputManager
from cadence.core.sched.thinking import MAX_ROLLBACK, Phase, ThinkingBudget
from cadence.sampling_params import SamplingParams, ThinkingTokens

VOCAB = 1024
START, END = 1000, 1001  # "<think>", "</think>"
FORCED = (7, END, 8)  # "\n", "</think>", "\n\n"
THINK_OPEN = ThinkingTokens((START,), (END,), FORCED, starts_inside=True)
THINK_CLOSED = ThinkingTokens((START,), (END,), FORCED, starts_inside=False)


def allowed(bitmask: np.ndarray, row: int) -> set[int]:
    bits = np.unpackbits(bitmask[row:row + 1].view(np.uint8), axis=1, bitorder="little")[0]
    return set(np.flatnonzero(bits[:VOCAB]).tolist())


def new_bitmask(rows: int = 1) -> np.ndarray:
    return np.full((rows, VOCAB // 32), -1, dtype=np.int32)


class OnlyTokens:
    """An answer grammar allowing ``tokens`` in order, then terminated."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens, self.pos = tokens, 0

    def accept_tokens(self, request_id, token_ids):
        for t in token_ids:
            if self.pos >= len(self.tokens) or t != self.tokens[self.pos]:
                return False
            self.pos += 1
        return True

    def validate_tokens(self, token_ids):
        ok = []
        for i, t in enumerate(token_ids):
            if self.pos + i >= len(self.tokens) or t != self.tokens[self.pos + i]:
                break
            ok.append(t)
        return ok

    def rollback(self, num_tokens):
        self.pos -= num_tokens

    def fill_bitmask(self, bitmask, row):
        bitmask[row] = 0
        if self.pos < len(self.tokens):
            t = self.tokens[self.pos]
            bitmask[row, t // 32] = np.int32(np.uint32(1 << (t % 32)).view(np.int32))

    def is_terminated(self):
        return self.pos == len(self.tokens)


# ---- the state ---------------------------------------------------------

def test_budget_forces_the_close_after_n_thinking_tokens():
    budget = ThinkingBudget(3, THINK_OPEN)
    bitmask = new_bitmask()
    for token in (20, 21, 22):
        budget.fill_bitmask(bitmask, 0)
        assert len(allowed(bitmask, 0)) == VOCAB  # thinking: anything
        assert budget.accept_tokens("r", [token])
    for forced in FORCED:
        budget.fill_bitmask(bitmask, 0)
        assert allowed(bitmask, 0) == {forced}
        assert not budget.validate_tokens([forced + 1])
        assert budget.accept_tokens("r", [forced])
    assert budget.phase is Phase.ANSWER and budget.num_thinking == 3
    budget.fill_bitmask(bitmask, 0)
    assert len(allowed(bitmask, 0)) == VOCAB  # no grammar: the answer is free


def test_a_model_that_closes_early_is_not_forced():
    budget = ThinkingBudget(10, THINK_OPEN)
    assert budget.accept_tokens("r", [20, END])
    assert budget.phase is Phase.ANSWER and budget.num_thinking == 2


def test_budget_zero_closes_at_once_and_a_closed_prompt_may_open():
    assert ThinkingBudget(0, THINK_OPEN).phase is Phase.CLOSING
    budget = ThinkingBudget(2, THINK_CLOSED, answer=OnlyTokens([50, 51]))
    bitmask = new_bitmask()
    budget.fill_bitmask(bitmask, 0)
    assert allowed(bitmask, 0) == {50, START}  # the answer's grammar, or the opening
    assert budget.accept_tokens("r", [START, 30, 31])
    assert budget.phase is Phase.CLOSING
    assert budget.accept_tokens("r", list(FORCED))
    budget.fill_bitmask(bitmask, 0)
    assert allowed(bitmask, 0) == {50}  # the grammar applies to the answer only
    assert budget.accept_tokens("r", [50, 51]) and budget.is_terminated()


def test_rollback_and_validate_cross_the_phases():
    grammar = OnlyTokens([50, 51])
    budget = ThinkingBudget(2, THINK_OPEN, answer=grammar)
    tokens = [20, 21, *FORCED, 50, 51]
    assert budget.validate_tokens(tokens + [52]) == tokens  # 52: the grammar ended
    assert budget.phase is Phase.THINKING and budget.num_thinking == 0 and grammar.pos == 0
    assert budget.validate_tokens([20, 21, 9]) == [20, 21]  # 9 is not the forced "\n"
    assert budget.accept_tokens("r", tokens)
    budget.rollback(4)
    assert (budget.phase, budget.num_thinking, budget.num_forced, grammar.pos) == (Phase.CLOSING, 2, 1, 0)


def test_a_long_thinking_keeps_a_bounded_history():
    budget = ThinkingBudget(10_000, THINK_OPEN)
    assert budget.accept_tokens("r", [20] * 5000)
    assert len(budget._history) <= 2 * MAX_ROLLBACK and budget.num_thinking == 5000
    budget.rollback(MAX_ROLLBACK)
    assert budget.num_thinking == 5000 - MAX_ROLLBACK


# ---- the scheduler -----------------------------------------------------

class BitmaskBackend:
    """A grammar backend with numpy bitmasks (no grammar of its own)."""

    def compile(self, params):
        return OnlyTokens([int(c) for c in params.choice[0].split()])

    def allocate_bitmask(self, num_rows):
        return new_bitmask(num_rows)

    def fill_bitmask_rows(self, grammars, rows, bitmask):
        for grammar, row in zip(grammars, rows):
            grammar.fill_bitmask(bitmask, row)


class MaskedRunner(FakeRunner):
    """Samples the model's token where its bitmask row allows it, else the
    lowest allowed one (as a -inf logit does); draft rows too."""

    def __init__(self, **kwargs) -> None:
        super().__init__(self._masked_token, **kwargs)
        self._rows: dict[str, int] = {}
        self._bitmask = None

    def execute_model(self, scheduler_output):
        self._rows = scheduler_output.structured_output_request_ids
        self._bitmask = scheduler_output.grammar_bitmask
        return super().execute_model(scheduler_output)

    def _masked_token(self, req_id, tokens):
        token = greedy_token(req_id, tokens)
        first = self._rows.get(req_id)
        if first is None:
            return token
        row = first + len(tokens) - len(self.tokens[req_id])  # a draft row: past the known tokens
        ok = allowed(self._bitmask, row)
        return token if token in ok else min(ok)


def thinking_request(req_id, budget, max_tokens=12, **params):
    return new_request(req_id, 8, max_tokens=max_tokens, thinking_token_budget=budget,
                       thinking=THINK_OPEN, **params)


def make(**kwargs):
    return new_scheduler(structured_output_manager=StructuredOutputManager(BitmaskBackend()), **kwargs)


def output_tokens(outputs) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


def assert_budget_kept(tokens: list[int], budget: int) -> None:
    assert tokens[budget:budget + len(FORCED)] == list(FORCED), tokens
    assert END not in tokens[:budget]


@pytest.mark.parametrize("mode", ["plain", "spec", "async", "preempt", "n2"])
def test_scheduler_forces_the_close_in_every_mode(mode):
    kwargs = {}
    runner_kwargs = {}
    if mode == "spec":
        kwargs["speculative_config"] = SpeculativeConfig(num_speculative_tokens=3)
        # Drafts that guess thinking tokens: some collide with the forced close.
        runner_kwargs["draft_fn"] = lambda req_id, tokens: [greedy_token(req_id, tokens), 7, 8]
    if mode == "preempt":
        kwargs.update(num_gpu_blocks=9, block_size=4)
    if mode == "async":
        kwargs["async_scheduling"] = True
    s = make(**kwargs)
    params = {"n": 2} if mode == "n2" else {}
    for i in range(3 if mode == "preempt" else 1):
        s.add_request(thinking_request(f"r{i}", 4, max_tokens=16, **params))
    runner = MaskedRunner(block_size=s.block_size, check_kv=True, **runner_kwargs)
    preempted: set[str] = set()
    scheduled: list[bool] = []  # whether r0 was in each step
    if mode == "async":
        outputs = run_pipelined(s, runner, on_schedule=lambda so: scheduled.append("r0" in so.num_scheduled_tokens))
        # While it thinks under its budget, its next mask is known: steps overlap.
        assert sum(a and b for a, b in zip(scheduled, scheduled[1:])) >= 2
    else:
        outputs = run_until_done(s, runner, on_step=lambda so: preempted.update(so.preempted_req_ids))
    finished = {req_id: output_tokens(outs) for req_id, outs in outputs.items() if outs}
    assert finished
    for tokens in finished.values():
        assert len(tokens) == 16
        assert_budget_kept(tokens, 4)
    if mode == "preempt":
        assert preempted  # the budget's state outlived a preemption
    if mode == "n2":
        assert len(finished) == 2


def test_a_structured_answer_follows_the_forced_close():
    s = make()
    s.add_request(thinking_request("r", 3, max_tokens=20, structured_outputs={"choice": ["50 51 52"]}))
    tokens = output_tokens(run_until_done(s, MaskedRunner(block_size=s.block_size))["r"])
    assert tokens == tokens[:3] + list(FORCED) + [50, 51, 52]  # the grammar ends the request


def test_the_budget_field_is_checked():
    with pytest.raises(ValueError, match="^thinking_token_budget:"):
        SamplingParams(thinking_token_budget=-1, thinking=THINK_OPEN)
    with pytest.raises(ValueError, match="^thinking_token_budget:.*reasoning-parser"):
        SamplingParams(thinking_token_budget=4)


def test_an_engine_without_a_grammar_backend_names_the_budget_field():
    scheduler = new_scheduler()  # no tokenizer, so no grammar backend
    with pytest.raises(ValueError, match=r"^thinking_token_budget: this engine has no grammar backend"):
        scheduler.add_request(thinking_request("r", 4))
    assert not scheduler.has_requests()
