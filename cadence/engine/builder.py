"""Build an ``EngineCore`` on a real model from ``EngineOptions``.

``build_engine`` loads the model where and as ``plan_load`` says;
``assemble_engine`` wires an engine around a loaded model: the KV cache
sized and the runner built by the device's setup, the scheduler with its
grammar backend and KV connector. Every choice that depends on the device
or the CPU is the runner's (``cadence.runner.load_plan``,
``cadence.runner.device_setup``): nothing here branches on them.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass

import torch

from cadence.config import CacheConfig, EngineOptions, SchedulerConfig
from cadence.core.kv_cache import KVCacheLayout, plan_kv_cache_layout
from cadence.core.sched.kv_connector import KVConnectorContext
from cadence.core.sched.scheduler import Scheduler
from cadence.core.sched.structured_output import StructuredOutputManager
from cadence.engine.core import EngineCore
from cadence.engine.kv_connectors import make_kv_connector_scheduler, make_kv_connector_worker
from cadence.engine.kv_events import publisher_for
from cadence.models import LlamaForCausalLM, ModelConfig, Tokenizer, load_model
from cadence.runner.device_setup import DeviceSetup, device_setup
from cadence.runner.kv_cache import cache_dtype_name
from cadence.runner.load_plan import dtype_name, plan_load
from cadence.runner.model_runner import ModelRunner
from cadence.structured import GrammarBackendBase, make_grammar_backend


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
    """Load the model ``options`` name (on the device, in the dtype, with the GGUF blocks
    ``plan_load`` chooses) and assemble its engine."""
    engine_config = options.engine
    if engine_config.num_threads is not None:
        torch.set_num_threads(engine_config.num_threads)
    torch.manual_seed(engine_config.seed)
    plan = plan_load(options, log=log)
    model, tokenizer, model_config = load_model(engine_config.model, plan.dtype, plan.quantization)
    model.to(plan.device)
    return assemble_engine(options, model, model_config, tokenizer, log=log)


def assemble_engine(
    options: EngineOptions,
    model: LlamaForCausalLM,
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
    scheduler_config = _scheduler_config(options, model_config)
    model.limit_positions(scheduler_config.max_model_len)  # before any runner reads the tables
    setup = device_setup(options, model, model_config, log)
    setup.kv_cache_layout = _kv_cache_layout(options, model_config, scheduler_config, setup, log)
    num_blocks = setup.num_kv_blocks(scheduler_config)
    cache_config = dataclasses.replace(options.cache, num_gpu_blocks=num_blocks,
                                       kv_cache_dtype=cache_dtype_name(setup.kv_cache_dtype))
    scheduler_config = _fit_to_cache(
        scheduler_config, _cache_capacity(setup.kv_cache_layout, num_blocks, cache_config.block_size,
                                          scheduler_config.max_num_batched_tokens), log)
    setup.log_kv_cache(num_blocks, cache_config.block_size)
    grammar_backend = None if tokenizer is None else make_grammar_backend(
        options.engine.structured_outputs_backend, tokenizer, model_config.vocab_size)
    connector_context = _connector_context(options, cache_config, setup)
    scheduler = _make_scheduler(options, scheduler_config, cache_config, connector_context, grammar_backend,
                                setup.kv_cache_layout)
    # After the scheduler: options it refuses never start tensor-parallel workers.
    runner = setup.make_runner(scheduler_config, num_blocks)
    if connector_context is not None:
        _attach_connector(runner, options, connector_context, log)
    setup.log_runner(runner)
    # The options as they ran: dtype "auto" made concrete, the cache sized.
    engine_config = dataclasses.replace(options.engine, dtype=dtype_name(setup.dtype))
    options = dataclasses.replace(options, engine=engine_config, scheduler=scheduler_config,
                                  cache=cache_config)
    # Last: the publisher binds its socket (None when KV cache events are off).
    core = EngineCore(scheduler, runner, event_publisher=publisher_for(cache_config),
                      async_scheduling=scheduler_config.async_scheduling)
    return Engine(core, tokenizer, model_config, options, scheduler_config.max_model_len, grammar_backend)


def _scheduler_config(options: EngineOptions, model_config: ModelConfig) -> SchedulerConfig:
    """The scheduler's options within the model's context length and with its sliding window."""
    scheduler_config = dataclasses.replace(
        options.scheduler,
        max_model_len=min(options.scheduler.max_model_len, model_config.max_position_embeddings))
    if model_config.sliding_window and scheduler_config.sliding_window is None:
        scheduler_config = dataclasses.replace(scheduler_config, sliding_window=model_config.sliding_window)
    return scheduler_config


def _kv_cache_layout(options: EngineOptions, model_config: ModelConfig, scheduler_config: SchedulerConfig,
                     setup: DeviceSetup, log) -> KVCacheLayout | None:
    """The model's KV cache groups (None: one full-length group for every layer), and why not where
    a model with windows keeps one group."""
    layout = plan_kv_cache_layout(model_config.num_hidden_layers, scheduler_config.sliding_window,
                                  model_config.full_attention_layers)
    if not layout.is_hybrid:
        return None
    reasons = [why for why, applies in (
        ("kv_cache_groups off", not options.cache.kv_cache_groups),
        (setup.one_kv_cache_group_reason, setup.one_kv_cache_group_reason is not None),
        ("tensor-parallel ranks build one table", options.parallel.tensor_parallel_size > 1),
    ) if applies]
    if reasons:
        print(f"cadence: one KV cache group, every layer keeping the whole context ({'; '.join(reasons)})",
              file=log)
        return None
    print(f"cadence: {layout.describe()}; the window groups free the blocks behind their window", file=log)
    return layout


def _cache_capacity(layout: KVCacheLayout | None, num_blocks: int, block_size: int,
                    max_num_batched_tokens: int) -> int:
    """The longest request the whole cache holds, in tokens."""
    if layout is None:
        return num_blocks * block_size
    return layout.max_request_tokens(num_blocks, block_size, max_num_batched_tokens)


def _fit_to_cache(scheduler_config: SchedulerConfig, cache_capacity: int, log) -> SchedulerConfig:
    """``max_model_len`` lowered to the whole cache's tokens: a longer request could never be scheduled."""
    if cache_capacity >= scheduler_config.max_model_len:
        return scheduler_config
    print(f"cadence: max_model_len lowered from {scheduler_config.max_model_len} to the KV cache's "
          f"{cache_capacity} tokens", file=log)
    return dataclasses.replace(scheduler_config, max_model_len=cache_capacity)


def _connector_context(options: EngineOptions, cache_config: CacheConfig,
                       setup: DeviceSetup) -> KVConnectorContext | None:
    """What both sides of the KV connector know of the cache and the device (None: no connector)."""
    if options.kv_transfer is None:
        return None
    return KVConnectorContext(
        block_size=cache_config.block_size, num_blocks=cache_config.num_gpu_blocks,
        bytes_per_block=setup.bytes_per_block(cache_config.block_size),
        kv_role=options.kv_transfer.kv_role or "kv_both",
        seconds_per_token=setup.seconds_per_token(),
        copy_bytes_per_second=setup.copy_bytes_per_second,
        preemption_mode=options.preemption_mode)


def _make_scheduler(options: EngineOptions, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                    connector_context: KVConnectorContext | None,
                    grammar_backend: GrammarBackendBase | None,
                    kv_cache_layout: KVCacheLayout | None = None) -> Scheduler:
    return Scheduler(
        scheduler_config, cache_config, speculative_config=options.speculative, log_stats=True,
        lora_config=options.lora,
        kv_connector=(make_kv_connector_scheduler(options.kv_transfer, connector_context)
                      if connector_context is not None else None),
        structured_output_manager=(StructuredOutputManager(grammar_backend)
                                   if grammar_backend is not None else None),
        kv_cache_layout=kv_cache_layout,
    )


def _attach_connector(runner: ModelRunner, options: EngineOptions, context: KVConnectorContext, log) -> None:
    """The KV connector's worker side on ``runner``, called around every step from now on."""
    runner.attach_kv_connector(make_kv_connector_worker(options.kv_transfer, context))
    print(f"cadence: KV connector {options.kv_transfer.kv_connector} "
          f"({context.kv_role}, preemption by {options.preemption_mode})", file=log)
