"""Table 1: per-device model-state memory of P_os, P_os+g and P_os+g+p (paper §5, K = 12, fp16 +
Adam, GB = 1e9 bytes) for Ψ = 7.5B / 128B / 1T and N_d = 1 ... 1024.

* analytic: all 54 cells from the closed form (``zero_repro.scale.analytic.table1``) at the
  paper's precision; ``truncated_by_paper`` flags the 8 cells the paper truncates instead of
  rounding (e.g. 257.75 -> 257), whose relative error is non-zero by design;
* measured: the memory ledger of real runs on local gloo ranks (the ``small`` model, fp16, world
  = N_d in ``experiment.params.measured_nd``, TP 1, stages 0-3, two steps) beside the formula at
  that run's Ψ (flat-buffer elements, padding included): ``matches_formula`` says whether the
  ledger equals it to the byte.
"""
from __future__ import annotations

from zero_repro.lab.figures import throughput_summary as TS
from zero_repro.lab.figures.figures import save_figure
from zero_repro.lab.points import Point
from zero_repro.scale.dryrun.real_run import ledgers_per_stage
from zero_repro.scale.analytic import model_state_bytes
from zero_repro.scale.paper.table1 import STAGE_NAMES
from zero_repro.scale import analytic

FIGURE = "table1"
PAPER_FIGURE = "table1"
Y = "model_state_memory_per_gpu"
SCHEME = STAGE_NAMES  # Table 1's column labels (reference.csv)


def plan(cfg) -> list[Point]:
    p = cfg.experiment.params
    pts = [Point(name="table1 analytic", params={"part": "analytic"}, mode="analytic")]
    for n_d in p.get("measured_nd", [1, 2, 4]):
        pts.append(Point(name=f"{cfg.model.name} N_d={n_d}",
                         params={"part": "measured", "n_d": int(n_d)},
                         overrides={"parallel.world_size": int(n_d), "parallel.tp": 1,
                                    "zero.dtype": "fp16"}, mode="measured"))
    return pts


def run_point(cfg, point: Point) -> dict:
    if point.mode == "analytic":
        return {"cells": [vars(c) for c in analytic.table1()]}
    return ledgers_per_stage(cfg, cfg.experiment.params.get("stages", [0, 1, 2, 3]))


def summarize(records) -> list[dict]:
    rows = []
    for r in records:
        if r.status != "ok":
            continue
        if r.mode == "analytic":
            for c in r.metrics["cells"]:
                rows.append({"figure": FIGURE, "series": f"{c['model']} model {c['scheme']}",
                             "x_name": "N_d", "x_value": c["n_d"], "y_name": Y,
                             "y_value": c["display"], "unit": "GB", "kind": "analytic",
                             "exact_GB": c["gb"], "paper_display": c["paper_display"],
                             "truncated_by_paper": c["truncated_by_paper"]})
            continue
        n_d = r.metrics["n_d"]
        for stage, run in zip(r.metrics["stages"], r.metrics["runs"]):
            formula = model_state_bytes(run["psi_padded"], stage, n_d)
            rows.append({"figure": f"{FIGURE}_measured",
                         "series": f"{r.config['model']['name']} (Ψ={run['psi']}) "
                                   f"{SCHEME[stage]}",
                         "x_name": "N_d", "x_value": n_d, "y_name": "model_state_bytes_per_gpu",
                         "y_value": run["model_state_bytes"], "unit": "bytes",
                         "kind": "measured", "formula_bytes": formula,
                         "psi_padded": run["psi_padded"],
                         "matches_formula": run["model_state_bytes"] == formula,
                         "provenance": TS.provenance_label(r)})
    return rows


def conclude(table) -> list[str]:
    """The 54 cells against the paper (equal / differ where the paper truncates / other), the
    measured ledgers against the formula, and at the largest measured N_d each stage's bytes
    per rank (stage 3 / baseline = 1/N_d)."""
    out = []
    cells = table[(table["figure"] == FIGURE) & (table["kind"] == "analytic")]
    if len(cells):
        err = cells["rel_error_vs_paper"].astype(float).abs()
        trunc = cells["truncated_by_paper"].astype(str) == "True"
        equal, other = int((err == 0).sum()), int(((err != 0) & ~trunc).sum())
        line = (f"analytic: {equal} of {len(cells)} cells equal the paper's printed value; "
                f"{int((trunc & (err != 0)).sum())} differ where the paper truncates instead of "
                f"rounding (largest {100 * err[trunc].max():.2f}%)")
        out.append(line + (f"; {other} other cells DIFFER" if other else ""))
    meas = table[(table["figure"] == f"{FIGURE}_measured") & (table["kind"] == "measured")]
    if "source" in meas:  # a user's table: their own runs beside the reference set's
        mine = meas[meas["source"].astype(str) != "reference"]
        meas = mine if len(mine) else meas
    if not len(meas):
        return out
    match = meas["matches_formula"].astype(str) == "True"
    n_ds = sorted({int(x) for x in meas["x_value"].astype(float)})
    model = str(meas["series"].iloc[0]).split(") ")[0] + ")"
    out.append(f"measured ({model}, real gloo runs, N_d {', '.join(map(str, n_ds))}): "
               f"{int(match.sum())} of {len(meas)} ledgers equal Table 1's formula to the byte")
    top = meas[meas["x_value"].astype(float) == n_ds[-1]]
    per_stage = {}
    for _, row in top.iterrows():
        stage = next((name for name in sorted(SCHEME.values(), key=len, reverse=True)
                      if str(row["series"]).split(" · ")[0].endswith(f") {name}")), None)
        if stage is not None:
            per_stage[stage] = float(row["y_value"])
    if per_stage:
        text = ", ".join(f"{k} {v / 1e6:.1f}" for k, v in
                         sorted(per_stage.items(), key=lambda kv: -kv[1]))
        line = f"N_d {n_ds[-1]}: model states per rank [MB] {text}"
        if "baseline" in per_stage and "Pos+g+p" in per_stage:
            line += (f"; Pos+g+p / baseline = {per_stage['Pos+g+p'] / per_stage['baseline']:.3f}"
                     f" (1/N_d = {1 / n_ds[-1]:.3f})")
        out.append(line)
    return out


def plot(table, out_dir: str) -> list[str]:
    """Table 1 as a grid of paper vs ours (log scale), plus the measured-vs-formula panel."""

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.8))
    ours = table[(table["figure"] == FIGURE) & (table["kind"] == "analytic")]
    paper = table[(table["figure"] == FIGURE) & (table["kind"] == "paper")]
    for i, (series, g) in enumerate(ours.groupby("series", sort=False)):
        g = g.assign(x=pd.to_numeric(g["x_value"])).sort_values("x")
        a1.plot(g["x"], g["y_value"], ":^", color=f"C{i % 10}", label=f"{series} [analytic]")
        p = paper[paper["series"] == series]
        a1.plot(pd.to_numeric(p["x_value"]), pd.to_numeric(p["y_value"]), "X",
                color=f"C{i % 10}", markeredgecolor="black", markersize=8)
    a1.set(xscale="log", yscale="log", xlabel="N_d", ylabel="model-state memory per GPU [GB]",
           title="Table 1: analytic (^) vs paper (X)")
    a1.set_ylim(1e-3, 1e5)  # room below the data for the legend
    a1.legend(fontsize=6.5, ncol=3, loc="lower left", framealpha=0.9)
    _plot_measured(a2, table[table["figure"] == f"{FIGURE}_measured"])
    fig.tight_layout()
    paths = save_figure(fig, out_dir, 'table1_memory', dpi=150)
    return paths


STAGE_COLOUR = {"baseline": "C0", "Pos": "C1", "Pos+g": "C2", "Pos+g+p": "C3"}


def _plot_measured(ax, meas) -> None:
    """Ledger (o) vs formula (+) per stage: colour = stage; this machine's series solid with
    filled markers, the reference set's dashed with larger hollow markers, so a series that
    equals the other stays visible; the title says whether they coincide."""
    import pandas as pd
    from matplotlib.lines import Line2D

    if not len(meas):
        ax.set_title("measured ledger: no runs")
        return
    meas = meas.assign(x=pd.to_numeric(meas["x_value"]),
                       source=meas.get("source", pd.Series("this machine", index=meas.index)))
    meas = meas.assign(stage=meas["series"].str.split(" · ", regex=False).str[0].str.split(") ", regex=False).str[-1],
                       src=meas["series"].str.split(" · ", regex=False).str[1].fillna("this machine")
                       .str.split(":").str[0])
    for (src, stage), g in meas.groupby(["src", "stage"], sort=False):
        g = g.sort_values("x")
        ref = src == "reference"
        ax.plot(g["x"], g["y_value"] / 1e6, "--" if ref else "-", color=STAGE_COLOUR[stage],
                marker="o", markersize=11 if ref else 5, markerfacecolor="none" if ref else None,
                alpha=0.8 if ref else 1.0)
        ax.plot(g["x"], g["formula_bytes"] / 1e6, "k+", markersize=10)
    ok = bool(meas["matches_formula"].all())
    srcs = list(dict.fromkeys(meas["src"]))
    same = ""
    if len(srcs) == 2:
        a, b = (meas[meas["src"] == s].set_index(["stage", "x"])["y_value"] for s in srcs)
        common = a.index.intersection(b.index)
        same = ("\nthis machine = reference at every point (drawn over each other)" if len(common)
                and (a[common] == b[common]).all() else "")
    ax.set(xlabel="N_d (gloo ranks)", ylabel="model-state bytes per rank [MB]",
           title=f"measured ledger (o) vs formula (+): {'all equal' if ok else 'MISMATCH'}"
                 f"{same}")
    xs = sorted(meas["x"].unique())
    ax.set_xticks(xs, [str(int(x)) for x in xs])
    ax.set_ylim(0, meas["y_value"].max() / 1e6 * 1.35)  # headroom for the legends
    model = meas["series"].iloc[0].split(") ")[0] + ")"
    stages = [Line2D([], [], color=c, marker="o", label=s)
              for s, c in STAGE_COLOUR.items() if s in set(meas["stage"])]
    leg = ax.legend(handles=stages, title=model, fontsize=7, title_fontsize=7,
                    loc="upper right", ncol=2)
    ax.add_artist(leg)
    def label(src: str) -> str:
        full = next((s for s in meas["series"] if " · " in s and s.split(" · ")[1]
                     .startswith(src)), None)
        return full.split(" · ")[1].split(" [")[0] if full else "ledger of real gloo runs"

    styles = [Line2D([], [], color="grey", marker="o", markersize=11 if s == "reference" else 5,
                     markerfacecolor="none" if s == "reference" else "grey",
                     ls="--" if s == "reference" else "-", label=label(s)) for s in srcs]
    styles.append(Line2D([], [], color="k", marker="+", ls="", markersize=10,
                         label="Table 1 formula at the run's Ψ"))
    ax.legend(handles=styles, fontsize=7, loc="upper center", bbox_to_anchor=(0.35, 1.0))
