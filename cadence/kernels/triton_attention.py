"""Paged attention on the GPU: one Triton kernel for a whole mixed step.

A step's query tokens arrive flattened, sequence after sequence, as in
``cadence.runner.attention``; sequence ``s`` owns query rows
``query_start_loc[s] : query_start_loc[s + 1]``, the tail of its
``seq_len`` tokens, and its keys and values sit in the paged cache at the
blocks its row of ``block_table`` names. Prefill chunks that attend to a
cached prefix, plain prefills and decodes all go through the same kernel.

Work is cut in *tiles*: ``block_q`` consecutive query tokens of one sequence
times the ``G`` query heads that share one KV head (grouped-query heads are
folded into the rows, so each key is loaded once per group, not once per
query head). Program ``(tile, kv_head)`` walks that sequence's keys
``block_n`` at a time, each key's address read through the block table,
with an online softmax in float32; causal and sliding-window masks come
from positions. The host lists the tiles (``tile_seq``, ``tile_q_start``),
so a decode-only batch of B sequences is always B tiles: a fixed grid that
a CUDA graph can replay.

Triton is imported on first use: the CPU install never needs it. With
``TRITON_INTERPRET=1`` the same kernel runs on the CPU (slowly), which is how
the suite checks it on machines without a GPU.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch


MAX_SPLITS = 16


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class TileShape:
    """How one call cuts its queries: ``block_m`` rows = ``block_q`` tokens x G heads."""

    block_q: int
    block_m: int
    block_n: int
    num_splits: int = 1  # >1: each tile's keys split over programs, then combined

    @classmethod
    def choose(cls, group: int, max_query_len: int, block_n: int = 64, *,
               num_tiles: int = 0, num_kv_heads: int = 1, num_sms: int = 0) -> "TileShape":
        """Small tiles for decode-only steps, large ones where queries are long.

        A decode step whose tiles x KV heads would leave most of the ``num_sms``
        multiprocessors idle (a few long sequences) splits each tile's keys
        over up to 16 programs (flash-decoding), then combines them.
        """
        rows = 16 if max_query_len <= 1 else 64
        block_m = max(rows, _next_pow2(group))
        num_splits = 1
        if max_query_len <= 1 and num_tiles and num_sms:
            programs = num_tiles * num_kv_heads
            num_splits = min(MAX_SPLITS, _next_pow2(max(1, -(-2 * num_sms // programs))))
            num_splits = num_splits if num_splits >= 2 else 1
        return cls(block_q=max(1, block_m // group), block_m=block_m, block_n=block_n,
                   num_splits=num_splits)


def _next_pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


def tiles_of(query_lens: "list[int] | torch.Tensor", block_q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tile_seq, tile_q_start)``: the sequence and first query index of every tile."""
    lens = torch.as_tensor(query_lens, dtype=torch.int64)
    num_tiles = (lens + block_q - 1) // block_q  # [S]
    tile_seq = torch.repeat_interleave(torch.arange(len(lens)), num_tiles)
    first_tile = torch.cumsum(num_tiles, 0) - num_tiles
    tile_q_start = (torch.arange(len(tile_seq)) - first_tile[tile_seq]) * block_q
    return tile_seq, tile_q_start


def _patch_interpreter_index() -> None:
    """Let Triton's CPU interpreter take a loaded scalar as a loop bound.

    The interpreter keeps scalars as 1-element arrays and converts them with
    ``int(array)``, which NumPy 2.4 refuses for arrays of one dimension.
    Only used under ``TRITON_INTERPRET=1``; compiled kernels never see it.
    """
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "cadence_patched", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.cadence_patched = True
    interpreter._patch_lang_tensor = patched


def prepare_interpreter() -> None:
    """Under ``TRITON_INTERPRET=1``, mend what the interpreter needs; else nothing."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        _patch_interpreter_index()


@functools.cache
def _kernel():
    """The kernel, built once Triton is imported."""
    import triton
    import triton.language as tl

    prepare_interpreter()

    @triton.jit
    def paged_attention_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr,
        query_start_loc_ptr, seq_lens_ptr, block_table_ptr, tile_seq_ptr, tile_q_start_ptr,
        part_acc_ptr, part_m_ptr, part_l_ptr, num_tokens,
        scale, sliding_window,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
        stride_bt,
        HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr, USE_WINDOW: tl.constexpr, IEEE: tl.constexpr,
        UPCAST: tl.constexpr, NUM_SPLITS: tl.constexpr,
    ):
        tile = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        seq = tl.load(tile_seq_ptr + tile)
        q_first = tl.load(tile_q_start_ptr + tile)
        query_start = tl.load(query_start_loc_ptr + seq)
        query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
        seq_len = tl.load(seq_lens_ptr + seq)
        num_cached = seq_len - query_len

        rows = tl.arange(0, BLOCK_M)
        q_idx = q_first + rows // GROUP  # query index inside the sequence
        head = kv_head * GROUP + rows % GROUP
        row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < query_len)
        q_pos = num_cached + q_idx  # [M] position of each row's token
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < HEAD_DIM

        q_rows = (query_start + q_idx).to(tl.int64)
        q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                    mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)

        # Keys this tile can see: up to its last token's position, and (with a
        # window) no earlier than its first token's window start.
        last_pos = num_cached + tl.minimum(q_first + BLOCK_Q, query_len) - 1
        kv_end = last_pos + 1
        kv_begin = 0
        if USE_WINDOW:
            kv_begin = tl.maximum(num_cached + q_first - sliding_window + 1, 0)
            kv_begin = (kv_begin // BLOCK_N) * BLOCK_N
        if NUM_SPLITS > 1:
            # This program's share of the keys: whole BLOCK_N chunks, maybe none.
            chunk = tl.cdiv(tl.cdiv(kv_end - kv_begin, NUM_SPLITS), BLOCK_N) * BLOCK_N
            kv_begin = kv_begin + split * chunk
            kv_end = tl.minimum(kv_begin + chunk, kv_end)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        keys = tl.arange(0, BLOCK_N)
        table_row = block_table_ptr + seq.to(tl.int64) * stride_bt
        for start in range(kv_begin, kv_end, BLOCK_N):
            k_pos = start + keys  # [N]
            k_ok = k_pos < kv_end
            block = tl.load(table_row + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
            offset = k_pos % BLOCK_SIZE
            k_addr = block * stride_kb + offset * stride_kt + kv_head * stride_kh
            v_addr = block * stride_vb + offset * stride_vt + kv_head * stride_vh
            k = tl.load(k_ptr + k_addr[None, :] + dims[:, None],
                        mask=k_ok[None, :] & dim_ok[:, None], other=0.0)  # [D, N]
            if UPCAST:
                k = k.to(tl.float32)
            if IEEE:
                s = tl.dot(q, k, input_precision="ieee")
            else:
                s = tl.dot(q, k)
            s = s * scale
            visible = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
            if USE_WINDOW:
                visible = visible & (k_pos[None, :] > q_pos[:, None] - sliding_window)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # Rows that have seen no key yet keep m = -inf; use 0 so exp stays finite.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + v_addr[:, None] + dims[None, :],
                        mask=k_ok[:, None] & dim_ok[None, :], other=0.0)  # [N, D]
            if UPCAST:
                v = v.to(tl.float32)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new

        if NUM_SPLITS == 1:
            acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
        else:
            # Partials [split, token, head]: the unnormalised sum, its max and its mass.
            cell = (split * num_tokens + q_rows) * (GROUP * tl.num_programs(1)) + head
            tl.store(part_acc_ptr + cell[:, None] * HEAD_DIM + dims[None, :], acc,
                     mask=row_ok[:, None] & dim_ok[None, :])
            tl.store(part_m_ptr + cell, m_i, mask=row_ok)
            tl.store(part_l_ptr + cell, l_i, mask=row_ok)

    @triton.jit
    def combine_splits_kernel(
        part_acc_ptr, part_m_ptr, part_l_ptr, out_ptr, num_tokens, num_heads, stride_ot, stride_oh,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
    ):
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        splits = tl.arange(0, NUM_SPLITS)
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < HEAD_DIM
        cells = (splits * num_tokens + token) * num_heads + head  # [S]
        m = tl.load(part_m_ptr + cells)
        l = tl.load(part_l_ptr + cells)
        m_max = tl.max(m, 0)
        m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
        weight = tl.exp(m - m_max)  # 0 for a split that saw no key
        acc = tl.load(part_acc_ptr + cells[:, None] * HEAD_DIM + dims[None, :],
                      mask=dim_ok[None, :], other=0.0)
        total = tl.sum(weight * l, 0)
        out = tl.sum(acc * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
        tl.store(out_ptr + token * stride_ot + head * stride_oh + dims,
                 out.to(out_ptr.dtype.element_ty), mask=dim_ok)

    return paged_attention_kernel, combine_splits_kernel


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    key_blocks: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_blocks: torch.Tensor,
    out: torch.Tensor,  # [T, Hq, D]
    query_start_loc: torch.Tensor,  # [S + 1] int
    seq_lens: torch.Tensor,  # [S] int
    block_table: torch.Tensor,  # [S, max_blocks] int
    tile_seq: torch.Tensor,  # [num_tiles] int
    tile_q_start: torch.Tensor,  # [num_tiles] int
    shape: TileShape,
    *,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention of every query row over its sequence's cached keys; fills ``out``.

    The keys and values of this step's tokens must already be in the cache.
    ``tile_seq`` / ``tile_q_start`` come from ``tiles_of(query_lens, shape.block_q)``.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = key_blocks.shape[2], key_blocks.shape[1]
    if q.stride(2) != 1 or key_blocks.stride(3) != 1 or value_blocks.stride(3) != 1:
        raise ValueError("paged_attention: the head dimension must be contiguous")
    group = num_heads // num_kv_heads
    splits = shape.num_splits
    grid = (tile_seq.shape[0], num_kv_heads, splits)
    if grid[0] == 0:
        return out
    attention_kernel, combine_kernel = _kernel()
    num_tokens = q.shape[0]
    parts = (out, out, out)  # unused unless split
    if splits > 1:
        cells = (splits, num_tokens, num_heads)
        parts = (torch.empty(*cells, head_dim, dtype=torch.float32, device=q.device),
                 torch.empty(cells, dtype=torch.float32, device=q.device),
                 torch.empty(cells, dtype=torch.float32, device=q.device))
    attention_kernel[grid](
        q, key_blocks, value_blocks, out,
        query_start_loc, seq_lens, block_table, tile_seq, tile_q_start,
        *parts, num_tokens,
        scale, sliding_window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key_blocks.stride(0), key_blocks.stride(1), key_blocks.stride(2),
        value_blocks.stride(0), value_blocks.stride(1), value_blocks.stride(2),
        block_table.stride(0),
        HEAD_DIM=head_dim, GROUP=group, BLOCK_SIZE=block_size,
        BLOCK_Q=shape.block_q, BLOCK_M=shape.block_m, BLOCK_N=shape.block_n,
        BLOCK_D=max(16, _next_pow2(head_dim)), USE_WINDOW=sliding_window is not None,
        IEEE=q.dtype == torch.float32,
        # Triton's CPU interpreter multiplies bfloat16 wrongly: it gets float32.
        UPCAST=q.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1",
        NUM_SPLITS=splits,
    )
    if splits > 1:
        combine_kernel[(num_tokens, num_heads)](
            *parts, out, num_tokens, num_heads, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=max(16, _next_pow2(head_dim)), NUM_SPLITS=splits,
        )
    return out
