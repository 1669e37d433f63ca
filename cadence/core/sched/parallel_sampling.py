"""Parallel sampling (``n > 1``): compute the prompt once, then fork.

The parent computes the prompt's leading full blocks only; then it is
replaced by ``n`` children that hold references to those blocks and each
compute the short tail themselves (less than two blocks), so no KV is ever
copied:

    prompt (block_size 4, 10 tokens):  |p p p p|p p p p|p p
    parent computes                    |<- fork_point=8->|
    each child computes                                  |p p  -> samples

A prompt shorter than a block plus one token has nothing to share: its
children are created at once. Child ids are ``"{index}_{parent_id}"``.
"""

from __future__ import annotations

from typing import Iterable

from cadence.core.kv_cache import AnyKVCacheManager
from cadence.core.request import Request


def child_request_id(parent_id: str, index: int) -> str:
    return f"{index}_{parent_id}"


class ForkRegistry:
    """Parents waiting to fork, and the live children of each forked parent."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._children: dict[str, list[str]] = {}

    def prepare(self, parent: Request, kv_cache_manager: AnyKVCacheManager) -> list[Request] | None:
        """Set the parent's fork point; returns the children instead if there is nothing to share."""
        fork_point = (parent.num_prompt_tokens - 1) // self.block_size * self.block_size
        if fork_point == 0:
            children = self._make_children(parent)
            # The first child answers for the prompt's remote KV (P/D): it loads
            # it, or tells the peer to let its blocks go (they would be held
            # until the peer's timeout). A parent that forks later asked already.
            children[0].kv_transfer_params = parent.kv_transfer_params
            return children
        parent.fork_point = fork_point
        return None

    def share_prefix(self, parent: Request, child: Request, kv_cache_manager: AnyKVCacheManager) -> None:
        """Give ``child`` the parent's computed blocks: it starts at the fork point."""
        fork_point = parent.fork_point
        assert fork_point is not None
        kv_cache_manager.fork_blocks(parent, child, fork_point // self.block_size)
        child.num_computed_tokens = fork_point
        child.num_cached_tokens = parent.num_cached_tokens

    def make_children(self, parent: Request) -> list[Request]:
        return self._make_children(parent)

    def _make_children(self, parent: Request) -> list[Request]:
        params = parent.sampling_params
        children = []
        for index in range(params.n):
            seed = None if params.seed is None else params.seed + index
            child = Request(
                child_request_id(parent.request_id, index),
                parent.prompt_token_ids,
                params.replace(n=1, seed=seed),
                eos_token_id=parent.eos_token_id,
                arrival_time=parent.arrival_time,
                priority=parent.priority,
                client_index=parent.client_index,
                lora_request=parent.lora_request,
                mm_positions=parent.mm_positions,
                mm_hashes=parent.mm_hashes,
            )
            child.max_tokens = parent.max_tokens
            child.parent_request_id = parent.request_id
            children.append(child)
        self._children[parent.request_id] = [c.request_id for c in children]
        return children

    def expand(self, request_ids: Iterable[str]) -> list[str]:
        """The ids plus the live children of any forked parent among them."""
        expanded = []
        for req_id in request_ids:
            expanded.append(req_id)
            expanded.extend(self._children.get(req_id, ()))
        return expanded

    def forget(self, request: Request) -> None:
        """A child finished: drop it from its parent's list."""
        parent_id = request.parent_request_id
        if parent_id is None:
            return
        siblings = self._children.get(parent_id)
        if siblings is None:
            return
        if request.request_id in siblings:
            siblings.remove(request.request_id)
        if not siblings:
            del self._children[parent_id]
