"""Encoder inputs (multimodal items) in the scheduler: a compute budget and a cache.

An item's encoder output replaces its placeholder tokens in the prompt
(``PlaceholderRange(offset, length)``). The encoder runs over the whole item
at once, so an item is scheduled when the step's token range first overlaps
it; its output stays cached (by content hash, shared across requests) until
every request that needs it has computed past it.

    prompt:    t t t [i i i i i] t t
                      ^offset  ^offset+length
    step range [num_computed, num_computed + num_new) overlapping -> encode
"""

from __future__ import annotations

from cadence.core.request import Request


class EncoderCacheManager:
    """Encoder outputs by mm hash, sized in tokens; freed when no request needs them."""

    def __init__(self, cache_size: int) -> None:
        self.cache_size = cache_size
        self.num_free_slots = cache_size
        # mm hash -> ids of requests still needing it.
        self._users: dict[str, set[str]] = {}
        self._sizes: dict[str, int] = {}
        self._freed: list[str] = []

    def has_cache(self, request: Request, input_id: int) -> bool:
        mm_hash = request.mm_hashes[input_id]
        if mm_hash not in self._users:
            return False
        self._users[mm_hash].add(request.request_id)
        return True

    def can_allocate(self, request: Request, input_id: int) -> bool:
        return request.mm_positions[input_id].length <= self.num_free_slots

    def allocate(self, request: Request, input_id: int) -> None:
        mm_hash = request.mm_hashes[input_id]
        size = request.mm_positions[input_id].length
        self._users.setdefault(mm_hash, set()).add(request.request_id)
        if mm_hash not in self._sizes:
            self._sizes[mm_hash] = size
            self.num_free_slots -= size

    def get_cached_input_ids(self, request: Request) -> list[int]:
        return [
            i for i, h in enumerate(request.mm_hashes)
            if request.request_id in self._users.get(h, ())
        ]

    def free_encoder_input(self, request: Request, input_id: int) -> None:
        mm_hash = request.mm_hashes[input_id]
        users = self._users.get(mm_hash)
        if users is None:
            return
        users.discard(request.request_id)
        if not users:
            del self._users[mm_hash]
            self.num_free_slots += self._sizes.pop(mm_hash)
            self._freed.append(mm_hash)

    def free(self, request: Request) -> None:
        for input_id in range(len(request.mm_hashes)):
            self.free_encoder_input(request, input_id)

    def take_freed_ids(self) -> list[str]:
        freed, self._freed = self._freed, []
        return freed


def schedule_encoder_inputs(
    request: Request,
    num_computed_tokens: int,
    num_new_tokens: int,
    encoder_budget: int,
    cache: EncoderCacheManager,
    disable_chunked_mm_input: bool,
) -> tuple[list[int], int, int]:
    """Which items to encode this step; may shrink ``num_new_tokens``.

    Returns (item indices, num_new_tokens, remaining encoder budget). When an
    item cannot be encoded (budget or cache full), the step stops just before
    its placeholder; if it is already past the start (a prefix-cache hit
    inside an item), nothing can be scheduled (num_new_tokens 0).
    """
    to_encode: list[int] = []
    end = num_computed_tokens + num_new_tokens
    for i, pos in enumerate(request.mm_positions):
        if pos.offset >= end:
            break  # later items are not reached this step
        if pos.offset + pos.length <= num_computed_tokens:
            continue  # already consumed into the KV cache
        if cache.has_cache(request, i):
            continue
        if (
            disable_chunked_mm_input
            and num_computed_tokens < pos.offset
            and end < pos.offset + pos.length
        ):
            num_new_tokens = pos.offset - num_computed_tokens
            break
        if pos.length > encoder_budget or not cache.can_allocate(request, i):
            num_new_tokens = max(0, pos.offset - num_computed_tokens)
            break
        encoder_budget -= pos.length
        to_encode.append(i)
    return to_encode, num_new_tokens, encoder_budget


def free_consumed_encoder_inputs(request: Request, cache: EncoderCacheManager) -> None:
    """Release cached items whose placeholders the request has fully computed."""
    for input_id in cache.get_cached_input_ids(request):
        pos = request.mm_positions[input_id]
        if pos.offset + pos.length <= request.num_computed_tokens:
            cache.free_encoder_input(request, input_id)
