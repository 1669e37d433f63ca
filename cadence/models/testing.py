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
