"""``LLM``: offline batch generation on one engine core, in this process.

    llm = LLM()                                   # the embedded default model
    llm = LLM("Qwen/Qwen3-0.6B")                  # a Hugging Face Hub id, downloaded once
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=20))
    print(outs[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

from tqdm.auto import tqdm

from cadence.config import EngineOptions
from cadence.core.outputs import SpecDecodingStats
from cadence.core.request import LoRARequest
from cadence.core.sched.policy import configured_policy
from cadence.engine.builder import Engine, build_engine
from cadence.engine.inputs import PromptType, make_request, prompt_token_ids
from cadence.engine.output_processor import OutputProcessor
from cadence.engine.outputs import RequestOutput
from cadence.models.hub import resolve_model_options
from cadence.sampling_params import PoolingParams, SamplingParams, embedding_params
from cadence.structured import GrammarLimits, IsolatedGrammarChecker

Conversation = list[dict[str, Any]]


class LLM:
    """Generate completions for a batch of prompts with continuous batching."""

    def __init__(self, model: str | None = None, dtype: str = "auto", **engine_options: Any) -> None:
        self.options = EngineOptions.from_kwargs(model=model, dtype=dtype, **engine_options)
        parallel = self.options.parallel
        if parallel.data_parallel_size > 1 or parallel.distributed_executor_backend == "ray":
            raise ValueError("data_parallel_size: engine replicas serve behind cadence serve; "
                             "offline generation runs one engine in this process")
        if configured_policy(self.options.scheduler).may_refuse_admission():
            raise ValueError(f"policy: {self.options.scheduler.policy} as configured refuses requests "
                             "under load, which only a server can answer (429); offline generation "
                             "runs every request")
        # A Hub id is fetched here, once (after the checks above: a refused option costs no download).
        self.options = resolve_model_options(self.options)
        self.engine: Engine = build_engine(self.options)
        self.tokenizer = self.engine.tokenizer
        self._processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        # Checks constraints in a worker process, as a server does (a crash in the
        # grammar library is a ValueError, not this process's end); started with
        # the first constraint.
        self._grammars: IsolatedGrammarChecker | None = None
        # Draft acceptance since this LLM was made (None: no speculative decoding).
        self.spec_decoding_stats: SpecDecodingStats | None = None

    @property
    def scheduler(self):
        return self.engine.core.scheduler

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        user: str | Sequence[str | None] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One final output per prompt, in order. Prompts are strings or
        ``{"prompt_token_ids": [...]}``; invalid input raises ValueError before
        anything runs. ``user``: the client of every prompt, or one per prompt
        (what the ``fair`` policy shares the engine between). ``lora_request``:
        the adapter of every prompt, or one per prompt (None: the base model);
        adapters are loaded before anything runs (needs ``enable_lora``)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params_list = self._params_for(len(prompts), sampling_params)
        users = _one_per_prompt("user", user, len(prompts), str)
        loras = _one_per_prompt("lora_request", lora_request, len(prompts), LoRARequest)
        for lora in dict.fromkeys(lora for lora in loras if lora is not None):
            self.engine.core.add_lora(lora)
        requests = self._make_requests(prompts, params_list, users, loras)
        for request, text in requests:
            self._processor.add_request(request.request_id, text, request.prompt_token_ids, request.sampling_params)
            self.engine.core.add_request(request)
        return self._run([r.request_id for r, _ in requests], use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        use_tqdm: bool = True,
        user: str | Sequence[str | None] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Like ``generate`` for conversations, rendered with the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conversation in conversations:
            text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
            prompts.append({"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, user=user,
                             lora_request=lora_request)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling: PoolingParams | None = None,
        *,
        use_tqdm: bool = True,
        user: str | Sequence[str | None] | None = None,
    ) -> list[list[float]]:
        """The embedding of each prompt, in order: the final hidden state pooled
        as ``pooling`` says (default: the model's pooling, L2-normalised). The
        prompts go through the same scheduler as generation; none samples a token."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = embedding_params(pooling, self.engine.model_config.pooling_type)
        outputs = self.generate(prompts, params, use_tqdm=use_tqdm, user=user)
        return [output.embedding for output in outputs]

    def _params_for(self, num_prompts: int, sampling_params) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * num_prompts
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * num_prompts
        if len(sampling_params) != num_prompts:
            raise ValueError("sampling_params: need one per prompt, or a single one for all")
        return list(sampling_params)

    def _make_requests(self, prompts, params_list, users, loras):
        requests = []
        for prompt, params, user, lora in zip(prompts, params_list, users, loras):
            self._check_structured_outputs(params)
            text, token_ids = prompt_token_ids(prompt, self.tokenizer)
            request = make_request(
                str(next(self._ids)), token_ids, params, self.tokenizer, self.engine.max_model_len,
                user=user, lora_request=lora,
            )
            requests.append((request, text))
        return requests

    def _check_structured_outputs(self, params: SamplingParams) -> None:
        """ValueError naming the field if ``params.structured_outputs`` is over a
        limit (the ``structured_outputs_*`` options), cannot compile, or nothing
        satisfies it; the grammar library runs in the checker's worker."""
        backend = self.engine.grammar_backend
        if params.structured_outputs is None or backend is None:
            return
        if self._grammars is None:
            engine = self.options.engine
            self._grammars = IsolatedGrammarChecker(engine.structured_outputs_backend, self.tokenizer,
                                                    backend.vocab_size, GrammarLimits.of(engine))
        self._grammars.check(params.structured_outputs)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        core = self.engine.core
        finals: dict[str, RequestOutput | None] = {}  # None: failed, see errors
        errors: dict[str, str] = {}
        faults: set[str] = set()  # of errors: the engine's (a failed step), not the input's
        wanted = set(request_ids)
        bar = tqdm(total=len(request_ids), desc="generate", disable=not use_tqdm, unit="req")
        while len(finals) < len(wanted) and core.has_work():
            step_outputs = core.step()
            self._count_drafts(step_outputs)
            outputs = [o for eco in step_outputs.values() for o in eco.outputs]
            results, stopped = self._processor.process(outputs)
            if stopped:
                core.finish_by_stop_string(stopped)
            for result in results:
                if result.finished and result.request_id in wanted:
                    finals[result.request_id] = result
                    bar.update(1)
            errors.update(core.take_request_errors())
            faults |= core.take_runner_faults()
            finals.update(dict.fromkeys(errors.keys() & wanted - finals.keys()))
        bar.close()
        while core.has_work() and not core.scheduler.has_unfinished_requests():
            core.step()  # report the last finished ids to the runner
        if not core.has_work():
            # Idle until the next call: the heap's pages freed by this call's steps go
            # back to the kernel, as the engine process does once idle (core_proc).
            from cadence.runner.host_memory import return_freed_memory  # torch is loaded: the engine runs here

            return_freed_memory()
        if errors:  # the others ran to the end first
            message = "; ".join(f"request {request_id}: {why}" for request_id, why in errors.items())
            raise RuntimeError(message) if faults else ValueError(message)
        return [finals[request_id] for request_id in request_ids]

    def _count_drafts(self, step_outputs) -> None:
        for eco in step_outputs.values():
            spec = eco.scheduler_stats.spec_decoding_stats if eco.scheduler_stats is not None else None
            if spec is not None:
                if self.spec_decoding_stats is None:
                    self.spec_decoding_stats = SpecDecodingStats.new(spec.num_spec_tokens)
                self.spec_decoding_stats.add(spec)


def _one_per_prompt(name: str, value: Any, num_prompts: int, single: type) -> list:
    """``value`` for every prompt (None or one ``single``), or its items, one per prompt."""
    if value is None or isinstance(value, single):
        return [value] * num_prompts
    values = list(value)
    if len(values) != num_prompts:
        raise ValueError(f"{name}: need one per prompt, or a single one for all")
    return values
