"""``/metrics`` in Prometheus text format; names follow vLLM's with a ``cadence:`` prefix.

Gauges come from the ``SchedulerStats`` that ride on every step's outputs;
request latencies (TTFT, time per output token, end to end) are measured in
the front end, where the client's clock runs. Counters get ``_total`` on
export, as Prometheus wants (``cadence:prompt_tokens_total``).

The ``cadence:frontend_*`` gauges are the state requests hold in the front end
(``AsyncLLM.frontend_state``), read at scrape time: all zero when no request
is in flight, so a leak shows as a gauge that never comes back to zero.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Callable

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from cadence.core.outputs import SchedulerStats, SpecDecodingStats
from cadence.engine.async_llm import FrontendState

_FRONTEND_DOCS = {
    "open_requests": "Requests the front end holds state for (output queue, timing, sequences).",
    "unfinished_seqs": "Sequences counted against --max-num-seqs plus --max-num-queued-requests.",
    "output_requests": "Requests the front end's output processor detokenizes.",
    "output_routes": "Engine request ids the output processor routes (a request or its n children).",
    "pending_utility_calls": "Utility calls (stats, reset_prefix_cache) awaiting the engine's answer.",
}

prometheus_client.disable_created_metrics()

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class PrometheusStatLogger:
    """Implements ``cadence.engine.async_llm.StatLogger`` on its own registry."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"cadence:{name}", doc, labels, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"cadence:{name}", doc, labels, registry=self.registry).labels(model_name)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"cadence:{name}", doc, labels, buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to run.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).")
        self.running_seats = gauge(
            "running_seats", "Requests the step-time bound lets run at once now "
            "(--step-time-target-s: the running batch a step of one token each keeps within "
            "the target); max_num_seqs while the bound has not timed enough steps.")
        self._kv_cache_group_usage = Gauge(
            "cadence:kv_cache_group_usage_perc", "With KV cache groups (layers of one attention "
            "type share a block table): the fraction of the KV-cache blocks each group's requests "
            "hold, by group (index:full or index:windowW); they add up to kv_cache_usage_perc.",
            ["model_name", "group"], registry=self.registry)
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.prefix_cache_hit_rate = gauge(
            "prefix_cache_hit_rate", "Prefix-cache hits / queries since the server started.")
        self.external_prefix_cache_queries = counter(
            "external_prefix_cache_queries",
            "Prompt tokens looked up beyond the prefix cache by a KV connector (the host-memory tier).")
        self.external_prefix_cache_hits = counter(
            "external_prefix_cache_hits", "Prompt tokens a KV connector supplied (tier hits, swaps back).")
        self.num_preemptions = counter("num_preemptions", "Requests preempted (KV blocks ran out).")
        self.num_swapped_preemptions = counter(
            "num_swapped_preemptions", "Preempted requests whose KV was swapped to the host-memory "
            "tier instead of freed for recompute.")
        self.prompt_tokens = counter("prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self._request_success = Counter(
            "cadence:request_success", "Finished requests, by finish reason.",
            ["model_name", "finished_reason"], registry=self.registry)
        self._model_name = model_name
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.time_per_output_token = histogram(
            "time_per_output_token_seconds", "Time between output tokens of a request (per step).",
            _TPOT_BUCKETS)
        self.request_time_per_output_token = histogram(
            "request_time_per_output_token_seconds",
            "Mean time per output token of a finished request.", _TPOT_BUCKETS)
        self.e2e_latency = histogram(
            "e2e_request_latency_seconds", "End-to-end request latency.", _E2E_BUCKETS)
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens of a finished request.", _TOKEN_BUCKETS)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens of a finished request.", _TOKEN_BUCKETS)
        self.client_service = Gauge(
            "cadence:client_service_tokens",
            "Tokens computed for each client since start (policy fair; the 16 most served by "
            "name, the rest as _other).", ["model_name", "client"], registry=self.registry)
        self._clients: set[str] = set()
        self._slo = Counter(
            "cadence:slo_requests", "Finished requests with latency targets (policy slo), by "
            "whether they met them.", ["model_name", "result"], registry=self.registry)
        self._num_queries = 0
        self._num_hits = 0
        self.spec_drafts = counter("spec_decode_num_drafts", "Drafts verified (one per request per step).")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self._spec_accepted_per_pos = Counter(
            "cadence:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position "
            "in the draft (0 first).", ["model_name", "position"], registry=self.registry)
        self.spec_acceptance_rate = gauge(
            "spec_decode_acceptance_rate", "Accepted / drafted tokens since the server started.")
        self.spec_mean_acceptance_length = gauge(
            "spec_decode_mean_acceptance_length",
            "Tokens per verifying step of a request (1 + accepted drafts) since the server started.")
        self._spec_totals: SpecDecodingStats | None = None
        self._frontend_gauges = {f.name: gauge(f"frontend_{f.name}", _FRONTEND_DOCS[f.name])
                                 for f in fields(FrontendState)}
        self._replica_up = Gauge(
            "cadence:dp_replica_up", "Data parallel: 1 while the engine replica serves, 0 once "
            "it died.", ["model_name", "replica"], registry=self.registry)
        self._read_replicas: Callable[[], list[bool]] | None = None

    # ---- StatLogger ---------------------------------------------------

    def record_scheduler_stats(self, stats: SchedulerStats) -> None:
        self.num_requests_running.set(stats.num_running_reqs)
        self.num_requests_waiting.set(stats.num_waiting_reqs)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        if stats.running_seats is not None:
            self.running_seats.set(stats.running_seats)
        for group, usage in (stats.kv_cache_group_usage or {}).items():
            self._kv_cache_group_usage.labels(self._model_name, group).set(usage)
        if stats.num_preemptions:
            self.num_preemptions.inc(stats.num_preemptions)
        prefix = stats.prefix_cache_stats
        queries = prefix.queries + prefix.preempted_queries if prefix is not None else 0
        if queries:
            hits = prefix.hits + prefix.preempted_hits
            self.prefix_cache_queries.inc(queries)
            self.prefix_cache_hits.inc(hits)
            self._num_queries += queries
            self._num_hits += hits
            self.prefix_cache_hit_rate.set(self._num_hits / self._num_queries)
        if stats.num_swapped_preemptions:
            self.num_swapped_preemptions.inc(stats.num_swapped_preemptions)
        external = stats.connector_prefix_cache_stats
        if external is not None and (external.queries or external.preempted_queries):
            self.external_prefix_cache_queries.inc(external.queries + external.preempted_queries)
            self.external_prefix_cache_hits.inc(external.hits + external.preempted_hits)
        if stats.client_service is not None:
            self._record_client_service(stats.client_service)
        if stats.spec_decoding_stats is not None:
            self._record_spec_decoding(stats.spec_decoding_stats)

    def _record_spec_decoding(self, spec: SpecDecodingStats) -> None:
        self.spec_drafts.inc(spec.num_drafts)
        self.spec_draft_tokens.inc(spec.num_draft_tokens)
        self.spec_accepted_tokens.inc(spec.num_accepted_tokens)
        for pos, count in enumerate(spec.num_accepted_tokens_per_pos):
            self._spec_accepted_per_pos.labels(self._model_name, str(pos)).inc(count)
        if self._spec_totals is None:
            self._spec_totals = SpecDecodingStats.new(spec.num_spec_tokens)
        self._spec_totals.add(spec)
        if self._spec_totals.num_drafts:
            self.spec_acceptance_rate.set(self._spec_totals.acceptance_rate or 0.0)
            self.spec_mean_acceptance_length.set(self._spec_totals.mean_acceptance_length)

    def _record_client_service(self, service: dict[str, int]) -> None:
        for client in self._clients - service.keys():  # fell out of the named set
            self.client_service.remove(self._model_name, client)
        for client, tokens in service.items():
            self.client_service.labels(self._model_name, client).set(tokens)
        self._clients = set(service)

    def record_first_token(self, ttft_s: float, num_prompt_tokens: int) -> None:
        self.ttft.observe(ttft_s)
        self.prompt_tokens.inc(num_prompt_tokens)

    def record_tokens(self, num_tokens: int, inter_token_latency_s: float | None) -> None:
        self.generation_tokens.inc(num_tokens)
        if inter_token_latency_s is not None:
            self.time_per_output_token.observe(inter_token_latency_s)

    def record_finished(self, e2e_s: float, ttft_s: float | None, finish_reason: str,
                        num_prompt_tokens: int, num_generation_tokens: int) -> None:
        self._request_success.labels(self._model_name, finish_reason).inc()
        self.e2e_latency.observe(e2e_s)
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(num_generation_tokens)
        if ttft_s is not None and num_generation_tokens > 1:
            self.request_time_per_output_token.observe((e2e_s - ttft_s) / (num_generation_tokens - 1))

    def record_slo(self, met: bool) -> None:
        self._slo.labels(self._model_name, "met" if met else "missed").inc()

    def watch_frontend(self, read: Callable[[], FrontendState]) -> None:
        for name, frontend_gauge in self._frontend_gauges.items():
            frontend_gauge.set_function(lambda name=name: getattr(read(), name))

    def watch_replicas(self, read: Callable[[], list[bool]]) -> None:
        """Data parallel: ``read()`` is each replica's liveness, by rank (read at scrape time)."""
        self._read_replicas = read

    def render(self) -> bytes:
        if self._read_replicas is not None:
            for rank, alive in enumerate(self._read_replicas()):
                self._replica_up.labels(self._model_name, str(rank)).set(int(alive))
        return prometheus_client.generate_latest(self.registry)


CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST
