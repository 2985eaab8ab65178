"""The throughput figures' vocabulary (paper §10.2-10.5): table names and units, the
experiment parameters they read with their defaults, and the paper setups of each figure (paper
Tables 5, 6, 9, 10 via ``zero_repro.scale.paper.setups``). Imports no planner or runner: the
figures read it too.
"""
from __future__ import annotations

from zero_repro.scale.paper import table9
from zero_repro.scale.paper.buckets import ALLGATHER_BUCKET, REDUCE_BUCKET
from zero_repro.scale.paper.clusters import PAPER_CLUSTER
from zero_repro.scale.paper.setups import PaperSetup, setups

Y_NAME, UNIT = "throughput_per_gpu", "TFLOPs/GPU"
AGG_NAME, AGG_UNIT = "aggregate_throughput", "TFLOPs"
X_NAME = {"fig2": "model_size_B", "fig3": "num_gpus", "fig4": "model_size_B",
          "fig8": "zero_config"}
PAPER_BATCH = " (paper batch)"  # suffix of the series at the paper's batch

DEFAULTS = {
    "sim_cluster": PAPER_CLUSTER,  # the paper's cluster: calibration and simulation
    "use_fig3": False,  # calibrate on Figure 2 only (Figure 3 stays a prediction)
    "batch": "paper",  # paper | max_fit (cluster-measured paper-scale points)
    "max_fit_judge": "auto",  # auto (dry run if present) | dryrun | analytic
    # simulated points: one series per batch rule (module doc); their judge and stack
    "batch_series": ["max_fit", "paper"],
    "sim_judge": "dryrun",  # dryrun | analytic (the closed-form model: quick, for tests)
    "max_fit_stack": "paper2020",
    "unstated_configs": ["C4", "C5"],
    "cluster_steps": 8, "cluster_warmup": 3, "cluster_dtype": "fp16",
    "reduce_bucket": REDUCE_BUCKET, "allgather_bucket": ALLGATHER_BUCKET,  # C_B, elements
    "local": True,  # the local measured points (false: the simulated series alone)
    "local_batch": 4,  # int, or max_fit (analytic model, pretend device of local_device_mb)
    "local_device_mb": 180, "local_max_batch": 8, "local_base_batch": 4,
    "local_repeats": 1,  # each local point measured this often (interleaved: repeat-major)
}
# every experiment.params key the throughput figures read (cli.check_params)
PARAMS = (*DEFAULTS, "table9_order")


def params(cfg) -> dict:
    return {**DEFAULTS, **dict(cfg.experiment.params or {})}


# ----------------------------------------------------------------- paper setups -> configs
def figure_setups(figure: str, p: dict | None = None) -> list[PaperSetup]:
    """The paper's setups of ``figure``; Figure 8's rows mapped to C1..C5 by
    ``experiment.params.table9_order`` (``paper.table9``: c1_to_c5 | table7)."""
    rows = setups(figure)
    if figure == "fig8":
        rows = table9.remap(rows, (p or {}).get("table9_order", table9.DEFAULT_ORDER))
    return rows


def order_params(figure: str, p: dict | None) -> dict:
    """A point's ``table9_order`` param: only for Figure 8 and only when not the default, so
    the keys of records made before the mapping was selectable stay valid."""
    order = (p or {}).get("table9_order", table9.DEFAULT_ORDER)
    return {"table9_order": order} if figure == "fig8" and order != table9.DEFAULT_ORDER else {}


def find_setup(figure: str, label: str, series: str, p: dict | None = None) -> PaperSetup:
    """The setup a point or record names, under the same Table 9 row mapping that planned it
    (``p``: the experiment's or the record's params; ``table9_order`` absent = the default)."""
    for s in figure_setups(figure, p):
        if s.point == label and s.series == series:
            return s
    raise ValueError(f"no setup {label!r} ({series}) in {figure}")
