"""Build an ``EngineCore`` on a real model from ``EngineOptions``.

Loads the model, sizes the KV cache from the memory budget (or
``num_gpu_blocks``), and wires the scheduler to a ``ModelRunner``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass

import torch

from cadence.config import EngineOptions, parse_memory
from cadence.core.sched.kv_connector import KVConnectorContext
from cadence.core.sched.scheduler import Scheduler
from cadence.core.sched.structured_output import StructuredOutputManager
from cadence.engine.core import EngineCore
from cadence.engine.kv_connectors import make_kv_connector_scheduler, make_kv_connector_worker
from cadence.engine.kv_events import publisher_for
from cadence.models import ModelConfig, Tokenizer, checkpoint_dtype, load_model
from cadence.models.default_model import default_model_path
from cadence.models.gguf_loader import read_gguf
from cadence.models.quantized import describe as describe_quantized
from cadence.models.quantized import keeps_quantized
from cadence.models.tensor_parallel import check_tensor_parallel
from cadence.models.tp_group import collective_backend
from cadence.runner.cpu_paths import auto_dtype, log_cpu_choice, resolve_dtype, resolve_quantization
from cadence.runner.cuda_graphs import default_capture_sizes
from cadence.runner.gpu_memory import gpu_kv_blocks
from cadence.runner.kv_cache import bytes_per_block, num_blocks_for_budget, resolve_kv_cache_dtype
from cadence.runner.model_runner import ModelRunner
from cadence.runner.tp_workers import start_driver
from cadence.structured import GrammarBackendBase, make_grammar_backend

DEFAULT_KV_CACHE_MEMORY = 1 << 30  # 1 GiB, or a quarter of free memory if less
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


@dataclass
class Engine:
    """What a front end needs: the engine core, the tokenizer, the model's facts."""

    core: EngineCore
    tokenizer: Tokenizer | None
    model_config: ModelConfig
    options: EngineOptions
    max_model_len: int
    grammar_backend: GrammarBackendBase | None = None  # None: no tokenizer, no grammars


def build_engine(options: EngineOptions, *, log=sys.stderr) -> Engine:
    engine_config = options.engine
    if engine_config.num_threads is not None:
        torch.set_num_threads(engine_config.num_threads)
    torch.manual_seed(engine_config.seed)
    device = resolve_device(engine_config.device)
    quantization, note = resolve_quantization(engine_config.quantization, device)
    if options.parallel.tensor_parallel_size > 1 and quantization != "none":
        quantization, note = _dense_for_tensor_parallel(engine_config.quantization,
                                                        options.parallel.tensor_parallel_size)
    if note is not None:
        print(f"cadence: {note}", file=log)
    dtype = _resolve_dtype(engine_config, device, quantization, log)
    model, tokenizer, model_config = load_model(engine_config.model, dtype, quantization)
    model.to(device)
    return assemble_engine(options, model, model_config, tokenizer, log=log)


def assemble_engine(
    options: EngineOptions,
    model: torch.nn.Module,
    model_config: ModelConfig,
    tokenizer: Tokenizer | None,
    *,
    log=sys.stderr,
) -> Engine:
    """An engine around a model already loaded on its device (in its dtype).

    ``build_engine`` loads and calls this; benchmarks that make a model
    themselves (random weights of a large shape, straight on the GPU) call it
    directly. With no tokenizer the engine takes token-id prompts only.
    """
    engine_config = options.engine
    device = next(model.parameters()).device
    dtype = model.dtype
    kv_dtype = resolve_kv_cache_dtype(options.cache.kv_cache_dtype, dtype, device)
    check_tensor_parallel_options(options, model, model_config, device)
    max_model_len = min(options.scheduler.max_model_len, model_config.max_position_embeddings)
    scheduler_config = dataclasses.replace(options.scheduler, max_model_len=max_model_len)
    if model_config.sliding_window and scheduler_config.sliding_window is None:
        scheduler_config = dataclasses.replace(scheduler_config, sliding_window=model_config.sliding_window)
    if device.type == "cuda":
        runner, num_blocks = _gpu_runner(options, model, model_config, dtype, device,
                                         scheduler_config, log)
    else:
        if options.cache.gpu_memory_utilization is not None:
            raise ValueError("gpu_memory_utilization: applies on a CUDA device; "
                             "on the CPU, size the cache with kv_cache_memory")
        num_blocks = _num_kv_blocks(options, model_config, kv_dtype)
        runner = None
    cache_config = dataclasses.replace(options.cache, num_gpu_blocks=num_blocks,
                                       kv_cache_dtype=_dtype_name(kv_dtype))
    cache_capacity = num_blocks * cache_config.block_size
    if cache_capacity < max_model_len:
        # A request longer than the whole cache could never be scheduled.
        print(f"cadence: max_model_len lowered from {max_model_len} to the KV cache's "
              f"{cache_capacity} tokens", file=log)
        max_model_len = cache_capacity
        scheduler_config = dataclasses.replace(scheduler_config, max_model_len=max_model_len)
    block_bytes = bytes_per_block(model_config, cache_config.block_size, kv_dtype)
    lazily = ", committed as blocks are first used" if device.type == "cpu" else ""
    print(
        f"cadence: KV cache {num_blocks} blocks x {cache_config.block_size} tokens = "
        f"{num_blocks * cache_config.block_size} tokens, {num_blocks * block_bytes / 2**20:.0f} MiB "
        f"({_dtype_name(kv_dtype)}, {device}){lazily}",
        file=log,
    )
    grammar_backend = None
    if tokenizer is not None:
        grammar_backend = make_grammar_backend(
            engine_config.structured_outputs_backend, tokenizer, model_config.vocab_size)
    connector_context = None
    if options.kv_transfer is not None:
        connector_context = KVConnectorContext(
            block_size=cache_config.block_size, num_blocks=num_blocks, bytes_per_block=block_bytes,
            kv_role=options.kv_transfer.kv_role or "kv_both",
            seconds_per_token=estimated_seconds_per_token(model, device),
            copy_bytes_per_second=_ESTIMATED_COPY_BYTES_PER_SECOND.get(device.type, 1e10),
            preemption_mode=options.preemption_mode)
    scheduler = Scheduler(
        scheduler_config, cache_config, speculative_config=options.speculative, log_stats=True,
        lora_config=options.lora,
        kv_connector=(make_kv_connector_scheduler(options.kv_transfer, connector_context)
                      if connector_context is not None else None),
        structured_output_manager=(StructuredOutputManager(grammar_backend)
                                   if grammar_backend is not None else None),
    )
    if runner is None:
        runner_args = dict(
            block_size=cache_config.block_size, num_blocks=num_blocks,
            dtype=dtype, max_num_seqs=scheduler_config.max_num_seqs, max_model_len=max_model_len,
            device=device, speculative_config=options.speculative,
            sliding_window=scheduler_config.sliding_window, lora_config=options.lora,
            kv_cache_dtype=kv_dtype,
        )
        runner = _cpu_runner(options, model, model_config, runner_args, log)
    if connector_context is not None:
        runner.attach_kv_connector(make_kv_connector_worker(options.kv_transfer, connector_context))
        print(f"cadence: KV connector {options.kv_transfer.kv_connector} "
              f"({connector_context.kv_role}, preemption by {options.preemption_mode})", file=log)
    if runner.cpu_paths is not None:
        log_cpu_choice(dtype, runner.cpu_paths, log=log)
        if runner.cpu_paths.attention_kernel is not None and runner.attention_kernel is None:
            print(f"cadence: attention over the cache on PyTorch's SDPA (the C kernel does not read a "
                  f"{_dtype_name(kv_dtype)} cache for {_dtype_name(dtype)} queries, or soft-caps)", file=log)
    kept = model.quantized_weights() if hasattr(model, "quantized_weights") else []
    if kept:
        reason = runner.cpu_paths.quant_reason if runner.cpu_paths is not None else "PyTorch"
        print(f"cadence: weights kept quantized: {describe_quantized(kept)}; {reason}", file=log)
        if getattr(runner, "fused_decoder_note", None):
            print(f"cadence: {runner.fused_decoder_note}", file=log)
    dequantized = getattr(model, "dequantized_at_load", {})
    if dequantized:
        counts = ", ".join(f"{name} x{n}" for name, n in sorted(dequantized.items()))
        print(f"cadence: GGUF tensors dequantized to {_dtype_name(dtype)} at load (no quantized kernel "
              f"computes their type): {counts}", file=log)
    # The options as they ran: dtype "auto" made concrete, the cache sized.
    engine_config = dataclasses.replace(engine_config, dtype=_dtype_name(dtype))
    options = dataclasses.replace(options, engine=engine_config, scheduler=scheduler_config,
                                  cache=cache_config)
    # Last: the publisher binds its socket (None when KV cache events are off).
    core = EngineCore(scheduler, runner, event_publisher=publisher_for(cache_config),
                      async_scheduling=scheduler_config.async_scheduling)
    return Engine(core, tokenizer, model_config, options, max_model_len, grammar_backend)


def _cpu_runner(options, model, model_config, runner_args, log):
    """The runner on the CPU: one ``ModelRunner``, or rank 0 of ``tensor_parallel_size`` ranks.

    The KV cache's blocks are the same either way (the scheduler's): each
    rank holds its share of the heads of every block, so the memory budget
    is the engine's, spread over the ranks. So are the threads: each rank
    runs ``num_threads`` / K of them (default: this process's torch threads / K).
    """
    size = options.parallel.tensor_parallel_size
    if size == 1:
        return ModelRunner(model, model_config, **runner_args)
    threads = max(1, (options.engine.num_threads or torch.get_num_threads()) // size)
    torch.set_num_threads(threads)
    runner = start_driver(model, model_config, size, num_threads=threads, **runner_args)
    print(f"cadence: tensor parallel over {size} ranks (gloo, {threads} threads each; "
          f"worker pids {runner.workers.pids()})", file=log)
    return runner


def check_tensor_parallel_options(options: EngineOptions, model: torch.nn.Module,
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
    if options.lora is not None:
        raise ValueError(f"enable_lora: LoRA adapters are not split over ranks; "
                         f"serve them with tensor_parallel_size 1 (got {size})")
    if options.kv_transfer is not None:
        raise ValueError(f"kv_transfer_config: a KV connector (kv_offload_size too) moves one "
                         f"process's cache; with tensor_parallel_size {size} each rank holds "
                         f"part of every block's heads")
    if hasattr(model, "quantized_weights") and model.quantized_weights():
        raise ValueError(f"quantization: weights kept quantized are not split over ranks; "
                         f"load them dense (quantization none) for tensor_parallel_size {size}")
    check_tensor_parallel(model_config, size)


def _dense_for_tensor_parallel(option: str, size: int) -> tuple[str, str]:
    """The loader's mode when ranks split the weights: dense (auto), or refused (gguf)."""
    if option == "gguf":
        raise ValueError(f"quantization: gguf keeps weights quantized, which tensor_parallel_size "
                         f"{size} does not split; use auto or none")
    return "none", f"quantization auto: GGUF weights dequantized at load (tensor_parallel_size {size})"


def _gpu_runner(options, model, model_config, dtype, device, scheduler_config, log):
    """The runner on a CUDA device, its KV cache sized, its decode graphs captured.

    The cache is sized, in order of precedence, by ``num_gpu_blocks``,
    ``kv_cache_memory`` (bytes, or a fraction of the GPU's free memory) or
    ``gpu_memory_utilization`` (default 0.9, measured by a profile run).
    """
    cache = options.cache
    if cache.kv_cache_memory is not None and cache.gpu_memory_utilization is not None:
        raise ValueError("gpu_memory_utilization: set it or kv_cache_memory, not both")
    runner = ModelRunner(
        model, model_config, block_size=cache.block_size, num_blocks=1, dtype=dtype,
        max_num_seqs=scheduler_config.max_num_seqs, max_model_len=scheduler_config.max_model_len,
        device=device, speculative_config=options.speculative,
        sliding_window=scheduler_config.sliding_window, lora_config=options.lora,
    )
    if cache.num_gpu_blocks is not None:
        num_blocks = cache.num_gpu_blocks
    elif cache.kv_cache_memory is not None:
        free, _ = torch.cuda.mem_get_info(device)
        budget = parse_memory(cache.kv_cache_memory, free)
        num_blocks = num_blocks_for_budget(budget, model_config, cache.block_size, dtype)
    else:
        utilization = cache.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
        num_blocks, figures = gpu_kv_blocks(
            runner, utilization, max_num_batched_tokens=scheduler_config.max_num_batched_tokens,
            max_num_seqs=scheduler_config.max_num_seqs)
        print(f"cadence: GPU memory {figures['total'] / 2**30:.1f} GiB x {utilization}: "
              f"profile peak {figures['peak_torch'] / 2**30:.2f} GiB, outside PyTorch "
              f"{figures['outside_torch'] / 2**30:.2f} GiB, the rest is KV cache", file=log)
    if num_blocks < 1:
        raise ValueError("gpu_memory_utilization: no room left for one KV block after the "
                         "weights and activations; raise it or shorten max_num_batched_tokens")
    runner.allocate_kv_cache(num_blocks)
    if options.lora is not None and not options.engine.enforce_eager:
        # A graph would replay one step's adapter mapping: LoRA steps run eagerly.
        print("cadence: CUDA graphs off: LoRA adapters are applied eagerly", file=log)
    elif model_config.num_experts and not options.engine.enforce_eager:
        # Grouping tokens by expert reads the counts on the host: not capturable.
        print("cadence: CUDA graphs off: mixture-of-experts routing runs eagerly", file=log)
    elif not options.engine.enforce_eager:
        sizes = default_capture_sizes(scheduler_config.max_num_seqs)
        runner.capture_cuda_graphs(sizes)
        print(f"cadence: CUDA graphs captured for decode batches of {sizes[0]}..{sizes[-1]} "
              f"({len(sizes)} sizes)", file=log)
    return runner, num_blocks


# Rough sustained rates, for the connectors' cost models only (their
# options override the estimate): matmul FLOP/s of a CPU and of a GPU.
_ESTIMATED_FLOPS = {"cpu": 5e10, "cuda": 3e14}
# Bytes per second of a KV copy to host memory: memcpy in RAM; PCIe to pinned memory.
_ESTIMATED_COPY_BYTES_PER_SECOND = {"cpu": 1e10, "cuda": 2.5e10}


def estimated_seconds_per_token(model: torch.nn.Module, device: torch.device) -> float:
    """Seconds to compute one token's KV: two FLOPs per weight at a rough rate."""
    num_params = sum(p.numel() for p in model.parameters())
    return 2 * num_params / _ESTIMATED_FLOPS.get(device.type, _ESTIMATED_FLOPS["cpu"])


def _resolve_dtype(engine_config, device: torch.device, quantization: str, log) -> torch.dtype:
    """The dtype option made concrete, ``auto`` said why in one line: it reads whether the
    loader keeps GGUF blocks (CPU) or the checkpoint's own dtype (GPU)."""
    if engine_config.dtype != "auto":
        return resolve_dtype(engine_config.dtype, device)
    stored = checkpoint_dtype(engine_config.model) if device.type == "cuda" else None
    kept = device.type == "cpu" and _keeps_gguf_blocks(engine_config.model, quantization)
    dtype, why = auto_dtype(device, checkpoint_dtype=stored, weights_kept=kept)
    print(f"cadence: dtype auto -> {_dtype_name(dtype)}: {why}", file=log)
    return dtype


def _keeps_gguf_blocks(path: str | None, quantization: str) -> bool:
    """Whether the loader keeps some matmul weight of ``path`` in its GGUF blocks under
    ``quantization`` (the rule of ``load_gguf_model``: 2-D tensors ``keeps_quantized`` takes)."""
    path = default_model_path() if path is None else path
    if quantization == "none" or not path.endswith(".gguf"):
        return False
    reader, _ = read_gguf(path)
    return any(len(t.shape) == 2 and keeps_quantized(t.name, t.tensor_type, quantization)
               for t in reader.tensors)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _num_kv_blocks(options: EngineOptions, model_config: ModelConfig, dtype: torch.dtype) -> int:
    if options.cache.num_gpu_blocks is not None:
        return options.cache.num_gpu_blocks
    available = _available_memory_bytes()
    if options.cache.kv_cache_memory is not None:
        budget = parse_memory(options.cache.kv_cache_memory, available)
    else:
        budget = min(DEFAULT_KV_CACHE_MEMORY, available // 4)
    num_blocks = num_blocks_for_budget(budget, model_config, options.cache.block_size, dtype)
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory: {budget} bytes do not hold one KV block")
    return num_blocks


def _available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
