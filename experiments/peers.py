"""Peers experiment: this project's ZeRO-DP stages side by side with torch DDP,
DDP + ZeroRedundancyOptimizer, FSDP2 ``fully_shard`` and DeepSpeed ZeRO 1-3 (paper §5, §7).

One measured point runs every framework in one set of ranks, interleaved step by step with a
single-process reference (``zero_repro.peers.runners.run_peers``), so all speeds come from
the same run under the same machine load. The record keeps, per framework, the per-step loss,
the per-step max |Δθ| vs the reference with the tensor and rank where it is largest, the first
divergence beyond tolerance, step times, the memory each rank holds and the communication of
one step. ``summarize`` emits rows with figure ``peers``, series ``<framework>/stage<k>``,
x_name ``framework`` and y_name step_time_s | ratio_to_best_peer | ratio_to_ddp |
max_abs_dparam | max_abs_dloss | comm_volume_elements (all ``kind=measured``); ``plot`` draws
grouped bars by stage and writes ``report.md`` (the ratio table).
"""
from __future__ import annotations

import importlib.util
import logging
import os

from zero_repro.harness.figures import save_figure
from zero_repro.harness.points import Point
from zero_repro.peers.runners import DEEPSPEED_PEERS, FRAMEWORKS
from zero_repro.distributed.launch import spawn
from zero_repro.peers import report
from zero_repro.peers.runners import PeerSpec, run_peers

log = logging.getLogger(__name__)

FIGURE = "peers"
Y_UNITS = {"step_time_s": "s", "ratio_to_best_peer": "x", "ratio_to_ddp": "x",
           "max_abs_dparam": "abs", "max_abs_dloss": "nats", "comm_volume_elements": "elements"}


def _frameworks(cfg) -> list[str]:
    wanted = list(cfg.experiment.params.get("frameworks") or FRAMEWORKS)
    if importlib.util.find_spec("deepspeed") is None:
        dropped = [f for f in wanted if f in DEEPSPEED_PEERS]
        if dropped:
            log.warning("DeepSpeed is not installed: skipping %s (install it with "
                        "`DS_BUILD_OPS=0 pip install deepspeed` to compare against it)", dropped)
        wanted = [f for f in wanted if f not in DEEPSPEED_PEERS]
    return wanted


def plan(cfg) -> list[Point]:
    fws = _frameworks(cfg)
    m, w = cfg.model, cfg.parallel.world_size
    if cfg.parallel.tp != 1:
        raise ValueError("the peers experiment compares data parallelism only: set parallel.tp=1")
    return [Point(name=f"peers_{m.name}_w{w}",
                  params={"model": m.name, "world_size": w, "frameworks": fws},
                  mode="measured")]


def run_point(cfg, point: Point) -> dict:
    p = cfg.experiment.params
    spec = PeerSpec(cfg.model, cfg.train, cfg.zero, frameworks=tuple(point.params["frameworks"]),
                    digest_every=int(p.get("digest_every", 1)))
    results = spawn(run_peers, cfg.parallel.world_size, spec, backend=cfg.cluster.backend,
                    timeout_s=cfg.launcher.collective_timeout_s)
    eq = report.equivalence(results, cfg.train.lr, float(p.get("param_tol_rel_lr", 0.05)),
                            float(p.get("loss_tol", 1e-4)))
    sp = report.speed(results, cfg.train.warmup_steps)
    log.info("peers (world %d, %s, fp32, measured):\n%s", cfg.parallel.world_size,
             cfg.model.name, report.format_report(eq, sp))
    r0 = min(results, key=lambda r: r["rank"])
    fw = r0["frameworks"]
    return {"metrics": {"equivalence": eq, "speed": sp,
                        "build_s": {n: fw[n]["build_s"] for n in fw}},
            "memory": {n: {f"rank{r['rank']}": r["frameworks"][n]["memory"] for r in results}
                       for n in fw},
            "comm": {n: fw[n]["comm"] for n in fw}}


def _detail(e: dict) -> str:
    fd = e.get("first_divergence")
    if fd:
        return f"first beyond tolerance: step {fd['step']} {fd['tensor']} rank {fd['rank']}"
    at = [w for w in e.get("worst_at") or [] if w]
    return f"within tolerance; largest in {at[-1][0]} (rank {at[-1][1]})" if at else ""


def summarize(records) -> list[dict]:
    rows = []
    for r in records:
        if r.status != "ok":
            continue
        eq, sp = r.metrics.get("equivalence", {}), r.metrics.get("speed", {})
        for name, s in sp.items():
            e = eq.get(name, {})
            comm = r.comm.get(name, {})
            vol = sum(v.get("volume", 0) for k, v in comm.items()
                      if isinstance(v, dict) and k.endswith("/dp"))
            values = {"step_time_s": s.get("step_time_s"),
                      "ratio_to_best_peer": s.get("ratio_to_best_peer"),
                      "ratio_to_ddp": s.get("ratio_to_ddp"),
                      "max_abs_dparam": e.get("max_abs_dparam_all"),
                      "max_abs_dloss": e.get("max_abs_dloss_all"),
                      "comm_volume_elements": vol or None}
            for y_name, y in values.items():
                if y is None:
                    continue
                rows.append({"figure": FIGURE, "series": f"{name}/stage{s['stage']}",
                             "x_name": "framework", "x_value": name, "y_name": y_name,
                             "y_value": y, "unit": Y_UNITS[y_name], "kind": r.mode,
                             "stage": s["stage"], "best_peer": s.get("best_peer") or "",
                             "detail": _detail(e) if y_name == "max_abs_dparam" else ""})
    return rows


def plot(table, out_dir: str) -> list[str]:
    """Grouped bars by stage (step time, ratio to the best peer, max |Δθ|) + report.md."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    t = table[table["kind"] != "paper"].copy()
    t["y"] = pd.to_numeric(t["y_value"], errors="coerce")
    panels = [("step_time_s", "median step time [s]", False),
              ("ratio_to_best_peer", "step time / best peer at the same stage", False),
              ("max_abs_dparam", "max |θ - θ_ref| over steps", True)]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    for ax, (y_name, label, logy) in zip(axes, panels):
        d = t[t["y_name"] == y_name].sort_values(["stage", "x_value"])
        colors = ["C2" if str(x).startswith("zero_repro") else
                  "C1" if str(x).startswith("deepspeed") else "C0" for x in d["x_value"]]
        ax.bar(range(len(d)), d["y"], color=colors)
        ax.set_xticks(range(len(d)), [f"{x}\n(s{s})" for x, s in zip(d["x_value"], d["stage"])],
                      rotation=60, fontsize=7, ha="right")
        ax.set_ylabel(label)
        if logy and (d["y"] > 0).any():
            ax.set_yscale("log")
        if y_name == "ratio_to_best_peer":
            ax.axhline(0.9, color="red", linestyle="--", linewidth=1, label="goal 0.9")
            ax.axhline(1.0, color="gray", linestyle=":", linewidth=1)
            ax.legend(fontsize=7)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle("ZeRO stages vs peers (measured, world 2, fp32, CPU/gloo; blue torch, "
                 "orange DeepSpeed, green zero_repro)", fontsize=10)
    fig.tight_layout()
    paths = save_figure(fig, out_dir, FIGURE, dpi=130)
    paths.append(_write_report(t, out_dir))
    return paths


def _write_report(t, out_dir: str) -> str:
    wide = t.pivot_table(index=["stage", "x_value"], columns="y_name", values="y",
                         aggfunc="first").reset_index()
    detail = t[t["y_name"] == "max_abs_dparam"].set_index("x_value")["detail"]
    peer = t.drop_duplicates("x_value").set_index("x_value")["best_peer"]
    lines = ["# Peers: measured step time and equivalence (world 2, fp32, CPU/gloo)", "",
             "| stage | framework | median step [s] | / best peer | best peer | / DDP | "
             "max abs dθ | equivalence |", "|---|---|---|---|---|---|---|---|"]
    for _, r in wide.iterrows():
        def f(k, fmt):
            v = r.get(k)
            return format(v, fmt) if v == v and v is not None else "-"
        lines.append(f"| {r['stage']} | {r['x_value']} | {f('step_time_s', '.3f')} | "
                     f"{f('ratio_to_best_peer', '.2f')} | {peer.get(r['x_value'], '') or '-'} | "
                     f"{f('ratio_to_ddp', '.2f')} | {f('max_abs_dparam', '.1e')} | "
                     f"{detail.get(r['x_value'], '')} |")
    path = os.path.join(out_dir, "report.md")
    with open(path + ".tmp", "w") as fh:
        fh.write("\n".join(lines) + "\n")
    os.replace(path + ".tmp", path)
    return path
