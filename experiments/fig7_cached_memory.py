"""Figure 7: max cached memory per ZeRO configuration (paper §10.5, Table 8: 400 V100-32GB,
MP 16; 40B = 50 x 8192, 32 heads, batch 16/GPU under C1-C5; 100B = 125 x 8192, 64 heads,
batch 32/GPU under C4 and C5).

simulated (prediction; the paper's values are withheld, nothing here is fitted): one dry run of
the real runtime per setup (fake tensors, fake 400-rank process group, rank 0), its allocation
trace replayed through the caching-allocator model (``simulate.allocator``) with the device's
32 GB: ``max_cached_memory`` = the model's peak reserved bytes, PyTorch's
``max_memory_cached``/``max_memory_reserved``, the quantity the paper plots. Also reported:
peak allocated, exact live peak, fragmentation and the ledger. The paper states (§10.5) that
the cached memory does not decrease from C4 to C5 at 40B but does at 100B; ``c4_to_c5`` rows
say whether the prediction agrees.

``experiment.params.md_off: true`` adds each setup with M_D off (contiguous_memory=false), to
show what the arenas do to fragmentation; ``all_100b: true`` adds 100B under C1-C3 (Table 8 has
none: the prediction is whether they fit).
"""
from __future__ import annotations

from zero_repro.harness.figures import save_figure
from zero_repro.harness.points import Point
import dataclasses

from zero_repro.paper.setups import setups
from zero_repro.simulate.dryrun import dry_run, setup_overrides

FIGURE = "fig7"
GB = 1e9


def plan(cfg) -> list[Point]:
    p = cfg.experiment.params
    cluster = p.get("cluster", "dgx2_v100")
    its = int(p.get("iterations", 1))
    todo = list(setups("fig7"))
    if p.get("all_100b"):
        s100 = next(s for s in todo if s.size_label == "100B")
        todo += [dataclasses.replace(s100, zero_config=c, point=f"100B {c}")
                 for c in ("C1", "C2", "C3")]
    pts = []
    for s in todo:
        for md in ([True, False] if p.get("md_off") else [True]):
            ov = setup_overrides(s, cluster)
            if not md:
                ov["zero_r.contiguous_memory"] = False
            name = f"{s.size_label} {s.zero_config}" + ("" if md else " M_D off")
            pts.append(Point(name=name, params={"model": s.size_label,
                                                "zero_config": s.zero_config, "m_d": md,
                                                "cluster": cluster, "iterations": its},
                             overrides=ov, mode="simulated"))
    return pts


def run_point(cfg, point: Point) -> dict:
    r = dry_run(cfg, iterations=int(point.params.get("iterations", 1)), keep_trace=False)
    a = r.allocator
    return {"metrics": {"max_cached_memory_GB": a["peak_reserved"] / GB,
                        "peak_allocated_GB": a["peak_allocated"] / GB,
                        "live_peak_GB": max(r.live_peak_by_iteration.values()) / GB,
                        "live_peak_steady_GB": r.live_peak_steady / GB,
                        "fragmentation": a["fragmentation"], "oom": a["oom"],
                        "allocator": a, "allocator_with_build": r.allocator_with_build,
                        "live_peak_by_phase": r.live_peak_by_phase, "psi": r.psi,
                        "host_bytes": r.host_bytes, "timings": r.timings,
                        "n_events": r.n_events},
            "memory": r.ledger}


def summarize(records) -> list[dict]:
    rows, cached = [], {}
    newest: dict = {}  # point name -> newest ok record (older settings, e.g. 2 steps, stay
    for r in records:  # in points.jsonl as history)
        if r.status == "ok" and (r.point not in newest or r.timestamp >= newest[r.point].timestamp):
            newest[r.point] = r
    for r in newest.values():
        m = r.metrics
        series = f"{r.params['model']}" + ("" if r.params.get("m_d", True) else " M_D off")
        cached[(series, r.params["zero_config"])] = m["max_cached_memory_GB"]
        for y, key in (("max_cached_memory", "max_cached_memory_GB"),
                       ("peak_allocated", "peak_allocated_GB")):
            rows.append({"figure": FIGURE, "series": series, "x_name": "zero_config",
                         "x_value": r.params["zero_config"], "y_name": y,
                         "y_value": round(m[key], 3), "unit": "GB", "kind": "simulated",
                         "oom_at_32GB": m["oom"], "fragmentation": round(m["fragmentation"], 4)})
    for series in dict.fromkeys(s for s, _ in cached):
        c4, c5 = cached.get((series, "C4")), cached.get((series, "C5"))
        if c4 is not None and c5 is not None:
            rows.append({"figure": f"{FIGURE}_claims", "series": series,
                         "x_name": "claim", "x_value": "C4->C5 change",
                         "y_name": "c4_to_c5_GB", "y_value": round(c5 - c4, 3), "unit": "GB",
                         "kind": "simulated"})
    return rows


def plot(table, out_dir: str) -> list[str]:
    """The paper's Figure 7 layout: max cached memory (GB) per configuration C1..C5, one bar
    per model size (40B, 100B; M_D-off variants hatched), peak allocated as a tick on each bar,
    the 32 GB device as a line; the C4->C5 change per size in the title."""

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = table[table["figure"] == FIGURE]
    cached = t[t["y_name"] == "max_cached_memory"]
    alloc = t[t["y_name"] == "peak_allocated"]
    series = list(dict.fromkeys(cached["series"]))
    cats = sorted(set(cached["x_value"]))
    w = 0.8 / max(1, len(series))
    fig, ax = plt.subplots(figsize=(7.6, 4.8))
    base = {s.split()[0]: f"C{i}" for i, s in enumerate(dict.fromkeys(
        s.split()[0] for s in series))}
    for k, s in enumerate(series):
        for i, c in enumerate(cats):
            row = cached[(cached["series"] == s) & (cached["x_value"] == c)]
            if not len(row):
                continue
            x = i - 0.4 + w * (k + 0.5)
            y = float(row["y_value"].iloc[0])
            oom = bool(row.get("oom_at_32GB", [False]).iloc[0]) if "oom_at_32GB" in row else False
            ax.bar(x, y, w, color=base[s.split()[0]], hatch="//" if "M_D off" in s else None,
                   edgecolor="black" if oom else "white",
                   label=s if i == cats.index(row["x_value"].iloc[0]) else None)
            ax.annotate(f"{y:.1f}" + (" OOM" if oom else ""), (x, y), ha="center",
                        va="bottom", fontsize=7.5, xytext=(0, 2), textcoords="offset points")
            a = alloc[(alloc["series"] == s) & (alloc["x_value"] == c)]
            if len(a):
                ax.plot([x - w / 2.5, x + w / 2.5], [float(a["y_value"].iloc[0])] * 2,
                        color="black", lw=1.2)
    handles, labels = ax.get_legend_handles_labels()
    seen = dict(zip(labels, handles))
    ax.axhline(32, color="0.4", ls="--", lw=1)
    ax.text(len(cats) - 0.5, 32.3, "V100 32 GB", ha="right", va="bottom", fontsize=8,
            color="0.3")
    from matplotlib.lines import Line2D

    seen["peak allocated"] = Line2D([], [], color="black", lw=1.2)
    ax.legend(seen.values(), [f"{k} [simulated]" if k != "peak allocated" else k
                              for k in seen], fontsize=8, loc="upper right", ncol=1)
    ax.set_xticks(range(len(cats)), cats)
    ax.set_xlabel("ZeRO configuration (Table 3)")
    ax.set_ylabel("Max cached memory (GB)")
    ax.set_ylim(0, 40)
    claims = table[table["figure"] == f"{FIGURE}_claims"]
    note = "; ".join(f"{r.series}: C4->C5 {float(r.y_value):+.1f} GB"
                     for r in claims.itertuples())
    ax.set_title("Figure 7: max cached memory, 400 V100-32GB, MP 16 (simulated; paper values "
                 "withheld)" + (f"\n{note}" if note else ""), fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    paths = save_figure(fig, out_dir, 'fig7_cached_memory', dpi=150)
    return paths
