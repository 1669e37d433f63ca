"""The request model: one sequence the scheduler drives to completion.

A request's progress is two numbers. ``num_tokens`` counts the tokens known
so far (prompt + sampled outputs); ``num_computed_tokens`` counts those whose
KV is (or, after ``schedule()``, will be) in the cache. Each step the
scheduler lets ``num_computed_tokens`` catch up with ``num_tokens_with_spec``
(known tokens plus speculative drafts); there are no prefill/decode phases.

    prompt tokens            output tokens   drafts
    |p0 p1 p2 ... p(P-1)|o0 o1 ... o(k-1)|d0 d1 d2|
    |<---- num_computed_tokens ---->|
    |<------------- num_tokens --------->|
    |<---------- num_tokens_with_spec ----------->|

Only the scheduler mutates a request; the runner gets plain data.
"""

from __future__ import annotations

import enum
import hashlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:
    from cadence.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Where a request is. Finished states compare greater than PREEMPTED."""

    WAITING = enum.auto()
    WAITING_FOR_FSM = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything below is a finished state.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: "RequestStatus") -> "FinishReason | None":
        return _FINISHED_REASONS.get(status)


class FinishReason(enum.IntEnum):
    """Why a request finished; ``str()`` gives the OpenAI spelling."""

    STOP = 0
    LENGTH = 1
    ABORT = 2

    def __str__(self) -> str:
        return self.name.lower()


_FINISHED_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_IGNORED: FinishReason.LENGTH,
}


class RequestEventType(enum.IntEnum):
    QUEUED = 1
    SCHEDULED = 2
    PREEMPTED = 3


@dataclass(frozen=True, slots=True)
class RequestEvent:
    type: RequestEventType
    timestamp: float


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """An adapter to apply to a request. ``lora_int_id`` > 0 identifies it."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        lora_id = self.lora_int_id
        if isinstance(lora_id, bool) or not isinstance(lora_id, int) or lora_id < 1:
            raise ValueError(f"lora_request: lora_int_id must be an integer >= 1, got {lora_id!r}")
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_request: lora_name must be a non-empty string")
        if not isinstance(self.lora_path, str):
            raise ValueError(f"lora_request: lora_path must be a string, got {self.lora_path!r}")


def extra_hash_key_of(lora_request: LoRARequest | None, cache_salt: str | None) -> Any:
    """What besides its tokens sets a block's hash (``Request.extra_hash_key``).

    The LoRA adapter's id: its KV differs. The cache salt (vLLM's
    ``cache_salt``): requests share cached blocks only when their salts are
    equal, and no salt shares only with no salt, so one tenant cannot time
    another's prompts through cache hits. vLLM mixes the salt into the first
    block's hash; the chain carries it to every later block, and folding it
    into every block, as here, gives the same sharing. The salt enters as a
    digest: the key travels in KV-cache events, the secret need not. The key
    stays a scalar (None, int or str), hashable after a msgpack round trip.
    """
    lora_id = lora_request.lora_int_id if lora_request is not None else None
    if cache_salt is None:
        return lora_id
    digest = hashlib.sha256(cache_salt.encode("utf-8")).hexdigest()[:32]
    return f"salt:{digest}" if lora_id is None else f"lora:{lora_id}:salt:{digest}"


@dataclass(frozen=True, slots=True)
class PlaceholderRange:
    """Where a multimodal item's encoder output sits in the prompt."""

    offset: int
    length: int


class Request:
    """One generation request as the scheduler sees it."""

    __slots__ = (
        "request_id", "client_index", "priority", "arrival_time", "sampling_params",
        "eos_token_id", "lora_request", "prompt_token_ids", "num_prompt_tokens", "num_tokens",
        "_output_token_ids", "_all_token_ids", "spec_token_ids", "num_computed_tokens",
        "num_cached_tokens", "status", "stop_reason", "max_tokens", "min_tokens",
        "stop_token_ids", "stops_on_eos", "num_output_placeholders", "num_preemptions",
        "block_hashes", "mm_positions", "mm_hashes", "structured_output_request",
        "events", "parent_request_id", "num_nans_in_logits", "fork_point",
        "extra_hash_key", "tenant", "slo_ttft_s", "slo_tpot_s", "kv_transfer_params",
        "is_pooling",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: "SamplingParams",
        *,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        client_index: int = 0,
        lora_request: LoRARequest | None = None,
        mm_positions: list[PlaceholderRange] | None = None,
        mm_hashes: list[str] | None = None,
        max_model_len: int | None = None,
        tenant: str | None = None,
        slo_ttft_s: float | None = None,
        slo_tpot_s: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.client_index = client_index
        # Who sent it, for fair shares (the OpenAI ``user`` field); None: anonymous.
        self.tenant = tenant
        # Latency targets for the slo policy (None: the deployment's default, if any).
        self.slo_ttft_s = slo_ttft_s
        self.slo_tpot_s = slo_tpot_s
        self.priority = priority
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.lora_request = lora_request
        self.prompt_token_ids = prompt_token_ids
        self.num_prompt_tokens = len(prompt_token_ids)
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(prompt_token_ids)
        # len(all_token_ids), kept as a plain attribute: the scheduler reads it
        # for every running request every step.
        self.num_tokens = self.num_prompt_tokens
        self.spec_token_ids: list[int] = []
        self.num_computed_tokens = 0
        # Set when first scheduled: prompt tokens found in a cache (local or external).
        self.num_cached_tokens: int | None = None
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        # Stop conditions, unpacked once so the per-step check is cheap.
        max_tokens = sampling_params.max_tokens
        if max_model_len is not None:
            room = max_model_len - self.num_prompt_tokens
            max_tokens = room if max_tokens is None else min(max_tokens, room)
        self.max_tokens: int | None = max_tokens
        self.min_tokens = sampling_params.min_tokens
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids)
        self.stops_on_eos = eos_token_id is not None and not sampling_params.ignore_eos
        # Async scheduling: tokens scheduled to be sampled whose ids are not back yet.
        self.num_output_placeholders = 0
        self.num_preemptions = 0
        # Chained hashes of this request's full blocks, filled lazily by the KV cache manager.
        self.block_hashes: list[Any] = []
        # Folded into the hash of every block: equal tokens under another
        # adapter have other KV, and under another cache salt must not be shared.
        self.extra_hash_key: Any = extra_hash_key_of(lora_request, sampling_params.cache_salt)
        self.mm_positions: list[PlaceholderRange] = mm_positions or []
        self.mm_hashes: list[str] = mm_hashes or [
            f"{request_id}#{i}" for i in range(len(self.mm_positions))
        ]
        self.structured_output_request: Any = None
        self.events: list[RequestEvent] = []
        self.parent_request_id: str | None = None
        self.num_nans_in_logits = 0
        # Parallel sampling (n > 1): number of prompt tokens computed before the
        # request forks into its children; None when it never forks.
        self.fork_point: int | None = None
        # What a KV connector reads (and answers) about KV computed or used
        # elsewhere, e.g. prefill/decode disaggregation; vLLM carries it in
        # the sampling params' extra_args too.
        # An embedding request: it samples nothing and finishes in the step
        # that computes its prompt's last token, with the pooled hidden state.
        self.is_pooling = sampling_params.pooling is not None
        extra_args = sampling_params.extra_args
        self.kv_transfer_params: dict[str, Any] | None = (
            extra_args.get("kv_transfer_params") if extra_args else None)

    # ---- token counts -------------------------------------------------

    @property
    def num_tokens_with_spec(self) -> int:
        return self.num_tokens + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self._output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def use_structured_output(self) -> bool:
        """Whether the grammar mask path drives this request: a grammar, or a
        thinking budget (which forces its close through the same path)."""
        params = self.sampling_params
        return params.structured_outputs is not None or params.thinking_token_budget is not None

    # ---- mutation (scheduler only) -------------------------------------

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        if isinstance(token_ids, int):
            self.append_output_token(token_ids)
        else:
            token_ids = list(token_ids)
            self._output_token_ids.extend(token_ids)
            self._all_token_ids.extend(token_ids)
            self.num_tokens += len(token_ids)

    def append_output_token(self, token_id: int) -> None:
        """One sampled token (the common case of ``append_output_token_ids``)."""
        self._output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)
        self.num_tokens += 1

    def record_event(self, event_type: RequestEventType, timestamp: float | None = None) -> None:
        self.events.append(RequestEvent(event_type, time.monotonic() if timestamp is None else timestamp))

    def take_events(self) -> list[RequestEvent] | None:
        if not self.events:
            return None
        events, self.events = self.events, []
        return events

    # ---- state ----------------------------------------------------------

    def is_finished(self) -> bool:
        return self.status > RequestStatus.PREEMPTED

    def get_finished_reason(self) -> FinishReason | None:
        return _FINISHED_REASONS.get(self.status)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
