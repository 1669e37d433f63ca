"""Admission and ordering policies borrowed from transformers' continuous batching.

- ``SafetyMarginAdmission``: admit no new request while the free-block
  fraction is under a margin, so running requests can keep decoding instead
  of being preempted by newcomers.
- ``prefill_first_order``: serve running requests that are still prefilling
  before the decoding ones (finishes split prompts sooner).
"""

from __future__ import annotations

from typing import Protocol

from cadence.core.kv_cache import AnyKVCacheManager
from cadence.core.request import Request


class AdmissionPolicy(Protocol):
    def can_admit(self, request: Request, kv_cache_manager: AnyKVCacheManager) -> bool:
        """Whether a waiting request may start (or resume) this step."""
        ...


class AlwaysAdmit:
    def can_admit(self, request: Request, kv_cache_manager: AnyKVCacheManager) -> bool:
        return True


class SafetyMarginAdmission:
    def __init__(self, margin: float) -> None:
        self.margin = margin

    def can_admit(self, request: Request, kv_cache_manager: AnyKVCacheManager) -> bool:
        pool = kv_cache_manager.block_pool
        return pool.num_free_blocks >= self.margin * pool.num_blocks


def make_admission_policy(safety_margin: float) -> AdmissionPolicy:
    return SafetyMarginAdmission(safety_margin) if safety_margin > 0 else AlwaysAdmit()


def prefill_first_order(running: list[Request]) -> list[Request]:
    """Running requests with prompt tokens left first, each group in its old order."""
    prefilling = [r for r in running if r.num_computed_tokens < r.num_prompt_tokens]
    if not prefilling:
        return list(running)
    decoding = [r for r in running if r.num_computed_tokens >= r.num_prompt_tokens]
    return prefilling + decoding


def kv_read_tokens(request: Request, num_new_tokens: int, sliding_window: int | None) -> int:
    """KV-cache tokens attention reads for this request this step."""
    context = request.num_computed_tokens + num_new_tokens
    if sliding_window is not None and context > sliding_window:
        return sliding_window
    return context
