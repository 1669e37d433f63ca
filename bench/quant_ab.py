"""One quantized product, two or more builds of quant_matmul side by side, in one process.

    python bench/quant_ab.py Q4_1 960 576 --rows 1,2,4 --tree base=../base-tree --tree new=.
    python bench/quant_ab.py Q4_K 2048 2048 --march x86-64-v3 --tree base=../base-tree --tree new=.

Each ``--tree NAME=PATH`` is a checkout whose ``cadence/kernels/csrc`` is built
(``-march=native`` or ``--march``) and loaded; random blocks of the type
(``tests/models/ggml_blocks.random_blocks``), in enough copies that the
weights come from memory, not the cache (``--copies 1``: from the cache).
Every round times each build in turn; the best round of each is printed, as
milliseconds a product, the weights' GB/s and GOP/s. The machine's speed
drifts from minute to minute, so only the builds' ratios within one run mean
anything.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from gguf import GGMLQuantizationType  # noqa: E402

from tests.models import ggml_blocks  # noqa: E402

ARGTYPES = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
            ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]


def load_build(tree: str, march: str):
    """quant_matmul of the checkout at ``tree``, built in a child (its own ``cadence``)."""
    code = f"import sys; sys.path.insert(0, {tree!r}); from cadence.kernels import build; " \
           f"print(build.build('quant_matmul', {march!r}))"
    path = subprocess.check_output([sys.executable, "-c", code], cwd=tree, text=True).strip()
    function = ctypes.CDLL(path).quant_matmul
    function.restype, function.argtypes = ctypes.c_int, ARGTYPES
    return function


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("type", help="ggml type, e.g. Q4_1")
    parser.add_argument("n", type=int, help="weight rows")
    parser.add_argument("k", type=int, help="values a row")
    parser.add_argument("--rows", default="1", help="rows of x, comma-separated (default 1)")
    parser.add_argument("--tree", action="append", required=True, help="NAME=PATH of a checkout (repeat)")
    parser.add_argument("--march", default="native")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--copies", type=int, default=0, help="weight copies (default: 256 MB of them)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    builds = {name: load_build(os.path.abspath(path), args.march)
              for name, path in (tree.split("=", 1) for tree in args.tree)}
    n, k, type_id = args.n, args.k, int(GGMLQuantizationType[args.type])
    rng = np.random.default_rng(0)
    copies = args.copies or max(2, int(256e6 // (n * k)))
    weights = [np.ascontiguousarray(ggml_blocks.random_blocks(args.type, n * k // ggml_blocks.BLOCK_VALUES[args.type],
                                                              rng).reshape(n, -1)) for _ in range(copies)]
    for m in (int(v) for v in args.rows.split(",")):
        x = np.random.default_rng(1).standard_normal((m, k)).astype(np.float32)
        out = np.zeros((m, n), np.float32)
        reps = max(copies, int(1e9 / (m * n * k)))
        best = dict.fromkeys(builds, float("inf"))
        for _ in range(args.rounds):
            for name, function in builds.items():
                start = time.perf_counter()
                for i in range(reps):
                    status = function(type_id, weights[i % copies].ctypes.data, n, k, x.ctypes.data, m, k,
                                      out.ctypes.data, n)
                    assert status == 0, status
                best[name] = min(best[name], (time.perf_counter() - start) / reps)
        print(f"{args.type} {n}x{k} m={m}: " + "  ".join(
            f"{name} {seconds * 1e3:.3f} ms ({weights[0].nbytes / seconds / 1e9:.1f} GB/s, "
            f"{2 * m * n * k / seconds / 1e9:.0f} GOP/s)" for name, seconds in best.items()), flush=True)


if __name__ == "__main__":
    main()
