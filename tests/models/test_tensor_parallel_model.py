"""A decoder split over 2 ranks computes the logits of the whole model.

The ranks are two threads of this process, each with its own gloo group
over the loopback (no process to start): every building block a family
picks (q/k/v biases, per-head q/k norms, partial rotary, fused checkpoint
projections, Gemma's sandwich norms, GeGLU, scaled embeddings and
soft-capping, sliding windows) and the vocabulary split (a tied head, an
odd vocabulary that pads) against the unsplit model.
"""

from __future__ import annotations

import datetime
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from cadence.models.attention_ref import ReferenceAttention
from cadence.models.tensor_parallel import build_shard, shard_weights
from cadence.models.testing import random_model, tiny_config
from cadence.models.tp_group import TensorParallelGroup, make_store

TIMEOUT = datetime.timedelta(seconds=60)
IDS = [3, 17, 42, 9, 250, 77, 5, 101, 64, 33, 12, 200]
CONFIGS = {
    "llama_gqa": dict(),
    "qwen2_bias_tied_odd_vocab": dict(attention_bias=True, tie_word_embeddings=True, vocab_size=301),
    "qwen3_head_norms": dict(architecture="qwen3", qk_norm="per_head"),
    "phi3_partial_rotary_fused": dict(architecture="phi3", partial_rotary_factor=0.5,
                                      fused_checkpoint_projections=True),
    "gemma2": dict(architecture="gemma2", norm_placement="sandwich", norm_weight_offset=1.0,
                   mlp_activation="gelu_tanh", embedding_multiplier=8.0, query_pre_attn_scalar=24.0,
                   attn_logit_softcapping=2.0, final_logit_softcapping=2.0, sliding_window=5,
                   full_attention_layers=(1,), tie_word_embeddings=True),
}


def logits_of(model, config) -> torch.Tensor:
    attention = ReferenceAttention.for_model(config)
    with torch.inference_mode():
        hidden = model(torch.tensor(IDS), torch.arange(len(IDS)), attention)
        return model.compute_logits(hidden)  # [T, vocab]


def split_logits(model, size: int) -> list[torch.Tensor]:
    """Each rank's logits of the model split ``size`` ways, the ranks being threads."""
    store = make_store(0, size, 0, TIMEOUT)

    def rank_logits(rank: int) -> torch.Tensor:
        rank_store = store if rank == 0 else make_store(rank, size, store.port, TIMEOUT)
        group = TensorParallelGroup.connect(rank_store, rank, size, backend="gloo", timeout=TIMEOUT)
        shard = build_shard(model.config, group, model.dtype, shard_weights(model, rank, size))
        return logits_of(shard, model.config)

    with ThreadPoolExecutor(size) as pool:
        return list(pool.map(rank_logits, range(size)))


@pytest.mark.parametrize("name", CONFIGS)
def test_two_ranks_compute_the_whole_models_logits(name):
    model = random_model(tiny_config(**CONFIGS[name]), seed=5)
    expected = logits_of(model, model.config)
    for logits in split_logits(model, 2):
        assert logits.shape == expected.shape
        torch.testing.assert_close(logits, expected, atol=2e-5, rtol=1e-4)
        assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_shards_hold_their_share_of_the_weights():
    model = random_model(tiny_config(vocab_size=301), seed=5)
    whole = sum(p.numel() for p in model.parameters())
    norms = sum(p.numel() for name, p in model.named_parameters() if "norm" in name)
    shards = [shard_weights(model, rank, 2) for rank in range(2)]
    padding = 1 * 64 * 2  # one padded vocabulary row of the embedding and of the head
    assert sum(t.numel() for shard in shards for t in shard.values()) == whole + norms + padding
