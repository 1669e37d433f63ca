"""Command line. Engine options are generated from the config dataclasses,
so each option's default and help text live in ``cadence.config`` only.

    cadence serve                                     # OpenAI-compatible server, default model
    cadence generate "Why is the sky blue?"          # the embedded default model
    cadence generate --dtype float32 --max-tokens 64 "Hello"
    cadence demo                                      # scheduler benchmark, small
"""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

from cadence.config_cli import add_config_options, options_of
from cadence.server.cli import add_bench_serve_parser, add_serve_parser
from cadence.sim.cli import add_simulate_parser

def cmd_generate(args: argparse.Namespace) -> int:
    from cadence.engine.llm import LLM
    from cadence.sampling_params import SamplingParams

    options = options_of(args)
    llm = LLM(**options)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.sampling_seed)
    prompts = args.prompt or ["Write a haiku about continuous batching."]
    if args.raw:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    else:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        print(f">>> {prompt}\n{completion.text}\n[{len(completion.token_ids)} tokens, "
              f"finish: {completion.finish_reason}]")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    bench = Path(__file__).resolve().parent.parent / "bench" / "sched_overhead.py"
    sys.argv = [str(bench), "--quick"]
    runpy.run_path(str(bench), run_name="__main__")
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
    add_config_options(gen)
    gen.set_defaults(func=cmd_generate)
    demo = sub.add_parser("demo", help="run the scheduler benchmark on a small workload")
    demo.set_defaults(func=cmd_demo)
    add_serve_parser(sub)
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
