"""Turns the scheduler's per-step token deltas into user-facing outputs.

Per request it keeps a detokenizer per completion, the tokens and logprobs
so far, and finds stop strings (which the engine then reports to the
scheduler as finished). A parallel-sampling request (``n`` > 1) is one
``RequestOutput`` whose completions come from the scheduler's children
``"{i}_{request_id}"``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from cadence.core.outputs import EngineCoreOutput, LogprobsLists
from cadence.core.request import FinishReason
from cadence.core.sched.parallel_sampling import child_request_id
from cadence.engine.detokenizer import IncrementalDetokenizer
from cadence.engine.outputs import CompletionOutput, Logprob, RequestOutput, SampleLogprobs
from cadence.models.tokenizer import Tokenizer
from cadence.sampling_params import SamplingParams


@dataclass
class _Completion:
    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    completions: list[_Completion]
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    engine_ids: list[str] = field(default_factory=list)  # ids the scheduler uses
    kv_transfer_params: dict | None = None
    embedding: list[float] | None = None  # a pooling request's

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)


class OutputProcessor:
    """Request states by id; ``process`` absorbs one step's outputs."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}
        # engine-core request id -> (user request id, completion index)
        self._routes: dict[str, tuple[str, int]] = {}

    def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        completions = [
            _Completion(i, IncrementalDetokenizer(self.tokenizer, params),
                        logprobs=[] if params.logprobs is not None else None)
            for i in range(params.n)
        ]
        engine_ids = (
            [request_id] if params.n == 1
            else [child_request_id(request_id, i) for i in range(params.n)]
        )
        self._states[request_id] = state = _RequestState(
            request_id, prompt, prompt_token_ids, params, completions,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
            engine_ids=engine_ids,
        )
        for i, engine_id in enumerate(engine_ids):
            self._routes[engine_id] = (request_id, i)
        if params.n > 1:
            # The parent computes the shared prompt before it forks: its prompt
            # logprobs belong to the request (it samples no token itself).
            self._routes[request_id] = (request_id, 0)
            state.engine_ids.insert(0, request_id)

    def engine_request_ids(self, request_id: str) -> list[str]:
        """The ids the scheduler knows this request by (itself, or its children)."""
        state = self._states.get(request_id)
        if state is None:
            return []
        return list(state.engine_ids)

    def has_unfinished_requests(self) -> bool:
        return bool(self._states)

    def num_entries(self) -> tuple[int, int]:
        """(requests, engine ids) tracked; both 0 once nothing is in flight (a leak check)."""
        return len(self._states), len(self._routes)

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """(updated request outputs, engine ids that stop strings finished)."""
        touched: dict[str, _RequestState] = {}
        stopped_by_string: list[str] = []
        for out in outputs:
            route = self._routes.get(out.request_id)
            if route is None:
                continue
            state = self._states[route[0]]
            completion = state.completions[route[1]]
            if out.new_prompt_logprobs is not None and state.prompt_logprobs is not None and route[1] == 0:
                # Children past the first recompute parts of the prompt: count it once.
                state.prompt_logprobs.extend(
                    self._logprob_rows(out.new_prompt_logprobs, state.params.prompt_logprobs))
            if self._absorb(state, completion, out):
                stopped_by_string.append(out.request_id)
            touched[state.request_id] = state
        results = [self._make_output(state) for state in touched.values()]
        for state in touched.values():
            if state.finished:
                self._forget(state)
        return results, stopped_by_string

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish a request as aborted (client gone); returns its last output."""
        state = self._states.get(request_id)
        if state is None:
            return None
        for completion in state.completions:
            if completion.finish_reason is None:
                completion.finish_reason = "abort"
        output = self._make_output(state)
        self._forget(state)
        return output

    def _absorb(self, state: _RequestState, completion: _Completion, out: EngineCoreOutput) -> bool:
        """Add one output to a completion; True if a stop string finished it."""
        if completion.finish_reason is not None:
            return False
        state.num_cached_tokens = out.num_cached_tokens
        if out.kv_transfer_params is not None:
            state.kv_transfer_params = out.kv_transfer_params
        if out.pooled is not None:
            state.embedding = out.pooled
        new_ids = out.new_token_ids
        completion.token_ids.extend(new_ids)
        if completion.logprobs is not None and out.new_logprobs is not None:
            rows = self._logprob_rows(out.new_logprobs, state.params.logprobs, len(new_ids))
            completion.logprobs.extend(rows)
            completion.cumulative_logprob += sum(
                row[token].logprob for row, token in zip(rows, new_ids) if row and token in row
            )
        text_ids = new_ids
        if new_ids and self._ends_on_stop_token(state.params, out):
            text_ids = new_ids[:-1]  # EOS / a stop token ends the text without showing in it
        stop_string = completion.detokenizer.append(text_ids)
        if stop_string is not None:
            completion.finish_reason, completion.stop_reason = "stop", stop_string
            return out.finish_reason is None  # the scheduler still runs it: finish it there
        if out.finish_reason is not None:
            completion.finish_reason = str(out.finish_reason)
            completion.stop_reason = out.stop_reason
        return False

    def _ends_on_stop_token(self, params: SamplingParams, out: EngineCoreOutput) -> bool:
        if out.finish_reason != FinishReason.STOP or params.include_stop_str_in_output:
            return False
        last = out.new_token_ids[-1]
        return last in params.stop_token_ids or last in self.tokenizer.eos_token_ids

    def _logprob_rows(
        self, lists: LogprobsLists, num_top: int | None, limit: int | None = None
    ) -> list[dict[int, Logprob]]:
        rows = []
        num_rows = len(lists.logprob_token_ids) if limit is None else min(limit, len(lists.logprob_token_ids))
        for r in range(num_rows):
            ids, values = lists.logprob_token_ids[r], lists.logprobs[r]
            if not ids:
                rows.append({})
                continue
            row = {ids[0]: Logprob(values[0], lists.sampled_token_ranks[r], self._piece(ids[0]))}
            for rank, (token, value) in enumerate(zip(ids[1:1 + (num_top or 0)], values[1:]), 1):
                row.setdefault(token, Logprob(value, rank, self._piece(token)))
            rows.append(row)
        return rows

    def _piece(self, token_id: int) -> str:
        return self.tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")

    def _make_output(self, state: _RequestState) -> RequestOutput:
        completions = []
        for c in state.completions:
            text = c.detokenizer.streamable_text(c.finish_reason is not None)
            completions.append(CompletionOutput(
                index=c.index, text=text, token_ids=list(c.token_ids),
                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                logprobs=list(c.logprobs) if c.logprobs is not None else None,
                cumulative_logprob=c.cumulative_logprob if c.logprobs is not None else None,
            ))
        return RequestOutput(
            request_id=state.request_id, prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids, outputs=completions,
            finished=state.finished, num_cached_tokens=state.num_cached_tokens,
            prompt_logprobs=list(state.prompt_logprobs) if state.prompt_logprobs is not None else None,
            kv_transfer_params=state.kv_transfer_params, embedding=state.embedding,
        )

    def _forget(self, state: _RequestState) -> None:
        self._states.pop(state.request_id, None)
        for engine_id in state.engine_ids:
            self._routes.pop(engine_id, None)
