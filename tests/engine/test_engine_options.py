"""EngineOptions.from_kwargs (flat options -> config classes) and parse_memory."""

import pytest

from cadence.config import (
    CacheConfig,
    EngineConfig,
    EngineOptions,
    SchedulerConfig,
    SpeculativeConfig,
    parse_memory,
)

GIB = 2**30


def test_defaults():
    options = EngineOptions.from_kwargs()
    assert options.engine == EngineConfig()
    assert options.scheduler == SchedulerConfig()
    assert options.cache == CacheConfig()
    assert options.speculative is None


def test_options_go_to_the_class_that_owns_them():
    options = EngineOptions.from_kwargs(
        model="m.gguf", dtype="float32", seed=7, max_num_seqs=4, max_model_len=128,
        policy="priority", block_size=32, kv_cache_memory="1GiB", enable_prefix_caching=False,
    )
    assert options.engine == EngineConfig(model="m.gguf", dtype="float32", seed=7)
    assert options.scheduler == SchedulerConfig(max_num_seqs=4, max_model_len=128, policy="priority")
    assert options.cache == CacheConfig(block_size=32, kv_cache_memory="1GiB", enable_prefix_caching=False)
    assert options.speculative is None


def test_unknown_option_is_named():
    with pytest.raises(ValueError, match=r"^max_num_sequences: unknown engine option"):
        EngineOptions.from_kwargs(max_num_seqs=4, max_num_sequences=8)


def test_invalid_value_is_named_by_its_class():
    with pytest.raises(ValueError, match=r"^max_num_seqs: "):
        EngineOptions.from_kwargs(max_num_seqs=0)
    with pytest.raises(ValueError, match=r"^dtype: "):
        EngineOptions.from_kwargs(dtype="int8")
    with pytest.raises(ValueError, match=r"^block_size: "):
        EngineOptions.from_kwargs(block_size=0)


def test_num_speculative_tokens_turns_speculative_decoding_on():
    options = EngineOptions.from_kwargs(num_speculative_tokens=4, prompt_lookup_max=5)
    assert options.speculative == SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=5)
    assert options.speculative.method == "ngram"


def test_zero_speculative_tokens_means_off():
    assert EngineOptions.from_kwargs(num_speculative_tokens=0).speculative is None


def test_invalid_speculative_option_is_named():
    with pytest.raises(ValueError, match=r"^prompt_lookup_min: "):
        EngineOptions.from_kwargs(num_speculative_tokens=2, prompt_lookup_min=4, prompt_lookup_max=2)


def test_options_are_frozen():
    options = EngineOptions.from_kwargs()
    with pytest.raises(AttributeError):
        options.scheduler.max_num_seqs = 3


# ------------------------------------------------------------ parse_memory


@pytest.mark.parametrize(
    "value, expected",
    [
        ("2GiB", 2 * GIB), ("512MiB", 512 * 2**20), ("64KiB", 64 * 1024),
        ("512MB", 512 * 10**6), ("2GB", 2 * 10**9), ("1kb", 1000), ("100B", 100),
        (" 1.5 GiB ", int(1.5 * GIB)), ("1073741824", GIB), (GIB, GIB), (4096, 4096),
    ],
)
def test_parse_memory_sizes(value, expected):
    assert parse_memory(value, available_bytes=8 * GIB) == expected


@pytest.mark.parametrize("value, expected", [("0.25", 2 * GIB), (0.5, 4 * GIB), ("0.125", GIB)])
def test_parse_memory_fraction_of_available(value, expected):
    assert parse_memory(value, available_bytes=8 * GIB) == expected


@pytest.mark.parametrize("value", ["lots", "GiB", "2 XB", "", "0", "-0.5", "nan", True])
def test_parse_memory_rejects_nonsense_naming_kv_cache_memory(value):
    with pytest.raises(ValueError, match=r"^kv_cache_memory: "):
        parse_memory(value, available_bytes=8 * GIB)


@pytest.mark.parametrize("value", ["inf", "infGiB"])
def test_parse_memory_rejects_infinity(value):
    with pytest.raises(ValueError, match=r"^kv_cache_memory: "):
        parse_memory(value, available_bytes=8 * GIB)


def test_parse_memory_rejects_negative_sizes():
    with pytest.raises(ValueError, match=r"^kv_cache_memory: "):
        parse_memory("-1GiB", available_bytes=8 * GIB)


def test_dtype_defaults_to_auto_and_accepts_every_name():
    assert EngineConfig().dtype == "auto"
    for name in ("auto", "float32", "bfloat16", "float16"):
        assert EngineOptions.from_kwargs(dtype=name).engine.dtype == name
    with pytest.raises(ValueError, match="^dtype:"):
        EngineOptions.from_kwargs(dtype="float8")


@pytest.mark.parametrize("option, value", [
    ("max_num_encoder_input_tokens", 512),
    ("encoder_cache_size", 1024),
    ("disable_chunked_mm_input", True),
])
def test_scheduler_options_no_engine_delivers_are_refused(option, value):
    # The scheduler takes them (its own tests set them); an engine would ignore them.
    SchedulerConfig(**{option: value})
    with pytest.raises(ValueError, match=f"^{option}: not supported yet"):
        EngineOptions.from_kwargs(**{option: value})
    with pytest.raises(ValueError, match=f"^{option}: not supported yet"):
        EngineOptions(EngineConfig(), SchedulerConfig(**{option: value}), CacheConfig())


def test_async_scheduling_is_refused_with_speculative_decoding():
    assert EngineOptions.from_kwargs(async_scheduling=True).scheduler.async_scheduling
    with pytest.raises(ValueError, match="^async_scheduling: not supported with speculative decoding"):
        EngineOptions.from_kwargs(async_scheduling=True, num_speculative_tokens=2, method="ngram")


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp", "draft_model", "medusa"])
def test_speculative_methods_without_a_drafter_are_refused(method):
    assert SpeculativeConfig(method=method).method == method  # the scheduler reserves lookahead for them
    with pytest.raises(ValueError, match="^method: .* not supported yet"):
        EngineOptions.from_kwargs(num_speculative_tokens=2, method=method)
    assert EngineOptions.from_kwargs(num_speculative_tokens=2, method="ngram").speculative.method == "ngram"


def test_every_cli_flag_is_delivered_or_refused():
    """Each generated flag is one the engine uses; the refused ones say so in their help."""
    import argparse

    from cadence.config_cli import add_config_options
    from cadence.config import UNDELIVERED_SCHEDULER_OPTIONS

    parser = argparse.ArgumentParser()
    add_config_options(parser)
    help_text = " ".join(parser.format_help().split())
    for name in UNDELIVERED_SCHEDULER_OPTIONS:
        flag = "--" + name.replace("_", "-")
        assert flag in help_text
        after = help_text.rsplit(flag, 1)[1][:400]  # the option listing, past the usage line
        assert "engines refuse it" in after, name


@pytest.mark.parametrize("value", [0.0, -0.1, 1.5])
def test_gpu_memory_utilization_out_of_range_is_named(value):
    with pytest.raises(ValueError, match=r"^gpu_memory_utilization: must be in \(0, 1\]"):
        EngineOptions.from_kwargs(gpu_memory_utilization=value)


def test_gpu_options_reach_their_classes_and_flags():
    import argparse

    from cadence.config_cli import add_config_options, options_of

    options = EngineOptions.from_kwargs(gpu_memory_utilization=0.5, enforce_eager=True)
    assert options.cache.gpu_memory_utilization == 0.5 and options.engine.enforce_eager
    parser = argparse.ArgumentParser()
    add_config_options(parser)
    args = parser.parse_args(["--gpu-memory-utilization", "0.7", "--enforce-eager"])
    parsed = options_of(args)
    assert parsed["gpu_memory_utilization"] == 0.7 and parsed["enforce_eager"] is True


def test_gpu_memory_utilization_is_refused_on_the_cpu():
    """It sizes a GPU's cache; on the CPU it would do nothing, so it is an error."""
    from cadence.engine.builder import assemble_engine
    from cadence.models.testing import random_model, tiny_config

    config = tiny_config()
    options = EngineOptions.from_kwargs(device="cpu", dtype="float32", gpu_memory_utilization=0.5)
    with pytest.raises(ValueError, match=r"^gpu_memory_utilization: applies on a CUDA device"):
        assemble_engine(options, random_model(config), config, None)


def test_rotary_tables_hold_the_engines_positions_only():
    """A model trained for more positions than max_model_len keeps max_model_len
    rows per table (Gemma 3's four 32k-row tables were 128 MiB), and generates
    as before: the tokens of a run at the model's full length are the same."""
    import io

    import torch

    from cadence.core.request import Request
    from cadence.engine.builder import assemble_engine
    from cadence.models.testing import random_model, tiny_config
    from cadence.sampling_params import SamplingParams

    config = tiny_config()  # 512 positions
    tokens = {}
    for max_model_len in (512, 64):
        torch.manual_seed(0)
        model = random_model(config)
        options = EngineOptions.from_kwargs(device="cpu", dtype="float32", max_model_len=max_model_len,
                                            num_gpu_blocks=32)
        engine = assemble_engine(options, model, config, None, log=io.StringIO())
        assert model.model.rotary.cos.shape[0] == max_model_len
        assert model.model.rotary.sin.shape[0] == max_model_len
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        engine.core.add_request(Request("r", list(range(3, 30)), params))
        out = []
        while engine.core.scheduler.has_requests():
            for outputs in engine.core.step().values():
                out += [t for o in outputs.outputs for t in o.new_token_ids]
        tokens[max_model_len] = out
    assert len(tokens[64]) == 24 and tokens[64] == tokens[512]
