"""Appending a sampled token, and whether it stops its request.

The two are one operation, ``append_token``: both paths that absorb sampled
tokens (the one-token fast path and the general path, in ``absorb``) append
through it, so no token is added without its stop check.
"""

from __future__ import annotations

from cadence.core.request import Request, RequestStatus


def append_token(request: Request, token_id: int, max_model_len: int) -> bool:
    """Append one sampled token; if it ends the request, set the finished status
    (and ``stop_reason``) and return True.

    Order: ``min_tokens`` holds back EOS and stop tokens; then EOS, then the
    request's stop tokens, then the length limits. Runs once per sampled
    token: a request with neither EOS nor stop tokens only compares counts.
    """
    request.append_output_token(token_id)
    num_tokens = request.num_tokens
    num_output = num_tokens - request.num_prompt_tokens
    if (request.stops_on_eos or request.stop_token_ids) and num_output >= request.min_tokens:
        if request.stops_on_eos and token_id == request.eos_token_id:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if token_id in request.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = token_id
            return True
    if num_tokens >= max_model_len or (
        request.max_tokens is not None and num_output >= request.max_tokens
    ):
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False


def append_tokens(
    request: Request, token_ids: list[int], max_model_len: int
) -> tuple[list[int], bool]:
    """Append sampled tokens until one stops the request: (the tokens appended, stopped).

    Tokens after the one that stops (accepted drafts past an EOS) are dropped.
    """
    if len(token_ids) == 1:  # the common case: one decode token
        return token_ids, append_token(request, token_ids[0], max_model_len)
    for num_appended, token_id in enumerate(token_ids, 1):
        if append_token(request, token_id, max_model_len):
            if num_appended < len(token_ids):
                token_ids = token_ids[:num_appended]
            return token_ids, True
    return token_ids, False
