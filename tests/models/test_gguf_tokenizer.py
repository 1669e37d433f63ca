"""Tokenizers built from GGUF vocabularies, on small vocabularies written here."""

import pytest
import transformers
from gguf import GGUFWriter

from cadence.models.tokenizer import Tokenizer

# A tiny SentencePiece-style vocabulary: unknown, control, 256 byte tokens, then pieces.
PIECES = {"▁": -1.0, "▁t": -2.0, "▁th": -3.0, "▁the": -1.5, "t": -5.0, "h": -5.0, "e": -5.0,
          "a": -5.0, "c": -5.0, "at": -4.0, "▁c": -3.5, "▁cat": -2.5, "▁a": -3.0, "s": -5.0,
          "▁s": -4.0, "▁sat": -2.8, "▁at": -3.3}
SPM_TOKENS = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + list(PIECES)
SPM_SCORES = [0.0, 0.0, 0.0] + [0.0] * 256 + list(PIECES.values())
SPM_TYPES = [2, 3, 3] + [6] * 256 + [1] * len(PIECES)


def spm_metadata():
    return {
        "general.architecture": "llama", "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": SPM_TOKENS, "tokenizer.ggml.scores": SPM_SCORES,
        "tokenizer.ggml.token_type": SPM_TYPES, "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0,
    }


def write_tokenizer_gguf(path, metadata):
    """A GGUF holding just enough model keys for transformers plus the tokenizer."""
    writer = GGUFWriter(str(path), "llama")
    for key in ("block_count", "context_length", "embedding_length", "feed_forward_length",
                "attention.head_count"):
        writer.add_uint32(f"llama.{key}", 64)
    writer.add_string("tokenizer.ggml.model", metadata["tokenizer.ggml.model"])
    writer.add_array("tokenizer.ggml.tokens", metadata["tokenizer.ggml.tokens"])
    writer.add_array("tokenizer.ggml.scores", metadata["tokenizer.ggml.scores"])
    writer.add_array("tokenizer.ggml.token_type", metadata["tokenizer.ggml.token_type"])
    for key in ("bos_token_id", "eos_token_id", "unknown_token_id"):
        writer.add_uint32(f"tokenizer.ggml.{key}", metadata[f"tokenizer.ggml.{key}"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def spm_pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("spm")
    write_tokenizer_gguf(folder / "vocab.gguf", spm_metadata())
    reference = transformers.AutoTokenizer.from_pretrained(str(folder), gguf_file="vocab.gguf")
    return Tokenizer.from_gguf_metadata(spm_metadata()), reference


@pytest.mark.parametrize("text", ["the cat sat", "the cat  at", "sat", "ü cat?", "hello"])
def test_sentencepiece_vocab_encodes_like_transformers(spm_pair, text):
    tokenizer, reference = spm_pair
    ids = tokenizer.encode(text)
    assert ids == reference.encode(text)
    assert ids[0] == 1  # a SentencePiece GGUF adds BOS unless told otherwise
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_sentencepiece_bytes_for_incremental_detokenization(spm_pair):
    tokenizer, _ = spm_pair
    ids = tokenizer.encode("ü cat", add_special_tokens=False)
    assert b"".join(tokenizer.token_bytes(i) for i in ids) == " ü cat".encode()


def byte_level_metadata(pre="default"):
    # A byte-level vocabulary: "Ġ" is the space byte in GPT-2's alphabet.
    tokens = ["<|end|>", "a", "b", "c", "Ġ", "1", "2", "Ġa", "ab", "Ġab", "abc", "Ã", "©", "12"]
    return {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3] + [1] * (len(tokens) - 1),
        "tokenizer.ggml.merges": ["Ġ a", "a b", "Ġa b", "ab c", "1 2"],
        "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 0,
    }


def test_byte_level_bpe_merges_and_special_tokens():
    tokenizer = Tokenizer.from_gguf_metadata(byte_level_metadata())
    pieces = [tokenizer.id_to_piece(i) for i in tokenizer.encode("abc ab<|end|>")]
    assert pieces == ["abc", "Ġab", "<|end|>"]
    assert tokenizer.all_special_ids == (0,) and tokenizer.eos_token_ids == (0,)
    assert tokenizer.decode(tokenizer.encode("abc ab<|end|>"), skip_special_tokens=True) == "abc ab"


def test_byte_level_token_bytes_rebuild_split_characters():
    tokenizer = Tokenizer.from_gguf_metadata(byte_level_metadata())
    ids = tokenizer.encode("é")  # two bytes, C3 A9: the vocabulary has each alone
    assert [tokenizer.id_to_piece(i) for i in ids] == ["Ã", "©"]
    assert [tokenizer.token_bytes(i) for i in ids] == [b"\xc3", b"\xa9"]
    assert tokenizer.token_bytes(tokenizer.encode(" a")[0]) == b" a"


@pytest.mark.parametrize("pre, expected", [("default", ["Ġ", "12"]), ("smollm", ["Ġ", "1", "2"]),
                                           ("qwen2", ["Ġ", "1", "2"]), ("llama-bpe", ["Ġ", "12"])])
def test_pre_tokenizer_names_pick_the_split(pre, expected):
    tokenizer = Tokenizer.from_gguf_metadata(byte_level_metadata(pre))
    assert [tokenizer.id_to_piece(i) for i in tokenizer.encode(" 12")] == expected


def test_unknown_tokenizer_model_is_a_clear_error():
    with pytest.raises(ValueError, match="'bert'.*not supported"):
        Tokenizer.from_gguf_metadata({**byte_level_metadata(), "tokenizer.ggml.model": "bert"})
