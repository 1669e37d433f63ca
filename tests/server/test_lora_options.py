"""LoRA server options without a server: --lora-modules parsing and the checks at build."""

import argparse

import pytest

from cadence.config import EngineOptions
from cadence.server.api import build_app, lora_modules_of
from cadence.server.cli import add_serve_parser, server_config_from_args
from cadence.server.config import ServerConfig, parse_lora_modules


def parse(argv):
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_lora_modules_take_name_path_and_json_forms():
    args = parse(["--lora-modules", "a=/x", '{"name": "b", "path": "/y"}', "--lora-modules", "c=/z=1"])
    config = server_config_from_args(args)
    assert parse_lora_modules(config.lora_modules) == [("a", "/x"), ("b", "/y"), ("c", "/z=1")]


@pytest.mark.parametrize("item, message", [
    ("no-path", "expected name=path"), ("=/x", "expected name=path"),
    ('{"name": "a"}', "expected name=path"), ("{oops", "cannot read"),
])
def test_bad_lora_modules_are_refused(item, message):
    with pytest.raises(ValueError, match=f"^lora_modules: {message}"):
        ServerConfig(lora_modules=(item,))
    with pytest.raises(ValueError, match="^lora_modules: the name 'a' is given twice"):
        ServerConfig(lora_modules=("a=/x", "a=/y"))


def test_runtime_updating_from_vllm_env(monkeypatch):
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    assert server_config_from_args(parse([])).allow_runtime_lora_updating
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    assert not server_config_from_args(parse([])).allow_runtime_lora_updating


def test_adapters_need_enable_lora():
    with pytest.raises(ValueError, match="^lora_modules: serving LoRA adapters needs --enable-lora"):
        build_app(ServerConfig(lora_modules=("a=/x",)), EngineOptions.from_kwargs())
    with pytest.raises(ValueError, match="^allow_runtime_lora_updating: .*needs --enable-lora"):
        build_app(ServerConfig(allow_runtime_lora_updating=True), EngineOptions.from_kwargs())
    assert lora_modules_of(ServerConfig(lora_modules=("a=/x",)),
                           EngineOptions.from_kwargs(enable_lora=True)) == [("a", "/x")]


def test_enable_lora_with_no_adapter_to_serve_is_refused():
    with pytest.raises(ValueError, match="^enable_lora: no request could name an adapter"):
        lora_modules_of(ServerConfig(), EngineOptions.from_kwargs(enable_lora=True))
    assert lora_modules_of(ServerConfig(allow_runtime_lora_updating=True),
                           EngineOptions.from_kwargs(enable_lora=True)) == []
