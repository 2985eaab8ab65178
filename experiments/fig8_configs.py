"""Figure 8: best throughput per GPU for each ZeRO configuration C1-C5 (paper §10.5, setups
Table 9: 60B on 128 GPUs at MP 16, and 170B on 400 GPUs under C5). Paper values are withheld:
these are predictions.

Table 3: C1 P_os, C2 P_os + P_a, C3 P_os+g, C4 P_os+g + P_a, C5 P_os+g + P_a+cpu (all with
C_B + M_D). Memory freed by P_os+g and P_a buys a larger batch per GPU (Table 9: 2, 4, 32, 32,
8 in its printed row order, which ``paper.table9`` maps to C1..C5: by default Table 7's order
C1, C2, C4, C5, C3, i.e. C3 at batch 8; ``experiment.params.table9_order=c1_to_c5`` for the
CSV labels), P_a costs one all-gather of b·s·h per block over the MP group, P_a+cpu 2x the partitioned
checkpoints over PCIe -> the C4 -> C5 drop the paper states.

* simulated (paper scale): Table 9 through the performance model calibrated on Figure 2; the
  inputs behind each value go to ``results/fig8_configs/predictions.csv``;
* measured (cluster): the same setups as real points;
* measured (local): C1-C5 on ``local_model`` at world 2 with TP 2 (so P_a partitions).
"""
from __future__ import annotations

import pandas as pd

from zero_repro.lab.figures import throughput as T
from zero_repro.lab.figures import throughput_plots as TP
from zero_repro.lab.figures import throughput_summary as TS
from zero_repro.scale.paper import table9
from zero_repro.scale.paper.setups import setups

PARAMS = T.PARAMS  # the experiment.params keys it reads (cli.check_params)

FIGURE = "fig8"
PAPER_FIGURE = "fig8"
SERIES_FAMILY: dict = {}
CONFIGS = ("C1", "C2", "C3", "C4", "C5")


def series_of(s) -> str:
    return f"{s.size_label} ({s.gpus} GPUs, MP {s.tp})"


def _local(cfg, p: dict) -> list:
    model, tp = p.get("local_model", "small"), int(p.get("local_tp", 2))
    world = int(p.get("local_world", 2))
    return [T.local_point(FIGURE, f"local {model} {c} w{world} tp{tp}", model, world, tp, c, p)
            for c in p.get("local_configs", CONFIGS)]


def plan(cfg) -> list:
    return T.plan_points(cfg, FIGURE, _local)


def run_point(cfg, point) -> dict:
    return T.run_point(cfg, point)


def _current_mapping(records) -> list:
    """Records of the Table 9 row order in use (``paper.table9.DEFAULT_ORDER``): a 60B
    paper-scale record whose batch is not its configuration's batch under that order was made
    under the other order and stays in points.jsonl as history."""
    want = table9.batch_by_config(setups(FIGURE), table9.DEFAULT_ORDER)
    out = []
    for r in records:
        q = r.params
        if (q.get("role") in ("simulated", "measured_paper") and q.get("figure") == FIGURE
                and str(q.get("setup", "")).startswith("60B")
                and q.get("batch") != want.get(q.get("zero_config"))):
            continue
        out.append(r)
    return out


def summarize(records) -> list[dict]:
    records = _current_mapping(records)
    rows = TS.paper_scale_rows(records, FIGURE, series_of, lambda s: s.zero_config)
    for r in sorted(TS.ok_records(records, "measured_local"),
                    key=lambda r: r.params["zero_config"]):
        q = r.params
        name = f"local {q['model']}: world {q['world_size']}, TP {q['tp']}"
        rows.append(TS.base_row(r, FIGURE, name, q["zero_config"], r.metrics["tflops_per_gpu"]))
    return rows


def plot(table: pd.DataFrame, out_dir: str) -> list[str]:
    return TP.plot_standard(table, out_dir, "fig8_configs",
                           "Fig 8: C1-C5 (PREDICTION; paper withheld)", categorical=True)
