"""Where did the memory go: per-category bytes at the peak of one rank's cached memory (paper §10.5,
Figure 7's "max cached" split into what holds it), for the paper's 40B C4 and 100B C5 setups
(Table 8: 400 V100-32GB, MP 16) under both software stacks, and what each ``paper2020`` switch
costs at 40B C4.

breakdown points (``simulated``): one dry run per setup x stack; ``DryRunResult.breakdown``
(``zero_repro.scale.dryrun.stack.categories.breakdown``): at the judged replay's reserved peak,
the live requested bytes per category plus allocator slack and cached-but-free bytes, summing to
the peak reserved bytes exactly. The CUDA context + NCCL (outside the allocator) is a row of its
own: the low end of its sourced bracket and the rest up to the high end
(``scale.dryrun.stack.outside``); the device line is the V100-32GB as it reports itself (32510 MiB
= 31.75 GiB, ``scale.hardware``). switch points: at 40B C4, for every switch of
``zero_repro.scale.dryrun.stack.switches.Stack``,
``modern`` with only that switch (``simulate.only_switches=[s]``) and, with
``experiment.params.in_context=true``, ``paper2020`` without it: the peak-reserved change "alone"
and "in context", in GiB (switches acting only inside another one's path show 0 alone).
``memory_breakdown_live_peak`` rows: the same categories at the peak of live bytes (for
paper2020 the reserved peak can be the build's, whose cached blocks the step then reuses).
mechanism points (``MECHANISMS``): at 40B C1 (Table 8's setup) and at 60B on 64 GPUs (Table
6's setup: batch 16, C5 as the harness's config7 ran it), paper2020 with one 2020 mechanism at
each of its values: what it adds to the capacity a run needs (``min_capacity``) and to its max
cached, and the category it changes (``memory_breakdown_mechanisms`` rows). Time-only switches
(category ``time``) have no memory points. Unit: GiB = 2^30 B (the paper's harness printed
max_memory_cached in GiB).
"""
from __future__ import annotations

import dataclasses

from zero_repro.lab import records as R
from zero_repro.lab.memory_view import point_snapshot
from experiments.memory_breakdown import figure as MBF
from zero_repro.lab.points import Point
from zero_repro.scale.paper.setups import setups
from zero_repro.scale.dryrun.dryrun import dry_run, setup_overrides
from zero_repro.scale.dryrun.stack import switches as S
from zero_repro.scale.hardware import device_bytes, load_cluster

FIGURE = "memory_breakdown"
GIB = 2**30
DEVICE_GIB = device_bytes(load_cluster("dgx2_v100")) / GIB
STACKS = ("paper2020", "modern")
SETUPS = ("40B C1", "40B C4", "100B C5", "60B 64GPUs C5")
SWITCH_AT = "40B C4"
ROWS = S.CATEGORIES + ("allocator_slack", "stream_held", "cached_free")
# switch points of an earlier revision counted DeepSpeed 0.2's host copies of the fp16
# parameters on the device; they stay in points.jsonl as history, the table uses this one
REV = 4  # 4: Fidelity III (streams, stage-1 intervals, stage-2 step per commit, reentrant)
# the 2020 mechanisms of Fidelity III: (switch, value without it, value with it)
MECHANISMS = (("collective_stream_reuse", "at_free", "after_sync"),
              ("stage1_interval_layout", False, True),
              ("stage2_step", "e67a3def0", "f2ac7eafd"),
              ("reentrant_checkpointing", False, True),
              ("fp32_model_on_gpu_before_half", False, True))
MECHANISM_AT = ("40B C1", "60B 64GPUs C5")
SHORT = {"collective_stream_reuse": "streams", "stage1_interval_layout": "intervals",
         "stage2_step": "f2ac7eafd step", "reentrant_checkpointing": "reentrant",
         "fp32_model_on_gpu_before_half": "fp32 build"}


def _setup(label: str):
    """'40B C4' (Table 8) or '60B 64GPUs C5' (Table 6: Figure 3's 64-GPU point)."""
    words = label.split()
    if len(words) == 3:
        s = next(s for s in setups("fig3") if s.gpus == int(words[1].removesuffix("GPUs")))
        return s, words[2]
    size, zc = words
    s = next(s for s in setups("fig7") if s.size_label == size)
    return s, zc


def plan(cfg) -> list[Point]:
    p = cfg.experiment.params
    cluster = p.get("cluster", "dgx2_v100")
    its = int(p.get("iterations", 2))
    pts = []
    for label in p.get("setups") or SETUPS:
        s, zc = _setup(label)
        ov = setup_overrides(s, cluster, zero_config=zc)
        for stack in p.get("stacks") or STACKS:
            pts.append(Point(name=f"{label} {stack}",
                             params={"part": "breakdown", "setup": label, "stack": stack,
                                     "cluster": cluster, "iterations": its},
                             overrides={**ov, "simulate.stack": stack}, mode="simulated"))
    if p.get("mechanisms", True):
        for label in MECHANISM_AT:
            s, zc = _setup(label)
            ov = {**setup_overrides(s, cluster, zero_config=zc), "simulate.stack": "paper2020"}
            for name, without, with_ in MECHANISMS:
                for value in (without, with_):
                    pts.append(Point(name=f"{label} {name}={value}",
                                     params={"part": "mechanism", "setup": label,
                                             "switch": name, "value": value,
                                             "cluster": cluster, "iterations": its,
                                             "rev": REV},
                                     overrides=ov, mode="simulated"))
    if p.get("switches", True):
        s, zc = _setup(SWITCH_AT)
        ov = setup_overrides(s, cluster, zero_config=zc)
        names = [n for n in S.paper2020().switches()
                 if S.describe(n)["category"] != S.TIME]
        hows = ("alone", "in_context") if p.get("in_context", False) else ("alone",)
        for name in names:
            for how in hows:
                only = [name] if how == "alone" else [n for n in names if n != name]
                pts.append(Point(name=f"{SWITCH_AT} {how} {name}",
                                 params={"part": "switch", "setup": SWITCH_AT, "switch": name,
                                         "how": how, "cluster": cluster, "iterations": its,
                                         "rev": REV},
                                 overrides={**ov, "simulate.only_switches": only},
                                 mode="simulated"))
    return pts


def run_point(cfg, point: Point) -> dict:
    q = point.params
    if q["part"] == "mechanism":
        stack = dataclasses.replace(S.paper2020(), **{q["switch"]: q["value"]})
        r = dry_run(cfg, iterations=int(q.get("iterations", 2)), keep_trace=True, stack=stack)
        b = r.breakdown
        return {"peak_reserved": r.allocator["peak_reserved"], "oom": r.allocator["oom"],
                "needs_bytes": r.min_capacity(), "peak_held": r.allocator["peak_held"],
                "capacity_bytes": r.capacity, "categories": b["categories"],
                "allocator_slack": b["allocator_slack"], "stream_held": b["stream_held"],
                "stream_held_categories": b["stream_held_categories"],
                "cached_free": b["cached_free"], "live_peak": r.live_peak,
                "build_live_peak": r.live_peak_by_phase.get("build", 0),
                "total_s": r.timings["total_s"]}
    snap = bool(cfg.experiment.params.get("snapshot", False))
    r = dry_run(cfg, iterations=int(q.get("iterations", 2)), keep_trace=snap)
    b = r.breakdown
    return {**point_snapshot(cfg, point.name, r),
            "peak_reserved": r.allocator["peak_reserved"], "oom": r.allocator["oom"],
            "peak_allocated": r.allocator["peak_allocated"], "capacity_bytes": r.capacity,
            "judged_with_build": r.judged_with_build, "stack": r.stack,
            "dry_run_backend": r.backend,
            "outside_bracket": list(S.get(point.params["stack"]).outside_bracket())
            if point.params.get("stack") else [0, 0],
            "categories": b["categories"], "allocator_slack": b["allocator_slack"],
            "stream_held": b.get("stream_held", 0), "peak_held": r.allocator.get("peak_held", 0),
            "cached_free": b["cached_free"], "breakdown_peak_reserved": b["peak_reserved"],
            "live_peak": b["live_peak"], "live_peak_categories": b["live_peak_categories"],
            "at_phase_event": b["at_event"], "total_s": r.timings["total_s"]}


NEWEST_ONLY = True  # summarize() shows the newest record of every point (lab.figures.regenerate)


def summarize(records) -> list[dict]:
    rows = []
    newest = R.newest_ok(records)
    base = {}
    for r in newest:
        m, p = r.metrics, r.params
        if p["part"] != "breakdown":
            continue
        base[(p["setup"], p["stack"])] = m["peak_reserved"]
        series = f"{p['setup']}, {p['stack']}"
        vals = dict(m["categories"])
        vals["allocator_slack"], vals["cached_free"] = m["allocator_slack"], m["cached_free"]
        vals["stream_held"] = m.get("stream_held", 0)
        for cat in ROWS:
            rows.append({"figure": FIGURE, "series": series, "x_name": "category",
                         "x_value": cat, "y_name": "bytes_at_peak",
                         "y_value": round(vals.get(cat, 0) / GIB, 4), "unit": "GiB",
                         "kind": "simulated", "setup": p["setup"], "stack": p["stack"],
                         "bytes": int(vals.get(cat, 0))})
        for cat, v in sorted(m["live_peak_categories"].items()):  # the training live peak
            rows.append({"figure": f"{FIGURE}_live_peak", "series": series,
                         "x_name": "category", "x_value": cat, "y_name": "bytes_at_live_peak",
                         "y_value": round(v / GIB, 4), "unit": "GiB", "kind": "simulated",
                         "setup": p["setup"], "stack": p["stack"], "bytes": int(v)})
        rows.append({"figure": FIGURE, "series": series, "x_name": "category",
                     "x_value": "peak_reserved (max cached)", "y_name": "bytes_at_peak",
                     "y_value": round(m["peak_reserved"] / GIB, 4), "unit": "GiB",
                     "kind": "simulated", "setup": p["setup"], "stack": p["stack"],
                     "bytes": int(m["peak_reserved"])})
        lo, hi = m.get("outside_bracket") or (m.get("outside_allocator", 0),) * 2
        for name, v in ((S.OUTSIDE, lo), (f"{S.OUTSIDE} (to high end)", hi - lo)):
            rows.append({"figure": FIGURE, "series": series, "x_name": "category",
                         "x_value": name, "y_name": "bytes_at_peak",
                         "y_value": round(v / GIB, 4), "unit": "GiB", "kind": "simulated",
                         "setup": p["setup"], "stack": p["stack"], "bytes": int(v)})
    rows += _mechanism_rows(newest)
    for r in newest:
        m, p = r.metrics, r.params
        if p["part"] != "switch" or p.get("rev") != REV:
            continue
        ref = base.get((p["setup"], "modern" if p["how"] == "alone" else "paper2020"))
        if ref is None:
            continue
        delta = (m["peak_reserved"] - ref) if p["how"] == "alone" else (ref - m["peak_reserved"])
        meta = S.describe(p["switch"])
        extra = 0
        if p["switch"] == "outside_allocator":  # capacity, not max cached (low end)
            extra = S.paper2020().outside_bytes("low")
        rows.append({"figure": f"{FIGURE}_switches", "series": f"{p['setup']}, {p['how']}",
                     "x_name": "switch", "x_value": p["switch"],
                     "y_name": "peak_reserved_change", "y_value": round(delta / GIB, 4),
                     "unit": "GiB", "kind": "simulated", "setup": p["setup"], "how": p["how"],
                     "category": meta["category"], "capacity_change_GiB": -extra / GIB,
                     "oom": m["oom"], "source": meta["source"]})
    return rows


def _mechanism_rows(newest) -> list[dict]:
    """Per mechanism and setup: needed capacity and max cached with the mechanism's value as
    the 2020 code ran it minus without (GiB), and the categories at the peak that moved."""
    got = {(r.params["setup"], r.params["switch"], r.params["value"]): r.metrics
           for r in newest if r.params["part"] == "mechanism" and r.params.get("rev") == REV}
    rows = []
    for label in MECHANISM_AT:
        for name, without, with_ in MECHANISMS:
            a, b = got.get((label, name, with_)), got.get((label, name, without))
            if a is None or b is None:
                continue
            moved = {c: a["categories"].get(c, 0) - b["categories"].get(c, 0)
                     for c in sorted(set(a["categories"]) | set(b["categories"]))}
            moved["stream_held"] = a.get("stream_held", 0) - b.get("stream_held", 0)
            # the category that moved most; "none" when nothing moved (no tie to break by
            # the order of a set, which changes with the interpreter's hash seed)
            top = max(moved, key=lambda c: abs(moved[c]))
            if moved[top] == 0:
                top, moved["none"] = "none", 0
            meta = S.describe(name)
            for y, va, vb in (("needs_change", a["needs_bytes"], b["needs_bytes"]),
                              ("max_cached_change", a["peak_reserved"], b["peak_reserved"])):
                rows.append({"figure": f"{FIGURE}_mechanisms", "series": f"{label}, {y}",
                             "x_name": "switch", "x_value": f"{name}={with_} (vs {without})",
                             "y_name": y, "y_value": round((va - vb) / GIB, 3),
                             "unit": "GiB", "kind": "simulated", "setup": label,
                             "switch": name, "with": str(with_), "without": str(without),
                             "needs_with_GiB": round(a["needs_bytes"] / GIB, 3),
                             "needs_without_GiB": round(b["needs_bytes"] / GIB, 3),
                             "peak_held_GiB": round(a.get("peak_held", 0) / GIB, 3),
                             "category_moved": top,
                             "category_moved_GiB": round(moved[top] / GIB, 3),
                             "source": meta["source"]})
    return rows


def conclude(table, most: int = 4) -> list[str]:
    """The table in words (``memory_breakdown.figure.conclude``): the bytes outside the
    allocator, the largest categories at ``MECHANISM_AT``, the top mechanisms and switches."""
    return MBF.conclude(table, FIGURE, MECHANISM_AT, SHORT, most)


def plot(table, out_dir: str) -> list[str]:
    """The figure (``memory_breakdown.figure``): categories at the peak per setup x stack,
    what each Fidelity III mechanism adds at ``MECHANISM_AT``, each switch's cost at 40B C4."""
    return MBF.plot(table, out_dir, FIGURE, ROWS, MECHANISM_AT, DEVICE_GIB)
