"""Peers experiment: this project's ZeRO-DP stages beside torch DDP, DDP + ZeroRedundancyOptimizer,
FSDP2 ``fully_shard`` and DeepSpeed ZeRO 1-3 (paper §5, §7), racing like with like, each
framework's distance to a lower bound.

Points (one record each): ``same_kernel`` (the headline: every peer's AdamW is
``torch.optim.AdamW(fused=True)``, the kernel ``ShardAdamW`` runs; all frameworks, the lower
bound and the single-process reference on ``model``, gpt_20m), ``as_shipped`` (the peers'
default optimizers), ``size`` (stage 2 and 3 frameworks on larger models, fused kernel, no
reference), ``memory`` (every framework alone in processes of its own: its per-rank live-storage
peak, ``lab.live_peak.live_tracer``, beside the max RSS) and ``budget`` (the largest model of a ladder
each framework trains at world 2 within a per-rank live-peak budget: the paper's Figure 6
question). The race's tables carry each framework's live peak over its untimed steps beside its
step time. A point runs one ``launch.spawn`` per process set (``runners.process_sets``);
inside a set frameworks are interleaved step by step (``runners.run_peers``) and the timed steps
split into ``repeats`` blocks.

``summarize``: figure ``peers``, series ``<table>/<framework>/stage<k>``, x_name ``framework``,
y_name step_time_s | ratio_to_bound | ratio_to_best_peer | ratio_to_ddp | max_abs_dparam |
tolerance_ratio | max_abs_dloss | comm_volume_elements | live_peak_bytes | max_rss_bytes |
rss_growth_bytes | memory_to_best_peer | max_params_in_budget (``kind=measured``; extra columns table,
model, params, stage, best_peer, repeats, detail); ``plot`` draws the ratios (time above, memory below) and
writes ``report.md`` (``lab.peers.report_md``). Notes on the CPU fast path: ``results/peers/notes.md``.
"""
from __future__ import annotations

import importlib.util
import json
import logging

from zero_repro import schema
from zero_repro.lab import records as R
from zero_repro.lab.points import Point
from zero_repro.lab.peers.frameworks import DEEPSPEED_PEERS, FRAMEWORKS, LOWER_BOUND
from zero_repro.lab.peers import race
from experiments.peers import figure

log = logging.getLogger(__name__)

FIGURE = "peers"
TABLES = ("same_kernel", "as_shipped", "size", "memory", "budget")
Y_UNITS = {"step_time_s": "s", "ratio_to_bound": "x", "ratio_to_best_peer": "x",
           "ratio_to_ddp": "x", "max_abs_dparam": "abs", "tolerance_ratio": "x",
           "max_abs_dloss": "nats", "comm_volume_elements": "elements",
           "live_peak_bytes": "bytes", "max_rss_bytes": "bytes", "rss_growth_bytes": "bytes",
           "memory_to_best_peer": "x", "max_params_in_budget": "params"}
RACERS = [f for f in FRAMEWORKS if f != LOWER_BOUND]  # what the memory tables measure


def _available(wanted) -> list[str]:
    wanted = list(wanted)
    if importlib.util.find_spec("deepspeed") is None:
        dropped = [f for f in wanted if f in DEEPSPEED_PEERS]
        if dropped:
            log.warning("DeepSpeed is not installed: skipping %s (install it with "
                        "`DS_BUILD_OPS=0 pip install deepspeed` to compare against it)", dropped)
        wanted = [f for f in wanted if f not in DEEPSPEED_PEERS]
    return wanted


def _frameworks(cfg) -> list[str]:
    return _available(cfg.experiment.params.get("frameworks") or FRAMEWORKS)


def plan(cfg) -> list[Point]:
    p = cfg.experiment.params
    fws = _frameworks(cfg)
    m, w = cfg.model, cfg.parallel.world_size
    if cfg.parallel.tp != 1:
        raise ValueError("the peers experiment compares data parallelism only: set parallel.tp=1")
    tables = list(p.get("tables") or ["same_kernel"])
    unknown = [t for t in tables if t not in TABLES]
    if unknown:
        raise ValueError(f"experiment.params.tables: unknown {unknown}; choose from {TABLES}")
    pts = []
    for table in tables:
        if table in ("size", "memory", "budget"):
            continue
        opt = "fused" if table == "same_kernel" else "as_shipped"
        pts.append(Point(name=f"peers_{m.name}_w{w}_{table}",
                         params={"model": m.name, "world_size": w, "frameworks": fws,
                                 "optimizer": opt, "table": table, "reference": True,
                                 "by_stage": False}, mode="measured"))
    if "memory" in tables:
        mem = p.get("memory") or {}
        steps = int(mem.get("steps", cfg.train.warmup_steps + 1))
        pts.append(Point(name=f"peers_{m.name}_w{w}_memory",
                         params={"model": m.name, "world_size": w, "table": "memory",
                                 "frameworks": [f for f in fws if f in RACERS],
                                 "steps": steps},
                         overrides={"train.steps": steps}, mode="measured"))
    if "budget" in tables:
        b = p.get("budget") or {}
        ladder = [list(map(int, x)) for x in b.get("ladder") or []]
        pts.append(Point(name=f"peers_w{w}_budget",
                         params={"world_size": w, "table": "budget",
                                 "frameworks": _available(b.get("frameworks") or []),
                                 "ladder": ladder, "rank_bytes": float(b.get("rank_bytes", 1e9)),
                                 "steps": int(b.get("steps", 2))}, mode="measured"))
    if "size" in tables:
        s = p.get("size_series") or {}
        size_fws = _available(s.get("frameworks") or [])
        for name in s.get("models") or []:
            ov = {f"model.{k}": v for k, v in schema.model_conf(name).items()}
            ov["train.steps"] = int(s.get("steps", cfg.train.steps))
            pts.append(Point(name=f"peers_{name}_w{w}_size",
                             params={"model": name, "world_size": w, "frameworks": size_fws,
                                     "optimizer": "fused", "table": "size",
                                     "reference": bool(s.get("reference", False)),
                                     "by_stage": True, "steps": ov["train.steps"]},
                             overrides=ov, mode="measured"))
    return pts


def run_point(cfg, point: Point) -> dict:
    pp = point.params
    if pp["table"] == "memory":
        return race.run_memory(cfg, pp)
    if pp["table"] == "budget":
        return race.run_budget(cfg, pp)
    return race.run_race(cfg, pp)


def _detail(e: dict) -> str:
    fd = e.get("first_divergence")
    if fd:
        return f"first beyond tolerance: step {fd['step']} {fd['tensor']} rank {fd['rank']}"
    at = [w for w in e.get("worst_at") or [] if w]
    if not at:
        return ""
    n = e.get("elements_within_budget_only") or 0
    extra = f"; {n} element-steps needed the conditioning budget" if n else ""
    return f"within tolerance; largest in {at[-1][0]} (rank {at[-1][1]}){extra}"


def _best_peer_memory(peaks: dict[str, float], name: str) -> tuple[float | None, str]:
    """``name``'s peak over the smallest peak of another framework at its stage (not this
    project's, not a hybrid), and that peer."""
    stage = FRAMEWORKS[name][0]
    cands = [(v, n) for n, v in peaks.items() if n != name and FRAMEWORKS[n][0] == stage
             and FRAMEWORKS[n][1] not in ("zero_repro", "bound", "hybrid") and v]
    if not cands or not peaks.get(name):
        return None, ""
    v, n = min(cands)
    return peaks[name] / v, n


def _row(r, table: str, name: str, y_name: str, y, load: str, **extra) -> dict:
    m = r.metrics
    return {"figure": FIGURE, "series": f"{table}/{name}/stage{FRAMEWORKS[name][0]}",
            "x_name": "framework", "x_value": name, "y_name": y_name, "y_value": y,
            "unit": Y_UNITS[y_name], "kind": r.mode, "table": table,
            "model": m.get("model", r.params.get("model", "")), "params": m.get("params"),
            "stage": FRAMEWORKS[name][0], "process_set": 0, "best_peer": "", "repeats": "",
            "detail": "", "loadavg_1min": load, "measured_at": r.timestamp,
            "split_tied_grad": False, **extra}


def _memory_rows(r, load: str) -> list[dict]:
    """The ``memory`` table: per framework the largest rank's live peak, max RSS and its
    growth over the process before the build; zero_repro's peak over the best peer's."""
    rows, mp = [], r.metrics["memory_peak"]
    peaks = {n: max(v["live_peak"]) for n, v in mp.items()}
    for name, v in mp.items():
        ratio, peer = _best_peer_memory(peaks, name)
        growth = max(a - b for a, b in zip(v["max_rss"], v["rss_before"]))
        for y_name, y in (("live_peak_bytes", peaks[name]), ("max_rss_bytes", max(v["max_rss"])),
                          ("rss_growth_bytes", growth), ("memory_to_best_peer", ratio)):
            if y is not None:
                rows.append(_row(r, "memory", name, y_name, y, load, best_peer=peer))
    return rows


def _budget_rows(r, load: str) -> list[dict]:
    """The ``budget`` table: per framework the parameters of the largest ladder model whose
    live peak fits the per-rank budget (0: none), the peaks climbed in ``detail``."""
    rows, m = [], r.metrics
    for name, v in m["budget"].items():
        detail = "; ".join(f"{s['model']} {s['live_peak'] / 2**20:.0f} MiB"
                           f"{'' if s['fits'] else ' (over)'}" for s in v["sizes"])
        rows.append(_row(r, "budget", name, "max_params_in_budget", v["largest_params"], load,
                         model=v["largest"] or "-", params=v["largest_params"],
                         detail=f"budget {m['rank_bytes'] / 2**20:.0f} MiB/rank: {detail}"))
    return rows


def summarize(records) -> list[dict]:
    rows = []
    for r in R.newest_ok(records):  # older runs stay in points.jsonl as history
        m = r.metrics
        if "table" not in m:
            continue  # a record of the earlier race (default AdamW peers, no bound): history
        eq, sp = m.get("equivalence", {}), m.get("speed", {})
        table = m["table"]
        loads = [x for x in m.get("loadavg_1min") or [] if isinstance(x, (int, float))]
        load = f"{min(loads):.1f}-{max(loads):.1f}" if loads else ""
        if table == "memory":
            rows += _memory_rows(r, load)
            continue
        if table == "budget":
            rows += _budget_rows(r, load)
            continue
        split = bool(((r.config or {}).get("zero") or {}).get("split_tied_grad", False))
        live = {n: max(v) for n, v in (m.get("live_peak") or {}).items() if v}
        for name, s in sp.items():
            e = eq.get(name, {})
            comm = r.comm.get(name, {})
            vol = sum(v.get("volume", 0) for k, v in comm.items()
                      if isinstance(v, dict) and k.endswith("/dp"))
            values = {"step_time_s": (s.get("step_time_s"), s.get("repeats_s")),
                      "ratio_to_bound": (s.get("ratio_to_bound"),
                                         s.get("ratio_to_bound_repeats")),
                      "ratio_to_best_peer": (s.get("ratio_to_best_peer"),
                                             s.get("ratio_to_best_peer_repeats")),
                      "ratio_to_ddp": (s.get("ratio_to_ddp"), None),
                      "max_abs_dparam": (e.get("max_abs_dparam_all"), None),
                      "tolerance_ratio": (e.get("max_tolerance_ratio"), None),
                      "max_abs_dloss": (e.get("max_abs_dloss_all"), None),
                      "comm_volume_elements": (vol or None, None),
                      "live_peak_bytes": (live.get(name) if name != LOWER_BOUND else None,
                                          None)}
            for y_name, (y, reps) in values.items():
                if y is None:
                    continue
                rows.append({"figure": FIGURE, "series": f"{table}/{name}/stage{s['stage']}",
                             "x_name": "framework", "x_value": name, "y_name": y_name,
                             "y_value": y, "unit": Y_UNITS[y_name], "kind": r.mode,
                             "table": table, "model": m.get("model", r.params.get("model")),
                             "params": m.get("params"), "stage": s["stage"],
                             "process_set": s.get("process_set", 0),
                             "best_peer": s.get("best_peer") or "",
                             "repeats": json.dumps([round(x, 4) for x in reps]) if reps else "",
                             "detail": _detail(e) if y_name == "max_abs_dparam" else "",
                             "loadavg_1min": load, "measured_at": r.timestamp,
                             "split_tied_grad": split})
    return rows


def plot(table, out_dir: str) -> list[str]:
    """The race's figure and ``report.md`` (``peers.figure.plot``)."""
    return figure.plot(table, out_dir)


def conclude(table) -> list[str]:
    """The race's result lines (``peers.figure.conclude``)."""
    return figure.conclude(table)
