"""Figure 6: the largest trainable model per ZeRO configuration C1-C5 (paper §10.5, Table 7:
400 V100-32GB, MP 16, DP 25, batch 16 per GPU).

simulated (dry-run judged): for each configuration, at the hidden size and head count of its
Table 7 row, the largest number of layers whose dry run -- the real runtime on fake tensors and
a fake process group of 400 ranks (``simulate.dryrun``), its allocation trace replayed through
the caching-allocator model with the cluster's device memory -- does not run out of memory
(``simulate.maxsize.max_layers``). Reported as parameters (B) next to the paper's
40/60/50/140/150B, with the relative error and whether the paper's order of the five is
reproduced (the ``fig6_order`` row of table.csv, and the figure's title). The figure is the
paper's: bars per configuration, the paper's values hatched beside ours.

Bucket sizes are the paper harness's (reduce 5e8, all-gather 2e8 elements; REFERENCE.md,
inferred); ``experiment.params.iterations`` training steps per dry run (default 1: the dry
run's ``live_peak_steady`` -- the first step's live curve plus the state it creates lazily --
equals the first step's peak at these shapes, and 1 vs 2 steps gave identical peak live and
peak reserved bytes at 100B C4).
"""
from __future__ import annotations

from zero_repro.harness.figures import save_figure
from zero_repro.harness.points import Point
from zero_repro.paper.setups import setups
from zero_repro.simulate import maxsize
from zero_repro.simulate.dryrun import setup_overrides

FIGURE = "fig6"
PAPER_FIGURE = "fig6"
PAPER_SERIES = "max trainable model size, fixed batch 16/GPU, MP=16, 400 GPUs"
OURS = "dry-run judged"
SERIES_FAMILY = {OURS: PAPER_SERIES}
PAPER_ORDER = ("C1", "C3", "C2", "C4", "C5")  # ascending max size in the paper (40,50,60,140,150)


def plan(cfg) -> list[Point]:
    p = cfg.experiment.params
    cluster = p.get("cluster", "dgx2_v100")
    only = p.get("configs") or None
    pts = []
    for s in sorted(setups("fig6"), key=lambda s: s.zero_config):
        if only and s.zero_config not in only:
            continue
        pts.append(Point(name=f"{s.zero_config} h{s.hidden}",
                         params={"zero_config": s.zero_config, "hidden": s.hidden,
                                 "heads": s.heads, "table7_layers": s.n_layer,
                                 "cluster": cluster, "iterations": int(p.get("iterations", 1))},
                         overrides=setup_overrides(s, cluster), mode="simulated"))
    return pts


def run_point(cfg, point: Point) -> dict:
    r = maxsize.max_layers(cfg, iterations=int(point.params.get("iterations", 1)))
    return {"max_n_layer": r.n_layer, "max_params": r.params, "max_params_B": r.params / 1e9,
            "capacity_bytes": r.capacity, "seed": r.seed, "seed_from": r.seed_from,
            "analytic_seed": r.analytic_seed, "probes": r.probes, "n_dry_runs": r.n_dry_runs,
            "search_s": r.seconds, "judgements": [vars(j) for j in r.judgements]}


def summarize(records) -> list[dict]:
    rows, sizes = [], {}
    for r in records:
        if r.status != "ok":
            continue
        zc = r.params["zero_config"]
        sizes[zc] = r.metrics["max_params_B"]
        rows.append({"figure": FIGURE, "series": OURS, "x_name": "zero_config", "x_value": zc,
                     "y_name": "max_model_size", "y_value": round(r.metrics["max_params_B"], 2),
                     "unit": "B params", "kind": "simulated",
                     "n_layer": r.metrics["max_n_layer"], "hidden": r.params["hidden"]})
    if len(sizes) == len(PAPER_ORDER):
        ours = tuple(sorted(sizes, key=lambda k: sizes[k]))
        rows.append({"figure": f"{FIGURE}_order", "series": "ascending order of C1-C5",
                     "x_name": "zero_config", "x_value": " < ".join(ours),
                     "y_name": "order_matches_paper", "y_value": float(ours == PAPER_ORDER),
                     "unit": "bool", "kind": "simulated"})
    return rows


def plot(table, out_dir: str) -> list[str]:
    """The paper's Figure 6 layout: one bar per configuration C1..C5 (max model size, B
    parameters), the paper's value as a hatched bar beside ours, our relative error above."""

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    t = table[(table["figure"] == FIGURE) & (table["y_name"] == "max_model_size")]
    ours = t[t["kind"] == "simulated"].set_index("x_value")
    paper = t[t["kind"] == "paper"].set_index("x_value")
    cats = sorted(set(ours.index) | set(paper.index))
    x = range(len(cats))
    w = 0.38
    fig, ax = plt.subplots(figsize=(7.2, 4.6))
    pv = [float(paper["y_value"].get(c, float("nan"))) for c in cats]
    ov = [float(ours["y_value"].get(c, float("nan"))) for c in cats]
    ax.bar([i - w / 2 for i in x], pv, w, color="white", edgecolor="0.35", hatch="///",
           label="paper (Fig. 6)")
    bars = ax.bar([i + w / 2 for i in x], ov, w, color="C0",
                  label="simulated: dry run of the runtime, judged at 32 GB")
    for c, b in zip(cats, bars):
        err = ours["rel_error_vs_paper"].get(c) if "rel_error_vs_paper" in ours else None
        if err is not None and pd.notna(err):
            ax.annotate(f"{100 * float(err):+.0f}%", (b.get_x() + b.get_width() / 2,
                                                     b.get_height()),
                        ha="center", va="bottom", fontsize=9, xytext=(0, 2),
                        textcoords="offset points")
        n = ours["n_layer"].get(c) if "n_layer" in ours else None
        if n is not None and pd.notna(n):
            ax.annotate(f"{int(n)} L", (b.get_x() + b.get_width() / 2, 0), ha="center",
                        va="bottom", fontsize=7, color="white", xytext=(0, 3),
                        textcoords="offset points")
    ax.set_xticks(list(x), cats)
    ax.set_xlabel("ZeRO configuration (Table 3)")
    ax.set_ylabel("Max model size (B parameters)")
    top = max(v for v in pv + ov if v == v)
    ax.set_ylim(0, top * 1.22)
    order = table[table["figure"] == f"{FIGURE}_order"]
    note = ""
    if len(order):
        same = float(order["y_value"].iloc[0]) == 1.0
        note = (f"\nsimulated order {order['x_value'].iloc[0]} "
                f"({'same as' if same else 'differs from'} the paper's)")
    ax.set_title("Figure 6: max model size, 400 V100-32GB, MP 16, batch 16/GPU" + note,
                 fontsize=9.5)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    paths = save_figure(fig, out_dir, 'fig6_max_model', dpi=150)
    return paths
