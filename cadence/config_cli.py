"""Config dataclasses as command-line options, written once for every CLI.

    add_config_options(parser, classes)   one --flag per field (help and default from the class)
    add_config_options(parser, classes, only=names)   only those fields' flags
    options_of(args, classes)             the flags the user gave, by field name

``cadence generate``, ``cadence serve`` and ``cadence simulate`` all build
their options here; a leaf module (stdlib and ``cadence.config`` only), so
the CLIs import it and never each other.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, Collection

from cadence.config import (
    CacheConfig, EngineConfig, KVTransferConfig, LoRAConfig, ParallelConfig, RouterConfig,
    SchedulerConfig, SpeculativeConfig, field_names, parse_json_object,
)

ENGINE_OPTION_CLASSES = (
    EngineConfig, SchedulerConfig, CacheConfig, SpeculativeConfig, LoRAConfig, ParallelConfig,
    RouterConfig, KVTransferConfig,
)
# Whole-object flags: one JSON value for every field of a class (vLLM's --kv-transfer-config).
WHOLE_OBJECT_FLAGS = {KVTransferConfig: "kv_transfer_config"}


def add_config_options(parser: argparse.ArgumentParser, classes=ENGINE_OPTION_CLASSES,
                       only: Collection[str] | None = None) -> None:
    """One ``--option`` per config field (or per field named in ``only``, for a
    command that serves some of a class); unset options keep the class default."""
    for cls in classes:
        fields = [f for f in dataclasses.fields(cls) if only is None or f.name in only]
        whole = WHOLE_OBJECT_FLAGS.get(cls)
        if only is not None and whole not in only:
            whole = None
        if not fields and whole is None:
            continue
        # A subset's group goes without the class's description, which is of all its fields.
        description = (cls.__doc__ or "").strip() if only is None else None
        group = parser.add_argument_group(cls.__name__, description)
        hints = typing.get_type_hints(cls)
        for field in fields:
            flag = "--" + field.name.replace("_", "-")
            base = _base_type(hints[field.name])
            help_text = f"{field.metadata.get('help', '')} (default: {field.default})"
            if base is bool:
                group.add_argument(flag, dest=field.name, action=argparse.BooleanOptionalAction,
                                   default=argparse.SUPPRESS, help=help_text)
            elif base is dict:  # a JSON object
                group.add_argument(flag, dest=field.name, type=_json_option(field.name),
                                   default=argparse.SUPPRESS, metavar="JSON", help=help_text)
            elif base is tuple:  # tuple[str, ...]: one or more values, the flag repeatable
                group.add_argument(flag, dest=field.name, nargs="+", action="extend", type=str,
                                   default=argparse.SUPPRESS, metavar="VALUE", help=help_text)
            else:
                group.add_argument(flag, dest=field.name, type=base, default=argparse.SUPPRESS,
                                   metavar=base.__name__.upper(), help=help_text)
        if whole is not None:
            group.add_argument("--" + whole.replace("_", "-"), dest=whole, type=_json_option(whole),
                               default=argparse.SUPPRESS, metavar="JSON",
                               help=f"All the {cls.__name__} fields as one JSON object.")


def options_of(args: argparse.Namespace, classes=ENGINE_OPTION_CLASSES) -> dict[str, Any]:
    """The options given on the command line that belong to ``classes``."""
    names = set().union(*(field_names(cls) for cls in classes))
    names.update(WHOLE_OBJECT_FLAGS[cls] for cls in classes if cls in WHOLE_OBJECT_FLAGS)
    return {name: value for name, value in vars(args).items() if name in names}


def _base_type(annotation: Any) -> type:
    """int for ``int | None``, tuple for ``tuple[str, ...]``, etc."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _base_type(args[0])
    return typing.get_origin(annotation) or annotation


def _json_option(name: str):
    """An argparse type reading a JSON object (its error names the option)."""
    def parse(text: str) -> dict:
        try:
            return parse_json_object(text, name)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    parse.__name__ = "JSON object"
    return parse
