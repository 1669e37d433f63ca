#!/usr/bin/env python3
"""Scheduling scenarios in the simulator: priority displacement and prefill caps (issue 12).

Llama-3-8B on the H100 roofline, several seeds, each scenario against its
baseline on the same trace:

- ``priority``: priorities 0 (a fifth of the requests) and 1 at 1.3x capacity,
  ``max_num_seqs`` 64 so the running slots, not the KV cache, are what runs
  out. Baseline: the same policy with displacement turned off (the behaviour
  before issue 12's item 3: preemption only when blocks run out). Figure:
  p99 TTFT of the priority-0 requests.
- ``long-prompt``: chat requests (prompts ~256, outputs ~128) at 60% of
  capacity, and one prompt of 32,768 tokens arriving at t=10 s. Baseline:
  the same trace without it; against: with it, with and without the caps
  (``long_prefill_token_threshold`` 512, ``max_num_partial_prefills`` 4,
  ``max_long_partial_prefills`` 1). Figure: p99 TTFT of the chat requests.

    python bench/sim_scheduling.py            # ~20 seconds
    python bench/sim_scheduling.py --cpu-calibration bench/results/cpu_calibrated.json

With ``--cpu-calibration`` (a model from ``cadence simulate calibrate``, the
default SmolLM2 on this CPU) the same scenarios run at the CPU's scale:
prompts ~128 and outputs ~64 tokens, a 512-token budget, rates scaled to
its capacity (~2.8 req/s), and a long prompt of 8,000 tokens (the model's
context is 8,192).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cadence.config import CacheConfig, SchedulerConfig  # noqa: E402
from cadence.core.sched.policy import PriorityPolicy, register_policy  # noqa: E402
from cadence.sim.cost_model import LLAMA_3_8B, PROFILES, ModelShape, RooflineCostModel  # noqa: E402
from cadence.sim.simulator import Simulator  # noqa: E402
from cadence.sim.workload import RequestSpec, SyntheticWorkload  # noqa: E402


class PriorityWithoutDisplacement(PriorityPolicy):
    """The priority policy as it was before displacement at max_num_seqs."""

    def displace(self, waiting, running):
        return None


register_policy("priority-no-displace")(PriorityWithoutDisplacement)


# Each profile's scale: lengths, budgets, rates (a fraction of its capacity) and the long prompt.
H100_SCALE = dict(prompt="lognormal:512:1.0", output="lognormal:128:1.0", chat_prompt="lognormal:256:0.5",
                  chat_output="lognormal:128:0.5", budget=8192, priority_rate=45.0, chat_rate=20.0,
                  long_prompt=32768, max_model_len=40000, threshold=512, num_requests=3000)
CPU_SCALE = dict(prompt="lognormal:128:1.0", output="lognormal:64:1.0", chat_prompt="lognormal:64:0.5",
                 chat_output="lognormal:32:0.5", budget=512, priority_rate=3.6, chat_rate=1.7,
                 long_prompt=8000, max_model_len=8192, threshold=128, num_requests=1200)
SCALE = dict(H100_SCALE)
COST_MODEL = {"model": None}


def cost_model():
    if COST_MODEL["model"] is not None:
        return COST_MODEL["model"]
    return RooflineCostModel(PROFILES["h100"], ModelShape.from_hf_config(LLAMA_3_8B))


def simulate(specs, config: SchedulerConfig, policy: str):
    config = dataclasses.replace(config, policy="priority") if policy.startswith("priority") else config
    blocks = getattr(cost_model(), "kv_blocks", None)
    simulator = Simulator(config, CacheConfig(block_size=16, num_gpu_blocks=blocks), cost_model())
    if policy == "priority-no-displace":
        simulator.scheduler._displace = None  # the hook the scheduler calls at max_num_seqs
    return simulator.run(specs, label=policy).summary()


def ttft_p99(summary, key, group):
    return summary[key][str(group)]["ttft_p99_s"]


def priority_scenario(seed: int) -> dict:
    specs = SyntheticWorkload(num_requests=SCALE["num_requests"], rate=SCALE["priority_rate"],
                              prompt_len=SCALE["prompt"], output_len=SCALE["output"],
                              priorities="0,1,1,1,1", seed=seed).generate()
    config = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=SCALE["budget"],
                             max_model_len=8192, policy="priority")
    before = simulate(specs, config, "priority-no-displace")
    after = simulate(specs, config, "priority")
    return {
        "high_ttft_p99_s": {"before": ttft_p99(before, "per_priority", 0),
                            "after": ttft_p99(after, "per_priority", 0)},
        "low_ttft_p99_s": {"before": ttft_p99(before, "per_priority", 1),
                           "after": ttft_p99(after, "per_priority", 1)},
        "output_tokens_per_s": {"before": before["throughput"]["output_tokens_per_s"],
                                "after": after["throughput"]["output_tokens_per_s"]},
        "preemptions": {"before": before.get("preemptions"), "after": after.get("preemptions")},
    }


def long_prompt_scenario(seed: int) -> dict:
    chat = SyntheticWorkload(num_requests=1200, rate=SCALE["chat_rate"], prompt_len=SCALE["chat_prompt"],
                             output_len=SCALE["chat_output"], max_len=2048, seed=seed).generate()
    arrival = chat[len(chat) // 10].arrival_time  # a tenth of the way in
    long_prompt = RequestSpec(arrival_time=arrival, prompt_tokens=SCALE["long_prompt"], output_tokens=16,
                              client=1)
    with_long = sorted([*chat, long_prompt], key=lambda s: s.arrival_time)
    base = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=SCALE["budget"],
                           max_model_len=SCALE["max_model_len"])
    capped = dataclasses.replace(base, long_prefill_token_threshold=SCALE["threshold"],
                                 max_num_partial_prefills=4, max_long_partial_prefills=1)
    runs = {"without long prompt": simulate(chat, base, "fcfs"),
            "with it, no caps": simulate(with_long, base, "fcfs"),
            "with it, caps": simulate(with_long, capped, "fcfs")}
    return {name: {"chat_ttft_p99_s": ttft_p99(summary, "per_client", 0),
                   "chat_ttft_p50_s": summary["per_client"]["0"]["ttft_p50_s"],
                   "output_tokens_per_s": summary["throughput"]["output_tokens_per_s"]}
            for name, summary in runs.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--cpu-calibration", metavar="PATH",
                        help="run at the CPU's scale on this calibrated cost model")
    args = parser.parse_args()
    if args.cpu_calibration:
        from cadence.sim.cost_model import CalibratedCostModel

        COST_MODEL["model"] = CalibratedCostModel.load(args.cpu_calibration)
        SCALE.update(CPU_SCALE)
    results = {"priority": {}, "long-prompt": {}}
    for seed in range(args.seeds):
        results["priority"][seed] = priority_scenario(seed)
        results["long-prompt"][seed] = long_prompt_scenario(seed)
        print(f"seed {seed}: priority {json.dumps(results['priority'][seed])}", flush=True)
        print(f"seed {seed}: long prompt {json.dumps(results['long-prompt'][seed])}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
