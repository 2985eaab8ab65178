"""Plotting shared by the throughput figures (paper Figures 2, 3, 4, 8): a paper-scale panel
(simulated + the paper's values overlaid + cluster-measured) and a panel for the local
scaled-down measurement; bars for categorical x, lines for numeric x. Axis titles are words
with units (``axis_label``), legends sit below the axes (never over data) with full labels,
and a paper bar is drawn hatched and unfilled in its series' colour, so it never looks like a
simulated or measured bar.
"""
from __future__ import annotations

import re

import pandas as pd

from zero_repro.lab.figures.figures import LINESTYLES, MARKERS, save_figure
from zero_repro.lab.throughput.setups import AGG_NAME, AGG_UNIT, PAPER_BATCH, UNIT, Y_NAME
from zero_repro.lab.figures.throughput_summary import write_predictions

def _pyplot():
    # matplotlib is only needed to draw (regenerating a table does not); Agg: no display
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


AXIS_WORDS = {Y_NAME: f"throughput per GPU [{UNIT}]", AGG_NAME: f"aggregate throughput "
              f"[{AGG_UNIT}]", "num_gpus": "number of GPUs",
              "model_size_B": "model size [billion parameters]",
              "zero_config": "ZeRO configuration (Table 3)",
              "local_config": "data parallelism (2 CPU ranks, TP 1)"}


def axis_label(name: str) -> str:
    """An axis title in words with its unit, for a table's x_name / y_name."""
    return AXIS_WORDS.get(name, str(name).replace("_", " "))


PREDICTED_BATCH = " (predicted batch)"


def label(series: str, kind: str) -> str:
    """A legend entry: the series, which batch a simulated series ran at (the paper's, or the
    one the memory dry run predicts), and its kind."""
    if kind == "simulated" and not str(series).endswith(PAPER_BATCH):
        series = f"{series}{PREDICTED_BATCH}"
    return f"{series} [{kind}]"


def legend_below(ax, handles=None, labels=None, ncol: int = 1, fontsize: float = 7.5,
                 y: float = -0.13) -> None:
    """The legend under the axes (outside the data; ``y``: its top, in axes fractions), full
    labels."""
    if handles is None:
        handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, y),
                  ncol=ncol, fontsize=fontsize, frameon=False)


def mean_err(df) -> str:
    if "rel_error_vs_paper" not in df:
        return ""
    e = pd.to_numeric(df["rel_error_vs_paper"], errors="coerce").abs()
    return f"  mean |err| vs paper {100 * e.mean():.1f}%" if e.notna().any() else ""


def _column(g, name: str) -> list:
    return list(g[name]) if name in g else [None] * len(g)


def draw_bars(ax, df, xs: list, ylabel: str = axis_label(Y_NAME), palette=None) -> None:
    """Grouped bars: one group per x in ``xs`` (categorical), one bar per (series, kind);
    colour = series, paper bars unfilled and hatched in that colour. Optional columns:
    ``y_min``/``y_max`` (repeats: drawn as a range), ``bar_label`` (text above the bar),
    ``in_sample`` (a calibration point: cross-hatched and starred)."""
    groups = list(dict.fromkeys(zip(df["series"], df["kind"])))
    palette = palette or [f"C{i}" for i in (0, 1, 2, 4, 5, 6, 7, 8, 9)]  # red: kept apart
    colors = {s: palette[i % len(palette)] for i, s in enumerate(dict.fromkeys(df["series"]))}
    width = 0.8 / max(1, len(groups))
    hatch = {"paper": "///", "simulated": "", "measured": "..", "analytic": "xx"}
    for i, (series, kind) in enumerate(groups):
        g = df[(df["series"] == series) & (df["kind"] == kind)]
        pos = [xs.index(x) + (i - (len(groups) - 1) / 2) * width for x in g["x_value"]]
        paper = kind == "paper"
        ys = g["y_value"].astype(float).fillna(0.0)  # NaN: predicted not to fit (labelled)
        inside = [isinstance(v, str) and v != "" for v in _column(g, "in_sample")]
        bars = ax.bar(pos, ys, width, label=label(series, kind),
                      hatch=hatch.get(kind, ""), linewidth=1.0 if paper else 0.5,
                      edgecolor=colors[series] if paper else "black",
                      color="white" if paper else colors[series])
        for bar, hit in zip(bars, inside):
            if hit:  # a calibration point: cross-hatched
                bar.set_hatch("xxx")
                bar.set_edgecolor("black")
        lo, hi = _column(g, "y_min"), _column(g, "y_max")
        if any(v is not None and v == v for v in lo):
            ax.errorbar(pos, ys, yerr=[[y - (a if a == a else y) for y, a in zip(ys, lo)],
                                       [(b if b == b else y) - y for y, b in zip(ys, hi)]],
                        fmt="none", ecolor="black", elinewidth=0.8, capsize=2)
        texts = [("* " if hit else "") + (t if isinstance(t, str) else "")
                 for t, hit in zip(_column(g, "bar_label"), inside)]
        if any(texts):
            ax.bar_label(bars, texts, fontsize=6, padding=2, rotation=90)
            ax.set_ylim(top=max(ax.get_ylim()[1], 1.3 * float(ys.max())))
    ax.set_xticks(range(len(xs)), [str(x) for x in xs])
    ax.set_ylabel(ylabel)
    ax.grid(True, axis="y", alpha=0.3)


def draw_lines(ax, df, logx: bool = False) -> None:
    """Lines over a numeric x: one per (series, kind); paper values as X markers."""
    xnum = pd.to_numeric(df["x_value"], errors="coerce")
    for _, r in df[xnum.isna()].iterrows():  # the paper's reference lines (x = "all")
        name = str(r["series"])  # drawn as the caption says: "(dotted)", "(dashed)"
        style = ":" if "dotted" in name else "--" if "dashed" in name else "-."
        ax.axhline(float(r["y_value"]), color="gray", linewidth=1.0, linestyle=style)
        quoted = re.search(r"'([^']+)'", name)  # plain words, not the digitisation note
        text = f"paper's {quoted.group(1)} line" if quoted else name
        ax.annotate(text, (0.99, float(r["y_value"])), fontsize=7, ha="right",
                    xycoords=("axes fraction", "data"), va="bottom", color="gray",
                    bbox=dict(facecolor="white", edgecolor="none", pad=0.5, alpha=0.8))
    df = df[xnum.notna()].assign(_x=xnum[xnum.notna()])
    # colour = series family (the paper-batch twin of a series shares its colour, dotted)
    family = df["series"].astype(str).str.replace(PAPER_BATCH, "", regex=False)
    colors = {s: f"C{i % 10}" for i, s in enumerate(dict.fromkeys(family))}
    for (series, kind), g in df.groupby(["series", "kind"], sort=False):
        g = g.sort_values("_x")
        twin = str(series).endswith(PAPER_BATCH) and kind != "paper"
        fitted = "in_sample" in g and all(isinstance(v, str) and v for v in g["in_sample"])
        ax.plot(g["_x"], g["y_value"].astype(float), marker=MARKERS.get(kind, "o"),
                linestyle=":" if twin else LINESTYLES.get(kind, "-"),
                color=colors[str(series).replace(PAPER_BATCH, "")],
                markerfacecolor="white" if twin else None,
                markersize=9 if kind == "paper" else 5,
                label=label(series, kind) + (" = the calibration points (fit)" if fitted else ""))
        if "fits" in g:  # predicted not to fit: a cross on the axis, said in words
            for x in g.loc[g["fits"].eq(False), "_x"]:
                ax.plot([x], [0], marker="x", color=colors[str(series).replace(PAPER_BATCH, "")],
                        markersize=9, clip_on=False)
                ax.annotate(f"{series.split(' (')[0]}: does not fit\n(OOM at batch 1)", (x, 0),
                            fontsize=6.5, ha="right", va="bottom", xytext=(-6, 60),
                            textcoords="offset points",
                            arrowprops=dict(arrowstyle="->", lw=0.6, color="0.3"))
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
    """The local panel's title: the machine, what each series' collectives ran over (a
    record's ``transport``: ZeRO's DP over shared memory or gloo, Megatron's TP over gloo) and
    the repeats."""
    hw = next((h for h in local.get("hardware", []) if isinstance(h, str) and h), "")
    reps = pd.to_numeric(local["repeats"], errors="coerce").max() if "repeats" in local else 1
    rep = (f"\nbars: median of {int(reps)} runs, whiskers: their range" if reps == reps
           and reps > 1 else "")
    how = ""
    if "transport" in local:
        pairs = dict.fromkeys((str(s).split(":")[0], t) for s, t, y in zip(
            local["series"], local["transport"], local["y_name"])
            if isinstance(t, str) and t and y != "speedup")
        how = "".join(f"\n{s}: {t}" for s, t in pairs)
        for t in {t for _, t in pairs}:
            hw = hw.replace(f"{t}, ", "")
    return "local scaled-down analogue (measured)\n" + hw.replace("measured: ", "")[:90] + how + rep


def plot_standard(table, out_dir: str, name: str, title: str, categorical: bool,
                  local_note: str = "") -> list[str]:
    """Paper-scale panel (simulated + paper overlay + cluster-measured) and local panel
    (``local_note``: more lines of its title)."""
    plt = _pyplot()
    write_predictions(table, out_dir)
    big, local = split(table)
    big, local = big[big["y_name"] == Y_NAME], local[local["y_name"] == Y_NAME]
    n = 1 + bool(len(local))
    fig, axes = plt.subplots(1, n, figsize=(7.5 * n, 6.4), squeeze=False)
    ax = axes[0][0]
    if categorical:
        draw_bars(ax, big, sorted(dict.fromkeys(big["x_value"]), key=str))  # C1..C5
    else:  # a linear x: every model size where it is (a log axis crowds 40-170B together)
        draw_lines(ax, big)
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        ax.set_ylabel(axis_label(Y_NAME))
    ax.set_xlabel(axis_label(big["x_name"].iloc[0]) if len(big) else "")
    ax.set_title(title + mean_err(big), fontsize=9)
    legend_below(ax)
    if len(local):
        ax = axes[0][1]
        size = local["x_name"].iloc[0] == "model_size_B"
        # local models are millions of parameters: label them so, not "0.000137" B
        local = local.assign(x_value=[f"{float(x) * 1e3:.3g}M" if size else
                                      f"{x:.4g}" if isinstance(x, float) else str(x)
                                      for x in local["x_value"]])
        ordered = size or local["x_name"].iloc[0] == "local_config"  # as planned
        if local["x_name"].iloc[0] == "local_config" and "bar_label" in local:
            local = local.assign(  # each bar's own model under its name, not over the bar
                x_value=[f"{x}\n{t}" if isinstance(t, str) and t else x
                         for x, t in zip(local["x_value"], local["bar_label"])],
                bar_label=None)
        xs = list(dict.fromkeys(local["x_value"]))
        draw_bars(ax, local, xs if ordered else sorted(xs, key=str))
        ax.set_xlabel("model size [million parameters]" if size
                      else axis_label(local["x_name"].iloc[0]))
        ax.set_title(local_title(local) + (f"\n{local_note}" if local_note else ""),
                     fontsize=9)
        two_line = any("\n" in str(x) for x in xs)  # tick labels of two lines
        legend_below(ax, y=-0.18 if two_line else -0.13)
    return save(fig, out_dir, name)
