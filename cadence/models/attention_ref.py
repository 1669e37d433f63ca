"""Dense causal attention for ONE sequence, with its own contiguous KV per layer (GQA aware).

A reference for tests and simple scripts: it lets ``LlamaForCausalLM`` run a
prefill and then token-by-token decode without the runner's paged cache.

Each call appends the new k/v to the layer's cache, then lets the T new queries
attend to every cached key up to their own position. With P tokens already
cached, query i (absolute position P + i) sees keys 0 .. P + i:

    keys     0 .. P-1 | P  P+1 .. P+T-1
    query 0     all   | x   .       .
    query 1     all   | x   x       .
    query T-1   all   | x   x  ...  x

With a sliding window W (Mistral), query at position p sees only keys p-W+1 .. p.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class ReferenceAttention:
    """``attention(layer_idx, q, k, v)`` callable over a single growing sequence."""

    def __init__(self, sliding_window: int | None = None) -> None:
        self.sliding_window = sliding_window
        self._keys: dict[int, torch.Tensor] = {}  # layer -> [S, Hkv, D]
        self._values: dict[int, torch.Tensor] = {}  # layer -> [S, Hkv, D]

    @property
    def num_cached_tokens(self) -> int:
        """Tokens whose k/v layer 0 holds (the next token's position)."""
        cached = self._keys.get(0)
        return 0 if cached is None else cached.shape[0]

    def reset(self) -> None:
        """Forget the sequence; the next call starts a new one at position 0."""
        self._keys.clear()
        self._values.clear()

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (rotary applied) -> [T, Hq, D]."""
        keys = self._append(self._keys, layer_idx, k)  # [S, Hkv, D]
        values = self._append(self._values, layer_idx, v)  # [S, Hkv, D]
        num_new, num_total = q.shape[0], keys.shape[0]
        group = q.shape[1] // k.shape[1]  # query heads per kv head
        out = F.scaled_dot_product_attention(
            _batched_heads(q),  # [1, Hq, T, D]
            _batched_heads(keys.repeat_interleave(group, dim=1)),  # [1, Hq, S, D]
            _batched_heads(values.repeat_interleave(group, dim=1)),  # [1, Hq, S, D]
            **self._causality(num_new, num_total, q.device))
        return out[0].transpose(0, 1)  # [T, Hq, D]

    def _causality(self, num_new: int, num_total: int, device: torch.device) -> dict:
        """SDPA arguments making new query i see keys up to its own position (and window)."""
        if self.sliding_window is not None and num_total > self.sliding_window:
            return {"attn_mask": causal_mask(num_new, num_total, device, self.sliding_window)}
        if num_new == 1:
            return {}  # the newest token sees everything cached
        if num_new == num_total:
            return {"is_causal": True}  # a whole prompt: the usual lower triangle
        return {"attn_mask": causal_mask(num_new, num_total, device)}

    @staticmethod
    def _append(cache: dict[int, torch.Tensor], layer_idx: int, new: torch.Tensor) -> torch.Tensor:
        old = cache.get(layer_idx)
        cache[layer_idx] = new if old is None else torch.cat([old, new], dim=0)
        return cache[layer_idx]


def _batched_heads(x: torch.Tensor) -> torch.Tensor:
    # [T, H, D] -> [1, H, T, D]: 4-D inputs let CPU SDPA take its flash kernel
    # (faster there with kv heads repeated than with enable_gqa).
    return x.transpose(0, 1).unsqueeze(0)


def causal_mask(num_new: int, num_total: int, device: torch.device,
                sliding_window: int | None = None) -> torch.Tensor:
    """bool [T, S]: True where new query i (position S - T + i) may attend key j."""
    query_positions = torch.arange(num_total - num_new, num_total, device=device)[:, None]  # [T, 1]
    key_positions = torch.arange(num_total, device=device)[None, :]  # [1, S]
    visible = key_positions <= query_positions
    if sliding_window is not None:
        visible &= key_positions > query_positions - sliding_window
    return visible
