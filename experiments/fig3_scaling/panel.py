"""One scaling panel of a throughput figure (paper §10.2 Figure 3: super-linear scaling):
per-GPU (per-rank) throughput as grouped bars on a log2 axis of the GPU (rank) count, the
aggregate as lines on a log2 right axis, and perfect linear scaling from each series' smallest
count. Used by ``experiments/fig3_scaling/`` for the paper-scale and the local panel.
"""
from __future__ import annotations

import pandas as pd
from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

from zero_repro.lab.figures import throughput_plots as TP


def _source(series: str) -> str:
    """``, <source>: <hw>`` of a series labelled by ``lab.figures.regenerate`` (`` · this machine: ...``)."""
    return f", {series.split(' · ', 1)[1]}" if " · " in series else ""


def _log2_gpu_axis(ax, xs: list[int], label: str) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.minorticks_off()
    ax.set_xlim(xs[0] / 2 ** 0.5, xs[-1] * 2 ** 0.5)
    ax.set_xlabel(label + " (log2 scale)")


def _bars_log(ax, per, xs, palette) -> None:
    """Grouped bars on a log2 x axis: each group spans a fixed fraction of an octave."""
    groups = list(dict.fromkeys(zip(per["series"], per["kind"])))
    colors = {s: palette[i % len(palette)] for i, s in enumerate(dict.fromkeys(per["series"]))}
    span = 0.6 / max(1, len(groups))  # octaves per bar
    for i, (series, kind) in enumerate(groups):
        g = per[(per["series"] == series) & (per["kind"] == kind)]
        off = (i - (len(groups) - 1) / 2) * span
        x = g["x_value"].astype(float)
        left, right = x * 2 ** (off - span / 2), x * 2 ** (off + span / 2)
        paper = kind == "paper"
        ys = g["y_value"].astype(float)
        ax.bar(left, ys, right - left, align="edge", label=TP.label(series, kind),
               hatch={"paper": "///", "measured": ".."}.get(kind, ""),
               color="white" if paper else colors[series],
               edgecolor=colors[series] if paper else "black", linewidth=1.0 if paper else 0.5)
        if "y_min" in g and g["y_min"].notna().any():
            mid = (left * right) ** 0.5
            ax.errorbar(mid, ys, yerr=[ys - g["y_min"].astype(float),
                                       g["y_max"].astype(float) - ys],
                        fmt="none", ecolor="black", elinewidth=0.8, capsize=2)


LINESTYLES = ["-", "--", "-.", ":"]


def panel(ax, df, title: str, xlabel: str, y_per: str, y_agg: str, per_label: str,
          agg_label: str, unit: str = "GPU", linear: str = "") -> None:
    """Bars: per-GPU (per-rank) throughput on the left axis; lines on a log2 right axis: the
    aggregate, and perfect linear scaling from the smallest count (straight on log-log); the
    series named ``linear`` (the paper's own perfect-scaling line) is drawn dotted black."""
    per = df[df["y_name"] == y_per]
    xs = sorted({int(x) for x in per["x_value"]})
    _bars_log(ax, per.assign(x_value=per["x_value"].astype(int)), xs,
              ["tab:orange", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan"])
    _log2_gpu_axis(ax, xs, xlabel)
    ax.set_ylabel(per_label + " (bars)")
    ax.grid(True, axis="y", alpha=0.3)
    ax2 = ax.twinx()
    agg = df[df["y_name"] == y_agg].copy()
    agg["_x"] = agg["x_value"].astype(float)
    styles = {"paper": ("X", "none"), "simulated": ("s", "--"), "measured": ("o", "-")}
    greens = ["tab:green", "darkgreen", "yellowgreen", "teal"]
    blues = ["tab:blue", "navy", "deepskyblue", "slateblue"]
    lines = {}
    for (series, kind), g in agg.groupby(["series", "kind"], sort=False):
        g = g.sort_values("_x")
        m, ls = styles.get(kind, ("o", "-"))
        if series == linear:
            ax2.plot(g["_x"], g["y_value"].astype(float), ":", color="black", lw=1.2,
                     label=TP.label(series + " (paper's line)", kind))
            continue
        k = len(lines)
        lines[series] = k
        ax2.plot(g["_x"], g["y_value"].astype(float), marker=m, linestyle=ls,
                 color=greens[k % len(greens)], markersize=9 if kind == "paper" else 5,
                 label=TP.label(series, kind))
    ours = agg[agg["kind"].isin(["simulated", "measured"]) & (agg["series"] != linear)]
    for series, g in ours.groupby("series", sort=False):  # our own perfect-linear reference
        r = g.sort_values("_x").iloc[0]
        x0 = float(r["_x"])
        k = lines.get(series, 0)
        ax2.plot(xs, [float(r["y_value"]) * x / x0 for x in xs], LINESTYLES[k % 4],
                 color=blues[k % len(blues)], lw=1.0,
                 label=f"perfect linear scaling from the {x0:g}-{unit} value of: "
                       + TP.label(series.split(' · ')[0] + _source(series), r["kind"]))
    if len(agg):
        ax2.set_yscale("log", base=2)
        ax2.yaxis.set_major_locator(LogLocator(base=2, subs=(1.0, 1.5)))
        ax2.yaxis.set_minor_locator(NullLocator())
        ax2.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
        ax2.set_ylabel(agg_label + " (lines, log2 scale)")
    top = pd.to_numeric(per["y_max"] if "y_max" in per and per["y_max"].notna().any()
                        else per["y_value"], errors="coerce").max()
    top = max(top, pd.to_numeric(per["y_value"], errors="coerce").max())
    if top == top:
        ax.set_ylim(0, 1.45 * top)  # room above the bars for the notes
    ax.set_title(title, fontsize=9)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    TP.legend_below(ax, h1 + h2, l1 + l2, fontsize=7)
