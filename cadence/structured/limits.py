"""What one request's output constraint may cost: its size, and what no output satisfies.

Both checks run before a grammar library sees the constraint (sizes in the
server's process, cheaply; the schema check in the checker's worker, see
``isolated.py``), so the errors are the same whichever backend is chosen, and
each names the request's field (``structured_outputs.<kind>``, renamed by the
server to the field the request used).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from cadence.config import EngineConfig
from cadence.sampling_params import StructuredOutputParams

# A rule or terminal definition at the start of a line: Lark's ``name:``,
# ``?name:``, ``NAME.2:``, or GBNF's ``name ::=``. Alternatives on the lines
# that follow (``| ...``) are the same rule.
_DEFINITION = re.compile(r"^[ \t]*[?!]?[A-Za-z_][\w-]*(?:\.-?\d+)?[ \t]*(?::|::=)", re.MULTILINE)


@dataclass(frozen=True)
class GrammarLimits:
    """The ``structured_outputs_*`` limits of ``EngineConfig`` (defaults and help there)."""

    max_bytes: int
    max_rules: int
    max_choices: int
    compile_timeout_s: float

    @classmethod
    def of(cls, config: EngineConfig) -> GrammarLimits:
        return cls(config.structured_outputs_max_bytes, config.structured_outputs_max_rules,
                   config.structured_outputs_max_choices, config.structured_outputs_compile_timeout_s)


def check_size(params: StructuredOutputParams, limits: GrammarLimits) -> None:
    """ValueError naming the field and the option when ``params`` is over a limit."""
    kind = params.kind
    field = f"structured_outputs.{kind}"
    if kind == "choice" and len(params.choice) > limits.max_choices:
        raise ValueError(f"{field}: {len(params.choice)} strings, more than this server's limit of "
                         f"{limits.max_choices} (--structured-outputs-max-choices)")
    num_bytes = constraint_bytes(params)
    if num_bytes > limits.max_bytes:
        raise ValueError(f"{field}: {num_bytes} bytes, more than this server's limit of "
                         f"{limits.max_bytes} (--structured-outputs-max-bytes)")
    if kind == "grammar":
        num_rules = count_rules(params.grammar)
        if num_rules > limits.max_rules:
            raise ValueError(f"{field}: {num_rules} rules, more than this server's limit of "
                             f"{limits.max_rules} (--structured-outputs-max-rules)")


def constraint_bytes(params: StructuredOutputParams) -> int:
    if params.kind == "choice":
        return sum(len(c.encode("utf-8", "surrogatepass")) for c in params.choice)
    value = getattr(params, params.kind)
    return len(value.encode("utf-8", "surrogatepass")) if isinstance(value, str) else 0


def count_rules(grammar: str) -> int:
    """The rule and terminal definitions of a Lark or GBNF grammar (one per line that starts one)."""
    return len(_DEFINITION.findall(grammar))


# ------------------------------------------------------------------ schemas no value satisfies


def unsatisfiable_schema_reason(schema: Any) -> str | None:
    """Why no finite JSON value satisfies ``schema``, when a ``$ref`` cycle is the
    reason (each definition on it requires another, e.g. ``a`` requires a
    property ``b`` that requires a property ``a``); None when the schema can be
    satisfied, or this cannot tell.

    "Productive" is computed as a least fixed point over the local ``$ref``
    targets: a definition is productive once some value of it needs only
    productive definitions. Every other keyword counts as satisfiable (an
    over-approximation), so a schema refused here is refused for certain.
    """
    try:
        return _Productivity(schema).root_reason()
    except RecursionError:  # nested past Python's stack: let the grammar library judge it
        return None


class _Productivity:
    def __init__(self, root: Any) -> None:
        self.root = root
        self.productive: set[str] = set()
        self.refs: dict[str, Any] = {}
        self._collect(root)

    def root_reason(self) -> str | None:
        changed = True
        while changed:
            changed = False
            # Last found first: a chain of definitions then settles in one pass.
            for ref, target in reversed(self.refs.items()):
                if ref not in self.productive and self._satisfiable(target):
                    self.productive.add(ref)
                    changed = True
        if self._satisfiable(self.root):
            return None
        stuck = sorted(ref for ref in self.refs if ref not in self.productive)
        if not stuck:
            return "no JSON value satisfies this schema"
        return (f"no JSON value satisfies this schema: every value of {', '.join(_short(r) for r in stuck[:3])} "
                "must contain another value of the same $ref cycle, without end")

    def _collect(self, node: Any) -> None:
        """Every local ``$ref`` reachable from ``node``, resolved."""
        if isinstance(node, list):
            for item in node:
                self._collect(item)
            return
        if not isinstance(node, dict):
            return
        ref = node.get("$ref")
        if isinstance(ref, str) and ref not in self.refs:
            target = self._resolve(ref)
            if target is not None:
                self.refs[ref] = target
                self._collect(target)
        for key, value in node.items():
            if key not in ("enum", "const", "default", "examples"):
                self._collect(value)

    def _resolve(self, ref: str) -> Any:
        if ref != "#" and not ref.startswith("#/"):
            return None  # another document, or an anchor: not followed
        node = self.root
        for part in ref[2:].split("/") if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node

    def _satisfiable(self, node: Any) -> bool:
        """Over-approximates: False only where every value needs an unproductive $ref."""
        if isinstance(node, bool):
            return node
        if not isinstance(node, dict):
            return True
        ref = node.get("$ref")
        if isinstance(ref, str) and ref in self.refs and ref not in self.productive:
            return False
        if any(not self._satisfiable(sub) for sub in _list(node.get("allOf"))):
            return False
        for key in ("anyOf", "oneOf"):
            alternatives = _list(node.get(key))
            if alternatives and not any(self._satisfiable(sub) for sub in alternatives):
                return False
        if "enum" in node or "const" in node:
            return True
        types = node.get("type")
        types = {types} if isinstance(types, str) else (
            {t for t in types if isinstance(t, str)} if isinstance(types, list) else None)
        if not types or not types <= {"object", "array"}:
            return True  # a string, number, boolean or null (or, untyped, any value) needs no $ref
        return ("object" in types and self._object_ok(node)) or ("array" in types and self._array_ok(node))

    def _object_ok(self, node: dict) -> bool:
        properties = node.get("properties")
        properties = properties if isinstance(properties, dict) else {}
        return all(self._satisfiable(properties[name]) for name in _list(node.get("required"))
                   if isinstance(name, str) and name in properties)

    def _array_ok(self, node: dict) -> bool:
        min_items = node.get("minItems", 0)
        if not isinstance(min_items, int) or min_items <= 0:
            return True
        needed = _list(node.get("prefixItems"))[:min_items]
        if len(needed) < min_items and isinstance(node.get("items"), (dict, bool)):
            needed.append(node["items"])
        return all(self._satisfiable(sub) for sub in needed)


def _short(text: str, limit: int = 80) -> str:
    """At most ``limit`` characters of user input in a message."""
    return text if len(text) <= limit else text[:limit] + "..."


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []
