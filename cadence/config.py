"""Configuration: frozen dataclasses, each option's default and help written once.

The CLI is generated from these classes (``cadence.cli``), so a new option is
added here and nowhere else. Pure Python: ``cadence.core`` may import it.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from dataclasses import dataclass, field
from typing import Any

# Names a ``SchedulerConfig.policy`` may take: the built-in policies, and any
# registered with ``cadence.core.sched.policy.register_policy`` in this process
# (which adds them here). A "package.module:factory" path names one anywhere.
SCHEDULING_POLICIES = ["fcfs", "priority", "fair", "slo", "lpm"]
# Installed packages name their policies under this entry-point group
# (``shortest-first = my_pkg.policies:ShortestFirst``): ``policy="shortest-first"``
# then works in every process, the engine's under ``cadence serve`` included.
POLICY_ENTRY_POINT_GROUP = "cadence.scheduling_policies"


def installed_policy_names() -> list[str]:
    """The names installed packages declare under ``POLICY_ENTRY_POINT_GROUP``."""
    return sorted(ep.name for ep in importlib.metadata.entry_points(group=POLICY_ENTRY_POINT_GROUP))
PREFIX_HASH_ALGOS = ("builtin", "sha256")
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "q8_0")
# Drafting methods that need KV slots beyond the verified tokens for the
# drafter's own forward passes (the draft model writes its KV there).
LOOKAHEAD_METHODS = ("eagle", "eagle3", "mtp", "draft_model")


def option(default: Any, help: str, *, policy: str | None = None) -> Any:
    """A dataclass field with its help text (read by the CLI generator).

    ``policy``: the scheduling policy the option belongs to; set under any
    other policy it is refused. That policy's module checks its value."""
    if isinstance(default, (list, dict, set)):
        raise TypeError("mutable defaults are not allowed in config classes")
    return field(default=default, metadata={"help": help, "policy": policy})


def _require(condition: bool, name: str, message: str) -> None:
    if not condition:
        raise ValueError(f"{name}: {message}")


PREEMPTION_MODES = ("recompute", "swap", "auto")


@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler may put into one step."""

    max_num_seqs: int = option(256, "Most requests running at once.")
    max_num_batched_tokens: int = option(
        2048, "Token budget of one step (prefill chunks, decodes and speculative tokens)."
    )
    max_model_len: int = option(2048, "Longest sequence (prompt + output) a request may reach.")
    enable_chunked_prefill: bool = option(
        True, "Split long prompts over several steps instead of waiting for a whole-prompt budget."
    )
    long_prefill_token_threshold: int = option(
        0, "Cap on the tokens one request may take in a step (0: no cap)."
    )
    max_num_partial_prefills: int | None = option(
        None, "Most requests that prefill (get prompt tokens) in one step (None: no cap)."
    )
    max_long_partial_prefills: int | None = option(
        None, "Most of those whose prompt is longer than long_prefill_token_threshold; set below "
              "max_num_partial_prefills, short prompts pass long ones (None: no cap)."
    )
    max_blocked_bypass_steps: int = option(
        0, "Without chunked prefill, let later requests pass a waiting prompt that does not fit "
           "the step's budget for at most this many steps, then wait for it (0: never pass)."
    )
    policy: str = option("fcfs", "Queue order: fcfs; priority (lower value first; a better "
                                 "priority also displaces the worst running request when "
                                 "max_num_seqs is full); fair (fair shares across clients, "
                                 "named by the request's user); slo (latency targets first); "
                                 "lpm (longest cached prefix first, waiting bounded by "
                                 "lpm_max_bypass); or a policy's 'package.module:factory'.")
    fair_client_weights: str | None = option(
        None, "With policy fair: client shares, e.g. 'alice=2,bob=1' (unnamed clients 1).",
        policy="fair"
    )
    fair_short_step_tokens: int | None = option(
        None, "With policy fair: the token budget of a step that serves only more-served "
              "clients' prompts while a less-served client is active, so that client's next "
              "request waits for a short step in flight (default: 3/8 of "
              "max_num_batched_tokens; max_num_batched_tokens turns it off).",
        policy="fair"
    )
    slo_ttft_s: float | None = option(
        None, "With policy slo: the time-to-first-token target of requests that set none (s).",
        policy="slo"
    )
    slo_tpot_s: float | None = option(
        None, "With policy slo: the time-per-output-token target of requests that set none (s).",
        policy="slo"
    )
    slo_reject: bool = option(
        False, "With policy slo: refuse (HTTP 429, Retry-After) a request whose TTFT target "
               "is predicted to be missed.",
        policy="slo"
    )
    lpm_max_bypass: int | None = option(
        None, "With policy lpm: how many later requests may be admitted before a waiting one; "
              "then it goes first, whatever its cached prefix (the bound on waiting; default "
              "16; each bypass also ages it by 1/bound of the best cached score in the queue's "
              "window; a huge value leaves lpm unbounded and unaged, as SGLang ships it).",
        policy="lpm"
    )
    async_scheduling: bool = option(
        False, "Schedule the next step while the current one runs (output placeholders): the "
               "scheduler's and the front end's work overlaps the model's. Not with speculative "
               "decoding; a request with a grammar waits for its token in flight."
    )
    max_num_encoder_input_tokens: int | None = option(
        None, "Encoder-input token budget per step (default: max_num_batched_tokens). "
              "Scheduler only: engines refuse it until a multimodal model can be served."
    )
    encoder_cache_size: int | None = option(
        None, "Encoder outputs, in tokens, kept until the decoder consumed them (default: the "
              "budget). Scheduler only: engines refuse it until a multimodal model can be served."
    )
    disable_chunked_mm_input: bool = option(
        False, "Never split a multimodal item's placeholder tokens across steps. "
               "Scheduler only: engines refuse it until a multimodal model can be served."
    )
    step_time_target_s: float | None = option(
        None, "Admit a waiting request only while the step-time model (fitted online to this "
              "engine's steps) predicts that a step of one token for every running request, "
              "the newcomer's included, takes at most this many seconds: the running batch "
              "stays as large as this machine decodes within it, and later requests queue "
              "(None or 0: no bound but max_num_seqs)."
    )
    step_time_target_solo_steps: float | None = option(
        None, "With step_time_target_s: the target is at least this many decode steps of a "
              "single stream (timed when one runs alone; until then, the smallest step timed "
              "divided by its tokens, a bound below it), so a model whose own step is slow "
              "still batches (None or 0: the target as given)."
    )
    step_time_max_wait_s: float | None = option(
        None, "With step_time_target_s: a request that has waited this many seconds is "
              "admitted past the bound while the queue is short (at most a quarter of the "
              "seats the bound gives, at least one request): a burst at light load is not "
              "held back, a queue under sustained load still is (None: never)."
    )
    admission_safety_margin: float = option(
        0.0,
        "Admit no new request while fewer than this fraction of KV blocks are free "
        "(running requests keep going; 0: off).",
    )
    prefill_first: bool = option(
        False, "Serve running requests that are still prefilling before decoding ones."
    )
    max_num_kv_read_tokens: int | None = option(
        None, "Per-step budget of KV-cache tokens read by attention (None: no budget)."
    )
    sliding_window: int | None = option(
        None, "Attention window (default: the model's own): each token attends to the last "
              "this many; caps what one request reads from the KV cache."
    )
    preemption_mode: str | None = option(
        None, "What a preempted request's KV becomes: recompute (freed, computed again), swap "
              "(copied to the host-memory tier and back; needs --kv-offload-size) or auto (per "
              "victim, whichever the cost model predicts cheaper). Default: auto with a tier, "
              "recompute without."
    )

    def __post_init__(self) -> None:
        _require(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        _require(self.step_time_target_s is None or 0 <= self.step_time_target_s < float("inf"),
                 "step_time_target_s", "must be a number of seconds >= 0 (0: no bound)")
        _require(self.step_time_max_wait_s is None or 0 <= self.step_time_max_wait_s < float("inf"),
                 "step_time_max_wait_s", "must be a number of seconds >= 0")
        _require(self.step_time_max_wait_s is None or bool(self.step_time_target_s), "step_time_max_wait_s",
                 "lets requests past step_time_target_s's bound, so it needs step_time_target_s")
        _require(self.step_time_target_solo_steps is None or 0 <= self.step_time_target_solo_steps < float("inf"),
                 "step_time_target_solo_steps", "must be a number >= 0")
        _require(not self.step_time_target_solo_steps or bool(self.step_time_target_s),
                 "step_time_target_solo_steps", "raises step_time_target_s, so it needs step_time_target_s")
        _require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1")
        _require(self.max_model_len >= 2, "max_model_len", "must be >= 2")
        _require(
            self.long_prefill_token_threshold >= 0, "long_prefill_token_threshold", "must be >= 0"
        )
        if self.max_num_partial_prefills is not None:
            _require(self.max_num_partial_prefills >= 1, "max_num_partial_prefills", "must be >= 1")
        if self.max_long_partial_prefills is not None:
            _require(self.max_long_partial_prefills >= 1, "max_long_partial_prefills", "must be >= 1")
            _require(self.max_num_partial_prefills is None
                     or self.max_long_partial_prefills <= self.max_num_partial_prefills,
                     "max_long_partial_prefills", "must be <= max_num_partial_prefills")
            _require(self.long_prefill_token_threshold > 0, "max_long_partial_prefills",
                     "needs long_prefill_token_threshold > 0 (what makes a prompt long)")
        _require(self.max_blocked_bypass_steps >= 0, "max_blocked_bypass_steps", "must be >= 0")
        for option_field in dataclasses.fields(self):
            owner = option_field.metadata.get("policy")
            if owner is not None and owner != self.policy \
                    and getattr(self, option_field.name) != option_field.default:
                raise ValueError(f"{option_field.name}: applies to policy {owner} only")
        if self.preemption_mode is not None:
            _require(self.preemption_mode in PREEMPTION_MODES, "preemption_mode",
                     f"must be one of {', '.join(PREEMPTION_MODES)}, got {self.preemption_mode!r}")
        _require(
            self.policy in SCHEDULING_POLICIES or ":" in self.policy
            or self.policy in installed_policy_names(),
            "policy",
            f"must be one of {SCHEDULING_POLICIES + installed_policy_names()} or a policy's "
            f"'package.module:factory', "
            f"got {self.policy!r}",
        )
        _require(
            0.0 <= self.admission_safety_margin < 1.0,
            "admission_safety_margin",
            "must be in [0, 1)",
        )
        if self.max_num_kv_read_tokens is not None:
            _require(self.max_num_kv_read_tokens >= 1, "max_num_kv_read_tokens", "must be >= 1")
        if self.sliding_window is not None:
            _require(self.sliding_window >= 1, "sliding_window", "must be >= 1")

    @property
    def encoder_compute_budget(self) -> int:
        if self.max_num_encoder_input_tokens is not None:
            return self.max_num_encoder_input_tokens
        return self.max_num_batched_tokens

    @property
    def encoder_cache_tokens(self) -> int:
        if self.encoder_cache_size is not None:
            return self.encoder_cache_size
        return self.encoder_compute_budget



def _options_by_policy() -> dict[str, tuple[str, ...]]:
    by_policy: dict[str, tuple[str, ...]] = {}
    for option_field in dataclasses.fields(SchedulerConfig):
        owner = option_field.metadata.get("policy")
        if owner is not None:
            by_policy[owner] = by_policy.get(owner, ()) + (option_field.name,)
    return by_policy


# The options that belong to one policy (refused with any other), by policy.
POLICY_OPTIONS = _options_by_policy()

@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache."""

    block_size: int = option(16, "Tokens per KV-cache block.")
    num_gpu_blocks: int | None = option(
        None, "Total KV-cache blocks (default: sized from the memory budget)."
    )
    enable_prefix_caching: bool = option(
        True, "Reuse the KV blocks of equal prompt prefixes across requests."
    )
    prefix_caching_hash_algo: str = option(
        "builtin",
        "Block hash: builtin (fast, per process) or sha256 (stable across processes).",
    )
    enable_kv_cache_events: bool = option(
        False, "Record stored/removed block events (for prefix-aware routing)."
    )
    kv_events_endpoint: str = option(
        "tcp://*:5557",
        "ZMQ PUB address of the KV events: bound if a wildcard (*, ::, 0.0.0.0), ipc:// "
        "or inproc://, else connected to (a subscriber bound there).",
    )
    kv_events_replay_endpoint: str | None = option(
        None, "ZMQ ROUTER address (bound) that resends buffered KV event batches on request."
    )
    kv_events_topic: str = option("", "Topic frame of every KV event message.")
    kv_events_buffer_steps: int = option(
        10000, "KV event batches (one per engine step) kept for replay."
    )
    kv_cache_dtype: str = option(
        "auto",
        "KV-cache element type: auto, float32, float16, bfloat16 or q8_0 (blocks of 32 int8 "
        "values and a float16 scale, 34 bytes). auto: float16 for a float32 model on the CPU "
        "(half the bytes at the same speed), else the model's dtype. On the CPU a half-width "
        "cache holds twice the tokens in the same memory, q8_0 1.88x float16's; on a GPU only auto.",
    )
    kv_cache_memory: str | None = option(
        None, "KV-cache memory budget: bytes (e.g. 2GiB) or a fraction of free memory (e.g. 0.3)."
    )
    gpu_memory_utilization: float | None = option(
        None, "Fraction of the GPU's memory the engine may use for weights, activations and "
              "KV cache (default 0.9); the cache gets what a profile run leaves. CUDA only."
    )
    kv_cache_groups: bool = option(
        True, "Layers that share an attention type share a block table, and sliding-window "
              "layers free the blocks behind their window (vLLM's hybrid KV cache manager), so a "
              "model with windows (Gemma 2/3, Mistral) holds more sequences in the same memory; "
              "off: every layer keeps the whole context. The host tier, swap, P/D and KV cache "
              "events follow each group's blocks. On the CPU with tensor_parallel_size 1; "
              "elsewhere one group, logged."
    )

    def __post_init__(self) -> None:
        _require(self.block_size >= 1, "block_size", "must be >= 1")
        if self.num_gpu_blocks is not None:
            _require(self.num_gpu_blocks >= 1, "num_gpu_blocks", "must be >= 1")
        _require(
            self.prefix_caching_hash_algo in PREFIX_HASH_ALGOS,
            "prefix_caching_hash_algo",
            f"must be one of {PREFIX_HASH_ALGOS}",
        )
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype",
                 f"must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
                 + (" (fp8 caches are not implemented)" if "fp8" in str(self.kv_cache_dtype) else ""))
        _require("://" in self.kv_events_endpoint, "kv_events_endpoint", "must be a ZMQ address")
        if self.kv_events_replay_endpoint is not None:
            _require("://" in self.kv_events_replay_endpoint, "kv_events_replay_endpoint",
                     "must be a ZMQ address")
        _require(self.kv_events_buffer_steps >= 1, "kv_events_buffer_steps", "must be >= 1")
        if self.gpu_memory_utilization is not None:
            _require(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization",
                     "must be in (0, 1]")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: drafts verified by the target model in one step."""

    num_speculative_tokens: int = option(3, "Draft tokens proposed per request per step.")
    method: str = option(
        "ngram", "Drafter: ngram (prompt lookup). eagle, eagle3, mtp and draft_model are "
                 "scheduled (lookahead slots) but engines refuse them until a drafter exists."
    )
    prompt_lookup_min: int = option(1, "Shortest n-gram the ngram drafter matches.")
    prompt_lookup_max: int = option(3, "Longest n-gram the ngram drafter matches.")
    draft_acceptance_floor: float | None = option(
        None, "Per request, drafting pauses while the moving average of its accepted / drafted "
              "tokens is below this, and retries after a pause that doubles while it stays "
              "low. Default: the break-even rate, measured from the engine's own steps (what "
              "a draft token costs against what an output token is worth); 0 always drafts.")

    def __post_init__(self) -> None:
        _require(self.num_speculative_tokens >= 1, "num_speculative_tokens", "must be >= 1")
        if self.draft_acceptance_floor is not None:
            _require(0 <= self.draft_acceptance_floor <= 1, "draft_acceptance_floor", "must be in [0, 1]")
        _require(
            1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
            "prompt_lookup_min",
            "must be >= 1 and <= prompt_lookup_max",
        )

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots to reserve beyond the scheduled tokens for the drafter."""
        return self.num_speculative_tokens if self.method in LOOKAHEAD_METHODS else 0


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters served beside the base model (PEFT folders)."""

    enable_lora: bool = option(
        False, "Serve LoRA adapters: each request may name one (or none: the base model).")
    max_loras: int = option(1, "Most distinct adapters in one batch.")
    max_lora_rank: int = option(16, "Largest adapter rank; an adapter of a higher rank is refused.")
    max_cpu_loras: int | None = option(
        None, "Adapters kept loaded in memory (default: max_loras); beyond it the least "
              "recently used adapter that no request holds is unloaded (loaded again from its "
              "path when a request names it).")

    def __post_init__(self) -> None:
        _require(self.max_loras >= 1, "max_loras", "must be >= 1")
        _require(self.max_lora_rank >= 1, "max_lora_rank", "must be >= 1")
        if self.max_cpu_loras is not None:
            _require(self.max_cpu_loras >= self.max_loras, "max_cpu_loras", "must be >= max_loras")

    @property
    def num_cpu_loras(self) -> int:
        """How many adapters stay loaded (max_cpu_loras, or max_loras by default)."""
        return self.max_cpu_loras or self.max_loras


DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray")
DP_ROUTING_POLICIES = ("round_robin", "least_loaded", "cache_aware")


@dataclass(frozen=True)
class ParallelConfig:
    """How many engine cores serve, and over how many devices one model is split."""

    data_parallel_size: int = option(1, "Engine-core replicas behind one front end.")
    tensor_parallel_size: int = option(
        1, "Ranks (processes of this machine) one model is split over: attention heads, MLP, "
           "embedding and LM head; the KV cache memory and num_threads are shared among them.")
    distributed_executor_backend: str | None = option(
        None, "mp (local processes) or ray (Ray actors on a Ray cluster).")

    def __post_init__(self) -> None:
        _require(self.data_parallel_size >= 1, "data_parallel_size", "must be >= 1")
        _require(self.tensor_parallel_size >= 1, "tensor_parallel_size", "must be >= 1")
        _require(self.distributed_executor_backend in (None, *DISTRIBUTED_EXECUTOR_BACKENDS),
                 "distributed_executor_backend",
                 f"must be one of {', '.join(DISTRIBUTED_EXECUTOR_BACKENDS)}, "
                 f"got {self.distributed_executor_backend!r}")


@dataclass(frozen=True)
class RouterConfig:
    """Which data-parallel replica serves each request (with data_parallel_size > 1)."""

    dp_routing: str = option(
        "cache_aware", "round_robin; least_loaded (fewest queued and running tokens); "
                       "cache_aware (the replica holding the longest cached prefix of the "
                       "prompt, unless its load passes the least loaded's by the margin).")
    dp_load_margin_tokens: int = option(
        8192, "cache_aware: the most queued and running tokens the chosen replica may have "
              "beyond the least loaded one's; past it the least loaded one serves.")

    def __post_init__(self) -> None:
        _require(self.dp_routing in DP_ROUTING_POLICIES, "dp_routing",
                 f"must be one of {', '.join(DP_ROUTING_POLICIES)}, got {self.dp_routing!r}")
        _require(self.dp_load_margin_tokens >= 0, "dp_load_margin_tokens", "must be >= 0")


KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
OFFLOADING_CONNECTOR = "OffloadingConnector"


@dataclass(frozen=True)
class KVTransferConfig:
    """KV transfer through a connector (vLLM's names): a host-memory tier, swap
    preemption, prefill/decode disaggregation. ``--kv-transfer-config`` takes
    all of it as one JSON object, as vLLM's flag does."""

    kv_connector: str | None = option(
        None, "Registered connector name (e.g. OffloadingConnector); none: no KV transfer.")
    kv_role: str | None = option(
        None, "What this engine does with KV: kv_producer, kv_consumer or kv_both "
              "(default kv_both when a connector is named).")
    kv_connector_extra_config: dict | None = option(
        None, "The connector's own options, a JSON object.")
    kv_offload_size: float | None = option(
        None, "GiB of host memory for a second KV tier (OffloadingConnector): full blocks "
              "are copied there and found again when the prefix cache lost them.")

    def __post_init__(self) -> None:
        if self.kv_offload_size is not None:
            _require(self.kv_offload_size > 0, "kv_offload_size", "must be > 0 GiB")
            _require(self.kv_connector in (None, OFFLOADING_CONNECTOR), "kv_offload_size",
                     f"sizes the {OFFLOADING_CONNECTOR}'s tier, not {self.kv_connector!r}")
            if self.kv_connector is None:
                object.__setattr__(self, "kv_connector", OFFLOADING_CONNECTOR)
        if self.kv_connector is not None:
            _require(isinstance(self.kv_connector, str) and self.kv_connector != "",
                     "kv_connector", "must be a registered connector name")
            if self.kv_role is None:
                object.__setattr__(self, "kv_role", "kv_both")
        if self.kv_role is not None:
            _require(self.kv_role in KV_ROLES, "kv_role",
                     f"must be one of {', '.join(KV_ROLES)}, got {self.kv_role!r}")
            _require(self.kv_connector is not None, "kv_role", "needs a kv_connector")
        extra = self.kv_connector_extra_config
        if extra is not None:
            _require(isinstance(extra, dict), "kv_connector_extra_config", "must be a JSON object")
            _require(self.kv_connector is not None, "kv_connector_extra_config", "needs a kv_connector")

    def extra(self, name: str, default: Any = None) -> Any:
        """One of the connector's own options."""
        return (self.kv_connector_extra_config or {}).get(name, default)


def kv_transfer_config_of(options: dict[str, Any], whole: Any = None) -> KVTransferConfig | None:
    """The KV transfer options given (flat ones and/or ``whole``: a JSON object,
    a dict or a ``KVTransferConfig``), or None when no connector is asked for."""
    if whole is not None:
        if isinstance(whole, KVTransferConfig):
            whole = {f.name: getattr(whole, f.name) for f in dataclasses.fields(whole)}
        elif isinstance(whole, str):
            whole = parse_json_object(whole, "kv_transfer_config")
        if not isinstance(whole, dict):
            raise ValueError("kv_transfer_config: must be a JSON object")
        unknown = sorted(set(whole) - field_names(KVTransferConfig))
        if unknown:
            raise ValueError(f"kv_transfer_config: unknown field {unknown[0]!r}")
        clash = sorted(set(whole) & set(options))
        if clash:
            raise ValueError(f"{clash[0]}: given both on its own and in kv_transfer_config")
        options = {**whole, **options}
    options = {name: value for name, value in options.items() if value is not None}
    if not options:
        return None
    config = KVTransferConfig(**options)
    if config.kv_connector is None:
        raise ValueError(f"{sorted(options)[0]}: needs a kv_connector (or kv_offload_size)")
    return config


def parse_json_object(text: str, name: str) -> dict:
    """A JSON object from the command line; ValueError naming the option."""
    import json

    try:
        value = json.loads(text)
    except ValueError as error:
        raise ValueError(f"{name}: not valid JSON ({error})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name}: must be a JSON object")
    return value


DTYPES = ("auto", "float32", "bfloat16", "float16")
BATCH_INVARIANT_MODES = ("auto", "on", "off")
QUANTIZATIONS = ("auto", "gguf", "none")  # as cadence.models.quantized.QUANTIZATION_MODES
STRUCTURED_OUTPUTS_BACKENDS = ("llguidance", "xgrammar")


@dataclass(frozen=True)
class EngineConfig:
    """The model and where it runs."""

    model: str | None = option(
        None, "GGUF file (any shard of a split one), Hugging Face folder, or a Hugging Face Hub "
              "id: owner/name (safetensors or GGUF), owner/name:QUANT (that GGUF quantization, "
              "e.g. Q8_0; default Q4_K_M where the repository has one), downloaded once into the "
              "Hugging Face cache (default: the embedded SmolLM2-135M-Instruct)."
    )
    revision: str | None = option(
        None, "Branch, tag or commit of a model given by its Hub id (default: main)."
    )
    download_dir: str | None = option(
        None, "Hugging Face cache folder a Hub model is downloaded to and looked up in "
              "(default: huggingface_hub's, $HF_HUB_CACHE or ~/.cache/huggingface/hub)."
    )
    dtype: str = option(
        "auto",
        "Weights and KV-cache dtype: auto (on the CPU float32 where GGUF weights stay in their "
        "blocks; for float weights bfloat16 where the CPU computes it natively, float32 "
        "elsewhere; on a GPU the checkpoint's own), float32, bfloat16 or float16.",
    )
    quantization: str = option(
        "auto",
        "GGUF weights: auto (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL "
        "and IQ4_XS matmul weights stay in their blocks on the CPU where the C kernel builds; "
        "other types (IQ1-IQ3, TQ, MXFP4), and every weight elsewhere, dequantized at load), gguf "
        "(those types always kept, "
        "in PyTorch without the C kernel; other quantized types refused), none (every weight "
        "dequantized to dtype at load).",
    )
    device: str = option("auto", "cpu, cuda, or auto (cuda when available).")
    num_threads: int | None = option(None, "torch CPU threads (default: torch's choice).")
    enforce_eager: bool = option(
        False, "Never capture CUDA graphs: every GPU step runs eagerly (the CPU always does)."
    )
    batch_invariant: str = option(
        "auto",
        "Outputs that do not depend on the batch: on (a request's greedy tokens are the same "
        "alone and in any batch, with or without LoRA: every step's products run on at least "
        "a few rows, short steps padded, and attention on the C kernel one query row at a "
        "time; refused where no such path exists: a GPU, mixture-of-experts models, float16, "
        "bfloat16 computed in software, no C kernels, tensor parallelism), off, or auto (on "
        "where it costs under 5 percent of single-stream and of batch-64 throughput: dense float "
        "weights; off for weights kept in GGUF blocks, whose one-row decode product sums "
        "differently; a long prompt's prefill costs more, see BENCHMARKS.md). The start-up "
        "log says which and why.",
    )
    seed: int = option(0, "Seed of the sampler's default generator.")
    structured_outputs_backend: str = option(
        "llguidance", "Grammar engine of structured outputs (JSON schema, regex, choice, "
        "grammar): llguidance, or xgrammar when installed."
    )
    # The limits below bound what one request's constraint may cost the grammar
    # library; a request over one gets a 400 naming its field and the option.
    structured_outputs_max_bytes: int = option(
        1048576, "Largest output constraint a request may carry, in UTF-8 bytes (a JSON schema, "
        "a regex, a grammar, or a choice list's strings together)."
    )
    structured_outputs_max_rules: int = option(
        2000, "Most rules (and terminals) a request's grammar may define (Lark or GBNF)."
    )
    structured_outputs_max_choices: int = option(
        20000, "Most strings in a request's choice list."
    )
    structured_outputs_compile_timeout_s: float = option(
        10.0, "Longest a request's constraint may take to compile and check; the check runs "
        "in a worker process, so a slower one (or one that crashes the grammar library) is "
        "refused with a 400 and the server goes on."
    )

    def __post_init__(self) -> None:
        _require(self.structured_outputs_backend in STRUCTURED_OUTPUTS_BACKENDS,
                 "structured_outputs_backend",
                 f"must be one of {', '.join(STRUCTURED_OUTPUTS_BACKENDS)}, "
                 f"got {self.structured_outputs_backend!r}")
        for name in ("structured_outputs_max_bytes", "structured_outputs_max_rules",
                     "structured_outputs_max_choices"):
            _require(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        _require(self.structured_outputs_compile_timeout_s > 0, "structured_outputs_compile_timeout_s",
                 f"must be > 0, got {self.structured_outputs_compile_timeout_s}")
        _require(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        _require(self.batch_invariant in BATCH_INVARIANT_MODES, "batch_invariant",
                 f"must be one of {', '.join(BATCH_INVARIANT_MODES)}, got {self.batch_invariant!r}")
        _require(self.quantization in QUANTIZATIONS, "quantization",
                 f"must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        _require(self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"),
                 "device", f"must be cpu, cuda[:N] or auto, got {self.device!r}")
        if self.num_threads is not None:
            _require(self.num_threads >= 1, "num_threads", "must be >= 1")
        for name in ("revision", "download_dir"):  # a Hub model's: the embedded default has neither
            value = getattr(self, name)
            if value is not None:
                _require(self.model is not None, name, "applies to a model given by its Hub id "
                         "(--model owner/name), not to the embedded default")
                _require(bool(value.strip()) and value == value.strip(), name,
                         f"must be a non-empty name without surrounding spaces, got {value!r}")


@dataclass(frozen=True)
class EngineOptions:
    """Every engine option, split by the part that uses it."""

    engine: EngineConfig
    scheduler: SchedulerConfig
    cache: CacheConfig
    speculative: SpeculativeConfig | None = None
    lora: LoRAConfig | None = None  # None: LoRA disabled
    parallel: ParallelConfig = ParallelConfig()
    router: RouterConfig = RouterConfig()
    kv_transfer: KVTransferConfig | None = None  # None: no KV connector

    def __post_init__(self) -> None:
        refuse_undelivered(self.scheduler, self.speculative)
        mode = self.scheduler.preemption_mode
        if mode not in (None, "recompute") and (
                self.kv_transfer is None or self.kv_transfer.kv_connector != OFFLOADING_CONNECTOR):
            raise ValueError(f"preemption_mode: {mode} needs the host-memory tier "
                             f"(--kv-offload-size GiB, the {OFFLOADING_CONNECTOR})")

    @property
    def preemption_mode(self) -> str:
        """The preemption mode made concrete: auto with a tier, recompute without."""
        mode = self.scheduler.preemption_mode
        if mode is not None:
            return mode
        has_tier = self.kv_transfer is not None and self.kv_transfer.kv_connector == OFFLOADING_CONNECTOR
        return "auto" if has_tier else "recompute"

    @classmethod
    def from_kwargs(cls, **options: Any) -> "EngineOptions":
        """Route flat keyword options (as ``LLM(...)`` or the CLI take them) to their class.

        ``num_speculative_tokens`` > 0 turns speculative decoding on;
        ``enable_lora`` turns LoRA on (its other options are refused without it);
        ``kv_transfer_config`` (JSON, a dict or a ``KVTransferConfig``) or the
        flat KV transfer options turn a KV connector on.
        """
        groups: dict[type, dict[str, Any]] = {
            EngineConfig: {}, SchedulerConfig: {}, CacheConfig: {}, SpeculativeConfig: {},
            LoRAConfig: {}, ParallelConfig: {}, RouterConfig: {}, KVTransferConfig: {},
        }
        whole_kv_transfer = options.pop("kv_transfer_config", None)
        for name, value in options.items():
            owner = next((c for c in groups if name in field_names(c)), None)
            if owner is None:
                raise ValueError(f"{name}: unknown engine option")
            groups[owner][name] = value
        spec_options = groups[SpeculativeConfig]
        speculative = None
        if spec_options.get("num_speculative_tokens", 0):
            speculative = SpeculativeConfig(**spec_options)
        return cls(
            engine=EngineConfig(**groups[EngineConfig]),
            scheduler=SchedulerConfig(**groups[SchedulerConfig]),
            cache=CacheConfig(**groups[CacheConfig]),
            speculative=speculative,
            lora=lora_config_of(groups[LoRAConfig]),
            parallel=ParallelConfig(**groups[ParallelConfig]),
            router=RouterConfig(**groups[RouterConfig]),
            kv_transfer=kv_transfer_config_of(groups[KVTransferConfig], whole_kv_transfer),
        )


def lora_config_of(options: dict[str, Any]) -> LoRAConfig | None:
    """The LoRA options given, or None when ``enable_lora`` is not set (then any
    other LoRA option is a mistake: it would be silently ignored)."""
    if options.get("enable_lora"):
        return LoRAConfig(**options)
    defaults = LoRAConfig()
    for name, value in options.items():
        if name != "enable_lora" and value != getattr(defaults, name):
            raise ValueError(f"{name}: applies with enable_lora (--enable-lora) only")
    return None


# Scheduler features no runner delivers yet. The scheduler implements them
# (its unit tests set them on SchedulerConfig), but an engine given them
# would accept the option and silently do nothing, so engines refuse them.
UNDELIVERED_SCHEDULER_OPTIONS = {
    "max_num_encoder_input_tokens": "not supported yet: no multimodal model can be served",
    "encoder_cache_size": "not supported yet: no multimodal model can be served",
    "disable_chunked_mm_input": "not supported yet: no multimodal model can be served",
}
DELIVERED_SPEC_METHODS = ("ngram",)


def refuse_undelivered(scheduler: SchedulerConfig, speculative: SpeculativeConfig | None) -> None:
    """Raise ``ValueError`` naming the first option an engine would accept and ignore."""
    defaults = SchedulerConfig()
    for name, reason in UNDELIVERED_SCHEDULER_OPTIONS.items():
        if getattr(scheduler, name) != getattr(defaults, name):
            raise ValueError(f"{name}: {reason}")
    if speculative is not None and scheduler.async_scheduling:
        raise ValueError("async_scheduling: not supported with speculative decoding yet "
                         "(drafts need the tokens of the step in flight)")
    if speculative is not None and speculative.method not in DELIVERED_SPEC_METHODS:
        raise ValueError(f"method: speculative method {speculative.method!r} is not supported yet "
                         f"(supported: {', '.join(DELIVERED_SPEC_METHODS)})")


def field_names(cls: type) -> set[str]:
    """The option names of a config class."""
    return {f.name for f in dataclasses.fields(cls)}


def parse_memory(value: str | int | float, available_bytes: int) -> int:
    """Bytes from "2GiB", "512MB", "1073741824", or a fraction of available memory ("0.3")."""
    text = str(value).strip().lower()
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    scale = 1
    for unit, unit_scale in units.items():
        if text.endswith(unit):
            text, scale = text[: -len(unit)].strip(), unit_scale
            break
    try:
        number = float(text)
    except ValueError:
        number = float("nan")
    if number != number or number in (float("inf"), float("-inf")) or number <= 0:
        raise ValueError(
            f"kv_cache_memory: cannot read {value!r} as a positive size "
            "(e.g. 2GiB, 512MB, or 0.3 of free memory)"
        )
    if scale == 1 and number < 1:
        return int(number * available_bytes)  # a fraction of what is free
    return int(number * scale)
