"""Figure 6: the largest trainable model per ZeRO configuration C1-C5 (paper §10.5, Table 7:
400 V100-32GB, MP 16, DP 25, batch 16 per GPU).

simulated (dry-run judged): for each configuration, at the hidden size and head count of its
Table 7 row, the largest number of layers whose dry run -- the real runtime on fake tensors and
a fake process group of 400 ranks (``simulate.dryrun``), its allocation trace replayed through
the caching-allocator model with the cluster's device memory -- does not run out of memory
(``simulate.maxsize.max_layers``). Reported as parameters (B) next to the paper's
40/60/50/140/150B, with the relative error and whether the paper's order of the five is
reproduced (``order_check`` rows).

Bucket sizes are the paper harness's (reduce 5e8, all-gather 2e8 elements; REFERENCE.md,
inferred); ``experiment.params.iterations`` training steps per dry run (default 1 here: Adam
state is allocated eagerly at build, so the first step already holds every persistent tensor).
"""
from __future__ import annotations

from experiments.base import Point

FIGURE = "fig6"
PAPER_FIGURE = "fig6"
PAPER_SERIES = "max trainable model size, fixed batch 16/GPU, MP=16, 400 GPUs"
OURS = "dry-run judged"
SERIES_FAMILY = {OURS: PAPER_SERIES}
PAPER_ORDER = ("C1", "C3", "C2", "C4", "C5")  # ascending max size in the paper (40,50,60,140,150)


def plan(cfg) -> list[Point]:
    from zero_repro.simulate import maxsize
    from zero_repro.simulate.paper_setups import setups

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
                         overrides=maxsize.setup_overrides(s, cluster), mode="simulated"))
    return pts


def run_point(cfg, point: Point) -> dict:
    from zero_repro.simulate import maxsize

    r = maxsize.max_layers(cfg, iterations=int(point.params.get("iterations", 1)))
    return {"max_n_layer": r.n_layer, "max_params": r.params, "max_params_B": r.params / 1e9,
            "capacity_bytes": r.capacity, "seed": r.seed, "seed_from": r.seed_from,
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
