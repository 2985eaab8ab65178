"""Figure 4: largest-model throughput with ZeRO-DP only (no model parallelism), 128 V100 GPUs
(paper §10.4, setups Table 10). Paper values are withheld: these are predictions.

P_os+g needs 2Ψ + 14Ψ/N_d bytes of model states per GPU (Table 1), so with N_d = 128 a 13B
model fits a 32 GB V100 without MP, where baseline DP (16Ψ) stops near 1.4B.

* simulated (paper scale): Table 10 setups through the performance model calibrated on Figure 2
  (ZeRO-DP = P_os+g + C_B/M_D + checkpointing; the baseline is PyTorch DDP, whose bucketed
  all-reduce overlaps backward), at the batch the paper2020 memory dry run says fits (largest
  on the batch grid) and at Table 10's batch ("paper batch"). The inputs behind each value go to
  ``results/fig4_dp_only/predictions.csv``;
* measured (cluster): the same setups as real points;
* measured (local): ``local_models`` at world 2, TP 1: stage 0 (DDP baseline) vs stage 2
  (P_os+g, C3), x = parameters in B; median of ``local_repeats`` measurements (range drawn).
"""
from __future__ import annotations

import pandas as pd

from zero_repro.lab.figures import throughput as T
from zero_repro.lab.figures import throughput_plots as TP
from zero_repro.lab.figures import throughput_summary as TS

FIGURE = "fig4"
PAPER_FIGURE = "fig4"
ZERO = "ZeRO-DP (P_os+g)"
BASE = "Baseline-DP (PyTorch DDP)"
SERIES_FAMILY: dict = {}


def series_of(s) -> str:
    return ZERO if s.series == "ZeRO" else BASE


def _local(cfg, p: dict) -> list:
    pts = []
    for model in p.get("local_models", ["tiny", "small"]):
        pts.append(T.local_point(FIGURE, f"local {model} stage2 w2", model, 2, 1, "C3", p,
                                 series="ZeRO"))
        pts.append(T.local_point(FIGURE, f"local {model} stage0 w2", model, 2, 1, "baseline",
                                 p, series="Baseline"))
    return pts


def plan(cfg) -> list:
    return T.plan_points(cfg, FIGURE, _local)


def run_point(cfg, point) -> dict:
    return T.run_point(cfg, point)


def summarize(records) -> list[dict]:
    rows = TS.paper_scale_rows(records, FIGURE, series_of, lambda s: s.size_b)
    local = []
    for r in TS.ok_records(records, "measured_local"):
        name = ("local ZeRO-DP: stage 2 (C3), TP 1" if r.params["series"] == "ZeRO"
                else "local baseline DP: stage 0, TP 1")
        x = round(r.metrics["params_total"] / 1e9, 6)
        local.append(TS.base_row(r, FIGURE, name, x, r.metrics["tflops_per_gpu"]))
    return rows + TS.repeated(local)


def plot(table: pd.DataFrame, out_dir: str) -> list[str]:
    return TP.plot_standard(table, out_dir, "fig4_dp_only",
                           "Fig 4: ZeRO-DP only, 128 V100 GPUs (PREDICTION; paper values withheld "
                           "for blind judging)\nbatch: largest that fits (paper2020 memory dry "
                           "run) and Table 10's (paper batch)",
                           categorical=False)
