"""The report of bench/throughput.py: a header, the systems' table, the roofline.

Apart from throughput.py so each file holds one concept: throughput.py runs
the children and decides what to run; this file only prints what they gave.

The header says what was not measured and why (a dtype this CPU only
emulates, a GEMM library that cannot pack a dtype here), and marks what ran
emulated, so a table from an AVX2-only machine is never read as one from an
AVX-512 machine with a few rows missing. A system that failed is a row
saying so; its neighbours still print.
"""

from __future__ import annotations

import platform

SHORT_DTYPE = {"float32": "fp32", "bfloat16": "bf16"}


def dtype_label(dtype: str, plan) -> str:
    """``fp32``, or ``bf16 (emulated)`` where this CPU computes it in software."""
    return SHORT_DTYPE[dtype] + (" (emulated)" if dtype in plan.emulated else "")


def print_report(results: dict, roofline: dict | None, machine: dict | None, header: dict, plan) -> None:
    print_header(header, plan, machine)
    print_results(results, plan)
    if machine is not None:
        print()
        print_machine(machine, plan)
    if roofline:
        print_roofline(roofline, plan)
    print_ratios(results, roofline, plan)


def print_header(header: dict, plan, machine: dict | None) -> None:
    print(f"# workload {header['workload']} (name cpu-throughput, version {header['version']})")
    print(f"# {header['num_prompts']} prompts x {header['max_tokens']} new tokens, greedy, "
          f"EOS ignored, {header['num_threads']} threads; python {platform.python_version()}, "
          f"torch {header['torch']}, transformers {header['transformers']}")
    print(f"# cpu: {header['cpu']}")
    for line in skip_lines(plan, machine):
        print(f"# {line}")
    print(f"# load at start: {header['uptime_start']}")
    print(f"# load at end:   {header['uptime_end']}")


def skip_lines(plan, machine: dict | None) -> list[str]:
    """What this run left out or ran emulated, and why, one line each."""
    lines = [f"skipped {SHORT_DTYPE[d]} (every system and its roofline GEMM): {why}"
             for d, why in plan.skipped.items()]
    gemm = (machine or {}).get("gemm", {})
    lines += [f"skipped the {SHORT_DTYPE[d]} roofline GEMM with oneDNN packed weights: {g['packed_skipped']}"
              for d, g in gemm.items() if g.get("packed_skipped")]
    for d, why in plan.emulated.items():
        size = gemm.get(d, {}).get("size")
        small = f"; its roofline GEMM is {size}x{size}, small enough to end in seconds" if size else ""
        lines.append(f"emulated {SHORT_DTYPE[d]} (marked in the tables): {why}{small}")
    return lines


def print_results(results: dict, plan) -> None:
    if not results:
        return
    print()
    print("| system | dtype | output tok/s | wall s | peak RSS MiB | load s | CPU util "
          "| other procs (cores) | all runs: tok/s (other procs) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for (system, dtype), r in results.items():
        label = dtype_label(dtype, plan)
        if "failed" in r:
            print(f"| {system} | {label} | failed: {_cell(r['failed'])} |  |  |  |  |  |  |")
            continue
        runs = ", ".join(f"{tok_s:,.0f} ({others:.2f})" for tok_s, others in r["runs"])
        print(f"| {system} | {label} | {r['tok_s']:,.0f} | {r['wall_s']:.1f} "
              f"| {r['peak_rss_mib']:,.0f} | {r['load_s']:.1f} | {r['cpu_util']:.2f} "
              f"| {r['others_cores']:.2f} | {runs} |")


def print_machine(machine: dict, plan) -> None:
    """One line: bandwidth and each dtype's GEMM (library, size, emulated), or the failure."""
    if "failed" in machine:
        print(f"machine (roofline): failed: {machine['failed']}")
        return
    gemms = ", ".join(_gemm_text(d, g, plan) for d, g in machine["gemm"].items()) or "none measured"
    print(f"machine: copy {machine['copy_gbs']:.1f} GB/s (read+write), read {machine['read_gbs']:.1f} GB/s "
          f"-> bandwidth {machine['bandwidth_gbs']:.1f} GB/s; GEMM {gemms} "
          f"(other procs {machine['others_cores']:.2f} cores)")


def _gemm_text(dtype: str, gemm: dict, plan) -> str:
    if "failed" in gemm:
        return f"{SHORT_DTYPE[dtype]} failed: {gemm['failed']}"
    size = gemm["size"]
    gflops = gemm["gflops"]
    shown = f"{gflops:.0f}" if gflops >= 10 else f"{gflops:.2f}"  # emulated bf16: ~1 GFLOP/s
    return f"{dtype_label(dtype, plan)} {shown} GFLOP/s ({gemm['library']}, {size}x{size})"


def print_roofline(roofline: dict, plan) -> None:
    print()
    print("| dtype | weights MB/step | KV GB read | total GB | total TFLOP "
          "| compute-bound tok/s | memory-bound tok/s | roofline tok/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for dtype, r in roofline.items():
        print(f"| {dtype_label(dtype, plan)} | {r['weight_mb_per_step']:.0f} | {r['kv_gb_read']:.2f} "
              f"| {r['gb_total']:.1f} | {r['tflop_total']:.2f} | {r['compute_tok_s']:,.0f} "
              f"| {r['memory_tok_s']:,.0f} | {r['roofline_tok_s']:,.0f} |")


def print_ratios(results: dict, roofline: dict | None, plan) -> None:
    """cadence against each other system and the roofline, per dtype both ran in."""
    rows = []
    for dtype in plan.run:
        ours = _figure(results.get(("cadence", dtype)))
        if ours is None:
            continue
        cells = []
        for system, target in (("hf-static", 1.3), ("hf-cb", 4.0)):
            other = _figure(results.get((system, dtype)))
            cells.append(_ratio_cell(ours, other, target) if other else "—")
        bound = roofline.get(dtype) if roofline else None
        cells.append(_ratio_cell(ours, bound["roofline_tok_s"], 0.4, percent=True) if bound else "—")
        rows.append(f"| {dtype_label(dtype, plan)} | " + " | ".join(cells) + " |")
    if rows:
        print()
        print("| dtype | cadence / hf static (target ≥ 1.3×) | cadence / hf continuous batching "
              "(target ≥ 4×) | cadence / roofline (target ≥ 40%) |")
        print("|---|---:|---:|---:|")
        print("\n".join(rows))


def _figure(result: dict | None) -> float | None:
    """A system's tok/s, or None where it did not run or failed."""
    return None if result is None or "failed" in result else result["tok_s"]


def _ratio_cell(ours: float, other: float, target: float, percent: bool = False) -> str:
    ratio = ours / other
    text = f"{ratio:.0%}" if percent else f"{ratio:.2f}×"
    return text + (" ✓" if ratio >= target else " ✗")


def _cell(text: str) -> str:
    """``text`` safe inside a Markdown table cell."""
    return text.replace("|", "\\|")
