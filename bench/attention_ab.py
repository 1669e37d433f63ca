"""The C paged-attention kernel of two or more checkouts side by side, in one process.

    python bench/attention_ab.py --tree base=../base-tree --tree new=.
    python bench/attention_ab.py --tree base=../base-tree --tree new=. --shapes 4:1:256:1000:1,9:3:64:300:64

Each ``--tree NAME=PATH`` is a checkout whose ``paged_attention`` kernel is
built (``-march=native``) and loaded. A shape is ``Hq:Hkv:D:context:seqs``:
that many sequences, each one decode token over ``context`` cached keys in a
float16 cache of 16-token blocks in shuffled order (the default shapes are
Gemma 3 270M's heads, 4 query heads over 1 KV head of 256, and SmolLM2's, 9
over 3 of 64). Rounds alternate the builds; the median round of each is
printed as microseconds a call and the ratio to the first build, with the
largest difference of any output from the first build's. The machine's speed
drifts from minute to minute, so only the ratios within one run mean anything.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from cadence.kernels.paged_attention import PagedAttentionKernel  # noqa: E402

DEFAULT_SHAPES = ("4:1:256:128:1,4:1:256:400:1,4:1:256:1000:1,9:3:64:128:1,9:3:64:400:1,9:3:64:1000:1,"
                  "4:1:256:300:64,9:3:64:300:64")
BLOCK_SIZE = 16


def load_build(tree: str) -> PagedAttentionKernel:
    """The kernel of the checkout at ``tree``, built in a child (its own ``cadence``)."""
    import ctypes

    code = f"import sys; sys.path.insert(0, {tree!r}); from cadence.kernels import build; " \
           "print(build.build('paged_attention', 'native'))"
    path = subprocess.check_output([sys.executable, "-c", code], cwd=tree, text=True).strip()
    return PagedAttentionKernel(ctypes.CDLL(path))


def decode_inputs(heads: int, kv_heads: int, dim: int, context: int, seqs: int) -> tuple:
    """One decode token of each of ``seqs`` sequences over ``context`` cached keys."""
    generator = torch.Generator().manual_seed(0)
    blocks = -(-context // BLOCK_SIZE)
    cache = [torch.randn(seqs * blocks, BLOCK_SIZE, kv_heads, dim, generator=generator).half() for _ in range(2)]
    table = torch.randperm(seqs * blocks, generator=generator).to(torch.int32).view(seqs, blocks)
    q = torch.randn(seqs, heads, dim, generator=generator)
    return (q, *cache, torch.empty_like(q), torch.arange(seqs), torch.ones(seqs, dtype=torch.long),
            torch.full((seqs,), context, dtype=torch.long), table, None, dim ** -0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", required=True, help="NAME=PATH of a checkout (repeat)")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma list of Hq:Hkv:D:context:seqs")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    builds = {name: load_build(os.path.abspath(path)) for name, path in (tree.split("=", 1) for tree in args.tree)}
    first = next(iter(builds))
    for shape in args.shapes.split(","):
        heads, kv_heads, dim, context, seqs = map(int, shape.split(":"))
        inputs = decode_inputs(heads, kv_heads, dim, context, seqs)
        outputs = {}
        for name, kernel in builds.items():
            kernel(*inputs)
            outputs[name] = inputs[3].clone()
        calls = max(1, int(2e7 / (seqs * context * heads * dim)))
        times = {name: [] for name in builds}
        for _ in range(args.rounds):
            for name, kernel in builds.items():
                start = time.perf_counter()
                for _ in range(calls):
                    kernel(*inputs)
                times[name].append((time.perf_counter() - start) / calls)
        median = {name: statistics.median(t) for name, t in times.items()}
        difference = max(float((out - outputs[first]).abs().max()) for out in outputs.values())
        print(f"Hq {heads}, Hkv {kv_heads}, D {dim}, context {context}, {seqs} seqs: " + "  ".join(
            f"{name} {seconds * 1e6:.1f} us ({median[first] / seconds:.2f}x)" for name, seconds in median.items())
            + f"  largest difference {difference:.1e}", flush=True)


if __name__ == "__main__":
    main()
