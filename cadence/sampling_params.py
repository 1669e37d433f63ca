"""Sampling parameters of one request, validated at construction.

Every invalid value raises ``ValueError`` whose message starts with the
field's name, so the server can answer HTTP 400 naming it.
"""

from __future__ import annotations

import dataclasses
import json as _json
import math
from dataclasses import dataclass, field
from typing import Any

# Temperatures below this are treated as greedy (argmax).
GREEDY_EPSILON = 1e-5
# OpenAI allows temperatures up to 2; far beyond that the distribution is
# noise, and a huge value (1e308) is a mistake rather than a wish.
MAX_TEMPERATURE = 100.0
# Every integer crosses to the engine process as msgpack, which carries at most
# 64 bits: a larger value must be refused here, not fail in the send.
MAX_INT64 = 2**63 - 1
MAX_SEED = 2**64 - 1  # torch generators take an unsigned 64-bit seed
# Seen tokens' logits are divided (positive) or multiplied (negative) by the
# repetition penalty r. vLLM and Hugging Face accept any r > 0, but an r below
# float32's normal range (1e-40) turns every logit into inf or NaN and the
# sampler into argmax-of-garbage (token 0). Useful values lie near 1 (1.0-1.5
# penalise, below 1 favours); [1e-6, 1e6] keeps every scaled logit finite in
# float32 and refuses only mistakes.
MIN_REPETITION_PENALTY = 1e-6
MAX_REPETITION_PENALTY = 1e6
# vLLM's (and OpenAI's) range for the additive penalties.
MAX_ABS_PRESENCE_FREQUENCY_PENALTY = 2.0
# A cache salt is a secret of a few dozen characters (vLLM suggests 43: 256
# bits in base64); far longer is a mistake, and it travels with every request.
MAX_CACHE_SALT_LEN = 1024


@dataclass(frozen=True)
class StructuredOutputParams:
    """Constrain the output to a JSON schema, any JSON object, a regex, a
    choice of strings or a grammar (Lark, or GBNF/EBNF when it uses ``::=``).

    Exactly one of the fields must be set (vLLM's names). A schema given as a
    dict is kept as its JSON text, and choices as a tuple, so the params stay
    hashable; a grammar backend checks the content itself. An object schema
    with ``properties`` and no ``additionalProperties`` allows no other keys
    (OpenAI's strict mode, xgrammar's default).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        kinds = [name for name in STRUCTURED_KINDS if getattr(self, name) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError("structured_outputs: exactly one of json, regex, choice, grammar, "
                             f"json_object must be set, got {kinds or 'none'}")
        if isinstance(self.json, dict):
            object.__setattr__(self, "json", _json.dumps(self.json))  # keeps property order
        if self.json is not None and not isinstance(self.json, str):
            raise ValueError("structured_outputs.json: must be a JSON schema (an object or its text)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name}: must be a non-empty string")
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice):
                raise ValueError("structured_outputs.choice: must be a list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))
            if not self.choice:
                raise ValueError("structured_outputs.choice: must not be empty")
        if self.json_object not in (None, True, False):
            raise ValueError("structured_outputs.json_object: must be true or false")

    @property
    def kind(self) -> str:
        """Which field is set: json, regex, choice, grammar or json_object."""
        return next(name for name in STRUCTURED_KINDS if getattr(self, name) not in (None, False))


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class ThinkingTokens:
    """The token ids that open and close a model's thinking, for a thinking
    budget: the front end tokenizes them (the engine has no tokenizer).

    ``end_ids`` is how the model itself closes (e.g. ``</think>``);
    ``forced_end_ids`` what the engine makes it write when the budget is spent
    (e.g. ``\n</think>\n\n``); ``starts_inside``: the prompt already opened
    the thinking (a template that ends with ``<think>\n``).
    """

    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]
    forced_end_ids: tuple[int, ...]
    starts_inside: bool = False

    def __post_init__(self) -> None:
        for name in ("start_ids", "end_ids", "forced_end_ids"):
            ids = tuple(getattr(self, name))
            object.__setattr__(self, name, ids)
            if not ids:
                raise ValueError(f"thinking_token_budget: the model's {name} must not be empty")
            for t in ids:
                _check_int("thinking_token_budget", t, minimum=0)


POOLING_TYPES = ("last", "mean")


@dataclass(frozen=True)
class PoolingParams:
    """A pooling request (embeddings): no token is sampled; the request finishes
    in the step that computes its prompt's last token, with the pooled final
    hidden state (the model's final norm applied).

    ``type``: ``last`` (the last prompt token's state, for decoder LLMs) or
    ``mean`` (the mean over the prompt's tokens); None: the model's own (its
    GGUF ``pooling_type``, else last). ``normalize``: divided by its L2 norm.
    """

    type: str | None = None
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.type is not None and self.type not in POOLING_TYPES:
            raise ValueError(f"pooling: type must be one of {', '.join(POOLING_TYPES)}, "
                             f"got {_shown(self.type)}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"pooling: normalize must be true or false, got {_shown(self.normalize)}")

    @property
    def needs_every_position(self) -> bool:
        """Whether every prompt position must be computed (no prefix-cache hit):
        all but last-token pooling read every position's state (None may be mean)."""
        return self.type != "last"


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next tokens of a request, and when to stop."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1, as in OpenAI/vLLM clients) means all tokens
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    structured_outputs: StructuredOutputParams | None = None
    skip_special_tokens: bool = True
    # vLLM's per-request salt of the prefix cache: requests share cached blocks
    # only when their salts are equal (no salt shares with no salt), so one
    # tenant cannot learn another's prompts from cache hits (Request.extra_hash_key).
    cache_salt: str | None = None
    # vLLM's: after this many thinking tokens the engine forces the end of the
    # thinking (``thinking.forced_end_ids``), then the answer follows
    # (cadence/core/sched/thinking.py). ``thinking`` comes from the front end.
    thinking_token_budget: int | None = None
    thinking: ThinkingTokens | None = None
    # An embedding request: pooled hidden state, no sampled token (PoolingParams).
    pooling: PoolingParams | None = None
    extra_args: dict[str, Any] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        # Normalise list-like inputs so the object stays hashable and frozen.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        if self.stop_token_ids is None:
            object.__setattr__(self, "stop_token_ids", ())
        else:
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if isinstance(self.structured_outputs, dict):
            unknown = set(self.structured_outputs) - set(STRUCTURED_KINDS)
            if unknown:
                raise ValueError(f"structured_outputs: unknown field(s) {sorted(unknown)} "
                                 f"(known: {', '.join(STRUCTURED_KINDS)})")
            object.__setattr__(
                self, "structured_outputs", StructuredOutputParams(**self.structured_outputs)
            )
        self._validate()

    def _validate(self) -> None:
        _check_int("n", self.n, minimum=1)
        _check_number("temperature", self.temperature, minimum=0.0, maximum=MAX_TEMPERATURE)
        _check_number("top_p", self.top_p, minimum=0.0, maximum=1.0)
        if self.top_p == 0.0:
            raise ValueError("top_p: must be in (0, 1], got 0")
        _check_int("top_k", self.top_k, minimum=0)
        _check_number("min_p", self.min_p, minimum=0.0, maximum=1.0)
        if self.seed is not None:
            _check_seed(self.seed, self.n)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens: must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop: every stop string must be a non-empty str, got {_shown(s)}")
            if not _is_valid_unicode(s):
                raise ValueError("stop: a stop string contains a lone surrogate (not valid Unicode)")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, minimum=0)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, minimum=0)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, minimum=0)
        for name in ("presence_penalty", "frequency_penalty"):
            _check_number(name, getattr(self, name), minimum=-MAX_ABS_PRESENCE_FREQUENCY_PENALTY,
                          maximum=MAX_ABS_PRESENCE_FREQUENCY_PENALTY)
        _check_number("repetition_penalty", self.repetition_penalty,
                      minimum=MIN_REPETITION_PENALTY, maximum=MAX_REPETITION_PENALTY)
        if self.cache_salt is not None:
            _check_cache_salt(self.cache_salt)
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputParams
        ):
            raise ValueError("structured_outputs: must be a StructuredOutputParams or a dict")
        self._check_thinking_budget()
        self._check_pooling()

    def _check_thinking_budget(self) -> None:
        if self.thinking_token_budget is None:
            return
        _check_int("thinking_token_budget", self.thinking_token_budget, minimum=0)
        if not isinstance(self.thinking, ThinkingTokens):
            raise ValueError("thinking_token_budget: needs the model's thinking tokens "
                             "(a server started with --reasoning-parser)")

    def _check_pooling(self) -> None:
        if self.pooling is None:
            return
        if not isinstance(self.pooling, PoolingParams):
            raise ValueError("pooling: must be a PoolingParams")
        asked = [name for name, value in (("n", self.n != 1), ("logprobs", self.logprobs is not None),
                                          ("prompt_logprobs", self.prompt_logprobs is not None),
                                          ("structured_outputs", self.structured_outputs is not None),
                                          ("thinking_token_budget", self.thinking_token_budget is not None))
                 if value]
        if asked:
            raise ValueError(f"{asked[0]}: a pooling (embedding) request samples no token")

    @property
    def needs_every_prompt_position(self) -> bool:
        """Whether the request reads every prompt position's output (prompt
        logprobs, mean pooling): it must take no prefix-cache hit."""
        return self.prompt_logprobs is not None or (
            self.pooling is not None and self.pooling.needs_every_position)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON

    def replace(self, **changes: Any) -> "SamplingParams":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def embedding_params(pooling: PoolingParams | None, model_pooling_type: str | None) -> SamplingParams:
    """The params of an embedding request: ``pooling`` with its type made
    concrete (the model's, else last), so that last-token pooling may take
    prefix-cache hits."""
    pooling = pooling or PoolingParams()
    if pooling.type is None:
        pooling = dataclasses.replace(pooling, type=model_pooling_type or "last")
    return SamplingParams(max_tokens=None, temperature=0.0, pooling=pooling)


def _check_int(
    name: str, value: Any, *, minimum: int | None = None, maximum: int | None = MAX_INT64
) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: must be an integer, got {_shown(value)}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {_shown(value)}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name}: must be <= {maximum}, got {_shown(value)}")


def _check_seed(seed: Any, n: int) -> None:
    # Sample i of n draws with seed + i (parallel sampling): every one must fit.
    _check_int("seed", seed, maximum=None)
    if not 0 <= seed <= MAX_SEED - (n - 1):
        raise ValueError(f"seed: must be an unsigned 64-bit integer in [0, {MAX_SEED - (n - 1)}] "
                         f"(sample i of n uses seed + i), got {_shown(seed)}")


def _check_cache_salt(salt: Any) -> None:
    if not isinstance(salt, str) or not salt:
        raise ValueError("cache_salt: must be a non-empty string")
    if len(salt) > MAX_CACHE_SALT_LEN:
        raise ValueError(f"cache_salt: must be at most {MAX_CACHE_SALT_LEN} characters, "
                         f"got {len(salt)}")
    if not _is_valid_unicode(salt):
        raise ValueError("cache_salt: contains a lone surrogate (not valid Unicode)")


def _check_number(
    name: str, value: Any, *, minimum: float | None = None, maximum: float | None = None
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}: must be a number, got {_shown(value)}")
    if isinstance(value, float) and not math.isfinite(value):  # NaN, +-inf: no sampler survives them
        raise ValueError(f"{name}: must be a finite number, got {_shown(value)}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {_shown(value)}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name}: must be <= {maximum}, got {_shown(value)}")


def _shown(value: Any, limit: int = 100) -> str:
    """``repr(value)``, at most ``limit`` characters: an error quotes a bounded
    prefix of what it refuses (a 1 MB string, an integer of a million digits)."""
    try:
        text = repr(value)
    except ValueError:  # an int beyond Python's digit limit for str()
        return f"an integer of {value.bit_length()} bits"
    return text if len(text) <= limit else text[:limit] + "..."


def _is_valid_unicode(text: str) -> bool:
    """False for a lone surrogate (JSON can escape one): no UTF-8 encoder takes it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
