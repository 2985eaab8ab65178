"""The memory of every run the paper reports (Figures 2, 3, 4, 6 at Table 7's depths, and 8): does
each setup fit a V100-32GB at the paper's batch under the paper2020 stack (and the modern one), and
how much cached memory does it need (paper §10, Tables 5-10)?

One dry run per setup x stack (``zero_repro.scale.dryrun.dryrun``, rank 0, the paper harness's
buckets): ``needs`` = the smallest allocator capacity at which the judged replay does not run out
of memory (``DryRunResult.min_capacity``), and the max cached at the judged capacity. The capacity
is the device as it reports itself (31.75 GiB, ``scale.hardware``) less the stack's bytes outside
the allocator, a sourced bracket (``scale.dryrun.stack.outside``): the verdict is given at its low,
mid and high end. A setup that does not fit under paper2020 is one the paper could not have run as
modelled (``tests/integration/test_paper_runs_fit.py`` requires every one to fit). Figure 8's rows follow
``scale.paper.table9``'s default order (``experiment.params.table9_orders`` adds the other
reading); ``paper2020_most`` (every choice the 2020 sources leave open at its most-memory end,
``switches.paper2020_most``) is judged at the high end of the outside bracket: where the paper's
own runs exclude that end, the bracket's end is not what ran; "ZeRO" rows of Figures 2-3 take the configuration the paper states for the same workload
elsewhere (170B: Figure 8's C5 run, §10.5), else ``calibrate.zero_config_for``'s. Unit: GiB = 2^30
B. Nothing here is compared with withheld values.
"""
from __future__ import annotations

from zero_repro.lab import records as R
from zero_repro.scale.dryrun.stack import switches as S
from zero_repro.scale.hardware import device_bytes
from zero_repro.scale.paper.setups import setups
from zero_repro.lab.throughput import batch as TB
from zero_repro.lab.throughput import setups as TSU
from zero_repro.lab.throughput import simulate as TSIM
from zero_repro.lab.figures.figures import save_figure
from zero_repro.lab.figures.wording import column, num
from zero_repro.lab.points import Point
from zero_repro.scale.paper import table9
from zero_repro.scale.paper.clusters import DRYRUN_FIELDS, cluster_overrides, load_cluster
from zero_repro.scale.dryrun.dryrun import dry_run
from zero_repro.scale.hardware import Hardware

FIGURE = "prediction_memory"
GIB = 2**30
STACKS = ("paper2020", "modern", "paper2020_most")
FIGURES = ("fig2", "fig3", "fig4", "fig6", "fig8")


def _setups(figure: str, p: dict):
    """(order label, setup) pairs: Figure 6 at Table 7's depths, Figure 8 under each Table 9
    order asked for (rows that do not depend on the order -- C1, C2, 170B -- once)."""
    if figure == "fig6":
        return [("", s) for s in setups("fig6")]
    if figure != "fig8":
        return [("", s) for s in TSU.figure_setups(figure, p)]
    out, seen = [], set()
    for order in p.get("table9_orders") or [table9.DEFAULT_ORDER]:
        for s in TSU.figure_setups(figure, {**p, "table9_order": order}):
            key = (s.point, s.batch_per_gpu)
            if key not in seen:
                seen.add(key)
                out.append((order, s))
    return out


def stated_config(s, hw) -> str:
    """The configuration of a setup: its own, else the one the paper states for the same
    workload (shape, GPUs, MP, batch) in Figure 8's Table 9, else ``zero_config_of``'s."""
    if s.zero_config.startswith("C") or s.zero_config == "baseline":
        return s.zero_config
    for f8 in table9.remap(setups("fig8"), table9.DEFAULT_ORDER):
        if (f8.n_layer, f8.hidden, f8.gpus, f8.tp, f8.batch_per_gpu) == (
                s.n_layer, s.hidden, s.gpus, s.tp, s.batch_per_gpu):
            return f8.zero_config
    return TSIM.zero_config_of(s, hw)


def plan(cfg) -> list[Point]:
    p = {**TSU.DEFAULTS, **dict(cfg.experiment.params or {})}
    cluster = p.get("cluster", "dgx2_v100")
    hw = Hardware.from_config(load_cluster(cluster))
    pts = []
    for figure in p.get("figures") or FIGURES:
        for order, s in _setups(figure, p):
            zc = stated_config(s, hw)
            for stack in p.get("stacks") or STACKS:
                ov = {**TB.paper_point_overrides(s, zc, s.batch_per_gpu, p, "fp16"),
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
    r = dry_run(cfg, iterations=2, keep_trace=True)
    dev = device_bytes(cfg.cluster)
    stack = S.get(point.params["stack"])
    return {"peak_reserved": r.allocator["peak_reserved"], "oom": bool(r.allocator["oom"]),
            "peak_allocated": r.allocator["peak_allocated"], "capacity_bytes": r.capacity,
            "outside_point": cfg.simulate.outside_point, "device_bytes": dev,
            "outside_bracket": list(stack.outside_bracket()),
            "needs_bytes": r.min_capacity(),
            "live_peak": max(r.live_peak_by_iteration.values(), default=0),
            "judged_with_build": r.judged_with_build, "total_s": r.timings["total_s"],
            "dry_run_backend": r.backend}


def verdicts(m: dict) -> dict:
    """{point: fits} at the low / mid / high end of the outside-allocator bracket."""
    lo, hi = m["outside_bracket"]
    out = {"low": lo, "mid": (lo + hi) // 2, "high": hi}
    return {k: m["needs_bytes"] <= m["device_bytes"] - v for k, v in out.items()}


NEWEST_ONLY = True  # summarize() shows the newest record of every point (lab.figures.regenerate)
PARALLEL_POINTS = True  # independent dry runs: side by side (lab.point_pool)


def summarize(records) -> list[dict]:
    rows = []
    for r in R.newest_ok(records):  # older records (another method) stay as history
        q, m = r.params, r.metrics
        if "needs_bytes" not in m:  # before the real capacity and the bracket: history
            continue
        orders = q["table9_order"] or "-"
        fit = verdicts(m)
        rows.append({"figure": FIGURE, "series": f"{q['figure']}, {q['stack']}",
                     "x_name": "setup", "x_value": f"{q['setup']} {q['series']}",
                     "y_name": "max_cached_memory", "y_value": round(m["peak_reserved"] / GIB, 3),
                     "unit": "GiB", "kind": "simulated", "paper_figure": q["figure"],
                     "stack": q["stack"], "zero_config": q["zero_config"],
                     "batch_per_gpu": q["batch"], "n_layer": q["n_layer"], "hidden": q["hidden"],
                     "heads": q["heads"], "gpus": q["gpus"], "mp": q["mp"],
                     "table9_order": orders, "needs_GiB": round(m["needs_bytes"] / GIB, 3),
                     "fits_low": fit["low"], "fits_mid": fit["mid"], "fits_high": fit["high"],
                     "fits_judged": not m["oom"], "outside_point": m["outside_point"],
                     "device_GiB": round(m["device_bytes"] / GIB, 3),
                     "outside_low_GiB": round(m["outside_bracket"][0] / GIB, 3),
                     "outside_high_GiB": round(m["outside_bracket"][1] / GIB, 3),
                     "capacity_GiB": round(m["capacity_bytes"] / GIB, 3),
                     "live_peak_GiB": round(m["live_peak"] / GIB, 3)})
    return rows


def _dedup(label: str) -> str:
    """'1.5B ZeRO ZeRO' (setup + series) -> '1.5B ZeRO'."""
    words = str(label).split()
    return " ".join(words[:-1]) if len(words) > 1 and words[-1] == words[-2] else str(label)


def conclude(table) -> list[str]:
    """The table in words (the paper reports none of these numbers: nothing to compare): per
    stack how many of the paper's setups fit a V100-32GB at the paper's batch (at the judged
    capacity and at both ends of the outside-allocator bracket) and the setup with the least
    headroom; for a whole stack (not a bracket end, ``_least`` / ``_most``) also the range of
    what they need per figure."""
    t = table[(table["figure"] == FIGURE) & (table["y_name"] == "max_cached_memory")]
    out = []
    for kind in dict.fromkeys(t["kind"]):
        out.append(f"{kind}: each run the paper reports, one dry run at its batch per stack: "
                   "does it fit a V100-32GB?")
        rows = t[t["kind"] == kind]
        stacks = rows["stack"] if "stack" in rows else rows["series"].str.split(", ").str[-1]
        for stack, g in rows.groupby(stacks, sort=False):
            def n_fit(col):
                return int((g[col].astype(str) == "True").sum()) if col in g else 0
            cap, need = column(g, "capacity_GiB"), column(g, "needs_GiB")
            fig = g["paper_figure"] if "paper_figure" in g else g["series"].str.split(",").str[0]
            ends = (f", {n_fit('fits_low')}/{n_fit('fits_high')} at the bracket's low/high end"
                    if "fits_low" in g and "fits_high" in g else "")
            line = f"{stack}: {n_fit('fits_judged')} of {len(g)} fit at {num(cap.max(), 5)} GiB{ends}"
            if (cap - need).notna().any():
                i = (cap - need).idxmin()
                line += (f"; tightest: {fig[i]} {_dedup(g.loc[i, 'x_value'])} needs "
                         f"{num(need[i], 4)}")
            out.append(line)
            if str(stack).endswith(("_least", "_most")):
                continue  # a bracket end: its count and tightest run; the figure has the rest
            out.append(f"{stack}, needs per figure [GiB]: " + ", ".join(
                f"{f} {num(need[h.index].min())}..{num(need[h.index].max())}"
                for f, h in sorted(g.groupby(fig, sort=False), key=lambda kv: str(kv[0]))))
    return out


def plot(table, out_dir: str) -> list[str]:
    """Per paper run: the allocator capacity it needs (GiB, bars; paper2020 and modern), its max
    cached at the judged capacity (tick), the device as it reports itself (dashed) and the
    paper2020 allocator's share over the outside-allocator bracket (shaded band)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = table[table["figure"] == FIGURE].copy()
    if "needs_GiB" not in t:
        return []
    t = t[t["needs_GiB"].notna()]
    t["label"] = [f"{r['paper_figure']} {_dedup(r['x_value'])} b{int(r['batch_per_gpu'])}"
                  for _, r in t.iterrows()]
    labels = list(dict.fromkeys(t["label"]))
    fig, ax = plt.subplots(figsize=(9.0, 0.26 * len(labels) + 2.6))
    p20 = t[t["stack"] == "paper2020"]
    if len(p20):
        dev = float(p20["device_GiB"].iloc[0])
        lo, hi = float(p20["outside_low_GiB"].iloc[0]), float(p20["outside_high_GiB"].iloc[0])
        ax.axvspan(dev - hi, dev - lo, color="C3", alpha=0.12,
                   label=f"paper2020 allocator's share: device less {lo:.2f}..{hi:.2f} GiB "
                         "outside it (CUDA context + NCCL, sourced bracket)")
        ax.axvline(dev, color="0.4", ls="--", lw=1,
                   label=f"V100-32GB as it reports itself: {dev:.2f} GiB")
    most = t[t["stack"] == "paper2020_most"].set_index("label")
    if len(most):
        ys = [j - 0.19 for j in range(len(labels))]
        vals = [float(most["needs_GiB"].get(lab, float("nan"))) for lab in labels]
        ax.plot(vals, ys, ls="none", marker=">", ms=4, color="C3", mfc="white",
                label="paper2020 at the bracket's most-memory end (blocks held until sync, "
                      "step as at f2ac7eafd): capacity needed")
        for y, lab, v in zip(ys, labels, vals):
            if lab in most.index and not bool(most["fits_high"].get(lab, True)):
                ax.annotate("OOM at the most-memory end", (v, y), fontsize=6, va="center",
                            xytext=(5, 0), textcoords="offset points", color="C3")
    for k, (stack, col) in enumerate((("paper2020", "C3"), ("modern", "C0"))):
        d = t[t["stack"] == stack].set_index("label")
        ys = [j + (k - 0.5) * 0.38 for j in range(len(labels))]
        vals = [float(d["needs_GiB"].get(lab, 0.0)) for lab in labels]
        ax.barh(ys, vals, 0.38, color=col, label=f"{stack} stack: capacity needed")
        cached = [float(d["y_value"].get(lab, float("nan"))) for lab in labels]
        ax.plot(cached, ys, ls="none", marker="|", ms=7, color="black",
                label="max cached at the judged capacity" if k == 0 else None)
        for y, lab, v in zip(ys, labels, vals):
            if lab in d.index and not bool(d["fits_high"].get(lab, True)):
                word = "OOM" if not bool(d["fits_low"].get(lab)) else "OOM at high end"
                ax.annotate(word, (v, y), fontsize=6, va="center", xytext=(2, 0),
                            textcoords="offset points")
    ax.set_yticks(range(len(labels)), labels, fontsize=6.5)
    ax.invert_yaxis()
    ax.set_xlabel("Allocator capacity a paper run needs at its paper batch (GiB = 2^30 B; dry "
                  "run, steady state)")
    ax.set_title("Every run the paper reports: does it fit a V100-32GB? (simulated)", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.035), ncol=1,
              frameon=False)
    fig.tight_layout()
    return save_figure(fig, out_dir, "prediction_memory", dpi=150)
