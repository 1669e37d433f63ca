"""A GGUF split into shards (llama.cpp's -0000i-of-0000N names, written here by
gguf-py's writer from the default model) loads as the one file does: same tensors,
same greedy tokens; a missing, renumbered or renamed shard is refused, naming it."""

import os
import shutil

import numpy as np
import pytest

from cadence.engine.llm import LLM
from cadence.models.default_model import default_model_path
from cadence.models.gguf_file import GGUFFile
from cadence.models.gguf_loader import read_gguf
from cadence.models.gguf_split import GGUFSplit, shard_paths
from cadence.sampling_params import SamplingParams
from tests.models.gguf_split_helpers import write_split

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    folder = tmp_path_factory.mktemp("split")
    return [str(p) for p in write_split(default_model_path(), folder / "smollm2.gguf", 3)]


def greedy_tokens(model):
    llm = LLM(model=model, dtype="float32", max_num_seqs=2, kv_cache_memory="32MiB",
              max_model_len=256, num_threads=2)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def test_shard_names():
    assert shard_paths("/m/x-00002-of-00003.gguf") == [
        "/m/x-00001-of-00003.gguf", "/m/x-00002-of-00003.gguf", "/m/x-00003-of-00003.gguf"]
    assert shard_paths("/m/x-00001-of-00001.gguf") is None  # one file: no split
    assert shard_paths("/m/x.Q4_K_M.gguf") is None


def test_any_shard_opens_every_tensor_in_order(shards):
    whole = GGUFFile(default_model_path())
    for path in (shards[0], shards[2]):
        reader, metadata = read_gguf(path)
        assert isinstance(reader, GGUFSplit) and len(reader.files) == 3
        assert [t.name for t in reader.tensors] == [t.name for t in whole.tensors]
        assert {k: v for k, v in metadata.items() if not k.startswith("split.")} == whole.metadata
    by_name = {t.name: t for t in whole.tensors}
    assert all(np.array_equal(t.data, by_name[t.name].data) for t in reader.tensors)
    assert all(len(shard.tensors) < len(whole.tensors) for shard in reader.files)


def test_greedy_tokens_equal_the_unsplit_files(shards):
    assert greedy_tokens(shards[0]) == greedy_tokens(default_model_path())


def test_a_missing_shard_is_named(shards, tmp_path):
    for path in shards[:2]:
        shutil.copy(path, tmp_path)
    with pytest.raises(ValueError, match=r"smollm2-00003-of-00003\.gguf: missing; a GGUF split in 3 files"):
        read_gguf(str(tmp_path / os.path.basename(shards[0])))


def test_shards_that_do_not_belong_together_are_refused(shards, tmp_path):
    # Shard 2 of 3 copied as shard 3: its keys say otherwise.
    for no, source in enumerate([shards[0], shards[1], shards[1]], start=1):
        shutil.copy(source, tmp_path / f"m-{no:05d}-of-00003.gguf")
    with pytest.raises(ValueError, match="named as shard 3 of 3, but its keys say shard 2 of 3"):
        read_gguf(str(tmp_path / "m-00001-of-00003.gguf"))


def test_a_renamed_shard_is_refused(shards, tmp_path):
    renamed = tmp_path / "model.gguf"
    shutil.copy(shards[0], renamed)
    with pytest.raises(ValueError, match="shard 1 of 3 of a split GGUF, renamed"):
        read_gguf(str(renamed))
