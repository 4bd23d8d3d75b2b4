#!/usr/bin/env python3
"""Draws loadgen results: latency and goodput against offered load, one line per run.

    python3 bench/plot.py OUT.png RUN.json [RUN.json ...]

Each RUN.json is what `loadgen --json` wrote (its `--label` names the line). Needs
matplotlib (`pip install matplotlib`); the bench never runs in CI.
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load_axis(summary):
    arrivals = summary["arrivals"]
    if "poisson" in arrivals:
        return arrivals["poisson"], "offered load (requests/s, Poisson)"
    return arrivals["clients"], "concurrent clients (closed loop)"


def main(out, paths):
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    xlabel = ""
    for i, path in enumerate(paths):
        color = f"C{i}"
        with open(path) as f:
            run = json.load(f)
        label = run.get("label") or path
        rows = [lvl["summary"] for lvl in run["levels"]]
        xs = []
        for s in rows:
            x, xlabel = load_axis(s)
            xs.append(x)
        for q, style in (("p50", "-o"), ("p99", "--x")):
            for ax, key in ((axes[0], "ttft_ms"), (axes[1], "tpot_ms")):
                ax.plot(xs, [s[key][q] for s in rows], style, color=color, label=f"{label} {q}")
        axes[2].plot(xs, [100 * s["goodput"] for s in rows], "-o", color=color, label=label)
    slo = rows[0]["slo"]
    titles = ("time to first token (ms)", "time per output token (ms)",
              f"goodput (% meeting TTFT ≤ {slo['ttft_ms']:g} ms and TPOT ≤ {slo['tpot_ms']:g} ms)")
    for ax, title in zip(axes, titles):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    axes[2].set_ylim(0, 105)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2:])
