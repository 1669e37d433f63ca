"""Incremental detokenization and stop strings.

Text grows token by token from each token's bytes; a character split across
tokens appears only once its last byte arrived (an incremental UTF-8
decoder keeps the incomplete tail). Stop strings are searched only in the
text that could contain a new match, and streaming holds back the last
``len(longest stop) - 1`` characters, so a partial stop string is never
emitted:

    text:        "The answer is 42.\\n\\nQ"     stop: "\\n\\nQ:"
    streamable:  "The answer is 42."          held back: "\\n\\nQ"
"""

from __future__ import annotations

import codecs

from cadence.models.tokenizer import Tokenizer
from cadence.sampling_params import SamplingParams


class IncrementalDetokenizer:
    """The output text of one completion, and whether a stop string ended it."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._skip_ids = frozenset(tokenizer.all_special_ids) if params.skip_special_tokens else frozenset()
        self._stops = params.stop
        self._include_stop = params.include_stop_str_in_output
        self._holdback = max((len(s) for s in self._stops), default=1) - 1
        self.text = ""
        self.stop_string: str | None = None

    def append(self, token_ids: list[int]) -> str | None:
        """Add tokens; returns the stop string if one now ends the text."""
        if self.stop_string is not None:
            return self.stop_string
        chunk = b"".join(
            self._tokenizer.token_bytes(t) for t in token_ids if t not in self._skip_ids
        )
        if not chunk:
            return None
        start = len(self.text)
        self.text += self._decoder.decode(chunk)
        if self._stops:
            self._check_stop_strings(start)
        return self.stop_string

    def _check_stop_strings(self, start: int) -> None:
        # A new match must end in the new text, so it starts no earlier than this.
        search_from = max(0, start - self._holdback)
        best: tuple[int, str] | None = None
        for stop in self._stops:
            index = self.text.find(stop, search_from)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return
        index, stop = best
        self.text = self.text[: index + len(stop)] if self._include_stop else self.text[:index]
        self.stop_string = stop

    def streamable_text(self, finished: bool) -> str:
        """The text a stream may show: all of it once finished, else without a
        tail that could still become a stop string."""
        if finished or self.stop_string is not None or not self._holdback:
            return self.text
        return self.text[: max(0, len(self.text) - self._holdback)]
