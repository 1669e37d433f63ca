"""Models by name (issue 38): a Hub id is downloaded once into the Hugging Face cache and
loaded from there; each failure is one line saying what to do.

No test reaches the network. Downloads run in a subprocess whose environment points
HF_ENDPOINT at a stand-in Hub on loopback (tests/models/hub_standin.py) with HF_HUB_OFFLINE
off for that process only (huggingface_hub reads both when imported); offline runs read a
cache filled by an earlier download or by huggingface_hub itself, as another tool would.
"""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cadence.config import EngineConfig
from cadence.models.default_model import default_model_path, model_name_of
from cadence.models.gguf_loader import read_gguf
from cadence.models.hub import parse_hub_id, resolve_model
from cadence.models.hub_files import Choice, ChoiceError, choose_files, weight_files
from tests.models.hub_standin import (
    GATED_REPO, GATED_TOKEN, GGUF_DEFAULT_FILE, GGUF_REPO, GGUF_SHARDS, TINY_REPO, TINY_UNWANTED,
    StandInHub, add_test_repos, hub_env,
)

RESOLVE = """
import json, sys
from cadence.models.hub import resolve_model
try:
    print(json.dumps({"path": resolve_model(*json.loads(sys.argv[1]))}))
except ValueError as err:
    print(json.dumps({"error": type(err).__name__, "message": str(err)}))
"""


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    with StandInHub() as hub:
        add_test_repos(hub, str(tmp_path_factory.mktemp("repos")))
        yield hub


@pytest.fixture
def fresh(hub):
    """A test's view of the stand-in: its request log starts empty, and it must see no
    request huggingface_hub should not make (the agent-harness list it asks for aside)."""
    hub.clear_log()
    yield hub
    assert set(hub.unknown_paths) <= {"/api/agent-harnesses"}, hub.unknown_paths


def resolve(env: dict[str, str], spec: str, revision: str | None = None,
            download_dir: str | None = None) -> dict:
    """resolve_model in a subprocess under ``env``: {"path": ...} or {"error", "message"}."""
    done = subprocess.run([sys.executable, "-c", RESOLVE, json.dumps([spec, revision, download_dir])],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return {**json.loads(done.stdout.splitlines()[-1]), "log": done.stderr}


def cadence(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cadence.cli", *args], env=env, capture_output=True,
                          text=True, timeout=300)


def one_line(result: dict) -> str:
    message = result["message"]
    assert result["error"] == "ModelFetchError" and "\n" not in message, result
    return message


# ---------------------------------------------------------------- which files, pure


GGUF_LISTING = ["README.md", "Qwen3-0.6B-Q4_K_M.gguf", "Qwen3-0.6B-Q8_0.gguf", "Qwen3-0.6B-IQ4_XS.gguf",
                "mmproj-Qwen3-F16.gguf", *[f"BF16/Qwen3-0.6B-BF16-{n:05d}-of-00002.gguf" for n in (1, 2)]]


def test_a_gguf_repository_gives_q4_k_m_by_default_or_the_quant_named_in_any_case():
    assert choose_files(GGUF_LISTING, None) == Choice("gguf", ("Qwen3-0.6B-Q4_K_M.gguf",),
                                                      "Qwen3-0.6B-Q4_K_M.gguf", "Q4_K_M")
    assert choose_files(GGUF_LISTING, "q8_0").files == ("Qwen3-0.6B-Q8_0.gguf",)
    assert choose_files(GGUF_LISTING, "IQ4_XS").entry == "Qwen3-0.6B-IQ4_XS.gguf"
    bf16 = choose_files(GGUF_LISTING, "bf16")  # split, in a folder: every shard, the first loaded
    assert bf16.files == tuple(f"BF16/Qwen3-0.6B-BF16-{n:05d}-of-00002.gguf" for n in (1, 2))
    assert bf16.entry == bf16.files[0]
    assert choose_files(GGUF_LISTING, "Qwen3-0.6B-Q8_0.gguf").label == "Q8_0"  # a file by name


def test_without_q4_k_m_the_only_quant_is_taken_and_several_are_listed():
    assert choose_files(["m-Q8_0.gguf", "mmproj-F16.gguf"], None).files == ("m-Q8_0.gguf",)
    with pytest.raises(ChoiceError, match=r"has no Q4_K_M GGUF; its quantizations: IQ4_XS, Q8_0"):
        choose_files(["m-Q8_0.gguf", "m-IQ4_XS.gguf"], None)
    with pytest.raises(ChoiceError, match=r"has no Q2_K GGUF; its quantizations: BF16, IQ4_XS, Q4_K_M, Q8_0"):
        choose_files(GGUF_LISTING, "Q2_K")


def test_a_split_quant_missing_a_shard_or_two_files_of_one_quant_are_refused():
    with pytest.raises(ChoiceError, match="lists 1 of the 3 shards of its Q4_1 GGUF"):
        choose_files(["m-Q4_1-00001-of-00003.gguf"], "Q4_1")
    with pytest.raises(ChoiceError, match="several Q8_0 GGUF models .*owner/name:FILE.gguf"):
        choose_files(["a/m-Q8_0.gguf", "b/m-Q8_0.gguf"], "Q8_0")


def test_a_safetensors_checkpoint_is_preferred_and_its_index_names_the_weights():
    listing = ["config.json", "tokenizer.json", "model-00001-of-00002.safetensors",
               "model-00002-of-00002.safetensors", "consolidated.safetensors", "model.safetensors.index.json",
               "chat_template.jinja", "original/params.json", "model-Q4_K_M.gguf", "pytorch_model.bin"]
    choice = choose_files(listing, None)
    assert choice.kind == "safetensors" and choice.entry is None
    assert choice.files == ("chat_template.jinja", "config.json", "model.safetensors.index.json", "tokenizer.json")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    assert weight_files(listing, index) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert weight_files(["config.json", "model.safetensors", "x/y.safetensors"], None) == ["model.safetensors"]
    assert choose_files(listing, "Q4_K_M").kind == "gguf"  # a quant asks for the GGUF
    with pytest.raises(ChoiceError, match="has no GGUF files, and ':Q4_K_M' names a GGUF quantization"):
        choose_files(["config.json", "tokenizer.json", "model.safetensors"], "Q4_K_M")
    with pytest.raises(ChoiceError, match="has no tokenizer.json"):
        choose_files(["config.json", "model.safetensors"], None)
    with pytest.raises(ChoiceError, match="neither a safetensors checkpoint"):
        choose_files(["config.json", "pytorch_model.bin"], None)


# ---------------------------------------------------------------- names and local paths


def test_what_is_a_hub_id(tmp_path):
    assert parse_hub_id("Qwen/Qwen3-0.6B").repo == "Qwen/Qwen3-0.6B"
    model = parse_hub_id("unsloth/Qwen3-0.6B-GGUF:Q4_K_M")
    assert (model.repo, model.quant) == ("unsloth/Qwen3-0.6B-GGUF", "Q4_K_M")
    assert parse_hub_id("o/n:BF16/n-BF16-00001-of-00002.gguf").quant == "BF16/n-BF16-00001-of-00002.gguf"
    for path in ("./model.gguf", "/models/x", "models/qwen/x", "dir/model.gguf", "gpt2", "a--b/c", "a/b..c"):
        assert parse_hub_id(path) is None, path
    assert model_name_of("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"
    assert model_name_of("unsloth/Qwen3-0.6B-GGUF:Q8_0") == "unsloth/Qwen3-0.6B-GGUF:Q8_0"
    assert model_name_of(default_model_path()) == "SmolLM2-135M-Instruct.Q4_1"
    assert model_name_of(None) == "SmolLM2-135M-Instruct"


def test_local_paths_are_returned_as_they_are_and_bad_names_refused(tmp_path):
    assert resolve_model(None) is None
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    with pytest.raises(ValueError, match=r"^model: no such file or folder: ./missing.gguf \(a Hugging Face"):
        resolve_model("./missing.gguf")
    with pytest.raises(ValueError, match="revision: .* is a local path; --revision applies to a model"):
        resolve_model(str(tmp_path), revision="main")
    with pytest.raises(ValueError, match="revision: applies to a model given by its Hub id"):
        EngineConfig(revision="main")
    with pytest.raises(ValueError, match="download_dir: must be a non-empty name"):
        EngineConfig(model="Qwen/Qwen3-0.6B", download_dir=" ")
    with pytest.raises(ValueError, match="download_dir: .* is a file, not a folder"):
        resolve_model("Qwen/Qwen3-0.6B", download_dir=default_model_path())


# ---------------------------------------------------------------- downloads from the stand-in


def test_a_gguf_is_downloaded_once_then_served_from_the_cache(fresh, tmp_path):
    env = hub_env(fresh, str(tmp_path))
    first = resolve(env, GGUF_REPO)
    assert first["path"].startswith(str(tmp_path / "cache" / "models--cadence-test--SmolLM2-135M-Instruct-GGUF"))
    assert first["path"].endswith(GGUF_DEFAULT_FILE)
    assert filecmp.cmp(first["path"], default_model_path(), shallow=False)
    assert "Fetching 1 files" in first["log"] and "fetching its Q4_K_M GGUF" in first["log"]
    assert len(fresh.file_gets()) == 1  # neither the shards nor the vision projector
    assert resolve(env, GGUF_REPO)["path"] == first["path"]
    assert len(fresh.file_gets()) == 1  # the second run downloads nothing
    fresh.clear_log()
    offline = resolve(hub_env(fresh, str(tmp_path), HF_HUB_OFFLINE="1"), GGUF_REPO)
    assert offline["path"] == first["path"] and "HF_HUB_OFFLINE is set" in offline["log"]
    assert fresh.requests == []


def test_a_split_quant_downloads_every_shard_and_loads_from_the_first(fresh, tmp_path):
    found = resolve(hub_env(fresh, str(tmp_path)), f"{GGUF_REPO}:q4_1")
    assert found["path"].endswith(GGUF_SHARDS[0]) and "Q4_1 GGUF in 3 shards" in found["log"]
    reader, _ = read_gguf(found["path"])
    assert len(reader.files) == 3 and len(reader.tensors) == 272
    assert sorted(Path(r["path"]).name for r in fresh.file_gets()) == list(GGUF_SHARDS)


def test_a_quant_the_repository_lacks_lists_those_it_has(fresh, tmp_path):
    message = one_line(resolve(hub_env(fresh, str(tmp_path)), f"{GGUF_REPO}:Q8_0"))
    assert message == (f"model: {GGUF_REPO} (revision main) has no Q8_0 GGUF; its quantizations: "
                       "Q4_1, Q4_K_M (name one as owner/name:QUANT)")
    assert fresh.file_gets() == []


def test_a_missing_repository_or_revision(fresh, tmp_path):
    env = hub_env(fresh, str(tmp_path))
    message = one_line(resolve(env, "cadence-test/no-such-model"))
    assert message == (f"model: cadence-test/no-such-model is no local file or folder, and {fresh.url} has "
                       "no repository cadence-test/no-such-model: check the id, or set HF_TOKEN to a token "
                       "with access if it is private")
    message = one_line(resolve(env, GGUF_REPO, revision="v9"))
    assert message == f"model: {GGUF_REPO} has no revision 'v9' on {fresh.url}: check --revision (a branch, tag or commit)"
    commit = fresh.repos[GGUF_REPO].sha
    assert f"/snapshots/{commit}/" in resolve(env, GGUF_REPO, revision=commit)["path"]


def test_a_gated_repository_needs_a_token_with_access(fresh, tmp_path):
    message = one_line(resolve(hub_env(fresh, str(tmp_path)), GATED_REPO))
    assert message == (f"model: {GATED_REPO} on {fresh.url} is gated: accept its terms on "
                       f"{fresh.url}/{GATED_REPO} and set HF_TOKEN to a token of that account")
    message = one_line(resolve(hub_env(fresh, str(tmp_path), HF_TOKEN="hf_someone_else"), GATED_REPO))
    assert "is gated and the token (HF_TOKEN) has no access" in message
    found = resolve(hub_env(fresh, str(tmp_path), HF_TOKEN=GATED_TOKEN), GATED_REPO)
    assert found["path"].endswith("gated-Q4_K_M.gguf")
    assert fresh.file_gets(GATED_REPO)[-1]["authorization"] == f"Bearer {GATED_TOKEN}"


def test_no_network_or_offline_without_the_model_in_the_cache(tmp_path):
    message = one_line(resolve(hub_env(None, str(tmp_path)), GGUF_REPO))
    assert message.startswith(f"model: {GGUF_REPO} (revision main) is not in the Hugging Face cache at "
                              f"{tmp_path / 'cache'} and http://127.0.0.1:")
    assert "could not be reached (ConnectError" in message
    assert message.endswith("download it once with network access, or pass a local path")
    message = one_line(resolve(hub_env(None, str(tmp_path), HF_HUB_OFFLINE="1"), GGUF_REPO))
    assert message == (f"model: {GGUF_REPO} (revision main) is not in the Hugging Face cache at "
                       f"{tmp_path / 'cache'} and HF_HUB_OFFLINE is set: download it once with network "
                       "access, or pass a local path")


def test_files_another_tool_downloaded_are_used_offline_and_without_network(fresh, tmp_path):
    fill = ("import sys; from huggingface_hub import hf_hub_download; "
            f"print(hf_hub_download({GGUF_REPO!r}, sys.argv[1]))")
    for name in GGUF_SHARDS:
        subprocess.run([sys.executable, "-c", fill, name], env=hub_env(fresh, str(tmp_path)), check=True,
                       capture_output=True, timeout=120)
    fresh.clear_log()
    for env in (hub_env(fresh, str(tmp_path), HF_HUB_OFFLINE="1"), hub_env(None, str(tmp_path))):
        found = resolve(env, f"{GGUF_REPO}:Q4_1")
        assert found["path"].endswith(GGUF_SHARDS[0]), found
    assert "could not be reached" in found["log"]
    assert fresh.requests == []
    # What the cache lacks is named (offline, the cache is all there is).
    message = one_line(resolve(hub_env(fresh, str(tmp_path), HF_HUB_OFFLINE="1"), f"{GGUF_REPO}:Q8_0"))
    assert message == (f"model: {GGUF_REPO}:Q8_0 is not whole in the Hugging Face cache at "
                       f"{tmp_path / 'cache'} (the cached copy has no Q8_0 GGUF; its quantizations: Q4_1 "
                       "(name one as owner/name:QUANT)) and HF_HUB_OFFLINE is set: download it once "
                       "with network access, or pass a local path")


def test_a_dropped_connection_resumes_with_a_range_request(fresh, tmp_path):
    cut = 10 << 20
    fresh.drop_after[(GGUF_REPO, GGUF_DEFAULT_FILE)] = cut
    found = resolve(hub_env(fresh, str(tmp_path)), GGUF_REPO)
    assert filecmp.cmp(found["path"], default_model_path(), shallow=False)
    assert [r["range"] for r in fresh.file_gets()] == [None, f"bytes={cut}-"]


def test_a_failed_download_leaves_nothing_half_written_and_the_next_run_completes_it(fresh, tmp_path):
    broken = (GGUF_REPO, GGUF_SHARDS[1])
    fresh.fail_status[broken] = 500
    try:
        message = one_line(resolve(hub_env(fresh, str(tmp_path)), f"{GGUF_REPO}:Q4_1"))
    finally:
        del fresh.fail_status[broken]
    assert message.startswith(f"model: {fresh.url} answered HTTP 500 for {GGUF_REPO}")
    cache = tmp_path / "cache"
    assert not [p for p in cache.rglob("*") if p.name.endswith(".incomplete")]
    snapshot = next(cache.glob("models--*/snapshots/*"))
    assert not (snapshot / GGUF_SHARDS[1]).exists()
    message = one_line(resolve(hub_env(fresh, str(tmp_path), HF_HUB_OFFLINE="1"), f"{GGUF_REPO}:Q4_1"))
    assert f"is not whole in the Hugging Face cache at {cache} (the cached copy misses {GGUF_SHARDS[1]})" \
        " and HF_HUB_OFFLINE is set" in message
    # The listing the download kept makes the offline default the online one: Q4_K_M, not cached.
    message = one_line(resolve(hub_env(fresh, str(tmp_path), HF_HUB_OFFLINE="1"), GGUF_REPO))
    assert f"(the cached copy misses {GGUF_DEFAULT_FILE})" in message
    missing = sorted(set(GGUF_SHARDS) - {p.name for p in snapshot.iterdir()})
    fresh.clear_log()
    assert resolve(hub_env(fresh, str(tmp_path)), f"{GGUF_REPO}:Q4_1")["path"].endswith(GGUF_SHARDS[0])
    assert sorted(Path(r["path"]).name for r in fresh.file_gets()) == missing  # only what was missing


def test_download_dir_is_the_cache_used(fresh, tmp_path):
    found = resolve(hub_env(fresh, str(tmp_path)), f"{GGUF_REPO}:Q4_K_M", download_dir=str(tmp_path / "models"))
    assert found["path"].startswith(str(tmp_path / "models" / "models--cadence-test--SmolLM2"))
    assert not (tmp_path / "cache").exists()


# ---------------------------------------------------------------- the command line


def test_a_safetensors_repository_generates_with_only_its_checkpoint_fetched(fresh, tmp_path):
    env = hub_env(fresh, str(tmp_path))
    done = cadence(env, "generate", "--model", TINY_REPO, "--raw", "--max-tokens", "3",
                   "--num-threads", "1", "--kv-cache-memory", "16MiB", "hello")
    assert done.returncode == 0, done.stderr
    assert "[3 tokens, finish: length]" in done.stdout
    fetched = {Path(r["path"]).name for r in fresh.file_gets(TINY_REPO)}
    assert fetched == {"config.json", "tokenizer.json", "model.safetensors.index.json",
                       "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    assert not fetched & {Path(name).name for name in TINY_UNWANTED}
    message = one_line(resolve(env, f"{TINY_REPO}:Q4_K_M"))
    assert message.endswith("has no GGUF files, and ':Q4_K_M' names a GGUF quantization")


def test_cadence_generate_takes_a_gguf_repository_by_name(fresh, tmp_path):
    done = cadence(hub_env(fresh, str(tmp_path)), "generate", "--model", GGUF_REPO, "--max-tokens", "4",
                   "--num-threads", "2", "--kv-cache-memory", "32MiB", "Hi!")
    assert done.returncode == 0, done.stderr
    assert "[4 tokens" in done.stdout and f"cadence: model {GGUF_REPO} (revision main) -> " in done.stderr


def test_cadence_reports_a_fetch_failure_in_one_line(tmp_path):
    for command in ("generate", "serve"):
        done = cadence(hub_env(None, str(tmp_path), HF_HUB_OFFLINE="1"), command, "--model", GGUF_REPO)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert done.stderr.splitlines()[-1] == (
            f"cadence: error: model: {GGUF_REPO} (revision main) is not in the Hugging Face cache at "
            f"{tmp_path / 'cache'} and HF_HUB_OFFLINE is set: download it once with network access, "
            "or pass a local path")
    done = cadence(hub_env(None, str(tmp_path)), "serve", GGUF_REPO, "--model", "other/model")
    assert done.returncode == 2 and done.stderr.splitlines()[-1] == (
        f"cadence: error: model: named twice, {GGUF_REPO} and --model other/model")
