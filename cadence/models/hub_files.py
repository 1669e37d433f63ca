"""Which of a Hub repository's files make the model cadence loads. Pure Python.

    choose_files(paths, quant)  -> Choice: a GGUF quantization's file (every shard of a
                                   split one), or a safetensors checkpoint's files
    weight_files(paths, index)  -> the safetensors a checkpoint's index names

The rule (written in the README's "Models by name"):

    owner/name:QUANT   the GGUF file(s) of that quantization, QUANT as in the file
                       names (Q4_K_M, q8_0, IQ4_XS, F16 ...; any case), or a file's
                       own name (owner/name:sub/model.gguf)
    owner/name         a safetensors checkpoint (config.json, tokenizer.json and
                       *.safetensors at the top) when there is one; else GGUF, Q4_K_M
                       (llama.cpp's default) or the repository's only quantization

A quantization's label is the last quant-like word of a file's name (``Qwen3-0.6B-Q4_K_M.gguf``
-> ``Q4_K_M``, ``model.Q8_0-00001-of-00002.gguf`` -> ``Q8_0``); vision projectors
(``mmproj``) and importance matrices are no models.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass

DEFAULT_GGUF_QUANT = "Q4_K_M"
GGUF, SAFETENSORS = "gguf", "safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SPLIT_SUFFIX = re.compile(r"-(\d{5})-of-(\d{5})$")
# ggml type names as files spell them: Q4_K_M, Q8_0, IQ4_XS, Q4_0_4_4, TQ1_0, F16, BF16, MXFP4 ...
_QUANT_WORD = re.compile(r"(?<![a-z0-9])(?:t?i?q\d(?:_[a-z0-9]+)*|b?f16|f32|mxfp4(?:_moe)?)(?![a-z0-9])",
                         re.IGNORECASE)
_NOT_MODELS = ("mmproj", "imatrix")


class ChoiceError(ValueError):
    """No file (or several) fits: the message says what the repository has instead."""


@dataclass(frozen=True)
class Choice:
    kind: str  # GGUF or SAFETENSORS
    files: tuple[str, ...]  # repository paths to fetch (for safetensors: the small files first)
    entry: str | None  # the path load_model gets inside the snapshot; None: the folder itself
    label: str | None = None  # the GGUF's quantization


@dataclass(frozen=True)
class GGUFGroup:
    """One GGUF model of the repository: a file, or every shard of a split one."""

    label: str
    files: tuple[str, ...]  # in shard order
    num_shards: int  # what the names say (1: not split)

    @property
    def complete(self) -> bool:
        return len(self.files) == self.num_shards


def choose_files(paths: list[str], quant: str | None) -> Choice:
    """The files to fetch for ``quant`` (None: the default) among a repository's ``paths``."""
    groups = gguf_groups(paths)
    if quant is not None:
        if not groups:
            raise ChoiceError(f"has no GGUF files, and ':{quant}' names a GGUF quantization")
        return _gguf_choice(_pick_group(groups, quant))
    if "config.json" in paths and _top_level(paths, ".safetensors"):
        if "tokenizer.json" not in paths:
            raise ChoiceError("has no tokenizer.json, which cadence reads a model's tokenizer from")
        return Choice(SAFETENSORS, tuple(_top_level(paths, ".json", ".jinja")), None)
    if groups:
        return _gguf_choice(_pick_group(groups, None))
    raise ChoiceError("holds neither a safetensors checkpoint (config.json and *.safetensors) "
                      "nor GGUF files")


def weight_files(paths: list[str], index: dict | None) -> list[str]:
    """The weights of a safetensors checkpoint: those its index names, else every top-level file."""
    if index is not None:
        return sorted(set(index["weight_map"].values()))
    return _top_level(paths, ".safetensors")


def gguf_groups(paths: list[str]) -> list[GGUFGroup]:
    """The repository's GGUF models, each file or set of shards once, by path."""
    shards: dict[str, list[tuple[int, int, str]]] = {}
    for path in paths:
        name = posixpath.basename(path)
        if not name.lower().endswith(".gguf") or any(word in name.lower() for word in _NOT_MODELS):
            continue
        stem = path[: -len(".gguf")]
        match = _SPLIT_SUFFIX.search(stem)
        no, count = (int(match[1]), int(match[2])) if match else (1, 1)
        key = stem[: match.start()] if match else stem
        shards.setdefault(key, []).append((no, count, path))
    return [GGUFGroup(quant_label(key), tuple(p for _, _, p in sorted(found)), max(c for _, c, _ in found))
            for key, found in sorted(shards.items())]


def quant_label(stem: str) -> str:
    """``dir/Qwen3-0.6B-Q4_K_M`` -> ``Q4_K_M``; a name with no quant word is its own label."""
    name = posixpath.basename(stem)
    words = _QUANT_WORD.findall(name)
    return words[-1].upper() if words else name


def _pick_group(groups: list[GGUFGroup], quant: str | None) -> GGUFGroup:
    wanted = quant or DEFAULT_GGUF_QUANT
    if wanted.lower().endswith(".gguf"):  # a file's name (or path) in the repository
        found = [g for g in groups if any(wanted in (f, posixpath.basename(f)) for f in g.files)]
    else:
        found = [g for g in groups if g.label == wanted.upper()]
    if quant is None and not found and len(groups) == 1:
        found = groups  # the only quantization there is
    if not found:
        raise ChoiceError(f"has no {wanted} GGUF; its quantizations: {labels_of(groups)} "
                          "(name one as owner/name:QUANT)")
    if len(found) > 1:
        names = ", ".join(g.files[0] for g in found)
        raise ChoiceError(f"has several {wanted} GGUF models ({names}); name one by its file, "
                          "owner/name:FILE.gguf")
    return found[0]


def labels_of(groups: list[GGUFGroup]) -> str:
    return ", ".join(sorted({g.label for g in groups}))


def _gguf_choice(group: GGUFGroup) -> Choice:
    if not group.complete:
        raise ChoiceError(f"lists {len(group.files)} of the {group.num_shards} shards of its "
                          f"{group.label} GGUF ({group.files[0]} ...)")
    return Choice(GGUF, group.files, group.files[0], group.label)


def _top_level(paths: list[str], *suffixes: str) -> list[str]:
    return sorted(p for p in paths if "/" not in p and p.endswith(suffixes))
