"""ModelConfig: both constructors and the sizing helpers."""

import pytest
import torch

from cadence.models.config import ModelConfig
from cadence.models.llama import LlamaForCausalLM
from cadence.models.testing import tiny_config

LLAMA3_HF = {
    "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "tie_word_embeddings": False,
}
QWEN2_HF = {
    "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
    "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
    "sliding_window": 32768, "use_sliding_window": False, "tie_word_embeddings": True,
    "bos_token_id": 151643, "eos_token_id": 151645,
}


def test_llama3_hf_config():
    config = ModelConfig.from_hf_config(LLAMA3_HF)
    assert config.head_dim == 128 and config.num_kv_groups == 4
    assert config.rope_scaling["rope_type"] == "llama3" and config.rope_scaling["factor"] == 8.0
    assert config.eos_token_ids == (128001, 128008, 128009)
    assert not config.attention_bias and config.sliding_window is None


def test_qwen2_hf_config_has_qkv_bias_and_no_window():
    config = ModelConfig.from_hf_config(QWEN2_HF)
    assert config.attention_bias and config.tie_word_embeddings
    assert config.sliding_window is None and config.eos_token_ids == (151645,)


def test_transformers5_rope_parameters_spelling():
    hf = {k: v for k, v in LLAMA3_HF.items() if k not in ("rope_theta", "rope_scaling")}
    hf["rope_parameters"] = {**LLAMA3_HF["rope_scaling"], "rope_theta": 500000.0}
    config = ModelConfig.from_hf_config(hf)
    assert config.rope_theta == 500000.0 and config.rope_scaling["rope_type"] == "llama3"


def test_unsupported_model_type_and_rope_type_are_rejected():
    with pytest.raises(ValueError, match="gemma"):
        ModelConfig.from_hf_config({**QWEN2_HF, "model_type": "gemma"})
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_hf_config({**LLAMA3_HF, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_gguf_metadata_config():
    metadata = {
        "general.architecture": "llama", "llama.block_count": 30, "llama.context_length": 8192,
        "llama.embedding_length": 576, "llama.feed_forward_length": 1536,
        "llama.attention.head_count": 9, "llama.attention.head_count_kv": 3,
        "llama.rope.freq_base": 100000.0, "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.vocab_size": 49152, "llama.rope.dimension_count": 64,
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
    }
    config = ModelConfig.from_gguf_metadata(metadata, tie_word_embeddings=True)
    assert (config.hidden_size, config.head_dim, config.num_key_value_heads) == (576, 64, 3)
    assert config.eos_token_ids == (2,) and config.bos_token_id == 1 and config.tie_word_embeddings


@pytest.mark.parametrize("overrides", [{}, {"tie_word_embeddings": True}, {"attention_bias": True}])
def test_num_params_counts_the_built_model(overrides):
    config = tiny_config(**overrides)
    model = LlamaForCausalLM(config)
    assert config.num_params() == sum(p.numel() for p in model.parameters())


def test_kv_bytes_per_token():
    config = tiny_config()  # 2 layers, 2 kv heads, head_dim 16
    assert config.kv_bytes_per_token(torch.bfloat16) == 2 * 2 * 2 * 16 * 2
    assert config.kv_bytes_per_token(torch.float32) == 2 * 2 * 2 * 16 * 4


def test_config_is_frozen_and_hashable():
    config = tiny_config()
    with pytest.raises(AttributeError):
        config.hidden_size = 1
    assert hash(config) == hash(tiny_config())
