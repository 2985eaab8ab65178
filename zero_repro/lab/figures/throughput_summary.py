"""Table rows of the throughput figures (paper §10.2-10.5) from their records: the paper-scale
rows (simulated by the calibrated performance model, or measured on a GPU cluster) with the
inputs behind each simulated value, and the ``hardware`` column that says what a row ran on.

Column names are the committed tables' format (``mp`` and ``w_mp`` hold the TP degree, as the
paper's tables call it MP); new records spell the workload's field ``tp``, old ones ``mp``.
"""
from __future__ import annotations

import os
import statistics

from zero_repro.lab.throughput.setups import PAPER_BATCH, UNIT, X_NAME, Y_NAME, find_setup

_WORKLOAD_COLUMNS = ("n_layer", "hidden", "heads", "gpus", "mp", "batch_per_gpu", "stage",
                     "checkpointing", "p_a", "p_a_cpu", "overlap_comm")


_TRANSPORTS = {"shm": "shared memory", "gloo": "gloo", "pairwise": "gloo point-to-point",
               "native": "gloo's collectives"}


def transports(rec) -> str:
    """What a CPU record's collectives ran over: ZeRO's DP buckets over the transport the
    record names (``hardware.dp_transport``: shared memory where every rank maps every segment),
    Megatron's TP all-reduces over gloo."""
    hw, topo = rec.hardware or {}, rec.topology or {}
    parts = []
    if int(topo.get("dp", 1) or 1) > 1:
        dp = hw.get("dp_transport")
        parts.append(f"DP over {_TRANSPORTS.get(dp, dp or 'an unrecorded transport')}")
    if int(topo.get("tp", 1) or 1) > 1:
        parts.append("TP over gloo")
    return ", ".join(parts) or "one rank, no collectives"


def hardware_label(rec) -> str:
    """What a record ran on, for the table's ``hardware`` column."""
    if rec.mode == "simulated":
        c = rec.config.get("cluster", {})
        return f"simulated: {c.get('name', '?')} ({c.get('description', '')})"
    hw, topo = rec.hardware or {}, rec.topology or {}
    world = topo.get("world_size", "?")
    if hw.get("device") == "cpu" or rec.config.get("cluster", {}).get("device") == "cpu":
        cpu = hw.get("cpu_model") or hw.get("device_name", "cpu")
        return (f"measured: CPU ranks x {hw.get('threads_per_rank', '?')} thread, "
                f"{transports(rec)}, {cpu}, {hw.get('cpu_count', '?')} cores, "
                f"torch {hw.get('torch', '?')}")
    return (f"measured: {world} x {hw.get('device_name', 'GPU')}, "
            f"{topo.get('nodes', '?')} node(s), torch {hw.get('torch', '?')}")


def provenance_label(rec) -> str:
    """Whether a measured record can be traced to its code and its machine's load: its code
    signature (``lab.provenance``: committed trees, '+dirty' = uncommitted changes, none =
    made before signatures) and the load recorded while it ran (``records.load_between``)."""
    if rec.mode != "measured":
        return ""
    code = (rec.provenance or {}).get("code")
    words = ["no code signature" if not code else
             ("measured from uncommitted code" if "dirty" in code else "committed code")]
    load = getattr(rec, "load", None) or {}
    words.append(f"load average {load.get('loadavg_start')}->{load.get('loadavg_end')}"
                 if load else "machine load not recorded")
    return "; ".join(words)


def base_row(rec, figure: str, series: str, x, y, y_name=Y_NAME, unit=UNIT) -> dict:
    q, m = rec.params, rec.metrics
    return {"figure": figure, "series": series, "x_name": X_NAME[figure], "x_value": x,
            "y_name": y_name, "y_value": y, "unit": unit, "kind": rec.mode,
            "hardware": hardware_label(rec), "provenance": provenance_label(rec),
            "transport": transports(rec) if rec.mode == "measured" else "",
            "point": rec.point,
            "num_gpus": rec.topology.get("world_size"), "mp": rec.topology.get("tp"),
            "batch_per_gpu": m.get("batch", q.get("batch")),
            "batch_source": m.get("batch_source", q.get("batch_source", "")),
            "zero_config": m.get("zero_config", q.get("zero_config", "")),
            "batch_rule": q.get("batch_rule", ""), "in_sample": m.get("in_sample", "")}


def _workload_value(w: dict, column: str):
    if column == "mp":  # the TP degree: ``tp`` in new records, ``mp`` in older ones
        return w.get("tp", w.get("mp"))
    return w.get(column)


def sim_inputs(rec) -> dict:
    """The inputs and the time breakdown behind a simulated value (predictions.csv)."""
    m = rec.metrics
    w, pp, bd = m.get("workload", {}), m.get("perf_params", {}), m.get("breakdown_s", {})
    out = {**{f"w_{k}": _workload_value(w, k) for k in _WORKLOAD_COLUMNS},
           **{f"t_{k}_s": v for k, v in bd.items()}, **pp,
           "gemm_efficiency": m.get("gemm_efficiency")}
    srch = m.get("search") or {}
    if srch:  # the predicted batch: what it was judged against, what the next one needs
        out["judged_capacity_GB"] = round(srch["capacity"] / 1e9, 3)
        nxt = srch.get("next_capacity")
        out["next_batch_needs_GB"] = round(nxt / 1e9, 3) if nxt else None
        alts = m.get("alternatives") or {}
        out["alternatives"] = "; ".join(f"{c} b{a['batch']} {a['tflops_per_gpu']:.1f} TF"
                                        for c, a in alts.items()) if len(alts) > 1 else ""
    return out


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
        paper_batch = r.params.get("batch_rule", "paper") == "paper" and r.mode == "simulated"
        name = series_of(s) + (PAPER_BATCH if paper_batch else "")
        fits = r.metrics.get("fits", True)
        # a predicted batch of 0 (not even batch 1 fits): no throughput, the row says so
        y = r.metrics["tflops_per_gpu"] if fits else float("nan")
        row = base_row(r, figure, name, x_of(s), y)
        row["fits"] = bool(fits)
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


def repeated(rows: list[dict]) -> list[dict]:
    """Rows of repeated measurements of one point (same series, x, y_name, kind) as one row:
    the median y, with ``y_min``, ``y_max`` and ``repeats``; order of first appearance."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["series"], str(r["x_value"]), r["y_name"], r["kind"]), []).append(r)
    out = []
    for g in groups.values():
        ys = sorted(float(r["y_value"]) for r in g)
        mid = statistics.median(ys)
        out.append({**g[0], "y_value": mid, "y_min": ys[0], "y_max": ys[-1],
                    "repeats": len(ys)})
    return out
