"""Steps of short queries through every decoder layer in one C call.

A decode step of a small model on the CPU is mostly dispatch: per token,
SmolLM2-135M makes ~300 kernel calls from Python (norms, products, rotary,
cache writes, attention), each a few microseconds of C behind tens of
microseconds of module calls, views and ctypes. ``FusedDecoder`` hands the
whole stack to ``cadence/kernels/csrc/decoder_stack.c``, which calls the same
kernels, in the same order, on the same values, so the result equals the
module path's to the bit (tests/runner/test_fused_decoder.py).

It runs a step when every token is a short query the attention kernel takes
(decodes, speculative verification: ``AttentionMetadata.short`` and nothing
else); prefill chunks go through the modules. The model must be one the C
loop describes; ``FusedDecoder.build`` says why not otherwise:

    float32 Llama-family layers of any norm placement (pre, post: OLMo 2,
    sandwich: Gemma), norms with or without an offset, SwiGLU or GeGLU,
    whole-head or partial rotary (or none, per layer; Gemma 3's local
    tables), q/k norms per head or whole, per-layer windows (Gemma's global
    layers), soft-capped attention scores (Gemma 2), routed experts
    (Qwen3-MoE, dense layers beside them), every projection and every
    expert's matrices kept in GGUF blocks of a kernel type (a q/k/v bias
    allowed; the router float32 or in blocks); no LoRA adapters, the C
    attention kernel and fused ops in use.

A layer of experts routes and combines in the fused ops' C functions
(``moe_route``, ``moe_combine``, the float router's ``linear``), which the
module path (``cadence.models.moe`` with fused ops) calls too: top-k ties
go to the lower expert id and each token sums its picks in pick order on
both paths, and each expert multiplies the same rows (its tokens, in token
order), so the quantized kernel takes the same path for them.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from cadence.kernels.decoder_stack import (
    ACTIVATIONS, CACHE_DTYPES, MAX_PARTS, NORM_PLACEMENTS, QK_NORMS, ROTARY_MAIN, ROTARY_NONE, ROTARY_SLIDING,
    TYPE_F32_ROWS, BlockMatrix, DecoderLayer, DecoderShape, DecoderStackKernel, DecoderStep, ExpertMatrices,
    decoder_stack,
)
from cadence.models.layers import Linear, RMSNorm
from cadence.models.llama import LlamaForCausalLM, _DECODER_LAYERS
from cadence.models.moe import SparseMoE
from cadence.models.quantized import KERNEL_TYPES, QuantizedTensor

if TYPE_CHECKING:
    from cadence.core.kv_cache.groups import KVCacheLayout
    from cadence.models.config import ModelConfig
    from cadence.runner.attention import AttentionMetadata
    from cadence.runner.kv_cache import PagedKVCache


class FusedDecoder:
    """The model's decoder layers as one C call, for steps of short queries.

    It holds pointers into ``kv_cache``: a runner that reallocates its cache builds a new one.
    """

    def __init__(self, kernel: DecoderStackKernel, model: LlamaForCausalLM, config: "ModelConfig",
                 kv_cache: "PagedKVCache", full_attention_layers: tuple[int, ...] = (),
                 layout: "KVCacheLayout | None" = None) -> None:
        self.kernel = kernel
        self.model = model
        self.kv_cache = kv_cache
        scale = config.attention_scale
        self.shape = DecoderShape(
            num_layers=config.num_hidden_layers, hidden=config.hidden_size,
            num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim, intermediate=config.intermediate_size,
            cache_dtype=CACHE_DTYPES[kv_cache.data.dtype], block_size=kv_cache.block_size,
            num_slots=kv_cache.num_slots, norm_placement=NORM_PLACEMENTS[config.norm_placement],
            activation=ACTIVATIONS[config.mlp_activation], qk_norm=QK_NORMS[config.qk_norm],
            rotary_dim=config.rotary_dim, eps=config.rms_norm_eps,
            scale=scale if scale is not None else config.head_dim ** -0.5,
            softcap=config.attn_logit_softcapping or 0.0,
            num_experts=config.num_experts, experts_per_token=config.num_experts_per_tok,
            expert_intermediate=config.moe_intermediate_size if config.num_experts else 0,
            norm_topk_prob=int(config.norm_topk_prob),
            # the products the module path takes (the batch-invariant mode's: each row alone)
            rows_apart=int(model.quant_kernel is not None and model.quant_kernel.computes_rows_apart),
        )
        # The norms' weights as the kernels scale by them (offsets added), and each layer's
        # experts' matrices, held here for their pointers.
        self.norm_weights: list[torch.Tensor] = []
        self.expert_arrays: list[ctypes.Array] = []
        layers = model.model.layers
        self.layers = (DecoderLayer * len(layers))(*(
            self._layer(layer, kv_cache, i, config, i in full_attention_layers) for i, layer in enumerate(layers)))
        if layout is not None:  # each layer reads its KV cache group's table (forward's group_plans)
            for i, g in layout.group_of_layer().items():
                self.layers[i].group = g
        self.final_norm = model.model.norm.fused_weight()

    @classmethod
    def build(cls, arch: str | None, model: torch.nn.Module, config: "ModelConfig", kv_cache: "PagedKVCache",
              *, uses_fused_ops: bool, uses_attention_kernel: bool,
              full_attention_layers: tuple[int, ...] = (),
              layout: "KVCacheLayout | None" = None) -> tuple["FusedDecoder | None", str]:
        """The fused decoder for this model, built for ``-march=arch`` (None: no C kernels), or None and why not.
        ``full_attention_layers``: the layers that ignore the step's attention window."""
        reason = _why_not(model, config, kv_cache, uses_fused_ops, uses_attention_kernel)
        if reason is None and arch is None:
            reason = "the C kernels are unavailable"
        kernel = decoder_stack(arch) if reason is None else None
        if reason is None and kernel is None:
            reason = "the C library did not build"
        if reason is not None:
            return None, f"decode steps layer by layer ({reason})"
        return (cls(kernel, model, config, kv_cache, full_attention_layers, layout),
                "decode steps through all layers in one C call")

    def _layer(self, layer: torch.nn.Module, kv_cache: "PagedKVCache", index: int, config: "ModelConfig",
               full_attention: bool) -> DecoderLayer:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = _matrices(attn.qkv_proj.quantized)
        bias = attn.qkv_proj.bias
        rotary = ROTARY_NONE
        if attn.uses_rope:
            rotary = ROTARY_SLIDING if index in self.model.model.sliding_rope_layers else ROTARY_MAIN
        return DecoderLayer(
            input_norm=self._norm(getattr(layer, "input_layernorm", None)),
            post_attention_norm=self._norm(layer.post_attention_layernorm),
            pre_feedforward_norm=self._norm(getattr(layer, "pre_feedforward_layernorm", None)),
            post_feedforward_norm=self._norm(getattr(layer, "post_feedforward_layernorm", None)),
            q_norm=self._norm(getattr(attn, "q_norm", None)), k_norm=self._norm(getattr(attn, "k_norm", None)),
            qkv=(BlockMatrix * MAX_PARTS)(*qkv), qkv_parts=len(qkv),
            qkv_bias=None if bias is None else bias.data_ptr(),
            o=_matrices(attn.o_proj.quantized)[0],
            **(self._experts(mlp) if isinstance(mlp, SparseMoE) else _dense_mlp(mlp)),
            key_cache=kv_cache.keys(index).data_ptr(), value_cache=kv_cache.values(index).data_ptr(),
            rotary=rotary, full_attention=int(full_attention),
        )

    def _experts(self, moe: SparseMoE) -> dict:
        """DecoderLayer's fields for routed experts: the router, and the experts' matrices (held here)."""
        experts = moe.experts
        array = (ExpertMatrices * experts.num_experts)(*(
            ExpertMatrices(gate_up=(BlockMatrix * MAX_PARTS)(*_matrices(gate_up)), gate_up_parts=len(gate_up),
                           down=_matrices(down)[0])
            for gate_up, down in zip(experts.gate_up_parts, experts.down_parts)))
        self.expert_arrays.append(array)
        router = moe.gate
        if router.quantized is None:
            router_matrix = BlockMatrix(TYPE_F32_ROWS, router.weight.data_ptr(), router.out_features)
        else:
            router_matrix = _matrices(router.quantized)[0]
        return dict(router=router_matrix, experts=ctypes.addressof(array))

    def _norm(self, norm: RMSNorm | None) -> int | None:
        """The pointer to ``norm``'s weight as the kernel scales by it (None: no such norm)."""
        if norm is None:
            return None
        weight = norm.fused_weight().contiguous()
        self.norm_weights.append(weight)
        return weight.data_ptr()

    @staticmethod
    def covers(metadata: "AttentionMetadata") -> bool:
        """Whether every token of the step is a short query of the C attention kernel."""
        return metadata.short is not None and not metadata.batched and not metadata.prefills

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                metadata: "AttentionMetadata", group_plans: "list[AttentionMetadata] | None" = None
                ) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] of the step's tokens (keys and values written).
        ``group_plans``: with KV cache groups, each group's plan (``metadata`` is group 0's);
        each layer writes its group's slots and reads its group's block table."""
        hidden = self.model.model.embed(input_ids).contiguous()  # [T, hidden] float32, the residual stream
        # float32 [T, R] each; held here, so the pointers below stay valid through the call
        decoder = self.model.model
        cos, sin = (t.contiguous() for t in decoder.rotary.rows(positions))
        sliding_cos = sliding_sin = None
        if decoder.sliding_rotary is not None:
            sliding_cos, sliding_sin = (t.contiguous() for t in decoder.sliding_rotary.rows(positions))
        short = metadata.short
        slots = metadata.slot_mapping
        _check_index(slots, torch.int64, hidden.shape[0])
        for index in (short.query_start, short.query_len, short.seq_len):
            _check_index(index, torch.int64, short.seq_len.shape[0])
        _check_index(short.block_table, torch.int32, None)
        group_tables = group_slots = None
        window = short.sliding_window or 0  # (layers flagged full_attention ignore it)
        if group_plans is not None:
            window = next((p.short.sliding_window for p in group_plans if p.short.sliding_window), 0)
            # [G, S, max_blocks] and [G, T], held here through the call
            group_tables = torch.stack([plan.short.block_table for plan in group_plans]).contiguous()
            group_slots = torch.stack([plan.slot_mapping for plan in group_plans]).contiguous()
            _check_index(group_tables, torch.int32, len(group_plans))
            _check_index(group_slots, torch.int64, len(group_plans))
            if group_tables.shape[1:] != short.block_table.shape or group_slots.shape[1] != hidden.shape[0]:
                raise ValueError("fused decoder: the KV cache groups' plans differ in shape")
        step = DecoderStep(
            num_tokens=hidden.shape[0], cos=cos.data_ptr(), sin=sin.data_ptr(),
            sliding_cos=None if sliding_cos is None else sliding_cos.data_ptr(),
            sliding_sin=None if sliding_sin is None else sliding_sin.data_ptr(),
            slot_mapping=slots.data_ptr(), query_start=short.query_start.data_ptr(),
            query_len=short.query_len.data_ptr(), seq_len=short.seq_len.data_ptr(),
            block_table=short.block_table.data_ptr(), num_seqs=short.seq_len.shape[0],
            max_blocks=short.block_table.shape[1], sliding_window=window,
            group_block_tables=None if group_tables is None else group_tables.data_ptr(),
            group_slot_mappings=None if group_slots is None else group_slots.data_ptr(),
        )
        out = torch.empty_like(hidden)
        self.kernel.run(self.shape, self.layers, self.final_norm, step, hidden, out)
        return out


def _check_index(t: torch.Tensor, dtype: torch.dtype, length: int | None) -> None:
    if t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu" or (length is not None
                                                                             and t.shape[0] != length):
        raise ValueError(f"fused decoder: index tensors must be contiguous CPU {dtype}, "
                         f"got {t.dtype} {tuple(t.shape)}")


def _why_not(model, config, kv_cache, uses_fused_ops, uses_attention_kernel) -> str | None:
    """Why the C loop cannot run this model's decode steps (None: it can)."""
    if type(model) is not LlamaForCausalLM:
        return f"{type(model).__name__} is not the Llama-family decoder"
    if model.dtype != torch.float32:
        return f"the model runs in {str(model.dtype).removeprefix('torch.')}, not float32"
    if kv_cache.data.device.type != "cpu" or kv_cache.data.dtype not in CACHE_DTYPES:
        return "the KV cache is not a CPU cache of float32, float16 or bfloat16"
    if not (uses_fused_ops and uses_attention_kernel):
        return "the C attention kernel or fused ops are not in use"
    differences = [
        (f"the {config.mlp_activation} activation", config.mlp_activation not in ACTIVATIONS),
        (f"{config.norm_placement} norms", config.norm_placement not in NORM_PLACEMENTS),
    ]
    missing = [name for name, differs in differences if differs]
    if missing:
        return f"{config.architecture} has {', '.join(missing)}"
    layer_class = _DECODER_LAYERS[config.norm_placement]
    for i, layer in enumerate(model.model.layers):
        if type(layer) is not layer_class:
            return f"layer {i} is a {type(layer).__name__}"
        projections = {"qkv_proj": layer.self_attn.qkv_proj, "o_proj": layer.self_attn.o_proj}
        if not isinstance(layer.mlp, SparseMoE):
            projections.update(gate_up_proj=layer.mlp.gate_up_proj, down_proj=layer.mlp.down_proj)
        for name, linear in projections.items():
            reason = _why_not_blocks(linear, allow_bias=name == "qkv_proj")
            if reason is not None:
                return f"layer {i}'s {name} {reason}"
        if isinstance(layer.mlp, SparseMoE):
            reason = _why_not_experts(layer.mlp)
            if reason is not None:
                return f"layer {i}'s {reason}"
    return None


def _why_not_experts(moe: SparseMoE) -> str | None:
    """Why the C loop cannot run these routed experts (None: it can)."""
    router = moe.gate
    if router.quantized is not None or router.lora is not None:
        reason = _why_not_blocks(router, allow_bias=False)
        if reason is not None or len(router.quantized) != 1:
            return f"router {reason or 'has several parts'}"
    elif router.bias is not None or router.weight.dtype != torch.float32 or not router.weight.is_contiguous() \
            or router.weight.shape != (router.out_features, router.in_features):
        return "router is not a float32 matrix"
    experts = moe.experts
    if experts.gate_up_parts is None:
        return "experts are not kept in GGUF blocks"
    for e, (gate_up, down) in enumerate(zip(experts.gate_up_parts, experts.down_parts)):
        for name, parts in (("gate|up", gate_up), ("down", down)):
            if len(parts) > (MAX_PARTS if name == "gate|up" else 1):
                return f"expert {e}'s {name} has {len(parts)} parts"
            if not all(isinstance(p, QuantizedTensor) and p.ggml_type in KERNEL_TYPES for p in parts):
                return f"expert {e}'s {name} has a part in float (a type without a kernel)"
    return None


def _why_not_blocks(linear: Linear, *, allow_bias: bool) -> str | None:
    if linear.lora is not None:
        return "has LoRA adapters"
    if linear.bias is not None and not allow_bias:
        return "has a bias"
    parts = linear.quantized
    if parts is None:
        return "is not kept in GGUF blocks"
    if len(parts) > MAX_PARTS:
        return f"has {len(parts)} parts (at most {MAX_PARTS})"
    if not all(isinstance(p, QuantizedTensor) and p.ggml_type in KERNEL_TYPES for p in parts):
        return "has a part in float (a type without a kernel)"
    return None


def _dense_mlp(mlp) -> dict:
    """DecoderLayer's fields for a dense gated MLP."""
    gate_up = _matrices(mlp.gate_up_proj.quantized)
    return dict(gate_up=(BlockMatrix * MAX_PARTS)(*gate_up), gate_up_parts=len(gate_up),
                down=_matrices(mlp.down_proj.quantized)[0])


def _matrices(parts) -> list[BlockMatrix]:
    return [BlockMatrix(int(p.ggml_type), p.blocks.data_ptr(), p.shape[0]) for p in parts]
