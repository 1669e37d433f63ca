"""``Tokenizer``: text <-> token ids, special ids, and the chat template.

Built from GGUF metadata (``from_gguf_metadata``) or a Hugging Face folder
(``from_directory``: tokenizer.json + tokenizer_config.json). Either way the
work is done by a ``tokenizers.Tokenizer``; this class adds what an engine
needs around it: stop ids, raw token bytes for incremental detokenization,
and chat-template rendering.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Sequence

from tokenizers import Tokenizer as BackendTokenizer

from cadence.models.chat_template import render_chat_template
from cadence.models.config import gguf_eos_token_ids
from cadence.models.gguf_tokenizer import gguf_tokenizer

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class Tokenizer:
    """A tokenizer plus the model-specific facts an engine needs."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        chat_template: str | None = None,
        byte_level: bool = True,
    ) -> None:
        self.backend = backend
        # The backend counts its added tokens anew at every call (200 us on Gemma 3's
        # 262k vocabulary, paid per id when prompt ids are checked): counted once here.
        self._vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.chat_template = chat_template
        self.byte_level = byte_level  # GPT-2 byte alphabet (else SentencePiece "▁" pieces)
        added = backend.get_added_tokens_decoder()  # id -> AddedToken
        self.all_special_ids = tuple(sorted(i for i, t in added.items() if t.special))
        self._added_text = {i: t.content for i, t in added.items()}

    @classmethod
    def from_gguf_metadata(cls, metadata: dict[str, Any]) -> Tokenizer:
        """From the ``tokenizer.*`` keys of a GGUF (see ``gguf_tokenizer``)."""
        return cls(
            gguf_tokenizer(metadata),
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=gguf_eos_token_ids(metadata),
            chat_template=metadata.get("tokenizer.chat_template"),
            byte_level=metadata.get("tokenizer.ggml.model") == "gpt2",
        )

    @classmethod
    def from_directory(cls, path: str) -> Tokenizer:
        """From a Hugging Face folder: tokenizer.json, tokenizer_config.json, generation_config.json."""
        backend = BackendTokenizer.from_file(os.path.join(path, "tokenizer.json"))
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
        eos_ids = [backend.token_to_id(eos)] if eos is not None else []
        eos_ids += _as_list(_read_json(os.path.join(path, "generation_config.json")).get("eos_token_id"))
        return cls(
            backend,
            bos_token_id=backend.token_to_id(bos) if bos is not None else None,
            eos_token_ids=[i for i in dict.fromkeys(eos_ids) if i is not None],
            chat_template=_directory_chat_template(path, config),
            byte_level=_uses_byte_level(backend),
        )

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens written in the text are recognised.

        ``add_special_tokens`` adds what the model prepends by itself (e.g. BOS).
        ``encode_batch`` gives the same ids as ``encode`` but lets go of the GIL
        while it works (``encode`` holds it: 1.3 s for 2 MB of text), so the
        server's event loop runs on while a worker thread tokenizes a long prompt.
        """
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_piece(self, token_id: int) -> str:
        """The vocabulary entry of ``token_id`` as stored (e.g. "Ġthe", "▁the")."""
        return self.backend.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of text ``token_id`` stands for.

        An incremental detokenizer joins these and emits the longest valid UTF-8
        prefix: a character split over several tokens appears once complete.
        (A SentencePiece decoder also drops the space of the very first token;
        that is left to the caller.)
        """
        if token_id in self._added_text:
            return self._added_text[token_id].encode("utf-8")
        piece = self.id_to_piece(token_id)
        if self.byte_level:
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        match = _BYTE_TOKEN.fullmatch(piece)
        return bytes([int(match.group(1), 16)]) if match else piece.replace("▁", " ").encode("utf-8")

    @property
    def bos_token(self) -> str | None:
        return self._text_of(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self._text_of(self.eos_token_ids[0] if self.eos_token_ids else None)

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """The prompt text for a conversation, rendered with the model's template."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        return render_chat_template(
            self.chat_template, messages, add_generation_prompt=add_generation_prompt,
            tools=tools, bos_token=self.bos_token, eos_token=self.eos_token, **extra)

    def _text_of(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.backend.id_to_token(token_id)


def _gpt2_byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes (controls,
    space, ...) take the characters 256, 257, ... in byte order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in chars]
    chars.update({b: chr(256 + n) for n, b in enumerate(others)})
    return chars


_BYTE_OF_CHAR = {c: b for b, c in _gpt2_byte_alphabet().items()}


def _uses_byte_level(backend: BackendTokenizer) -> bool:
    """Whether the decoder (alone or inside a Sequence) is ByteLevel."""
    if backend.decoder is None:
        return False
    return '"type":"ByteLevel"' in backend.decoder.__getstate__().decode()


def _directory_chat_template(path: str, config: dict[str, Any]) -> str | None:
    """chat_template.jinja if present, else tokenizer_config.json's (the "default" of a list)."""
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.exists(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t["name"]: t["template"] for t in template}
        return named.get("default", next(iter(named.values()), None))
    return template


def _token_text(value: str | dict[str, Any] | None) -> str | None:
    # tokenizer_config.json writes special tokens as a string or as {"content": ...}.
    return value.get("content") if isinstance(value, dict) else value


def _as_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)
