"""Every runner the engine can be given satisfies the whole ``Runner``
protocol: the engine calls these methods directly, never probing."""

import inspect

import pytest

from cadence.core.testing import FakeRunner
from cadence.engine.core import Runner
from cadence.runner.model_runner import ModelRunner
from cadence.runner.tp_runner import DriverRunner, ShardRunner
from cadence.sim.runner import SimRunner

METHODS = [name for name, member in inspect.getmembers(Runner, inspect.isfunction)
           if not name.startswith("_")]


def test_the_protocol_names_what_the_engine_calls():
    assert sorted(METHODS) == ["add_lora", "execute_model", "list_loras", "remove_lora", "shutdown"]


@pytest.mark.parametrize("cls", [ModelRunner, DriverRunner, ShardRunner, SimRunner, FakeRunner])
def test_each_runner_has_every_method(cls):
    for name in METHODS:
        assert callable(getattr(cls, name, None)), f"{cls.__name__}.{name}"


def test_a_runner_without_adapters_refuses_one_and_lists_none():
    runner = FakeRunner()
    with pytest.raises(ValueError, match=r"^lora_request: "):
        runner.add_lora(None)
    assert runner.list_loras() == [] and runner.remove_lora(3) is False
    assert isinstance(runner, Runner)
