"""/v1/embeddings: OpenAI's embeddings on the same engine as generation.

Each input (a string, or a list of token ids) is one pooling request through
the same scheduler: its prompt is computed, chunk by chunk beside other
requests' tokens, and it finishes in the step that computes its last token
with the final hidden state pooled as the model says (last token for decoder
LLMs; mean where the GGUF's ``pooling_type`` says so) and L2-normalised
(vLLM's ``normalize: false`` keeps the raw state). No token is sampled and no
KV is kept after, except blocks the prefix cache holds. ``encoding_format``
``base64`` sends the little-endian float32 bytes (what the ``openai`` client
asks by default and decodes). ``dimensions`` is refused: no model served here
is trained for shorter (Matryoshka) embeddings.

``/v1/score`` and rerank are not served: they need a classification head or a
cross-encoder's scoring, which none of the causal LMs cadence loads has.
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from typing import Any, Literal, Union

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import model_validator

from cadence.core.request import LoRARequest
from cadence.engine.async_llm import AsyncLLM, RequestStream
from cadence.engine.inputs import prompt_token_ids
from cadence.sampling_params import PoolingParams, embedding_params
from cadence.server.protocol import RequestBody, refuse_lone_surrogates
from cadence.server.serving import collect

# OpenAI's limit on the inputs of one request.
MAX_INPUTS = 2048


class EmbeddingRequest(RequestBody):
    ROUTE = "embeddings"
    model: str | None = None
    input: Union[str, list[str], list[int], list[list[int]]]
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None
    # vLLM's: false keeps the pooled state as it is (not divided by its norm).
    normalize: bool = True

    @model_validator(mode="before")
    @classmethod
    def _refuse_lone_surrogates(cls, data: Any) -> Any:
        refuse_lone_surrogates(data)
        return data

    def inputs(self) -> list[str | list[int]]:
        """The inputs of the batch: strings or token-id lists."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if not value:
            raise ValueError("input: must not be empty")
        if all(isinstance(item, int) for item in value):
            return [list(value)]  # one input of token ids
        if len(value) > MAX_INPUTS:
            raise ValueError(f"input: at most {MAX_INPUTS} inputs in one request, got {len(value)}")
        return list(value)


class EmbeddingServing:
    """/v1/embeddings over one ``AsyncLLM``."""

    def __init__(self, llm: AsyncLLM, model_name: str) -> None:
        self.llm = llm
        self.model_name = model_name

    async def embeddings(self, body: EmbeddingRequest, raw: Request,
                         lora_request: LoRARequest | None = None) -> JSONResponse:
        assert self.llm.info is not None
        params = embedding_params(PoolingParams(normalize=body.normalize), self.llm.info.pooling_type)
        prompts = await asyncio.to_thread(self._prompts, body)
        self.llm.check_can_ever_admit(len(prompts))
        request_id = f"embd-{uuid.uuid4().hex}"
        streams = self._submit(request_id, prompts, params, body, lora_request)
        finals = await collect(streams, raw)
        data = [{"object": "embedding", "index": i,
                 "embedding": encode(final.embedding, body.encoding_format)}
                for i, final in enumerate(finals)]
        num_tokens = sum(len(final.prompt_token_ids) for final in finals)
        return JSONResponse({
            "object": "list", "data": data,
            "model": lora_request.lora_name if lora_request is not None else self.model_name,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
        })

    def _prompts(self, body: EmbeddingRequest) -> list[tuple[str | None, list[int]]]:
        """(text, token ids) of each input; runs in a worker thread."""
        assert self.llm.tokenizer is not None
        prompts = []
        for item in body.inputs():
            try:
                prompt = item if isinstance(item, str) else {"prompt_token_ids": item}
                prompts.append(prompt_token_ids(prompt, self.llm.tokenizer))
            except ValueError as err:  # the API's field is "input"
                raise ValueError("input:" + str(err).split(":", 1)[1]) from None
        return prompts

    def _submit(self, request_id: str, prompts: list[tuple[str | None, list[int]]], params,
                body: EmbeddingRequest, lora_request: LoRARequest | None) -> list[RequestStream]:
        """One pooling request per input; on any refusal, nothing stays submitted."""
        streams: list[RequestStream] = []
        try:
            for i, (text, token_ids) in enumerate(prompts):
                streams.append(self.llm.add_request(f"{request_id}-{i}", token_ids, params,
                                                    prompt=text, user=body.user,
                                                    lora_request=lora_request))
        except ValueError as err:
            for stream in streams:
                stream.close()
            message = str(err)
            if message.startswith("prompt:"):
                message = "input:" + message[len("prompt:"):]
            raise ValueError(message) from None
        except BaseException:
            for stream in streams:
                stream.close()
            raise
        return streams


def encode(embedding: list[float] | None, encoding_format: str) -> list[float] | str:
    """The floats, or their little-endian float32 bytes in base64 (OpenAI's two formats)."""
    assert embedding is not None, "a pooling request finished without its embedding"
    if encoding_format == "float":
        return embedding
    return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")
