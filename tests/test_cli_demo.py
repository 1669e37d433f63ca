"""`cadence demo` drives the installed scheduler (no bench/ file needed)."""

from cadence.cli import main


def test_demo_times_the_real_scheduler(capsys):
    assert main(["demo", "--num-requests", "4", "--max-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("4 requests,") and "12 tokens" in out and "us/step" in out


def test_generate_applies_an_adapter_given_with_lora(tmp_path, capsys):
    from cadence.models.default_model import default_model_path
    from cadence.models.gguf_loader import gguf_model_config, read_gguf
    from cadence.models.testing import write_random_adapter

    write_random_adapter(str(tmp_path / "adapter"), gguf_model_config(*read_gguf(default_model_path())),
                         rank=4, std=0.5, seed=3)
    common = ["generate", "--raw", "--max-tokens", "8", "--dtype", "float32", "The sky is"]
    assert main(common) == 0
    base = capsys.readouterr().out
    assert main([*common[:-1], "--lora", str(tmp_path / "adapter"), common[-1]]) == 0
    adapted = capsys.readouterr().out
    assert base.startswith(">>> The sky is") and adapted.startswith(">>> The sky is")
    assert adapted != base  # a strong random adapter changes the greedy answer


def test_generate_refuses_enable_lora_without_an_adapter(capsys):
    assert main(["generate", "--enable-lora", "Hi"]) == 2
    assert "enable_lora: cadence generate applies an adapter given with --lora PATH" in capsys.readouterr().err


def test_generate_continues_raw_text_where_the_model_has_no_chat_template(tmp_path, capsys):
    """A base model's GGUF (Gemma 3 270M's has none) is not an error: the prompt
    is continued as with --raw, and the log says so."""
    from cadence.models.default_model import default_model_path
    from tests.models.gguf_split_helpers import write_without_keys

    model = write_without_keys(default_model_path(), tmp_path / "base.gguf", ("tokenizer.chat_template",))
    common = ["generate", "--max-tokens", "4", "--temperature", "0", "--kv-cache-memory", "32MiB"]
    assert main([*common, "--model", str(model), "The capital of France is"]) == 0
    captured = capsys.readouterr()
    assert "no chat template: prompts are continued as raw text" in captured.err
    assert main([*common, "--raw", "The capital of France is"]) == 0
    assert captured.out == capsys.readouterr().out  # the default model's, raw: the same tokens
