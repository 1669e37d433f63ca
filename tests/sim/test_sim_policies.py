"""Policy comparison and prefix caching through the simulator."""

from tests.sim.sim_helpers import LinearCost, configs

from cadence.sim.simulator import Simulator, compare_policies
from cadence.sim.workload import PromptMaker, SyntheticWorkload


def overload(**fields):
    # 300 requests in ~3 s on a machine that serves far fewer: a queue builds up.
    return SyntheticWorkload(num_requests=300, rate=100, prompt_len="uniform:50:200",
                             output_len="uniform:10:40", priorities="0,1", seed=4, **fields).generate()


def test_policies_run_on_identical_workloads():
    specs = overload()
    prompts: dict[str, list[list[int]]] = {}

    class RecordingMaker(PromptMaker):
        def make(self, index, spec):
            tokens = super().make(index, spec)
            prompts.setdefault(self.label, []).append(tokens)
            return tokens

    labels = iter(["fcfs", "priority"])

    def maker():
        m = RecordingMaker()
        m.label = next(labels)
        return m

    cost = LinearCost(base=5e-3, per_token=1e-4)
    results = compare_policies(specs, ["fcfs", "priority"], *configs(max_num_seqs=8), cost,
                               prompt_maker_factory=maker)
    assert set(results) == {"fcfs", "priority"}
    assert prompts["fcfs"] and len(prompts["fcfs"]) == len(prompts["priority"]) == len(specs)
    assert sorted(prompts["fcfs"]) == sorted(prompts["priority"])
    for result in results.values():
        assert result.recorder.specs is specs
        assert result.recorder.num_output == [s.output_tokens for s in specs]
    # Under overload, priority serves priority-0 requests first.
    fcfs, priority = (results[p].summary()["per_priority"] for p in ("fcfs", "priority"))
    assert priority["0"]["ttft_p50_s"] < fcfs["0"]["ttft_p50_s"]
    assert priority["1"]["ttft_p50_s"] > fcfs["1"]["ttft_p50_s"]


def test_shared_prefix_groups_give_prefix_hits():
    grouped = overload(prefix_groups=2, prefix_fraction=1.0, prefix_tokens=48)
    alone = overload()
    hit = Simulator(*configs(), LinearCost()).run(grouped).summary()["prefix_hit_rate"]
    miss = Simulator(*configs(), LinearCost()).run(alone).summary()["prefix_hit_rate"]
    assert miss == 0.0
    # 48 shared tokens = 3 full blocks of 16 per request, all but the first of each group hit.
    total_prompt = sum(s.prompt_tokens for s in grouped)
    assert hit == (len(grouped) - 2) * 48 / total_prompt
