"""Hugging Face folders: tiny random transformers models saved, loaded by cadence, same logits."""

import pytest
import torch
import transformers

from cadence.models.attention_ref import ReferenceAttention
from cadence.models.hf_loader import load_hf_model, safetensors_files

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)

CASES = {
    "llama": (transformers.LlamaConfig, dict(rope_theta=10000.0)),
    "llama3-rope": (transformers.LlamaConfig, dict(
        rope_theta=500000.0, max_position_embeddings=1024,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "mistral": (transformers.MistralConfig, dict(sliding_window=4096, head_dim=16)),
    "qwen2-tied": (transformers.Qwen2Config, dict(tie_word_embeddings=True)),
}


def save_random_model(case, folder, **save_kwargs):
    config_class, extra = CASES[case]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config_class(**{**SMALL, **extra}), dtype=torch.float32)
    with torch.no_grad():  # transformers' init leaves biases at 0; make them matter
        for name, param in hf.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.5)
    hf.save_pretrained(folder, **save_kwargs)
    return hf.eval()


def cadence_logits(model, ids):
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), ReferenceAttention())
        return model.compute_logits(hidden)


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case, tmp_path):
    hf = save_random_model(case, tmp_path)
    model, config = load_hf_model(str(tmp_path), torch.float32)
    ids = torch.randint(0, 128, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(cadence_logits(model, ids), expected, atol=1e-4, rtol=1e-4)
    assert config.architecture == config_class_of(case).model_type
    assert (config.rope_scaling is not None) == (case == "llama3-rope")


def config_class_of(case):
    return CASES[case][0]


def test_sharded_folder_with_index(tmp_path):
    hf = save_random_model("qwen2-tied", tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists() and len(safetensors_files(str(tmp_path))) > 1
    model, config = load_hf_model(str(tmp_path))
    assert config.attention_bias and config.tie_word_embeddings
    with torch.inference_mode():
        expected = hf(torch.tensor([[5, 6, 7, 8]])).logits[0]
    torch.testing.assert_close(cadence_logits(model, [5, 6, 7, 8]), expected, atol=1e-4, rtol=1e-4)


def test_bfloat16_load_casts_weights(tmp_path):
    save_random_model("llama", tmp_path)
    model, _ = load_hf_model(str(tmp_path), torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert cadence_logits(model, [1, 2, 3]).dtype == torch.float32


def test_not_a_model_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_model(str(tmp_path))
