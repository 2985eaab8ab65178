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
judgement replays the second to the allocator's steady state). The reported depth is the
increasing sweep's (``depth_search.increasing_sweep``: the paper grew the model until it failed); the
depths above it that fit again up to the largest fit are the flip band (cross-hatched). The
bracket (markers): the same search with every choice the 2020 sources leave open at its
least-memory end (``paper2020_least``, outside-allocator bytes low) and at its most-memory end
(``paper2020_most``, high; ``switches.bracket_end``). The paper's order of C1-C5 is read from
``results/paper/reference.csv``. The table holds no timings (a re-run gives it byte for byte);
each record keeps its search's seconds (``search_s``, ``total_s``). Search timings and
fragmentation findings: ``results/fig6_max_model/notes.md``.
"""
from __future__ import annotations

import dataclasses
import time

from zero_repro.lab import judged
from zero_repro.lab import records as R
from zero_repro.lab.figures import max_model as MMF
from zero_repro.lab.figures.wording import num, pct
from zero_repro.lab.points import Point
from zero_repro.scale.paper.setups import reference_rows, setups
from zero_repro.scale.dryrun import maxsize
from zero_repro.scale.dryrun.dryrun import setup_overrides
from zero_repro.scale.dryrun.stack import switches as S
from zero_repro.scale.hardware import device_bytes
from zero_repro.runtime.model import flops

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


def paper_order() -> tuple[str, ...]:
    """C1-C5 in ascending order of the paper's largest model (results/paper/reference.csv)."""
    vals = {r["x_value"]: float(r["y_value"]) for r in reference_rows(PAPER_FIGURE)
            if r["y_name"] == "max_model_size"}
    return tuple(sorted(vals, key=vals.get))


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


def _params(cfg, n: int) -> int:
    return flops.param_count(dataclasses.replace(cfg.model, n_layer=n)) if n else 0


def flip_band(judgements: list[dict], answer: int, largest_fit: int | None = None
              ) -> tuple[int, int]:
    """(lowest depth judged NOT to fit, highest judged to fit) when the verdict flips with depth
    (fragmentation near the top): from the increasing sweep's first failure (``answer`` + 1)
    to the largest depth judged to fit (``largest_fit``, default the largest in the
    judgements); (answer, answer) when no depth above the answer fits."""
    top = max((j["n_layer"] for j in judgements if j["fits"]), default=answer)
    top = max(answer, top if largest_fit is None else largest_fit)
    fails = [j["n_layer"] for j in judgements if not j["fits"] and answer < j["n_layer"] < top]
    return (min(fails), top) if fails and top > answer else (answer, answer)


def run_point(cfg, point: Point) -> dict:
    its = int(point.params.get("iterations", 2))
    t0 = time.perf_counter()
    store = judged.for_experiment(cfg)  # depths judged before, shared (lab.judged)
    r = maxsize.max_layers(cfg, iterations=its, store=store)
    out = {"max_n_layer": r.n_layer, "max_params": r.params, "max_params_B": r.params / 1e9,
           "largest_fit": r.largest_fit, "sweep_start": r.sweep_start,
           "capacity_bytes": r.capacity, "outside_point": cfg.simulate.outside_point,
           "device_bytes": device_bytes(cfg.cluster),
           "seed": r.seed, "seed_from": r.seed_from,
           "analytic_seed": r.analytic_seed, "probes": r.probes, "n_dry_runs": r.n_dry_runs,
           "search_s": r.seconds, "dry_run_backend": r.backend,
           "judgements": [vars(j) for j in r.judgements]}
    out["flip_band"] = flip_band(out["judgements"], r.n_layer, r.largest_fit)
    # the same search at both ends of the bracket: the stack's open choices and the bytes
    # outside the allocator at their least- / most-memory end (switches.bracket_end)
    name = point.params.get("stack", "modern")
    lo, hi = S.get(name).outside_bracket()
    ends = {}
    for end in ("low", "high") if hi > lo else ():
        stack, where = S.bracket_end(name, end)
        c = dataclasses.replace(cfg, simulate=dataclasses.replace(
            cfg.simulate, stack=stack, outside_point=where))
        e = maxsize.max_layers(c, capacity=maxsize.capacity_of(c, where), iterations=its,
                               store=store)
        ends[end] = (e.n_layer, flip_band([vars(j) for j in e.judgements], e.n_layer,
                                          e.largest_fit), e.capacity, stack)
    for end, (n, band, cap, stack) in ends.items():
        out[f"n_layer_outside_{end}"] = n
        out[f"params_B_outside_{end}"] = _params(cfg, n) / 1e9
        out[f"flip_band_outside_{end}"] = band
        out[f"capacity_outside_{end}"] = cap
        out[f"stack_{end}"] = stack
    out["total_s"] = time.perf_counter() - t0
    return out


NEWEST_ONLY = True  # summarize() shows the newest record of every point (lab.figures.regenerate)
PARALLEL_POINTS = True  # independent searches: side by side with experiment.workers (lab.point_pool)


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
                     **_band_columns(r)})
    order = paper_order()
    for stack in [s for s in STACKS if s in sizes]:
        if len(sizes[stack]) == len(order):
            ours = tuple(sorted(sizes[stack], key=lambda k: sizes[stack][k]))
            rows.append({"figure": f"{FIGURE}_order",
                         "series": f"ascending order of C1-C5, {stack} stack",
                         "x_name": "zero_config", "x_value": " < ".join(ours),
                         "y_name": "order_matches_paper", "y_value": float(ours == order),
                         "unit": "bool", "kind": "simulated", "stack": stack})
    return rows


def _band_columns(r) -> dict:
    """The bracket's ends (B params, layers) and the flip band of the judged point."""
    m, out = r.metrics, {}
    for end in ("low", "high"):
        if f"params_B_outside_{end}" in m:
            out[f"B_outside_{end}"] = round(m[f"params_B_outside_{end}"], 2)
            out[f"n_layer_outside_{end}"] = m[f"n_layer_outside_{end}"]
            out[f"flip_layers_outside_{end}"] = "-".join(map(str, m[f"flip_band_outside_{end}"]))
    if "flip_band" in m:
        lo, hi = m["flip_band"]
        out["flip_layers"] = f"{lo}-{hi}"
        out["flip_B_high"] = round(_b(r, hi), 2)
        out["largest_fit"] = m.get("largest_fit", hi)
    if "outside_point" in m:
        out["outside_point"] = m["outside_point"]
        out["capacity_GiB"] = round(m["capacity_bytes"] / 2**30, 3)
    return out


def _b(r, n: int) -> float:
    """B params of depth ``n`` at the record's hidden size (scaled from the answer's count)."""
    m = r.metrics
    h = r.params["hidden"]
    per_layer = 12 * h * h + 13 * h  # one GPT-2 block (flops.param_count)
    return (m["max_params"] - per_layer * (m["max_n_layer"] - n)) / 1e9


def conclude(table) -> list[str]:
    """The figure in words: the paper's largest model per configuration C1-C5, then per stack the
    dry-run judged one with its signed error against the paper, and whether each stack
    reproduces the paper's ascending order of the five."""
    t = table[(table["figure"] == FIGURE) & (table["y_name"] == "max_model_size")]
    paper = t[t["kind"] == "paper"]
    out = []
    if len(paper):
        out.append("paper (measured, 400 V100-32GB), largest model [B params]: " + ", ".join(
            f"{r.x_value} {num(r.y_value, 4)}" for r in paper.sort_values("x_value").itertuples()))
    ours = t[t["kind"] != "paper"]
    stacks = ours["stack"] if "stack" in ours else ours["series"]
    rank = {k: i for i, k in enumerate(STACKS)}
    for stack, g in sorted(ours.groupby(stacks, sort=False), key=lambda kv: rank.get(kv[0], 9)):
        g = g.sort_values("x_value")
        err = g["rel_error_vs_paper"] if "rel_error_vs_paper" in g else [None] * len(g)
        out.append(f"{g['kind'].iloc[0]}, {stack} [B]: " + ", ".join(
            f"{r.x_value} {num(r.y_value, 6)}" + (f" {pct(e)}" if pct(e) != "-" else "")
            for r, e in zip(g.itertuples(), err)))
    order = table[table["figure"] == f"{FIGURE}_order"]
    if len(order):
        out.append(f"the paper's ascending order {' < '.join(paper_order())}: " + ", ".join(
            f"{getattr(r, 'stack', r.series)} " + (
                "reproduces it" if float(r.y_value) == 1.0 else f"DIFFERS ({r.x_value})")
            for r in order.itertuples()))
    return out


def plot(table, out_dir: str) -> list[str]:
    """The paper's Figure 6 layout (``lab.figures.max_model``): per configuration the paper's
    size and both stacks' dry-run answers, the bracket's ends, the flip band, a caption."""
    return MMF.plot(table, out_dir, FIGURE)
