"""After the model loads: the KV cache's size, the runner and their start-up lines, per device.

``assemble_engine`` (``cadence.engine.builder``) takes the setup of the
model's device from ``device_setup`` and calls it in this order; the
builder never branches on the device:

    setup = device_setup(options, model, model_config, log)
                          the KV cache's dtype; options this device cannot run refused
    setup.num_kv_blocks(scheduler_config)
        CpuSetup          num_gpu_blocks, or kv_cache_memory (default: 1 GiB, or a
                          quarter of available memory if less) over bytes per block
        GpuSetup          num_gpu_blocks, kv_cache_memory (of the GPU's free memory) or
                          gpu_memory_utilization (a profile run): the runner is built
                          here to measure, then holds the cache, decode graphs captured
    setup.log_kv_cache(num_blocks, block_size)
    setup.make_runner(scheduler_config, num_blocks)
        CpuSetup          a ModelRunner, or rank 0 of tensor_parallel_size ranks
        GpuSetup          the runner num_kv_blocks built
    setup.log_runner(runner)
                          the CPU's paths, weights kept quantized, tensors dequantized at load,
                          the batch-invariant mode (on or off, and why)

The builder makes the scheduler between ``log_kv_cache`` and
``make_runner``: options the scheduler refuses never start a CPU runner's
tensor-parallel workers.
"""

from __future__ import annotations

import sys
from typing import TextIO

import torch

from cadence.config import EngineOptions, SchedulerConfig, parse_memory
from cadence.models import LlamaForCausalLM, ModelConfig
from cadence.models.quantized import describe as describe_quantized
from cadence.models.tensor_parallel import check_tensor_parallel
from cadence.runner.batch_invariance import BatchInvariance
from cadence.runner.cpu_paths import log_cpu_choice
from cadence.runner.cuda_graphs import default_capture_sizes
from cadence.runner.gpu_memory import gpu_kv_blocks
from cadence.runner.host_memory import available_memory_bytes
from cadence.runner.kv_cache import (
    auto_kv_cache_dtype, bytes_per_block, cache_dtype_name, num_blocks_for_budget, resolve_kv_cache_dtype,
)
from cadence.runner.load_plan import dtype_name
from cadence.runner.model_runner import ModelRunner
from cadence.runner.tp_workers import collective_backend, start_driver

DEFAULT_KV_CACHE_MEMORY = 1 << 30  # 1 GiB, or a quarter of free memory if less
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


def device_setup(options: EngineOptions, model: LlamaForCausalLM, model_config: ModelConfig,
                 log: TextIO = sys.stderr) -> "DeviceSetup":
    """The setup of the device ``model`` is on (a CUDA device's, else the CPU's)."""
    device = next(model.parameters()).device
    setup = GpuSetup if device.type == "cuda" else CpuSetup
    return setup(options, model, model_config, device, log)


class DeviceSetup:
    """A loaded model's start-up on its device; the subclasses size the cache and build the runner."""

    # Rough sustained rates, for the KV connectors' cost models only (their
    # options override the estimate): matmul FLOP/s; bytes per second of a
    # KV copy to host memory.
    flops: float
    copy_bytes_per_second: float
    cache_note = ""  # after the KV cache's line: when its memory is committed
    # KV cache groups (cadence.core.kv_cache.groups), set by the engine's builder
    # before the cache is sized; None: one full-length group for every layer.
    kv_cache_layout = None
    # Why this device keeps one group for every layer (None: it runs groups).
    one_kv_cache_group_reason: str | None = None

    def __init__(self, options: EngineOptions, model: LlamaForCausalLM, model_config: ModelConfig,
                 device: torch.device, log: TextIO) -> None:
        self.options = options
        self.model = model
        self.model_config = model_config
        self.device = device
        self.dtype = model.dtype
        self.kv_cache_dtype = resolve_kv_cache_dtype(options.cache.kv_cache_dtype, self.dtype, device)
        self.log = log
        check_tensor_parallel_options(options, model, model_config, device)

    def num_kv_blocks(self, scheduler_config: SchedulerConfig) -> int:
        raise NotImplementedError

    def make_runner(self, scheduler_config: SchedulerConfig, num_blocks: int) -> ModelRunner:
        raise NotImplementedError

    def bytes_per_block(self, block_size: int) -> int:
        return bytes_per_block(self.model_config, block_size, self.kv_cache_dtype, self.kv_cache_layout)

    def seconds_per_token(self) -> float:
        """Seconds to compute one token's KV: two FLOPs per weight at a rough rate."""
        num_params = sum(p.numel() for p in self.model.parameters())
        return 2 * num_params / self.flops

    def log_kv_cache(self, num_blocks: int, block_size: int) -> None:
        size = f"{num_blocks * block_size} tokens"
        if self.kv_cache_layout is not None:  # a block holds one group's layers
            size = f"{num_blocks * block_size} tokens of {self.kv_cache_layout.layers_per_group} layers"
        print(f"cadence: KV cache {num_blocks} blocks x {block_size} tokens = "
              f"{size}, {num_blocks * self.bytes_per_block(block_size) / 2**20:.0f} MiB "
              f"({cache_dtype_name(self.kv_cache_dtype)}, {self.device}{self._kv_dtype_note()}){self.cache_note}",
              file=self.log)

    def _kv_dtype_note(self) -> str:
        if self.options.cache.kv_cache_dtype != "auto":
            return ""
        return f"; {auto_kv_cache_dtype(self.dtype, self.device)[1]}"

    def log_runner(self, runner: ModelRunner) -> None:
        """The lines on what runs: the CPU's paths, weights kept quantized, tensors dequantized at
        load, and whether outputs are batch-invariant."""
        log, dtype = self.log, self.dtype
        if runner.cpu_paths is not None:
            log_cpu_choice(dtype, runner.cpu_paths, log=log)
            if runner.cpu_paths.attention_kernel is not None and runner.attention_kernel is None:
                print(f"cadence: attention over the cache on PyTorch's SDPA (the C kernel does not read a "
                      f"{cache_dtype_name(self.kv_cache_dtype)} cache for {dtype_name(dtype)} queries)",
                      file=log)
        kept = self.model.quantized_weights()
        if kept:
            reason = runner.cpu_paths.quant_reason if runner.cpu_paths is not None else "PyTorch"
            print(f"cadence: weights kept quantized: {describe_quantized(kept)}; {reason}", file=log)
            if runner.fused_decoder_note:
                print(f"cadence: {runner.fused_decoder_note}", file=log)
        dequantized = self.model.dequantized_at_load
        if dequantized:
            counts = ", ".join(f"{name} x{n}" for name, n in sorted(dequantized.items()))
            print(f"cadence: GGUF tensors dequantized to {dtype_name(dtype)} at load (no quantized kernel "
                  f"computes their type): {counts}", file=log)
        print(f"cadence: {runner.batch_invariance.describe()}", file=log)


class CpuSetup(DeviceSetup):
    """The CPU: the cache sized from host memory, the runner built last (see the module doc)."""

    flops = 5e10
    copy_bytes_per_second = 1e10  # memcpy in RAM
    cache_note = ", committed as blocks are first used"

    def num_kv_blocks(self, scheduler_config: SchedulerConfig) -> int:
        cache = self.options.cache
        if cache.gpu_memory_utilization is not None:
            raise ValueError("gpu_memory_utilization: applies on a CUDA device; "
                             "on the CPU, size the cache with kv_cache_memory")
        if cache.num_gpu_blocks is not None:
            return cache.num_gpu_blocks
        available = available_memory_bytes()
        if cache.kv_cache_memory is not None:
            budget = parse_memory(cache.kv_cache_memory, available)
        else:
            budget = min(DEFAULT_KV_CACHE_MEMORY, available // 4)
        num_blocks = num_blocks_for_budget(budget, self.model_config, cache.block_size, self.kv_cache_dtype,
                                           self.kv_cache_layout)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory: {budget} bytes do not hold one KV block")
        return num_blocks

    def make_runner(self, scheduler_config: SchedulerConfig, num_blocks: int) -> ModelRunner:
        """One ``ModelRunner``, or rank 0 of ``tensor_parallel_size`` ranks.

        The KV cache's blocks are the same either way (the scheduler's): each
        rank holds its share of the heads of every block, so the memory budget
        is the engine's, spread over the ranks. So are the threads: each rank
        runs ``num_threads`` / K of them (default: this process's torch threads / K).
        """
        options = self.options
        runner_args = dict(
            block_size=options.cache.block_size, num_blocks=num_blocks,
            dtype=self.dtype, max_num_seqs=scheduler_config.max_num_seqs,
            max_model_len=scheduler_config.max_model_len, device=self.device,
            speculative_config=options.speculative, sliding_window=scheduler_config.sliding_window,
            lora_config=options.lora, kv_cache_dtype=self.kv_cache_dtype,
            # (tensor parallelism refuses on: check_tensor_parallel_options; auto is off there)
            batch_invariant=options.engine.batch_invariant
            if options.parallel.tensor_parallel_size == 1 else "off",
        )
        if self.kv_cache_layout is not None:  # (the builder keeps one group under tensor parallelism)
            runner_args["kv_cache_layout"] = self.kv_cache_layout
        size = options.parallel.tensor_parallel_size
        if size == 1:
            return ModelRunner(self.model, self.model_config, **runner_args)
        threads = max(1, (options.engine.num_threads or torch.get_num_threads()) // size)
        torch.set_num_threads(threads)
        runner = start_driver(self.model, self.model_config, size, num_threads=threads, **runner_args)
        runner.batch_invariance = BatchInvariance.off(f"tensor_parallel_size {size}: not built across ranks")
        print(f"cadence: tensor parallel over {size} ranks (gloo, {threads} threads each; "
              f"worker pids {runner.workers.pids()})", file=self.log)
        return runner


class GpuSetup(DeviceSetup):
    """A CUDA device: the runner is built first, to measure what its KV cache may take."""

    one_kv_cache_group_reason = "the Triton attention reads one block table per request"

    flops = 3e14
    copy_bytes_per_second = 2.5e10  # PCIe to pinned host memory
    runner: ModelRunner | None = None  # built by num_kv_blocks

    def num_kv_blocks(self, scheduler_config: SchedulerConfig) -> int:
        """The cache is sized, in order of precedence, by ``num_gpu_blocks``,
        ``kv_cache_memory`` (bytes, or a fraction of the GPU's free memory) or
        ``gpu_memory_utilization`` (default 0.9, measured by a profile run)."""
        options, cache = self.options, self.options.cache
        if cache.kv_cache_memory is not None and cache.gpu_memory_utilization is not None:
            raise ValueError("gpu_memory_utilization: set it or kv_cache_memory, not both")
        self.runner = ModelRunner(
            self.model, self.model_config, block_size=cache.block_size, num_blocks=1, dtype=self.dtype,
            max_num_seqs=scheduler_config.max_num_seqs, max_model_len=scheduler_config.max_model_len,
            device=self.device, speculative_config=options.speculative,
            sliding_window=scheduler_config.sliding_window, lora_config=options.lora,
            batch_invariant=options.engine.batch_invariant,
        )
        num_blocks = self._measure_kv_blocks(scheduler_config)
        if num_blocks < 1:
            raise ValueError("gpu_memory_utilization: no room left for one KV block after the "
                             "weights and activations; raise it or shorten max_num_batched_tokens")
        self.runner.allocate_kv_cache(num_blocks)
        self._capture_graphs(scheduler_config)
        return num_blocks

    def make_runner(self, scheduler_config: SchedulerConfig, num_blocks: int) -> ModelRunner:
        return self.runner

    def _measure_kv_blocks(self, scheduler_config: SchedulerConfig) -> int:
        cache = self.options.cache
        if cache.num_gpu_blocks is not None:
            return cache.num_gpu_blocks
        if cache.kv_cache_memory is not None:
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = parse_memory(cache.kv_cache_memory, free)
            return num_blocks_for_budget(budget, self.model_config, cache.block_size, self.dtype)
        utilization = cache.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
        num_blocks, figures = gpu_kv_blocks(
            self.runner, utilization, max_num_batched_tokens=scheduler_config.max_num_batched_tokens,
            max_num_seqs=scheduler_config.max_num_seqs)
        print(f"cadence: GPU memory {figures['total'] / 2**30:.1f} GiB x {utilization}: "
              f"profile peak {figures['peak_torch'] / 2**30:.2f} GiB, outside PyTorch "
              f"{figures['outside_torch'] / 2**30:.2f} GiB, the rest is KV cache", file=self.log)
        return num_blocks

    def _capture_graphs(self, scheduler_config: SchedulerConfig) -> None:
        """Decode graphs for every batch size up to ``max_num_seqs``, where a step can replay one."""
        if self.options.engine.enforce_eager:
            return
        if self.options.lora is not None:
            # A graph would replay one step's adapter mapping: LoRA steps run eagerly.
            print("cadence: CUDA graphs off: LoRA adapters are applied eagerly", file=self.log)
        elif self.model_config.num_experts:
            # Grouping tokens by expert reads the counts on the host: not capturable.
            print("cadence: CUDA graphs off: mixture-of-experts routing runs eagerly", file=self.log)
        else:
            sizes = default_capture_sizes(scheduler_config.max_num_seqs)
            self.runner.capture_cuda_graphs(sizes)
            print(f"cadence: CUDA graphs captured for decode batches of {sizes[0]}..{sizes[-1]} "
                  f"({len(sizes)} sizes)", file=self.log)


def check_tensor_parallel_options(options: EngineOptions, model: LlamaForCausalLM,
                                  model_config: ModelConfig, device: torch.device) -> None:
    """ValueError naming the option when ``tensor_parallel_size`` > 1 cannot run with the others."""
    parallel = options.parallel
    size = parallel.tensor_parallel_size
    if size == 1:
        return
    if parallel.distributed_executor_backend == "ray":
        raise ValueError(f"distributed_executor_backend: ray places data-parallel engine cores; "
                         f"tensor_parallel_size {size} runs its ranks as local processes (mp)")
    if device.type != "cpu":
        raise ValueError(f"tensor_parallel_size {size}: ranks run on the CPU over gloo; the "
                         f"{device.type} path ({collective_backend(device)}, one device per rank) "
                         f"is not built")
    if options.engine.batch_invariant == "on":
        raise ValueError(f"batch_invariant: on is not built for tensor_parallel_size {size} "
                         f"(each rank's products and the sums across ranks); use auto or off")
    if options.lora is not None:
        raise ValueError(f"enable_lora: LoRA adapters are not split over ranks; "
                         f"serve them with tensor_parallel_size 1 (got {size})")
    if options.kv_transfer is not None:
        raise ValueError(f"kv_transfer_config: a KV connector (kv_offload_size too) moves one "
                         f"process's cache; with tensor_parallel_size {size} each rank holds "
                         f"part of every block's heads")
    if model.quantized_weights():
        raise ValueError(f"quantization: weights kept quantized are not split over ranks; "
                         f"load them dense (quantization none) for tensor_parallel_size {size}")
    check_tensor_parallel(model_config, size)
