"""The prompt in a completion's answer: ``echo`` and vLLM's ``prompt_logprobs``.

With ``echo`` the prompt comes before the completion, in the text and, when
``logprobs`` is asked, in the legacy logprobs object too: its tokens first,
the first with a null logprob and null top logprobs (nothing scores it), as
OpenAI and vLLM answer. Offsets run over the whole text, prompt included.
``prompt_logprobs`` (vLLM's) adds each choice's ``prompt_logprobs``: null,
then per prompt position the token id (as a JSON key) -> logprob, rank and
decoded token. The engine computes them (``SamplingParams.prompt_logprobs``);
a request that asks them takes no prefix-cache hit.
"""

from __future__ import annotations

from typing import Any

from cadence.engine.outputs import Logprob, RequestOutput
from cadence.models.tokenizer import Tokenizer
from cadence.server.formatting import CompletionLogprobs, logprob_value


class PromptEcho:
    """What the choices of one prompt show of it: the echoed text and logprobs,
    and ``prompt_logprobs``; nothing when the request asks neither."""

    def __init__(self, tokenizer: Tokenizer, echo: bool, logprobs: int | None,
                 prompt_logprobs: int | None, echo_only: bool = False) -> None:
        """``echo_only``: the completion (one token the engine had to make) is not shown."""
        self.tokenizer = tokenizer
        self.echo = echo
        self.echo_only = echo_only
        self.num_top = logprobs  # None: the completion has no logprobs object
        self.prompt_logprobs = prompt_logprobs

    def text(self, output: RequestOutput) -> str:
        """The prompt as the client sent it (its token ids decoded), if echoed."""
        if not self.echo:
            return ""
        if output.prompt is not None:
            return output.prompt
        return self.tokenizer.decode(output.prompt_token_ids)

    def completion_logprobs(self, output: RequestOutput) -> CompletionLogprobs:
        """A builder of the completion's logprobs, its offsets after the echoed prompt."""
        builder = CompletionLogprobs()
        builder.text_offset = len(self.text(output))
        return builder

    def first_choice(self, output: RequestOutput, text: str,
                     logprobs: dict[str, Any] | None) -> dict[str, Any]:
        """A choice's first text and logprobs with the prompt before them, and its
        ``prompt_logprobs`` if asked."""
        if self.echo_only:
            text = ""
            logprobs = None if logprobs is None else {key: [] for key in logprobs}
        choice: dict[str, Any] = {"text": self.text(output) + text, "logprobs": logprobs}
        if self.echo and logprobs is not None and self.num_top is not None:
            echoed = self._echo_logprobs(output)
            choice["logprobs"] = {key: echoed[key] + logprobs[key] for key in echoed}
        if self.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_json(output)
        return choice

    def usage(self, counts: dict[str, Any]) -> dict[str, Any]:
        """The usage object: no completion tokens where none is shown (``echo_only``)."""
        if self.echo_only:
            counts = {**counts, "completion_tokens": 0, "total_tokens": counts["prompt_tokens"]}
        return counts

    def _echo_logprobs(self, output: RequestOutput) -> dict[str, Any]:
        """The prompt's part of the legacy logprobs object."""
        rows = output.prompt_logprobs or []
        tokens, values, tops, offsets = [], [], [], []
        offset = 0
        for position, token_id in enumerate(output.prompt_token_ids):
            piece = self._piece(token_id, None)
            row = rows[position] if position < len(rows) else None
            tokens.append(piece)
            offsets.append(offset)
            offset += len(piece)
            if not row:  # the first token: nothing before it scores it
                values.append(None)
                tops.append(None)
                continue
            entry = row.get(token_id)
            values.append(logprob_value(entry.logprob) if entry is not None else None)
            tops.append({self._piece(t, lp): logprob_value(lp.logprob)
                         for t, lp in sorted(row.items(), key=lambda item: item[1].rank or 0)
                         if lp.rank is not None and lp.rank <= (self.num_top or 0)
                         or t == token_id})
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
                "text_offset": offsets}

    def _piece(self, token_id: int, logprob: Logprob | None) -> str:
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.tokenizer.token_bytes(token_id).decode("utf-8", "replace")


def prompt_logprobs_json(output: RequestOutput) -> list[dict[str, Any] | None] | None:
    """vLLM's ``prompt_logprobs`` of a choice: None first, then one dict per prompt token."""
    if output.prompt_logprobs is None:
        return None
    return [None if not row else {
        str(token_id): {"logprob": logprob_value(lp.logprob), "rank": lp.rank,
                        "decoded_token": lp.decoded_token}
        for token_id, lp in row.items()} for row in output.prompt_logprobs]

