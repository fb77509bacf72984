"""Figures of simulations (matplotlib, no display needed).

``plot_run``: one policy's run — JCT CDF and GPUs in use over time.
``plot_jct_cdf``: several policies' JCT CDFs on a log x-axis (thesis Fig. 3.13).
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _cdf(values: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    x = np.sort(np.asarray(values, dtype=float))
    y = np.arange(1, len(x) + 1) / max(1, len(x))
    return x, y


def jcts(result) -> list[float]:
    return [j.end_time - j.submit_time for j in result.jobs if j.end_time is not None]


def plot_jct_cdf(series: Mapping[str, Sequence[float]], path: str, title: str = "") -> None:
    """CDF of job completion times per policy, log x-axis."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, values in series.items():
        if len(values):
            x, y = _cdf(np.maximum(values, 1e-3))
            ax.step(x, y, where="post", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("job completion time (s)")
    ax.set_ylabel("fraction of jobs")
    ax.set_ylim(0, 1)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right")
    if title:
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_run(result, path: str, title: str = "") -> None:
    """One run: JCT CDF (left) and GPUs in use over time, from the jobs' run intervals (right)."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    x, y = _cdf(np.maximum(jcts(result), 1e-3))
    left.step(x, y, where="post")
    left.set_xscale("log")
    left.set_xlabel("job completion time (s)")
    left.set_ylabel("fraction of jobs")
    left.grid(True, which="both", alpha=0.3)
    # GPUs held over time: +W at each start, -W at each stop/end (timeline recorded by the run)
    if result.timeline:
        gpus = {j.job_id: j.num_gpus for j in result.jobs}
        delta = {"start": 1, "stop": -1, "end": -1}
        events = sorted((t, delta[kind] * gpus[jid]) for t, jid, kind in result.timeline)
        t = np.array([e[0] for e in events]) / 3600.0
        used = np.cumsum([e[1] for e in events])
        right.step(t, used, where="post")
        right.axhline(result.capacity, color="grey", linestyle="--", linewidth=0.8)
    right.set_xlabel("time (h)")
    right.set_ylabel("GPUs in use")
    right.grid(True, alpha=0.3)
    fig.suptitle(title or f"{result.policy}: {len(result.jobs)} jobs on {result.capacity} GPUs")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
