"""Build a ``tokenizers.Tokenizer`` from the vocabulary stored in GGUF metadata.

Two vocabulary kinds (``tokenizer.ggml.model``):

* ``gpt2``: byte-level BPE. Tokens and merges are stored; how text is split
  before BPE (the pre-tokenizer) is named by ``tokenizer.ggml.pre`` and must
  be reconstructed from that name (the regexes below are llama.cpp's).
* ``llama``: SentencePiece BPE. Tokens and scores are stored, no merges: a
  merge ``(a, b)`` exists when ``a + b`` is a token, ranked by that token's
  score. Spaces become "▁", unknown bytes fall back to ``<0xNN>`` tokens.

Token types (``tokenizer.ggml.token_type``): 3 = control (special, e.g.
``<|im_end|>``), 4 = user-defined (matched whole, not special).
"""

from __future__ import annotations

import logging
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

logger = logging.getLogger(__name__)

CONTROL, USER_DEFINED = 3, 4

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> regexes applied in order (each splits the previous pieces).
_PRE_TOKENIZER_SPLITS = {
    "default": (_GPT2_SPLIT,),
    "gpt2": (_GPT2_SPLIT,),
    "llama-bpe": (_LLAMA3_SPLIT,),
    "llama3": (_LLAMA3_SPLIT,),
    "llama-v3": (_LLAMA3_SPLIT,),
    "smaug-bpe": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,),
    "deepseek-r1-qwen": (_QWEN2_SPLIT,),
    # StarCoder-style: every digit alone, then the GPT-2 split.
    "smollm": (r"\p{N}", _GPT2_SPLIT),
    "starcoder": (r"\p{N}", _GPT2_SPLIT),
    "refact": (r"\p{N}", _GPT2_SPLIT),
}


def gguf_tokenizer(metadata: dict[str, Any]) -> Tokenizer:
    """The tokenizer a GGUF's ``tokenizer.ggml.*`` metadata describes."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind == "gpt2":
        backend = _byte_level_bpe(metadata)
    elif kind == "llama":
        backend = _sentencepiece_bpe(metadata)
    else:
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (supported: 'gpt2', 'llama')")
    _add_special_tokens(backend, metadata)
    if add_bos_token(metadata):
        _prepend_bos(backend, metadata)
    return backend


def add_bos_token(metadata: dict[str, Any]) -> bool:
    """Whether encoding with special tokens starts with BOS (SentencePiece files default to yes)."""
    default = metadata.get("tokenizer.ggml.model") == "llama"
    return bool(metadata.get("tokenizer.ggml.add_bos_token", default))


def _byte_level_bpe(metadata: dict[str, Any]) -> Tokenizer:
    tokens = metadata["tokenizer.ggml.tokens"]
    merges = [tuple(merge.split(" ", 1)) for merge in metadata["tokenizer.ggml.merges"]]
    backend = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    splits = _pre_tokenizer_splits(metadata.get("tokenizer.ggml.pre", "default"))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend


def _pre_tokenizer_splits(pre: str) -> tuple[str, ...]:
    if pre not in _PRE_TOKENIZER_SPLITS:
        logger.warning("unknown GGUF pre-tokenizer %r: splitting text as GPT-2 does", pre)
    return _PRE_TOKENIZER_SPLITS.get(pre, (_GPT2_SPLIT,))


def _sentencepiece_bpe(metadata: dict[str, Any]) -> Tokenizer:
    tokens, scores = metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.scores"]
    vocab = {t: i for i, t in enumerate(tokens)}
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id", 0)
    backend = Tokenizer(models.BPE(vocab, _sentencepiece_merges(tokens, scores, vocab),
                                   unk_token=tokens[unk_id], fuse_unk=True, byte_fallback=True))
    space_prefix = metadata.get("tokenizer.ggml.add_space_prefix", True)
    backend.normalizer = normalizers.Sequence(
        ([normalizers.Prepend("▁")] if space_prefix else []) + [normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if space_prefix else []))
    return backend


def _sentencepiece_merges(tokens: list[str], scores: list[float],
                          vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, best-scoring merged token first."""
    ranked = []
    for token, score in zip(tokens, scores):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _add_special_tokens(backend: Tokenizer, metadata: dict[str, Any]) -> None:
    """Control tokens become special; user-defined ones are matched whole but not special."""
    tokens = metadata["tokenizer.ggml.tokens"]
    types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    control = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED]
    backend.add_special_tokens(control)
    backend.add_tokens(user)


def _prepend_bos(backend: Tokenizer, metadata: dict[str, Any]) -> None:
    bos_id = metadata["tokenizer.ggml.bos_token_id"]
    bos = metadata["tokenizer.ggml.tokens"][bos_id]
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
