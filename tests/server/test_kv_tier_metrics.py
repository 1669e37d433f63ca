"""/metrics counts the host-memory tier's hits apart from the prefix cache's,
and swapped preemptions apart from recomputed ones."""

from cadence.core.outputs import PrefixCacheStats, SchedulerStats
from cadence.server.metrics import PrometheusStatLogger


def sample(text: str, name: str) -> float:
    [line] = [line for line in text.splitlines() if line.startswith(f"cadence:{name}{{")]
    return float(line.rsplit(" ", 1)[1])


def test_tier_hits_and_swaps_have_their_own_counters():
    logger = PrometheusStatLogger("m")
    logger.record_scheduler_stats(SchedulerStats(
        prefix_cache_stats=PrefixCacheStats(requests=2, queries=60, hits=8),
        connector_prefix_cache_stats=PrefixCacheStats(requests=1, queries=30, hits=20,
                                                      preempted_requests=1, preempted_queries=25,
                                                      preempted_hits=24),
        num_preemptions=3, num_swapped_preemptions=2,
    ))
    logger.record_scheduler_stats(SchedulerStats())  # a step with nothing to count
    text = logger.render().decode()
    assert sample(text, "prefix_cache_queries_total") == 60
    assert sample(text, "prefix_cache_hits_total") == 8
    assert sample(text, "external_prefix_cache_queries_total") == 55
    assert sample(text, "external_prefix_cache_hits_total") == 44
    assert sample(text, "num_preemptions_total") == 3
    assert sample(text, "num_swapped_preemptions_total") == 2
