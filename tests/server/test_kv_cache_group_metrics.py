"""/metrics reports each KV cache group's share of the blocks (a model with
sliding windows), beside the whole cache's; one group of full attention
reports none."""

from cadence.core.kv_cache import plan_kv_cache_layout
from cadence.core.testing import FakeRunner, new_request, new_scheduler, step
from cadence.server.metrics import PrometheusStatLogger


def samples(text: str, name: str) -> dict[str, float]:
    lines = [line for line in text.splitlines() if line.startswith(f"cadence:{name}{{")]
    return {line.split('group="')[1].split('"')[0] if 'group="' in line else "": float(line.rsplit(" ", 1)[1])
            for line in lines}


def test_each_group_reports_its_share_and_they_add_up():
    layout = plan_kv_cache_layout(3, 8, (2,))  # full [2]; window 8 [0], [1]
    scheduler = new_scheduler(num_gpu_blocks=101, block_size=4, max_num_batched_tokens=64,
                              kv_cache_layout=layout, log_stats=True)
    runner = FakeRunner(block_size=4, sliding_windows=layout.sliding_windows)
    scheduler.add_request(new_request("a", 60, max_tokens=20))
    for _ in range(3):  # the prompt, then decodes: the window groups dropped what is behind
        step(scheduler, runner)
    logger = PrometheusStatLogger("m")
    logger.record_scheduler_stats(scheduler.make_stats())
    text = logger.render().decode()
    groups = samples(text, "kv_cache_group_usage_perc")
    assert set(groups) == {"0:full", "1:window8", "2:window8"}
    assert groups["0:full"] == 16 / 100  # 62 tokens: 16 blocks
    assert groups["1:window8"] == groups["2:window8"] == 3 / 100  # positions 55..63
    assert abs(sum(groups.values()) - samples(text, "kv_cache_usage_perc")[""]) < 1e-9


def test_one_group_reports_no_group_usage():
    scheduler = new_scheduler(log_stats=True)
    scheduler.add_request(new_request("a", 10, max_tokens=2))
    step(scheduler, FakeRunner(block_size=4))
    stats = scheduler.make_stats()
    assert stats.kv_cache_group_usage is None
    logger = PrometheusStatLogger("m")
    logger.record_scheduler_stats(stats)
    assert samples(logger.render().decode(), "kv_cache_group_usage_perc") == {}
