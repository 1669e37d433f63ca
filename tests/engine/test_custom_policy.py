"""A scheduling policy from outside the package, chosen by name, through the
offline ``LLM`` and ``cadence simulate`` (the server's engine process imports
it the same way: ``--policy package.module:factory``)."""

import json

from cadence.engine import LLM
from cadence.sampling_params import SamplingParams

POLICY = "tests.plugins.shortest_first:ShortestPromptFirst"


def test_llm_runs_a_policy_named_by_its_import_path():
    llm = LLM(dtype="float32", max_num_seqs=1, kv_cache_memory="64MiB", max_model_len=256,
              policy=POLICY)
    assert type(llm.engine.core.scheduler.policy).__name__ == "ShortestPromptFirst"
    prompts = ["Tell me a long story about a cat who lives on a boat and sails far.", "Hi"]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                           use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [4, 4]


def test_simulate_compares_a_policy_named_by_its_import_path(tmp_path, capsys):
    import argparse

    from cadence.sim.cli import add_simulate_parser

    parser = argparse.ArgumentParser()
    add_simulate_parser(parser.add_subparsers(dest="command", required=True))
    out = tmp_path / "out"
    args = parser.parse_args(["simulate", "--policy", f"fcfs,{POLICY}", "--num-requests", "80",
                              "--rate", "50", "--out", str(out)])
    assert args.func(args) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["policies"]) == {"fcfs", POLICY}
