"""Plotting shared by the throughput figures (paper Figures 2, 3, 4, 8): a paper-scale panel
(simulated + the paper's values overlaid + cluster-measured) and a panel for the local
scaled-down measurement; bars for categorical x, lines for numeric x..
"""
from __future__ import annotations

import pandas as pd

from zero_repro.harness.figures import LINESTYLES, MARKERS, save_figure
from zero_repro.harness.throughput import UNIT, Y_NAME
from zero_repro.harness.throughput_summary import write_predictions

def _pyplot():
    # matplotlib is only needed to draw (regenerating a table does not); Agg: no display
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def label(series: str, kind: str, width: int = 48) -> str:
    s = series if len(series) <= width else series[:width - 1] + "…"
    return f"{s} [{kind}]"


def mean_err(df) -> str:
    if "rel_error_vs_paper" not in df:
        return ""
    e = pd.to_numeric(df["rel_error_vs_paper"], errors="coerce").abs()
    return f"  mean |err| vs paper {100 * e.mean():.1f}%" if e.notna().any() else ""


def draw_bars(ax, df, xs: list, ylabel: str = f"{Y_NAME} [{UNIT}]") -> None:
    """Grouped bars: one group per x in ``xs`` (categorical), one bar per (series, kind)."""
    groups = list(dict.fromkeys(zip(df["series"], df["kind"])))
    colors = {s: f"C{i % 10}" for i, s in enumerate(dict.fromkeys(df["series"]))}
    width = 0.8 / max(1, len(groups))
    hatch = {"paper": "//", "simulated": "", "measured": "..", "analytic": "xx"}
    for i, (series, kind) in enumerate(groups):
        g = df[(df["series"] == series) & (df["kind"] == kind)]
        pos = [xs.index(x) + (i - (len(groups) - 1) / 2) * width for x in g["x_value"]]
        ax.bar(pos, g["y_value"].astype(float), width, label=label(series, kind),
               hatch=hatch.get(kind, ""), edgecolor="black", linewidth=0.5, color=colors[series])
    ax.set_xticks(range(len(xs)), [str(x) for x in xs])
    ax.set_ylabel(ylabel)
    ax.grid(True, axis="y", alpha=0.3)


def draw_lines(ax, df, logx: bool = False) -> None:
    """Lines over a numeric x: one per (series, kind); paper values as X markers."""
    xnum = pd.to_numeric(df["x_value"], errors="coerce")
    for _, r in df[xnum.isna()].iterrows():  # the paper's reference lines (x = "all")
        ax.axhline(float(r["y_value"]), color="gray", linewidth=0.8, linestyle="-.")
        ax.annotate(str(r["series"]), (0.01, float(r["y_value"])), fontsize=6,
                    xycoords=("axes fraction", "data"), va="bottom", color="gray")
    df = df[xnum.notna()].assign(_x=xnum[xnum.notna()])
    colors = {s: f"C{i % 10}" for i, s in enumerate(dict.fromkeys(df["series"]))}
    for (series, kind), g in df.groupby(["series", "kind"], sort=False):
        g = g.sort_values("_x")
        ax.plot(g["_x"], g["y_value"].astype(float), marker=MARKERS.get(kind, "o"),
                linestyle=LINESTYLES.get(kind, "-"), color=colors[series],
                markersize=9 if kind == "paper" else 5, label=label(series, kind))
    if logx:
        ax.set_xscale("log", base=2)
    ax.grid(True, alpha=0.3)


def save(fig, out_dir: str, name: str) -> list[str]:
    fig.tight_layout()
    return save_figure(fig, out_dir, name, dpi=130)


def split(table):
    """(paper-scale rows incl. paper overlay, local measured rows) of a throughput table."""
    local = table["hardware"].fillna("").str.contains("CPU rank") if "hardware" in table else (
        table["kind"] == "__none__")
    return table[~local], table[local]


def local_title(local) -> str:
    hw = next((h for h in local.get("hardware", []) if isinstance(h, str) and h), "")
    return "local scaled-down analogue (measured)\n" + hw.replace("measured: ", "")[:90]


def plot_standard(table, out_dir: str, name: str, title: str, categorical: bool) -> list[str]:
    """Paper-scale panel (simulated + paper overlay + cluster-measured) and local panel."""
    plt = _pyplot()
    write_predictions(table, out_dir)
    big, local = split(table)
    big, local = big[big["y_name"] == Y_NAME], local[local["y_name"] == Y_NAME]
    n = 1 + bool(len(local))
    fig, axes = plt.subplots(1, n, figsize=(7.5 * n, 5.2), squeeze=False)
    ax = axes[0][0]
    if categorical:
        draw_bars(ax, big, list(dict.fromkeys(big["x_value"])))
    else:
        draw_lines(ax, big, logx=True)
        ax.set_ylim(bottom=0)
        ax.set_ylabel(f"{Y_NAME} [{UNIT}]")
    ax.set_xlabel(big["x_name"].iloc[0] if len(big) else "")
    ax.set_title(title + mean_err(big), fontsize=9)
    ax.legend(fontsize=6, loc="best")
    if len(local):
        ax = axes[0][1]
        local = local.assign(x_value=[f"{x:.4g}" if isinstance(x, float) else str(x)
                                      for x in local["x_value"]])
        draw_bars(ax, local, list(dict.fromkeys(local["x_value"])))
        ax.set_xlabel(local["x_name"].iloc[0])
        ax.set_title(local_title(local), fontsize=9)
        ax.legend(fontsize=6, loc="best")
    return save(fig, out_dir, name)
