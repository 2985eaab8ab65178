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

from experiments.base import Point

FIGURE = "fig7"
GB = 1e9


def plan(cfg) -> list[Point]:
    import dataclasses

    from zero_repro.simulate import maxsize
    from zero_repro.simulate.paper_setups import setups

    p = cfg.experiment.params
    cluster = p.get("cluster", "dgx2_v100")
    its = int(p.get("iterations", 2))
    todo = list(setups("fig7"))
    if p.get("all_100b"):
        s100 = next(s for s in todo if s.size_label == "100B")
        todo += [dataclasses.replace(s100, zero_config=c, point=f"100B {c}")
                 for c in ("C1", "C2", "C3")]
    pts = []
    for s in todo:
        for md in ([True, False] if p.get("md_off") else [True]):
            ov = maxsize.setup_overrides(s, cluster)
            if not md:
                ov["zero_r.contiguous_memory"] = False
            name = f"{s.size_label} {s.zero_config}" + ("" if md else " M_D off")
            pts.append(Point(name=name, params={"model": s.size_label,
                                                "zero_config": s.zero_config, "m_d": md,
                                                "cluster": cluster, "iterations": its},
                             overrides=ov, mode="simulated"))
    return pts


def run_point(cfg, point: Point) -> dict:
    from zero_repro.simulate.dryrun import dry_run

    r = dry_run(cfg, iterations=int(point.params.get("iterations", 2)), keep_trace=False)
    a = r.allocator
    return {"metrics": {"max_cached_memory_GB": a["peak_reserved"] / GB,
                        "peak_allocated_GB": a["peak_allocated"] / GB,
                        "live_peak_GB": max(r.live_peak_by_iteration.values()) / GB,
                        "fragmentation": a["fragmentation"], "oom": a["oom"],
                        "allocator": a, "allocator_with_build": r.allocator_with_build,
                        "live_peak_by_phase": r.live_peak_by_phase, "psi": r.psi,
                        "host_bytes": r.host_bytes, "timings": r.timings,
                        "n_events": r.n_events},
            "memory": r.ledger}


def summarize(records) -> list[dict]:
    rows, cached = [], {}
    for r in records:
        if r.status != "ok":
            continue
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
