"""Command line. Engine options are generated from the config dataclasses,
so each option's default and help text live in ``cadence.config`` only.

    cadence serve                                     # OpenAI-compatible server, default model
    cadence generate "Why is the sky blue?"          # the embedded default model
    cadence generate --dtype float32 --max-tokens 64 "Hello"
    cadence demo                                      # scheduler benchmark, small
"""

from __future__ import annotations

import argparse
import dataclasses
import runpy
import sys
import types
import typing
from pathlib import Path
from typing import Any

from cadence.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from cadence.server.cli import add_bench_serve_parser, add_serve_parser
from cadence.sim.cli import add_simulate_parser

ENGINE_OPTION_CLASSES = (EngineConfig, SchedulerConfig, CacheConfig, SpeculativeConfig)


def add_config_options(parser: argparse.ArgumentParser, classes=ENGINE_OPTION_CLASSES) -> None:
    """One ``--option`` per config field; unset options keep the class default."""
    for cls in classes:
        group = parser.add_argument_group(cls.__name__, (cls.__doc__ or "").strip())
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            flag = "--" + field.name.replace("_", "-")
            base = _base_type(hints[field.name])
            help_text = f"{field.metadata.get('help', '')} (default: {field.default})"
            if base is bool:
                group.add_argument(flag, dest=field.name, action=argparse.BooleanOptionalAction,
                                   default=argparse.SUPPRESS, help=help_text)
            else:
                group.add_argument(flag, dest=field.name, type=base, default=argparse.SUPPRESS,
                                   metavar=base.__name__.upper(), help=help_text)


def engine_options_from_args(args: argparse.Namespace, classes=ENGINE_OPTION_CLASSES) -> dict[str, Any]:
    names = {f.name for cls in classes for f in dataclasses.fields(cls)}
    return {name: value for name, value in vars(args).items() if name in names}


def _base_type(annotation: Any) -> type:
    """int for ``int | None``, etc."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0]
    return annotation


def cmd_generate(args: argparse.Namespace) -> int:
    from cadence.engine.llm import LLM
    from cadence.sampling_params import SamplingParams

    options = engine_options_from_args(args)
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
