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
from experiments.fig7_cached_memory import figure as CMF
from zero_repro.lab.figures.wording import by_kind_and_series, column, num
from zero_repro.lab.memory_view import point_snapshot
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
                        "capacity_bytes": r.capacity, "breakdown": r.breakdown,
                        **point_snapshot(cfg, point.name, r)},
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
    """The paper's Figure 7 layout (``fig7_cached_memory.figure``): max cached memory per
    configuration, bars per model size x stack, peak allocated, the bracket's ends, the usable
    device memory; empty 100B slots at C1-C3 are configurations the paper did not run."""
    return CMF.plot(table, out_dir, FIGURE, DEVICE_GIB)
