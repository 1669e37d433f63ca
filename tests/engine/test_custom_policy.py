"""A scheduling policy from outside the package, chosen by name, through the
offline ``LLM`` and ``cadence simulate``: by import path, by the name it
registered in this process, and by the name an installed package declares
(entry points). ``cadence serve``: tests/server/test_custom_policy_server.py."""

import importlib
import json

import pytest

from cadence.config import SchedulerConfig

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


@pytest.fixture
def installed_plugin(tmp_path, monkeypatch):
    from tests.plugins.installed import install_plugin

    monkeypatch.syspath_prepend(str(install_plugin(tmp_path)))
    importlib.invalidate_caches()


def test_a_registered_name_runs_in_this_process():
    import tests.plugins.shortest_first  # noqa: F401  (registers "shortest-first")

    llm = LLM(dtype="float32", max_num_seqs=1, kv_cache_memory="64MiB", max_model_len=256,
              policy="shortest-first")
    assert type(llm.engine.core.scheduler.policy).__name__ == "ShortestPromptFirst"


def test_an_installed_packages_name_selects_its_policy(installed_plugin, tmp_path, capsys):
    assert SchedulerConfig(policy="shortest-first-installed").policy == "shortest-first-installed"
    llm = LLM(dtype="float32", max_num_seqs=1, kv_cache_memory="64MiB", max_model_len=256,
              policy="shortest-first-installed")
    assert type(llm.engine.core.scheduler.policy).__name__ == "ShortestPromptFirst"
    outputs = llm.generate(["Hi"], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                           use_tqdm=False)
    assert len(outputs[0].outputs[0].token_ids) == 3
    import argparse

    from cadence.sim.cli import add_simulate_parser

    parser = argparse.ArgumentParser()
    add_simulate_parser(parser.add_subparsers(dest="command", required=True))
    out = tmp_path / "out"
    args = parser.parse_args(["simulate", "--policy", "fcfs,shortest-first-installed",
                              "--num-requests", "40", "--rate", "50", "--out", str(out)])
    assert args.func(args) == 0
    assert set(json.loads((out / "summary.json").read_text())["policies"]) == \
        {"fcfs", "shortest-first-installed"}


def test_an_unknown_name_lists_the_installed_ones(installed_plugin):
    with pytest.raises(ValueError, match=r"^policy: must be one of .*'short-prompts-only'"):
        SchedulerConfig(policy="no-such-policy")
