"""Tiny random Llamas and random PEFT adapters for the LoRA tests.

    base = save_base(folder)                              transformers model, saved
    save_adapter(base, folder, seed=1, rank=8)            PEFT LoRA (random A and B), saved
    merged_logits(base, adapter_folder, ids)              PEFT merge_and_unload()'s logits
"""

from __future__ import annotations

import copy

import torch
import transformers

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, rope_theta=10000.0)


def save_base(folder, **overrides) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**SMALL, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    return model.eval()


def save_adapter(base, folder, *, seed: int, rank: int = 8, alpha: int = 16,
                 targets=TARGETS, **lora_options) -> None:
    """A PEFT adapter with random A and B (B not zero: the delta matters), saved."""
    import peft

    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets),
                             init_lora_weights=False, lora_dropout=0.0, **lora_options)
    model = peft.get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():  # PEFT's random init is small; make each adapter clearly its own
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.1)
    model.save_pretrained(folder)


def merged_model(base, adapter_folder) -> transformers.PreTrainedModel:
    import peft

    model = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(adapter_folder))
    return model.merge_and_unload().eval()


@torch.inference_mode()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0]
