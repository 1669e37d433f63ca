"""A KV cache below 16 bits: llama.cpp's q8_0 blocks (``--kv-cache-dtype q8_0``, CPU only).

Each 32 values of a token's keys (or values) are 34 bytes: a float16 scale
``d = max|x| / 127`` then 32 int8 ``q = round(x / d)`` (to nearest even),
read back as ``d * q``: 1.88x the tokens of a float16 cache in the same
memory. The cache's tensor holds the bytes (``Q8_0``, uint8): a layer's
blocks are ``[num_blocks, block_size, Hkv, D / 32 * 34]``, so block copies
(swap, the host tier, transfers) move them as they move any cache's.

The C kernels write (``decoder_stack.c``'s ``store_row``) and read
(``paged_attention.c``, the ``f32_kvq8_0`` variant) the same bytes as
``encode`` and ``decode`` here, which the PyTorch path uses: the same
rounding, step for step (tests/runner/test_kv_quant.py).
"""

from __future__ import annotations

import torch

Q8_0 = torch.uint8  # the storage dtype that stands for a q8_0 cache
VALUES, BYTES = 32, 34  # per q8_0 block


def row_elements(num_values: int, dtype: torch.dtype) -> int:
    """Elements of ``dtype`` that hold ``num_values`` cached values."""
    return num_values // VALUES * BYTES if dtype == Q8_0 else num_values


def check_head_dim(head_dim: int, dtype: torch.dtype) -> None:
    if dtype == Q8_0 and head_dim % VALUES:
        raise ValueError(f"kv_cache_dtype: q8_0 keeps blocks of {VALUES} values of a head; this model's "
                         f"head_dim {head_dim} is not a multiple of {VALUES}")


def encode(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] (n a multiple of 32) -> its q8_0 bytes [..., n / 32 * 34] (uint8)."""
    *lead, n = x.shape
    groups = x.float().reshape(*lead, n // VALUES, VALUES)
    scale = groups.abs().amax(dim=-1, keepdim=True) / 127  # [..., n/32, 1]
    inverse = torch.where(scale != 0, 1.0 / scale, torch.zeros_like(scale))
    out = torch.empty(*lead, n // VALUES, BYTES, dtype=torch.uint8, device=x.device)
    out[..., :2] = scale.to(torch.float16).view(torch.uint8)
    out[..., 2:] = torch.round(groups * inverse).to(torch.int8).view(torch.uint8)
    return out.reshape(*lead, n // VALUES * BYTES)


def decode(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q8_0 bytes [..., m] -> the values [..., m / 34 * 32] in ``dtype``."""
    *lead, m = data.shape
    blocks = data.reshape(*lead, m // BYTES, BYTES)
    scale = blocks[..., :2].contiguous().view(torch.float16).float()  # [..., m/34, 1]
    values = blocks[..., 2:].contiguous().view(torch.int8).float()
    return (scale * values).reshape(*lead, m // BYTES * VALUES).to(dtype)
