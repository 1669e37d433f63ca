"""Command line. Engine options are generated from the config dataclasses,
so each option's default and help text live in ``cadence.config`` only.

    cadence serve                                     # OpenAI-compatible server, default model
    cadence serve Qwen/Qwen3-0.6B                     # a Hugging Face Hub id (downloaded once)
    cadence generate --model owner/name-GGUF:Q8_0 "Hi" # a GGUF repository's quantization
    cadence generate "Why is the sky blue?"          # the embedded default model
    cadence generate --dtype float32 --max-tokens 64 "Hello"
    cadence demo                                      # scheduler benchmark, small
    cadence proxy --prefill URL --decode URL          # prefill/decode disaggregation
"""

from __future__ import annotations

import argparse
import sys

from cadence.config_cli import add_config_options, options_of
from cadence.server.cli import add_bench_serve_parser, add_proxy_parser, add_serve_parser
from cadence.sim.cli import add_simulate_parser

def cmd_generate(args: argparse.Namespace) -> int:
    from cadence.engine.llm import LLM
    from cadence.sampling_params import SamplingParams

    options = options_of(args)
    lora_request = None
    if args.lora:
        from cadence.core.request import LoRARequest

        options["enable_lora"] = True
        lora_request = LoRARequest("cli-adapter", 1, args.lora)
    elif options.get("enable_lora"):
        raise ValueError("enable_lora: cadence generate applies an adapter given with --lora PATH")
    llm = LLM(**options)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.sampling_seed)
    prompts = args.prompt or ["Write a haiku about continuous batching."]
    raw = args.raw
    if not raw and llm.tokenizer.chat_template is None:
        # A base model (Gemma 3 270M's GGUF, say) has no template: continue the text instead.
        print("cadence: this model has no chat template: prompts are continued as raw text "
              "(as with --raw)", file=sys.stderr)
        raw = True
    if raw:
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_request)
    else:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False,
                           lora_request=lora_request)
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        print(f">>> {prompt}\n{completion.text}\n[{len(completion.token_ids)} tokens, "
              f"finish: {completion.finish_reason}]")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """The real scheduler on a small random workload, its runner faked (costs nothing):
    what one step costs the scheduler. ``bench/sched_overhead.py`` is the full benchmark."""
    import random
    import time

    from cadence.core.testing import FakeRunner, fixed_token, new_request, new_scheduler

    rng = random.Random(0)
    scheduler = new_scheduler(max_num_seqs=args.num_requests, max_num_batched_tokens=8192,
                              max_model_len=4096, block_size=16, num_gpu_blocks=args.num_requests * 80)
    for i in range(args.num_requests):
        prompt = [rng.randrange(100, 30000) for _ in range(rng.randint(256, 1024))]
        scheduler.add_request(new_request(f"r{i}", prompt, max_tokens=args.max_tokens, ignore_eos=True))
    runner, num_steps, num_tokens, seconds = FakeRunner(fixed_token(7)), 0, 0, 0.0
    while scheduler.has_requests():
        start = time.perf_counter()
        step = scheduler.schedule()
        seconds += time.perf_counter() - start
        output = runner.execute_model(step)  # not timed: the runner is fake
        start = time.perf_counter()
        scheduler.update_from_output(step, output)
        seconds += time.perf_counter() - start
        num_steps += 1
        num_tokens += sum(len(t) for t in output.sampled_token_ids)
    print(f"{args.num_requests} requests, {num_steps} steps, {num_tokens} tokens: scheduler "
          f"{seconds / num_steps * 1e6:.0f} us/step, {seconds / num_tokens * 1e6:.1f} us/token")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cadence", description="cadence LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate completions on the model (chat template applied)")
    gen.add_argument("prompt", nargs="*", help="user messages (one completion each)")
    gen.add_argument("--max-tokens", type=int, default=128, help="new tokens per prompt")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--raw", action="store_true", help="send prompts as raw text, no chat template")
    gen.add_argument("--lora", metavar="PATH", help="a PEFT LoRA adapter folder applied to every prompt "
                                                   "(turns on --enable-lora)")
    add_config_options(gen)
    gen.set_defaults(func=cmd_generate)
    demo = sub.add_parser("demo", help="time the real scheduler on a small workload (fake runner)")
    demo.add_argument("--num-requests", type=int, default=64)
    demo.add_argument("--max-tokens", type=int, default=32)
    demo.set_defaults(func=cmd_demo)
    add_serve_parser(sub)
    add_proxy_parser(sub)
    add_simulate_parser(sub)
    bench = sub.add_parser("bench", help="benchmarks against a running server")
    add_bench_serve_parser(bench.add_subparsers(dest="bench_command", required=True))
    return parser


def run(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen command; a ValueError is a usage error (exit 2)."""
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as err:
        print(f"cadence: error: {err}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    return run(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
