"""The messages between ``AsyncLLM`` (front end) and the engine-core process.

Every message is two ZMQ frames, ``[kind, msgpack payload]``; the payload
types are the msgspec structs below (core ``Request``s are rebuilt in the
engine process from ``EngineCoreRequest``).

    front end ──ADD / ABORT / FINISH_STOPPED / UTILITY / SHUTDOWN──► engine core
    front end ◄──OUTPUTS / READY / UTILITY_RESULT / REQUEST_ERROR / FAILED── engine core

The kinds are read per direction: ``b"U"`` is UTILITY one way, UTILITY_RESULT
the other.
"""

from __future__ import annotations

from typing import Any

import msgspec

from cadence.core.outputs import EngineCoreOutputs
from cadence.core.request import LoRARequest, Request
from cadence.sampling_params import SamplingParams

# Front end -> engine.
ADD, ABORT, FINISH_STOPPED, UTILITY, SHUTDOWN = b"A", b"X", b"S", b"U", b"Q"
# Engine -> front end.
OUTPUTS, READY, UTILITY_RESULT, REQUEST_ERROR, FAILED = b"O", b"R", b"U", b"E", b"F"


class EngineCoreRequest(msgspec.Struct, array_like=True, gc=False):
    """A core ``Request`` as plain data; validated by the front end already."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    priority: int = 0
    tenant: str | None = None
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    lora_request: LoRARequest | None = None

    @classmethod
    def from_request(cls, request: Request) -> "EngineCoreRequest":
        return cls(request.request_id, request.prompt_token_ids, request.sampling_params,
                   request.eos_token_id, request.arrival_time, request.priority, request.tenant,
                   request.slo_ttft_s, request.slo_tpot_s, request.lora_request)

    def to_request(self, max_model_len: int) -> Request:
        return Request(self.request_id, self.prompt_token_ids, self.sampling_params,
                       eos_token_id=self.eos_token_id, arrival_time=self.arrival_time,
                       priority=self.priority, max_model_len=max_model_len, tenant=self.tenant,
                       slo_ttft_s=self.slo_ttft_s, slo_tpot_s=self.slo_tpot_s,
                       lora_request=self.lora_request)


class EngineReady(msgspec.Struct, gc=False):
    """The handshake: facts about the engine the front end needs."""

    model_name: str
    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    num_kv_blocks: int
    block_size: int
    # What an embedding request pools when it does not say (the model's own).
    pooling_type: str = "last"


class UtilityCall(msgspec.Struct, array_like=True, gc=False):
    call_id: int
    method: str
    args: list[Any] = []


class UtilityResult(msgspec.Struct, array_like=True, gc=False):
    call_id: int
    result: Any = None
    error: str | None = None


class RequestError(msgspec.Struct, array_like=True, gc=False):
    """The engine refused a request (the front end validates, so this is rare)."""

    request_id: str
    message: str
    retry_after_s: float | None = None  # set: the load refused it (HTTP 429), not the input
    internal: bool = False  # the engine failed on it (HTTP 500), not the input: a step taken back


class EngineFailed(msgspec.Struct, gc=False):
    """The engine could not start, or a step raised; the process exits after this."""

    message: str


_encoder = msgspec.msgpack.Encoder()
# What the front end receives, by kind.
_decoders = {
    OUTPUTS: msgspec.msgpack.Decoder(EngineCoreOutputs),
    READY: msgspec.msgpack.Decoder(EngineReady),
    UTILITY_RESULT: msgspec.msgpack.Decoder(UtilityResult),
    REQUEST_ERROR: msgspec.msgpack.Decoder(RequestError),
    FAILED: msgspec.msgpack.Decoder(EngineFailed),
}


def encode(kind: bytes, payload: Any) -> list[bytes]:
    return [kind, _encoder.encode(payload)]


def decode(kind: bytes, payload: bytes) -> Any:
    """A message from the engine (the engine decodes its inputs in ``core_proc``)."""
    return _decoders[kind].decode(payload)
