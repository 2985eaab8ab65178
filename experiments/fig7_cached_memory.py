"""Figure 7: max cached memory per ZeRO configuration (paper §10.5, Table 8: 400 V100-32GB, MP 16;
40B = 50 x 8192, 32 heads, batch 16/GPU under C1-C5; 100B = 125 x 8192, 64 heads, batch 32/GPU
under C4 and C5).

simulated (a blind prediction: the paper's values are withheld on purpose, REFERENCE.md; nothing is
fitted): one dry run of the real runtime per setup (rank 0 of a fake 400-rank group), its trace
replayed through the caching-allocator model (``zero_repro.scale.dryrun.allocator``) with the
allocator's share of the device: the V100-32GB as it reports itself (31.75 GiB,
``scale.hardware``) less the stack's bytes outside the allocator at ``simulate.outside_point`` of
their sourced bracket (``scale.dryrun.stack.outside``); the whiskers: the bracket's ends, for
paper2020 a dry run with every choice the 2020 sources leave open at its least-memory end
(``paper2020_least``: collective blocks reusable at their free, stage 2's step as at e67a3def0)
judged with the outside bytes low, and at its most-memory end (``paper2020_most``: blocks held
until the harness's next sync, step as at f2ac7eafd) judged with them high
(``switches.bracket_end``). ``max_cached_memory`` = the peak reserved bytes (PyTorch's ``max_memory_cached`` /
``max_memory_reserved``, what the paper plots); also peak allocated, the exact live peak,
fragmentation and the ledger. ``c4_to_c5`` rows check the paper's §10.5 statement (no decrease
from C4 to C5 at 40B, a decrease at 100B).

Stacks (``experiment.params.stacks``): ``paper2020`` (its build's cached blocks count: "max cached"
from process start) and ``modern``. Unit: GiB = 2^30 B, what the paper's harness printed
(``torch.cuda.max_memory_cached() / (1024*1024*1024)`` labelled "GigaBytes", DSE@405ce794
mpu/random.py see_memory_usage); records keep bytes in GB = 1e9 B (``*_GB``). Table 8 runs 100B
only under C4 and C5; the figure leaves C1-C3 empty at 100B and says so. ``md_off: true`` adds
each setup with M_D off; ``all_100b: true`` adds 100B under C1-C3 (whether they fit).
"""
from __future__ import annotations

from zero_repro.lab import records as R
from zero_repro.lab.figures.figures import save_figure
from zero_repro.lab.figures.wording import by_kind_and_series, column, num
from zero_repro.lab.points import Point
import dataclasses

from zero_repro.scale.paper.setups import setups
from zero_repro.scale.dryrun.dryrun import dry_run, setup_overrides
from zero_repro.scale.dryrun.stack import switches as S
from zero_repro.scale.hardware import device_bytes, load_cluster

FIGURE = "fig7"
GB = 1e9
GIB = 2**30
DEVICE_GIB = device_bytes(load_cluster("dgx2_v100")) / GIB
STACKS = ("paper2020", "modern")


def stack_params(stack: str) -> dict:
    """Point params naming the stack (none for modern: its committed keys stay valid)."""
    return {} if stack == "modern" else {"stack": stack}


def plan(cfg) -> list[Point]:
    p = cfg.experiment.params
    cluster = p.get("cluster", "dgx2_v100")
    its = int(p.get("iterations", 2))
    todo = list(setups("fig7"))
    if p.get("all_100b"):
        s100 = next(s for s in todo if s.size_label == "100B")
        todo += [dataclasses.replace(s100, zero_config=c, point=f"100B {c}")
                 for c in ("C1", "C2", "C3")]
    pts = []
    for stack in p.get("stacks") or STACKS:
        for s in todo:
            for md in ([True, False] if p.get("md_off") else [True]):
                ov = {**setup_overrides(s, cluster), "simulate.stack": stack}
                if not md:  # no longer Table 3's configuration: a custom one
                    ov["zero_r.contiguous_memory"] = False
                    ov["zero_r.name"] = "custom"
                name = (f"{s.size_label} {s.zero_config}" + ("" if md else " M_D off")
                        + ("" if stack == "modern" else f" {stack}"))
                pts.append(Point(name=name, params={"model": s.size_label,
                                                    "zero_config": s.zero_config, "m_d": md,
                                                    "cluster": cluster, "iterations": its,
                                                    **stack_params(stack)},
                                 overrides=ov, mode="simulated"))
    return pts


def run_point(cfg, point: Point) -> dict:
    its = int(point.params.get("iterations", 2))
    r = dry_run(cfg, iterations=its, keep_trace=True)
    a = r.allocator
    name = point.params.get("stack", "modern")
    ends = {}
    for end in ("low", "high"):
        st, where = S.bracket_end(name, end)
        cap = S.get(st).capacity_bytes(device_bytes(cfg.cluster), where)
        if st == name:
            e = a if cap == r.capacity else r.replay(cap)
        else:  # another stack: its own dry run
            e = dry_run(cfg, iterations=its, keep_trace=False, details=False,
                        stack=S.get(st), allocator_capacity=cap).allocator
        ends[f"outside_{end}"] = {"capacity_bytes": cap, "max_cached_memory_GB":
                                  e["peak_reserved"] / GB, "oom": bool(e["oom"]),
                                  "stack": st}
    return {"metrics": {"max_cached_memory_GB": a["peak_reserved"] / GB,
                        "outside_point": cfg.simulate.outside_point, "bracket_ends": ends,
                        "peak_allocated_GB": a["peak_allocated"] / GB,
                        "live_peak_GB": max(r.live_peak_by_iteration.values()) / GB,
                        "live_peak_steady_GB": r.live_peak_steady / GB,
                        "fragmentation": a["fragmentation"], "oom": a["oom"],
                        "dry_run_backend": r.backend,
                        "allocator": a, "allocator_with_build": r.allocator_with_build,
                        "live_peak_by_phase": r.live_peak_by_phase, "psi": r.psi,
                        "host_bytes": r.host_bytes, "timings": r.timings,
                        "n_events": r.n_events, "stack": r.stack,
                        "judged_with_build": r.judged_with_build,
                        "capacity_bytes": r.capacity, "breakdown": r.breakdown},
            "memory": r.ledger}


NEWEST_ONLY = True  # summarize() shows the newest record of every point (lab.figures.regenerate)


def summarize(records) -> list[dict]:
    rows, cached = [], {}
    for r in R.newest_ok(records):  # older settings (e.g. 1 traced step) stay as history
        m = r.metrics
        stack = r.params.get("stack", "modern")
        series = (f"{r.params['model']}" + ("" if r.params.get("m_d", True) else " M_D off")
                  + f", {stack}")
        cached[(series, r.params["zero_config"])] = m["max_cached_memory_GB"] * GB / GIB
        ends = m.get("bracket_ends", {})
        band = {f"{y}_outside_{e}": ends[f"outside_{e}"][k]
                for e in ("low", "high") if f"outside_{e}" in ends
                for y, k in (("cached_GiB", "max_cached_memory_GB"), ("oom", "oom"))}
        for k in [k for k in band if k.startswith("cached_GiB")]:
            band[k] = round(band[k] * GB / GIB, 3)
        for y, key in (("max_cached_memory", "max_cached_memory_GB"),
                       ("peak_allocated", "peak_allocated_GB")):
            rows.append({"figure": FIGURE, "series": series, "x_name": "zero_config",
                         "x_value": r.params["zero_config"], "y_name": y,
                         "y_value": round(m[key] * GB / GIB, 3), "unit": "GiB",
                         "kind": "simulated", "stack": stack, "model": r.params["model"],
                         "oom_judged": m["oom"], "fragmentation": round(m["fragmentation"], 4),
                         "outside_point": m.get("outside_point", ""),
                         "capacity_GiB": round(m["capacity_bytes"] / GIB, 3),
                         "value_GB_1e9": round(m[key], 3), **band})
    for series in dict.fromkeys(s for s, _ in cached):
        c4, c5 = cached.get((series, "C4")), cached.get((series, "C5"))
        if c4 is not None and c5 is not None:
            rows.append({"figure": f"{FIGURE}_claims", "series": series,
                         "x_name": "claim", "x_value": "C4->C5 change",
                         "y_name": "c4_to_c5_GiB", "y_value": round(c5 - c4, 3), "unit": "GiB",
                         "kind": "simulated", "stack": series.split(", ")[-1]})
    return rows


def conclude(table) -> list[str]:
    """The figure in words (the paper's values are withheld: nothing to compare): per model and
    stack the predicted max cached memory of each configuration, the allocator capacity it was
    judged at and any out-of-memory verdict; the C4 -> C5 change against §10.5's statement."""
    t = table[(table["figure"] == FIGURE) & (table["y_name"] == "max_cached_memory")]
    out = []
    for kind, series, g, first in by_kind_and_series(t):
        if first:
            out.append(f"{kind} max cached memory [GiB = 2^30 B] per configuration (paper values "
                       "withheld):")
        oom = [str(x) for x, o in zip(g["x_value"], g.get("oom_judged", [False] * len(g)))
               if str(o) == "True"]
        cap = column(g, "capacity_GiB").max()
        out.append(f"{series}: " + ", ".join(f"{x} {num(y, 4)}" for x, y in
                                              zip(g["x_value"], g["y_value"]))
                   + (f" (capacity {num(cap, 5)}" if cap == cap else " (")
                   + (f"; OUT OF MEMORY: {' '.join(oom)})" if oom else ", all fit)"))
    claims = table[table["figure"] == f"{FIGURE}_claims"]
    if len(claims):
        by_stack: dict = {}
        for r in claims.itertuples():
            model, _, stack = str(r.series).rpartition(", ")
            by_stack.setdefault(stack, []).append(f"{model} {num(r.y_value, 4)}")
        out.append("C4->C5 [GiB] (§10.5: none at 40B, a drop at 100B): "
                   + "; ".join(f"{k} {', '.join(v)}" for k, v in by_stack.items()))
    return out


def plot(table, out_dir: str) -> list[str]:
    """The paper's Figure 7 layout: max cached memory (GiB) per configuration C1..C5, bars per
    model size x stack (paper2020 solid, modern hatched; 40B and 100B in two colours), peak
    allocated as a black tick on each bar, the usable device memory as lines; empty 100B slots
    at C1-C3 are configurations the paper did not run (Table 8)."""

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    t = table[table["figure"] == FIGURE]
    cached = t[t["y_name"] == "max_cached_memory"]
    alloc = t[t["y_name"] == "peak_allocated"]
    series = list(dict.fromkeys(cached["series"]))
    order = {"40B": 0, "100B": 1}
    series.sort(key=lambda s: (order.get(s.split(",")[0].split()[0], 9), "modern" in s,
                               "M_D off" in s))
    cats = sorted(set(cached["x_value"]))
    w = 0.8 / max(1, len(series))
    fig, ax = plt.subplots(figsize=(9.6, 6.6))
    colour = {"40B": "C0", "100B": "C1"}
    for k, s in enumerate(series):
        size, stack = s.split(",")[0].split()[0], s.split(", ")[-1]
        for i, c in enumerate(cats):
            row = cached[(cached["series"] == s) & (cached["x_value"] == c)]
            x = i - 0.4 + w * (k + 0.5)
            if not len(row):
                if size == "100B":
                    ax.text(x, 0.3, "not run in paper", rotation=90, ha="center", va="bottom",
                            fontsize=6, color="0.45")
                continue
            y = float(row["y_value"].iloc[0])
            oom = bool(row["oom_judged"].iloc[0]) if "oom_judged" in row else False
            ax.bar(x, y, w, color=colour.get(size, "C2"), alpha=1.0 if stack != "modern"
                   else 0.45, hatch="//" if stack == "modern" else None,
                   edgecolor="black" if oom else "white", lw=0.6)
            ax.annotate(f"{y:.1f}" + (" OOM" if oom else ""), (x, y), ha="center",
                        va="bottom", fontsize=6.5, xytext=(0, 2), textcoords="offset points",
                        rotation=90)
            if "cached_GiB_outside_high" in row and row["cached_GiB_outside_high"].notna().all():
                lo_c = float(row["cached_GiB_outside_high"].iloc[0])
                hi_c = float(row["cached_GiB_outside_low"].iloc[0])
                if abs(hi_c - lo_c) > 1e-3:
                    ax.plot([x, x], [lo_c, hi_c], color="0.2", lw=0.9)
            a = alloc[(alloc["series"] == s) & (alloc["x_value"] == c)]
            if len(a):
                ax.plot([x - w / 2.5, x + w / 2.5], [float(a["y_value"].iloc[0])] * 2,
                        color="black", lw=1.2)
    dev = DEVICE_GIB
    lo_o, hi_o = (x / GIB for x in S.paper2020().outside_bracket())
    ax.axhline(dev, color="0.4", ls="--", lw=1)
    ax.axhspan(dev - hi_o, dev - lo_o, color="C3", alpha=0.12)
    handles = [Patch(color="C0", label="40B (50 x 8192, batch 16/GPU), paper2020 stack"),
               Patch(color="C0", alpha=0.45, hatch="//", label="40B, modern stack"),
               Patch(color="C1", label="100B (125 x 8192, batch 32/GPU), paper2020 stack"),
               Patch(color="C1", alpha=0.45, hatch="//", label="100B, modern stack"),
               Line2D([], [], color="black", lw=1.2, label="peak allocated (same run)"),
               Line2D([], [], color="0.2", lw=0.9, label="max cached at the bracket's ends "
                      "(paper2020: least-memory end = collective blocks reusable at their\n"
                      "free, step as at e67a3def0, outside bytes low; most-memory end = held "
                      "until the next sync, step as at f2ac7eafd,\noutside bytes high)"),
               Line2D([], [], color="0.4", ls="--", lw=1,
                      label=f"V100-32GB as it reports itself: {dev:.2f} GiB"),
               Patch(color="C3", alpha=0.12,
                     label=f"paper2020 allocator's share: device less {lo_o:.2f}..{hi_o:.2f} "
                           "GiB (CUDA context + NCCL, sourced bracket)")]
    ax.legend(handles=handles, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.11),
              ncol=1, frameon=False)
    ax.set_xticks(range(len(cats)), cats)
    ax.set_xlabel("ZeRO configuration (paper Table 3)")
    ax.set_ylabel("Max cached memory per GPU (GiB = 2^30 bytes)")
    ax.set_ylim(0, 36)
    claims = table[table["figure"] == f"{FIGURE}_claims"]
    note = "; ".join(f"{r.series}: {float(r.y_value):+.1f}" for r in claims.itertuples())
    ax.set_title("Figure 7: max cached memory, 400 V100-32GB, MP 16 (simulated, blind: the "
                 "paper's values are\nwithheld on purpose by this project until the prediction "
                 "is judged against them)", fontsize=9)
    fig.text(0.5, 0.01, "C4 -> C5 change (GiB): " + note + "\nEmpty 100B slots at C1-C3: "
             "the paper ran 100B only under C4 and C5 (Table 8).", ha="center", va="bottom",
             fontsize=6.8)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    paths = save_figure(fig, out_dir, 'fig7_cached_memory', dpi=150)
    return paths
