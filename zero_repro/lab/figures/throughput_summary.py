"""Table rows of the throughput figures (paper §10.2-10.5) from their records: the paper-scale
rows (simulated by the calibrated performance model, or measured on a GPU cluster) with the
inputs behind each simulated value, and the ``hardware`` column that says what a row ran on.

Column names are the committed tables' format (``mp`` and ``w_mp`` hold the TP degree, as the
paper's tables call it MP); new records spell the workload's field ``tp``, old ones ``mp``.
"""
from __future__ import annotations

import os

from zero_repro.lab.figures.throughput import UNIT, X_NAME, Y_NAME, find_setup

_WORKLOAD_COLUMNS = ("n_layer", "hidden", "heads", "gpus", "mp", "batch_per_gpu", "stage",
                     "checkpointing", "p_a", "p_a_cpu", "overlap_comm")


def hardware_label(rec) -> str:
    """What a record ran on, for the table's ``hardware`` column."""
    if rec.mode == "simulated":
        c = rec.config.get("cluster", {})
        return f"simulated: {c.get('name', '?')} ({c.get('description', '')})"
    hw, topo = rec.hardware or {}, rec.topology or {}
    world = topo.get("world_size", "?")
    if hw.get("device") == "cpu" or rec.config.get("cluster", {}).get("device") == "cpu":
        cpu = hw.get("cpu_model") or hw.get("device_name", "cpu")
        return (f"measured: CPU ranks x {hw.get('threads_per_rank', '?')} thread, gloo, {cpu}, "
                f"{hw.get('cpu_count', '?')} cores, torch {hw.get('torch', '?')}")
    return (f"measured: {world} x {hw.get('device_name', 'GPU')}, "
            f"{topo.get('nodes', '?')} node(s), torch {hw.get('torch', '?')}")


def base_row(rec, figure: str, series: str, x, y, y_name=Y_NAME, unit=UNIT) -> dict:
    q = rec.params
    return {"figure": figure, "series": series, "x_name": X_NAME[figure], "x_value": x,
            "y_name": y_name, "y_value": y, "unit": unit, "kind": rec.mode,
            "hardware": hardware_label(rec), "point": rec.point,
            "num_gpus": rec.topology.get("world_size"), "mp": rec.topology.get("tp"),
            "batch_per_gpu": q.get("batch"), "batch_source": q.get("batch_source", ""),
            "zero_config": q.get("zero_config", "")}


def _workload_value(w: dict, column: str):
    if column == "mp":  # the TP degree: ``tp`` in new records, ``mp`` in older ones
        return w.get("tp", w.get("mp"))
    return w.get(column)


def sim_inputs(rec) -> dict:
    """The inputs and the time breakdown behind a simulated value (predictions.csv)."""
    m = rec.metrics
    w, pp, bd = m.get("workload", {}), m.get("perf_params", {}), m.get("breakdown_s", {})
    return {**{f"w_{k}": _workload_value(w, k) for k in _WORKLOAD_COLUMNS},
            **{f"t_{k}_s": v for k, v in bd.items()}, **pp}


def ok_records(records, role: str | None = None) -> list:
    return [r for r in records if r.status == "ok"
            and (role is None or r.params.get("role") == role)]


def paper_scale_rows(records, figure: str, series_of, x_of) -> list[dict]:
    """Rows of the simulated and cluster-measured paper-scale points."""
    rows = []
    for r in ok_records(records):
        if r.params.get("role") not in ("simulated", "measured_paper"):
            continue
        if r.params.get("figure") != figure:
            continue
        s = find_setup(figure, r.params["setup"], r.params["series"], r.params)
        row = base_row(r, figure, series_of(s), x_of(s), r.metrics["tflops_per_gpu"])
        if r.mode == "simulated":
            row.update(sim_inputs(r))
        rows.append(row)
    return rows


def write_predictions(table, out_dir: str) -> str | None:
    """predictions.csv: the simulated paper-scale rows with the inputs that produced them."""
    sim = table[(table["kind"] == "simulated") & (table["y_name"] == Y_NAME)]
    if not len(sim):
        return None
    path = os.path.join(out_dir, "predictions.csv")
    sim.dropna(axis=1, how="all").to_csv(path, index=False)
    return path
