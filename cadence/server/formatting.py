"""OpenAI response bodies from ``RequestOutput``s: choices, logprobs, usage, SSE chunks."""

from __future__ import annotations

import json
import math
from typing import Any

from cadence.engine.outputs import CompletionOutput, Logprob, RequestOutput
from cadence.models.tokenizer import Tokenizer

# JSON has no -inf: a token the model rules out gets this instead (as vLLM does).
MIN_LOGPROB = -9999.0


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def usage(outputs: list[RequestOutput]) -> dict[str, Any]:
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    completion_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    result: dict[str, Any] = {
        "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    cached = sum(o.num_cached_tokens for o in outputs)
    if cached:
        result["prompt_tokens_details"] = {"cached_tokens": cached}
    return result


def _value(logprob: float) -> float:
    return MIN_LOGPROB if math.isnan(logprob) or logprob < MIN_LOGPROB else logprob


logprob_value = _value  # JSON's value of a logprob (no -inf, no NaN)


def _by_rank(row: dict[int, Logprob]) -> list[tuple[int, Logprob]]:
    return sorted(row.items(), key=lambda item: (item[1].rank or 0))


class CompletionLogprobs:
    """The legacy ``logprobs`` object of /v1/completions, built incrementally."""

    def __init__(self) -> None:
        self.num_rows = 0  # rows already sent
        self.text_offset = 0

    def take(self, completion: CompletionOutput, final: bool = False) -> dict[str, Any] | None:
        rows = completion.logprobs
        if rows is None:
            return None
        end = len(completion.token_ids)
        tokens, values, tops, offsets = [], [], [], []
        for token_id, row in zip(completion.token_ids[self.num_rows:end], rows[self.num_rows:end]):
            entry = row.get(token_id)
            piece = entry.decoded_token if entry is not None and entry.decoded_token is not None else ""
            tokens.append(piece)
            values.append(_value(entry.logprob) if entry is not None else None)
            tops.append({lp.decoded_token: _value(lp.logprob) for _, lp in _by_rank(row)})
            offsets.append(self.text_offset)
            self.text_offset += len(piece)
        self.num_rows = end
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


class ChatLogprobs:
    """The ``logprobs.content`` list of /v1/chat/completions, built incrementally."""

    def __init__(self, tokenizer: Tokenizer, num_top: int) -> None:
        self.tokenizer = tokenizer
        self.num_top = num_top
        self.num_rows = 0

    def take(self, completion: CompletionOutput) -> dict[str, Any] | None:
        rows = completion.logprobs
        if rows is None:
            return None
        end = len(completion.token_ids)
        content = []
        for token_id, row in zip(completion.token_ids[self.num_rows:end], rows[self.num_rows:end]):
            entry = row.get(token_id)
            top = [self._item(t, lp) for t, lp in _by_rank(row)
                   if lp.rank is not None and lp.rank <= self.num_top][: self.num_top]
            item = self._item(token_id, entry) if entry is not None else {
                "token": self.tokenizer.token_bytes(token_id).decode("utf-8", "replace"),
                "logprob": MIN_LOGPROB, "bytes": list(self.tokenizer.token_bytes(token_id))}
            content.append({**item, "top_logprobs": top})
        self.num_rows = end
        return {"content": content}

    def _item(self, token_id: int, logprob: Logprob) -> dict[str, Any]:
        raw = self.tokenizer.token_bytes(token_id)
        token = logprob.decoded_token if logprob.decoded_token is not None else raw.decode("utf-8", "replace")
        return {"token": token, "logprob": _value(logprob.logprob), "bytes": list(raw)}


class TextDelta:
    """What of a completion's text a stream has not sent yet."""

    def __init__(self) -> None:
        self.num_chars = 0
        self.finished = False

    def take(self, completion: CompletionOutput) -> str:
        text = completion.text[self.num_chars:]
        self.num_chars = len(completion.text)
        return text
