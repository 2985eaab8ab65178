"""The calibrated performance model's prediction of a throughput point at paper scale (paper
§10.2-10.5): ``scale.calibrate`` (2 parameters fitted ONLY on Figure 2's ZeRO series, on the
paper's DGX-2 V100 cluster) through ``perf_model.step_time``: throughput per GPU = F/tp / T,
F the Megatron FLOPs of one iteration (96·B·s·l·h²·(1 + s/6h + V/16lh), recompute counted), T =
compute + exposed TP/DP/P_a/offload communication. A predicted-batch point runs each candidate
configuration at its largest batch that fits (``batch.max_fit_search``) and keeps the fastest.
"""
from __future__ import annotations

import dataclasses

from zero_repro.lab.throughput.batch import max_fit_search
from zero_repro.lab.throughput.setups import DEFAULTS, find_setup
from zero_repro.scale.calibrate import calibration, workload_for, zero_config_for
from zero_repro.scale.hardware import Hardware, hardware
from zero_repro.scale.paper.setups import PaperSetup, setups
from zero_repro.scale.perf_model import compute_efficiency, step_time

# Figure 4's baseline is PyTorch DDP, which overlaps its bucketed all-reduce with backward
# (must match calibrate.predict_fig4; a test checks the two agree)
OVERLAP = {"fig4": lambda s: s.series == "Baseline"}


def zero_config_of(s: PaperSetup, hw: Hardware) -> str:
    """'C1'..'C5' or 'baseline' (ZeRO points without a stated C: see calibrate.zero_config_for)."""
    return zero_config_for(s, hw)


def simulate(figure: str, label: str, series: str, batch: int, sim_cluster: str,
             use_fig3: bool = False, p: dict | None = None,
             zero_config: str | None = None) -> dict:
    """The calibrated model's prediction for one paper setup, with the inputs behind it."""
    cal = calibration(sim_cluster, use_fig3)
    hw = hardware(sim_cluster)
    s = find_setup(figure, label, series, p)
    w = workload_for(s, hw, zero_config, batch_per_gpu=int(batch),
                     overlap_comm=OVERLAP.get(figure, lambda _: False)(s))
    bd = step_time(w, hw, cal.params)
    return {"tflops_per_gpu": bd["tflops_per_gpu"],
            "aggregate_tflops": bd["tflops_per_gpu"] * s.gpus,
            "step_time_s": bd["total"], "breakdown_s": {k: v for k, v in bd.items()
                                                        if k != "tflops_per_gpu"},
            "workload": dataclasses.asdict(w), "perf_params": dataclasses.asdict(cal.params),
            "gemm_efficiency": compute_efficiency(w, hw, cal.params),
            "calibrated_on": cal.targets, "sim_cluster": sim_cluster, "batch": int(batch),
            "zero_config": zero_config or zero_config_of(s, hw),
            "in_sample": in_sample(w, cal, hw)}


def in_sample(w, cal, hw: Hardware) -> str:
    """The fitted point whose workload ``w`` is ('' if none): its prediction is in-sample."""
    fitted = [(s, "fig2") for s in setups("fig2") if s.series == "ZeRO"]
    if "fig3" in cal.targets:
        fitted += [(s, "fig3") for s in setups("fig3")]
    for s, fig in fitted:
        if dataclasses.replace(workload_for(s, hw), overlap_comm=w.overlap_comm) == w:
            return f"{fig} {s.point} (calibration point)"
    return ""


def simulate_max_fit(q: dict) -> dict:
    """A predicted-batch point: each candidate configuration at its largest batch that fits
    (``max_fit_search``), the fastest kept; the others stay in ``alternatives``."""
    p = {**DEFAULTS, **q, "judge": q.get("judge", "dryrun")}
    p["sim_judge"] = q.get("judge", "dryrun")
    p["max_fit_stack"] = q.get("stack", DEFAULTS["max_fit_stack"])
    s = find_setup(q["figure"], q["setup"], q["series"], q)
    best, alts = None, {}
    for zc in str(q["zero_config"]).split("/"):
        srch = max_fit_search(s, zc, p)
        if srch["batch"] < 1:
            alts[zc] = {"batch": 0, "tflops_per_gpu": 0.0, "search": srch}
            continue
        r = simulate(q["figure"], q["setup"], q["series"], srch["batch"], q["sim_cluster"],
                     bool(q.get("use_fig3")), q, zero_config=zc)
        r["search"] = srch
        alts[zc] = {"batch": srch["batch"], "tflops_per_gpu": r["tflops_per_gpu"],
                    "search": srch}
        if best is None or r["tflops_per_gpu"] > best["tflops_per_gpu"]:
            best = r
    if best is None:  # nothing fits, not even batch 1: the prediction is "does not run"
        return {"tflops_per_gpu": 0.0, "aggregate_tflops": 0.0, "batch": 0, "fits": False,
                "zero_config": q["zero_config"], "alternatives": alts,
                "batch_source": "max_fit: nothing fits", "in_sample": ""}
    best["alternatives"] = alts
    best["fits"] = True
    best["batch_source"] = (f"max_fit: largest on the batch grid that fits, "
                            f"{best['search']['judge']}")
    return best
