"""Attention over the paged KV cache for one step's flattened, mixed batch.

A step's tokens arrive flattened, sequence after sequence; sequence ``s`` owns
query rows ``query_start_loc[s] : query_start_loc[s + 1]``. Its new tokens
are the tail of its context:

    positions   0 ........... k-1 | k ...... seq_len-1
                cached before     | new this step (query_len = seq_len - k)
    query at position p attends to keys 0..p (and only the last
    ``sliding_window`` of them when a window is set)

Invariant, per layer: the new keys/values of *all* tokens are written to the
cache first, and every key/value attention reads comes from the cache. (The
scheduler no longer relies on it: blocks enter the prefix cache once their
step is final, so a request never hits blocks another one writes in the
same step; the test harness's shadow KV cache checks what each step reads.)

Short queries (decodes, speculative verification) take one of two paths:

- with the native kernel (``cadence.kernels.paged_attention``, C compiled on first
  use), one call per layer reads every short sequence's keys and values in
  place through its block table (``ShortQueryIndex``);
- otherwise they are batched on ``scaled_dot_product_attention``, in groups
  of similar context length (decodes apart): their blocks are gathered
  whole into a padded ``[B, Hkv, Lpad, D]`` with a mask; grouped-query heads
  are folded into the query axis, so no key is copied per query head.

Longer prefill chunks run one sequence at a time on
``scaled_dot_product_attention`` with a causal mask offset by the cached
prefix; where a sliding window cuts a chunk's context, in pieces of
``WINDOW_PIECE_QUERY_LEN`` query tokens, each reading only the keys its
window reaches (one masked call computes every score, seen or not: on
Gemma 3's local layers a 2,000-token prompt's attention took 2.7x as long
whole); in the batch-invariant mode (``cadence.runner.batch_invariance``)
they take the native kernel too, in pieces of at most
``NATIVE_PIECE_QUERY_LEN`` query tokens: the kernel computes each query row
alone, its keys in position order, so a row's result does not depend on how
its prompt was chunked or batched.

Everything index-shaped is computed once per step (``AttentionMetadata``)
and reused by every layer; a model whose layers use different windows
(Gemma's local and global layers) gets one plan per distinct window, each
layer reading its own (``PagedAttention.layer_metadata``). With score
soft-capping (Gemma 2) the SDPA calls compute their scores explicitly
(``softcapped_attention``), and the native kernel caps its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from cadence.models.attention_ref import softcapped_attention
from cadence.runner import kv_quant
from cadence.runner.kv_cache import PagedKVCache
from cadence.kernels.paged_attention import PagedAttentionKernel

# Sequences with at most this many query tokens share one padded batched call.
MAX_BATCHED_QUERY_LEN = 8
# Query tokens per piece of a long query on the native kernel (batch-invariant
# mode): pieces bound its scratch memory and spread one prompt over the threads.
NATIVE_PIECE_QUERY_LEN = 32
# Query tokens per SDPA call of a long query whose keys a sliding window cuts:
# one call would compute (then mask) every score of the query against its whole
# context; a piece computes only those its window reaches.
WINDOW_PIECE_QUERY_LEN = 256


@dataclass
class BatchedPlan:
    """Gather indices and mask of the short-query sequences, batched together."""

    num_seqs: int
    max_query_len: int
    token_index: torch.Tensor  # [B * Qmax] query rows; padding repeats a real row
    block_index: torch.Tensor  # [B * nblk] cache blocks to gather, per sequence
    mask: torch.Tensor  # [B, 1, Qmax, Lpad] bool, True = may attend
    valid_rows: torch.Tensor | None  # [N] real rows of [B * Qmax]; None: all real
    out_index: torch.Tensor  # [N] where those rows go in the step's output
    _folded_masks: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def folded_mask(self, group: int) -> torch.Tensor:
        """The mask with each query row repeated for the G heads of its group.

        Built on first use and kept for the other layers of the step.
        """
        if self.max_query_len == 1:
            return self.mask  # [B, 1, 1, Lpad] broadcasts over the group
        if group not in self._folded_masks:
            self._folded_masks[group] = self.mask.repeat_interleave(group, dim=2)
        return self._folded_masks[group]  # [B, 1, Qmax*G, Lpad]


@dataclass
class ShortQueryIndex:
    """The short-query sequences, as the native kernel reads them."""

    query_start: torch.Tensor  # [S] int64, first query row of each
    query_len: torch.Tensor  # [S] int64
    seq_len: torch.Tensor  # [S] int64, context length after this step
    block_table: torch.Tensor  # [S, max_blocks] int32
    sliding_window: int | None
    # Each entry's sequence in the step's block table (None: not kept), so a KV cache
    # group's table is one gather away (``AttentionMetadata.through``).
    seqs: torch.Tensor | None = None  # [S] int64

    def to(self, device: torch.device) -> "ShortQueryIndex":
        tensors = (self.query_start, self.query_len, self.seq_len, self.block_table)
        return ShortQueryIndex(*(t.to(device, non_blocking=True) for t in tensors),
                               self.sliding_window, self.seqs)


@dataclass
class PrefillPlan:
    """One long query chunk: its rows, its cache blocks and its causal mask."""

    query_start: int
    query_end: int
    block_ids: torch.Tensor  # [nblk] int64, the blocks covering its keys
    kv_offset: int  # first key's offset inside the first gathered block
    kv_len: int
    mask: torch.Tensor | None  # [Q, kv_len] bool; None: plain causal (Q == kv_len)


@dataclass
class AttentionMetadata:
    """Everything attention needs about one step, built once, used by all layers."""

    slot_mapping: torch.Tensor  # [T] int64, cache slot of each new token
    batched: list[BatchedPlan]  # short queries, in groups of similar length
    prefills: list[PrefillPlan]  # long queries, one each (in pieces under a sliding window)
    short: ShortQueryIndex | None = None  # short queries, for the native kernel
    native_long: bool = False  # ``short`` also holds pieces of long queries (batch-invariant mode)

    @classmethod
    def build(
        cls,
        query_start_loc: list[int],
        seq_lens: list[int],
        block_table: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_size: int,
        sliding_window: int | None = None,
        native_short_queries: bool = False,
        native_long_queries: bool = False,
    ) -> "AttentionMetadata":
        """Plan a step.

        ``query_start_loc`` has S + 1 entries; ``seq_lens[s]`` is sequence s's
        context length after this step (computed + scheduled tokens);
        ``block_table`` ``[S, max_blocks]`` holds each sequence's block ids.
        ``native_short_queries``: index short queries for the native kernel
        instead of planning padded batches; ``native_long_queries``: long ones
        too, in pieces, instead of SDPA (needs ``native_short_queries``).
        """
        if native_long_queries:
            return cls(slot_mapping=slot_mapping, batched=[], prefills=[],
                       short=_native_pieces(query_start_loc, seq_lens, block_table, sliding_window),
                       native_long=max(query_start_loc[s + 1] - query_start_loc[s]
                                       for s in range(len(seq_lens))) > MAX_BATCHED_QUERY_LEN)
        query_lens = [query_start_loc[s + 1] - query_start_loc[s] for s in range(len(seq_lens))]
        # Decodes apart from other short queries: padding them to Qmax would
        # multiply their query rows.
        decodes = [s for s, n in enumerate(query_lens) if n == 1]
        short = [s for s, n in enumerate(query_lens) if 1 < n <= MAX_BATCHED_QUERY_LEN]
        long = [s for s, n in enumerate(query_lens) if n > MAX_BATCHED_QUERY_LEN]
        starts = torch.tensor(query_start_loc[:-1], dtype=torch.long)
        lens = torch.tensor(query_lens, dtype=torch.long)
        seqs = torch.tensor(seq_lens, dtype=torch.long)
        short_index, batched = None, []
        if native_short_queries and (decodes or short):
            idx = torch.tensor(decodes + short, dtype=torch.long)
            short_index = ShortQueryIndex(
                starts[idx], lens[idx], seqs[idx], block_table[idx].to(torch.int32).contiguous(),
                sliding_window, idx)
            decodes, short = [], []
        for group in _group_by_length(decodes, seq_lens) + _group_by_length(short, seq_lens):
            idx = torch.tensor(group, dtype=torch.long)
            batched.append(_plan_batched(
                starts[idx], lens[idx], seqs[idx], block_table[idx].long(),
                block_size, sliding_window,
            ))
        prefills = [
            plan
            for s in long
            for plan in _plan_prefill_pieces(
                query_start_loc[s], query_lens[s], seq_lens[s], block_table[s],
                block_size, sliding_window,
            )
        ]
        return cls(slot_mapping=slot_mapping, batched=batched, prefills=prefills, short=short_index)

    def through(
        self, block_table: torch.Tensor, slot_mapping: torch.Tensor, sliding_window: int | None
    ) -> "AttentionMetadata | None":
        """This plan read through another block table and slots (a KV cache group's), with
        its window: one gather where the native kernel runs every query (decode steps);
        None where the plan must be built anew (``build``)."""
        short = self.short
        if short is None or short.seqs is None or self.batched or self.prefills or self.native_long:
            return None
        table = block_table[short.seqs].to(torch.int32).contiguous()
        index = ShortQueryIndex(short.query_start, short.query_len, short.seq_len, table, sliding_window, short.seqs)
        return AttentionMetadata(slot_mapping=slot_mapping, batched=[], prefills=[], short=index)

    def to(self, device: torch.device) -> "AttentionMetadata":
        """The same plan with its tensors on ``device`` (itself when already there)."""
        if self.slot_mapping.device == device:
            return self
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        batched = [
            BatchedPlan(
                b.num_seqs, b.max_query_len, move(b.token_index), move(b.block_index),
                move(b.mask), move(b.valid_rows), move(b.out_index),
            )
            for b in self.batched
        ]
        prefills = [
            PrefillPlan(
                p.query_start, p.query_end, move(p.block_ids), p.kv_offset, p.kv_len, move(p.mask)
            )
            for p in self.prefills
        ]
        short = None if self.short is None else self.short.to(device)
        return AttentionMetadata(move(self.slot_mapping), batched, prefills, short, self.native_long)


def _native_pieces(
    query_start_loc: list[int], seq_lens: list[int], block_table: torch.Tensor, sliding_window: int | None
) -> ShortQueryIndex:
    """Every sequence for the native kernel, a long query cut into pieces of at most
    ``NATIVE_PIECE_QUERY_LEN`` tokens: a piece is its tokens j0..j1-1, with the
    context up to the last of them (the earlier ones' keys are in the cache)."""
    starts, lens, ends, owners = [], [], [], []
    for s, seq_len in enumerate(seq_lens):
        query_len = query_start_loc[s + 1] - query_start_loc[s]
        first_pos = seq_len - query_len
        for j0 in range(0, query_len, NATIVE_PIECE_QUERY_LEN):
            j1 = min(query_len, j0 + NATIVE_PIECE_QUERY_LEN)
            starts.append(query_start_loc[s] + j0)
            lens.append(j1 - j0)
            ends.append(first_pos + j1)
            owners.append(s)
    as_long = lambda values: torch.tensor(values, dtype=torch.long)  # noqa: E731
    table = block_table[as_long(owners)].to(torch.int32).contiguous()
    return ShortQueryIndex(as_long(starts), as_long(lens), as_long(ends), table, sliding_window)


def _group_by_length(seqs: list[int], seq_lens: list[int]) -> list[list[int]]:
    """Split sequences into groups padded to their longest member.

    Sorted by length, a group closes when padding would more than double
    the keys it really reads, so one long context does not make every short
    one pay for its length; similar lengths still share one call.
    """
    groups: list[list[int]] = []
    current: list[int] = []
    real = 0
    for s in sorted(seqs, key=seq_lens.__getitem__):
        if current and seq_lens[s] * (len(current) + 1) > 2 * (real + seq_lens[s]):
            groups.append(current)
            current, real = [], 0
        current.append(s)
        real += seq_lens[s]
    if current:
        groups.append(current)
    return groups


def _first_key_positions(num_cached: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """[B] the earliest key any new token of each sequence can see."""
    if sliding_window is None:
        return torch.zeros_like(num_cached)
    return (num_cached - (sliding_window - 1)).clamp(min=0)


def _causal_mask(
    q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None
) -> torch.Tensor:
    """True where a query at ``q_pos`` may see the key at ``k_pos`` (broadcasts)."""
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


def _plan_batched(
    query_start: torch.Tensor,  # [B]
    query_len: torch.Tensor,  # [B]
    seq_len: torch.Tensor,  # [B]
    block_table: torch.Tensor,  # [B, max_blocks] int64
    block_size: int,
    sliding_window: int | None,
) -> BatchedPlan:
    token_index, q_pos, real = _padded_queries(query_start, query_len, seq_len)
    first_key = _first_key_positions(seq_len - query_len, sliding_window)
    block_index, k_pos = _padded_keys(first_key, seq_len, block_table, block_size)
    mask = _causal_mask(q_pos[:, :, None], k_pos[:, None, :], sliding_window)  # [B, Qmax, Lpad]
    token_index, real = token_index.flatten(), real.flatten()  # [B * Qmax]
    return BatchedPlan(
        num_seqs=len(query_len),
        max_query_len=q_pos.shape[1],
        token_index=token_index,
        block_index=block_index.flatten(),
        mask=mask.unsqueeze(1),
        valid_rows=None if bool(real.all()) else real.nonzero().squeeze(1),
        out_index=token_index[real],
    )


def _padded_queries(
    query_start: torch.Tensor, query_len: torch.Tensor, seq_len: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query rows, positions and realness of each padded query slot, all [B, Qmax].

    Padded slots repeat the sequence's last query, so their mask row is never
    empty (an all-False row would give NaN); their output is dropped.
    """
    j = torch.arange(int(query_len.max()))
    j_real = torch.minimum(j[None, :], (query_len - 1)[:, None])  # [B, Qmax]
    token_index = query_start[:, None] + j_real
    q_pos = (seq_len - query_len)[:, None] + j_real
    real = j[None, :] < query_len[:, None]
    return token_index, q_pos, real


def _padded_keys(
    first_key: torch.Tensor, seq_len: torch.Tensor, block_table: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks to gather ``[B, nblk]`` and the position of each gathered key ``[B, Lpad]``.

    Blocks first_block .. end_block-1 hold a sequence's visible keys. Shorter
    sequences repeat their last block up to nblk; positions are counted as
    if the blocks went on, so the copies sit at positions >= seq_len, where
    the causal mask hides them.
    """
    first_block = first_key // block_size
    end_block = (seq_len + block_size - 1) // block_size
    num_blocks = int((end_block - first_block).max())
    block_col = first_block[:, None] + torch.arange(num_blocks)  # [B, nblk]
    block_col = torch.minimum(block_col, (end_block - 1)[:, None])
    block_index = torch.gather(block_table, 1, block_col)
    k_pos = first_block[:, None] * block_size + torch.arange(num_blocks * block_size)
    return block_index, k_pos


def _plan_prefill_pieces(
    query_start: int,
    query_len: int,
    seq_len: int,
    block_row: torch.Tensor,  # [max_blocks]
    block_size: int,
    sliding_window: int | None,
) -> list[PrefillPlan]:
    """One long query chunk's plans: itself whole, or, where a sliding window
    cuts its context, pieces of WINDOW_PIECE_QUERY_LEN query tokens, each
    planned as a chunk whose earlier tokens are cached (every new key is in the
    cache before any layer reads it), so that a piece reads only its window."""
    piece = WINDOW_PIECE_QUERY_LEN
    if sliding_window is None or seq_len <= sliding_window or query_len <= piece:
        return [_plan_prefill(query_start, query_len, seq_len, block_row, block_size, sliding_window)]
    num_cached = seq_len - query_len
    return [
        _plan_prefill(query_start + j0, min(piece, query_len - j0), num_cached + min(query_len, j0 + piece),
                      block_row, block_size, sliding_window)
        for j0 in range(0, query_len, piece)
    ]


def _plan_prefill(
    query_start: int,
    query_len: int,
    seq_len: int,
    block_row: torch.Tensor,  # [max_blocks]
    block_size: int,
    sliding_window: int | None,
) -> PrefillPlan:
    num_cached = seq_len - query_len
    first_key = 0 if sliding_window is None else max(0, num_cached - (sliding_window - 1))
    first_block = first_key // block_size
    end_block = (seq_len + block_size - 1) // block_size
    kv_len = seq_len - first_key
    mask = None
    # SDPA's is_causal aligns the mask top-left, right only when Q == kv_len.
    if num_cached > 0 or (sliding_window is not None and sliding_window < query_len):
        q_pos = torch.arange(num_cached, seq_len)
        k_pos = torch.arange(first_key, seq_len)
        mask = _causal_mask(q_pos[:, None], k_pos[None, :], sliding_window)  # [Q, kv_len]
    return PrefillPlan(
        query_start=query_start,
        query_end=query_start + query_len,
        block_ids=block_row[first_block:end_block].long(),
        kv_offset=first_key - first_block * block_size,
        kv_len=kv_len,
        mask=mask,
    )


class PagedAttention:
    """The model's attention callable for one step: ``(layer, q, k, v) -> out``.

    q ``[T, Hq, D]``, k and v ``[T, Hkv, D]`` (rotary already applied);
    returns ``[T, Hq, D]``. ``scale`` defaults to ``1/sqrt(D)``. ``kernel``
    runs ``metadata.short`` (required when the metadata has it).
    ``layer_metadata``: the plans of layers whose window is not
    ``metadata``'s, by layer. ``softcap``: soft-cap the scores.
    """

    def __init__(
        self,
        kv_cache: PagedKVCache,
        metadata: AttentionMetadata,
        *,
        scale: float | None = None,
        kernel: PagedAttentionKernel | None = None,
        layer_metadata: dict[int, AttentionMetadata] | None = None,
        softcap: float | None = None,
    ) -> None:
        plans = [metadata, *(layer_metadata or {}).values()]
        if any(plan.short is not None for plan in plans) and kernel is None:
            raise ValueError("metadata indexes short queries for a native kernel, but none was given")
        self.kv_cache = kv_cache
        self.metadata = metadata
        self.layer_metadata = layer_metadata or {}
        self.scale = scale
        self.kernel = kernel
        self.softcap = softcap

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        # Write first (see the module docstring), then read back from the cache.
        # (With KV cache groups each layer's plan has its group's slots and table.)
        metadata = self.layer_metadata.get(layer_idx, self.metadata)
        self.kv_cache.write(layer_idx, k, v, metadata.slot_mapping)
        key_blocks = self.kv_cache.keys(layer_idx)  # [num_blocks, bs, Hkv, D]
        value_blocks = self.kv_cache.values(layer_idx)
        out = torch.empty_like(q)  # [T, Hq, D]
        short = metadata.short
        if short is not None:
            scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5
            self.kernel(
                q.contiguous(), key_blocks, value_blocks, out, short.query_start,
                short.query_len, short.seq_len, short.block_table,
                short.sliding_window, scale, self.softcap,
            )
        for plan in metadata.batched:
            self._attend_batched(plan, q, key_blocks, value_blocks, out)
        for plan in metadata.prefills:
            self._attend_prefill(plan, q, key_blocks, value_blocks, out)
        return out

    def _attend_batched(
        self,
        plan: BatchedPlan,
        q: torch.Tensor,
        key_blocks: torch.Tensor,
        value_blocks: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = key_blocks.shape[2]
        group = num_heads // num_kv_heads
        B, Qmax = plan.num_seqs, plan.max_query_len
        # Fold each KV head's group of query heads into the query axis:
        # [B*Qmax, Hq, D] -> [B, Hkv, Qmax*G, D], row r = j*G + g.
        qb = q.index_select(0, plan.token_index).view(B, Qmax, num_kv_heads, group, head_dim)
        qb = qb.permute(0, 2, 1, 3, 4).reshape(B, num_kv_heads, Qmax * group, head_dim)
        kb = _gather_blocks(key_blocks, plan.block_index, B, q.dtype)  # [B, Hkv, Lpad, D]
        vb = _gather_blocks(value_blocks, plan.block_index, B, q.dtype)
        ob = softcapped_attention(
            qb, kb, vb, attn_mask=plan.folded_mask(group), scale=self.scale, softcap=self.softcap
        )  # [B, Hkv, Qmax*G, D]
        ob = ob.view(B, num_kv_heads, Qmax, group, head_dim).permute(0, 2, 1, 3, 4)
        ob = ob.reshape(B * Qmax, num_heads, head_dim)
        if plan.valid_rows is not None:
            ob = ob.index_select(0, plan.valid_rows)
        out.index_copy_(0, plan.out_index, ob)

    def _attend_prefill(
        self,
        plan: PrefillPlan,
        q: torch.Tensor,
        key_blocks: torch.Tensor,
        value_blocks: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        qs = q[plan.query_start : plan.query_end].transpose(0, 1).unsqueeze(0)  # [1, Hq, Q, D]
        kv = slice(plan.kv_offset, plan.kv_offset + plan.kv_len)
        ks = _gather_blocks(key_blocks, plan.block_ids, 1, q.dtype)[:, :, kv]  # [1, Hkv, K, D]
        vs = _gather_blocks(value_blocks, plan.block_ids, 1, q.dtype)[:, :, kv]
        if self.softcap is not None:
            group = q.shape[1] // ks.shape[1]
            ks, vs = ks.repeat_interleave(group, dim=1), vs.repeat_interleave(group, dim=1)  # [1, Hq, K, D]
            os = softcapped_attention(qs, ks, vs, attn_mask=plan.mask, is_causal=plan.mask is None,
                                      scale=self.scale, softcap=self.softcap)
            out[plan.query_start : plan.query_end] = os[0].transpose(0, 1)
            return
        os = F.scaled_dot_product_attention(
            qs, ks, vs,
            attn_mask=plan.mask,
            is_causal=plan.mask is None,
            scale=self.scale,
            enable_gqa=True,
        )  # [1, Hq, Q, D]
        out[plan.query_start : plan.query_end] = os[0].transpose(0, 1)


def _gather_blocks(
    blocks: torch.Tensor, block_index: torch.Tensor, num_seqs: int, dtype: torch.dtype
) -> torch.Tensor:
    """Blocks ``[num_blocks, bs, Hkv, D]`` picked by ``block_index`` -> ``[B, Hkv, L, D]`` of
    ``dtype`` (a q8_0 cache's bytes decoded: ``kv_quant``)."""
    num_blocks, _, num_kv_heads, stored = blocks.shape
    # Rows of a 2-D view: index_select then copies whole blocks (memcpy), many
    # times faster on CPU than selecting along dim 0 of the 4-D tensor.
    picked = blocks.view(num_blocks, -1).index_select(0, block_index)  # [B*nblk, bs*Hkv*stored]
    picked = picked.view(num_seqs, -1, num_kv_heads, stored)  # [B, L, Hkv, stored]
    if blocks.dtype == kv_quant.Q8_0:
        return kv_quant.decode(picked, dtype).transpose(1, 2)
    return picked.transpose(1, 2).to(dtype)
