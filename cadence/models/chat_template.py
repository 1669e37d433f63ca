"""Render a model's Jinja chat template, sandboxed.

Templates come from model files, so they run in jinja2's immutable sandbox.
They expect a few names beyond plain Jinja, which the Hugging Face ecosystem
made conventional: ``raise_exception``, ``strftime_now``, a ``tojson`` that
keeps non-ASCII text, and the ``bos_token``/``eos_token`` strings.
"""

from __future__ import annotations

import datetime
import functools
import json
from typing import Any, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """A template called ``raise_exception`` (e.g. roles out of order)."""


def render_chat_template(
    template: str,
    messages: Sequence[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tools: Sequence[dict[str, Any]] | None = None,
    bos_token: str | None = None,
    eos_token: str | None = None,
    **extra: Any,
) -> str:
    """The prompt text for ``messages``; ``extra`` reaches the template as variables."""
    return _compile(template).render(
        messages=list(messages),
        tools=list(tools) if tools is not None else None,
        add_generation_prompt=add_generation_prompt,
        bos_token=bos_token or "",
        eos_token=eos_token or "",
        **extra,
    )


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    return _environment().from_string(template)


@functools.lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    # trim_blocks/lstrip_blocks: templates are written assuming them (HF renders so).
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; a prompt wants them verbatim.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)
