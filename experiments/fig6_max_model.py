"""Figure 6: the largest trainable model per ZeRO configuration C1-C5 (paper §10.5, Table 7: 400
V100-32GB, MP 16, DP 25, batch 16 per GPU).

simulated (dry-run judged): per configuration, at its Table 7 row's hidden size and heads, the
largest depth whose dry run (``zero_repro.scale.dryrun.dryrun``: the real runtime on data-free
tensors, a fake 400-rank group) replays through the caching-allocator model within the device
memory (``zero_repro.scale.dryrun.maxsize.max_layers``), reported as parameters (B) beside the
paper's 40/60/50/140/150B with the relative error and whether the paper's order of the five is
reproduced (the ``fig6_order`` row, and the title). Bars per configuration, the paper's hatched.

Stacks (``experiment.params.stacks``, ``cfg.simulate.stack``): ``paper2020`` (DeepSpeed 0.2 + the
2019 Megatron-LM layer + PyTorch 1.x allocator behaviour, ``zero_repro.scale.dryrun.stack``) is
the paper's column; ``modern`` (this runtime) what today's runtime fits on the same cluster. A
point's params carry ``stack`` only when it is not ``modern`` (the modern keys are unchanged).
Bucket sizes are the paper harness's (``zero_repro.scale.paper.buckets``; inferred,
REFERENCE.md); ``experiment.params.iterations`` steps are traced per dry run (default 2; each
judgement replays the second to the allocator's steady state). Search timings and fragmentation
findings: ``results/fig6_max_model/notes.md``.
"""
from __future__ import annotations

from zero_repro.lab import records as R
from zero_repro.lab.figures.figures import save_figure
from zero_repro.lab.points import Point
from zero_repro.scale.paper.setups import setups
from zero_repro.scale.dryrun import maxsize
from zero_repro.scale.dryrun.dryrun import setup_overrides

FIGURE = "fig6"
PAPER_FIGURE = "fig6"
PAPER_SERIES = "max trainable model size, fixed batch 16/GPU, MP=16, 400 GPUs"
STACKS = ("paper2020", "modern")
SERIES = {"paper2020": "dry-run judged, paper2020 stack", "modern": "dry-run judged, modern stack"}
OURS = SERIES["modern"]
SERIES_FAMILY = {v: PAPER_SERIES for v in SERIES.values()}


def stack_params(stack: str) -> dict:
    """Point params naming the stack (none for modern: its committed keys stay valid)."""
    return {} if stack == "modern" else {"stack": stack}


def stack_of(record) -> str:
    return record.params.get("stack", "modern")
PAPER_ORDER = ("C1", "C3", "C2", "C4", "C5")  # ascending max size in the paper (40,50,60,140,150)


def plan(cfg) -> list[Point]:
    p = cfg.experiment.params
    cluster = p.get("cluster", "dgx2_v100")
    only = p.get("configs") or None
    pts = []
    for stack in p.get("stacks") or STACKS:
        for s in sorted(setups("fig6"), key=lambda s: s.zero_config):
            if only and s.zero_config not in only:
                continue
            suffix = "" if stack == "modern" else f" {stack}"
            pts.append(Point(name=f"{s.zero_config} h{s.hidden}{suffix}",
                             params={"zero_config": s.zero_config, "hidden": s.hidden,
                                     "heads": s.heads, "table7_layers": s.n_layer,
                                     "cluster": cluster,
                                     "iterations": int(p.get("iterations", 2)),
                                     **stack_params(stack)},
                             overrides={**setup_overrides(s, cluster),
                                        "simulate.stack": stack},
                             mode="simulated"))
    return pts


def run_point(cfg, point: Point) -> dict:
    r = maxsize.max_layers(cfg, iterations=int(point.params.get("iterations", 2)))
    return {"max_n_layer": r.n_layer, "max_params": r.params, "max_params_B": r.params / 1e9,
            "capacity_bytes": r.capacity, "seed": r.seed, "seed_from": r.seed_from,
            "analytic_seed": r.analytic_seed, "probes": r.probes, "n_dry_runs": r.n_dry_runs,
            "search_s": r.seconds, "dry_run_backend": r.backend,
            "judgements": [vars(j) for j in r.judgements]}


NEWEST_ONLY = True  # summarize() shows the newest record of every point (lab.figures.regenerate)


def summarize(records) -> list[dict]:
    rows, sizes = [], {}
    for r in R.newest_ok(records):  # one record per point: older params stay as history
        zc, stack = r.params["zero_config"], stack_of(r)
        sizes.setdefault(stack, {})[zc] = r.metrics["max_params_B"]
        rows.append({"figure": FIGURE, "series": SERIES[stack], "x_name": "zero_config",
                     "x_value": zc, "y_name": "max_model_size",
                     "y_value": round(r.metrics["max_params_B"], 2), "unit": "B params",
                     "kind": "simulated", "stack": stack,
                     "n_layer": r.metrics["max_n_layer"], "hidden": r.params["hidden"],
                     "search_s": round(r.metrics.get("search_s", 0.0), 1)})
    for stack in [s for s in STACKS if s in sizes]:
        if len(sizes[stack]) == len(PAPER_ORDER):
            ours = tuple(sorted(sizes[stack], key=lambda k: sizes[stack][k]))
            rows.append({"figure": f"{FIGURE}_order",
                         "series": f"ascending order of C1-C5, {stack} stack",
                         "x_name": "zero_config", "x_value": " < ".join(ours),
                         "y_name": "order_matches_paper", "y_value": float(ours == PAPER_ORDER),
                         "unit": "bool", "kind": "simulated", "stack": stack})
    return rows


def plot(table, out_dir: str) -> list[str]:
    """The paper's Figure 6 layout: per configuration C1..C5 the paper's max model size
    (hatched), the paper2020-stack dry run and the modern-stack dry run (B parameters); the
    relative error vs the paper above each simulated bar, the searched depth ("60 L" = 60
    layers at the Table 7 hidden size) inside it; legend and caption below the axes."""

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    t = table[(table["figure"] == FIGURE) & (table["y_name"] == "max_model_size")]
    paper = t[t["kind"] == "paper"].set_index("x_value")
    sim = t[t["kind"] == "simulated"]
    cats = sorted(set(t["x_value"]))
    x = range(len(cats))
    w = 0.27
    style = {"paper2020": dict(color="C3", label="simulated: paper2020 stack (DeepSpeed 0.2 + "
                                                "2019 Megatron-LM), dry run judged at 32 GB"),
             "modern": dict(color="C0", label="simulated: modern stack (this runtime), dry run "
                                             "judged at 32 GB")}
    fig, ax = plt.subplots(figsize=(8.0, 5.6))
    pv = [float(paper["y_value"].get(c, float("nan"))) for c in cats]
    ax.bar([i - w for i in x], pv, w, color="white", edgecolor="0.3", hatch="///",
           label="paper, Figure 6 (measured on 400 V100-32GB)")
    tops = list(pv)
    for k, stack in enumerate(("paper2020", "modern")):
        ours = sim[sim["stack"] == stack].set_index("x_value") if "stack" in sim else sim[:0]
        if not len(ours):
            continue
        ov = [float(ours["y_value"].get(c, float("nan"))) for c in cats]
        tops += ov
        bars = ax.bar([i + k * w for i in x], ov, w, **style[stack])
        for c, b in zip(cats, bars):
            err = ours["rel_error_vs_paper"].get(c) if "rel_error_vs_paper" in ours else None
            if err is not None and pd.notna(err):
                ax.annotate(f"{100 * float(err):+.0f}%", (b.get_x() + b.get_width() / 2,
                                                         b.get_height()),
                            ha="center", va="bottom", fontsize=7.5, xytext=(0, 2),
                            textcoords="offset points")
            n = ours["n_layer"].get(c) if "n_layer" in ours else None
            if n is not None and pd.notna(n):
                ax.annotate(f"{int(n)} L", (b.get_x() + b.get_width() / 2, 0), ha="center",
                            va="bottom", fontsize=6.5, color="white", xytext=(0, 3),
                            textcoords="offset points", rotation=90)
    ax.set_xticks(list(x), cats)
    ax.set_xlabel("ZeRO configuration (paper Table 3: C1-C2 P_os, C3-C5 P_os+g; "
                  "C2, C4 + P_a; C5 + P_a+cpu)", fontsize=8.5)
    ax.set_ylabel("Largest trainable model (billions of parameters)")
    top = max(v for v in tops if v == v)
    ax.set_ylim(0, top * 1.15)
    order = table[table["figure"] == f"{FIGURE}_order"]
    notes = []
    for r in order.itertuples():
        same = float(r.y_value) == 1.0
        notes.append(f"{getattr(r, 'stack', '')}: {r.x_value} "
                     f"({'same as' if same else 'differs from'} the paper's C1 < C3 < C2 < C4 < C5)")
    ax.set_title("Figure 6: largest model per ZeRO configuration, 400 V100-32GB, MP 16, "
                 "batch 16 per GPU", fontsize=9.5)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=1,
              frameon=False)
    caption = ("Bars: percentage = error vs the paper; \"N L\" = number of layers of the "
               "largest model that fits (hidden size and heads of the Table 7 row).\n"
               "Simulated order: " + "; ".join(notes))
    fig.text(0.5, 0.01, caption, ha="center", va="bottom", fontsize=7, wrap=True)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    paths = save_figure(fig, out_dir, 'fig6_max_model', dpi=150)
    return paths
