"""The persistent batch: one row per request the runner holds, kept between steps.

Rebuilding every step's inputs from Python lists would cost O(total tokens)
of Python work. Instead each request owns a row of preallocated arrays
(its token ids, its block table) that change by small deltas: a sampled
token is one store, a new block is one store. A step's inputs are then a few
vectorized gathers over the rows it schedules.

Rows stay dense: removing a request moves the last row into the hole.

    token_ids[row]    |p0 p1 ... p(P-1)|o0 ... o(k-1)|d0 d1 |  ...unused
                      |<------- num_tokens --------->|drafts| (this step only)
    block_table[row]  |b7 b2 b9 |  ...unused
                      |<-num_blocks->|

With KV cache groups (``cadence.core.kv_cache.groups``) each group has its
own table, ``block_tables[g]``, all of one length per row (a window group's
entries behind its window are the null block or blocks freed since, never
read); block ids come as one list per group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from cadence.sampling_params import SamplingParams

if TYPE_CHECKING:
    from cadence.runner.draft_gate import DraftGate


@dataclass
class RequestState:
    """What the runner remembers about one request, in or out of the batch.

    A preempted request leaves the batch but keeps this state, so it can be
    recomputed from its prompt and the outputs it had already sampled.
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    block_ids: list[int]  # with KV cache groups, one list per group (a tuple)
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    # Prompt positions whose logprobs were already reported (a recompute after
    # preemption must not report them twice).
    num_prompt_logprobs_sent: int = 0
    eos_token_id: int | None = None
    draft_gate: "DraftGate | None" = None  # whether to draft for it (speculative decoding)
    lora_int_id: int = 0  # its LoRA adapter (0: the base model)
    # Mean pooling: the sum of the final hidden states of prompt positions
    # [0, num_pooled), kept across chunks (runner/pooling.py).
    pooled_sum: torch.Tensor | None = None
    num_pooled: int = 0

    @property
    def min_tokens_pending(self) -> bool:
        """Whether EOS and stop tokens must not be sampled yet (min_tokens)."""
        return len(self.output_token_ids) < self.sampling_params.min_tokens

    def stop_ids(self) -> list[int]:
        """The token ids that end this request: its stop ids and EOS."""
        stop_ids = list(self.sampling_params.stop_token_ids)
        if self.eos_token_id is not None:
            stop_ids.append(self.eos_token_id)
        return stop_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class StepInputs:
    """One step's flattened inputs, over the S scheduled requests in batch order.

    Sequence s owns token rows ``query_start_loc[s] : query_start_loc[s+1]``.
    """

    req_ids: list[str]  # [S]
    rows: np.ndarray  # [S] batch rows
    num_scheduled: np.ndarray  # [S]
    num_computed: np.ndarray  # [S] before this step
    num_drafts: np.ndarray  # [S] speculative tokens at the end of each query
    query_start_loc: np.ndarray  # [S + 1]
    seq_lens: np.ndarray  # [S] num_computed + num_scheduled
    does_sample: np.ndarray  # [S] bool: reaches the end of its known tokens (pooling requests never)
    pools: np.ndarray  # [S] bool: a pooling request (embeddings), which samples nothing
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    block_table: torch.Tensor  # [S, max_blocks] int32
    # Token rows whose logits get sampled: for each sampling request, its last
    # 1 + num_drafts rows (the drafts' verification and the bonus token).
    logits_indices: torch.Tensor  # [N] int64
    # KV cache groups: each group's slot of every token and block table (group 0's are
    # slot_mapping and block_table); None with one group.
    group_slot_mappings: torch.Tensor | None = None  # [G, T] int64
    group_block_tables: torch.Tensor | None = None  # [G, S, max_blocks] int32

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])


class InputBatch:
    """Rows of per-request arrays, preallocated for ``max_num_reqs`` requests."""

    def __init__(
        self, *, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int, block_size: int,
        num_kv_cache_groups: int = 1,
    ) -> None:
        self.block_size = block_size
        self.num_groups = num_kv_cache_groups
        self.max_model_len = max_model_len
        # One spare column: a step's bonus token may land at index max_model_len.
        self.token_ids = np.zeros((max_num_reqs, max_model_len + 1), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)  # known (no drafts)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_tables = np.zeros((num_kv_cache_groups, max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.block_table = self.block_tables[0]  # [max_num_reqs, max_blocks] (a view)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.pools = np.zeros(max_num_reqs, dtype=bool)  # pooling requests (sample nothing)
        self.states: list[RequestState] = []  # row -> request
        self.req_id_to_row: dict[str, int] = {}

    @property
    def num_reqs(self) -> int:
        return len(self.states)

    @property
    def max_num_reqs(self) -> int:
        return self.token_ids.shape[0]

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.req_id_to_row

    # ------------------------------------------------------------ rows

    def add(self, state: RequestState) -> int:
        """Give ``state`` the next free row; returns the row."""
        if self.num_reqs >= self.max_num_reqs:
            raise RuntimeError(f"input batch is full ({self.max_num_reqs} requests)")
        row = self.num_reqs
        self.states.append(state)
        self.req_id_to_row[state.req_id] = row
        tokens = state.prompt_token_ids + state.output_token_ids
        self.token_ids[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_computed_tokens[row] = state.num_computed_tokens
        self.num_blocks[row] = 0
        self.pools[row] = state.sampling_params.pooling is not None
        self.append_block_ids(row, state.block_ids, mirror_only=True)
        return row

    def remove(self, req_id: str) -> None:
        """Drop a request's row; the last row moves into the hole (rows stay dense)."""
        row = self.req_id_to_row.pop(req_id)
        last = self.num_reqs - 1
        moved = self.states.pop()
        if row != last:
            self.states[row] = moved
            self.req_id_to_row[moved.req_id] = row
            self._copy_row(last, row)

    def _copy_row(self, src: int, dst: int) -> None:
        num_tokens, num_blocks = self.num_tokens[src], self.num_blocks[src]
        self.token_ids[dst, :num_tokens] = self.token_ids[src, :num_tokens]
        self.block_tables[:, dst, :num_blocks] = self.block_tables[:, src, :num_blocks]
        self.num_tokens[dst] = num_tokens
        self.num_blocks[dst] = num_blocks
        self.num_computed_tokens[dst] = self.num_computed_tokens[src]
        self.pools[dst] = self.pools[src]

    # ------------------------------------------------------------ deltas

    def append_block_ids(
        self, row: int, block_ids: list[int], *, mirror_only: bool = False
    ) -> None:
        """Blocks appended to the request's list (``mirror_only``: already in it);
        with KV cache groups, one list per group, all of one length."""
        groups = block_ids if self.num_groups > 1 else (block_ids,)
        if not groups[0]:
            return
        start = self.num_blocks[row]
        end = start + len(groups[0])
        if end > self.block_table.shape[1]:
            raise RuntimeError(
                f"request {self.states[row].req_id} needs {end} blocks, "
                f"the block table holds {self.block_table.shape[1]}"
            )
        for g, ids in enumerate(groups):
            self.block_tables[g, row, start:end] = ids
        self.num_blocks[row] = end
        if not mirror_only:
            if self.num_groups > 1:
                for held, ids in zip(self.states[row].block_ids, groups):
                    held.extend(ids)
            else:
                self.states[row].block_ids.extend(block_ids)

    def replace_block_ids(self, row: int, block_ids: list[int]) -> None:
        """The request's whole block list is new (it was preempted and resumed)."""
        self.states[row].block_ids = tuple([] for _ in block_ids) if self.num_groups > 1 else []
        self.num_blocks[row] = 0
        self.append_block_ids(row, block_ids)

    def append_token_ids(self, row: int, token_ids: list[int]) -> None:
        """Tokens sampled for the request (or sent by the scheduler) become known."""
        start = self.num_tokens[row]
        self.token_ids[row, start : start + len(token_ids)] = token_ids
        self.num_tokens[row] = start + len(token_ids)
        self.states[row].output_token_ids.extend(token_ids)

    def set_num_computed_tokens(self, row: int, num_computed: int) -> None:
        self.num_computed_tokens[row] = num_computed
        self.states[row].num_computed_tokens = num_computed

    def known_token_ids(self, row: int) -> np.ndarray:
        """Prompt + outputs of a row, ``[num_tokens]`` (a view)."""
        return self.token_ids[row, : self.num_tokens[row]]

    # ------------------------------------------------------------ step inputs

    def prepare_inputs(
        self, num_scheduled_tokens: dict[str, int], spec_tokens: dict[str, list[int]]
    ) -> StepInputs:
        """Flatten the scheduled requests (in row order) into one step's inputs."""
        rows = np.sort(np.fromiter(
            (self.req_id_to_row[r] for r in num_scheduled_tokens), dtype=np.int64,
            count=len(num_scheduled_tokens),
        ))  # [S]
        req_ids = [self.states[row].req_id for row in rows]
        num_scheduled = np.array([num_scheduled_tokens[r] for r in req_ids], dtype=np.int64)
        num_drafts = self._write_drafts(rows, req_ids, spec_tokens)
        num_computed = self.num_computed_tokens[rows]
        seq_lens = num_computed + num_scheduled
        query_start_loc = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(num_scheduled, out=query_start_loc[1:])
        pools = self.pools[rows]
        does_sample = (seq_lens - num_drafts >= self.num_tokens[rows]) & ~pools

        # Token t belongs to sequence seq_of[t], at position num_computed + (t - start).
        seq_of = np.repeat(np.arange(len(rows)), num_scheduled)  # [T]
        row_of = rows[seq_of]  # [T]
        offsets = np.arange(len(seq_of)) - query_start_loc[seq_of]
        positions = num_computed[seq_of] + offsets  # [T]
        input_ids = self.token_ids[row_of, positions]  # [T]
        block_of = self.block_table[row_of, positions // self.block_size]  # [T]
        slot_mapping = block_of.astype(np.int64) * self.block_size + positions % self.block_size
        group_slots = group_tables = None
        if self.num_groups > 1:
            group_blocks = self.block_tables[:, row_of, positions // self.block_size]  # [G, T]
            group_slots = torch.from_numpy(np.ascontiguousarray(
                group_blocks.astype(np.int64) * self.block_size + positions % self.block_size))
            group_tables = torch.from_numpy(np.ascontiguousarray(self.block_tables[:, rows]))
        return StepInputs(
            req_ids=req_ids,
            rows=rows,
            num_scheduled=num_scheduled,
            num_computed=num_computed,
            num_drafts=num_drafts,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            does_sample=does_sample,
            pools=pools,
            input_ids=torch.from_numpy(input_ids),
            positions=torch.from_numpy(positions),
            slot_mapping=torch.from_numpy(slot_mapping),
            block_table=torch.from_numpy(self.block_table[rows]),
            logits_indices=torch.from_numpy(
                _logits_indices(query_start_loc, num_drafts, does_sample)
            ),
            group_slot_mappings=group_slots,
            group_block_tables=group_tables,
        )

    def _write_drafts(
        self, rows: np.ndarray, req_ids: list[str], spec_tokens: dict[str, list[int]]
    ) -> np.ndarray:
        """Put this step's draft tokens after each row's known tokens; [S] counts."""
        num_drafts = np.zeros(len(rows), dtype=np.int64)
        if not spec_tokens:
            return num_drafts
        for s, (row, req_id) in enumerate(zip(rows, req_ids)):
            drafts = spec_tokens.get(req_id)
            if drafts:
                start = self.num_tokens[row]
                self.token_ids[row, start : start + len(drafts)] = drafts
                num_drafts[s] = len(drafts)
        return num_drafts


def _logits_indices(
    query_start_loc: np.ndarray, num_drafts: np.ndarray, does_sample: np.ndarray
) -> np.ndarray:
    """Token rows to sample from: the last 1 + num_drafts rows of each sampling sequence."""
    ends = query_start_loc[1:][does_sample]  # [N_seqs]
    if not num_drafts.any():
        return ends - 1
    counts = 1 + num_drafts[does_sample]
    starts = ends - counts
    within = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(starts, counts) + within
