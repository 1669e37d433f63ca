"""From what a user sends (text, token ids, chat messages) to a core ``Request``."""

from __future__ import annotations

import time
from typing import Any, Union

from cadence.core.request import LoRARequest, Request
from cadence.models.tokenizer import Tokenizer
from cadence.sampling_params import SamplingParams

PromptType = Union[str, dict[str, Any]]


def prompt_token_ids(prompt: PromptType, tokenizer: Tokenizer) -> tuple[str | None, list[int]]:
    """(prompt text if any, token ids) of a string or ``{"prompt_token_ids": [...]}``."""
    if isinstance(prompt, str):
        return prompt, tokenizer.encode(prompt)
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        ids = list(prompt["prompt_token_ids"])
        vocab_size = tokenizer.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab_size for t in ids):
            raise ValueError("prompt_token_ids: every id must be an int in [0, vocab_size)")
        return prompt.get("prompt"), ids
    if isinstance(prompt, dict) and "prompt" in prompt:
        return prompt["prompt"], tokenizer.encode(prompt["prompt"])
    raise ValueError("prompt: expected a string or a dict with 'prompt_token_ids' or 'prompt'")


MAX_USER_LEN = 256


def make_request(
    request_id: str,
    token_ids: list[int],
    params: SamplingParams,
    tokenizer: Tokenizer,
    max_model_len: int,
    *,
    priority: int = 0,
    client_index: int = 0,
    arrival_time: float | None = None,
    user: str | None = None,
    slo_ttft_s: float | None = None,
    slo_tpot_s: float | None = None,
    lora_request: LoRARequest | None = None,
) -> Request:
    """A validated core request (prompt length checked against the context).

    ``user`` names the client for the ``fair`` policy (OpenAI's ``user`` field);
    ``lora_request`` the adapter it runs under (None: the base model).
    """
    check_lora_request(lora_request)
    if user is not None and (not isinstance(user, str) or len(user) > MAX_USER_LEN):
        raise ValueError(f"user: must be a string of at most {MAX_USER_LEN} characters")
    for name, target in (("slo_ttft_s", slo_ttft_s), ("slo_tpot_s", slo_tpot_s)):
        if target is not None and (isinstance(target, bool) or not isinstance(target, (int, float))
                                   or not 0 < target < float("inf")):
            raise ValueError(f"{name}: must be a positive number of seconds, got {target!r}")
    if not token_ids:
        raise ValueError("prompt: must not be empty")
    if len(token_ids) >= max_model_len:
        raise ValueError(
            f"prompt: {len(token_ids)} tokens, but the context holds {max_model_len} "
            "(prompt and output together)"
        )
    eos = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None
    if len(tokenizer.eos_token_ids) > 1 and not params.ignore_eos:
        # Further end-of-turn ids stop the request like EOS does.
        extra = tuple(t for t in tokenizer.eos_token_ids[1:] if t not in params.stop_token_ids)
        if extra:
            params = params.replace(stop_token_ids=params.stop_token_ids + extra)
    return Request(
        request_id, token_ids, params, eos_token_id=eos, priority=priority,
        client_index=client_index, arrival_time=time.time() if arrival_time is None else arrival_time,
        max_model_len=max_model_len, tenant=user, slo_ttft_s=slo_ttft_s, slo_tpot_s=slo_tpot_s,
        lora_request=lora_request,
    )


def check_lora_request(lora_request: LoRARequest | None) -> None:
    """ValueError naming ``lora_request`` unless it is None or a ``LoRARequest`` (which
    checks its own fields)."""
    if lora_request is None:
        return
    if not isinstance(lora_request, LoRARequest):
        raise ValueError(f"lora_request: expected a LoRARequest, got {type(lora_request).__name__}")
