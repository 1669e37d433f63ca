"""PNG plots of simulated runs, one line per run (policy): matplotlib, Agg backend.

    ttft_cdf.png   the CDF of time to first token
    queues.png     running and waiting requests over time
    kv_usage.png   KV-cache block usage over time
    ttft_cdf_per_client.png   the TTFT CDF of each client under each run
                              (only when the workload has several clients)
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from cadence.sim.metrics import MetricsRecorder, Timeline

MAX_POINTS = 4000  # per line: a long run is thinned to this many steps


def write_plots(recorders: Mapping[str, MetricsRecorder], out_dir: str | Path) -> list[Path]:
    """Write the three plots for ``{label: recorder}``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [
        _ttft_cdf(plt, recorders, out_dir / "ttft_cdf.png"),
        _over_time(plt, recorders, out_dir / "queues.png", ("running", "waiting"), "requests"),
        _over_time(plt, recorders, out_dir / "kv_usage.png", ("kv_usage",), "KV blocks in use (fraction)"),
    ]
    first = next(iter(recorders.values()), None)
    if first is not None and len({s.client for s in first.specs}) > 1:
        paths.append(_ttft_cdf_per_client(plt, recorders, out_dir / "ttft_cdf_per_client.png"))
    return paths


def _ttft_cdf_per_client(plt, recorders: Mapping[str, MetricsRecorder], path: Path) -> Path:
    """One line per (run, client), at most 8 clients (the ones with most requests)."""
    import numpy as np
    from collections import Counter

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, recorder in recorders.items():
        clients = np.asarray([s.client for s in recorder.specs])
        ttft = np.asarray(recorder.first_token) - np.asarray(recorder.arrival)
        for client, _ in Counter(clients.tolist()).most_common(8):
            _plot_cdf(ax, ttft[clients == client], f"{label}, client {client}")
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s, log scale)")
    ax.set_ylabel("fraction of the client's requests")
    ax.set_title("TTFT CDF per client")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(plt, fig, path)


def _ttft_cdf(plt, recorders: Mapping[str, MetricsRecorder], path: Path) -> Path:
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, recorder in recorders.items():
        _plot_cdf(ax, np.asarray(recorder.first_token) - np.asarray(recorder.arrival), label)
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(plt, fig, path)


def _plot_cdf(ax, values, label: str) -> None:
    """The empirical CDF of ``values`` (NaN: never got a first token, left out)."""
    import numpy as np

    values = np.sort(values[~np.isnan(values)])
    if values.size:
        ax.plot(values, np.arange(1, values.size + 1) / values.size, label=label)


def _over_time(plt, recorders: Mapping[str, MetricsRecorder], path: Path, series: tuple[str, ...],
               ylabel: str) -> Path:
    fig, axes = plt.subplots(len(series), 1, figsize=(8, 3 * len(series)), sharex=True, squeeze=False)
    for ax, name in zip(axes[:, 0], series):
        for label, recorder in recorders.items():
            times, values = _thinned(recorder.timeline, name)
            ax.step(times, values, where="post", label=label, linewidth=0.9)
        ax.set_ylabel(f"{name} {ylabel}" if len(series) > 1 else ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
    axes[-1, 0].set_xlabel("time (s)")
    return _save(plt, fig, path)


def _thinned(timeline: Timeline, name: str) -> tuple[list[float], list[float]]:
    times, values = timeline.time, getattr(timeline, name)
    stride = max(1, len(times) // MAX_POINTS)
    return list(times[::stride]), list(values[::stride])


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
