"""Peers experiment: this project's ZeRO-DP stages beside torch DDP, DDP + ZeroRedundancyOptimizer,
FSDP2 ``fully_shard`` and DeepSpeed ZeRO 1-3 (paper §5, §7), racing like with like, each
framework's distance to a lower bound.

Points (one record each): ``same_kernel`` (the headline: every peer's AdamW is
``torch.optim.AdamW(fused=True)``, the kernel ``ShardAdamW`` runs; all frameworks, the lower
bound and the single-process reference on ``model``, gpt_20m), ``as_shipped`` (the peers'
default optimizers), ``size`` (stage 2 and 3 frameworks on larger models, fused kernel, no
reference), ``memory`` (every framework alone in processes of its own: its per-rank live-storage
peak, ``peers.memory.LivePeak``, beside the max RSS) and ``budget`` (the largest model of a ladder
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

import dataclasses
import importlib.util
import json
import logging
import os

from zero_repro import config as C
from zero_repro import schema
from zero_repro.runtime.comm.launch import spawn
from zero_repro.lab import records as R
from zero_repro.lab.figures.figures import save_figure
from zero_repro.lab.points import Point
from zero_repro.runtime.model.flops import param_count
from zero_repro.lab.peers import report
from zero_repro.lab.peers.report_md import pd_numeric, repeats_of as _reps, write_report
from zero_repro.lab.peers.frameworks import DEEPSPEED_PEERS, FRAMEWORKS, LOWER_BOUND, PATCHES_TORCH
from zero_repro.lab.peers.runners import PeerSpec, process_sets, run_budget, run_peers

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


def ladder_model(n_layer: int, n_embd: int, like) -> C.ModelConfig:
    """One GPT shape of the budget ladder: ``n_layer`` x ``n_embd`` (heads of 64), the rest of
    ``like`` (vocabulary, sequence)."""
    return dataclasses.replace(like, name=f"gpt_{n_layer}x{n_embd}", n_layer=n_layer,
                               n_embd=n_embd, n_head=max(1, n_embd // 64), nominal="")


def _spec(cfg, **kw) -> PeerSpec:
    return PeerSpec(cfg.model, cfg.train, cfg.zero, zero_r=cfg.zero_r, **kw)


def _run_memory(cfg, pp: dict) -> dict:
    """Every framework alone (its own spawn): live peak, max RSS, RSS before its build."""
    out, load = {}, [os.getloadavg()[0]]
    for fw in pp["frameworks"]:
        res = spawn(run_peers, cfg.parallel.world_size,
                    _spec(cfg, frameworks=(fw,), reference=False, optimizer="fused"),
                    backend=cfg.cluster.backend, timeout_s=cfg.launcher.collective_timeout_s)
        res = sorted(res, key=lambda r: r["rank"])
        out[fw] = {"live_peak": [r["frameworks"][fw]["live_peak"] for r in res],
                   "max_rss": [r["max_rss"] for r in res],
                   "rss_before": [r["rss_before"] for r in res],
                   "held": [r["frameworks"][fw]["memory"] for r in res]}
        load.append(os.getloadavg()[0])
    log.info("peers memory (world %d, %s, measured): %s", cfg.parallel.world_size,
             cfg.model.name, {f: f"{max(v['live_peak']) / 2**20:.0f} MiB" for f, v in out.items()})
    return {"metrics": {"table": "memory", "model": cfg.model.name,
                        "params": param_count(cfg.model), "memory_peak": out,
                        "loadavg_1min": load}}


def _run_budget(cfg, pp: dict) -> dict:
    """Per framework (its own spawn): the ladder climbed until a size's live peak exceeds the
    per-rank budget on some rank."""
    ladder = [ladder_model(n, h, cfg.model) for n, h in pp["ladder"]]
    params = {m.name: param_count(m) for m in ladder}
    train = dataclasses.replace(cfg.train, warmup_steps=int(pp["steps"]))
    out, load = {}, [os.getloadavg()[0]]
    for fw in pp["frameworks"]:
        spec = PeerSpec(cfg.model, train, cfg.zero, frameworks=(fw,), reference=False,
                        zero_r=cfg.zero_r)
        res = sorted(spawn(run_budget, cfg.parallel.world_size, spec, ladder, pp["rank_bytes"],
                           backend=cfg.cluster.backend,
                           timeout_s=cfg.launcher.collective_timeout_s), key=lambda r: r["rank"])
        sizes = [{"model": s0["model"], "params": params[s0["model"]],
                  "live_peak": max(r["sizes"][i]["live_peak"] for r in res),
                  "max_rss": max(r["sizes"][i]["max_rss"] for r in res), "fits": s0["fits"]}
                 for i, s0 in enumerate(res[0]["sizes"])]
        fit = [s0 for s0 in sizes if s0["fits"]]
        out[fw] = {"sizes": sizes, "largest": fit[-1]["model"] if fit else "",
                   "largest_params": fit[-1]["params"] if fit else 0,
                   "rss_before": max(r["rss_before"] for r in res)}
        load.append(os.getloadavg()[0])
        log.info("peers budget %s: largest within %.2f GB per rank: %s", fw,
                 pp["rank_bytes"] / 1e9, out[fw]["largest"] or "none")
    return {"metrics": {"table": "budget", "rank_bytes": pp["rank_bytes"],
                        "ladder": [{"model": m.name, "params": params[m.name],
                                    "n_layer": m.n_layer, "n_embd": m.n_embd} for m in ladder],
                        "budget": out, "loadavg_1min": load}}


def run_point(cfg, point: Point) -> dict:
    p, pp = cfg.experiment.params, point.params
    if pp["table"] == "memory":
        return _run_memory(cfg, pp)
    if pp["table"] == "budget":
        return _run_budget(cfg, pp)
    spec = _spec(cfg, optimizer=pp["optimizer"],
                    reference=bool(pp.get("reference", True)),
                    digest_every=int(p.get("digest_every", 1)),
                    param_tol_rel_lr=float(p.get("param_tol_rel_lr", 0.05)),
                    grad_rounding_rel=float(p.get("grad_rounding_rel", 1e-5)))
    sets = process_sets(pp["frameworks"], by_stage=bool(pp.get("by_stage")))
    load = [os.getloadavg()[0]]
    results = []
    for fws in sets:  # one set of processes each (a patching framework alone + the bound)
        log.info("peers: process set %s", fws)
        results.append(spawn(run_peers, cfg.parallel.world_size,
                             PeerSpec(**{**vars(spec), "frameworks": tuple(fws)}),
                             backend=cfg.cluster.backend,
                             timeout_s=cfg.launcher.collective_timeout_s))
        load.append(os.getloadavg()[0])
    repeats = int(p.get("repeats", 3))
    eq = (report.equivalence(report.merge_sets(results), cfg.train.lr,
                             spec.param_tol_rel_lr, float(p.get("loss_tol", 1e-4)))
          if spec.reference else {})
    sp = report.speed_sets(results, cfg.train.warmup_steps, repeats)
    log.info("peers %s (world %d, %s, fp32, %s AdamW, measured):\n%s", pp["table"],
             cfg.parallel.world_size, cfg.model.name, spec.optimizer,
             report.format_report(eq, sp))
    fw = {n: tr for rs in results for n, tr in min(rs, key=lambda r: r["rank"])[
        "frameworks"].items()}
    return {"metrics": {"table": pp["table"], "model": cfg.model.name,
                        "params": param_count(cfg.model), "optimizer": spec.optimizer,
                        "process_sets": [list(s) for s in sets],
                        "patches_torch": {n: PATCHES_TORCH[n] for n in fw if n in PATCHES_TORCH},
                        "loadavg_1min": load, "repeats": repeats,
                        "equivalence": eq, "speed": sp,
                        "live_peak": {n: [r["frameworks"][n]["live_peak"] for rs in results
                                          for r in sorted(rs, key=lambda r: r["rank"])
                                          if n in r["frameworks"]] for n in fw},
                        "build_s": {n: fw[n]["build_s"] for n in fw}},
            "memory": {n: {f"rank{r['rank']}": r["frameworks"][n]["memory"]
                           for rs in results for r in rs if n in r["frameworks"]} for n in fw},
            "comm": {n: fw[n]["comm"] for n in fw}}


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


P2P = "_p2p"  # zero_repro stages on gloo point-to-point (the peers' transport)
HYBRID = "torch_ddp_shm"  # DDP on zero_repro's shared-memory transport


def _color(name: str) -> str:
    if name.startswith("zero_repro"):
        return "#a6dba0" if name.endswith(P2P) else "C2"
    return ("C1" if name.startswith("deepspeed") else "0.5" if name == LOWER_BOUND
            else "C9" if name == HYBRID else "C0")


def plot(table, out_dir: str) -> list[str]:
    """Linear axes, time above, memory below: (a) every framework's step time / the lower
    bound, same kernel; (b) the project's stage k / the best peer at stage k, same kernel vs as
    shipped; (c) the size series, step time / lower bound at stages 2 and 3 against the
    parameter count; (d) every framework's per-rank live-storage peak, its max RSS growth beside
    it; (e) the project's peak / the best peer's at each stage; (f) the largest model each
    framework trains within the per-rank budget. Error bars: min-max over the repeats. Writes
    report.md."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    t = table[table["kind"] != "paper"].copy()
    # records of a point that differ in a config knob (e.g. a default that changed) come as
    # separate variants (lab.figures.regenerate): the figure and report show the newest race
    if "measured_at" in t:
        t = (t.sort_values("measured_at", kind="stable")
             .drop_duplicates(["table", "model", "x_value", "y_name"], keep="last"))
    t["y"] = pd.to_numeric(t["y_value"], errors="coerce")
    fig, axes = plt.subplots(2, 3, figsize=(18, 10.4),
                             gridspec_kw={"width_ratios": [2.2, 1, 1.2]})
    _panel_bound(axes[0][0], t)
    _panel_best_peer(axes[0][1], t)
    _panel_size(axes[0][2], t)
    _panel_memory(axes[1][0], t)
    _panel_memory_peer(axes[1][1], t)
    _panel_budget(axes[1][2], t)
    fig.suptitle("ZeRO stages vs peers, measured on CPU ranks, world 2, fp32: step time (top), "
                 "per-rank memory (bottom); bars: median, whiskers: min-max of 3 repeats\n"
                 "blue torch (gloo), cyan DDP on zero_repro's shared-memory transport, orange "
                 "DeepSpeed (gloo), green zero_repro (shared memory; light green: _p2p, on gloo "
                 "point-to-point like the peers), grey lower bound", fontsize=10)
    fig.tight_layout()
    paths = save_figure(fig, out_dir, FIGURE, dpi=130)
    paths.append(write_report(t, out_dir))
    return paths


def _errbar(ys, reps):
    lo = [y - min(r) if r else 0 for y, r in zip(ys, reps)]
    hi = [max(r) - y if r else 0 for y, r in zip(ys, reps)]
    return [[max(0, v) for v in lo], [max(0, v) for v in hi]]


def _panel_bound(ax, t) -> None:
    d = t[(t["table"] == "same_kernel") & (t["y_name"] == "ratio_to_bound")]
    d = d.sort_values(["stage", "x_value"])
    reps = [_reps(v) for v in d["repeats"]]
    ax.bar(range(len(d)), d["y"], color=[_color(x) for x in d["x_value"]],
           yerr=_errbar(list(d["y"]), reps), capsize=2)
    ax.set_xticks(range(len(d)), [f"{x}\n(stage {s})" if s >= 0 else f"{x}" for x, s in
                                  zip(d["x_value"], d["stage"])],
                  rotation=60, fontsize=7, ha="right")
    ax.axhline(1.0, color="0.4", linestyle=":", linewidth=1, label="lower bound (1.0)")
    ax.axhline(report.GOAL_BOUND, color="C3", linestyle="--", linewidth=1,
               label=f"goal for zero_repro: <= {report.GOAL_BOUND:.2f} x lower bound")
    top = max([1.2] + [max(r) for r in reps if r] + list(d["y"].dropna()))
    ax.set_ylim(0, top * 1.08)  # whiskers included
    ax.set_ylabel("step time / lower bound [x], same fused AdamW")
    ax.set_title("(a) distance to the lower bound (gpt_20m)", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(True, axis="y", alpha=0.3)


def _panel_best_peer(ax, t) -> None:
    d = t[(t["y_name"] == "ratio_to_best_peer") & t["x_value"].str.startswith("zero_repro")
          & t["table"].isin(["same_kernel", "as_shipped"])]
    width = 0.2
    bars = (("same_kernel", False, "C2", "", "shared memory; peers with fused AdamW"),
            ("as_shipped", False, "#a6dba0", "//", "shared memory; peers as shipped"),
            ("same_kernel", True, "#e5f5e0", "xx", "gloo p2p (_p2p); peers with fused AdamW"),
            ("as_shipped", True, "#e5f5e0", "\\\\", "gloo p2p (_p2p); peers as shipped"))
    for i, (table, p2p, color, hatch, label) in enumerate(bars):
        e = d[(d["table"] == table) & (d["x_value"].str.endswith(P2P) == p2p)].sort_values("stage")
        if e.empty:  # not measured: no legend entry
            continue
        reps = [_reps(v) for v in e["repeats"]]
        ax.bar(e["stage"] + (i - 1.5) * width, e["y"], width=width, color=color, hatch=hatch,
               edgecolor="0.3", yerr=_errbar(list(e["y"]), reps), capsize=2, label=label)
    ax.axhline(1.0, color="0.4", linestyle=":", linewidth=1, label="parity with the best peer")
    for k, goal in sorted(report.GOAL_RATIO.items()):
        ax.hlines(goal, k - 0.45, k + 0.45, colors="C3", linestyles="--", linewidth=1,
                  label="goal: <= 0.95 (stages 0-1), 0.80 (2-3)" if k == 0 else None)
    ax.set_xticks(range(4), [f"stage {k}" for k in range(4)])
    tops = [max(r) for v in d["repeats"] for r in [_reps(v)] if r]
    ax.set_ylim(0, max([1.3] + tops) * 1.45)  # room for the legend above the bars
    ax.set_ylabel("zero_repro / best peer at the stage [x]")
    ax.set_title("(b) step time vs the best peer (gpt_20m)", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(True, axis="y", alpha=0.3)


def _panel_size(ax, t) -> None:
    d = t[(t["y_name"] == "ratio_to_bound") & (t["stage"].isin([2, 3]))
          & t["table"].isin(["same_kernel", "size"])].copy()
    d = d[d["x_value"].isin(set(d.loc[d["table"] == "size", "x_value"]))]  # the series' own
    d["params_m"] = pd_numeric(d["params"]) / 1e6
    for (name, stage), e in d.groupby(["x_value", "stage"]):
        e = e.sort_values("params_m")
        reps = [_reps(v) for v in e["repeats"]]
        ax.errorbar(e["params_m"], e["y"], yerr=_errbar(list(e["y"]), reps), marker="o",
                    color=_color(name), linestyle="-" if stage == 2 else "--", capsize=2,
                    label=f"{name} (stage {stage})")
    ax.axhline(1.0, color="0.4", linestyle=":", linewidth=1)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("model parameters [M] (seq 64, micro-batch 4 per rank)")
    ax.set_ylabel("step time / lower bound [x], same fused AdamW")
    ax.set_title("(c) size series, stages 2 (solid) and 3 (dashed)", fontsize=9)
    ax.legend(fontsize=6)
    ax.grid(True, alpha=0.3)


def _memory_source(t):
    """Per-framework memory rows: the memory table's (each framework alone), else the race's
    live peaks (same kernel)."""
    d = t[t["table"] == "memory"]
    return d if not d.empty else t[(t["table"] == "same_kernel")]


def _not_measured(ax, what: str) -> None:
    """A panel whose records do not exist yet: said in words, no empty axes."""
    ax.text(0.5, 0.5, f"{what}: not measured in these records\n(python run.py +exp=peers "
            "experiment.force=true)", ha="center", va="center", transform=ax.transAxes)
    ax.set_axis_off()


def _panel_memory(ax, t) -> None:
    d = _memory_source(t)
    peak = d[d["y_name"] == "live_peak_bytes"].sort_values(["stage", "x_value"])
    if peak.empty:
        _not_measured(ax, "memory")
        return
    xs = range(len(peak))
    ax.bar(xs, peak["y"] / 2**20, color=[_color(x) for x in peak["x_value"]],
           label="live-storage peak (largest rank)")
    growth = d[d["y_name"] == "rss_growth_bytes"].set_index("x_value")["y"]
    if not growth.empty:
        ax.plot(list(xs), [growth.get(x, float("nan")) / 2**20 for x in peak["x_value"]], "kD",
                markersize=4, linestyle="none",
                label="max RSS - RSS before the build (cross-check)")
    ax.set_xticks(list(xs), [f"{x}\n(stage {s})" for x, s in zip(peak["x_value"], peak["stage"])],
                  rotation=60, fontsize=7, ha="right")
    model = peak["model"].iloc[0]
    ax.set_ylabel("per-rank memory [MiB]")
    ax.set_title(f"(d) per-rank peak memory ({model}; one accounting for all: live tensor "
                 f"storages)", fontsize=9)
    top = max(peak["y"].max(), growth.max() if not growth.empty else 0) / 2**20
    ax.set_ylim(0, top * 1.25)  # headroom: the legend covers no point
    ax.legend(fontsize=7, loc="upper right")
    ax.grid(True, axis="y", alpha=0.3)


def _panel_memory_peer(ax, t) -> None:
    d = _memory_source(t)
    peak = d[d["y_name"] == "live_peak_bytes"].set_index("x_value")["y"]
    if peak.empty:
        _not_measured(ax, "memory")
        return
    width = 0.35
    for i, p2p in enumerate((False, True)):
        ks, ys = [], []
        for k in range(4):
            ours = f"zero_repro_s{k}{P2P if p2p else ''}"
            peers_k = [peak[n] for n in peak.index if FRAMEWORKS.get(n, (-1, ""))[0] == k
                       and FRAMEWORKS[n][1] not in ("zero_repro", "bound", "hybrid")]
            if ours in peak and peers_k:
                ks.append(k)
                ys.append(peak[ours] / min(peers_k))
        if ks:
            ax.bar([k + (i - 0.5) * width for k in ks], ys, width=width,
                   color="#e5f5e0" if p2p else "C2", edgecolor="0.3",
                   hatch="xx" if p2p else "",
                   label="gloo p2p (_p2p)" if p2p else "shared memory")
    ax.axhline(1.0, color="0.4", linestyle=":", linewidth=1, label="the best peer's peak")
    ax.set_xticks(range(4), [f"stage {k}" for k in range(4)])
    ax.set_ylim(0, max(1.5, ax.get_ylim()[1]) * 1.15)
    ax.set_ylabel("zero_repro peak / best peer's peak [x]")
    ax.set_title("(e) memory vs the best peer (lower is less)", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(True, axis="y", alpha=0.3)


def _panel_budget(ax, t) -> None:
    d = t[(t["table"] == "budget") & (t["y_name"] == "max_params_in_budget")]
    d = d.sort_values(["stage", "x_value"])
    if d.empty:
        _not_measured(ax, "largest model in a per-rank budget")
        return
    ys = range(len(d))
    ax.barh(list(ys), d["y"] / 1e6, color=[_color(x) for x in d["x_value"]])
    for y, (v, m) in zip(ys, zip(d["y"], d["model"])):
        ax.text(v / 1e6, y, f" {m}", va="center", fontsize=6)
    ax.set_yticks(list(ys), [f"{x} (stage {s})" for x, s in zip(d["x_value"], d["stage"])],
                  fontsize=7)
    ax.invert_yaxis()
    budget = d["detail"].iloc[0].split(":")[0]
    ax.set_xlabel("parameters of the largest model trained [M]")
    ax.set_title(f"(f) largest model within a per-rank {budget.replace('budget ', '')} "
                 f"budget (live peak)", fontsize=9)
    ax.grid(True, axis="x", alpha=0.3)


def _memory_conclusion(t) -> list[str]:
    """The memory half: zero_repro's live peak over the best peer's per stage (each framework
    alone), and per stage the largest ladder model zero_repro and the best peer train within
    the budget."""
    out = []
    mem = t[(t["table"] == "memory") & (t["y_name"] == "memory_to_best_peer")
            & t["x_value"].astype(str).str.fullmatch(r"zero_repro_s\d")]
    if len(mem):
        out.append("memory, " + str(mem["model"].iloc[0]) + ": live peak, zero_repro / best peer: "
                   + ", ".join(f"s{int(r.stage)} {float(r.y_value):.2f} ({r.best_peer})"
                               for r in mem.sort_values("stage").itertuples()))
    bud = t[(t["table"] == "budget") & (t["y_name"] == "max_params_in_budget")]
    if len(bud):
        per = []
        for st, g in bud.groupby("stage"):
            ours = g[g["x_value"].astype(str).str.startswith("zero_repro")]["y_value"].astype(float)
            peers = g[~g["x_value"].astype(str).str.startswith("zero_repro")]["y_value"]
            best = f"{peers.astype(float).max() / 1e6:.1f}M" if len(peers) else "-"
            if len(ours):
                per.append(f"s{int(st)} {ours.max() / 1e6:.1f}M vs {best}")
        out.append("budget: largest model trained per rank budget, zero_repro vs best peer: "
                   + ", ".join(per))
    return out


def conclude(table) -> list[str]:
    """Per table of the race (same kernel, as shipped) and per set of records (this machine,
    the reference): zero_repro's step time per stage over the best peer's of that stage and
    over the lower bound; then the largest tolerance ratio of the equivalence check (< 1:
    every framework's parameters equal the reference within tolerance)."""
    import re

    t = table[table["kind"] == "measured"]
    if "measured_at" in t:  # the newest race of every table, as the figure and report show
        t = (t.sort_values("measured_at", kind="stable")
             .drop_duplicates(["table", "model", "x_value", "y_name"], keep="last"))
    source = t["series"].astype(str).map(
        lambda s: f" ({s.split(' · ', 1)[1].split(':')[0]})" if " · " in s else "")
    out = []
    def span(v) -> str:
        lo, hi = f"{v.min():.2f}", f"{v.max():.2f}"
        return lo if lo == hi else f"{lo}-{hi}"

    keys = [t["table"].astype(str), t["model"].astype(str), source]
    for (name, model, src), g in t.groupby(keys, sort=False):
        ours = g[g["x_value"].astype(str).str.fullmatch(r"zero_repro_s\d")]
        best = ours[ours["y_name"] == "ratio_to_best_peer"]
        bound = ours[ours["y_name"] == "ratio_to_bound"]["y_value"].astype(float)
        if not len(best):
            continue
        per = ", ".join(f"s{int(st)} {span(b['y_value'].astype(float))} "
                        f"({'/'.join(dict.fromkeys(b['best_peer'].astype(str)))})"
                        for st, b in best.groupby("stage"))
        out.append(f"{name}{src}, {model}: step time, zero_repro / best peer: {per}; "
                   f"zero_repro / lower bound {span(bound)}")
    out += _memory_conclusion(t)
    tol = pd_numeric(t[t["y_name"] == "tolerance_ratio"]["y_value"]).dropna()
    if len(tol):
        out.append(f"equivalence: largest tolerance ratio {tol.max():.3f} over {len(tol)} "
                   f"framework runs ({'all within' if tol.max() < 1 else 'SOME BEYOND'} "
                   f"tolerance)")
    return [re.sub(r"\s+", " ", line) for line in out]
