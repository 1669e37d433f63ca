"""transformers' model for the default GGUF: the reference the parity tests compare against."""

import importlib.util
import os

import torch
import transformers


def transformers_reference(path):
    """transformers' model and tokenizer for the same GGUF, float32."""
    folder, name = os.path.split(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if importlib.util.find_spec("accelerate") is not None:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        return model.eval(), tokenizer
    # from_pretrained refuses GGUF without accelerate; run the same GGUF conversion by hand.
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.AutoConfig.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    return model.eval(), tokenizer
