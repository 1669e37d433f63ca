"""LoRA through the whole engine (scheduler, runner, adapter registry) on a tiny random Llama.

Greedy outputs under each adapter equal those of an engine serving the model
with that adapter merged (PEFT ``merge_and_unload``), whatever else shares
the batch; adapters over ``max_loras`` wait for a later step; at most
``max_cpu_loras`` stay loaded; the prefix cache never shares KV across
adapters; bad adapters are refused with a ValueError naming the field.
"""

import io
import json

import pytest
import torch

from cadence.config import EngineOptions
from cadence.core.request import LoRARequest, Request
from cadence.engine.builder import assemble_engine
from cadence.models.hf_loader import load_hf_model
from cadence.sampling_params import SamplingParams
from tests.runner.lora_helpers import merged_model, save_adapter, save_base

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [10, 11, 12], [40, 41, 42, 43, 44], [10, 11, 12, 13, 14, 15]]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-engine")
    base = save_base(root / "base")
    for i in (1, 2, 3):
        save_adapter(base, root / f"a{i}", seed=i, rank=8)
        merged_model(base, root / f"a{i}").save_pretrained(root / f"merged{i}")
    return root


def make_core(folder, **options):
    model, config = load_hf_model(str(folder), torch.float32)
    engine_options = EngineOptions.from_kwargs(
        dtype="float32", device="cpu", num_gpu_blocks=96, block_size=4, max_model_len=128,
        **options)
    return assemble_engine(engine_options, model, config, None, log=io.StringIO()).core


def lora(root, i):
    return LoRARequest(f"a{i}", i, str(root / f"a{i}")) if i else None


def run(core, prompts, loras, params=GREEDY):
    """Greedy tokens and num_cached_tokens per request, all added before the first step."""
    tokens, cached = {}, {}
    for i, (prompt, lora_request) in enumerate(zip(prompts, loras)):
        core.add_request(Request(str(i), prompt, params, lora_request=lora_request))
    while core.has_work():
        for outputs in core.step().values():
            for out in outputs.outputs:
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                cached[out.request_id] = out.num_cached_tokens
    return [tokens[str(i)] for i in range(len(prompts))], [cached[str(i)] for i in range(len(prompts))]


def expected_tokens(root, prompt, i):
    core = make_core(root / (f"merged{i}" if i else "base"))
    return run(core, [prompt], [None])[0][0]


def test_mixed_batch_greedy_equals_merged_models(folders):
    core = make_core(folders / "base", enable_lora=True, max_loras=2)
    ids = [0, 1, 2, 1]
    got, _ = run(core, PROMPTS, [lora(folders, i) for i in ids])
    for prompt, i, tokens in zip(PROMPTS, ids, got):
        assert tokens == expected_tokens(folders, prompt, i), f"adapter {i}"


def test_mixed_batch_under_async_scheduling_equals_the_synchronous_engine(folders):
    """Adapters load on the runner's worker, between the steps in flight."""
    ids = [0, 1, 2, 1, 3, 0]
    prompts = PROMPTS + [[7, 8, 9], [20, 21, 22, 23]]
    overlapped = make_core(folders / "base", enable_lora=True, max_loras=2, max_cpu_loras=2,
                           async_scheduling=True)
    sync = make_core(folders / "base", enable_lora=True, max_loras=2, max_cpu_loras=2)
    assert overlapped.async_scheduling
    loras = [lora(folders, i) for i in ids]
    assert run(overlapped, prompts, loras)[0] == run(sync, prompts, loras)[0]
    assert sorted(overlapped.list_loras()) == sorted(sync.list_loras())
    assert overlapped.remove_lora(1) and not overlapped.remove_lora(1)


def test_max_loras_splits_adapters_across_steps(folders):
    core = make_core(folders / "base", enable_lora=True, max_loras=1, max_cpu_loras=3)
    seen = []
    execute = core.runner.execute_model

    def recording(scheduler_output):
        batch = {core.runner.requests[r].lora_int_id for r in scheduler_output.num_scheduled_tokens
                 if r in core.runner.requests}
        result = execute(scheduler_output)
        batch |= {core.runner.requests[r].lora_int_id for r in scheduler_output.num_scheduled_tokens}
        seen.append(batch - {0})
        return result

    core.runner.execute_model = recording
    ids = [1, 2, 3, 0, 2]
    prompts = PROMPTS + [PROMPTS[0]]
    got, _ = run(core, prompts, [lora(folders, i) for i in ids])
    assert all(len(adapters) <= 1 for adapters in seen)
    assert {1, 2, 3} <= set().union(*seen)
    for prompt, i, tokens in zip(prompts, ids, got):
        assert tokens == expected_tokens(folders, prompt, i)


def test_prefix_cache_is_keyed_on_the_adapter(folders):
    core = make_core(folders / "base", enable_lora=True, max_loras=2)
    prompt = list(range(20, 37))  # four full blocks of 4
    _, cached = run(core, [prompt], [lora(folders, 1)])
    assert cached == [0]
    _, cached = run(core, [prompt], [lora(folders, 2)])
    assert cached == [0], "another adapter must not reuse adapter 1's KV"
    _, cached = run(core, [prompt], [None])
    assert cached == [0], "the base model must not reuse an adapter's KV"
    _, cached = run(core, [prompt], [lora(folders, 1)])
    assert cached[0] >= 12, "the same adapter reuses its own blocks"


def test_cpu_loras_evicted_least_recently_used_and_reloaded(folders):
    core = make_core(folders / "base", enable_lora=True, max_loras=1, max_cpu_loras=2)
    for i in (1, 2):
        assert core.add_lora(lora(folders, i))
    assert not core.add_lora(lora(folders, 1))  # already loaded: now the most recent
    assert core.add_lora(lora(folders, 3))
    assert sorted(core.list_loras()) == [1, 3]  # 2 was the least recently used
    got, _ = run(core, [PROMPTS[2]], [lora(folders, 2)])  # loaded again from its path
    assert got[0] == expected_tokens(folders, PROMPTS[2], 2)
    assert sorted(core.list_loras()) == [2, 3]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_adapter_that_cannot_be_reloaded_fails_its_request_only(folders, tmp_path, async_scheduling):
    """An unloaded adapter whose files are gone: its request ends with the
    reason, its blocks go back, the others in the batch run to the end."""
    import shutil
    doomed = tmp_path / "doomed"
    shutil.copytree(folders / "a1", doomed)
    core = make_core(folders / "base", enable_lora=True, max_loras=2, max_cpu_loras=2,
                     async_scheduling=async_scheduling)
    assert core.add_lora(LoRARequest("doomed", 1, str(doomed)))
    assert core.add_lora(lora(folders, 2)) and core.add_lora(lora(folders, 3))  # 1 unloaded
    shutil.rmtree(doomed)
    free_before = core.scheduler.kv_cache_manager.num_free_blocks
    tokens = {}
    core.add_request(Request("bad", PROMPTS[0], GREEDY, lora_request=LoRARequest("doomed", 1, str(doomed))))
    core.add_request(Request("good", PROMPTS[2], GREEDY, lora_request=lora(folders, 2)))
    errors = {}
    while core.has_work():
        for outputs in core.step().values():
            for out in outputs.outputs:
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        errors.update(core.take_request_errors())
    assert list(errors) == ["bad"]
    assert "lora_request: adapter 'doomed' was unloaded and cannot be loaded again" in errors["bad"]
    assert "bad" not in tokens
    assert tokens["good"] == expected_tokens(folders, PROMPTS[2], 2)
    assert core.scheduler.kv_cache_manager.num_free_blocks == free_before
    assert not core.scheduler.has_unfinished_requests()


def test_unload_waits_for_the_requests_using_it(folders):
    core = make_core(folders / "base", enable_lora=True, max_loras=2)
    core.add_request(Request("r", PROMPTS[0], GREEDY, lora_request=lora(folders, 1)))
    core.step()
    assert core.remove_lora(1)
    assert 1 not in core.list_loras()
    while core.has_work():  # the running request keeps its adapter to the end
        core.step()
    assert core.runner.lora.loaded == {}
    assert not core.remove_lora(1)


def test_rank_above_max_lora_rank_is_refused(folders, tmp_path):
    core = make_core(folders / "base", enable_lora=True, max_lora_rank=4)
    with pytest.raises(ValueError, match=r"^lora_path: the adapter's rank 8 exceeds max_lora_rank 4"):
        core.add_request(Request("r", PROMPTS[0], GREEDY, lora_request=lora(folders, 1)))
    assert not core.has_work()


@pytest.mark.parametrize("change, message", [
    ({"use_dora": True}, "sets use_dora=True"),
    ({"bias": "all"}, "sets bias='all'"),
    ({"peft_type": "IA3"}, "peft_type 'IA3' is not LoRA"),
])
def test_unsupported_adapter_options_are_refused(folders, tmp_path, change, message):
    import shutil

    shutil.copytree(folders / "a1", tmp_path / "a", dirs_exist_ok=True)
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps({**config, **change}))
    core = make_core(folders / "base", enable_lora=True)
    with pytest.raises(ValueError, match=f"^lora_path: .*{message}"):
        core.add_lora(LoRARequest("bad", 9, str(tmp_path / "a")))


def test_adapter_of_another_model_is_refused(folders, tmp_path):
    other = save_base(tmp_path / "other", hidden_size=32, intermediate_size=48)
    save_adapter(other, tmp_path / "wrong", seed=1, rank=4)
    core = make_core(folders / "base", enable_lora=True)
    with pytest.raises(ValueError, match=r"^lora_path: .*an adapter of another base model"):
        core.add_lora(LoRARequest("wrong", 5, str(tmp_path / "wrong")))
    deeper = save_base(tmp_path / "deeper", num_hidden_layers=3)
    save_adapter(deeper, tmp_path / "deep", seed=1, rank=4)
    with pytest.raises(ValueError, match=r"^lora_path: target module 'model.layers.2.\w+.\w+' "
                                         r"is not in the model"):
        core.add_lora(LoRARequest("deep", 7, str(tmp_path / "deep")))
    with pytest.raises(ValueError, match=r"^lora_path: no such folder"):
        core.add_lora(LoRARequest("missing", 6, str(tmp_path / "missing")))
    assert core.list_loras() == []


def test_lora_request_without_enable_lora_is_refused(folders):
    core = make_core(folders / "base")
    with pytest.raises(ValueError, match=r"^lora_request: LoRA is not enabled"):
        core.add_request(Request("r", PROMPTS[0], GREEDY, lora_request=lora(folders, 1)))
    assert not core.has_work()


def test_lora_options_need_enable_lora():
    with pytest.raises(ValueError, match=r"^max_loras: applies with enable_lora"):
        EngineOptions.from_kwargs(max_loras=4)
    assert EngineOptions.from_kwargs().lora is None
    options = EngineOptions.from_kwargs(enable_lora=True, max_loras=4)
    assert options.lora.max_loras == 4 and options.lora.num_cpu_loras == 4
    with pytest.raises(ValueError, match=r"^max_cpu_loras: must be >= max_loras"):
        EngineOptions.from_kwargs(enable_lora=True, max_loras=4, max_cpu_loras=2)
