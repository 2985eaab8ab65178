"""Will it fit, which stage, how fast: the estimate for one model on one cluster (paper §5 Table 1
and what it leaves out), its figure, and the estimate held to real CPU runs.

* simulated (one point): ``zero_repro.lab.estimate.run`` -- per ZeRO stage the per-rank memory
  from the dry run (model states vs Table 1, gathered parameters, buffers, activations, the
  allocator's extra), the verdict at the device, the largest micro-batch, step time / tokens/s /
  MFU (``scale.estimate_time``: the modern stack on the cluster's GPU, its band and every
  term), a recommendation; DeepSpeed's own estimator beside it when
  installed (analytic). Plus step time per stage against the inter-node bandwidth
  (``experiment.params.bandwidths_gbps``, Gbit/s per node; memory does not depend on it).
* measured (``experiment.params.trust``: one point per (world, TP) layout): the same configs at
  small sizes run for real on CPU ranks (``zero_repro.lab.live_peak``: the live-storage peak of
  the training steps) beside the estimator's live peak for the same rank, every stage, GPT and
  Llama (``experiment.params.trust_models``).

Figure ``results/estimate/estimate.png``: memory per GPU by part for each stage (stacked, the
device and Table 1's closed form marked) and step time against the inter-node bandwidth.
"""
from __future__ import annotations

import dataclasses
import logging

from zero_repro import config as C
from zero_repro import schema
from zero_repro.lab import estimate as L
from zero_repro.lab import live_peak as LP
from zero_repro.lab import records as R
from zero_repro.lab.figures.figures import save_figure
from zero_repro.lab.points import Point
from zero_repro.scale import estimate as E

log = logging.getLogger(__name__)

FIGURE = "estimate"
GB = 1e9
PARTS = ("model_states", "gathered_params", "buffers", "activations", "other",
         "allocator_extra")
NEWEST_ONLY = True  # summarize() shows the newest record of every point


def plan(cfg) -> list[Point]:
    p = cfg.experiment.params
    m, par, c = cfg.model, cfg.parallel, cfg.cluster
    pts = [Point(name=f"{m.name} on {par.world_size} x {c.name} tp{par.tp} "
                      f"b{cfg.train.micro_batch_size} s{m.seq_len}",
                 params={"part": "estimate", "model": m.name, "cluster": c.name,
                         "zero_r": p.get("zero_r", "auto"),
                         "stages": list(p.get("stages", [0, 1, 2, 3])),
                         "search": bool(p.get("search", True)),
                         "bandwidths_gbps": list(p.get("bandwidths_gbps", []))},
                 mode="simulated")]
    if p.get("trust"):
        for world, tp in p.get("trust_layouts", [[2, 1], [4, 2]]):
            # the pre-flight check (memory, cores) sees the first trust model, not the estimate's
            first = dataclasses.asdict(C.ModelConfig(**schema.model_conf(
                list(p.get("trust_models"))[0])))
            ov = {**{f"model.{k}": v for k, v in first.items()},
                  "parallel.world_size": int(world), "parallel.tp": int(tp),
                  "cluster.name": "local", "cluster.device": "cpu", "cluster.backend": "gloo",
                  "cluster.device_memory_gb": 0.0, "cluster.gpus_per_node": int(world),
                  "zero.reduce_bucket_size": 2_000_000, "zero.allgather_bucket_size": 2_000_000}
            pts.append(Point(name=f"trust world {world} tp {tp}",
                             params={"part": "trust", "world": int(world), "tp": int(tp),
                                     "models": list(p.get("trust_models")),
                                     # the shapes, so that a changed conf/model file re-runs
                                     "shapes": {n: schema.model_conf(n)
                                                for n in p.get("trust_models")},
                                     "batch": int(p.get("trust_batch", 2))},
                             overrides=ov, mode="measured"))
    return pts


def _trust_configs(cfg, point: Point) -> list[C.Config]:
    out = []
    zr = "pa" if point.params["tp"] > 1 else "ckpt"
    for name in point.params["models"]:
        base = dataclasses.replace(cfg, model=C.ModelConfig(**schema.model_conf(name)))
        out += [E.stage_config(base, s, zr, point.params["batch"]) for s in range(4)]
    return out


def run_point(cfg, point: Point) -> dict:
    if point.params["part"] == "trust":
        return {"rows": LP.compare(_trust_configs(cfg, point))}
    p = point.params
    est, ds = L.run(cfg, tuple(p["stages"]), p["zero_r"], p["search"])
    text = L.report(est, ds)
    log.info("estimate:\n%s", text)
    sweep = E.bandwidth_sweep(cfg, p["stages"], p["zero_r"], p["bandwidths_gbps"]) \
        if p["bandwidths_gbps"] and cfg.cluster.peak_tflops > 0 else {}
    return {"estimate": L.as_json(est, ds), "report": text,
            "bandwidth": {str(s): v for s, v in sweep.items()}}


def summarize(records) -> list[dict]:
    rows = []
    for r in R.newest_ok(records):
        if r.params.get("part") == "trust":
            rows += [{"figure": f"{FIGURE}_trust", "series": f"{t['model']} stage {t['stage']}",
                      "x_name": "world/tp/rank", "x_value": f"{t['world']}/{t['tp']}/{t['rank']}",
                      "y_name": "estimate_over_measured", "y_value": round(t["ratio"], 5),
                      "unit": "ratio", "kind": "measured", "estimate_MB": t["estimate"] / 1e6,
                      "measured_MB": t["measured"] / 1e6, "zero_r": t["zero_r"],
                      "dtype": t["dtype"], "batch": t["batch"]} for t in r.metrics["rows"]]
            continue
        rows += _estimate_rows(r)
    return rows


def _estimate_rows(r) -> list[dict]:
    est, rows = r.metrics["estimate"], []
    ds = est.get("deepspeed") or {}
    for s in est["stages"]:
        series = f"stage {s['stage']}"
        vals = {**s["parts"], "allocator_extra": s["peak_reserved"] - s["live_peak"]}
        for part in PARTS:
            rows.append({"figure": FIGURE, "series": series, "x_name": "part", "x_value": part,
                         "y_name": "bytes_per_gpu", "y_value": round(vals[part] / GB, 4),
                         "unit": "GB", "kind": "simulated"})
        extra = {"table1_model_states": (s["table1"], "analytic"),
                 "peak_reserved": (s["peak_reserved"], "simulated"),
                 "capacity": (s["capacity"], "simulated")}
        if str(s["stage"]) in ds:
            extra["deepspeed_estimator"] = (ds[str(s["stage"])], "analytic")
        if s["stage"] == 3:  # the runtime's own peak of gathered units (its ledger)
            extra["gathered_runtime_ledger"] = (s.get("gathered_ledger", 0), "simulated")
        for name, (v, kind) in extra.items():
            rows.append({"figure": FIGURE, "series": series, "x_name": "part", "x_value": name,
                         "y_name": "bytes_per_gpu", "y_value": round(v / GB, 4), "unit": "GB",
                         "kind": kind})
        for name, v in (("fits", int(s["fits"])), ("max_batch", s["max_batch"]),
                        ("step_s", s["perf"].get("step_s")),
                        ("tokens_per_s", s["perf"].get("tokens_per_s")),
                        ("mfu", s["perf"].get("mfu")),
                        ("tokens_per_s_at_max_batch", s["perf_max"].get("tokens_per_s"))):
            if v is not None:
                rows.append({"figure": f"{FIGURE}_stages", "series": series,
                             "x_name": "quantity", "x_value": name, "y_name": name,
                             "y_value": round(float(v), 6), "unit": "", "kind": "simulated"})
    bw = r.metrics.get("bandwidth") or {}
    for stage, times in bw.items():
        for g, t in zip(r.params["bandwidths_gbps"], times):
            rows.append({"figure": f"{FIGURE}_network", "series": f"stage {stage}",
                         "x_name": "inter_node_gbps", "x_value": g, "y_name": "step_s",
                         "y_value": round(t, 5), "unit": "s", "kind": "simulated"})
    rec = est["recommendation"]
    rows.append({"figure": f"{FIGURE}_stages", "series": "recommendation",
                 "x_name": "quantity", "x_value": "stage", "y_name": "recommended_stage",
                 "y_value": -1 if rec[0] is None else rec[0], "unit": "", "kind": "simulated",
                 "title": _title(est)})
    return rows


def _title(est: dict) -> str:
    m, c = est["model"], est["cluster"]
    return (f"{m['name']} ({m['params'] / 1e9:.2f}B) on {est['world_size']} x "
            f"{c['device_bytes'] / GB:.0f} GB ({c['name']}), TP {est['tp']}, micro-batch "
            f"{est['batch']} x {est['seq']}, {est['dtype']}, ZeRO-R {est['zero_r']}")


def plot(table, out_dir: str) -> list[str]:
    """Left: per-GPU memory by part for each stage (stacked; the device capacity as a line,
    Table 1's closed form and DeepSpeed's estimator as ticks; verdict and largest micro-batch
    above each bar). Right: step time per stage against the inter-node bandwidth (log axis),
    dashed where the stage does not fit the requested micro-batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mem = table[table["figure"] == FIGURE]
    if mem.empty:
        return []
    stg = table[table["figure"] == f"{FIGURE}_stages"]
    net = table[table["figure"] == f"{FIGURE}_network"]
    series = sorted(set(mem["series"]))
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12.5, 5.4),
                                 gridspec_kw={"width_ratios": [1.1, 1]})
    colours = dict(zip(PARTS, ("C0", "C9", "C2", "C1", "C7", "C3")))
    labels = {"model_states": "model states (own shards)",
              "gathered_params": "gathered parameters (stage 3)",
              "buffers": "buffers (C_B buckets, gather)",
              "activations": "activations (checkpoints, working layer, logits)",
              "other": "other (step transients)",
              "allocator_extra": "allocator's extra (rounding, fragmentation)"}

    def val(s, part, frame=mem):
        row = frame[(frame["series"] == s) & (frame["x_value"] == part)]
        return float(row["y_value"].iloc[0]) if len(row) else None

    cap, labelled = None, set()
    for i, s in enumerate(series):
        bottom = 0.0
        for part in PARTS:
            v = val(s, part) or 0.0
            ax.bar(i, v, 0.6, bottom=bottom, color=colours[part],
                   label=labels[part] if i == 0 else None)
            bottom += v
        cap = val(s, "capacity")
        for key, style, lab in (("table1_model_states", dict(color="black", lw=2),
                                 "Table 1 closed form (model states)"),
                                ("deepspeed_estimator", dict(color="m", lw=2, ls="--"),
                                 "DeepSpeed's estimator (model states)")):
            v = val(s, key)
            if v is not None:
                ax.plot([i - 0.38, i + 0.38], [v, v], **style,
                        label=None if key in labelled else lab)
                labelled.add(key)
        fits, mb = val(s, "fits", stg), val(s, "max_batch", stg)
        ax.annotate(("fits" if fits else "OOM") + f"\nmax micro-batch {int(mb or 0)}",
                    (i, bottom), ha="center", va="bottom", fontsize=8, xytext=(0, 3),
                    textcoords="offset points")
    if cap:
        ax.axhline(cap, color="0.3", ls=":", lw=1.2, label=f"device, {cap:.0f} GB")
    top = max(float(mem["y_value"].max()), cap or 0)
    ax.set_ylim(0, top * 1.25)
    ax.set_xticks(range(len(series)), series)
    ax.set_ylabel("memory per GPU at its peak (GB = 1e9 bytes)")
    ax.legend(fontsize=7, loc="upper right")
    ax.grid(True, axis="y", alpha=0.3)
    ax.set_title("Per-GPU memory by stage (dry run + caching-allocator replay)", fontsize=9)
    for s in sorted(set(net["series"])):
        rows = net[net["series"] == s].sort_values("x_value")
        fits = val(s, "fits", stg)
        bx.plot(rows["x_value"].astype(float), rows["y_value"].astype(float), marker="o",
                ms=3, ls="-" if fits else "--", label=s + ("" if fits else " (does not fit)"))
    bx.set_xscale("log")
    bx.set_yscale("log")
    bx.set_xlabel("inter-node bandwidth per node (Gbit/s; 1 = Gigabit Ethernet)")
    bx.set_ylabel("step time at the requested micro-batch (s)")
    bx.grid(True, which="both", alpha=0.3)
    bx.legend(fontsize=8)
    bx.set_title("Step time against the network (performance model)", fontsize=9)
    title = stg[stg["series"] == "recommendation"]
    rec = int(title["y_value"].iloc[0]) if len(title) else -1
    fig.suptitle(((title["title"].iloc[0] if len(title) and "title" in title else "") +
                  (f" -- recommended: stage {rec}" if rec >= 0 else " -- no stage fits")
                  + "  (simulated)"), fontsize=9.5)
    g3 = val("stage 3", "gathered_runtime_ledger")
    if g3 is not None and (val("stage 3", "gathered_params") or 0) > g3:
        fig.text(0.01, 0.01, f"Stage 3's gathered parameters as the dry run traces them: its "
                 f"tracer keeps the units the runtime releases alive (the runtime's own peak "
                 f"of gathered units: {g3:.2f} GB); see results/estimate/notes.md.",
                 fontsize=7, color="0.3")
    fig.tight_layout(rect=(0, 0.03, 1, 0.95))
    return save_figure(fig, out_dir, FIGURE, dpi=150)
