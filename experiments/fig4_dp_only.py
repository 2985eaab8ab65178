"""Figure 4: largest-model throughput with ZeRO-DP only (no MP), 128 V100 GPUs (paper §10.4, setups
Table 10); paper values withheld: predictions. P_os+g needs 2Ψ + 14Ψ/N_d bytes of model states
per GPU, so at N_d = 128 a 13B model fits a 32 GB V100 without MP (baseline DP, 16Ψ: ~1.4B).

* simulated (paper scale): Table 10 through the performance model calibrated on Figure 2
  (ZeRO-DP = P_os+g + C_B/M_D + checkpointing; baseline = PyTorch DDP, its bucketed all-reduce
  overlapping backward); each value's inputs in ``results/fig4_dp_only/predictions.csv``;
* measured (cluster): the same setups as real points;
* measured (local): ``local_models`` at world 2, TP 1: stage 0 (DDP) vs stage 2 (C3), x =
  parameters in B.
"""
from __future__ import annotations

import pandas as pd

from zero_repro.lab.figures import throughput as T
from zero_repro.lab.figures import throughput_plots as TP
from zero_repro.lab.figures import throughput_summary as TS

PARAMS = T.PARAMS  # the experiment.params keys it reads (cli.check_params)

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
    for r in TS.ok_records(records, "measured_local"):
        name = ("local ZeRO-DP: stage 2 (C3), TP 1" if r.params["series"] == "ZeRO"
                else "local baseline DP: stage 0, TP 1")
        x = round(r.metrics["params_total"] / 1e9, 6)
        rows.append(TS.base_row(r, FIGURE, name, x, r.metrics["tflops_per_gpu"]))
    return rows


def plot(table: pd.DataFrame, out_dir: str) -> list[str]:
    return TP.plot_standard(table, out_dir, "fig4_dp_only",
                           "Fig 4: ZeRO-DP only, 128 V100 GPUs (PREDICTION; paper withheld)",
                           categorical=False)
