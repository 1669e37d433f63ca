"""The C loop through all decoder layers (``FusedDecoder``) against the module path, bit for bit.

Two runners share one model whose projections are random GGUF blocks of
every kernel type (q, k, v in three types: three parts; gate and up in two);
one takes decode steps through ``decoder_stack.c``, the other layer by layer
in Python. The same schedule must give the same hidden states, the same KV
cache bytes and the same tokens, on every cache dtype, the portable C build
included, for each architecture's building blocks the loop takes (a q/k/v
bias, layers without rotary, a sliding window, q/k norms per head and
whole, post-norm and sandwich layers, offset norms, GeGLU, partial rotary,
Gemma 3's local rotary tables and global layers, Gemma 2's soft-capped
scores, Qwen3-MoE's routed experts in random blocks, beside a dense layer,
the router in float32 or in blocks) and for speculative verification rows.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GGMLType

from tests.models import ggml_blocks
from tests.runner.test_model_runner import BLOCK_SIZE, NUM_BLOCKS, HandScheduler, prompt_of
from cadence import cpu_features
from cadence.config import LoRAConfig, SpeculativeConfig
from cadence.kernels.decoder_stack import ctypes_layout, decoder_stack
from cadence.models.moe import SparseMoE
from cadence.models.quantized import QuantizedTensor
from cadence.models.testing import random_model, tiny_config
from cadence.runner.cpu_paths import CpuPaths, choose_cpu_paths
from cadence.runner.kv_quant import Q8_0
from cadence.runner.model_runner import ModelRunner

CONFIG = tiny_config(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=64, num_hidden_layers=2)
# Each layer's shard types: q/k/v and gate/up mix types, so their projections have several
# parts; between them the layers take every type with a kernel.
SHARD_TYPES = ({"q_proj": "Q4_0", "k_proj": "Q8_0", "v_proj": "Q4_K", "o_proj": "Q4_1",
                "gate_proj": "Q4_1", "up_proj": "Q4_K", "down_proj": "Q6_K"},
               {"q_proj": "Q5_0", "k_proj": "Q5_1", "v_proj": "Q5_K", "o_proj": "IQ4_NL",
                "gate_proj": "Q3_K", "up_proj": "IQ4_XS", "down_proj": "Q2_K"})
CPU_PATHS = {"as-built": (), "portable-c": ("avx2",)}


def random_part(kind, rows, cols, rng):
    raw = ggml_blocks.random_blocks(kind, rows * cols // ggml_blocks.BLOCK_VALUES[kind], rng).reshape(rows, -1)
    return QuantizedTensor.from_gguf(GGMLType[kind], raw, (rows, cols))


def quantized_model(config, seed=0, router_type=None):
    """A random model of ``config`` whose layers' projections are random blocks of SHARD_TYPES;
    routed experts too (expert e of layer i in SHARD_TYPES[i + e], so gate|up is one part or two),
    the router in float32 (as GGUF files hold it) or in blocks of ``router_type``."""
    model = random_model(config, seed=seed)
    rng = np.random.default_rng(seed)
    for index, layer in enumerate(model.model.layers):
        types = SHARD_TYPES[index % len(SHARD_TYPES)]
        attn, mlp = layer.self_attn, layer.mlp
        linears = [(attn.qkv_proj, attn.qkv_proj.shard_names), (attn.o_proj, ("o_proj",))]
        if isinstance(mlp, SparseMoE):
            keep_experts_quantized(mlp, index, rng, router_type)
        else:
            linears += [(mlp.gate_up_proj, mlp.gate_up_proj.shard_names), (mlp.down_proj, ("down_proj",))]
        for linear, names in linears:
            sizes = getattr(linear, "shard_sizes", (linear.out_features,))
            linear.keep_quantized([random_part(types[name], rows, linear.in_features, rng)
                                   for name, rows in zip(names, sizes)])
    return model


def keep_experts_quantized(moe, layer_index, rng, router_type):
    experts = moe.experts
    hidden, size = experts.down_proj.shape[1], experts.intermediate_size
    shards = []
    for e in range(experts.num_experts):
        types = SHARD_TYPES[(layer_index + e) % len(SHARD_TYPES)]
        shards += [random_part(types["gate_proj"], size, hidden, rng),
                   random_part(types["gate_proj" if e % 2 else "up_proj"], size, hidden, rng),
                   random_part(types["down_proj"], hidden, size, rng)]
    experts.keep_quantized(shards)
    if router_type is not None:
        moe.gate.keep_quantized([random_part(router_type, moe.gate.out_features, hidden, rng)])


def cpu_paths(path):
    features = cpu_features.with_hidden(cpu_features.detect(), *CPU_PATHS[path])
    if CPU_PATHS[path] and not features.is_x86:
        pytest.skip("hiding AVX2 is an x86 path")
    paths = choose_cpu_paths(torch.float32, features)
    if paths.decoder_stack_arch is None:
        pytest.skip("no C compiler here: the decoder stack cannot be built")
    return paths


def make_runner(model, paths, kv_cache_dtype=torch.float32, **options):
    return ModelRunner(model, model.config, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, dtype=torch.float32,
                       max_num_seqs=8, max_model_len=256, cpu_paths=paths, kv_cache_dtype=kv_cache_dtype,
                       **options)


class Recorder:
    """Wraps a runner's ``_forward``: each step's hidden states, and whether the C loop ran it."""

    def __init__(self, runner):
        self.hidden, self.fused = [], []
        calls = [0]
        if runner.fused_decoder is not None:
            original = runner.fused_decoder.forward

            def counted(*args):
                calls[0] += 1
                return original(*args)

            runner.fused_decoder.forward = counted
        forward = runner._forward

        def recorded(step):
            before = calls[0]
            hidden, indices = forward(step)
            self.hidden.append(hidden.clone())
            self.fused.append(calls[0] > before)
            return hidden, indices

        runner._forward = recorded


def run_schedule(runner, schedule):
    """The schedule's steps on a fresh HandScheduler: (scheduler, recorder)."""
    recorder = Recorder(runner)
    sched = HandScheduler(runner, seed=3)
    schedule(sched)
    return sched, recorder


def mixed_schedule(sched):
    """Prefills (module path), then decodes of three sequences of different lengths."""
    sched.add("a", prompt_of(1, 5))
    sched.add("b", prompt_of(2, 19))
    sched.step()
    sched.add("c", prompt_of(3, 33))
    sched.step({"a": 1, "b": 1, "c": 33})  # decodes beside a prefill: one module step
    sched.decode(6)
    sched.finish("a")
    sched.decode(3)


GEMMA3 = dict(architecture="gemma3_text", norm_placement="sandwich", norm_weight_offset=1.0,
              mlp_activation="gelu_tanh", embedding_multiplier=16.0, query_pre_attn_scalar=48.0,
              qk_norm="per_head", sliding_rope_theta=10000.0, rope_theta=1e6, full_attention_layers=(1,),
              sliding_window=12, tie_word_embeddings=True)
# 8 experts, 3 per token: with 3 sequences' decodes most experts get a row, some several.
QWEN3_MOE = dict(architecture="qwen3_moe", qk_norm="per_head", num_experts=8, num_experts_per_tok=3,
                 moe_intermediate_size=256, norm_topk_prob=True)
VARIANTS = {
    "llama": {},
    "qkv-bias": {"attention_bias": True},  # Qwen2
    "no-rope-layer": {"no_rope_layers": (1,)},  # SmolLM3
    "sliding-window": {"sliding_window": 12},  # Mistral
    "qwen3": {"architecture": "qwen3", "qk_norm": "per_head"},
    "olmo2": {"architecture": "olmo2", "norm_placement": "post", "qk_norm": "whole"},
    "phi3-partial-rotary": {"architecture": "phi3", "partial_rotary_factor": 0.5},
    "gemma3": GEMMA3,
    "gemma3-wide-heads": dict(GEMMA3, num_attention_heads=2, num_key_value_heads=1, head_dim=128),
    "gemma2-soft-capped": dict(GEMMA3, architecture="gemma2", qk_norm=None, sliding_rope_theta=None,
                               attn_logit_softcapping=1.5, final_logit_softcapping=30.0),
    "qwen3-moe": QWEN3_MOE,
    "qwen3-moe-dense-layer": dict(QWEN3_MOE, dense_mlp_layers=(1,), norm_topk_prob=False),
}


def assert_same_run(config, path, kv_cache_dtype, schedule=mixed_schedule, router_type=None, **options):
    model = quantized_model(config, router_type=router_type)
    paths = cpu_paths(path)
    fused_runner = make_runner(model, paths, kv_cache_dtype, **options)
    assert fused_runner.fused_decoder is not None, fused_runner.fused_decoder_note
    plain_runner = make_runner(model, paths, kv_cache_dtype, **options)
    plain_runner.fused_decoder = None
    fused_sched, fused = run_schedule(fused_runner, schedule)
    plain_sched, plain = run_schedule(plain_runner, schedule)
    assert sum(fused.fused) >= 8  # the decode steps ran in C ...
    assert not all(fused.fused)  # ... the prefill steps did not
    for step, (got, expected) in enumerate(zip(fused.hidden, plain.hidden)):
        assert torch.equal(got, expected), f"step {step}"
    assert torch.equal(fused_runner.kv_cache.data, plain_runner.kv_cache.data)
    for req_id in fused_sched.reqs:
        assert fused_sched.outputs(req_id) == plain_sched.outputs(req_id)


@pytest.mark.parametrize("path", CPU_PATHS)
@pytest.mark.parametrize("kv_cache_dtype", [torch.float32, torch.float16, torch.bfloat16, Q8_0])
def test_decode_steps_equal_the_module_path_bit_for_bit(path, kv_cache_dtype):
    assert_same_run(CONFIG, path, kv_cache_dtype)


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_variant_the_loop_takes_equals_the_module_path(variant):
    config = CONFIG.replace(**VARIANTS[variant])
    assert_same_run(config, "as-built", torch.float16)


@pytest.mark.parametrize("variant", ["llama", "gemma3"])
def test_the_batch_invariant_mode_takes_the_same_products_in_the_loop(variant):
    """Under the mode the products on GGUF blocks compute each row as alone (the
    integer path at any number of rows): the C loop takes those too, to the bit."""
    config = CONFIG.replace(**VARIANTS[variant])
    runner = make_runner(quantized_model(config), cpu_paths("as-built"), torch.float16, batch_invariant="on")
    assert runner.batch_invariance.quant_rows_apart and runner.model.quant_kernel.computes_rows_apart
    assert runner.fused_decoder.shape.rows_apart == 1
    assert make_runner(quantized_model(config), cpu_paths("as-built"), torch.float16,
                       batch_invariant="off").fused_decoder.shape.rows_apart == 0
    assert_same_run(config, "as-built", torch.float16, batch_invariant="on")


@pytest.mark.parametrize("kv_cache_dtype", [torch.float32, torch.bfloat16])
def test_gemma3_on_the_portable_build_equals_the_module_path(kv_cache_dtype):
    assert_same_run(CONFIG.replace(**GEMMA3), "portable-c", kv_cache_dtype)


@pytest.mark.parametrize("path", CPU_PATHS)
@pytest.mark.parametrize("router_type", [None, "Q8_0"])  # float32 (GGUF files' router) or blocks
def test_experts_on_each_build_equal_the_module_path(path, router_type):
    assert_same_run(CONFIG.replace(**QWEN3_MOE), path, torch.bfloat16, router_type=router_type)


def test_speculative_verification_rows_equal_the_module_path():
    def schedule(sched):
        sched.add("a", prompt_of(4, 9))
        sched.add("b", prompt_of(5, 14))
        sched.step()
        for _ in range(8):  # each sequence verifies two drafts (3 query rows) per step
            sched.step({"a": 3, "b": 3}, drafts={"a": [7, 8], "b": [9, 10]})

    assert_same_run(CONFIG, "as-built", torch.float32, schedule,
                    speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=2))


def test_a_slot_outside_the_cache_is_refused_and_nothing_is_written():
    runner = make_runner(quantized_model(CONFIG), cpu_paths("as-built"))
    sched = HandScheduler(runner)
    sched.add("a", prompt_of(6, 7))
    sched.step()
    plans = []
    plan = runner._plan_attention
    runner._plan_attention = lambda step, window: plans.append(plan(step, window)) or plans[-1]
    sched.decode(1)
    metadata = plans[-1]
    before = runner.kv_cache.data.clone()
    metadata.slot_mapping[0] = runner.kv_cache.num_slots  # one past the end
    with pytest.raises(ValueError, match="refused"):
        runner.fused_decoder.forward(torch.tensor([5]), torch.tensor([8]), metadata)
    assert torch.equal(runner.kv_cache.data, before)


@pytest.mark.parametrize("path", CPU_PATHS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_cache_rows_round_as_pytorch_rounds(path, dtype):
    kernel = decoder_stack(cpu_paths(path).decoder_stack_arch)
    edges = [0.0, -0.0, 1.0, 65504.0, 65519.99, 65520.0, -65520.0, 1e6, float("inf"), -float("inf"),
             2.0 ** -14, 2.0 ** -24, 2.0 ** -25, 1.5 * 2.0 ** -25, 3 * 2.0 ** -26, 2.0 ** -26, 1e-30,
             1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 3.0e38, -3.0e38]
    random = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * torch.logspace(-9, 6, 1000)
    for values in (torch.tensor(edges), random, random[:7]):  # [:7]: no vector loop at all
        got = kernel.store_row(values, dtype)
        assert torch.equal(got.view(torch.int16) if dtype != torch.float32 else got,
                           values.to(dtype).view(torch.int16) if dtype != torch.float32 else values)
    nan = kernel.store_row(torch.tensor([float("nan")] * 9), dtype)
    assert torch.isnan(nan.float()).all()


def test_the_structures_match_the_c_layout():
    kernel = decoder_stack(cpu_paths("as-built").decoder_stack_arch)
    assert kernel.struct_layout() == ctypes_layout()


def reason_for(model, paths=None, **options):
    runner = make_runner(model, paths or cpu_paths("as-built"), **options)
    assert runner.fused_decoder is None
    return runner.fused_decoder_note


def test_models_and_runners_the_loop_does_not_take_say_why():
    assert "not kept in GGUF blocks" in reason_for(random_model(CONFIG))
    moe = quantized_model(CONFIG.replace(**QWEN3_MOE))
    experts = moe.model.layers[1].mlp.experts
    experts.down_parts = ((torch.zeros(256, 256),), *experts.down_parts[1:])  # a type without a kernel
    assert "layer 1's expert 0's down has a part in float" in reason_for(moe)
    assert "fused ops are not in use" in reason_for(quantized_model(CONFIG), CpuPaths.plain())
    paths = cpu_paths("as-built")
    no_library = CpuPaths(paths.pack_weights, paths.fused_ops, paths.attention_kernel, paths.reasons,
                          paths.quant_matmul, paths.quant_reason, None)
    assert "C kernels are unavailable" in reason_for(quantized_model(CONFIG), no_library)
    # Adapters can be loaded into any layer at any time: no C loop beside LoRA.
    assert reason_for(quantized_model(CONFIG), lora_config=LoRAConfig(enable_lora=True)) is None
    assert make_runner(quantized_model(CONFIG), paths).fused_decoder_note.endswith("in one C call")
