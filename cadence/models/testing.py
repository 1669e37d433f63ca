"""Tiny random-weight models for fast tests of anything that drives a model.

    config = tiny_config()                      # 2 layers, GQA, 256-token vocab
    model = random_model(config, seed=0)        # LlamaForCausalLM with N(0, 0.02) weights
"""

from __future__ import annotations

from typing import Any

import torch

from cadence.models.config import ModelConfig
from cadence.models.llama import LlamaForCausalLM


def tiny_config(**overrides: Any) -> ModelConfig:
    """A small Llama-style config (GQA 4:2, head_dim 16); any field can be overridden."""
    fields: dict[str, Any] = dict(
        architecture="llama",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_ids=(2,),
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def randomize(model: torch.nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Fill every parameter: norms near 1, everything else N(0, std). Deterministic in seed."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32) * std
            if name.endswith("norm.weight"):
                noise += 1.0
            param.copy_(noise)


def random_model(config: ModelConfig, dtype: torch.dtype = torch.float32, seed: int = 0) -> LlamaForCausalLM:
    """A ``LlamaForCausalLM`` of ``config`` with random weights, in eval mode."""
    model = LlamaForCausalLM(config, dtype)
    randomize(model, seed)
    return model.eval()


def hf_checkpoint(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """The model's weights under Hugging Face names, fused projections split back.

    The inverse of ``load_weights``: ``other.load_weights(hf_checkpoint(model).items())``
    makes ``other`` compute what ``model`` does.
    """
    return {name: tensor.detach().clone() for name, tensor in model.checkpoint_tensors().items()}


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(folder: str, config: ModelConfig, *, rank: int = 8, alpha: int = 16,
                         targets: tuple[str, ...] = LORA_TARGETS, seed: int = 0,
                         std: float = 0.02) -> None:
    """A random LoRA adapter for a model of ``config``, in PEFT's format (the
    files ``save_pretrained`` writes), without building the model: for tests
    and benchmarks on models too large to build twice."""
    import json
    import os

    from safetensors.torch import save_file

    attention_out = config.num_attention_heads * config.head_dim
    kv_out = config.num_key_value_heads * config.head_dim
    shapes = {  # module -> (in, out)
        "q_proj": (config.hidden_size, attention_out), "k_proj": (config.hidden_size, kv_out),
        "v_proj": (config.hidden_size, kv_out), "o_proj": (attention_out, config.hidden_size),
        "gate_proj": (config.hidden_size, config.intermediate_size),
        "up_proj": (config.hidden_size, config.intermediate_size),
        "down_proj": (config.intermediate_size, config.hidden_size),
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for target in targets:
            group = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{group}.{target}"
            fan_in, fan_out = shapes[target]
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) * std
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * std
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": alpha,
                   "target_modules": list(targets), "bias": "none", "use_dora": False,
                   "use_rslora": False, "task_type": "CAUSAL_LM"}, f)


def byte_tokenizer_json(vocab_size: int = 256) -> str:
    """A byte-level BPE with no merges, as a tokenizer.json: ids 0..255, one per
    byte, then added tokens ``<|i|>`` up to ``vocab_size`` (so every id decodes)."""
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = BackendTokenizer(models.BPE(vocab={piece: i for i, piece in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_tokens([f"<|{i}|>" for i in range(len(alphabet), vocab_size)])
    return backend.to_str()


def write_hf_folder(folder: str, model: LlamaForCausalLM) -> None:
    """A Hugging Face folder that ``load_model`` reads back as ``model`` (a "llama" of at
    least 256 tokens): config.json, model.safetensors and a byte-level tokenizer
    (``byte_tokenizer_json``), so an ``LLM`` or ``cadence serve`` runs a tiny random model."""
    import json
    import os

    from safetensors.torch import save_file

    config = model.config
    if config.architecture != "llama" or config.vocab_size < 256:
        raise ValueError("write_hf_folder: writes llama models of at least 256 tokens")
    hf_config = {
        "model_type": "llama", "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim, "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings, "attention_bias": config.attention_bias,
        "bos_token_id": config.bos_token_id, "eos_token_id": list(config.eos_token_ids),
    }
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf_config, f)
    with open(os.path.join(folder, "tokenizer.json"), "w") as f:
        f.write(byte_tokenizer_json(config.vocab_size))
    save_file({name: tensor.contiguous() for name, tensor in hf_checkpoint(model).items()},
              os.path.join(folder, "model.safetensors"))
