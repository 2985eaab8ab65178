"""The memory model behind the Figure 4 and 8 predictions (paper §10.4-10.5, Tables 9-10): does each
predicted setup fit a 32 GB V100 at the paper's batch, under paper2020 and modern, and how much
cached memory does it need?

One dry run per setup x stack (``zero_repro.scale.dryrun.dryrun``, rank 0, the paper harness's
buckets): its judged replay's peak reserved bytes (GiB) and whether it ran out of memory; Figure
8's rows under both Table 9 row orders (``zero_repro.scale.paper.table9``: the order decides C3-C5's
batch). A setup that does not fit under ``paper2020`` could not have run as the mapping reads it:
its prediction is flagged. Every value's inputs are columns of the table; nothing is compared
with the withheld values.
"""
from __future__ import annotations

from zero_repro.lab import records as R
from zero_repro.lab.figures import throughput as T
from zero_repro.lab.figures.figures import save_figure
from zero_repro.lab.points import Point
from zero_repro.scale.paper import table9
from zero_repro.scale.paper.clusters import DRYRUN_FIELDS, cluster_overrides, load_cluster
from zero_repro.scale.dryrun.dryrun import dry_run
from zero_repro.scale.hardware import Hardware

FIGURE = "prediction_memory"
GIB = 2**30
STACKS = ("paper2020", "modern")
FIGURES = ("fig4", "fig8")


def _setups(figure: str, p: dict):
    """(order label, setup) pairs: Figure 8 under every Table 9 order (rows that do not depend
    on the order -- C1, C2, 170B -- once)."""
    if figure != "fig8":
        return [("", s) for s in T.figure_setups(figure, p)]
    out, seen = [], set()
    for order in table9.ORDERS:
        for s in T.figure_setups(figure, {**p, "table9_order": order}):
            key = (s.point, s.batch_per_gpu)
            if key not in seen:
                seen.add(key)
                out.append((order, s))
    return out


def plan(cfg) -> list[Point]:
    p = {**T.DEFAULTS, **dict(cfg.experiment.params or {})}
    cluster = p.get("cluster", "dgx2_v100")
    hw = Hardware.from_config(load_cluster(cluster))
    pts = []
    for figure in p.get("figures") or FIGURES:
        for order, s in _setups(figure, p):
            zc = T.zero_config_of(s, hw)
            for stack in p.get("stacks") or STACKS:
                ov = {**T.paper_point_overrides(s, zc, s.batch_per_gpu, p, "fp16"),
                      **cluster_overrides(cluster, DRYRUN_FIELDS), "simulate.stack": stack}
                name = f"{figure} {s.point} {s.series} b{s.batch_per_gpu} {stack}"
                pts.append(Point(name=name, mode="simulated",
                                 params={"figure": figure, "setup": s.point, "series": s.series,
                                         "zero_config": zc, "batch": s.batch_per_gpu,
                                         "n_layer": s.n_layer, "hidden": s.hidden,
                                         "heads": s.heads, "gpus": s.gpus, "mp": s.tp,
                                         "table9_order": order, "stack": stack,
                                         "cluster": cluster}, overrides=ov))
    return pts


def run_point(cfg, point: Point) -> dict:
    r = dry_run(cfg, iterations=2, keep_trace=False)
    return {"peak_reserved": r.allocator["peak_reserved"], "oom": bool(r.allocator["oom"]),
            "peak_allocated": r.allocator["peak_allocated"], "capacity_bytes": r.capacity,
            "live_peak": max(r.live_peak_by_iteration.values(), default=0),
            "judged_with_build": r.judged_with_build, "total_s": r.timings["total_s"],
            "dry_run_backend": r.backend}


NEWEST_ONLY = True  # summarize() shows the newest record of every point (lab.figures.regenerate)


def summarize(records) -> list[dict]:
    rows = []
    for r in R.newest_ok(records):  # older records (another method) stay as history
        q, m = r.params, r.metrics
        orders = q["table9_order"] or "-"
        rows.append({"figure": FIGURE, "series": f"{q['figure']}, {q['stack']}",
                     "x_name": "setup", "x_value": f"{q['setup']} {q['series']}",
                     "y_name": "max_cached_memory", "y_value": round(m["peak_reserved"] / GIB, 3),
                     "unit": "GiB", "kind": "simulated", "paper_figure": q["figure"],
                     "stack": q["stack"], "zero_config": q["zero_config"],
                     "batch_per_gpu": q["batch"], "n_layer": q["n_layer"], "hidden": q["hidden"],
                     "heads": q["heads"], "gpus": q["gpus"], "mp": q["mp"],
                     "table9_order": orders, "fits_32GB": not m["oom"],
                     "capacity_GiB": round(m["capacity_bytes"] / GIB, 3),
                     "live_peak_GiB": round(m["live_peak"] / GIB, 3)})
    return rows


def plot(table, out_dir: str) -> list[str]:
    """Max cached memory (GiB) of every predicted setup, paper2020 vs modern, OOM marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = table[table["figure"] == FIGURE].copy()
    # Figure 8's rows under the Table 9 row order(s) that give them (C1, C2 and 170B: both)
    orders = {}
    for _, r in t.iterrows():
        if r["paper_figure"] == "fig8":
            key = (r["x_value"], r["batch_per_gpu"])
            orders.setdefault(key, set()).add(str(r["table9_order"]))
    by_setup: dict = {}
    for (setup, _b), _o in orders.items():
        by_setup.setdefault(setup, 0)
        by_setup[setup] += 1

    def _label(r) -> str:
        lab = f"{r['paper_figure']} {r['x_value']} b{r['batch_per_gpu']}"
        if r["paper_figure"] == "fig8" and by_setup.get(r["x_value"], 0) > 1:
            lab += f" (Table 9 order {r['table9_order']})"
        return lab

    t["label"] = [_label(r) for _, r in t.iterrows()]
    labels = list(dict.fromkeys(t["label"]))
    fig, ax = plt.subplots(figsize=(8.5, 0.32 * len(labels) + 2.2))
    for k, (stack, col) in enumerate((("paper2020", "C3"), ("modern", "C0"))):
        d = t[t["stack"] == stack].set_index("label")
        ys = [j + (k - 0.5) * 0.38 for j in range(len(labels))]
        vals = [float(d["y_value"].get(lab, 0.0)) for lab in labels]
        ax.barh(ys, vals, 0.38, color=col, label=f"{stack} stack")
        for y, lab, v in zip(ys, labels, vals):
            if lab in d.index and not bool(d["fits_32GB"].get(lab)):
                ax.annotate("OOM", (v, y), fontsize=6, va="center", xytext=(2, 0),
                            textcoords="offset points")
    ax.axvline(32e9 / GIB, color="0.4", ls="--", lw=1, label="V100 32 GB = 29.8 GiB")
    caps = t.loc[t["stack"] == "paper2020", "capacity_GiB"].dropna()
    if len(caps):  # paper2020 judges against the device less the CUDA context + NCCL
        ax.axvline(float(caps.iloc[0]), color="C3", ls=":", lw=1.2,
                   label=f"paper2020 allocator's share ({float(caps.iloc[0]):.1f} GiB: less "
                         "CUDA context + NCCL)")
    ax.set_yticks(range(len(labels)), labels, fontsize=6.5)
    ax.invert_yaxis()
    ax.set_xlabel("Max cached memory per GPU at the paper's batch (GiB = 2^30 B; dry run)")
    ax.set_title("Memory behind the Figure 4 / 8 predictions (simulated)", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.08 - 1.0 / len(labels)),
              ncol=2, frameon=False)
    fig.tight_layout()
    return save_figure(fig, out_dir, "prediction_memory", dpi=150)
