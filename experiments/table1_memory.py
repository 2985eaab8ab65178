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

from zero_repro.lab.figures.figures import save_figure
from zero_repro.lab.points import Point
from zero_repro.runtime.comm.launch import spawn
from zero_repro.scale.dryrun.dryrun import real_ledgers
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
    import dataclasses

    from omegaconf import OmegaConf

    stages = list(cfg.experiment.params.get("stages", [0, 1, 2, 3]))
    dicts = [OmegaConf.to_container(OmegaConf.structured(
        dataclasses.replace(cfg, zero=dataclasses.replace(cfg.zero, stage=s)))) for s in stages]
    res = spawn(real_ledgers, cfg.parallel.world_size, dicts)[0]
    return {"stages": stages, "runs": res, "n_d": cfg.parallel.world_size}


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
                         "matches_formula": run["model_state_bytes"] == formula})
    return rows


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
    meas = table[table["figure"] == f"{FIGURE}_measured"]
    for i, (series, g) in enumerate(meas.groupby("series", sort=False)):
        g = g.assign(x=pd.to_numeric(g["x_value"])).sort_values("x")
        a2.plot(g["x"], g["y_value"] / 1e6, "-o", color=f"C{i % 10}", label=f"{series} [ledger]")
        a2.plot(g["x"], g["formula_bytes"] / 1e6, "k+", markersize=10)
    ok = bool(meas["matches_formula"].all()) if len(meas) else False
    a2.set(xlabel="N_d (gloo ranks)", ylabel="model-state bytes per rank [MB]",
           title=f"measured ledger (o) vs formula (+): {'all equal' if ok else 'MISMATCH'}")
    if len(meas):
        xs = sorted(pd.to_numeric(meas["x_value"]).unique())
        a2.set_xticks(xs, [str(int(x)) for x in xs])
    a2.set_ylim(bottom=0)
    a2.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    paths = save_figure(fig, out_dir, 'table1_memory', dpi=150)
    return paths
