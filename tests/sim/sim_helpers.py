"""Shared helpers of the simulator tests."""

from __future__ import annotations

from cadence.config import CacheConfig, SchedulerConfig
from cadence.sim.cost_model import StepShape
from cadence.sim.workload import RequestSpec


class LinearCost:
    """A cost model easy to reason about: ``base`` + ``per_token`` per token; logs every charge."""

    name = "linear"

    def __init__(self, base: float = 1e-3, per_token: float = 1e-5, num_blocks: int = 4096) -> None:
        self.base = base
        self.per_token = per_token
        self.num_blocks = num_blocks
        self.charged: list[float] = []

    def step_seconds(self, shape: StepShape) -> float:
        cost = self.base + self.per_token * shape.num_tokens if shape.num_tokens else 0.0
        self.charged.append(cost)
        return cost

    def num_kv_blocks(self, block_size: int) -> int:
        return self.num_blocks

    def describe(self) -> dict:
        return {"name": self.name}


def configs(**options) -> tuple[SchedulerConfig, CacheConfig]:
    """Small scheduler and cache configs; options go to whichever class has them."""
    cache = {k: options.pop(k) for k in ("num_gpu_blocks", "enable_prefix_caching", "block_size") if k in options}
    cache.setdefault("num_gpu_blocks", 4096)
    cache.setdefault("block_size", 16)
    scheduler = dict(max_num_seqs=32, max_num_batched_tokens=256, max_model_len=2048)
    scheduler.update(options)
    return SchedulerConfig(**scheduler), CacheConfig(**cache)


def specs_at(times: list[float], prompt: int = 40, output: int = 8, **fields) -> list[RequestSpec]:
    return [RequestSpec(t, prompt, output, **fields) for t in times]
