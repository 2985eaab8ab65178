"""Figure 3: super-linear scalability of ZeRO-100B (60B model, 64-400 V100 GPUs; paper §10.3).
P_os+g's model states shrink as 2Ψ + 14Ψ/N_d, so a larger DP degree buys a larger batch per GPU
(Table 6: 16 -> 48 -> 48 -> 64) and higher arithmetic intensity: per-GPU throughput rises and the
aggregate more than doubles from 64 to 128 GPUs (paper: 2.93x).

* simulated (paper scale): Table 6 through the performance model calibrated on Figure 2 only:
  per-GPU TFLOPs, aggregate = per-GPU x GPUs, speed-ups between GPU counts;
* measured (cluster): the same four setups as real points (``cluster=dgx2_v100 launcher=slurm``);
* measured (local): ``local_model`` at C3 (P_os+g, TP 1) on ``local_worlds`` ranks, batch per rank
  the largest that fits a pretend ``local_device_mb`` device by the analytic model (so it grows
  with the DP degree, as in the paper).
"""
from __future__ import annotations

import pandas as pd

from zero_repro.lab.figures import throughput as T
from zero_repro.lab.figures.figures import plt
from zero_repro.lab.figures import throughput_plots as TP
from zero_repro.lab.figures import throughput_summary as TS

PARAMS = T.PARAMS  # the experiment.params keys it reads (cli.check_params)

FIGURE = "fig3"
PAPER_FIGURE = "fig3"
BARS = "ZeRO-100B 60B model, Performance/GPU (bars)"
AGG = "ZeRO-100B 60B model, Observed Performance (green line)"
LINEAR = "Perfect Linear Scalability (blue line)"
PAIRS = [(64, 128), (128, 256), (256, 400), (64, 400)]
SERIES_FAMILY: dict = {}  # our paper-scale series carry the paper's names


def _local(cfg, p: dict) -> list:
    model = p.get("local_model", "small")
    return [T.local_point(FIGURE, f"local {model} C3 w{w}", model, int(w), 1, "C3", p)
            for w in p.get("local_worlds", [1, 2])]


def plan(cfg) -> list:
    return T.plan_points(cfg, FIGURE, _local)


def run_point(cfg, point) -> dict:
    return T.run_point(cfg, point)


def speedup_series(a: int, b: int) -> str:
    return f"aggregate speedup {a}->{b} GPUs (ideal {b / a})"


def _aggregate_and_speedups(rows: list[dict], series: str, agg_series: str, pairs,
                            prefix: str = "") -> list:
    out = []
    for kind in dict.fromkeys(r["kind"] for r in rows):
        mine = {r["x_value"]: r for r in rows if r["kind"] == kind and r["series"] == series}
        for x, r in mine.items():
            out.append({**r, "series": agg_series, "y_name": T.AGG_NAME,
                        "y_value": r["y_value"] * x, "unit": T.AGG_UNIT})
        for a, b in pairs:
            if a in mine and b in mine:
                out.append({**mine[b], "series": prefix + speedup_series(a, b),
                            "x_value": f"{a}->{b}",
                            "y_name": "speedup", "unit": "x",
                            "y_value": mine[b]["y_value"] * b / (mine[a]["y_value"] * a)})
    return out


def summarize(records) -> list[dict]:
    rows = TS.paper_scale_rows(records, FIGURE, lambda s: BARS, lambda s: s.gpus)
    rows += _aggregate_and_speedups(rows, BARS, AGG, PAIRS)
    local = []
    for r in TS.ok_records(records, "measured_local"):
        q = r.params
        series = f"local {q['model']}: P_os+g (C3), TP 1"
        local.append(TS.base_row(r, FIGURE, series, q["world_size"], r.metrics["tflops_per_gpu"]))
    worlds = sorted({r["x_value"] for r in local})
    pairs = [(a, b) for a, b in zip(worlds, worlds[1:])]
    for model in dict.fromkeys(r["series"] for r in local):
        mine = [r for r in local if r["series"] == model]
        local += _aggregate_and_speedups(mine, model, f"{model} aggregate", pairs, "local ")
    return rows + local


def _source(series: str) -> str:
    """`` · this machine: <hw>`` of a labelled series (``lab.figures.regenerate``), else ''."""
    return f", {series.split(' · ', 1)[1]}" if " · " in series else ""


GREENS = ["tab:green", "darkolivegreen", "yellowgreen", "seagreen"]


def _panel(ax, df, title: str, xlabel: str = TP.axis_label("num_gpus")) -> None:
    """Bars: per-GPU throughput (left axis). Lines (right axis, linear from 0): the aggregate
    in green as the paper's "green line", perfect linear scaling in blue as its "blue line"."""
    per = df[df["y_name"] == T.Y_NAME]
    xs = sorted({int(x) for x in per["x_value"]})
    TP.draw_bars(ax, per.assign(x_value=per["x_value"].astype(int)), xs,
                 palette=["tab:orange", "tab:purple", "tab:brown", "tab:pink"])
    ax2 = ax.twinx()
    agg = df[df["y_name"] == T.AGG_NAME].copy()
    agg["_x"] = agg["x_value"].astype(float).map(lambda v: xs.index(int(v)))
    styles = {"paper": ("X", "none"), "simulated": ("s", "--"), "measured": ("o", "-")}
    greens = {}
    for (series, kind), g in agg.groupby(["series", "kind"], sort=False):
        g = g.sort_values("_x")
        m, ls = styles.get(kind, ("o", "-"))
        color = greens.setdefault(series, GREENS[len(greens) % len(GREENS)])
        if series == LINEAR:
            m, ls, color = "", ":", "tab:blue"
        ax2.plot(g["_x"], g["y_value"].astype(float), marker=m, linestyle=ls, color=color,
                 markersize=9 if kind == "paper" else 5, label=TP.label(series, kind))
    ours = agg[agg["kind"].isin(["simulated", "measured"]) & (agg["series"] != LINEAR)]
    for series, g in ours.groupby("series", sort=False):  # our own perfect-linear reference
        r = g.sort_values("_x").iloc[0]
        x0 = int(float(r["x_value"]))
        ax2.plot(range(len(xs)), [float(r["y_value"]) * x / x0 for x in xs], "-.",
                 color="tab:blue", alpha=0.6,
                 label=f"perfect linear scaling from x = {x0} (ours{_source(series)}) "
                       f"[{r['kind']}]")
    if len(agg):
        ax2.set_ylim(bottom=0)
        ax2.set_ylabel(TP.axis_label(T.AGG_NAME) + " (lines)")
    ax.set_ylabel(TP.axis_label(T.Y_NAME) + " (bars)")
    ax.set_xlabel(xlabel)
    ax.set_title(title + TP.mean_err(per), fontsize=9)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    TP.legend_below(ax, h1 + h2, l1 + l2)


def plot(table: pd.DataFrame, out_dir: str) -> list[str]:
    TS.write_predictions(table, out_dir)
    big, local = TP.split(table)
    big = big[big["y_name"].isin([T.Y_NAME, T.AGG_NAME])]
    n = 1 + bool(len(local))
    fig, axes = plt.subplots(1, n, figsize=(7.5 * n, 6.6), squeeze=False)
    _panel(axes[0][0], big, "Fig 3: 60B model, 64-400 V100 GPUs (paper scale)")
    if len(local):
        _panel(axes[0][1], local, TP.local_title(local), "number of CPU ranks (DP degree)")
    return TP.save(fig, out_dir, "fig3_scaling")
