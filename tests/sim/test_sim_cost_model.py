"""Cost models: the roofline by hand, the calibrated fit, save and load."""

import json
import random

import pytest

from cadence.sim.cost_model import (
    LLAMA_3_8B,
    PROFILES,
    CalibratedCostModel,
    HardwareProfile,
    ModelShape,
    RooflineCostModel,
    StepShape,
    TokenCurve,
    load_model_config,
    make_cost_model,
)

# A toy model: 2 layers, hidden 64, 4 heads of 16 (2 KV heads), MLP 128, vocab 100, tied.
TOY = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100, "tie_word_embeddings": True}
TOY_HW = HardwareProfile("toy", peak_flops=1e9, mem_bandwidth=1e8, mem_capacity=1e7,
                         compute_efficiency=0.5, memory_efficiency=0.5, step_overhead_s=0.001,
                         dtype_bytes=2, kv_memory_fraction=1.0)


def test_model_shape_from_hf_config_by_hand():
    shape = ModelShape.from_hf_config(TOY)
    # per layer: q 64x64, k,v 64x32 each, o 64x64 -> 12288; MLP 3*64*128 = 24576; 2 norms 128
    per_layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128 + 2 * 64
    assert shape.num_params == 100 * 64 + 2 * per_layer + 64
    assert (shape.num_layers, shape.num_heads, shape.head_dim, shape.num_kv_heads) == (2, 4, 16, 2)
    assert shape.kv_bytes_per_token(2) == 2 * 2 * 2 * 16 * 2  # K,V x layers x kv heads x dim x bytes


def test_roofline_step_by_hand():
    model = RooflineCostModel(TOY_HW, ModelShape.from_hf_config(TOY))
    params = ModelShape.from_hf_config(TOY).num_params  # 80,448
    # A decode of 4 sequences at context 100 (each reads 101 keys).
    decode = StepShape(num_tokens=4, num_seqs=4, num_kv_tokens=404, num_attn_pairs=404)
    flops = 2 * params * 4 + 4 * 2 * 4 * 16 * 404
    memory = params * 2 + 404 * 256
    assert model.flops(decode) == flops
    assert model.bytes(decode) == memory
    # 160,896 + 207,616 B at 5e7 B/s = 7.37 ms (memory-bound: compute is 1.6 ms at 5e8 FLOP/s).
    assert model.step_seconds(decode) == pytest.approx(memory / 5e7 + 0.001)
    # A 512-token prefill from scratch is compute-bound.
    prefill = StepShape(512, 1, 512, 512 * 513 // 2)
    flops = 2 * params * 512 + 512 * 131328
    assert model.step_seconds(prefill) == pytest.approx(flops / 5e8 + 0.001)
    assert model.step_seconds(StepShape(0, 0, 0, 0)) == 0.0


def test_roofline_prices_window_groups_and_the_cache_width():
    """A Gemma-3-shaped toy (6 layers, every 3rd global, window 8): with groups a block is one
    group's page (2 layers), window layers read at most their window, and q8_0 takes 34/32
    bytes a value."""
    shape = ModelShape(num_params=1000, num_layers=6, num_heads=4, head_dim=32, num_kv_heads=1,
                       sliding_window=8, full_attention_layers=(2, 5))
    plain = RooflineCostModel(TOY_HW, shape)
    grouped = plain.with_kv_cache("auto", True)
    layout = grouped.kv_cache_layout()
    assert plain.kv_cache_layout() is None and layout.num_groups == 3 and layout.layers_per_group == 2
    free = 1e7 - 1000 * 2  # capacity less the weights
    assert plain.num_kv_blocks(16) == int(free // (16 * 2 * 6 * 32 * 2))
    assert grouped.num_kv_blocks(16) == int(free // (16 * 2 * 2 * 32 * 2))  # pages of 2 layers, not 6
    assert plain.with_kv_cache("q8_0", False).num_kv_blocks(16) == int(free // (16 * 2 * 6 * 34))
    # 4 decodes at context 100: full layers read 101 keys each, window layers 8 + 1
    decode = StepShape(num_tokens=4, num_seqs=4, num_kv_tokens=404, num_attn_pairs=404)
    per_layer_token = 2 * 32 * 2
    assert plain.bytes(decode) == 1000 * 2 + 6 * per_layer_token * 404
    assert grouped.bytes(decode) == pytest.approx(1000 * 2 + per_layer_token * (2 * 404 + 4 * (4 * 8 + 4)))
    with pytest.raises(ValueError, match="^kv_cache_dtype: the roofline prices"):
        plain.with_kv_cache("int4", False)


def test_llama_3_8b_on_h100():
    model = make_cost_model("roofline:h100", "llama-3-8b")
    assert 8.0e9 < model.model.num_params < 8.1e9  # Llama-3-8B has 8.03 B weights
    assert model.kv_bytes_per_token == 131072  # 2 x 32 layers x 8 heads x 128 x 2 bytes
    # Batch-1 decode: weights over bandwidth, ~6 ms at 80% of 3.35 TB/s.
    t = model.step_seconds(StepShape(1, 1, 1000, 1000))
    assert t == pytest.approx((model.weight_bytes + 1000 * 131072) / (3.35e12 * 0.8) + 0.0005)
    # KV blocks: 90% of 80 GB minus 16 GB of weights, in 16-token blocks of 2 MiB.
    assert model.num_kv_blocks(16) == int((80e9 * 0.9 - model.weight_bytes) // (16 * 131072))
    assert make_cost_model("roofline:h200").step_seconds(StepShape(1, 1, 1000, 1000)) < t


def test_profiles_and_specs():
    assert set(PROFILES) == {"h100", "h200", "a100", "cpu"}
    assert load_model_config("llama-3-8b") == LLAMA_3_8B
    with pytest.raises(ValueError, match="cost_model"):
        make_cost_model("roofline:tpu")
    with pytest.raises(ValueError, match="cost_model"):
        make_cost_model("magic")


def test_model_config_from_a_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TOY))
    model = make_cost_model("roofline:cpu", str(tmp_path))
    assert model.model == ModelShape.from_hf_config(TOY)


def test_calibrated_fit_recovers_known_coefficients():
    rng = random.Random(0)
    a, b, c, d = 0.02, 1.5e-4, 2e-3, 3e-7
    shapes, seconds = [], []
    for _ in range(300):
        seqs = rng.randint(1, 64)
        tokens = seqs + rng.choice([0, 0, rng.randint(1, 2000)])
        kv = tokens + seqs * rng.randint(0, 2000)
        shapes.append(StepShape(tokens, seqs, kv, kv))
        noise = 1 + rng.uniform(-0.01, 0.01)
        seconds.append((a + b * tokens + c * seqs + d * kv) * noise)
    model = CalibratedCostModel.fit(shapes, seconds, ("tokens", "seqs", "kv_tokens"))
    assert model.intercept == pytest.approx(a, rel=0.05)
    assert model.coefficients["tokens"] == pytest.approx(b, rel=0.05)
    assert model.coefficients["seqs"] == pytest.approx(c, rel=0.05)
    assert model.coefficients["kv_tokens"] == pytest.approx(d, rel=0.1)
    assert model.meta["mean_abs_rel_error"] < 0.01


def test_calibrated_save_and_load(tmp_path):
    model = CalibratedCostModel(0.01, {"tokens": 1e-4, "seqs": 1e-3}, meta={"block_size": 16}, kv_blocks=100)
    path = tmp_path / "cal.json"
    model.save(path)
    loaded = make_cost_model(f"calibrated:{path}")
    shape = StepShape(10, 2, 50, 60)
    assert loaded.step_seconds(shape) == pytest.approx(0.01 + 1e-3 + 2e-3)
    assert loaded.num_kv_blocks(16) == 100 and loaded.num_kv_blocks(32) == 50
    with pytest.raises(ValueError, match="unknown features"):
        CalibratedCostModel(0.0, {"flops": 1.0})


def test_token_curve_interpolates_and_extends_its_ends():
    curve = TokenCurve((1, 4, 8), (0.010, 0.040, 0.048))
    assert curve(1) == pytest.approx(0.010) and curve(4) == pytest.approx(0.040)
    assert curve(2) == pytest.approx(0.020)
    assert curve(6) == pytest.approx(0.044)
    assert curve(16) == pytest.approx(0.064)  # the last segment, extended
    with pytest.raises(ValueError, match="token_curve"):
        TokenCurve((4, 1), (0.0, 0.0))


def test_curve_fit_recovers_a_jagged_curve_and_the_linear_terms():
    # Batches of 3 slower than of 4, as on the CPU; plus 2 ms per sequence and 10 us per KV token.
    truth = TokenCurve((1, 2, 3, 4, 8, 64, 512), (0.060, 0.100, 0.140, 0.090, 0.100, 0.250, 1.500))
    rng = random.Random(1)
    shapes, seconds = [], []
    for _ in range(400):
        tokens = rng.choice([1, 2, 3, 4, 5, 6, 8, 512, rng.randint(9, 512)])
        seqs = rng.randint(1, tokens)
        kv = tokens + seqs * rng.randint(0, 400)
        shapes.append(StepShape(tokens, seqs, kv, kv))
        seconds.append(truth(tokens) + 2e-3 * seqs + 1e-5 * kv)
    model = CalibratedCostModel.fit(shapes, seconds, ("seqs", "kv_tokens"), token_knots=truth.knots)
    assert model.token_curve.knots == truth.knots
    assert model.token_curve.seconds == pytest.approx(truth.seconds, rel=1e-6)
    assert model.coefficients == pytest.approx({"seqs": 2e-3, "kv_tokens": 1e-5}, rel=1e-6)
    with pytest.raises(ValueError, match="token curve"):
        CalibratedCostModel.fit(shapes, seconds, ("tokens",), token_knots=truth.knots)


def test_only_knots_the_data_pins_down_are_kept():
    # Data at 1, 2, 3 and 40: knots 4, 8 and 16 have no step strictly between their neighbours.
    assert TokenCurve.usable_knots((1, 2, 3, 4, 8, 16, 64), [1, 2, 3, 3, 40]) == (1, 2, 3, 40)


def test_calibrated_model_with_a_curve_saves_and_loads(tmp_path):
    model = CalibratedCostModel(0.0, {"seqs": 1e-3}, token_curve=TokenCurve((1, 8), (0.05, 0.09)))
    model.save(tmp_path / "c.json")
    loaded = CalibratedCostModel.load(tmp_path / "c.json")
    assert loaded.token_curve == model.token_curve
    assert loaded.step_seconds(StepShape(4, 2, 10, 10)) == pytest.approx(0.05 + 0.04 * 3 / 7 + 2e-3)
