"""The decoder on tiny random weights: per-token purity, cache consistency, weight loading."""

import pytest
import torch

from cadence.models.attention_ref import ReferenceAttention
from cadence.models.rotary import RotaryEmbedding, apply_rotary
from cadence.models.testing import hf_checkpoint, random_model, tiny_config


class PackedAttention:
    """Attention for a flattened batch: token runs of ``lengths`` belong to separate sequences."""

    def __init__(self, num_seqs: int) -> None:
        self.seqs = [ReferenceAttention() for _ in range(num_seqs)]
        self.lengths: list[int] = []

    def __call__(self, layer_idx, q, k, v):
        parts = zip(self.seqs, q.split(self.lengths), k.split(self.lengths), v.split(self.lengths))
        return torch.cat([attend(layer_idx, *qkv) for attend, *qkv in parts])


def run(model, ids, start=0, attention=None):
    attention = attention or ReferenceAttention()
    positions = torch.arange(start, start + len(ids))
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), positions, attention))


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_config(), seed=0)


def test_logits_shape_and_dtype(model):
    logits = run(model, [3, 4, 5])
    assert logits.shape == (3, 256) and logits.dtype == torch.float32


def test_prefill_equals_token_by_token_decode(model):
    ids = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    prefill = run(model, ids)
    attention = ReferenceAttention()
    steps = [run(model, [token], start=i, attention=attention) for i, token in enumerate(ids)]
    torch.testing.assert_close(torch.cat(steps), prefill, atol=1e-5, rtol=1e-5)


def test_chunked_prefill_equals_one_prefill(model):
    ids = list(range(10, 30))
    attention = ReferenceAttention()
    chunks = [run(model, ids[:7], 0, attention), run(model, ids[7:15], 7, attention), run(model, ids[15:], 15, attention)]
    torch.testing.assert_close(torch.cat(chunks), run(model, ids), atol=1e-5, rtol=1e-5)


def test_flattened_batch_equals_separate_sequences(model):
    first, second = [5, 6, 7, 8, 9], [100, 101, 102]
    attention = PackedAttention(2)
    # Prefill both in one forward: positions restart for the second sequence.
    attention.lengths = [5, 3]
    ids = torch.tensor(first + second)
    positions = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2])
    with torch.inference_mode():
        packed = model.compute_logits(model(ids, positions, attention))
        # Then one decode step for each, again in one forward.
        attention.lengths = [1, 1]
        decode = model.compute_logits(model(torch.tensor([42, 43]), torch.tensor([5, 3]), attention))
    torch.testing.assert_close(packed[:5], run(model, first), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed[5:], run(model, second), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(decode[0], run(model, first + [42])[-1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(decode[1], run(model, second + [43])[-1], atol=1e-5, rtol=1e-5)


def test_bfloat16_model_tracks_float32():
    config = tiny_config()
    ids = list(range(40, 56))
    full = run(random_model(config, torch.float32, seed=3), ids)
    half = run(random_model(config, torch.bfloat16, seed=3), ids)
    assert half.dtype == torch.float32
    assert (full - half).abs().max() < 0.05 * full.abs().max()


def test_qwen2_style_bias_and_tied_embeddings():
    config = tiny_config(architecture="qwen2", attention_bias=True, tie_word_embeddings=True)
    model = random_model(config, seed=4)
    assert model.lm_head is None
    hidden = torch.randn(2, config.hidden_size)
    torch.testing.assert_close(model.compute_logits(hidden), hidden @ model.model.embed_tokens.weight.T)
    prefill = run(model, [1, 2, 3, 4])
    attention = ReferenceAttention()
    steps = [run(model, [t], i, attention) for i, t in enumerate([1, 2, 3, 4])]
    torch.testing.assert_close(torch.cat(steps), prefill, atol=1e-5, rtol=1e-5)


def test_load_weights_round_trips_fused_projections(model):
    checkpoint = hf_checkpoint(model)
    assert set(checkpoint) == set(model.checkpoint_names())
    assert "model.layers.0.self_attn.k_proj.weight" in checkpoint
    copy = random_model(tiny_config(), seed=99)
    copy.load_weights(checkpoint.items())
    torch.testing.assert_close(run(copy, [7, 8, 9]), run(model, [7, 8, 9]))


def test_load_weights_rejects_missing_unexpected_and_misshaped(model):
    checkpoint = hf_checkpoint(model)
    target = random_model(tiny_config(), seed=5)
    with pytest.raises(ValueError, match="lacks 1 weights"):
        target.load_weights((k, v) for k, v in checkpoint.items() if k != "model.norm.weight")
    with pytest.raises(ValueError, match="unexpected weight 'model.extra.weight'"):
        target.load_weights([*checkpoint.items(), ("model.extra.weight", torch.zeros(1))])
    checkpoint["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="up_proj.weight' has shape"):
        target.load_weights(checkpoint.items())


def test_rotary_scores_depend_only_on_relative_position():
    rotary = RotaryEmbedding(tiny_config())
    q, k = torch.randn(1, 1, 16), torch.randn(1, 1, 16)

    def score(q_pos, k_pos):
        q_rot = apply_rotary(q, *rotary(torch.tensor([q_pos]), torch.float32))
        k_rot = apply_rotary(k, *rotary(torch.tensor([k_pos]), torch.float32))
        return (q_rot * k_rot).sum()

    torch.testing.assert_close(score(7, 3), score(104, 100), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(score(0, 0), (q * k).sum(), atol=1e-6, rtol=1e-6)


def test_reference_attention_sliding_window_matches_a_dense_windowed_mask():
    window = 4
    model = random_model(tiny_config(sliding_window=window), seed=6)

    def windowed(layer_idx, q, k, v):  # the whole sequence at once, explicit mask
        pos = torch.arange(q.shape[0])
        mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, enable_gqa=True)
        return out.transpose(0, 1)

    ids = list(range(60, 75))
    expected = run(model, ids, attention=windowed)
    attention = ReferenceAttention(sliding_window=window)
    chunks = [run(model, ids[:6], 0, attention)] + [run(model, [t], 6 + i, attention) for i, t in enumerate(ids[6:])]
    torch.testing.assert_close(torch.cat(chunks), expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(run(model, ids), expected, atol=1e-3)  # the window matters
