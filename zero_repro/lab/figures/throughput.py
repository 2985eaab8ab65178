"""Planning and running the points of the throughput figures (paper §10.2-10.5: Figure 2 model
size, Figure 3 super-linear scaling, Figure 4 ZeRO-DP only, Figure 8 C1-C5).

Three kinds of points, always labelled (``kind`` column):

* ``simulated`` at paper scale: the paper's setups (Tables 5, 6, 9, 10 via
  ``zero_repro.scale.paper.setups``) through the calibrated performance model
  (``zero_repro.scale.calibrate``: 2 parameters fitted ONLY on Figure 2's ZeRO series, on the
  paper's DGX-2 V100 cluster). Throughput per GPU = F/tp / T with F the Megatron FLOPs of one
  iteration (96·B·s·l·h²·(1 + s/6h + V/16lh), recompute counted) and T = compute + exposed
  TP/DP/P_a/offload communication (``perf_model.step_time``).
* ``measured`` at paper scale: with a GPU cluster (``cluster.device=cuda``) the same setups are
  planned as real points for ``zero_repro.lab.launcher.run_training`` (each its own Slurm job under
  ``launcher=slurm``).
* ``measured`` locally: a scaled-down analogue on CPU ranks (gloo), defined by each figure's
  module; the ``hardware`` column says what it ran on.

A ``calibration`` point writes the fitted values and the fit error to ``results/calibration/``
(``calibrate.write_calibration``; the one file side effect of a run_point here: the calibration
is shared by the four figures).

Batch per GPU of the simulated points, one series each (``experiment.params.batch_series``):
``max_fit`` -- the predicted batch: the largest on ``maxsize.BATCH_GRID`` whose memory dry run
under ``max_fit_stack`` (paper2020: the 2020 DeepSpeed + Megatron stack) fits the simulated
cluster's device (``maxsize.max_batch``); a ZeRO point whose configuration the paper does not
state runs the fastest of ``unstated_configs`` (C4, C5 when MP > 1; C3 at MP 1), each at its
own largest batch -- and ``paper``, the batch of the paper's Tables 5-10 (the "paper batch"
series). Cluster-measured points take ``experiment.params.batch`` (paper | max_fit).
"""
from __future__ import annotations

import dataclasses
import json
import logging
from functools import lru_cache

from omegaconf import OmegaConf

from zero_repro.lab.points import Point
from zero_repro import config as C
from zero_repro import schema
from zero_repro.lab import sweep
from zero_repro.scale.analytic import fits
from zero_repro.scale.paper.buckets import ALLGATHER_BUCKET, REDUCE_BUCKET
from zero_repro.scale.paper.clusters import PAPER_CLUSTER, cluster_overrides, load_cluster
from zero_repro.scale.paper.overrides import setup_overrides
from zero_repro.scale.paper import table9
from zero_repro.scale.paper.setups import PaperSetup
from zero_repro.scale.paper.setups import setups
from zero_repro.scale.paper.table3 import zero_overrides
from zero_repro.scale.dryrun import dryrun, maxsize
from zero_repro.scale.dryrun.dryrun import apply_overrides
from zero_repro.scale.dryrun.maxsize import capacity_of
from zero_repro.scale.paper.clusters import DRYRUN_FIELDS
from zero_repro.scale.calibrate import (
    calibration,
    calibration_summary,
    workload_for,
    write_calibration,
    zero_config_for,
)
from zero_repro.scale.hardware import Hardware, cpu_model
from zero_repro.scale.hardware import hardware
from zero_repro.scale.perf_model import compute_efficiency, step_time
from zero_repro.lab.launcher import run_training

log = logging.getLogger(__name__)

Y_NAME, UNIT = "throughput_per_gpu", "TFLOPs/GPU"
AGG_NAME, AGG_UNIT = "aggregate_throughput", "TFLOPs"
X_NAME = {"fig2": "model_size_B", "fig3": "num_gpus", "fig4": "model_size_B",
          "fig8": "zero_config"}

DEFAULTS = {
    "sim_cluster": PAPER_CLUSTER,  # the paper's cluster: calibration and simulation
    "use_fig3": False,  # calibrate on Figure 2 only (Figure 3 stays a prediction)
    "batch": "paper",  # paper | max_fit (cluster-measured paper-scale points)
    "max_fit_judge": "auto",  # auto (dry run if present) | dryrun | analytic
    # simulated points: one series per batch rule (module doc); their judge and stack
    "batch_series": ["max_fit", "paper"],
    "sim_judge": "dryrun",  # dryrun | analytic (the closed-form model: quick, for tests)
    "max_fit_stack": "paper2020",
    "unstated_configs": ["C4", "C5"],
    "cluster_steps": 8, "cluster_warmup": 3, "cluster_dtype": "fp16",
    "reduce_bucket": REDUCE_BUCKET, "allgather_bucket": ALLGATHER_BUCKET,  # C_B, elements
    "local": True,  # the local measured points (false: the simulated series alone)
    "local_batch": 4,  # int, or max_fit (analytic model, pretend device of local_device_mb)
    "local_device_mb": 180, "local_max_batch": 8, "local_base_batch": 4,
    "local_repeats": 1,  # each local point measured this often (interleaved: repeat-major)
}
# every experiment.params key the throughput figures read (cli.check_params)
PARAMS = (*DEFAULTS, "table9_order")
# Figure 4's baseline is PyTorch DDP, which overlaps its bucketed all-reduce with backward
# (must match calibrate.predict_fig4; a test checks the two agree)
OVERLAP = {"fig4": lambda s: s.series == "Baseline"}


def params(cfg) -> dict:
    return {**DEFAULTS, **dict(cfg.experiment.params or {})}


# ----------------------------------------------------------------- paper setups -> configs
def figure_setups(figure: str, p: dict | None = None) -> list[PaperSetup]:
    """The paper's setups of ``figure``; Figure 8's rows mapped to C1..C5 by
    ``experiment.params.table9_order`` (``paper.table9``: c1_to_c5 | table7)."""
    rows = setups(figure)
    if figure == "fig8":
        rows = table9.remap(rows, (p or {}).get("table9_order", table9.DEFAULT_ORDER))
    return rows


def order_params(figure: str, p: dict | None) -> dict:
    """A point's ``table9_order`` param: only for Figure 8 and only when not the default, so
    the keys of records made before the mapping was selectable stay valid."""
    order = (p or {}).get("table9_order", table9.DEFAULT_ORDER)
    return {"table9_order": order} if figure == "fig8" and order != table9.DEFAULT_ORDER else {}


def find_setup(figure: str, label: str, series: str, p: dict | None = None) -> PaperSetup:
    """The setup a point or record names, under the same Table 9 row mapping that planned it
    (``p``: the experiment's or the record's params; ``table9_order`` absent = the default)."""
    for s in figure_setups(figure, p):
        if s.point == label and s.series == series:
            return s
    raise ValueError(f"no setup {label!r} ({series}) in {figure}")


def zero_config_of(s: PaperSetup, hw: Hardware) -> str:
    """'C1'..'C5' or 'baseline' (ZeRO points without a stated C: see calibrate.zero_config_for)."""
    return zero_config_for(s, hw)


@lru_cache(maxsize=None)
def model_name_for_setup(s: PaperSetup) -> str:
    """The conf/model file of a paper setup's shape when there is one, else paper_<l>x<h>."""
    return next((n for n, d in schema.model_files().items()
                 if d.get("n_layer") == s.n_layer and d.get("n_embd") == s.hidden
                 and d.get("seq_len") == 1024), f"paper_{s.n_layer}x{s.hidden}")


def paper_point_overrides(s: PaperSetup, zc: str, batch: int, p: dict,
                          dtype: str | None = None) -> dict:
    """``paper.overrides.setup_overrides`` with this experiment's C_B bucket sizes, the model
    named after its conf/model file and the paper's size label; ``dtype`` None keeps the
    configured precision (simulated points: the performance model assumes fp16 anyway)."""
    return setup_overrides(s, zc, int(batch), dtype=dtype, name=model_name_for_setup(s),
                           nominal=s.size_label,
                           buckets={"zero.reduce_bucket_size": int(p["reduce_bucket"]),
                                    "zero.allgather_bucket_size": int(p["allgather_bucket"])})


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
    return lambda b: fits(device_bytes, s.n_layer, s.hidden, s.heads, s.tp, s.dp, b, zc,
                          reduce_bucket=int(p["reduce_bucket"]),
                          allgather_bucket=int(p["allgather_bucket"]))


@lru_cache(maxsize=None)
def _dryrun_fits(cfg_json: str, batch: int, capacity: float) -> bool:
    cfg = schema.to_config(OmegaConf.create(json.loads(cfg_json)))
    cfg.train.micro_batch_size = batch
    r = dryrun.dry_run_subprocess(cfg, iterations=2, allocator_capacity=capacity)
    return not r.allocator.get("oom") and r.allocator.get("peak_reserved", 0) <= capacity


def max_fit_batch(s, zc: str, cluster_cfg, p: dict, base_cfg=None) -> tuple[int, str]:
    """Largest batch per GPU that fits ``cluster_cfg``'s device for setup ``s`` under ``zc``.

    The analytic model gives the answer directly; with the dry run (judge auto/dryrun and a
    ``base_cfg`` to run) that answer only seeds the search, the dry run decides."""
    hw = Hardware.from_config(cluster_cfg)
    analytic = _analytic_fits(hw.device_bytes, s, zc, p)
    if base_cfg is None or p["max_fit_judge"] == "analytic":
        return largest_true(analytic), "max_fit (analytic memory model)"
    pcfg = sweep.point_config(base_cfg, paper_point_overrides(s, zc, 1, p,
                                                                    p["cluster_dtype"]))
    blob = json.dumps(schema.summary(pcfg), sort_keys=True, default=str)
    seed = max(1, largest_true(analytic))

    def dry(b: int) -> bool:
        return _dryrun_fits(blob, b, hw.device_bytes)

    if dry(seed):  # walk up from the analytic answer
        b = seed
        while b < 1024 and dry(b + max(1, b // 8)):
            b += max(1, b // 8)
        return b, "max_fit (memory dry run)"
    return largest_true(lambda b: b <= seed and dry(b), hi=seed), "max_fit (memory dry run)"


def _local_dryrun_config(model: str, world: int, tp: int, zc: str) -> C.Config:
    ov = {**{f"model.{k}": v for k, v in schema.model_conf(model).items()},
          "parallel.world_size": world, "parallel.tp": tp, **zero_overrides(zc)}
    return apply_overrides(C.Config(), ov)


@lru_cache(maxsize=None)
def local_budget(model: str, world: int, tp: int, zc: str, base_batch: int) -> int:
    """The per-rank memory budget of the local analogue: the capacity the memory dry run
    (this runtime, the allocator replay) says ``world`` ranks need at ``base_batch`` -- the
    reference point runs with its memory full, as the paper's smallest DP degree does."""
    cfg = _local_dryrun_config(model, world, tp, zc)
    res = maxsize.max_batch(cfg, capacity=float(1 << 50), seed=base_batch, grid=(base_batch,))
    return res.judgements[0].min_capacity


@lru_cache(maxsize=None)
def _local_max_batch(model: str, world: int, tp: int, zc: str, budget: int) -> int:
    cfg = _local_dryrun_config(model, world, tp, zc)
    return maxsize.max_batch(cfg, capacity=float(budget), seed=1).batch


@lru_cache(maxsize=None)
def local_max_layers(model: str, world: int, tp: int, zc: str, budget: int, batch: int) -> int:
    """Largest depth of ``model``'s shape (hidden, heads, vocabulary fixed) whose memory dry run
    (this runtime, the allocator replay) at ``batch`` per rank fits ``budget`` bytes per rank:
    the local form of "the largest model that trains" (``maxsize.max_layers``)."""
    cfg = _local_dryrun_config(model, world, tp, zc)
    cfg.train.micro_batch_size = batch
    return maxsize.max_layers(cfg, capacity=float(budget), parallel=False).n_layer


def local_batch(model: str, world: int, tp: int, zc: str, p: dict) -> tuple[int, str]:
    """Per-rank batch of a local point: ``local_batch`` as given; ``max_fit``: the largest that
    fits a pretend device of ``local_device_mb`` by the analytic model (capped by
    local_max_batch); ``max_fit_dryrun``: the largest on ``maxsize.BATCH_GRID`` whose memory
    dry run fits the per-rank budget ``local_budget`` of world ``local_worlds[0]`` at
    ``local_base_batch`` (the same judge as the paper-scale batches, scaled to this machine)."""
    if str(p["local_batch"]) == "max_fit_dryrun":
        ref = int(p.get("local_worlds", [1])[0])
        budget = local_budget(model, ref, tp, zc, int(p["local_base_batch"]))
        b = _local_max_batch(model, world, tp, zc, budget)
        if b == 0:
            raise ValueError(f"local model {model} at world {world} fits no batch in the "
                             f"budget of world {ref} at batch {p['local_base_batch']}")
        return b, (f"max_fit (memory dry run, budget {budget / 1e6:.0f} MB per rank = world "
                   f"{ref} at batch {p['local_base_batch']})")
    if str(p["local_batch"]) != "max_fit":
        return int(p["local_batch"]), "fixed"
    m = schema.model_conf(model)
    cap = float(p["local_device_mb"]) * 1e6

    def pred(b: int) -> bool:
        return fits(cap, m["n_layer"], m["n_embd"], m["n_head"], tp, world // tp, b, zc,
                    seq=m["seq_len"], vocab=m["vocab_size"])

    b = largest_true(pred, hi=int(p["local_max_batch"]))
    if b == 0:
        raise ValueError(f"local model {model} does not fit experiment.params.local_device_mb="
                         f"{p['local_device_mb']} even at batch 1: raise it")
    return b, f"max_fit (analytic, pretend {p['local_device_mb']} MB device)"


def paper_batch(s, zc, cluster_cfg, p, base_cfg=None) -> tuple[int, str]:
    if p["batch"] == "paper":
        return s.batch_per_gpu, "paper (Tables 5-10)"
    if p["batch"] != "max_fit":
        raise ValueError(f"experiment.params.batch={p['batch']!r}: use paper or max_fit")
    b, src = max_fit_batch(s, zc, cluster_cfg, p, base_cfg)
    if b == 0:  # not even one sample fits: run batch 1 and let the record say oom
        return 1, src + ": nothing fits, batch 1 (expect oom)"
    return b, src


# ------------------------------------------------------------------------------ planning
def calibration_point(cfg) -> Point:
    p = params(cfg)
    return Point(name="calibration", mode="simulated",
                 params={"role": "calibration", "cluster": p["sim_cluster"],
                         "use_fig3": bool(p["use_fig3"])})


def _point_name(s: PaperSetup, prefix: str = "") -> str:
    baseline = s.series == "Baseline" and "Baseline" not in s.point
    return f"{prefix}{s.point}" + (" Baseline" if baseline else "")


PAPER_BATCH = " (paper batch)"  # suffix of the series at the paper's batch


def candidate_configs(s: PaperSetup, hw: Hardware, p: dict) -> list[str]:
    """Configurations a predicted-batch point may run: the one the paper states, else (ZeRO,
    MP > 1) ``unstated_configs``; at MP 1 the configuration ``zero_config_of`` assumes."""
    if s.zero_config.startswith("C") or s.zero_config == "baseline" or s.tp == 1:
        return [zero_config_of(s, hw)]
    return [str(c) for c in p["unstated_configs"]]


def simulated_points(cfg, figure: str) -> list[Point]:
    """Per paper setup of ``figure`` on the paper's cluster, one simulated point per batch rule
    in ``batch_series`` (module doc)."""
    p = params(cfg)
    ccfg = load_cluster(p["sim_cluster"])
    hw = Hardware.from_config(ccfg)
    out = []
    for rule in p["batch_series"]:
        if rule not in ("max_fit", "paper"):
            raise ValueError(f"experiment.params.batch_series: {rule!r} is not max_fit or paper")
        for s in figure_setups(figure, p):
            zc = zero_config_of(s, hw)
            q = {"role": "simulated", "figure": figure, "setup": s.point, "series": s.series,
                 "sim_cluster": p["sim_cluster"], "use_fig3": bool(p["use_fig3"]),
                 **order_params(figure, p)}
            ov = {**paper_point_overrides(s, zc, s.batch_per_gpu, p),
                  **cluster_overrides(p["sim_cluster"])}
            if rule == "paper":
                q.update(zero_config=zc, batch=s.batch_per_gpu,
                         batch_source="paper (Tables 5-10)", batch_rule="paper")
                name = _point_name(s, "sim ") + PAPER_BATCH
            else:
                ov.pop("train.micro_batch_size")  # the run decides it
                q.update(zero_config="/".join(candidate_configs(s, hw, p)), batch_rule="max_fit",
                         judge=p["sim_judge"], stack=p["max_fit_stack"],
                         reduce_bucket=int(p["reduce_bucket"]),
                         allgather_bucket=int(p["allgather_bucket"]))
                name = _point_name(s, "sim ")
            out.append(Point(name=name, mode="simulated", params=q, overrides=ov))
    return out


def cluster_points(cfg, figure: str) -> list[Point]:
    """The paper's setups as real measured points on ``cfg.cluster`` (a GPU cluster)."""
    p = params(cfg)
    hw = Hardware.from_config(cfg.cluster)
    out = []
    for s in figure_setups(figure, p):
        zc = zero_config_of(s, hw)
        b, src = paper_batch(s, zc, cfg.cluster, p, base_cfg=cfg)
        if s.tp > cfg.cluster.gpus_per_node:
            log.warning("%s: TP %d spans nodes of %d GPUs on %s", s.point, s.tp,
                        cfg.cluster.gpus_per_node, cfg.cluster.name)
        ov = {**paper_point_overrides(s, zc, b, p, p["cluster_dtype"]),
              "train.steps": int(p["cluster_steps"]),
              "train.warmup_steps": int(p["cluster_warmup"])}
        out.append(Point(name=_point_name(s), mode="measured",
                         params={"role": "measured_paper", "figure": figure, "setup": s.point,
                                 "series": s.series, "zero_config": zc, "batch": b,
                                 "batch_source": src, **order_params(figure, p)},
                         overrides=ov))
    return out


def local_point(figure: str, name: str, model: str, world: int, tp: int, zc: str, p: dict,
                n_layer: int | None = None, **extra) -> Point:
    """A measured point on local CPU ranks: ``model`` (at depth ``n_layer`` if given) under
    ``zc`` at the batch ``local_batch`` gives; ``extra``: more point params."""
    b, src = local_batch(model, world, tp, zc, p)
    ov = {**{f"model.{k}": v for k, v in schema.model_conf(model).items()},
          "parallel.world_size": world, "parallel.tp": tp, "train.micro_batch_size": b,
          **zero_overrides(zc)}
    if n_layer is not None:
        ov["model.n_layer"] = int(n_layer)
        extra["n_layer"] = int(n_layer)
    return Point(name=name, mode="measured",
                 params={"role": "measured_local", "figure": figure, "model": model,
                         "world_size": world, "tp": tp, "zero_config": zc, "batch": b,
                         "batch_source": src, **extra},
                 overrides=ov)


def plan_points(cfg, figure: str, local_fn) -> list[Point]:
    """calibration + simulated paper-scale points + (cluster measured | local measured); the
    local points ``local_repeats`` times, all of them once before any twice (the machine's
    load drifts alike over every point)."""
    pts = [calibration_point(cfg)] + simulated_points(cfg, figure)
    if cfg.cluster.device == "cuda":
        return pts + cluster_points(cfg, figure)
    p = params(cfg)
    if not p["local"]:
        return pts
    base = local_fn(cfg, p)
    local = list(base)
    for i in range(1, int(p["local_repeats"])):
        local += [Point(name=f"{pt.name} r{i}", mode=pt.mode, params={**pt.params, "repeat": i},
                        overrides=pt.overrides) for pt in base]
    return pts + local


# ------------------------------------------------------------------------------- running
def simulate(figure: str, label: str, series: str, batch: int, sim_cluster: str,
             use_fig3: bool = False, p: dict | None = None,
             zero_config: str | None = None) -> dict:
    """The calibrated model's prediction for one paper setup, with the inputs behind it."""
    cal = calibration(sim_cluster, use_fig3)
    hw = hardware(sim_cluster)
    s = find_setup(figure, label, series, p)
    w = workload_for(s, hw, zero_config, batch_per_gpu=int(batch),
                     overlap_comm=OVERLAP.get(figure, lambda _: False)(s))
    bd = step_time(w, hw, cal.params)
    return {"tflops_per_gpu": bd["tflops_per_gpu"],
            "aggregate_tflops": bd["tflops_per_gpu"] * s.gpus,
            "step_time_s": bd["total"], "breakdown_s": {k: v for k, v in bd.items()
                                                        if k != "tflops_per_gpu"},
            "workload": dataclasses.asdict(w), "perf_params": dataclasses.asdict(cal.params),
            "gemm_efficiency": compute_efficiency(w, hw, cal.params),
            "calibrated_on": cal.targets, "sim_cluster": sim_cluster, "batch": int(batch),
            "zero_config": zero_config or zero_config_of(s, hw),
            "in_sample": in_sample(w, cal, hw)}


def in_sample(w, cal, hw: Hardware) -> str:
    """The fitted point whose workload ``w`` is ('' if none): its prediction is in-sample."""
    fitted = [(s, "fig2") for s in setups("fig2") if s.series == "ZeRO"]
    if "fig3" in cal.targets:
        fitted += [(s, "fig3") for s in setups("fig3")]
    for s, fig in fitted:
        if dataclasses.replace(workload_for(s, hw), overlap_comm=w.overlap_comm) == w:
            return f"{fig} {s.point} (calibration point)"
    return ""


def dryrun_config(s: PaperSetup, zc: str, p: dict) -> C.Config:
    """The memory dry run's config of setup ``s`` under ``zc`` on the simulated cluster's
    device, under ``max_fit_stack``."""
    ov = {**paper_point_overrides(s, zc, 1, p, "fp16"),
          **cluster_overrides(p["sim_cluster"], DRYRUN_FIELDS),
          "simulate.stack": p["max_fit_stack"]}
    return apply_overrides(C.Config(), ov)


@lru_cache(maxsize=None)
def _search(key: str, judge: str) -> dict:
    """``maxsize.max_batch`` (judge dryrun) or the analytic model on the same grid, memoised
    per process on the dry run's config (Figures 2 and 8 share the 170B search)."""
    d = json.loads(key)
    cfg = schema.to_config(OmegaConf.create(d["cfg"]))
    seed = int(d["seed"])
    if judge == "analytic":
        cap = capacity_of(cfg)
        fits_ = _analytic_fits(cap, _S(d["setup"]), d["zc"], d["p"])
        grid = [g for g in maxsize.BATCH_GRID if fits_(g)]
        return {"batch": max(grid, default=0), "capacity": cap, "judgements": [],
                "seconds": 0.0, "next_capacity": None, "judge": "analytic memory model"}
    res = maxsize.max_batch(cfg, seed=max(1, seed))
    # the sensitivity of the answer (Figure 3's line): the capacity each of the ABOVE grid
    # batches above the paper's batch needs, judged where the walk did not
    judged = {j.batch for j in res.judgements}
    paper_b = int(d.get("paper_batch") or 0)
    above = [g for g in maxsize.BATCH_GRID if paper_b and paper_b < g < res.batch][:ABOVE]
    res.judgements += [maxsize.judge_batch(cfg, b, res.capacity) for b in above
                       if b not in judged]
    return {**res.as_dict(), "next_capacity": res.next_capacity(),
            "judge": f"memory dry run ({cfg.simulate.stack})"}


ABOVE = 2  # grid batches above the paper's judged for the sensitivity of a predicted batch


class _S:  # the fields of a PaperSetup ``_analytic_fits`` reads, from JSON
    def __init__(self, d: dict):
        self.__dict__.update(d)


def max_fit_search(s: PaperSetup, zc: str, p: dict) -> dict:
    """The predicted batch of setup ``s`` under ``zc``: {batch, capacity, judgements,
    next_capacity (what the next grid batch needs), judge}."""
    hw = Hardware.from_config(load_cluster(p["sim_cluster"]))
    sd = {"n_layer": s.n_layer, "hidden": s.hidden, "heads": s.heads, "tp": s.tp, "dp": s.dp}
    pp = {"reduce_bucket": int(p["reduce_bucket"]), "allgather_bucket": int(p["allgather_bucket"])}
    seed = largest_true(_analytic_fits(hw.device_bytes, _S(sd), zc, pp))
    cfg = dryrun_config(s, zc, p)
    key = json.dumps({"cfg": OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True),
                      "seed": seed, "setup": sd, "zc": zc, "p": pp,
                      "paper_batch": s.batch_per_gpu}, sort_keys=True, default=str)
    return _search(key, p["sim_judge"])


def simulate_max_fit(q: dict) -> dict:
    """A predicted-batch point: each candidate configuration at its largest batch that fits
    (``max_fit_search``), the fastest kept; the others stay in ``alternatives``."""
    p = {**DEFAULTS, **q, "judge": q.get("judge", "dryrun")}
    p["sim_judge"] = q.get("judge", "dryrun")
    p["max_fit_stack"] = q.get("stack", DEFAULTS["max_fit_stack"])
    s = find_setup(q["figure"], q["setup"], q["series"], q)
    best, alts = None, {}
    for zc in str(q["zero_config"]).split("/"):
        srch = max_fit_search(s, zc, p)
        if srch["batch"] < 1:
            alts[zc] = {"batch": 0, "tflops_per_gpu": 0.0, "search": srch}
            continue
        r = simulate(q["figure"], q["setup"], q["series"], srch["batch"], q["sim_cluster"],
                     bool(q.get("use_fig3")), q, zero_config=zc)
        r["search"] = srch
        alts[zc] = {"batch": srch["batch"], "tflops_per_gpu": r["tflops_per_gpu"],
                    "search": srch}
        if best is None or r["tflops_per_gpu"] > best["tflops_per_gpu"]:
            best = r
    if best is None:  # nothing fits, not even batch 1: the prediction is "does not run"
        return {"tflops_per_gpu": 0.0, "aggregate_tflops": 0.0, "batch": 0, "fits": False,
                "zero_config": q["zero_config"], "alternatives": alts,
                "batch_source": "max_fit: nothing fits", "in_sample": ""}
    best["alternatives"] = alts
    best["fits"] = True
    best["batch_source"] = (f"max_fit: largest on the batch grid that fits, "
                            f"{best['search']['judge']}")
    return best


def run_point(cfg, point: Point) -> dict:
    role = point.params.get("role")
    if role == "calibration":
        cal = calibration(point.params["cluster"], bool(point.params.get("use_fig3")))
        summ = calibration_summary(cal)
        summ["files"] = write_calibration(cal, cfg.experiment.results_dir)
        return summ
    if role == "simulated":
        q = point.params
        if q.get("batch_rule") == "max_fit":
            return simulate_max_fit(q)
        return simulate(q["figure"], q["setup"], q["series"], q["batch"], q["sim_cluster"],
                        bool(q.get("use_fig3")), q, zero_config=q.get("zero_config"))
    result = run_training(cfg, point.run_dir, point.checked)
    m = result.setdefault("metrics", {})
    m["aggregate_tflops"] = m["tflops_per_gpu"] * cfg.parallel.world_size
    hw = result.setdefault("hardware", {})
    if hw.get("device") == "cpu":
        hw["cpu_model"] = cpu_model()
    return result
