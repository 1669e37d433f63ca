"""Each newer family loaded from an HF folder and from a GGUF gives transformers' logits.

The runner-level parity (paged attention, chunked prefill, prefix caching)
is in ``tests/runner/test_architecture_parity.py``.
"""

import pytest
import torch
from safetensors.torch import load_file, save_file

from cadence.models.attention_ref import ReferenceAttention
from cadence.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from cadence.models.gguf_loader import load_gguf_model, read_gguf
from cadence.models.hf_loader import load_hf_model
from tests.models.arch_cases import CASES, GGUF_OVERRIDES, hf_logits, random_hf_model, write_gguf

IDS = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(0)).tolist()


def cadence_logits(model, ids):
    with torch.inference_mode():
        attention = ReferenceAttention.for_model(model.config)
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), attention))


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    return request.param, random_hf_model(request.param)


def test_hf_folder_logits_match_transformers(case, tmp_path):
    name, hf = case
    hf.save_pretrained(tmp_path)
    model, config = load_hf_model(str(tmp_path))
    assert config.architecture == name
    torch.testing.assert_close(cadence_logits(model, IDS), hf_logits(hf, IDS), atol=1e-4, rtol=1e-4)


def test_gguf_logits_match_transformers(case, tmp_path):
    name, hf = case
    if name in GGUF_OVERRIDES:
        hf = random_hf_model(name, **GGUF_OVERRIDES[name])
    write_gguf(tmp_path / "m.gguf", hf, CASES[name][2])
    model, config = load_gguf_model(*read_gguf(str(tmp_path / "m.gguf")))
    assert config.architecture == name
    torch.testing.assert_close(cadence_logits(model, IDS), hf_logits(hf, IDS), atol=1e-4, rtol=1e-4)


def test_moe_with_dense_layers_and_unnormalised_weights(tmp_path):
    hf = random_hf_model("qwen3_moe", mlp_only_layers=[1], norm_topk_prob=False)
    hf.save_pretrained(tmp_path)
    model, config = load_hf_model(str(tmp_path))
    assert config.dense_mlp_layers == (1,) and not config.norm_topk_prob
    torch.testing.assert_close(cadence_logits(model, IDS), hf_logits(hf, IDS), atol=1e-4, rtol=1e-4)


def test_config_fields_say_what_each_family_differs_in(tmp_path):
    fields = {}
    for name in CASES:
        random_hf_model(name).save_pretrained(tmp_path / name)
        fields[name] = load_hf_model(str(tmp_path / name))[1]
    assert fields["qwen3"].qk_norm == "per_head" and fields["qwen3"].head_dim == 24
    assert fields["olmo2"].qk_norm == "whole" and fields["olmo2"].norm_placement == "post"
    assert fields["smollm3"].no_rope_layers == (3,)
    assert fields["phi3"].fused_checkpoint_projections and fields["phi3"].rotary_dim == 8
    moe = fields["qwen3_moe"]
    assert (moe.num_experts, moe.num_experts_per_tok, moe.norm_topk_prob) == (8, 3, True)
    assert [moe.is_moe_layer(i) for i in range(4)] == [True] * 4
    gemma2, gemma3 = fields["gemma2"], fields["gemma3_text"]
    assert gemma2.norm_placement == "sandwich" and gemma2.norm_weight_offset == 1.0
    assert gemma2.mlp_activation == "gelu_tanh" and gemma2.embedding_multiplier == 8.0
    assert gemma2.full_attention_layers == (1, 3) and gemma2.sliding_window == 6
    assert [gemma2.layer_sliding_window(i) for i in range(4)] == [6, None, 6, None]
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping) == (2.0, 2.0)
    assert gemma2.attention_scale == 24 ** -0.5 and gemma2.tie_word_embeddings
    assert gemma3.qk_norm == "per_head" and gemma3.full_attention_layers == (5,)
    assert (gemma3.rope_theta, gemma3.sliding_rope_theta) == (100000.0, 10000.0)
    assert gemma3.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert [gemma3.uses_sliding_rope(i) for i in range(6)] == [True] * 5 + [False]
    assert gemma3.attn_logit_softcapping is None


@pytest.mark.parametrize("case", ["gemma2", "gemma3_text"])
def test_gemma_parameters_counted(case):
    hf = random_hf_model(case)
    config = ModelConfig.from_hf_config(hf.config.to_dict())
    assert config.num_params() == sum(p.numel() for p in hf.parameters())


def test_moe_parameters_counted():
    config = ModelConfig.from_hf_config(random_hf_model("qwen3_moe").config.to_dict())
    hf = random_hf_model("qwen3_moe")
    assert config.num_params() == sum(p.numel() for p in hf.parameters())


def test_unknown_architecture_names_itself_and_the_supported_ones():
    with pytest.raises(ValueError, match=r"model_type 'mamba' is not supported \(supported: .*'qwen3_moe'"):
        ModelConfig.from_hf_config({"model_type": "mamba"})
    with pytest.raises(ValueError, match=r"GGUF architecture 'rwkv6' is not supported \(supported: .*'qwen3moe'"):
        ModelConfig.from_gguf_metadata({"general.architecture": "rwkv6"}, tie_word_embeddings=False)
    assert {"qwen3", "olmo2", "smollm3", "phi3", "qwen3_moe"} <= set(SUPPORTED_ARCHITECTURES)


def test_unsupported_rope_scaling_names_the_type():
    hf = random_hf_model("phi3").config.to_dict()
    hf["rope_parameters"] = {**hf["rope_parameters"], "rope_type": "longrope", "short_factor": [1.0] * 4}
    with pytest.raises(ValueError, match="rope_type 'longrope' is not supported"):
        ModelConfig.from_hf_config(hf)


def test_checkpoint_shape_disagreeing_with_config_names_the_tensor(tmp_path):
    random_hf_model("qwen3").save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.1.self_attn.q_norm.weight"] = torch.ones(16)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.self_attn\.q_norm\.weight' has shape \(16,\), "
                                         r"the model expects \(24,\)"):
        load_hf_model(str(tmp_path))


def test_gemma_with_another_activation_names_it():
    hf = random_hf_model("gemma2").config.to_dict()
    hf["hidden_activation"] = "gelu"
    with pytest.raises(ValueError, match="hidden_activation 'gelu' is not supported for Gemma"):
        ModelConfig.from_hf_config(hf)
