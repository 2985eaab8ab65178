"""Calibration of the performance model's two free parameters (``PerfParams``: ``e_max``,
``comm_eff``) on the paper's Figure 2 ZeRO series; predictions of Figures 2 (baseline), 3, 4 and 8
without refitting (paper §10.2-10.5). Entry points: ``calibration``, ``fit``, ``predict_fig2/3/4/8``.

Taken from the paper: hardware specs (§10.1 -> ``conf/cluster/dgx2_v100.yaml``), setups (Tables
5, 6, 9, 10, ``zero_repro.scale.paper.setups``), fit targets (Figure 2 "ZeRO-100B" TFLOPs/GPU at
the batches Table 5 states; with ``use_fig3`` Figure 3's bars). Objective: Σ log(simulated /
paper)², a deterministic Nelder-Mead on the log of the parameters, bounds by clipping.
Predictions take the batch the memory dry run says fits (``lab.throughput.batch``) or the
paper's (the "paper batch" series). A Figure 2/3 point's ZeRO-R configuration (unstated,
``zero_config_for``): the cheapest the analytic model fits on a 32 GB V100: C4 when MP > 1, C3
when MP = 1, C5 when C4 does not fit (§10.5: 170B needs P_a+cpu). Fit limits:
``results/fig2_throughput/notes.md``.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, Sequence

import pandas as pd

from zero_repro.scale.analytic import ZERO_CONFIGS, fits
from zero_repro.scale.dryrun.stack import switches as S
from zero_repro.scale.paper import table9
from zero_repro.scale.paper.buckets import ALLGATHER_BUCKET, REDUCE_BUCKET
from zero_repro.scale.paper.setups import PaperSetup, paper_values
from zero_repro.scale.paper.setups import setups
from zero_repro.scale.hardware import Hardware
from zero_repro.scale.hardware import hardware
from zero_repro.scale.perf_model import PerfParams, Workload, step_time

log = logging.getLogger(__name__)

FIG2_ZERO = "ZeRO-100B ("
FIG2_BASELINE = "Baseline"
FIG3_BARS = "ZeRO-100B 60B model, Performance/GPU"
BOUNDS = {"e_max": (0.05, 1.0), "comm_eff": (0.02, 1.0)}
PARAM_NAMES = ("e_max", "comm_eff")


@dataclass
class Calibration:
    params: PerfParams
    cluster: str
    targets: list[str]  # which series were fitted
    n_free: int = len(PARAM_NAMES)
    residuals: list[dict] = field(default_factory=list)  # per fitted point: x, paper, sim, rel
    objective: float = 0.0


# -------------------------------------------------------------------------- setups -> work
def zero_config_for(s: PaperSetup, hw: Hardware) -> str:
    """The ZeRO-R configuration assumed for a setup (see module doc)."""
    if s.zero_config.startswith("C") or s.zero_config == "baseline":
        return s.zero_config
    if s.size_label == "170B":  # §10.5: 170B needs P_a+cpu to run (stated; no capacity test)
        return "C5"
    first = "C4" if s.tp > 1 else "C3"
    ok = fits(hw.device_bytes, s.n_layer, s.hidden, s.heads, s.tp, s.dp, s.batch_per_gpu,
              first, reduce_bucket=REDUCE_BUCKET, allgather_bucket=ALLGATHER_BUCKET)
    return first if ok or s.tp == 1 else "C5"


def workload_for(s: PaperSetup, hw: Hardware, zero_config: str | None = None,
                 stack: S.Stack | None = None, **overrides) -> Workload:
    """The performance model's workload of setup ``s`` under ``zero_config`` (default: the
    configuration ``zero_config_for`` assumes) and the software stack's time switches
    (default: ``paper2020``, the stack that ran the paper; ``scale.dryrun.stack.switches``);
    ``overrides``: Workload fields."""
    cfg = zero_config or zero_config_for(s, hw)
    mc = ZERO_CONFIGS[cfg]
    st = S.paper2020() if stack is None else stack
    kw = dict(n_layer=s.n_layer, hidden=s.hidden, heads=s.heads, gpus=s.gpus, tp=s.tp,
              batch_per_gpu=s.batch_per_gpu, stage=mc.stage, checkpointing=mc.checkpointing,
              p_a=mc.p_a and s.tp > 1, p_a_cpu=mc.cpu,
              step_commit=st.stage2_step if st.zero_step_time and st.stage2_step != "none"
              else "", rooted_reduce=st.stage2_rooted_reduces,
              pa_cpu_sync=st.pa_cpu_pageable_sync)
    kw.update(overrides)
    return Workload(**kw)


def _points(figure: str, series: str, prefix: str, x_of: Callable[[PaperSetup], float]
            ) -> list[tuple[PaperSetup, float, float]]:
    """(setup, x, paper y) for the setups of ``series`` that have a paper value."""
    pv = paper_values(figure, prefix)
    out = []
    for s in setups(figure):
        if s.series == series and x_of(s) in pv:
            out.append((s, x_of(s), pv[x_of(s)]))
    return out


def fig2_points(series: str = "ZeRO"):
    return _points("fig2", series, FIG2_ZERO if series == "ZeRO" else FIG2_BASELINE,
                   lambda s: s.size_b)


def fig3_points():
    return _points("fig3", "ZeRO", FIG3_BARS, lambda s: float(s.gpus))


# ---------------------------------------------------------------------------- optimisation
def nelder_mead(f: Callable[[list[float]], float], x0: Sequence[float], step: float = 0.3,
                iters: int = 400, tol: float = 1e-10) -> tuple[list[float], float]:
    """Plain deterministic Nelder-Mead (reflection 1, expansion 2, contraction 0.5)."""
    n = len(x0)
    simplex = [list(x0)] + [[x0[j] + (step if j == i else 0.0) for j in range(n)]
                            for i in range(n)]
    vals = [f(x) for x in simplex]
    for _ in range(iters):
        order = sorted(range(n + 1), key=vals.__getitem__)
        simplex, vals = [simplex[i] for i in order], [vals[i] for i in order]
        if vals[-1] - vals[0] < tol:
            break
        cen = [sum(x[j] for x in simplex[:-1]) / n for j in range(n)]
        refl = [c + (c - w) for c, w in zip(cen, simplex[-1])]
        fr = f(refl)
        if fr < vals[0]:
            exp = [c + 2 * (c - w) for c, w in zip(cen, simplex[-1])]
            fe = f(exp)
            simplex[-1], vals[-1] = (exp, fe) if fe < fr else (refl, fr)
        elif fr < vals[-2]:
            simplex[-1], vals[-1] = refl, fr
        else:
            con = [c + 0.5 * (w - c) for c, w in zip(cen, simplex[-1])]
            fc = f(con)
            if fc < vals[-1]:
                simplex[-1], vals[-1] = con, fc
            else:  # shrink towards the best vertex
                best = simplex[0]
                simplex = [best] + [[b + 0.5 * (x - b) for b, x in zip(best, v)]
                                    for v in simplex[1:]]
                vals = [vals[0]] + [f(v) for v in simplex[1:]]
    i = min(range(n + 1), key=vals.__getitem__)
    return simplex[i], vals[i]


def _to_params(z: Sequence[float]) -> PerfParams:
    vals = {}
    for name, v in zip(PARAM_NAMES, z):
        lo, hi = BOUNDS[name]
        vals[name] = min(max(math.exp(v), lo), hi)
    return PerfParams(**vals)


def _residuals(p: PerfParams, hw: Hardware, points, figure: str) -> list[dict]:
    out = []
    for s, x, y in points:
        sim = step_time(workload_for(s, hw), hw, p)["tflops_per_gpu"]
        out.append({"figure": figure, "point": s.point, "x": x, "paper": y, "simulated": sim,
                    "rel_err": sim / y - 1.0})
    return out


def fit(cluster: str = "dgx2_v100", use_fig3: bool = False,
        x0: PerfParams = PerfParams()) -> Calibration:
    """Fit (e_max, comm_eff) on Figure 2's ZeRO series at the paper's batches (Table 5;
    + Figure 3 bars if asked)."""
    hw = hardware(cluster)
    sets = [("fig2", fig2_points("ZeRO"))] + ([("fig3", fig3_points())] if use_fig3 else [])

    def objective(z):
        p = _to_params(z)
        return sum(math.log(1.0 + r["rel_err"]) ** 2
                   for fig, pts in sets for r in _residuals(p, hw, pts, fig))

    z0 = [math.log(getattr(x0, n)) for n in PARAM_NAMES]
    best_z, best_f = nelder_mead(objective, z0)
    for _ in range(2):  # restarts from the optimum guard against a collapsed simplex
        best_z, best_f = nelder_mead(objective, best_z, step=0.1)
    p = _to_params(best_z)
    res = [r for fig, pts in sets for r in _residuals(p, hw, pts, fig)]
    log.info("calibrated %s on %d points: e_max %.4g (of the tensor-core peak), comm_eff %.4g "
             "(of the link bandwidth), objective %.4g (sum of log(sim/paper)^2)", cluster,
             len(res), p.e_max, p.comm_eff, best_f)
    return Calibration(params=p, cluster=cluster,
                       targets=["fig2 ZeRO"] + (["fig3"] if use_fig3 else []),
                       residuals=res, objective=best_f)


# ------------------------------------------------------------------------------ predictions
def _row(figure: str, series: str, x_name: str, x, y: float) -> dict:
    return {"figure": figure, "series": series, "x_name": x_name, "x_value": x,
            "y_name": "throughput_per_gpu", "y_value": y, "unit": "TFLOPs/GPU",
            "kind": "simulated"}


def _predict(cal: Calibration, figure: str, x_name: str, x_of, series_name,
             overlap_of=lambda s: False) -> list[dict]:
    hw = hardware(cal.cluster)
    rows = []
    rows_of = setups(figure)
    if figure == "fig8":  # Table 9's rows -> C1..C5 (paper.table9: Table 7's order by default)
        rows_of = table9.remap(rows_of)
    for s in rows_of:
        w = workload_for(s, hw, overlap_comm=overlap_of(s))
        tf = step_time(w, hw, cal.params)["tflops_per_gpu"]
        rows.append(_row(figure, series_name(s), x_name, x_of(s), tf))
    return rows


def predict_fig2(cal: Calibration) -> list[dict]:
    return _predict(cal, "fig2", "model_size_B", lambda s: s.size_b,
                    lambda s: "ZeRO-100B" if s.series == "ZeRO" else "Baseline (Megatron-LM)")


def predict_fig3(cal: Calibration) -> list[dict]:
    return _predict(cal, "fig3", "num_gpus", lambda s: s.gpus, lambda s: "ZeRO-100B 60B model")


def predict_fig4(cal: Calibration) -> list[dict]:
    """Table 10 setups, MP = 1. The baseline is PyTorch DDP, which overlaps its bucketed
    gradient all-reduce with backward (Megatron-2019's own DDP in Figure 2 did not)."""
    return _predict(cal, "fig4", "model_size_B", lambda s: s.size_b,
                    lambda s: "ZeRO-DP (P_os+g)" if s.series == "ZeRO" else "Baseline-DP",
                    overlap_of=lambda s: s.series == "Baseline")


def predict_fig8(cal: Calibration) -> list[dict]:
    return _predict(cal, "fig8", "zero_config", lambda s: s.point,
                    lambda s: f"{s.size_label} ({s.gpus} GPUs)")


def errors_vs_paper(cal: Calibration) -> dict[str, list[dict]]:
    """Per-point relative errors at the paper's batches: Fig 2 ZeRO (the fit), and the
    unfitted Fig 2 baseline, Fig 2 speed-up (ZeRO / baseline) and Fig 3."""
    hw = hardware(cal.cluster)
    zero = _residuals(cal.params, hw, fig2_points("ZeRO"), "fig2")
    base = _residuals(cal.params, hw, fig2_points("Baseline"), "fig2")
    paper_sp = paper_values("fig2", "ZeRO speed-up", "speedup")
    bmap = {r["x"]: r for r in base}
    speed = []
    for z in zero:
        b = bmap.get(z["x"])
        if b is None or z["x"] not in paper_sp:
            continue
        sim = z["simulated"] / b["simulated"]
        speed.append({"figure": "fig2", "point": f"{z['x']:g}B speed-up", "x": z["x"],
                      "paper": paper_sp[z["x"]], "simulated": sim,
                      "rel_err": sim / paper_sp[z["x"]] - 1.0})
    return {"fig2_zero": zero, "fig2_baseline": base, "fig2_speedup": speed,
            "fig3": _residuals(cal.params, hw, fig3_points(), "fig3")}


# ------------------------------------------------------------------------ shared fit, files
@lru_cache(maxsize=4)
def calibration(cluster: str = "dgx2_v100", use_fig3: bool = False) -> Calibration:
    """``fit`` once per process (Figures 2, 3, 4 and 8 share one calibration)."""
    return fit(cluster=cluster, use_fig3=use_fig3)


def calibration_summary(cal: Calibration) -> dict:
    """Fitted values, fit error and the prediction errors of the unfitted series."""
    errs = errors_vs_paper(cal)
    worst = {k: max(abs(r["rel_err"]) for r in v) for k, v in errs.items() if v}
    return {"cluster": cal.cluster, "fitted_on": cal.targets, "n_free": cal.n_free,
            "params": dataclasses.asdict(cal.params), "objective": cal.objective,
            "max_abs_rel_err": worst, "residuals": errs}


def write_calibration(cal: Calibration, results_dir: str) -> list[str]:
    """results/calibration/<cluster>_<targets>.json and .csv: fitted values, fit error, and the
    prediction errors of the unfitted series (Fig 2 baseline, Fig 3). Written atomically."""
    out = os.path.join(results_dir, "calibration")
    os.makedirs(out, exist_ok=True)
    summ = calibration_summary(cal)
    stem = os.path.join(out, f"{cal.cluster}_{'+'.join(t.split()[0] for t in cal.targets)}")
    with open(stem + ".json.tmp", "w") as f:
        json.dump(summ, f, indent=1)
    os.replace(stem + ".json.tmp", stem + ".json")
    rows = [{"series": k, "fitted": k in ("fig2_zero",) or (k == "fig3" and len(cal.targets) > 1),
             **r} for k, v in summ["residuals"].items() for r in v]
    pd.DataFrame(rows).to_csv(stem + ".csv", index=False)
    return [stem + ".json", stem + ".csv"]
