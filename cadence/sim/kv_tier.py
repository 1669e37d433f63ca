"""The host-memory KV tier in the simulator: the real ``OffloadingConnector``
plans (tier hits, write-through saves, swap preemption, LRU); instead of
moving bytes, each step's copy orders are charged on the virtual clock at
the copy link's bandwidth.

A step with copy orders costs

    swap-outs + loads (before the forward, on its critical path)
    + max(forward, saves)   (saves stream out beside the next work)

and every load finishes within its step (``finished_recving``), as the
CPU worker's do.
"""

from __future__ import annotations

from dataclasses import dataclass

from cadence.config import PREEMPTION_MODES, KVTransferConfig
from cadence.core.kv_transfer.offloading import OffloadingConnector, OffloadingMetadata
from cadence.core.outputs import KVConnectorOutput
from cadence.core.sched.kv_connector import KVConnectorContext
from cadence.sim.cost_model import CostModel, StepShape

# Bytes per second, one direction, between GPU memory and host memory:
# pcie, an H100 on PCIe Gen5 x16 at half its 64 GB/s peak (pinned copies of
# scattered blocks); nvlink, a Grace Hopper's NVLink-C2C at 450 GB/s.
COPY_LINKS = {"pcie": 32e9, "nvlink": 450e9}
# The prompt length whose per-token cost is the price of recomputing a token.
_RECOMPUTE_PRICE_TOKENS = 512


@dataclass(frozen=True)
class SimKVTier:
    """A tier of ``offload_gib`` GiB behind ``link``, and how victims are preempted."""

    offload_gib: float
    link: str = "pcie"
    preemption_mode: str = "auto"

    def __post_init__(self) -> None:
        if not self.offload_gib > 0:
            raise ValueError("kv_offload_size: must be > 0 GiB")
        if self.link not in COPY_LINKS:
            raise ValueError(f"copy_link: must be one of {', '.join(COPY_LINKS)}, got {self.link!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode: must be one of {', '.join(PREEMPTION_MODES)}")

    @property
    def bytes_per_second(self) -> float:
        return COPY_LINKS[self.link]


def make_tier_connector(
    tier: SimKVTier, cost_model: CostModel, block_size: int, num_blocks: int
) -> OffloadingConnector:
    """The scheduler's connector for ``tier`` on the modelled machine."""
    kv_block_bytes = getattr(cost_model, "kv_block_bytes", None)
    if kv_block_bytes is None:
        raise ValueError("kv_offload_size: the simulator's tier needs a roofline cost model "
                         "(it reads the KV bytes per token from the model's shape)")
    n = _RECOMPUTE_PRICE_TOKENS
    prefill = StepShape(n, 1, n, n * (n + 1) // 2)
    context = KVConnectorContext(
        block_size=block_size, num_blocks=num_blocks, bytes_per_block=int(kv_block_bytes(block_size)),  # one group's page with groups
        seconds_per_token=cost_model.step_seconds(prefill) / n,
        copy_bytes_per_second=tier.bytes_per_second, preemption_mode=tier.preemption_mode)
    return OffloadingConnector(KVTransferConfig(kv_offload_size=tier.offload_gib), context)


class TierCopies:
    """Prices a step's copy orders; the loads it finished."""

    def __init__(self, bytes_per_block: int, bytes_per_second: float) -> None:
        self.seconds_per_block = bytes_per_block / bytes_per_second
        self.num_blocks_copied = 0
        self.copy_seconds = 0.0

    def charge(self, metadata: OffloadingMetadata | None,
               forward_seconds: float = 0.0) -> tuple[float, float, KVConnectorOutput | None]:
        """(seconds before the forward, seconds of saves after it, the connector output)."""
        if metadata is None:
            return 0.0, 0.0, None
        num_before = len(metadata.swap_outs) + sum(len(orders) for orders in metadata.loads.values())
        num_after = len(metadata.saves)
        self.num_blocks_copied += num_before + num_after
        before, after = num_before * self.seconds_per_block, num_after * self.seconds_per_block
        self.copy_seconds += before + after
        output = KVConnectorOutput(finished_recving=set(metadata.loads)) if metadata.loads else None
        return before, after, output
