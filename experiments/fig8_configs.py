"""Figure 8: best throughput per GPU for each ZeRO configuration C1-C5 (paper §10.5, setups
Table 9: 60B on 128 GPUs at MP 16, and 170B on 400 GPUs under C5). Paper values are withheld:
these are predictions.

Table 3: C1 P_os, C2 P_os + P_a, C3 P_os+g, C4 P_os+g + P_a, C5 P_os+g + P_a+cpu (all with
C_B + M_D). Memory freed by P_os+g and P_a buys a larger batch per GPU (Table 9: 2, 4, 32, 32,
8 in its printed row order, which ``paper.table9`` maps to C1..C5: by default Table 7's order
C1, C2, C4, C5, C3, i.e. C3 at batch 8; ``experiment.params.table9_order=c1_to_c5`` for the
CSV labels), P_a costs one all-gather of b·s·h per block over the MP group, P_a+cpu 2x the partitioned
checkpoints over PCIe -> the C4 -> C5 drop the paper states.

* simulated (paper scale): Table 9 through the performance model calibrated on Figure 2, at
  the batch the paper2020 memory dry run says fits (largest on the batch grid) and at Table
  9's batch ("paper batch"); each bar says its batch and, at the paper's batch, its Table 9
  row. The 170B C5 point at batch 12 is Figure 2's 170B point, one of the calibration points:
  in-sample (marked). The inputs behind each value go to
  ``results/fig8_configs/predictions.csv``;
* measured (cluster): the same setups as real points;
* measured (local): none by default. C1-C5 differ only with both a DP degree (P_os, P_os+g
  partition over it) and an MP degree (P_a partitions over it) of at least 2: world >= 4.
  On a machine with 4+ cores: ``experiment.params.local_configs=[C1,C2,C3,C4,C5]
  experiment.params.local_world=4`` (``local_model`` at TP ``local_tp``, batch ``local_batch``;
  median of ``local_repeats`` measurements, range drawn). A world whose DP or MP degree is 1 is
  refused: those configurations would coincide in all but name.
"""
from __future__ import annotations

import pandas as pd

from zero_repro.lab.throughput import plan as T
from zero_repro.lab.throughput import run as TR
from zero_repro.lab.throughput import setups as TN
from zero_repro.lab.figures import throughput_plots as TP
from zero_repro.lab import records as R
from zero_repro.lab.figures import throughput_summary as TS
from zero_repro.lab.figures.wording import by_kind_and_series, column, num
from zero_repro.scale.paper import table9
from zero_repro.scale.paper.setups import setups

PARAMS = TN.PARAMS  # the experiment.params keys it reads (cli.check_params)

FIGURE = "fig8"
PAPER_FIGURE = "fig8"
SERIES_FAMILY: dict = {}
# summarize() shows the newest record of every point (lab.figures.regenerate): a re-run at another
# device capacity (new point keys) replaces the figure's values; older records stay as history
NEWEST_ONLY = True
CONFIGS = ("C1", "C2", "C3", "C4", "C5")


def series_of(s) -> str:
    return f"{s.size_label} ({s.gpus} GPUs, MP {s.tp})"


def _local(cfg, p: dict) -> list:
    model, tp = p.get("local_model", "small"), int(p.get("local_tp", 2))
    world = int(p.get("local_world", 4))
    if p.get("local_configs") and (tp < 2 or world // tp < 2):
        raise ValueError(f"experiment.params.local_world={world} with local_tp={tp}: C1-C5 "
                         f"differ only with DP >= 2 and TP >= 2 (world >= 4); with DP or TP 1 "
                         f"they coincide in all but name")
    return [T.local_point(FIGURE, f"local {model} {c} w{world} tp{tp}", model, world, tp, c, p)
            for c in p.get("local_configs") or ()]


def plan(cfg) -> list:
    return T.plan_points(cfg, FIGURE, _local)


def run_point(cfg, point) -> dict:
    return TR.run_point(cfg, point)


def _current_mapping(records) -> list:
    """Records of the Table 9 row order in use (``paper.table9.DEFAULT_ORDER``): a 60B
    paper-scale record whose batch is not its configuration's batch under that order was made
    under the other order and stays in points.jsonl as history."""
    want = table9.batch_by_config(setups(FIGURE), table9.DEFAULT_ORDER)
    out = []
    for r in records:
        q = r.params
        if (q.get("role") in ("simulated", "measured_paper") and q.get("figure") == FIGURE
                and q.get("batch_rule", "paper") == "paper"
                and str(q.get("setup", "")).startswith("60B")
                and q.get("batch") != want.get(q.get("zero_config"))):
            continue
        out.append(r)
    return out


def bar_label(row: dict) -> str:
    """``b<batch>``, at the paper's batch also the Table 9 row it is (under the row order in
    use, ``paper.table9``)."""
    b = row.get("batch_per_gpu")
    text = f"b{b}" if b else f"{str(row['series']).split(' (')[0]}: does not fit (OOM at b1)"
    if row.get("batch_rule") == "paper" and str(row["series"]).startswith("60B"):
        k = table9.ORDERS[table9.DEFAULT_ORDER].index(row["x_value"]) + 1
        text += f", T9 row {k}"
    elif row.get("batch_rule") == "paper":
        text += ", T9 170B row"
    return text


def summarize(records) -> list[dict]:
    records = R.newest_ok(records)
    records = _current_mapping(records)
    rows = TS.paper_scale_rows(records, FIGURE, series_of, lambda s: s.zero_config)
    for r in rows:
        r["bar_label"] = bar_label(r)
    local = []
    for r in sorted(TS.ok_records(records, "measured_local"),
                    key=lambda r: r.params["zero_config"]):
        q = r.params
        name = f"local {q['model']}: world {q['world_size']}, TP {q['tp']}"
        local.append(TS.base_row(r, FIGURE, name, q["zero_config"], r.metrics["tflops_per_gpu"]))
    return rows + TS.repeated(local)


def conclude(table: pd.DataFrame) -> list[str]:
    """The figure in words (the paper's values are withheld: nothing to compare): per model and
    configuration C1-C5 the TFLOPs/GPU and its batch per GPU, at the largest batch the memory
    dry run fits and at Table 9's batch; a calibration point (in-sample) is marked."""
    rows = table[(table["y_name"] == TN.Y_NAME) & (table["kind"] != "paper")]
    out = []
    for kind, series, g, first in by_kind_and_series(rows):
        if first:
            out.append(f"{kind}, TFLOPs/GPU per configuration (b = batch per GPU; paper values "
                       "withheld):")
        name = str(series).removesuffix(TN.PAPER_BATCH)
        how = ("Table 9's batch" if str(series).endswith(TN.PAPER_BATCH) else
               "largest batch that fits" if kind == "simulated" else "measured batch")
        fitted = (g["in_sample"].fillna("").astype(str) != "" if "in_sample" in g
                  else pd.Series(False, index=g.index))
        out.append(f"{name}, {how}: " + ", ".join(
            f"{x} {num(y)} b{num(b)}" + (" (in-sample)" if f else "")
            for x, y, b, f in zip(g["x_value"], g["y_value"], column(g, "batch_per_gpu"),
                                  fitted)))
    return out


def plot(table: pd.DataFrame, out_dir: str) -> list[str]:
    order = ", ".join(f"row {i + 1} = {c}" for i, c in
                      enumerate(table9.ORDERS[table9.DEFAULT_ORDER]))
    return TP.plot_standard(
        table, out_dir, "fig8_configs",
        "Fig 8: C1-C5 (PREDICTION; paper values withheld for blind judging)\nbars: b = batch "
        "per GPU (largest that fits, paper2020 memory dry run; or the paper's)\nTable 9's 60B "
        f"rows read in Table 7's order: {order}\n* cross-hatched = in-sample: 170B C5 at batch 12 "
        "is Fig 2's fitted 170B point", categorical=True)
