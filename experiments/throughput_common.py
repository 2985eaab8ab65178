"""Shared planning, running and summarising of the throughput figures (paper §10.2-10.5:
Figure 2 model size, Figure 3 super-linear scaling, Figure 4 ZeRO-DP only, Figure 8 C1-C5).

Three kinds of points, always labelled (``kind`` column):

* ``simulated`` at paper scale: the paper's setups (Tables 5, 6, 9, 10 via
  ``zero_repro.simulate.paper_setups``) through the calibrated performance model
  (``zero_repro.simulate.calibrate``: 3 parameters fitted ONLY on Figure 2's ZeRO series, on the
  paper's DGX-2 V100 cluster). Throughput per GPU = F/MP / T with F the Megatron FLOPs of one
  iteration (96·B·s·l·h²·(1 + s/6h + V/16lh), recompute counted) and T = compute + exposed
  TP/DP/P_a/offload communication (``perf_model.step_time``).
* ``measured`` at paper scale: with a GPU cluster (``cluster.device=cuda``) the same setups are
  planned as real points for ``zero_repro.worker.run_training`` (each its own Slurm job under
  ``launcher=slurm``).
* ``measured`` locally: a scaled-down analogue on CPU ranks (gloo), defined by each figure's
  module; the ``hardware`` column says what it ran on.

A ``calibration`` point writes the fitted values and the fit error to ``results/calibration/``
(the one file side effect of a run_point here: the calibration is shared by the four figures).
Batch per GPU: ``experiment.params.batch=paper`` (Tables 5-10) or ``max_fit`` (the largest that
fits the device according to the memory dry run when available, else the analytic model).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from functools import lru_cache
from pathlib import Path

from zero_repro.harness.figures import save_figure
from zero_repro.harness.points import Point

log = logging.getLogger(__name__)

Y_NAME, UNIT = "throughput_per_gpu", "TFLOPs/GPU"
AGG_NAME, AGG_UNIT = "aggregate_throughput", "TFLOPs"
X_NAME = {"fig2": "model_size_B", "fig3": "num_gpus", "fig4": "model_size_B",
          "fig8": "zero_config"}
CONF = Path(__file__).resolve().parents[1] / "conf"

DEFAULTS = {
    "sim_cluster": "dgx2_v100",  # the paper's cluster: calibration and simulation
    "use_fig3": False,  # calibrate on Figure 2 only (Figure 3 stays a prediction)
    "batch": "paper",  # paper | max_fit (paper-scale points)
    "max_fit_judge": "auto",  # auto (dry run if present) | dryrun | analytic
    "cluster_steps": 8, "cluster_warmup": 3, "cluster_dtype": "fp16",
    "reduce_bucket": 500_000_000, "allgather_bucket": 200_000_000,  # C_B, elements
    "local_batch": 4,  # int, or max_fit (analytic model, pretend device of local_device_mb)
    "local_device_mb": 180, "local_max_batch": 8,
}
# Figure 4's baseline is PyTorch DDP, which overlaps its bucketed all-reduce with backward
# (must match calibrate.predict_fig4; a test checks the two agree)
OVERLAP = {"fig4": lambda s: s.series == "Baseline"}


def params(cfg) -> dict:
    return {**DEFAULTS, **dict(cfg.experiment.params or {})}


# --------------------------------------------------------------------------- calibration
@lru_cache(maxsize=4)
def calibration(cluster: str = "dgx2_v100", use_fig3: bool = False):
    from zero_repro.simulate import calibrate

    return calibrate.fit(cluster=cluster, use_fig3=use_fig3)


def calibration_summary(cal) -> dict:
    from zero_repro.simulate import calibrate

    errs = calibrate.errors_vs_paper(cal)
    worst = {k: max(abs(r["rel_err"]) for r in v) for k, v in errs.items() if v}
    return {"cluster": cal.cluster, "fitted_on": cal.targets, "n_free": cal.n_free,
            "params": dataclasses.asdict(cal.params), "objective": cal.objective,
            "max_abs_rel_err": worst, "residuals": errs}


def write_calibration(cal, results_dir: str) -> list[str]:
    """results/calibration/<cluster>_<targets>.json and .csv: fitted values, fit error, and the
    prediction errors of the unfitted series (Fig 2 baseline, Fig 3)."""
    import pandas as pd

    out = os.path.join(results_dir, "calibration")
    os.makedirs(out, exist_ok=True)
    summ = calibration_summary(cal)
    stem = os.path.join(out, f"{cal.cluster}_{'+'.join(t.split()[0] for t in cal.targets)}")
    with open(stem + ".json.tmp", "w") as f:
        json.dump(summ, f, indent=1)
    os.replace(stem + ".json.tmp", stem + ".json")
    rows = [{"series": k, "fitted": k in ("fig2_zero",) or (k == "fig3" and len(cal.targets) > 1),
             **r} for k, v in summ["residuals"].items() for r in v]
    pd.DataFrame(rows).to_csv(stem + ".csv", index=False)
    return [stem + ".json", stem + ".csv"]


# ----------------------------------------------------------------- paper setups -> configs
def setups(figure: str):
    from zero_repro.simulate.paper_setups import setups as _setups

    return _setups(figure)


def find_setup(figure: str, label: str, series: str):
    for s in setups(figure):
        if s.point == label and s.series == series:
            return s
    raise ValueError(f"no setup {label!r} ({series}) in {figure}")


def hardware_of(cluster_cfg):
    from zero_repro.simulate.hardware import Hardware

    return Hardware.from_config(cluster_cfg)


def zero_config_of(s, hw) -> str:
    """'C1'..'C5' or 'baseline' (ZeRO points without a stated C: see calibrate.zero_config_for)."""
    from zero_repro.simulate.calibrate import zero_config_for

    return zero_config_for(s, hw)


def zero_overrides(zc: str) -> dict:
    """zero.* / zero_r.* for a Table 3 configuration or the Megatron/DDP baseline (stage 0,
    activation checkpointing as Megatron-LM did, no ZeRO-R)."""
    if zc == "baseline":
        return {"zero.stage": 0, "zero_r.name": "custom", "zero_r.activation_checkpointing": True,
                "zero_r.partition_activations": False, "zero_r.cpu_checkpointing": False,
                "zero_r.constant_buffers": False, "zero_r.contiguous_memory": False}
    from zero_repro.zero_r.configs import TABLE3, zero_r_config

    zr = dataclasses.asdict(zero_r_config(zc.lower()))
    return {"zero.stage": TABLE3[zc.lower()].stage, **{f"zero_r.{k}": v for k, v in zr.items()}}


@lru_cache(maxsize=None)
def _model_files() -> dict:
    from omegaconf import OmegaConf

    out = {}
    for p in sorted((CONF / "model").glob("*.yaml")):
        d = OmegaConf.to_container(OmegaConf.load(p))
        d.pop("defaults", None)
        out[p.stem] = d
    return out


def model_conf(name: str) -> dict:
    """The fields of conf/model/<name>.yaml (for local points' overrides)."""
    try:
        return dict(_model_files()[name])
    except KeyError:
        raise ValueError(f"no conf/model/{name}.yaml; choose one of {sorted(_model_files())}")


def model_overrides_for_setup(s) -> dict:
    """model.* of a paper setup, named after its conf/model file when there is one."""
    name = next((n for n, d in _model_files().items()
                 if d.get("n_layer") == s.n_layer and d.get("n_embd") == s.hidden
                 and d.get("seq_len") == 1024), f"paper_{s.n_layer}x{s.hidden}")
    return {"model.name": name, "model.n_layer": s.n_layer, "model.n_embd": s.hidden,
            "model.n_head": s.heads, "model.seq_len": 1024, "model.vocab_size": 50257,
            "model.vocab_pad_multiple": 128, "model.nominal": s.size_label}


def _local_model_overrides(name: str) -> dict:
    return {f"model.{k}": v for k, v in model_conf(name).items()}


def paper_overrides(s, zc: str, batch: int, p: dict) -> dict:
    return {**model_overrides_for_setup(s), "parallel.world_size": s.gpus, "parallel.tp": s.mp,
            "train.micro_batch_size": int(batch), **zero_overrides(zc),
            "zero.reduce_bucket_size": int(p["reduce_bucket"]),
            "zero.allgather_bucket_size": int(p["allgather_bucket"])}


def cluster_overrides(name: str) -> dict:
    from zero_repro.simulate.hardware import load_cluster

    return {f"cluster.{k}": v for k, v in dataclasses.asdict(load_cluster(name)).items()}


# ------------------------------------------------------------------------------- batch
def largest_true(pred, hi: int = 1024) -> int:
    """Largest b in [1, hi] with pred(b) (pred monotone: true then false); 0 if none."""
    if not pred(1):
        return 0
    lo, up = 1, 2
    while up <= hi and pred(up):
        lo, up = up, up * 2
    up = min(up, hi + 1)
    while up - lo > 1:
        mid = (lo + up) // 2
        lo, up = (mid, up) if pred(mid) else (lo, mid)
    return lo


def _analytic_fits(device_bytes, s, zc, p):
    from zero_repro.measure.analytic import fits

    return lambda b: fits(device_bytes, s.n_layer, s.hidden, s.heads, s.mp, s.dp, b, zc,
                          reduce_bucket=int(p["reduce_bucket"]),
                          allgather_bucket=int(p["allgather_bucket"]))


def _dryrun_available() -> bool:
    try:
        from zero_repro.simulate import dryrun
    except Exception:  # noqa: BLE001 - absent or broken: fall back to the analytic model
        return False
    return hasattr(dryrun, "dry_run_subprocess")


@lru_cache(maxsize=None)
def _dryrun_fits(cfg_json: str, batch: int, capacity: float) -> bool:
    from zero_repro import config as C
    from zero_repro.simulate import dryrun
    from omegaconf import OmegaConf

    cfg = C.to_config(OmegaConf.create(json.loads(cfg_json)))
    cfg.train.micro_batch_size = batch
    r = dryrun.dry_run_subprocess(cfg, iterations=2, allocator_capacity=capacity)
    return not r.allocator.get("oom") and r.allocator.get("peak_reserved", 0) <= capacity


def max_fit_batch(s, zc: str, cluster_cfg, p: dict, base_cfg=None) -> tuple[int, str]:
    """Largest batch per GPU that fits ``cluster_cfg``'s device for setup ``s`` under ``zc``.

    The analytic model gives the answer directly; with the dry run (judge auto/dryrun and a
    ``base_cfg`` to run) that answer only seeds the search, the dry run decides."""
    hw = hardware_of(cluster_cfg)
    analytic = _analytic_fits(hw.device_bytes, s, zc, p)
    judge = p["max_fit_judge"]
    if base_cfg is None or judge == "analytic" or (judge == "auto" and not _dryrun_available()):
        return largest_true(analytic), "max_fit (analytic memory model)"
    from zero_repro.harness import sweep as orchestrate
    from zero_repro import config as C

    pcfg = orchestrate.point_config(base_cfg, {**paper_overrides(s, zc, 1, p),
                                               "zero.dtype": p["cluster_dtype"]})
    blob = json.dumps(C.summary(pcfg), sort_keys=True, default=str)
    seed = max(1, largest_true(analytic))

    def dry(b: int) -> bool:
        return _dryrun_fits(blob, b, hw.device_bytes)

    if dry(seed):  # walk up from the analytic answer
        b = seed
        while b < 1024 and dry(b + max(1, b // 8)):
            b += max(1, b // 8)
        return b, "max_fit (memory dry run)"
    return largest_true(lambda b: b <= seed and dry(b), hi=seed), "max_fit (memory dry run)"


def local_batch(model: str, world: int, tp: int, zc: str, p: dict) -> tuple[int, str]:
    """Per-rank batch of a local point: ``local_batch`` as given, or the largest that fits a
    pretend device of ``local_device_mb`` by the analytic model (capped by local_max_batch)."""
    if str(p["local_batch"]) != "max_fit":
        return int(p["local_batch"]), "fixed"
    from zero_repro.measure.analytic import fits

    m = model_conf(model)
    cap = float(p["local_device_mb"]) * 1e6
    pred = lambda b: fits(cap, m["n_layer"], m["n_embd"], m["n_head"], tp, world // tp, b, zc,  # noqa: E731
                          seq=m["seq_len"], vocab=m["vocab_size"])
    b = largest_true(pred, hi=int(p["local_max_batch"]))
    if b == 0:
        raise ValueError(f"local model {model} does not fit experiment.params.local_device_mb="
                         f"{p['local_device_mb']} even at batch 1: raise it")
    return b, f"max_fit (analytic, pretend {p['local_device_mb']} MB device)"


# ------------------------------------------------------------------------------ planning
def calibration_point(cfg) -> Point:
    p = params(cfg)
    return Point(name="calibration", mode="simulated",
                 params={"role": "calibration", "cluster": p["sim_cluster"],
                         "use_fig3": bool(p["use_fig3"])})


def paper_batch(s, zc, cluster_cfg, p, base_cfg=None) -> tuple[int, str]:
    if p["batch"] == "paper":
        return s.batch_per_gpu, "paper (Tables 5-10)"
    if p["batch"] != "max_fit":
        raise ValueError(f"experiment.params.batch={p['batch']!r}: use paper or max_fit")
    b, src = max_fit_batch(s, zc, cluster_cfg, p, base_cfg)
    if b == 0:  # not even one sample fits: run batch 1 and let the record say oom
        return 1, src + ": nothing fits, batch 1 (expect oom)"
    return b, src


def simulated_points(cfg, figure: str) -> list[Point]:
    """One simulated point per paper setup of ``figure`` on the paper's cluster."""
    from zero_repro.simulate.hardware import load_cluster

    p = params(cfg)
    ccfg = load_cluster(p["sim_cluster"])
    hw = hardware_of(ccfg)
    out = []
    for s in setups(figure):
        zc = zero_config_of(s, hw)
        # max_fit here uses the analytic model: a dry-run search per simulated point would
        # make planning take minutes (the measured cluster points use the dry run)
        b, src = paper_batch(s, zc, ccfg, dict(p, max_fit_judge="analytic"))
        out.append(Point(
            name=f"sim {s.point}" + (" Baseline" if s.series == "Baseline" and "Baseline" not in s.point else ""),
            mode="simulated",
            params={"role": "simulated", "figure": figure, "setup": s.point, "series": s.series,
                    "zero_config": zc, "batch": b, "batch_source": src,
                    "sim_cluster": p["sim_cluster"], "use_fig3": bool(p["use_fig3"])},
            overrides={**paper_overrides(s, zc, b, p), **cluster_overrides(p["sim_cluster"])}))
    return out


def cluster_points(cfg, figure: str) -> list[Point]:
    """The paper's setups as real measured points on ``cfg.cluster`` (a GPU cluster)."""
    p = params(cfg)
    hw = hardware_of(cfg.cluster)
    out = []
    for s in setups(figure):
        zc = zero_config_of(s, hw)
        b, src = paper_batch(s, zc, cfg.cluster, p, base_cfg=cfg)
        if s.mp > cfg.cluster.gpus_per_node:
            log.warning("%s: MP %d spans nodes of %d GPUs on %s", s.point, s.mp,
                        cfg.cluster.gpus_per_node, cfg.cluster.name)
        ov = {**paper_overrides(s, zc, b, p), "zero.dtype": p["cluster_dtype"],
              "train.steps": int(p["cluster_steps"]),
              "train.warmup_steps": int(p["cluster_warmup"])}
        out.append(Point(name=f"{s.point}" + (" Baseline" if s.series == "Baseline" and "Baseline" not in s.point else ""),
                         mode="measured",
                         params={"role": "measured_paper", "figure": figure, "setup": s.point,
                                 "series": s.series, "zero_config": zc, "batch": b,
                                 "batch_source": src},
                         overrides=ov))
    return out


def local_point(figure: str, name: str, model: str, world: int, tp: int, zc: str, p: dict,
                **extra) -> Point:
    b, src = local_batch(model, world, tp, zc, p)
    ov = {**_local_model_overrides(model), "parallel.world_size": world, "parallel.tp": tp,
          "train.micro_batch_size": b, **zero_overrides(zc)}
    return Point(name=name, mode="measured",
                 params={"role": "measured_local", "figure": figure, "model": model,
                         "world_size": world, "tp": tp, "zero_config": zc, "batch": b,
                         "batch_source": src, **extra},
                 overrides=ov)


def plan_points(cfg, figure: str, local_fn) -> list[Point]:
    """calibration + simulated paper-scale points + (cluster measured | local measured)."""
    pts = [calibration_point(cfg)] + simulated_points(cfg, figure)
    if cfg.cluster.device == "cuda":
        return pts + cluster_points(cfg, figure)
    return pts + local_fn(cfg, params(cfg))


# ------------------------------------------------------------------------------- running
def simulate(figure: str, label: str, series: str, batch: int, sim_cluster: str,
             use_fig3: bool = False) -> dict:
    """The calibrated model's prediction for one paper setup, with the inputs behind it."""
    from zero_repro.simulate.calibrate import workload_for
    from zero_repro.simulate.hardware import hardware
    from zero_repro.simulate.perf_model import step_time

    cal = calibration(sim_cluster, use_fig3)
    hw = hardware(sim_cluster)
    s = find_setup(figure, label, series)
    w = workload_for(s, hw, batch_per_gpu=int(batch),
                     overlap_comm=OVERLAP.get(figure, lambda _: False)(s))
    bd = step_time(w, hw, cal.params)
    return {"tflops_per_gpu": bd["tflops_per_gpu"],
            "aggregate_tflops": bd["tflops_per_gpu"] * s.gpus,
            "step_time_s": bd["total"], "breakdown_s": {k: v for k, v in bd.items()
                                                        if k != "tflops_per_gpu"},
            "workload": dataclasses.asdict(w), "perf_params": dataclasses.asdict(cal.params),
            "calibrated_on": cal.targets, "sim_cluster": sim_cluster}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def run_point(cfg, point: Point) -> dict:
    role = point.params.get("role")
    if role == "calibration":
        cal = calibration(point.params["cluster"], bool(point.params.get("use_fig3")))
        summ = calibration_summary(cal)
        summ["files"] = write_calibration(cal, cfg.experiment.results_dir)
        return summ
    if role == "simulated":
        q = point.params
        return simulate(q["figure"], q["setup"], q["series"], q["batch"], q["sim_cluster"],
                        bool(q.get("use_fig3")))
    from zero_repro.worker import run_training  # heavy (torch): only when a point runs

    result = run_training(cfg, point.run_dir)
    m = result.setdefault("metrics", {})
    m["aggregate_tflops"] = m["tflops_per_gpu"] * cfg.parallel.world_size
    hw = result.setdefault("hardware", {})
    if hw.get("device") == "cpu":
        hw["cpu_model"] = cpu_model()
    return result


# ----------------------------------------------------------------------------- summarising
def hardware_label(rec) -> str:
    """What a record ran on, for the table's ``hardware`` column."""
    if rec.mode == "simulated":
        c = rec.config.get("cluster", {})
        return f"simulated: {c.get('name', '?')} ({c.get('description', '')})"
    hw, topo = rec.hardware or {}, rec.topology or {}
    world = topo.get("world_size", "?")
    if hw.get("device") == "cpu" or rec.config.get("cluster", {}).get("device") == "cpu":
        cpu = hw.get("cpu_model") or hw.get("device_name", "cpu")
        return (f"measured: CPU ranks x {hw.get('threads_per_rank', '?')} thread, gloo, {cpu}, "
                f"{hw.get('cpu_count', '?')} cores, torch {hw.get('torch', '?')}")
    return (f"measured: {world} x {hw.get('device_name', 'GPU')}, "
            f"{topo.get('nodes', '?')} node(s), torch {hw.get('torch', '?')}")


def base_row(rec, figure: str, series: str, x, y, y_name=Y_NAME, unit=UNIT) -> dict:
    q = rec.params
    return {"figure": figure, "series": series, "x_name": X_NAME[figure], "x_value": x,
            "y_name": y_name, "y_value": y, "unit": unit, "kind": rec.mode,
            "hardware": hardware_label(rec), "point": rec.point,
            "num_gpus": rec.topology.get("world_size"), "mp": rec.topology.get("tp"),
            "batch_per_gpu": q.get("batch"), "batch_source": q.get("batch_source", ""),
            "zero_config": q.get("zero_config", "")}


def sim_inputs(rec) -> dict:
    """The inputs and the time breakdown behind a simulated value (predictions.csv)."""
    m = rec.metrics
    w, pp, bd = m.get("workload", {}), m.get("perf_params", {}), m.get("breakdown_s", {})
    return {**{f"w_{k}": w.get(k) for k in ("n_layer", "hidden", "heads", "gpus", "mp",
                                            "batch_per_gpu", "stage", "checkpointing", "p_a",
                                            "p_a_cpu", "overlap_comm")},
            **{f"t_{k}_s": v for k, v in bd.items()}, **pp}


def ok_records(records, role: str | None = None) -> list:
    return [r for r in records if r.status == "ok"
            and (role is None or r.params.get("role") == role)]


def paper_scale_rows(records, figure: str, series_of, x_of) -> list[dict]:
    """Rows of the simulated and cluster-measured paper-scale points."""
    rows = []
    for r in ok_records(records):
        if r.params.get("role") not in ("simulated", "measured_paper"):
            continue
        if r.params.get("figure") != figure:
            continue
        s = find_setup(figure, r.params["setup"], r.params["series"])
        row = base_row(r, figure, series_of(s), x_of(s), r.metrics["tflops_per_gpu"])
        if r.mode == "simulated":
            row.update(sim_inputs(r))
        rows.append(row)
    return rows


def write_predictions(table, out_dir: str) -> str | None:
    """predictions.csv: the simulated paper-scale rows with the inputs that produced them."""
    sim = table[(table["kind"] == "simulated") & (table["y_name"] == Y_NAME)]
    if not len(sim):
        return None
    path = os.path.join(out_dir, "predictions.csv")
    sim.dropna(axis=1, how="all").to_csv(path, index=False)
    return path


# -------------------------------------------------------------------------------- plotting
def label(series: str, kind: str, width: int = 48) -> str:
    s = series if len(series) <= width else series[:width - 1] + "…"
    return f"{s} [{kind}]"


def _mean_err(df) -> str:
    import pandas as pd

    if "rel_error_vs_paper" not in df:
        return ""
    e = pd.to_numeric(df["rel_error_vs_paper"], errors="coerce").abs()
    return f"  mean |err| vs paper {100 * e.mean():.1f}%" if e.notna().any() else ""


def draw_bars(ax, df, xs: list, ylabel: str = f"{Y_NAME} [{UNIT}]") -> None:
    """Grouped bars: one group per x in ``xs`` (categorical), one bar per (series, kind)."""
    groups = list(dict.fromkeys(zip(df["series"], df["kind"])))
    colors = {s: f"C{i % 10}" for i, s in enumerate(dict.fromkeys(df["series"]))}
    width = 0.8 / max(1, len(groups))
    hatch = {"paper": "//", "simulated": "", "measured": "..", "analytic": "xx"}
    for i, (series, kind) in enumerate(groups):
        g = df[(df["series"] == series) & (df["kind"] == kind)]
        pos = [xs.index(x) + (i - (len(groups) - 1) / 2) * width for x in g["x_value"]]
        ax.bar(pos, g["y_value"].astype(float), width, label=label(series, kind),
               hatch=hatch.get(kind, ""), edgecolor="black", linewidth=0.5, color=colors[series])
    ax.set_xticks(range(len(xs)), [str(x) for x in xs])
    ax.set_ylabel(ylabel)
    ax.grid(True, axis="y", alpha=0.3)


def draw_lines(ax, df, logx: bool = False) -> None:
    """Lines over a numeric x: one per (series, kind); paper values as X markers."""
    import pandas as pd

    from zero_repro.harness.regenerate import LINESTYLES, MARKERS

    xnum = pd.to_numeric(df["x_value"], errors="coerce")
    for _, r in df[xnum.isna()].iterrows():  # the paper's reference lines (x = "all")
        ax.axhline(float(r["y_value"]), color="gray", linewidth=0.8, linestyle="-.")
        ax.annotate(str(r["series"]), (0.01, float(r["y_value"])), fontsize=6,
                    xycoords=("axes fraction", "data"), va="bottom", color="gray")
    df = df[xnum.notna()].assign(_x=xnum[xnum.notna()])
    colors = {s: f"C{i % 10}" for i, s in enumerate(dict.fromkeys(df["series"]))}
    for (series, kind), g in df.groupby(["series", "kind"], sort=False):
        g = g.sort_values("_x")
        ax.plot(g["_x"], g["y_value"].astype(float), marker=MARKERS.get(kind, "o"),
                linestyle=LINESTYLES.get(kind, "-"), color=colors[series],
                markersize=9 if kind == "paper" else 5, label=label(series, kind))
    if logx:
        ax.set_xscale("log", base=2)
    ax.grid(True, alpha=0.3)


def save(fig, out_dir: str, name: str) -> list[str]:
    fig.tight_layout()
    paths = save_figure(fig, out_dir, name, dpi=130)
    return paths


def split(table):
    """(paper-scale rows incl. paper overlay, local measured rows) of a throughput table."""
    local = table["hardware"].fillna("").str.contains("CPU rank") if "hardware" in table else (
        table["kind"] == "__none__")
    return table[~local], table[local]


def local_title(local) -> str:
    hw = next((h for h in local.get("hardware", []) if isinstance(h, str) and h), "")
    return "local scaled-down analogue (measured)\n" + hw.replace("measured: ", "")[:90]


def plot_standard(table, out_dir: str, name: str, title: str, categorical: bool) -> list[str]:
    """Paper-scale panel (simulated + paper overlay + cluster-measured) and local panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    write_predictions(table, out_dir)
    big, local = split(table)
    big, local = big[big["y_name"] == Y_NAME], local[local["y_name"] == Y_NAME]
    n = 1 + bool(len(local))
    fig, axes = plt.subplots(1, n, figsize=(7.5 * n, 5.2), squeeze=False)
    ax = axes[0][0]
    if categorical:
        draw_bars(ax, big, list(dict.fromkeys(big["x_value"])))
    else:
        draw_lines(ax, big, logx=True)
        ax.set_ylim(bottom=0)
        ax.set_ylabel(f"{Y_NAME} [{UNIT}]")
    ax.set_xlabel(big["x_name"].iloc[0] if len(big) else "")
    ax.set_title(title + _mean_err(big), fontsize=9)
    ax.legend(fontsize=6, loc="best")
    if len(local):
        ax = axes[0][1]
        local = local.assign(x_value=[f"{x:.4g}" if isinstance(x, float) else str(x)
                                      for x in local["x_value"]])
        draw_bars(ax, local, list(dict.fromkeys(local["x_value"])))
        ax.set_xlabel(local["x_name"].iloc[0])
        ax.set_title(local_title(local), fontsize=9)
        ax.legend(fontsize=6, loc="best")
    return save(fig, out_dir, name)
