"""The simulator's host-memory tier: the real OffloadingConnector plans, the
copies are charged at the link's bandwidth."""

import pytest

from cadence.config import CacheConfig, SchedulerConfig
from cadence.core.kv_cache import HybridKVCacheManager
from cadence.sim.cost_model import ModelShape, RooflineCostModel, make_cost_model
from cadence.sim.kv_tier import COPY_LINKS, SimKVTier
from cadence.sim.simulator import Simulator
from cadence.sim.workload import SyntheticWorkload

H100 = make_cost_model("roofline:h100", "llama-3-8b")
CONFIG = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=4096, max_model_len=4096)


def run(specs, num_blocks, tier=None, **cache):
    simulator = Simulator(CONFIG, CacheConfig(num_gpu_blocks=num_blocks, **cache), H100, kv_tier=tier)
    return simulator, simulator.run(specs)


def test_prefixes_past_the_primary_cache_hit_the_tier():
    specs = SyntheticWorkload(num_requests=60, rate=20, prompt_len="fixed:1024", output_len="fixed:8",
                              prefix_groups=12, prefix_fraction=1.0, prefix_tokens=768, seed=1).generate()
    _, plain = run(specs, 512)
    simulator, tiered = run(specs, 512, SimKVTier(16, "pcie"))
    assert simulator.connector.num_hit_tokens > 0
    assert tiered.summary()["prefix_hit_rate"] > plain.summary()["prefix_hit_rate"] + 0.1
    assert tiered.summary()["ttft_s"]["p50"] < plain.summary()["ttft_s"]["p50"]
    assert simulator.runner.transfers.copy_seconds > 0


@pytest.mark.parametrize("link", sorted(COPY_LINKS))
def test_swap_preemption_computes_fewer_tokens_than_recompute(link):
    specs = SyntheticWorkload(num_requests=40, rate=0, prompt_len="uniform:256:1024",
                              output_len="uniform:128:512", seed=2).generate()
    plain_sim, plain = run(specs, 512, enable_prefix_caching=False)
    swap_sim, swapped = run(specs, 512, SimKVTier(16, link, "swap"), enable_prefix_caching=False)
    assert plain.num_preemptions > 0 and swap_sim.scheduler.num_swapped_preemptions_total > 0
    assert swap_sim.runner.num_tokens_computed < plain_sim.runner.num_tokens_computed
    assert swap_sim.scheduler.kv_cache_manager.num_free_blocks == 512
    swap_sim.connector.tier.check_consistency()
    assert swap_sim.connector.tier.pins == {}


def test_a_windowed_models_tier_moves_one_groups_pages():
    """Gemma-3-shaped (18 layers, every 6th global, window 512): six groups of three
    layers, a tier slot is one group's page, and swaps and tier hits run per group
    with nothing leaked."""
    shape = ModelShape(num_params=270_000_000, num_layers=18, num_heads=4, head_dim=256, num_kv_heads=1,
                       sliding_window=512, full_attention_layers=(5, 11, 17))
    model = RooflineCostModel(H100.hardware, shape)
    config = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512, max_model_len=4096)
    specs = SyntheticWorkload(num_requests=40, rate=0, prompt_len="uniform:600:1500", output_len="uniform:64:256",
                              prefix_groups=4, prefix_fraction=1.0, prefix_tokens=512, seed=3).generate()
    simulator = Simulator(config, CacheConfig(num_gpu_blocks=600), model, kv_tier=SimKVTier(1, "pcie", "swap"))
    simulator.run(specs)
    kv = simulator.scheduler.kv_cache_manager
    assert isinstance(kv, HybridKVCacheManager) and kv.num_groups == 6
    assert simulator.connector.context.bytes_per_block == 16 * model.kv_bytes_per_token * 3 // 18
    assert simulator.scheduler.num_swapped_preemptions_total > 0
    assert simulator.connector.num_hit_tokens > 0
    assert kv.num_free_blocks == 599
    simulator.connector.tier.check_consistency()
    assert simulator.connector.tier.pins == {}


def test_bad_tier_options_are_refused_by_name():
    with pytest.raises(ValueError, match=r"^copy_link: must be one of"):
        SimKVTier(1, "usb")
    with pytest.raises(ValueError, match=r"^kv_offload_size: must be > 0"):
        SimKVTier(0)
    with pytest.raises(ValueError, match=r"^preemption_mode: must be one of"):
        SimKVTier(1, preemption_mode="never")


def test_the_cli_runs_with_a_tier_and_refuses_swap_without_one(capsys):
    import argparse
    import re

    from cadence.sim.cli import add_simulate_parser

    def hit_rate(extra):
        parser = argparse.ArgumentParser(prog="cadence")
        add_simulate_parser(parser.add_subparsers(dest="command", required=True))
        args = parser.parse_args([
            "simulate", "--num-requests", "60", "--rate", "20", "--prompt-len", "fixed:1024",
            "--output-len", "fixed:8", "--prefix-groups", "12", "--prefix-fraction", "1.0",
            "--prefix-tokens", "768", "--num-gpu-blocks", "512", *extra])
        assert args.func(args) == 0
        return float(re.search(r"prefix hit rate\s+([\d.]+)%", capsys.readouterr().out).group(1))

    assert hit_rate(["--kv-offload-size", "16", "--copy-link", "nvlink"]) > hit_rate([]) + 10
    with pytest.raises(ValueError, match=r"^preemption_mode: swap needs the host-memory tier"):
        hit_rate(["--preemption-mode", "swap"])
