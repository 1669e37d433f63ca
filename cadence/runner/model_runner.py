"""``ModelRunner``: executes one ``SchedulerOutput`` on a real model.

One step, start to end:

    SchedulerOutput
      -> update the persistent batch (new, finished, preempted, resumed requests;
         appended blocks; computed-token counts)
      -> flatten the scheduled requests into input ids, positions, slots
      -> model forward with paged attention (KV written, then read, per layer)
      -> logits only at the rows that sample (and at draft positions)
      -> sample; verify drafts (accept the longest prefix the sampler agrees with)
      -> logprobs, prompt logprobs, pooled states (embeddings), new drafts for the next step
      -> ModelRunnerOutput

The runner never sees a ``Request``: it keeps its own ``RequestState`` per
request and appends every token it samples, so a decode step only needs the
scheduler's "one more token" to know what to feed.
"""

from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from cadence.core.runner_api import RunnerBase
from cadence.core.outputs import LogprobsLists, ModelRunnerOutput
from cadence.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from cadence.runner.attention import AttentionMetadata, PagedAttention
from cadence.runner.batch_invariance import (
    BatchInvariance, ForwardInputs, forward_inputs, pad_step, resolve_batch_invariance,
)
from cadence.runner.fused_decoder import FusedDecoder
from cadence.kernels.triton_fused_ops import TritonFusedOps
from cadence.runner.draft_gate import DraftCostModel, DraftGate
from cadence.runner.gpu_attention import StepStager, TritonPagedAttention
from cadence.runner.grammar_mask import revive_dead_rows
from cadence.runner.input_batch import InputBatch, RequestState, StepInputs
from cadence.runner.host_memory import keep_freed_memory, return_freed_memory
from cadence.runner.kv_cache import PagedKVCache
from cadence.runner.kv_transfer.base import KVConnectorWorker, take_connector_output
from cadence.runner.cpu_paths import CpuPaths, choose_cpu_paths
from cadence.runner.lora import LoRAManager
from cadence.models.layers import slice_feed_forwards
from cadence.models.row_padding import pad_rows_product
from cadence.models.step_buffer import StepBuffer
from cadence.runner.ngram_drafter import NgramDrafter
from cadence.runner.pooling import Pooler
from cadence.runner.sampler import Sampler, compute_prompt_logprobs
from cadence.runner.sampling_metadata import SamplingMetadata, make_generator
from cadence.runner.seeded_streams import SeededStreams
from cadence.runner.step_sampling import (
    accept_drafts, apply_grammar, logprobs_lists, suppress_stops_before_min_tokens,
)

if TYPE_CHECKING:
    from cadence.config import LoRAConfig, SpeculativeConfig
    from cadence.core.kv_cache.groups import KVCacheLayout
    from cadence.core.request import LoRARequest
    from cadence.models.config import ModelConfig
    from cadence.models.llama import LlamaForCausalLM

# On the CPU a feed-forward of more rows than this (a long prefill chunk) runs in even
# slices of at most this many: its gate|up and activation rows (3 x intermediate_size
# floats a row) stay a few MiB at any chunk size, where a 2,000-token prompt's took
# ~50 MiB of peak RSS on the default model (llama.cpp computes in micro-batches of 512
# tokens too). The products' throughput is flat past a few hundred rows.
MLP_ROW_SLICE = 512


class ModelRunner(RunnerBase):
    """Owns the KV cache, the persistent batch and the per-request state."""

    def __init__(
        self,
        model: "LlamaForCausalLM",
        model_config: "ModelConfig",
        *,
        block_size: int,
        num_blocks: int,
        dtype: torch.dtype,
        max_num_seqs: int,
        max_model_len: int,
        device: str | torch.device = "cpu",
        speculative_config: "SpeculativeConfig | None" = None,
        cpu_paths: CpuPaths | None = None,
        sliding_window: int | None = None,
        attention_backend: str | None = None,
        lora_config: "LoRAConfig | None" = None,
        kv_connector: KVConnectorWorker | None = None,
        kv_cache_dtype: torch.dtype | None = None,
        batch_invariant: str = "off",
        kv_cache_layout: "KVCacheLayout | None" = None,
    ) -> None:
        """``cpu_paths`` (on a CPU device): which fast paths to take (packed oneDNN
        matmuls, C kernels); by default what ``choose_cpu_paths`` finds this CPU
        can do, ``CpuPaths.plain()`` for plain PyTorch. ``sliding_window``: the
        attention window (default: the model's own). ``attention_backend``:
        ``triton`` (the default on a GPU; on the CPU only under
        ``TRITON_INTERPRET=1``, for tests) or ``cpu`` (the default on the CPU).
        ``lora_config``: serve LoRA adapters (``add_lora``; requests name theirs).
        ``kv_connector``: the worker side of a KV connector, called around
        every step's forward (see ``cadence.runner.kv_transfer.base``).
        ``kv_cache_dtype``: the KV cache's element type (default ``dtype``).
        ``batch_invariant``: auto, on or off (``cadence.runner.batch_invariance``;
        ``batch_invariance`` holds what it resolved to).
        ``kv_cache_layout``: KV cache groups (``cadence.core.kv_cache.groups``):
        each group's layers read its block table (the CPU backend only)."""
        self.model = model
        self.model_config = model_config
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = torch.device(device)
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype or dtype
        self.sliding_window = sliding_window or model_config.sliding_window
        self.attention_backend = attention_backend or ("triton" if self.device.type == "cuda" else "cpu")
        if self.attention_backend not in ("triton", "cpu"):
            raise ValueError(f"attention_backend: must be triton or cpu, got {attention_backend!r}")
        if self.attention_backend == "cpu" and self.device.type != "cpu":
            raise ValueError("attention_backend: the cpu backend runs on the CPU only")
        # Layers that ignore the window (Gemma's global layers) read a plan of their own.
        self.full_attention_layers = model_config.full_attention_layers if self.sliding_window else ()
        if self.attention_backend == "triton":
            _check_triton_supports(model_config, self.full_attention_layers)
        # Several groups: each reads its own table (one group reads the step's only table).
        self.kv_cache_layout = kv_cache_layout if kv_cache_layout and kv_cache_layout.num_groups > 1 else None
        if self.kv_cache_layout is not None:
            if self.attention_backend != "cpu":
                raise ValueError("kv_cache_layout: KV cache groups run on the CPU backend only")
            if kv_connector is not None:
                raise ValueError("kv_cache_layout: a KV connector moves one table per request, "
                                 "not one per KV cache group")
        num_spec = speculative_config.num_speculative_tokens if speculative_config else 0
        self.max_blocks_per_req = -(-(max_model_len + num_spec) // block_size)
        self.input_batch = InputBatch(
            max_num_reqs=max_num_seqs,
            max_model_len=max_model_len,
            max_blocks_per_req=self.max_blocks_per_req,
            block_size=block_size,
            num_kv_cache_groups=self.kv_cache_layout.num_groups if self.kv_cache_layout else 1,
        )
        self.group = model_config.num_attention_heads // model_config.num_key_value_heads
        self.stager = None
        self.decode_graphs = None  # see capture_cuda_graphs
        if self.attention_backend == "triton":
            self.stager = StepStager(self.device, self.group, model_config.num_key_value_heads,
                                     self.sliding_window)
        self.kv_connector = kv_connector
        self.batch_invariance = BatchInvariance.off("by request")  # resolved at the end
        self.fused_decoder: FusedDecoder | None = None  # see _use_cpu_paths
        self.fused_decoder_note: str | None = None  # for the start-up log
        if self.device.type == "cpu":
            return_freed_memory()  # the load's leftovers, before the cache takes its place
        self.allocate_kv_cache(num_blocks)
        self.requests: dict[str, RequestState] = {}  # in the batch or preempted
        self.seeded = SeededStreams()  # seeded requests' generators, rewound after a discarded step
        self.sampler = Sampler()
        self.pooler = Pooler(model_config.pooling_type)  # embedding requests
        self.drafter = _make_drafter(speculative_config)
        # Drafting's floor: fixed by the option, else measured (the break-even acceptance).
        self.draft_acceptance_floor = speculative_config.draft_acceptance_floor if speculative_config else None
        self.draft_costs = (DraftCostModel() if self.drafter is not None and self.draft_acceptance_floor is None
                            else None)
        self.attention_kernel = None
        self.cpu_paths = None
        self.lora = LoRAManager(model, lora_config, dtype, self.device) if lora_config else None
        self._failed_requests: dict[str, str] = {}  # this step's, for ModelRunnerOutput
        if self.device.type == "cpu":
            keep_freed_memory()
            self.model.logits_buffer = StepBuffer()  # a step's logits are read within the step
            slice_feed_forwards(self.model, MLP_ROW_SLICE)
            self.cpu_paths = choose_cpu_paths(dtype) if cpu_paths is None else cpu_paths
            self._use_cpu_paths(self.cpu_paths, dtype)
        if self.attention_backend == "triton":
            # Norms, rotary and SiLU-mul as one Triton kernel each (C ones on the CPU path).
            self.model.use_fused_ops(TritonFusedOps())
        self._resolve_batch_invariance(batch_invariant)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """(Re)allocate the paged cache for ``num_blocks`` scheduler blocks.

        The Triton backend gets one block more, the *scratch block*
        (``self.scratch_block``): padded rows of CUDA graphs and profiling runs
        write there, never into a block the scheduler hands out.
        """
        if self.decode_graphs is not None:
            raise RuntimeError("allocate_kv_cache: the CUDA graphs hold the old cache")
        self.kv_cache = None  # free the old one first
        extra = 1 if self.attention_backend == "triton" else 0
        self.scratch_block = num_blocks if extra else None
        self.kv_cache = PagedKVCache.for_model(
            self.model_config, num_blocks=num_blocks + extra, block_size=self.block_size,
            dtype=self.kv_cache_dtype, device=self.device, layout=self.kv_cache_layout,
        )
        if self.kv_connector is not None:
            self.kv_connector.register_kv_caches(self.kv_cache)
        if self.fused_decoder is not None:  # it points into the old cache
            self._build_fused_decoder()

    def attach_kv_connector(self, kv_connector: KVConnectorWorker) -> None:
        """Call ``kv_connector`` around every step from now on (between steps only)."""
        self.kv_connector = kv_connector
        kv_connector.register_kv_caches(self.kv_cache)

    def shutdown(self) -> None:
        """Stop the KV connector's threads (the engine core calls this last)."""
        if self.kv_connector is not None:
            self.kv_connector.shutdown()

    def capture_cuda_graphs(self, capture_sizes: list[int]) -> None:
        """Capture the decode forward for each batch size (CUDA, Triton backend only)."""
        from cadence.runner.cuda_graphs import DecodeGraphs

        if self.device.type != "cuda":
            raise ValueError("capture_cuda_graphs: CUDA graphs need a CUDA device")
        if self.model_config.num_experts:
            raise ValueError("capture_cuda_graphs: mixture-of-experts models run eagerly "
                             "(grouping tokens by expert reads counts on the host)")
        graphs = DecodeGraphs(
            self.model, self.kv_cache, capture_sizes=capture_sizes,
            max_blocks_per_req=self.max_blocks_per_req, group=self.group,
            num_kv_heads=self.model_config.num_key_value_heads, num_sms=self.stager.num_sms,
            sliding_window=self.sliding_window, scratch_block=self.scratch_block,
        )
        with torch.inference_mode():
            graphs.capture()
        self.decode_graphs = graphs

    def profile_run(self, num_tokens: int, num_seqs: int) -> None:
        """The largest step the scheduler may send, on dummy inputs (Triton backend).

        One sequence of ``num_tokens`` tokens through every layer, every key
        and value written to the scratch block, then logits and log-softmax
        for ``num_seqs`` rows: what a memory profile needs to see at its peak.
        Touches no block the scheduler owns and no request state.
        """
        if self.stager is None:
            raise ValueError("profile_run: needs the Triton attention backend")
        from cadence.kernels.triton_attention import TileShape, tiles_of
        from cadence.runner.gpu_attention import GpuAttentionMetadata

        device, bs = self.device, self.block_size
        num_tokens = max(1, num_tokens)
        positions = torch.arange(num_tokens, device=device) % self.max_model_len
        slots = self.scratch_block * bs + torch.arange(num_tokens, device=device) % bs
        shape = TileShape.choose(self.group, num_tokens)
        tile_seq, tile_q_start = tiles_of([num_tokens], shape.block_q)
        metadata = GpuAttentionMetadata(
            slot_mapping=slots,
            query_start_loc=torch.tensor([0, num_tokens], device=device),
            seq_lens=torch.tensor([num_tokens], device=device),
            block_table=torch.full((1, -(-num_tokens // bs)), self.scratch_block, device=device),
            tile_seq=tile_seq.to(device), tile_q_start=tile_q_start.to(device),
            shape=shape, sliding_window=self.sliding_window,
        )
        with torch.inference_mode():
            input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
            hidden = self.model(input_ids, positions, TritonPagedAttention(self.kv_cache, metadata))
            rows = hidden[: min(num_seqs, num_tokens)]
            self.model.compute_logits(rows).log_softmax(dim=-1).argmax(dim=-1)

    def _use_cpu_paths(self, paths: CpuPaths, dtype: torch.dtype) -> None:
        if paths.pack_weights:
            self.model.pack_weights()
        if paths.fused_ops is not None and paths.fused_ops.supports(dtype):
            self.model.use_fused_ops(paths.fused_ops)
        if paths.fused_ops is not None:  # (logits are float32 whatever the model's dtype)
            self.sampler = Sampler(argmax=paths.fused_ops.argmax)
        self.model.use_quant_kernel(paths.quant_matmul)
        kernel = paths.attention_kernel
        fits = kernel is not None and kernel.supports(dtype, self.kv_cache_dtype)
        self.attention_kernel = kernel if fits else None
        self._build_fused_decoder()

    def _resolve_batch_invariance(self, option: str) -> None:
        """The batch-invariant mode this runner computes in (ValueError for ``on`` where none exists)."""
        self.batch_invariance = resolve_batch_invariance(
            option, self.model, device=self.device, dtype=self.dtype,
            attention_kernel=self.attention_kernel is not None, lora=self.lora is not None,
            num_experts=self.model_config.num_experts)
        if self.lora is not None:
            self.lora.mapping.min_rows = self.batch_invariance.lora_min_rows
        if self.batch_invariance.quant_rows_apart:  # the model's products on GGUF blocks, and the C loop's
            self.model.use_quant_kernel(self.model.quant_kernel.rows_apart())
            self._build_fused_decoder()

    def _build_fused_decoder(self) -> None:
        """The C loop through all layers for decode steps, where the model and paths allow it."""
        paths = self.cpu_paths
        if paths is None or self.lora is not None:
            self.fused_decoder, self.fused_decoder_note = None, None
            return
        self.fused_decoder, self.fused_decoder_note = FusedDecoder.build(
            paths.decoder_stack_arch, self.model, self.model_config, self.kv_cache,
            uses_fused_ops=paths.fused_ops is not None and paths.fused_ops.supports(self.dtype),
            uses_attention_kernel=self.attention_kernel is not None,
            full_attention_layers=tuple(self.full_attention_layers), layout=self.kv_cache_layout,
        )

    # ------------------------------------------------------------ the step

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and report what each scheduled request sampled (and
        what the KV connector, if any, finished moving)."""
        self._update_states(scheduler_output)
        connector = self.kv_connector
        if connector is None:
            return self._execute_scheduled(scheduler_output)
        connector.start_load_kv(scheduler_output.kv_connector_metadata)
        output = self._execute_scheduled(scheduler_output)
        connector.wait_for_save()
        output.kv_connector_output = take_connector_output(connector, scheduler_output.finished_req_ids)
        return output

    def _execute_scheduled(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """The forward and sampling of the scheduled tokens."""
        failed, self._failed_requests = self._failed_requests or None, {}
        if not scheduler_output.total_num_scheduled_tokens:
            return ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[],
                                     failed_requests=failed)
        if len(self.seeded):
            self.seeded.note_step(scheduler_output.num_scheduled_tokens, self.requests)
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        step = self.input_batch.prepare_inputs(scheduler_output.num_scheduled_tokens, spec_tokens)
        if self.lora is not None:
            self._set_lora_step(step)
        start = time.perf_counter()
        with torch.inference_mode():
            hidden, logits_indices = self._forward(step)  # [T, hidden], [N]
            sampled, logprobs = self._sample(step, hidden, logits_indices, scheduler_output)
            prompt_logprobs = self._prompt_logprobs(step, hidden)
            pooled = self.pooler.pool(step, hidden, self.input_batch.states)
        if self.draft_costs is not None:  # (sampling ended in .tolist(): the step is done)
            self.draft_costs.observe_step(scheduler_output.total_num_scheduled_tokens,
                                          sum(map(len, sampled)), time.perf_counter() - start)
        for row, token_ids in zip(step.rows, sampled):
            if token_ids:
                self.input_batch.append_token_ids(row, token_ids)
        return ModelRunnerOutput(
            req_ids=step.req_ids,
            req_id_to_index={req_id: i for i, req_id in enumerate(step.req_ids)},
            sampled_token_ids=sampled,
            spec_token_ids=self._propose_drafts(step, sampled),
            logprobs=logprobs,
            prompt_logprobs_dict=prompt_logprobs,
            pooler_output=pooled,
            failed_requests=failed,
        )

    def _forward(self, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states of the step's tokens, and the rows to sample from (on the device)."""
        if self.stager is not None:
            return self._forward_triton(step)
        inputs = forward_inputs(step)
        invariance = self.batch_invariance
        if invariance.enabled:  # every product on at least min_rows rows
            inputs = pad_step(inputs, invariance.min_rows)
            if inputs.num_padding and self.lora is not None:
                self._set_lora_step(step, inputs.num_padding)
        group_plans = self._plan_groups(inputs) if self.kv_cache_layout is not None else None
        metadata = group_plans[0] if group_plans else self._plan_attention(inputs, self.sliding_window)
        # (Pieces of long queries on the C kernel are not the one-call decoder's: decode steps only.)
        if self.fused_decoder is not None and self.fused_decoder.covers(metadata) and not metadata.native_long:
            hidden = self.fused_decoder.forward(inputs.input_ids, inputs.positions, metadata, group_plans)
            return hidden[:step.num_tokens], step.logits_indices
        layer_metadata = self._layer_plans(inputs, group_plans)
        config = self.model_config
        attention = PagedAttention(self.kv_cache, metadata, kernel=self.attention_kernel,
                                   layer_metadata=layer_metadata, scale=config.attention_scale,
                                   softcap=config.attn_logit_softcapping)
        device = self.device
        hidden = self.model(inputs.input_ids.to(device), inputs.positions.to(device), attention)
        return hidden[:step.num_tokens], step.logits_indices.to(device)

    def _layer_plans(self, inputs: ForwardInputs, group_plans: list[AttentionMetadata] | None
                     ) -> dict[int, AttentionMetadata]:
        """The plans of layers that do not read the step's first plan: with KV cache
        groups, each layer its group's; else the full-attention layers (Gemma's global ones)."""
        if group_plans is not None:
            return {layer: group_plans[g] for layer, g in self.kv_cache_layout.group_of_layer().items()}
        if not self.full_attention_layers:
            return {}
        return dict.fromkeys(self.full_attention_layers, self._plan_attention(inputs, None))

    def _plan_groups(self, inputs: ForwardInputs) -> list[AttentionMetadata]:
        """One plan per KV cache group: its table, its slots, its window (the first
        group's plan read through the others' tables where that is one gather)."""
        tables, slots = inputs.group_block_tables, inputs.group_slot_mappings
        plans = []
        for g, group in enumerate(self.kv_cache_layout.groups):
            plan = plans[0].through(tables[g], slots[g], group.sliding_window) if plans else None
            if plan is None:
                plan = self._plan_attention(inputs, group.sliding_window, tables[g], slots[g])
            plans.append(plan.to(self.device))
        return plans

    def _plan_attention(
        self, inputs: ForwardInputs, sliding_window: int | None,
        block_table: torch.Tensor | None = None, slot_mapping: torch.Tensor | None = None,
    ) -> AttentionMetadata:
        """The step's attention plan for layers attending within ``sliding_window``
        (through ``block_table`` and ``slot_mapping``: a KV cache group's; default the step's)."""
        return AttentionMetadata.build(
            inputs.query_start_loc,
            inputs.seq_lens,
            inputs.block_table if block_table is None else block_table,
            inputs.slot_mapping if slot_mapping is None else slot_mapping,
            self.block_size,
            sliding_window,
            native_short_queries=self.attention_kernel is not None,
            native_long_queries=self.batch_invariance.enabled,
        ).to(self.device)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, V] of hidden rows [N, H]: the LM head's product, on at least
        ``min_rows`` rows in the batch-invariant mode (1 otherwise: as it comes)."""
        return pad_rows_product(self.model.compute_logits, hidden, self.batch_invariance.min_rows)

    def _forward_triton(self, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        staged = self.stager.stage(step)  # one host-to-device copy
        graphs = self.decode_graphs
        num_drafts = int(step.num_drafts.sum())
        if graphs is not None and not num_drafts and graphs.can_run(len(step.req_ids), int(step.num_scheduled.max())):
            return graphs.run(staged), staged.logits_indices
        attention = TritonPagedAttention(self.kv_cache, staged.attention)
        return self.model(staged.input_ids, staged.positions, attention), staged.logits_indices

    # ------------------------------------------------------------ batch updates

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
            self.seeded.forget(req_id)
            if req_id in batch:
                batch.remove(req_id)
        for req_id in scheduler_output.preempted_req_ids:
            if req_id in batch:
                batch.remove(req_id)  # state kept: it comes back resumed
        if self.lora is not None and scheduler_output.finished_req_ids:
            self.lora.collect(self._loras_in_use())
        for new_req in scheduler_output.scheduled_new_reqs:
            self._add_new_request(new_req)
        cached = scheduler_output.scheduled_cached_reqs
        for i in range(cached.num_reqs):
            self._update_cached_request(cached, i)

    def _add_new_request(self, new_req: NewRequestData) -> None:
        if new_req.req_id in self.input_batch:
            self.input_batch.remove(new_req.req_id)  # sent anew: rebuild from scratch
        state = RequestState(
            req_id=new_req.req_id,
            prompt_token_ids=list(new_req.prompt_token_ids),
            sampling_params=new_req.sampling_params,
            generator=self._generator_for(new_req),
            block_ids=_copy_block_ids(new_req.block_ids),
            num_computed_tokens=new_req.num_computed_tokens,
            output_token_ids=list(new_req.output_token_ids),
            eos_token_id=new_req.eos_token_id,
            draft_gate=self._draft_gate_for(new_req.req_id),
            lora_int_id=self._lora_id_of(new_req),
        )
        self.requests[new_req.req_id] = state
        self.input_batch.add(state)

    # ------------------------------------------------------------ LoRA

    def _set_lora_step(self, step: StepInputs, num_padding: int = 0) -> None:
        """Each token's adapter for this step; ``num_padding`` rows that repeat the
        last token (``pad_step``) take its adapter."""
        states = self.input_batch.states
        seq_lora_ids = np.fromiter((states[row].lora_int_id for row in step.rows),
                                   dtype=np.int64, count=len(step.rows))
        num_scheduled = step.num_scheduled
        if num_padding:
            seq_lora_ids = np.append(seq_lora_ids, np.repeat(seq_lora_ids[-1:], num_padding))
            num_scheduled = np.append(num_scheduled, np.ones(num_padding, dtype=num_scheduled.dtype))
        self.lora.set_step(seq_lora_ids, num_scheduled)

    def add_lora(self, lora_request: "LoRARequest") -> bool:
        """Load an adapter (once; ValueError naming what is wrong with it). True: loaded now."""
        if self.lora is None:
            raise ValueError("lora_request: LoRA is not enabled on this engine (enable_lora)")
        return self.lora.add_lora(lora_request, self._loras_in_use())

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unload an adapter (once no request uses it); False if it was not loaded."""
        return self.lora is not None and self.lora.remove_lora(lora_int_id, self._loras_in_use())

    def list_loras(self) -> list[int]:
        return self.lora.lora_ids if self.lora is not None else []

    def _loras_in_use(self) -> set[int]:
        return {state.lora_int_id for state in self.requests.values() if state.lora_int_id}

    def _lora_id_of(self, new_req: NewRequestData) -> int:
        """The request's adapter id, its adapter loaded again if it was unloaded
        meanwhile. If that fails (its files are gone), the row runs on the base
        model this step and the request is reported failed: the engine ends it."""
        lora = new_req.lora_request
        if lora is None:
            return 0
        try:
            self.add_lora(lora)
        except (ValueError, OSError) as error:
            self._failed_requests[new_req.req_id] = (
                f"lora_request: adapter {lora.lora_name!r} was unloaded and cannot be loaded "
                f"again from {lora.lora_path!r}: {error}")
            return 0
        return lora.lora_int_id

    def _draft_gate_for(self, req_id: str) -> DraftGate | None:
        """A request sent anew after preemption keeps its gate (its acceptance so far)."""
        if self.drafter is None:
            return None
        previous = self.requests.get(req_id)
        if previous is not None and previous.draft_gate is not None:
            return previous.draft_gate
        return DraftGate()

    def _draft_floor(self) -> float:
        """The acceptance rate a request's drafts need now to be worth drafting."""
        if self.draft_costs is not None:
            return self.draft_costs.break_even_acceptance()
        return self.draft_acceptance_floor or 0.0

    def _generator_for(self, new_req: NewRequestData) -> torch.Generator | None:
        """The request's own generator when it has a seed.

        A request sent anew after preemption keeps the generator it had, so
        its seeded stream goes on instead of restarting; sent anew after
        steps the engine discarded, the generator goes back to where the
        first of them found it (``seeded_streams``).
        """
        seed = new_req.sampling_params.seed
        req_id = new_req.req_id
        if seed is None:
            self.seeded.forget(req_id)
            return None
        old = self.requests.get(req_id)
        if old is not None and old.generator is not None and old.sampling_params == new_req.sampling_params:
            self.seeded.rewind(req_id, len(new_req.output_token_ids))
            return old.generator
        self.seeded.forget(req_id)
        generator = make_generator(seed, self.device)
        self.seeded.track(req_id, generator)
        return generator

    def _update_cached_request(self, cached: CachedRequestData, i: int) -> None:
        req_id, num_computed = cached.req_ids[i], cached.num_computed_tokens[i]
        state = self.requests[req_id]
        batch = self.input_batch
        row = batch.req_id_to_row.get(req_id)
        if cached.resumed_from_preemption[i]:
            # Its old blocks were freed; it recomputes into these from num_computed.
            if row is None:
                state.block_ids = _copy_block_ids(cached.new_block_ids[i])
                state.num_computed_tokens = num_computed
                row = batch.add(state)
            else:
                batch.replace_block_ids(row, cached.new_block_ids[i])
        elif row is None:
            _extend_block_ids(state.block_ids, cached.new_block_ids[i])
            row = batch.add(state)
        else:
            batch.append_block_ids(row, cached.new_block_ids[i])
        batch.set_num_computed_tokens(row, num_computed)
        if cached.new_token_ids and cached.new_token_ids[i]:
            self._absorb_sent_tokens(row, state, num_computed, cached.new_token_ids[i])

    def _absorb_sent_tokens(
        self, row: int, state: RequestState, num_computed: int, token_ids: list[int]
    ) -> None:
        """Tokens the scheduler sent because the runner could not know them.

        They end at position ``num_computed + len(token_ids)``; only the tail
        the runner does not hold yet is appended.
        """
        num_new = num_computed + len(token_ids) - state.num_tokens
        if num_new > 0:
            self.input_batch.append_token_ids(row, token_ids[-num_new:])

    # ------------------------------------------------------------ sampling

    def _sample(
        self, step: StepInputs, hidden: torch.Tensor, logits_indices: torch.Tensor,
        scheduler_output: SchedulerOutput,
    ) -> tuple[list[list[int]], LogprobsLists | None]:
        """Tokens per scheduled request ([] for a mid-prompt chunk), and their logprobs.

        Logits rows come in groups, one per sampling request: 1 + its number
        of drafts, row j being the target's choice after drafts[:j]. The
        grammar bitmask, if any, applies first.
        """
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        sampled: list[list[int]] = [[] for _ in step.req_ids]
        seqs = np.flatnonzero(step.does_sample).tolist()
        if not seqs:
            return sampled, None
        logits = self._logits(hidden.index_select(0, logits_indices))  # [N, V]
        drafts = [spec_tokens.get(step.req_ids[s], []) for s in seqs]
        states = [self.input_batch.states[step.rows[s]] for s in seqs]
        metadata = self._sampling_metadata(states, drafts)
        group_sizes = [1 + len(d) for d in drafts]
        structured = scheduler_output.grammar_bitmask is not None
        if structured:
            seq_req_ids = [step.req_ids[s] for s in seqs]
            masked_rows, allowed = apply_grammar(logits, scheduler_output, seq_req_ids, group_sizes)
        if suppress_stops_before_min_tokens(logits, states, drafts) and structured:
            # Rare (min_tokens with a grammar): the stop ids are gathered only then.
            first_mask_row = scheduler_output.structured_output_request_ids
            stop_ids = [state.stop_ids() for req_id, state, count in zip(seq_req_ids, states, group_sizes)
                        if req_id in first_mask_row for _ in range(count)]
            revive_dead_rows(logits, masked_rows, allowed, stop_ids)
        output = self.sampler.sample(logits, metadata)  # [N] tokens
        token_ids = output.sampled_token_ids.tolist()
        first_rows = [0] + list(itertools.accumulate(group_sizes))[:-1]
        floor = self._draft_floor() if any(drafts) else 0.0
        for s, seq_drafts, first, state in zip(seqs, drafts, first_rows, states):
            sampled[s] = accept_drafts(seq_drafts, token_ids[first : first + 1 + len(seq_drafts)])
            if seq_drafts and state.draft_gate is not None:
                state.draft_gate.observe(len(seq_drafts), len(sampled[s]) - 1, floor)
        logprobs = logprobs_lists(output, seqs, first_rows, states, sampled, len(step.req_ids))
        return sampled, logprobs

    def _sampling_metadata(
        self, states: list[RequestState], drafts: list[list[int]]
    ) -> SamplingMetadata:
        """One sampling row per logits row; a draft row sees the drafts before it as outputs."""
        params, prompts, outputs, generators = [], [], [], []
        for state, seq_drafts in zip(states, drafts):
            for j in range(1 + len(seq_drafts)):
                params.append(state.sampling_params)
                prompts.append(state.prompt_token_ids)
                # No copy for the common row (j = 0): the sampler only reads it.
                outputs.append(state.output_token_ids + seq_drafts[:j] if j else state.output_token_ids)
                generators.append(state.generator)
        return SamplingMetadata.build(
            params, prompts, outputs, generators, self.model_config.vocab_size, self.device
        )

    def _prompt_logprobs(self, step: StepInputs, hidden: torch.Tensor) -> dict[str, LogprobsLists]:
        """For requests that ask: logprobs of each prompt token computed this step.

        The logits at position p score prompt token p + 1, so the rows run
        over positions [num_computed, min(seq_len, num_prompt - 1)).
        """
        result: dict[str, LogprobsLists] = {}
        for s, row in enumerate(step.rows):
            state = self.input_batch.states[row]
            num_logprobs = state.sampling_params.prompt_logprobs
            if num_logprobs is None:
                continue
            start = max(int(step.num_computed[s]), state.num_prompt_logprobs_sent)
            end = min(int(step.seq_lens[s]), state.num_prompt_tokens - 1)
            if end <= start:
                continue
            first = int(step.query_start_loc[s]) + start - int(step.num_computed[s])
            logits = self._logits(hidden[first : first + end - start])  # [P, V]
            targets = torch.tensor(state.prompt_token_ids[start + 1 : end + 1])  # [P]
            ids, logprobs, ranks = compute_prompt_logprobs(
                logits, targets.to(logits.device), num_logprobs
            )
            result[state.req_id] = LogprobsLists(ids.tolist(), logprobs.tolist(), ranks.tolist())
            state.num_prompt_logprobs_sent = end
        return result

    # ------------------------------------------------------------ drafting

    def _propose_drafts(self, step: StepInputs, sampled: list[list[int]]) -> list[list[int]] | None:
        """Drafts for the next step, for the requests that just sampled."""
        if self.drafter is None:
            return None
        drafts: list[list[int]] = []
        for row, token_ids in zip(step.rows, sampled):
            gate = self.input_batch.states[row].draft_gate
            if not token_ids or (gate is not None and not gate.allows_draft()):
                drafts.append([])
                continue
            tokens = self.input_batch.known_token_ids(row)
            # The next step computes positions num_tokens - 1 .. num_tokens - 1 + k.
            drafts.append(self.drafter.propose(tokens, self.max_model_len - len(tokens)))
        return drafts


def _copy_block_ids(block_ids):
    """A request's block ids as sent (a list, or one list per KV cache group), copied."""
    return tuple(list(ids) for ids in block_ids) if isinstance(block_ids, tuple) else list(block_ids)


def _extend_block_ids(block_ids, new_block_ids) -> None:
    if isinstance(block_ids, tuple):
        for ids, new in zip(block_ids, new_block_ids):
            ids.extend(new)
    else:
        block_ids.extend(new_block_ids)


def _check_triton_supports(config: "ModelConfig", full_attention_layers: tuple[int, ...]) -> None:
    """ValueError naming the architecture when the Triton attention cannot run its model."""
    missing = [what for what, needed in (
        ("attention score soft-capping", config.attn_logit_softcapping is not None),
        ("per-layer sliding windows", bool(full_attention_layers)),
        ("an attention scale other than head_dim ** -0.5", config.attention_scale is not None),
    ) if needed]
    if missing:
        raise ValueError(f"attention_backend triton: {config.architecture} needs {', '.join(missing)}, "
                         f"which the Triton attention does not implement (run it on the CPU backend)")


def _make_drafter(config: "SpeculativeConfig | None") -> NgramDrafter | None:
    if config is None:
        return None
    if config.method != "ngram":
        raise ValueError(f"method: only the ngram drafter is implemented, got {config.method!r}")
    return NgramDrafter(
        config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
    )
