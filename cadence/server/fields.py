"""One rule for request fields, in one place.

Every top-level field of a request body is one of:

    honoured   a field of the route's body model in ``protocol.py``: it does
               what the README's "HTTP API" section says
    refused    a field of OpenAI's or vLLM's schema for the route that cadence
               does not honour (``NOT_HONOURED``): a 400 naming it, unless its
               value asks for nothing (null, empty, or a listed neutral value,
               e.g. ``use_beam_search: false``), so a client that sends the
               schema's defaults is served and none is silently misled
    unknown    in neither schema: ignored, and logged once per field name per
               process (as vLLM does)

A few schema fields are hints whose purpose cadence serves without them
(``ANY_VALUE``: ``prompt_cache_key``, cadence's prefix cache needs no key):
they are accepted with any value and listed in the README as such. Later
fields join the body models (honoured) or this table, and the README's list.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable

from cadence.server.errors import quoted

logger = logging.getLogger("cadence.server")

# Distinct unknown names logged per process (a client sending ever new names
# must not grow the set, or the log, forever).
MAX_LOGGED_UNKNOWN_FIELDS = 64
ANY_VALUE = object()  # a NotHonoured.neutral that accepts every value


@dataclass(frozen=True)
class NotHonoured:
    """A schema field cadence does not honour: the values that ask for nothing
    besides null, {} and [] (``neutral``), and why any other is refused (the
    400 says "not supported yet", or "not supported: <why>")."""

    neutral: tuple[Any, ...] | object = ()
    why: str | None = None

    @property
    def reason(self) -> str:
        return f"not supported: {self.why}" if self.why else "not supported yet"

    def refuses(self, value: Any) -> bool:
        if self.neutral is ANY_VALUE or value is None or value in ({}, [], ""):
            return False
        return not any(value == neutral for neutral in self.neutral)  # type: ignore[union-attr]


_NO_STORE = "cadence stores no completions"
_HINT = NotHonoured(ANY_VALUE)  # a hint for a provider's cache or monitoring: cadence needs none

# Both generation routes: OpenAI's and vLLM's sampling fields cadence lacks.
_GENERATION = {
    "logit_bias": NotHonoured(),
    "use_beam_search": NotHonoured((False,)),
    "length_penalty": NotHonoured((1, 1.0), "only for beam search, which cadence does not do"),
    "bad_words": NotHonoured(),
    "allowed_token_ids": NotHonoured(),
    "truncate_prompt_tokens": NotHonoured(),
    "spaces_between_special_tokens": NotHonoured((True,)),
    "return_tokens_as_token_ids": NotHonoured((False,)),
    "return_token_ids": NotHonoured((False,)),
    "logits_processors": NotHonoured(),
    "vllm_xargs": NotHonoured(),
    "max_repetition_pattern_size": NotHonoured((0,)),
    "min_repetition_pattern_size": NotHonoured((0,)),
    "repetition_min_count": NotHonoured((0,)),
    "request_id": NotHonoured(why="the server names each request itself (the response's id)"),
    "guided_decoding_backend": NotHonoured(
        why="the grammar backend is the server's (--structured-outputs-backend)"),
    "guided_whitespace_pattern": NotHonoured(),
    "structural_tag": NotHonoured(),
    "mm_processor_kwargs": NotHonoured(),
    "media_io_kwargs": NotHonoured(),
    "lora_request": NotHonoured(why="in a request body; name a served LoRA adapter in the "
                                    "model field (GET /v1/models lists them)"),
}

# Anthropic's Messages API, /v1/messages and its count_tokens.
_ANTHROPIC = {
    "output_config": NotHonoured(),
    "output_format": NotHonoured(),
    "container": NotHonoured(),
    "mcp_servers": NotHonoured(),
    "context_management": NotHonoured(),
    "service_tier": NotHonoured(("auto", "standard_only"), "cadence has one tier"),
    "speed": NotHonoured(("standard",)),
    "metadata": _HINT,
    "cache_control": _HINT,
    "inference_geo": _HINT,
    "diagnostics": _HINT,
    "user_profile_id": _HINT,
    "workspace_id": _HINT,
}

NOT_HONOURED: dict[str, dict[str, NotHonoured]] = {
    "chat": {
        **_GENERATION,
        "prompt_logprobs": NotHonoured(),
        # OpenAI's
        "audio": NotHonoured(why="cadence serves text models"),
        "modalities": NotHonoured((["text"],), "cadence serves text models"),
        "functions": NotHonoured(why="use tools"),
        "function_call": NotHonoured(("none", "auto"), "use tools and tool_choice"),
        "prediction": NotHonoured(),
        "web_search_options": NotHonoured(),
        "reasoning_effort": NotHonoured(why="no chat template cadence loads reads it; "
                                           "chat_template_kwargs {\"enable_thinking\": false} "
                                           "turns thinking off where the template reads that"),
        "verbosity": NotHonoured(),
        "moderation": NotHonoured(),
        "store": NotHonoured((False,), _NO_STORE),
        "metadata": _HINT,
        "service_tier": NotHonoured(("auto", "default"), "cadence has one tier, auto"),
        "safety_identifier": _HINT,
        "prompt_cache_key": _HINT,
        "prompt_cache_retention": _HINT,
        "prompt_cache_options": _HINT,
        # vLLM's
        "echo": NotHonoured((False,)),
        "continue_final_message": NotHonoured((False,)),
        "documents": NotHonoured(),
        "chat_template": NotHonoured(why="the model's own chat template is used"),
        "add_special_tokens": NotHonoured((False,), "the chat template adds the special tokens"),
    },
    "completions": {
        **_GENERATION,
        "suffix": NotHonoured(),
        "prompt_embeds": NotHonoured(),
        "add_special_tokens": NotHonoured((True,), "the prompt always gets the tokenizer's "
                                                   "special tokens"),
    },
    "tokenize": {
        "return_token_strs": NotHonoured((False,)),
        "continue_final_message": NotHonoured((False,)),
        "chat_template": NotHonoured(why="the model's own chat template is used"),
        "chat_template_kwargs": NotHonoured(),
        "tools": NotHonoured(),
        "mm_processor_kwargs": NotHonoured(),
        "media_io_kwargs": NotHonoured(),
    },
    "embeddings": {
        "dimensions": NotHonoured(why="the served model's embeddings have one size (it is not "
                                      "trained for shorter, Matryoshka, ones)"),
        "truncate_prompt_tokens": NotHonoured(),
        "add_special_tokens": NotHonoured((True,), "the input always gets the tokenizer's "
                                                   "special tokens"),
        "priority": NotHonoured((0,)),
        "request_id": NotHonoured(why="the server names each request itself (the response's id)"),
        "mm_processor_kwargs": NotHonoured(),
        "embed_dtype": NotHonoured(("float32",), "base64 sends float32"),
    },
    "detokenize": {},
    # OpenAI's Responses API (responses.py): stateless, function tools, text output.
    "responses": {
        "store": NotHonoured((False,), "cadence keeps no responses (stateless): send the whole "
                                       "conversation in input"),
        "previous_response_id": NotHonoured(why="cadence keeps no responses (stateless): send "
                                                "the whole conversation in input"),
        "conversation": NotHonoured(why="cadence keeps no conversations (stateless): send the "
                                        "whole conversation in input"),
        "background": NotHonoured((False,)),
        "background_options": NotHonoured(),
        "include": NotHonoured(),
        "reasoning": NotHonoured(why="the model reasons as it was trained to; its reasoning, "
                                     "if any, comes back as reasoning items"),
        "max_tool_calls": NotHonoured(),
        "prompt": NotHonoured(why="cadence keeps no prompt templates: send instructions and input"),
        "top_logprobs": NotHonoured((0,)),
        "truncation": NotHonoured(("disabled",)),
        "context_management": NotHonoured(),
        "moderation": NotHonoured(),
        "access_programs": NotHonoured(),
        "image": NotHonoured(why="cadence serves text models"),
        "stream_options": NotHonoured(({"include_obfuscation": False},)),
        "service_tier": NotHonoured(("auto", "default"), "cadence has one tier, auto"),
        "metadata": _HINT,
        "safety_identifier": _HINT,
        "prompt_cache_key": _HINT,
        "prompt_cache_retention": _HINT,
        "prompt_cache_options": _HINT,
    },
    # Anthropic's Messages API (messages.py): text and tool_use blocks.
    "messages": _ANTHROPIC,
    "messages_count_tokens": _ANTHROPIC,
    "load_lora_adapter": {"load_inplace": NotHonoured((False,))},
    "unload_lora_adapter": {},
}


def check_fields(route: str, data: Any, honoured: Iterable[str]) -> None:
    """Apply the rule to a body's top-level fields: ValueError ("field: ...",
    a 400) for the first refused one; unknown ones are logged once and left to
    the body model, which ignores them."""
    if not isinstance(data, dict):
        return  # not an object: the body model says so
    table = NOT_HONOURED[route]
    honoured = set(honoured)
    for name, value in data.items():
        if name in honoured:
            continue
        rule = table.get(name)
        if rule is None:
            log_unknown_field(route, name)
        elif rule.refuses(value):
            raise ValueError(f"{name}: {rule.reason}")


_logged_unknown: set[str] = set()


def log_unknown_field(route: str, name: Any) -> None:
    """One log line per unknown field name per process (at most
    ``MAX_LOGGED_UNKNOWN_FIELDS`` names, then one line saying so)."""
    name = quoted(str(name))
    if name in _logged_unknown or len(_logged_unknown) > MAX_LOGGED_UNKNOWN_FIELDS:
        return
    _logged_unknown.add(name)
    if len(_logged_unknown) > MAX_LOGGED_UNKNOWN_FIELDS:  # the set stops growing here
        logger.warning("cadence: %d unknown request fields logged; further ones are ignored "
                       "without a word", MAX_LOGGED_UNKNOWN_FIELDS)
        return
    logger.warning("cadence: the field %r of a %s request is in neither OpenAI's nor vLLM's "
                   "schema: ignored (logged once)", name, route)
