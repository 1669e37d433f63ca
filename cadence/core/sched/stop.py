"""When a request stops, checked after each appended token."""

from __future__ import annotations

from cadence.core.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Set the finished status (and ``stop_reason``) if the last token ends the request.

    Order: ``min_tokens`` holds back EOS and stop tokens; then EOS, then the
    request's stop tokens, then the length limits. Runs once per sampled
    token: a request with neither EOS nor stop tokens only compares counts.
    """
    num_tokens = request.num_tokens
    num_output = num_tokens - request.num_prompt_tokens
    if (request.stops_on_eos or request.stop_token_ids) and num_output >= request.min_tokens:
        last = request.output_token_ids[-1]
        if request.stops_on_eos and last == request.eos_token_id:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if last in request.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last
            return True
    if num_tokens >= max_model_len or (
        request.max_tokens is not None and num_output >= request.max_tokens
    ):
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False
