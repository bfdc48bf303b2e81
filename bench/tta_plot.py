"""The plot of bench/time_to_accuracy.py: test accuracy and log loss against wall seconds, one
line per configuration (the median over the seeds of the smoothed curves), one column per
straggler setting. Needs matplotlib (``pip install 'gradbus[plot]'``).

Usage: python bench/tta_plot.py CURVES.json OUT.png    (CURVES.json from ``--curves``)
"""
from __future__ import annotations

import json
import statistics
import sys
from types import SimpleNamespace

from time_to_accuracy import smoothed

STYLE = {"ddp": ("DDP (gloo, sync)", "black", "-"),
         "async": ("gradbus async", "tab:blue", "-"),
         "ssp": ("gradbus SSP", "tab:green", "--"),
         "async_topk": ("gradbus async, topk:0.01|int8", "tab:orange", "-."),
         "single": ("one process (no comm.)", "grey", ":")}


def median_curve(curves: list[list], grid: list[float], col: int) -> list[float | None]:
    """At each grid time, the median over the curves of their last value at or before it."""
    out = []
    for t in grid:
        vals = [next((pt[col] for pt in reversed(c) if pt[0] <= t), None) for c in curves]
        vals = [v for v in vals if v is not None]
        out.append(statistics.median(vals) if vals else None)
    return out


def plot(runs: list[dict], a, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stragglers = sorted({r["straggler"] for r in runs})
    fig, axes = plt.subplots(2, len(stragglers), figsize=(6 * len(stragglers), 7.5),
                             squeeze=False, sharex=True)
    step = a.eval_every
    grid = [i * step for i in range(int(a.budget / step) + 1)]
    for j, s in enumerate(stragglers):
        for name in dict.fromkeys(r["config"] for r in runs):
            curves = [smoothed(r["curve"], a.smooth) for r in runs
                      if r["straggler"] == s and r["config"] == name]
            label, color, ls = STYLE.get(name, (name, None, "-"))
            for row, col in ((0, 1), (1, 2)):
                axes[row][j].plot(grid, median_curve(curves, grid, col), label=label,
                                  color=color, linestyle=ls, linewidth=1.6)
        top, bottom = axes[0][j], axes[1][j]
        top.axhline(a.target, color="red", linewidth=0.8, linestyle=":")
        top.set_ylim(0.80, 1.0)
        top.set_title(f"W={a.workers}, step {a.step_ms:g} ms, "
                      + ("no straggler" if s == 1 else f"straggler x{s:g}")
                      + (f", jitter {a.jitter:g}" if a.jitter else ""))
        top.set_ylabel("test accuracy")
        bottom.set_ylabel("test log loss")
        bottom.set_yscale("log")
        bottom.set_xlabel("wall seconds")
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
    axes[0][0].legend(loc="lower right", fontsize=8)
    fig.suptitle(f"digits MLP, medians of {len(a.seeds)} seeds, "
                 f"metrics averaged over the last {a.smooth:g} s", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        raise SystemExit(__doc__)
    with open(argv[0]) as f:
        data = json.load(f)
    plot(data["runs"], SimpleNamespace(**data["args"]), argv[1])


if __name__ == "__main__":
    main()
