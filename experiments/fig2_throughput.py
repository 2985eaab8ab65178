"""Figure 2: throughput per GPU of ZeRO-100B vs the Megatron-LM baseline, 1.5B-170B parameters on
400 V100 GPUs (paper §10.2, setups Table 5). ZeRO-100B = P_os+g + ZeRO-R with MP inside a node
(MP <= 16); beyond ~40B the baseline's MP crosses nodes and its TP all-reduces (12·s·h·b bytes
per block) ride InfiniBand (~5 TFLOPs/GPU, the paper's collapse).

* simulated (paper scale): Table 5 through the performance model, whose 3 parameters are fitted
  on THIS figure's ZeRO series (the ZeRO rows are a fit, the baseline a prediction); speed-up =
  ZeRO / baseline per model size, as the paper's bars;
* measured (cluster): the same setups as real points (``cluster=dgx2_v100 launcher=slurm``);
* measured (local): ``local_models`` at world 2: C3 (P_os+g, DP 2) vs stage 0 with Megatron TP
  ``local_baseline_tp``, x = parameters in B.
"""
from __future__ import annotations

import pandas as pd

from zero_repro.lab.figures import throughput as T
from zero_repro.lab.figures import throughput_plots as TP
from zero_repro.lab.figures import throughput_summary as TS

PARAMS = T.PARAMS  # the experiment.params keys it reads (cli.check_params)

FIGURE = "fig2"
PAPER_FIGURE = "fig2"
ZERO = "ZeRO-100B (ZeRO-DP Pos+g + ZeRO-R, with Megatron MP)"
BASE_IN = "Baseline-MP (Megatron-LM, MP within node)"
BASE_OUT = "Baseline w. internode MP (Megatron-LM)"
SPEEDUP = "ZeRO speed-up bar (ZeRO/baseline)"
SERIES_FAMILY: dict = {}  # our paper-scale series carry the paper's names
GPUS_PER_NODE = 16  # DGX-2: the paper's split of the baseline into two series


def series_of(s) -> str:
    if s.series == "ZeRO":
        return ZERO
    return BASE_IN if s.tp <= GPUS_PER_NODE else BASE_OUT


def _local(cfg, p: dict) -> list:
    pts = []
    for model in p.get("local_models", ["tiny", "small", "gpt_20m"]):
        pts.append(T.local_point(FIGURE, f"local {model} ZeRO C3 w2", model, 2, 1, "C3", p,
                                 series="ZeRO"))
        tp = int(p.get("local_baseline_tp", 2))
        pts.append(T.local_point(FIGURE, f"local {model} baseline tp{tp} w2", model, 2, tp,
                                 "baseline", p, series="Baseline"))
    return pts


def plan(cfg) -> list:
    return T.plan_points(cfg, FIGURE, _local)


def run_point(cfg, point) -> dict:
    return T.run_point(cfg, point)


def _speedups(rows: list[dict], zero: str, bases: tuple, series: str) -> list[dict]:
    out = []
    for kind in dict.fromkeys(r["kind"] for r in rows):
        z = {r["x_value"]: r for r in rows if r["kind"] == kind and r["series"] == zero}
        b = {r["x_value"]: r for r in rows if r["kind"] == kind and r["series"] in bases}
        for x in z:
            if x in b and b[x]["y_value"] > 0:
                out.append({**z[x], "series": series, "y_name": "speedup", "unit": "x",
                            "y_value": z[x]["y_value"] / b[x]["y_value"]})
    return out


def summarize(records) -> list[dict]:
    rows = TS.paper_scale_rows(records, FIGURE, series_of, lambda s: s.size_b)
    rows += _speedups(rows, ZERO, (BASE_IN, BASE_OUT), SPEEDUP)
    local = []
    for r in TS.ok_records(records, "measured_local"):
        q = r.params
        if q["series"] == "ZeRO":
            name = "local ZeRO: P_os+g + ZeRO-R (C3), DP 2"
        else:
            name = f"local baseline: stage 0, Megatron TP {q['tp']}"
        x = round(r.metrics["params_total"] / 1e9, 6)
        local.append(TS.base_row(r, FIGURE, name, x, r.metrics["tflops_per_gpu"]))
    zero_local = "local ZeRO: P_os+g + ZeRO-R (C3), DP 2"
    bases = tuple({r["series"] for r in local} - {zero_local})
    local += _speedups(local, zero_local, bases, "local speed-up (ZeRO/baseline)")
    return rows + local


def plot(table: pd.DataFrame, out_dir: str) -> list[str]:
    return TP.plot_standard(table, out_dir, "fig2_throughput",
                           "Fig 2: 400 V100 GPUs, ZeRO-100B vs Megatron-LM (paper scale)",
                           categorical=False)
