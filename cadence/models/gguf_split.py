"""A GGUF model split over several files (llama.cpp's ``gguf-split``, or gguf-py's
writer with ``split_max_tensors``/``split_max_size``), read as one.

    name-00001-of-00003.gguf   the model's metadata, split.no 0, split.count 3,
                               split.tensors.count T, and the first tensors
    name-00002-of-00003.gguf   split.* keys and the next tensors
    name-00003-of-00003.gguf   ...

Each shard is a whole GGUF file holding a subset of the tensors; ``split.no``
counts from 0, file names from 1. Any shard's path opens the whole model (the
others are found by name). ``GGUFSplit`` offers what the loader reads of a
``GGUFFile``: the first shard's metadata, every tensor in shard order, and
``drop_pages``.
"""

from __future__ import annotations

import os
import re
from typing import Any

from gguf import GGUFValueType

from cadence.models.gguf_file import GGUFFile, GGUFTensor

SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS_COUNT = "split.no", "split.count", "split.tensors.count"
# llama.cpp's llama_split_path: "{prefix}-{no:05d}-of-{count:05d}.gguf", no from 1.
_SPLIT_NAME = re.compile(r"(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf")


def shard_paths(path: str) -> list[str] | None:
    """Every shard's path, first to last, if ``path`` is named as one shard of
    several (``-0000i-of-0000N.gguf``, N > 1); None for any other name."""
    match = _SPLIT_NAME.fullmatch(path)
    if match is None or int(match["count"]) <= 1:
        return None
    count = int(match["count"])
    return [f"{match['prefix']}-{no:05d}-of-{count:05d}.gguf" for no in range(1, count + 1)]


def open_gguf(path: str) -> GGUFFile | GGUFSplit:
    """The GGUF at ``path``: one file, or, named as a shard, the whole split model."""
    paths = shard_paths(path)
    if paths is not None:
        return GGUFSplit(paths)
    reader = GGUFFile(path)
    if int(reader.metadata.get(SPLIT_COUNT, 1)) > 1:
        raise ValueError(f"{path}: shard {reader.metadata.get(SPLIT_NO, 0) + 1} of "
                         f"{reader.metadata[SPLIT_COUNT]} of a split GGUF, renamed: its shards are "
                         "found by llama.cpp's names, <name>-00001-of-0000N.gguf ...")
    return reader


class GGUFSplit:
    """The shards of one model, checked to belong together: each is numbered as its
    name says, and together they hold ``split.tensors.count`` distinct tensors."""

    def __init__(self, paths: list[str]) -> None:
        missing = [p for p in paths if not os.path.exists(p)]
        if missing:
            raise ValueError(f"{missing[0]}: missing; a GGUF split in {len(paths)} files "
                             f"needs all of them ({len(missing)} missing)")
        self.files = [GGUFFile(p) for p in paths]
        self.path = paths[0]
        first = self.files[0]
        self.metadata: dict[str, Any] = first.metadata
        self.value_types: dict[str, GGUFValueType] = first.value_types
        for no, shard in enumerate(self.files):
            _check_shard(shard, no, len(paths))
        self.tensors: list[GGUFTensor] = [t for shard in self.files for t in shard.tensors]
        self._owner = {t.name: shard for shard in self.files for t in shard.tensors}
        self._check_tensors()

    def drop_pages(self, tensor: GGUFTensor) -> None:
        """As ``GGUFFile.drop_pages``, in the shard that holds ``tensor``."""
        self._owner[tensor.name].drop_pages(tensor)

    def _check_tensors(self) -> None:
        if len(self._owner) != len(self.tensors):
            names = [t.name for t in self.tensors]
            twice = next(name for name in names if names.count(name) > 1)
            raise ValueError(f"{self.path}: tensor {twice!r} appears in two shards")
        expected = self.metadata.get(SPLIT_TENSORS_COUNT)
        if expected is not None and int(expected) != len(self.tensors):
            raise ValueError(f"{self.path}: split.tensors.count says {expected} tensors, "
                             f"the {len(self.files)} shards hold {len(self.tensors)}")


def _check_shard(shard: GGUFFile, no: int, count: int) -> None:
    """Shard ``no`` (from 0) of ``count``, as its split.* keys must say."""
    found_no, found_count = shard.metadata.get(SPLIT_NO), shard.metadata.get(SPLIT_COUNT)
    if found_no is None or found_count is None:
        raise ValueError(f"{shard.path}: named as shard {no + 1} of {count}, but has no "
                         f"{SPLIT_NO}/{SPLIT_COUNT} keys: not a split GGUF")
    if int(found_no) != no or int(found_count) != count:
        raise ValueError(f"{shard.path}: named as shard {no + 1} of {count}, but its keys say "
                         f"shard {int(found_no) + 1} of {found_count}")
