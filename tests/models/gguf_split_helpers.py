"""Split a GGUF into llama.cpp's shards with gguf-py's writer, as ``gguf-split`` does:
the first shard has the metadata, every shard a run of the tensors and the split.* keys."""

from __future__ import annotations

import math
from pathlib import Path

from gguf import GGUFReader, GGUFValueType, GGUFWriter


def write_split(source: str | Path, destination: str | Path, num_shards: int) -> list[Path]:
    """Write ``source``'s metadata and tensors as ``destination`` (``x.gguf``) split into
    ``num_shards`` files ``x-00001-of-0000N.gguf`` ...; their paths, first to last."""
    return _rewrite(source, destination, num_shards)


def write_without_keys(source: str | Path, destination: str | Path, keys: tuple[str, ...]) -> Path:
    """``source`` rewritten as one file ``destination`` without the metadata ``keys``."""
    _rewrite(source, destination, 1, drop=keys)
    return Path(destination)


def _rewrite(source: str | Path, destination: str | Path, num_shards: int,
             drop: tuple[str, ...] = ()) -> list[Path]:
    reader = GGUFReader(source)
    architecture = reader.get_field("general.architecture").contents()
    if num_shards == 1:
        writer = GGUFWriter(destination, architecture)
    else:
        per_shard = math.ceil(len(reader.tensors) / num_shards)
        writer = GGUFWriter(destination, architecture, split_max_tensors=per_shard)
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith(("GGUF.", "split.")):
            continue  # written by GGUFWriter itself
        if field.name in drop:
            continue
        kind = field.types[0]
        sub_type = field.types[-1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub_type)
    for tensor in reader.tensors:
        writer.add_tensor_info(tensor.name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes,
                               tensor.tensor_type)
    paths = writer.format_shard_names(Path(destination)) if num_shards > 1 else [Path(destination)]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in reader.tensors:
        writer.write_tensor_data(tensor.data)
    writer.close()
    return paths
