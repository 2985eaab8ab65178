"""The convergence figure (``experiments/fig5_convergence/``; paper §10.4 Figure 5: ZeRO
trains to the same loss as the baseline): training loss per step of every stage / ZeRO-R
configuration, each one's |loss - stage 0 fp32 loss| on a log axis, and the paper's own
Figure 5 (a different experiment) as context. Reads the experiment's table only.
"""
from __future__ import annotations

import os

from zero_repro.lab.figures import paper_compare
from zero_repro.lab.figures.figures import save_figure

LOSS, DLOSS, MAXD = "loss", "abs_dloss_vs_stage0_fp32", "max_abs_dloss_vs_stage0_fp32"
UNIT = "nats"
LOG_FLOOR = 1e-9  # exact agreement (|dloss| = 0) is drawn here on the log axis


def paper_context(out_dir: str, paper_fig: str):
    ref = paper_compare.load_reference(paper_compare.reference_path(os.path.dirname(os.path.abspath(out_dir))))
    return paper_compare.paper_rows(ref, paper_fig, y_names=["validation_perplexity"])


def plot(table, out_dir: str, figure: str, paper_fig: str) -> list[str]:
    """Main panel: loss vs step for every series (fp32 drawn with distinct line styles and
    markers so that coinciding curves stay visible); second: |dloss| vs stage 0 fp32 on a log
    axis; third, small: the paper's Figure 5 values, a different experiment, for context."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    ours = table[table["kind"] != "paper"].copy()
    ours["_y"] = pd.to_numeric(ours["y_value"], errors="coerce")
    ours["_x"] = pd.to_numeric(ours["x_value"], errors="coerce")
    fig = plt.figure(figsize=(15, 7.4))
    # bottom row: the legend of the two measured panels (13 series: too many to sit on data)
    gs = fig.add_gridspec(2, 3, width_ratios=[2.2, 1.6, 1.0], height_ratios=[4.2, 1.5])
    ax_loss, ax_d, ax_p = (fig.add_subplot(gs[0, i]) for i in range(3))
    styles = _styles(list(dict.fromkeys(ours.loc[ours["y_name"] == LOSS, "series"])), ours)
    for series, g in ours[ours["y_name"] == LOSS].groupby("series", sort=False):
        ax_loss.plot(g["_x"], g["_y"], label=series, **styles[series])
        if "step_skipped" in g:
            sk = g[g["step_skipped"].astype(str) == "True"]
            if len(sk):
                ax_loss.plot(sk["_x"], sk["_y"], "x", color="red", markersize=8,
                             label=f"{series}: fp16 overflow, step skipped")
    for series, g in ours[ours["y_name"] == DLOSS].groupby("series", sort=False):
        ax_d.plot(g["_x"], g["_y"].clip(lower=LOG_FLOOR), label=series, **styles[series])
    grid = ours["grid"].dropna().iloc[0] if "grid" in ours and len(ours) else ""
    ax_loss.set(xlabel="step", ylabel=f"training loss [{UNIT}]",
                title=f"measured: same data and seed ({grid})")
    _annotate_worst(ax_d, ours[ours["y_name"] == MAXD])
    ax_d.set(xlabel="step", ylabel=f"|loss - stage 0 fp32 loss| [{UNIT}]", yscale="log",
             title=f"deviation from stage 0 fp32 (exact 0 drawn at {LOG_FLOOR:g})")
    for ax in (ax_loss, ax_d):
        ax.grid(True, alpha=0.3)
        ax.title.set_fontsize(10)
    ax_leg = fig.add_subplot(gs[1, 0:2])
    ax_leg.axis("off")
    handles, labels = ax_loss.get_legend_handles_labels()
    ax_leg.legend(handles, labels, loc="upper center", ncol=3, fontsize=8.5, frameon=False,
                  title="series (loss and deviation panels)", title_fontsize=9)
    _draw_paper(ax_p, paper_context(out_dir, paper_fig))
    hw = ours["hardware"].dropna().iloc[0] if "hardware" in ours and len(ours) else ""
    fig.suptitle(f"Fig. 5 analogue: convergence equivalence (measured on {hw or 'CPU'}, gloo)",
                 fontsize=11)
    fig.tight_layout()
    os.makedirs(out_dir, exist_ok=True)
    paths = save_figure(fig, out_dir, figure, dpi=120)
    return paths


_LINES = ["-", "--", "-.", ":", (0, (5, 1)), (0, (3, 1, 1, 1)), (0, (1, 2)), (0, (8, 2)),
          (0, (4, 2, 1, 2, 1, 2))]
_MARKERS = ["o", "s", "^", "v", "D", "P", "X", "<", ">", "*", "h", "p"]
# 13+ series: matplotlib's 10-colour cycle would repeat; tab20's dark shades, then the light
_COLORS = [f"#{c}" for c in ("1f77b4 ff7f0e 2ca02c d62728 9467bd 8c564b e377c2 7f7f7f bcbd22 "
                             "17becf aec7e8 ffbb78 98df8a ff9896 c5b0d5 c49c94").split()]


def _styles(series: list[str], ours) -> dict:
    """fp32 series: thick-to-thin lines, each its own dash pattern and marker (they lie on top
    of each other); fp16/bf16: thin, dimmer, their own markers."""
    dtype = dict(zip(ours["series"], ours["dtype"])) if "dtype" in ours else {}
    out = {}
    for i, s in enumerate(series):
        half = dtype.get(s, "fp32") != "fp32"
        out[s] = {"color": _COLORS[i % len(_COLORS)], "linestyle": _LINES[i % len(_LINES)],
                  "marker": _MARKERS[i % len(_MARKERS)], "markevery": (i % 5, 5),
                  "markersize": 4 if half else 5, "alpha": 0.6 if half else 0.9,
                  "linewidth": 0.9 if half else max(0.8, 2.6 - 0.2 * i)}
    return out


def _annotate_worst(ax, maxd) -> None:
    """The max |dloss| per dtype (and which series) in a corner of the deviation panel."""
    lines = []
    for dtype, g in maxd.groupby("dtype", sort=False):
        y = g["_y"]
        worst = g.loc[y.idxmax()] if y.notna().any() else None
        if worst is None:
            continue
        tol = worst.get("tolerance", float("nan"))
        lines.append(f"{dtype}: max {worst['_y']:.2g} ({worst['config']}), tol {tol:g}")
    if lines:
        ax.text(0.98, 0.22, "\n".join(lines), transform=ax.transAxes, fontsize=7,
                ha="right", va="center", bbox={"facecolor": "white", "alpha": 0.8})


def _draw_paper(ax, rows) -> None:
    import pandas as pd

    for i, (series, g) in enumerate(rows.groupby("series", sort=False)):
        x = pd.to_numeric(g["x_value"], errors="coerce") / 1000.0
        ax.plot(x, pd.to_numeric(g["y_value"], errors="coerce"), marker="X",
                markeredgecolor="black", markersize=7, linestyle=":", color=f"C{7 + i}",
                label=f"{series} [paper]")
    ax.set(xlabel="iteration [thousands]", ylabel="validation perplexity [ppl]",
           title="paper Fig. 5 (17B Turing-NLG, not comparable)")
    ax.title.set_fontsize(9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.16))
    ax.text(0.02, 0.02, "different experiment: context only", transform=ax.transAxes,
            fontsize=7, style="italic")
