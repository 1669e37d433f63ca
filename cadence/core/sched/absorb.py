"""Absorbing a step's results: what the runner sampled becomes request state.

``Scheduler.update_from_output`` (this module's mixin) runs once per step, after the runner.
For each request scheduled in the step it

- rolls back the drafts the runner rejected (``spec_decode``),
- appends the sampled tokens, each checked for a stop (``stop.append_token``),
  and advances the request's grammar,
- keeps the runner's fresh drafts, forks a parent that reached its fork
  point, frees a request that stopped (the ``lifecycle`` methods),

then applies the KV connector's finished transfers and builds the outputs
per client, with the ids finished since the last step and the stats.

Most requests of most steps are plain decodes (one token; no drafts,
logprobs, grammar or fork): those take a short path
inline, since the loop runs once per request per step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cadence.core.compiled import trait
from cadence.core.outputs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    KVConnectorOutput,
    ModelRunnerOutput,
    SchedulerStats,
    SpecDecodingStats,
)
from cadence.core.request import Request, RequestStatus
from cadence.core.sched import spec_decode
from cadence.core.sched.step_faults import StepFaults
from cadence.core.sched.stop import append_token, append_tokens

if TYPE_CHECKING:
    from cadence.core.kv_cache.interface import KVCacheManagerBase
    from cadence.core.sched.kv_connector import KVConnectorBase
    from cadence.core.sched.output import SchedulerOutput
    from cadence.core.sched.structured_output import StructuredOutputManager

_PREEMPTED = RequestStatus.PREEMPTED  # statuses above it are finished ones


@trait
class OutputAbsorber(StepFaults):
    """Methods of ``Scheduler`` that turn a ``ModelRunnerOutput`` into request
    state and ``EngineCoreOutputs``.

    A mixin with no state of its own; it frees and forks requests through
    the scheduler's lifecycle methods (``lifecycle``, under its base
    ``step_faults``), and implements the interface's ``update_from_output``.
    """

    # The scheduler's state these methods read and change (see Scheduler.__init__).
    requests: dict[str, Request]
    kv_cache_manager: KVCacheManagerBase
    connector: KVConnectorBase | None
    structured_output_manager: StructuredOutputManager | None
    # Ids whose remote KV arrived -> how many of their leading blocks hold
    # valid KV (None: all): added here, taken by admission.
    finished_recving_kv_req_ids: dict[str, int | None]
    max_model_len: int
    num_spec_tokens: int
    log_stats: bool

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        """Absorb the step's sampled tokens; the new outputs per client.

        Plain decodes take the short path inline; everything else goes
        through ``_update_request``.
        """
        self.num_steps_absorbed += 1
        sampled_token_ids = model_runner_output.sampled_token_ids
        req_id_to_index = model_runner_output.req_id_to_index
        # A runner that keeps the scheduler's order has request i in row i:
        # checked by identity, else looked up.
        runner_req_ids = model_runner_output.req_ids
        num_rows = len(runner_req_ids)
        scheduled_drafts = scheduler_output.scheduled_spec_decode_tokens
        max_model_len = self.max_model_len
        requests = self.requests
        free_request = self._free_request
        outputs = self._take_orphan_outputs()
        plain_step = self._is_plain_step(scheduler_output, model_runner_output)
        spec_stats: SpecDecodingStats | None = None
        stopped: list[Request] = []
        # The outputs of the last request's client (most steps serve one client).
        client = 0
        client_outputs: list[EngineCoreOutput] | None = None
        for position, req_id in enumerate(scheduler_output.num_scheduled_tokens):
            request = requests.get(req_id)
            if request is None or request.status > _PREEMPTED:
                continue  # finished (e.g. aborted) while the step ran
            if position < num_rows and runner_req_ids[position] is req_id:
                index = position
            else:
                index = req_id_to_index[req_id]
            new_token_ids = sampled_token_ids[index] if sampled_token_ids else []
            if plain_step and len(new_token_ids) == 1 and request.fork_point is None:
                if request.num_output_placeholders:
                    request.num_output_placeholders -= 1
                if append_token(request, new_token_ids[0], max_model_len):
                    stopped.append(request)
                    output = make_engine_core_output(request, new_token_ids, None, None, free_request(request))
                else:  # still running: no finish reason, nothing but the token (and events)
                    output = EngineCoreOutput(
                        req_id, new_token_ids, stop_reason=request.stop_reason,
                        num_cached_tokens=request.num_cached_tokens or 0,
                        events=request.take_events() if request.events else None,
                        parent_request_id=request.parent_request_id,
                    )
            else:
                if scheduled_drafts and scheduled_drafts.get(req_id):
                    spec_stats = self._roll_back_rejected(
                        request, scheduled_drafts[req_id], len(new_token_ids), spec_stats
                    )
                general = self._update_request(request, index, new_token_ids, model_runner_output)
                if general is None:
                    continue
                output = general
                if output.finish_reason is not None:
                    stopped.append(request)  # only a request that stopped in this step has one
            if client_outputs is None or request.client_index != client:
                client = request.client_index
                client_outputs = outputs.setdefault(client, [])
            client_outputs.append(output)
        if stopped:
            self._remove_finished_from_queues(stopped)
        if model_runner_output.kv_connector_output is not None:
            self._absorb_kv_transfers(model_runner_output.kv_connector_output)
        if self.suspects or self.freed_in_flight:
            self._after_absorbed(scheduler_output)
        return self._make_engine_core_outputs(outputs, spec_stats)

    def _is_plain_step(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> bool:
        """No drafts (verified or new), logprobs or grammars in this step: a
        request that sampled one token needs no more than appending it (and
        taking back its async placeholder)."""
        return not (
            scheduler_output.scheduled_spec_decode_tokens or runner_output.spec_token_ids is not None
            or runner_output.logprobs is not None or runner_output.prompt_logprobs_dict
            or scheduler_output.structured_output_request_ids or runner_output.pooler_output
        )

    def _update_request(
        self, request: Request, index: int, new_token_ids: list[int], runner_output: ModelRunnerOutput
    ) -> EngineCoreOutput | None:
        """Absorb one request's result in the general case; its output, if it has one."""
        if request.is_pooling:
            return self._absorb_pooled(request, index, runner_output)
        if request.num_output_placeholders:
            request.num_output_placeholders = max(
                0, request.num_output_placeholders - len(new_token_ids)
            )
        stopped = False
        if new_token_ids:
            new_token_ids, stopped = self._append_sampled(request, new_token_ids)
        fork = False
        if stopped:
            kv_transfer_params = self._free_request(request)
        else:
            kv_transfer_params = None
            if runner_output.spec_token_ids is not None:
                self._set_drafts(request, runner_output.spec_token_ids[index])
            fork = request.fork_point is not None and request.num_computed_tokens >= request.fork_point
        prompt_logprobs = runner_output.prompt_logprobs_dict.get(request.request_id)
        output = None
        if new_token_ids or kv_transfer_params or prompt_logprobs is not None:
            new_logprobs = None
            if request.sampling_params.logprobs is not None and runner_output.logprobs is not None:
                new_logprobs = runner_output.logprobs.rows_of(index)
            output = make_engine_core_output(
                request, new_token_ids, new_logprobs, prompt_logprobs, kv_transfer_params
            )
        if fork:
            # After the output is made: the parent's output does not carry the fork's finish.
            self._fork(request)
        return output

    def _absorb_pooled(
        self, request: Request, index: int, runner_output: ModelRunnerOutput
    ) -> EngineCoreOutput | None:
        """A pooling request finishes when its pooled state comes (its prompt's
        last token computed); its blocks are freed (kept in the prefix cache)."""
        pooled = runner_output.pooler_output[index] if runner_output.pooler_output else None
        if pooled is None:
            return None  # a chunk before the prompt's last one
        request.status = RequestStatus.FINISHED_STOPPED
        kv_transfer_params = self._free_request(request)
        output = make_engine_core_output(request, [], None, None, kv_transfer_params)
        output.pooled = pooled
        return output

    def _append_sampled(self, request: Request, new_token_ids: list[int]) -> tuple[list[int], bool]:
        """Append the tokens up to a stop, then advance the grammar: (tokens kept, stopped)."""
        new_token_ids, stopped = append_tokens(request, new_token_ids, self.max_model_len)
        if stopped:
            return new_token_ids, True
        so = request.structured_output_request
        if so is not None and self.structured_output_manager is not None:
            grammar = so.grammar
            if grammar is not None:
                if not grammar.accept_tokens(request.request_id, new_token_ids):
                    # The mask allows only what the grammar accepts, so this is
                    # a backend's fault; the output would break its contract.
                    request.status = RequestStatus.FINISHED_ABORTED
                    request.stop_reason = "structured_outputs: the grammar refused a sampled token"
                    return new_token_ids, True
                if grammar.is_terminated():
                    request.status = RequestStatus.FINISHED_STOPPED
                    return new_token_ids, True
        return new_token_ids, False

    def _roll_back_rejected(
        self, request: Request, drafts: list[int], num_sampled: int, spec_stats: SpecDecodingStats | None
    ) -> SpecDecodingStats | None:
        num_accepted = spec_decode.roll_back_rejected(request, len(drafts), num_sampled)
        if self.log_stats:
            spec_stats = spec_decode.observe(spec_stats, self.num_spec_tokens, len(drafts), num_accepted)
        return spec_stats

    @staticmethod
    def _set_drafts(request: Request, drafts: list[int]) -> None:
        """Keep the runner's drafts for the next step (those the grammar allows)."""
        so = request.structured_output_request
        if so is not None and so.grammar is not None:
            drafts = so.grammar.validate_tokens(drafts)
        request.spec_token_ids = list(drafts)

    def _absorb_kv_transfers(self, output: KVConnectorOutput) -> None:
        """Loads that finished make requests ready (up to their first invalid
        block); sends that finished free blocks."""
        if self.connector is not None:
            self.connector.update_connector_output(output)
        invalid = output.invalid_block_ids
        for req_id in output.finished_recving or ():
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                continue  # aborted while loading: its blocks are already free
            self.finished_recving_kv_req_ids[req_id] = (
                self._num_valid_blocks(req_id, invalid) if invalid else None
            )
        for req_id in output.finished_sending or ():
            request = self.requests.get(req_id)
            if request is not None:
                self._free_blocks(request)

    def _num_valid_blocks(self, req_id: str, invalid_block_ids: set[int]) -> int | None:
        """How many of the request's leading block positions precede its first
        invalid block (in any KV cache group)."""
        block_ids = self.kv_cache_manager.get_block_ids(req_id)
        first_invalid: int | None = None
        for group_ids in (block_ids if isinstance(block_ids, tuple) else (block_ids,)):
            for i, block_id in enumerate(group_ids):
                if block_id in invalid_block_ids:
                    if first_invalid is None or i < first_invalid:
                        first_invalid = i
                    break
        return first_invalid

    def _make_engine_core_outputs(
        self, outputs: dict[int, list[EngineCoreOutput]], spec_stats: SpecDecodingStats | None
    ) -> dict[int, EngineCoreOutputs]:
        engine_core_outputs = {
            client: EngineCoreOutputs(outputs=client_outputs)
            for client, client_outputs in outputs.items()
        }
        for client, finished in self._take_finished_per_client().items():
            eco = engine_core_outputs.get(client)
            if eco is None:
                eco = engine_core_outputs[client] = EngineCoreOutputs()
            eco.finished_requests = finished
        if engine_core_outputs and self.log_stats:
            # Stats go to one front end only.
            next(iter(engine_core_outputs.values())).scheduler_stats = self.make_stats(spec_stats)
        return engine_core_outputs


def make_engine_core_output(
    request: Request,
    new_token_ids: list[int],
    new_logprobs: Any,
    prompt_logprobs: Any,
    kv_transfer_params: dict | None,
) -> EngineCoreOutput:
    """What the request's client hears about it from this step."""
    return EngineCoreOutput(
        request_id=request.request_id,
        new_token_ids=new_token_ids,
        finish_reason=request.get_finished_reason(),
        stop_reason=request.stop_reason,
        new_logprobs=new_logprobs,
        new_prompt_logprobs=prompt_logprobs,
        num_cached_tokens=request.num_cached_tokens or 0,
        events=request.take_events() if request.events else None,
        kv_transfer_params=kv_transfer_params,
        parent_request_id=request.parent_request_id,
    )
