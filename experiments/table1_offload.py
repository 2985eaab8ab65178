"""Table 1's offload column: per-GPU model states with the optimizer and the gradients on the host
(ZeRO-Offload, Ren et al. 2021 §4.1; ``zero.offload_optimizer=cpu``) and, at stage 3, the
parameters too (ZeRO-3 Offload; ``zero.offload_param=cpu``: scheme ``Pos+g+p+param``), device and
host apart (fp16 + Adam, K = 12, GB = 1e9 bytes).

* analytic: the column at the paper's Ψ = 7.5B / 128B / 1T and N_d = 1 ... 1024 for P_os,
  P_os+g, P_os+g+p and P_os+g+p with the parameters (``scale.paper.table1.offload_bytes``):
  device 2Ψ / 2Ψ / 2Ψ/N_d / 0, host (K + 2)Ψ/N_d = 14Ψ/N_d (the optimizer's 12 and the gradient
  copy the host step reads), 16Ψ/N_d with the parameters;
* measured: the memory ledger of real runs on local gloo ranks (the ``small`` model, fp16, C_B
  on, world = N_d in ``experiment.params.measured_nd``, TP 1, the stages in ``experiment.params.stages``
  with the optimizer offloaded, stage 0 only at N_d = 1, and stage 3 again with the parameters,
  two steps): its device model states
  (``MemoryLedger.model_states``) and host model states (``host_model_states``) beside the
  column at that run's Ψ (flat-buffer elements, padding included); ``matches_formula`` says
  whether each equals it to the byte. On these CPU ranks host and device are the same memory:
  the ledger says where each byte would live with a GPU.
"""
from __future__ import annotations

from zero_repro.lab.figures.figures import save_figure
from zero_repro.lab.records import newest_ok
from zero_repro.lab.points import Point
from zero_repro.scale.dryrun.real_run import ledgers_per_stage
from zero_repro.scale.paper.table1 import (STAGE_NAMES, TABLE1_ND, TABLE1_PSI,
                                           offload_bytes)

FIGURE = "table1_offload"
# a re-run replaces the table's result (the records before the device kept no gradient store
# stay in points.jsonl as history): summarize takes the newest ok record of every point
NEWEST_ONLY = True
PARAM = "Pos+g+p+param"  # stage 3 with zero.offload_param=cpu too
PAPER_FIGURE = "table1_offload"
PARAM = "Pos+g+p+param"  # stage 3 with zero.offload_param=cpu too  # not in the paper: no paper rows
GB = 1e9


def plan(cfg) -> list[Point]:
    p = cfg.experiment.params
    pts = [Point(name="table1 offload analytic", params={"part": "analytic"}, mode="analytic")]
    for n_d in p.get("measured_nd", [1, 2, 3, 4]):
        pts.append(Point(name=f"{cfg.model.name} offload N_d={n_d}",
                         params={"part": "measured", "n_d": int(n_d)},
                         # the point's own stage is 1 (valid at every N_d with offload);
                         # run_point builds each stage of ``stages`` in turn
                         overrides={"parallel.world_size": int(n_d), "parallel.tp": 1,
                                    "zero.dtype": "fp16", "zero.stage": 1,
                                    "zero.offload_optimizer": "cpu"},
                         mode="measured"))
    return pts


def run_point(cfg, point: Point) -> dict:
    if point.mode == "analytic":
        return {"cells": [{"model": m, "scheme": PARAM if par == "cpu" else STAGE_NAMES[s],
                           "n_d": n, **offload_bytes(psi, s, n, param=par)}
                          for m, psi in TABLE1_PSI.items()
                          for s, par in ((1, "none"), (2, "none"), (3, "none"), (3, "cpu"))
                          for n in TABLE1_ND]}
    n_d = cfg.parallel.world_size
    stages = cfg.experiment.params.get("stages", [0, 1, 2, 3])
    out = ledgers_per_stage(cfg, [s for s in stages if s != 0 or n_d == 1])  # stage 0: DP 1
    out["params"] = ["none"] * len(out["stages"])
    if 3 in stages:  # stage 3 again with the parameter shard on the host
        par = ledgers_per_stage(_with(cfg, offload_param="cpu"), [3])
        out["stages"] += par["stages"]
        out["runs"] += par["runs"]
        out["params"] += ["cpu"]
    return out


def _with(cfg, **zero):
    import dataclasses
    return dataclasses.replace(cfg, zero=dataclasses.replace(cfg.zero, **zero))


def summarize(records) -> list[dict]:
    rows = []
    for r in newest_ok(records):
        if r.status != "ok":
            continue
        if r.mode == "analytic":
            for c in r.metrics["cells"]:
                for where in ("device", "host"):
                    rows.append({"figure": FIGURE,
                                 "series": f"{c['model']} model {c['scheme']} {where}",
                                 "x_name": "N_d", "x_value": c["n_d"],
                                 "y_name": "model_state_memory_per_gpu",
                                 "y_value": round(c[where] / GB, 4), "unit": "GB",
                                 "kind": "analytic"})
            continue
        n_d = r.metrics["n_d"]
        params = r.metrics.get("params") or ["none"] * len(r.metrics["stages"])
        for stage, run, par in zip(r.metrics["stages"], r.metrics["runs"], params):
            want = offload_bytes(run["psi_padded"], stage, n_d, param=par)
            scheme = PARAM if par == "cpu" else STAGE_NAMES[stage]
            got = {"device": run["model_state_bytes"],
                   "host": run.get("host_model_state_bytes", 0)}
            for where in ("device", "host"):
                rows.append({"figure": f"{FIGURE}_measured",
                             "series": f"{r.config['model']['name']} (Ψ={run['psi']}) "
                                       f"{scheme} {where}",
                             "x_name": "N_d", "x_value": n_d,
                             "y_name": "model_state_bytes_per_gpu", "y_value": got[where],
                             "unit": "bytes", "kind": "measured",
                             "formula_bytes": want[where], "psi_padded": run["psi_padded"],
                             "matches_formula": got[where] == want[where]})
    return rows


def conclude(table) -> list[str]:
    """The measured ledgers against the column's formula, and at the largest measured N_d
    each stage's device and host bytes per rank."""
    out = []
    meas = table[(table["figure"] == f"{FIGURE}_measured") & (table["kind"] == "measured")]
    if "source" in meas:
        mine = meas[meas["source"].astype(str) != "reference"]
        meas = mine if len(mine) else meas
    if not len(meas):
        return out
    match = meas["matches_formula"].astype(str) == "True"
    n_ds = sorted({int(x) for x in meas["x_value"].astype(float)})
    out.append(f"offload column, measured (real gloo runs, N_d {', '.join(map(str, n_ds))}): "
               f"{int(match.sum())} of {len(meas)} ledgers (device and host) equal "
               f"table1.offload_bytes to the byte")
    top = meas[meas["x_value"].astype(float) == n_ds[-1]]
    parts = [f"{str(row['series']).split(') ')[-1]} {float(row['y_value']) / 1e6:.1f}"
             for _, row in top.iterrows()]
    out.append(f"N_d {n_ds[-1]}: model states per rank [MB] " + ", ".join(parts))
    return out


COLOUR = {"Pos": "C1", "Pos+g": "C2", "Pos+g+p": "C3", "baseline": "C0", PARAM: "C4"}


def plot(table, out_dir: str) -> list[str]:
    """Left: the analytic column for each of the paper's Ψ (device solid, host dashed, log
    scales); right: the measured ledgers (o; the reference set's beside a user's own: open
    squares) against the formula (+), MB."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 6.2))
    ana = table[(table["figure"] == FIGURE) & (table["kind"] == "analytic")]
    for series, g in ana.groupby("series", sort=False):
        model, _, scheme, where = str(series).split(" ")
        g = g.assign(x=pd.to_numeric(g["x_value"])).sort_values("x")
        a1.plot(g["x"], g["y_value"], "-" if where == "device" else "--",
                color=COLOUR[scheme], marker={"7.5B": "^", "128B": "s", "1T": "o"}[model],
                markersize=4, label=f"{model} {scheme} {where}")
    a1.set(xscale="log", yscale="log", xlabel="N_d", ylabel="model states per GPU [GB]",
           title="offload column (analytic): device solid, host dashed\n"
                 "(Pos+g+p+param: device 0, off the log scale)")
    a1.legend(fontsize=6, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.13))
    meas = table[(table["figure"] == f"{FIGURE}_measured") & (table["kind"] == "measured")]
    for series, g in meas.groupby("series", sort=False):
        # "<model> (Ψ=...) <scheme> <where>", in a user's results directory followed by
        # " · this machine: <hw>" or " · reference: <hw>" (lab.figures.regenerate)
        head, _, source = str(series).partition(" · ")
        scheme, where = head.split(") ")[-1].split(" ")
        marker = "s" if source.startswith("reference") else "o"
        g = g.assign(x=pd.to_numeric(g["x_value"])).sort_values("x")
        a2.plot(g["x"], g["y_value"] / 1e6, ("-" if where == "device" else "--") + marker,
                color=COLOUR[scheme], fillstyle="none" if marker == "s" else "full",
                label=f"{scheme} {where}" + (f" ({source.split(':')[0]})" if source else ""))
        a2.plot(g["x"], g["formula_bytes"] / 1e6, "k+", markersize=10)
    ok = bool(meas["matches_formula"].astype(str).eq("True").all()) if len(meas) else False
    a2.set(xlabel="N_d (gloo ranks)", ylabel="model-state bytes per rank [MB]",
           title=f"measured ledger (o) vs formula (+): {'all equal' if ok else 'MISMATCH'}\n"
                 "(on the device P_os and P_os+g hold the same 2Ψ: one line)")
    a2.xaxis.get_major_locator().set_params(integer=True)
    a2.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.13))
    fig.tight_layout()
    return save_figure(fig, out_dir, FIGURE, dpi=150)
