#!/usr/bin/env python3
"""The 1B-class GGUF of issue 32: Llama-3.2-1B's layers, SmolLM2's vocabulary, random weights.

Both engines must read one file, so it is written here in two steps and
kept outside the repository (default ``~/.cache/cadence/llama-1b-class``):

1. ``gguf``'s writer (cadence's virtualenv) writes every tensor as F16:
   16 layers, hidden 2048, 32 query and 8 KV heads of 64, MLP 8192, rope
   theta 500,000, tied embeddings, and the tokenizer (vocabulary, merges,
   special tokens, chat template) copied from the default model's GGUF,
   so the 49,152-token SmolLM2 tokenizer encodes prompts for both engines.
   Weights are normal(0, 0.02), norms ones: random, but of a trained
   model's scale, so activations stay finite through 16 layers.
2. llama.cpp's own quantizer (``llama_model_quantize`` through
   ``llama-cpp-python``, run with ``--llamacpp-python``) writes Q4_K_M
   (Q4_K, with Q6_K for half the attention values, the FFN down
   projections and the tied output, as llama.cpp mixes it).

    python bench/make_1b_gguf.py --llamacpp-python /work/llamacpp-peer/bin/python

It prints the Q4_K_M file's path. Runs in a minute or two and needs about
3 GiB of disk for the F16 step (removed afterwards unless --keep-f16).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np

SHAPE = {
    "block_count": 16,
    "embedding_length": 2048,
    "feed_forward_length": 8192,
    "head_count": 32,
    "head_count_kv": 8,
    "context_length": 8192,
    "rope_freq_base": 500000.0,
    "layer_norm_rms_epsilon": 1e-5,
}
HEAD_DIM = 64
DEFAULT_OUT = Path.home() / ".cache" / "cadence" / "llama-1b-class"
WEIGHT_STD = 0.02
SEED = 0
# The default model's tokenizer keys copied as they are.
TOKENIZER_PREFIX = "tokenizer."

QUANTIZE = """
import ctypes, sys
import llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
params.nthread = 2
status = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params))
sys.exit(status)
"""


def _copy_tokenizer(writer, source: Path) -> int:
    """The tokenizer fields of ``source`` into ``writer``; returns the vocabulary size."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    vocab_size = 0
    for name, field in reader.fields.items():
        if not name.startswith(TOKENIZER_PREFIX):
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            item_type = field.types[-1]
            values = [field.parts[i] for i in field.data]
            if item_type == gguf.GGUFValueType.STRING:
                values = [bytes(v).decode("utf-8", errors="surrogateescape") for v in values]
            else:
                values = [v.tolist()[0] for v in values]
            writer.add_array(name, values)
            if name == "tokenizer.ggml.tokens":
                vocab_size = len(values)
        elif kind == gguf.GGUFValueType.STRING:
            writer.add_string(name, bytes(field.parts[field.data[0]]).decode("utf-8"))
        else:
            value = field.parts[field.data[0]].tolist()[0]
            writer.add_key_value(name, value, kind)
    return vocab_size


def write_f16(path: Path) -> None:
    """Step 1: the F16 file with random weights and the default model's tokenizer."""
    import gguf
    from cadence.models.default_model import default_model_path

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("llama-1b-class-random")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_block_count(SHAPE["block_count"])
    writer.add_context_length(SHAPE["context_length"])
    writer.add_embedding_length(SHAPE["embedding_length"])
    writer.add_feed_forward_length(SHAPE["feed_forward_length"])
    writer.add_head_count(SHAPE["head_count"])
    writer.add_head_count_kv(SHAPE["head_count_kv"])
    writer.add_rope_freq_base(SHAPE["rope_freq_base"])
    writer.add_layer_norm_rms_eps(SHAPE["layer_norm_rms_epsilon"])
    writer.add_rope_dimension_count(HEAD_DIM)
    vocab = _copy_tokenizer(writer, Path(default_model_path()))
    writer.add_vocab_size(vocab)

    rng = np.random.default_rng(SEED)
    hidden, ffn = SHAPE["embedding_length"], SHAPE["feed_forward_length"]
    kv = SHAPE["head_count_kv"] * HEAD_DIM

    def weight(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * WEIGHT_STD).astype(np.float16)

    writer.add_tensor("token_embd.weight", weight(vocab, hidden))
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for layer in range(SHAPE["block_count"]):
        prefix = f"blk.{layer}."
        writer.add_tensor(prefix + "attn_norm.weight", np.ones(hidden, dtype=np.float32))
        writer.add_tensor(prefix + "attn_q.weight", weight(hidden, hidden))
        writer.add_tensor(prefix + "attn_k.weight", weight(kv, hidden))
        writer.add_tensor(prefix + "attn_v.weight", weight(kv, hidden))
        writer.add_tensor(prefix + "attn_output.weight", weight(hidden, hidden))
        writer.add_tensor(prefix + "ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        writer.add_tensor(prefix + "ffn_gate.weight", weight(ffn, hidden))
        writer.add_tensor(prefix + "ffn_up.weight", weight(ffn, hidden))
        writer.add_tensor(prefix + "ffn_down.weight", weight(hidden, ffn))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--llamacpp-python", required=True,
                        help="a Python with llama-cpp-python (its quantizer writes Q4_K_M)")
    parser.add_argument("--keep-f16", action="store_true")
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    f16, q4 = args.out_dir / "llama-1b-class-f16.gguf", args.out_dir / "llama-1b-class-q4_k_m.gguf"
    if not f16.exists():
        write_f16(f16)
    status = subprocess.run([args.llamacpp_python, "-c", QUANTIZE, str(f16), str(q4)]).returncode
    if status != 0:
        print(f"llama_model_quantize failed ({status})", file=sys.stderr)
        return 1
    if not args.keep_f16:
        f16.unlink()
    print(q4)
    return 0


if __name__ == "__main__":
    sys.exit(main())
