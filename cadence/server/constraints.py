"""What a request asks its output to look like, as ``StructuredOutputParams``.

One request may constrain its output in one way, through one of:

- ``response_format``: OpenAI's ``{"type": "json_object"}`` or
  ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``
  (``"text"`` asks for nothing);
- ``structured_outputs``: vLLM's ``{"json" | "regex" | "choice" | "grammar" |
  "json_object": ...}``;
- vLLM's older ``guided_json``, ``guided_regex``, ``guided_choice``,
  ``guided_grammar``;
- ``tool_choice`` ``"required"`` or a named function (``tool_calls.py``).

Errors name the field the request used, so a 400 points at it.
"""

from __future__ import annotations

from typing import Any

from cadence.sampling_params import STRUCTURED_KINDS, StructuredOutputParams

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


def from_response_format(response_format: dict[str, Any] | None) -> StructuredOutputParams | None:
    """OpenAI's ``response_format`` (a dict as sent); None for absent or ``text``."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputParams(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError("response_format.json_schema: required with type json_schema "
                             '(an object: {"name": ..., "schema": {...}})')
        schema = spec.get("schema", spec.get("json_schema"))
        if not isinstance(schema, dict):
            raise ValueError("response_format.json_schema.schema: must be a JSON schema object")
        return StructuredOutputParams(json=schema)
    raise ValueError(f"response_format.type: must be text, json_object or json_schema, got {kind!r}")


def requested_constraint(body: Any) -> tuple[str, StructuredOutputParams] | None:
    """(the field it came from, the constraint) of a request body, or None.

    ``body`` has ``response_format``, ``structured_outputs`` and the
    ``guided_*`` fields; setting more than one of them is refused.
    """
    found: list[tuple[str, StructuredOutputParams]] = []
    response_format = body.response_format
    if response_format is not None:
        try:
            params = from_response_format(response_format.model_dump(by_alias=True))
        except ValueError as err:
            raise ValueError(_named("response_format", str(err))) from None
        if params is not None:
            found.append(("response_format", params))
    structured = body.structured_outputs
    if structured is not None:
        if hasattr(structured, "model_dump"):  # the server's pydantic model of the field
            structured = structured.model_dump(by_alias=True, exclude_none=True)
        found.append(("structured_outputs", _build("structured_outputs", structured)))
    for name, kind in GUIDED_FIELDS.items():
        value = getattr(body, name)
        if value is not None:
            found.append((name, _build(name, {kind: value})))
    if len(found) > 1:
        raise ValueError(f"{found[1][0]}: only one way of constraining the output per request "
                         f"(this request also sets {found[0][0]})")
    return found[0] if found else None


def rename_field(message: str, source: str) -> str:
    """A grammar backend's ``structured_outputs.<kind>: ...`` under the request's own field."""
    head, sep, rest = message.partition(":")
    if not sep or not head.startswith("structured_outputs"):
        return message
    if source == "response_format":
        return f"response_format.json_schema.schema:{rest}"
    if source == "tool_choice":  # the forced call's grammar is made of the tools' schemas
        return f"tools:{rest}"
    if source.startswith("guided_"):
        return f"{source}:{rest}"
    return message


def _build(field: str, value: Any) -> StructuredOutputParams:
    if not isinstance(value, dict):
        raise ValueError(f"{field}: must be an object")
    unknown = sorted(set(value) - set(STRUCTURED_KINDS))
    if unknown:
        raise ValueError(f"{field}: unknown field(s) {unknown} (known: {', '.join(STRUCTURED_KINDS)})")
    try:
        return StructuredOutputParams(**value)
    except ValueError as err:
        raise ValueError(rename_field(str(err), field)) from None


def _named(field: str, message: str) -> str:
    return message if message.startswith(field) else f"{field}: {message}"
