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
``for_model`` takes each layer's window, the q.k scale and the score
soft-capping from a ``ModelConfig`` (Gemma's alternating windows).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from cadence.models.config import ModelConfig


class ReferenceAttention:
    """``attention(layer_idx, q, k, v)`` callable over a single growing sequence."""

    def __init__(self, sliding_window: int | None = None, *, scale: float | None = None,
                 softcap: float | None = None, layer_window: Callable[[int], int | None] | None = None) -> None:
        """``layer_window``: each layer's window (default: ``sliding_window`` for all)."""
        self.layer_window = layer_window or (lambda _layer: sliding_window)
        self.scale = scale
        self.softcap = softcap
        self._keys: dict[int, torch.Tensor] = {}  # layer -> [S, Hkv, D]
        self._values: dict[int, torch.Tensor] = {}  # layer -> [S, Hkv, D]

    @classmethod
    def for_model(cls, config: "ModelConfig") -> "ReferenceAttention":
        """Attention as ``config``'s model runs it: its windows, scale and soft-capping."""
        return cls(scale=config.attention_scale, softcap=config.attn_logit_softcapping,
                   layer_window=config.layer_sliding_window)

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
        out = softcapped_attention(
            _batched_heads(q),  # [1, Hq, T, D]
            _batched_heads(keys.repeat_interleave(group, dim=1)),  # [1, Hq, S, D]
            _batched_heads(values.repeat_interleave(group, dim=1)),  # [1, Hq, S, D]
            scale=self.scale, softcap=self.softcap,
            **self._causality(num_new, num_total, q.device, self.layer_window(layer_idx)))
        return out[0].transpose(0, 1)  # [T, Hq, D]

    @staticmethod
    def _causality(num_new: int, num_total: int, device: torch.device, sliding_window: int | None) -> dict:
        """SDPA arguments making new query i see keys up to its own position (and window)."""
        if sliding_window is not None and num_total > sliding_window:
            return {"attn_mask": causal_mask(num_new, num_total, device, sliding_window)}
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


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                         attn_mask: torch.Tensor | None = None, is_causal: bool = False,
                         scale: float | None = None, softcap: float | None = None) -> torch.Tensor:
    """``scaled_dot_product_attention`` (same heads in q, k, v), with scores soft-capped.

    Without a cap this is SDPA itself. With one, the scores are computed
    explicitly: ``softmax(cap * tanh(q.k * scale / cap) masked)``, the softmax
    in float32 (as Gemma 2's reference does it). attn_mask: bool, True = may attend.
    """
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale  # [..., Q, K]
    scores = torch.tanh(scores / softcap) * softcap
    if is_causal:
        attn_mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)
