"""The points of a throughput figure (paper §10.2-10.5), always labelled by ``kind``: a
``calibration`` point; ``simulated`` points at paper scale, one per batch rule in
``batch_series`` (``simulate``); with a GPU cluster (``cluster.device=cuda``) the same setups as
``measured`` points for ``zero_repro.lab.launcher.run_training`` (each its own Slurm job under
``launcher=slurm``); else the figure's scaled-down ``measured`` analogue on local CPU ranks
(gloo), defined by each figure's module through ``local_point``.
"""
from __future__ import annotations

import logging

from zero_repro import schema
from zero_repro.lab.points import Point
from zero_repro.lab.throughput.batch import local_batch, paper_batch, paper_point_overrides
from zero_repro.lab.throughput.setups import PAPER_BATCH, figure_setups, order_params, params
from zero_repro.lab.throughput.simulate import zero_config_of
from zero_repro.scale.hardware import Hardware
from zero_repro.scale.paper.clusters import cluster_overrides, load_cluster
from zero_repro.scale.paper.setups import PaperSetup
from zero_repro.scale.paper.table3 import zero_overrides

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------ planning
def calibration_point(cfg) -> Point:
    p = params(cfg)
    return Point(name="calibration", mode="simulated",
                 params={"role": "calibration", "cluster": p["sim_cluster"],
                         "use_fig3": bool(p["use_fig3"])})


def _point_name(s: PaperSetup, prefix: str = "") -> str:
    baseline = s.series == "Baseline" and "Baseline" not in s.point
    return f"{prefix}{s.point}" + (" Baseline" if baseline else "")


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
