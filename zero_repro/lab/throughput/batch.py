"""The batch per GPU of a throughput point (paper §10.2-10.5): the paper's (Tables 5-10), or the
largest that fits -- by the closed-form model (``scale.analytic.fits``) or by the memory dry run
(``scale.dryrun.maxsize``: the real runtime on meta tensors and the caching-allocator replay) on
the simulated cluster's device; the local analogue's budget and depth by the same judge. Also
the config of a paper setup as point overrides (``paper_point_overrides``).
"""
from __future__ import annotations

import json
from functools import lru_cache

from omegaconf import OmegaConf

from zero_repro import config as C
from zero_repro import schema
from zero_repro.lab import sweep
from zero_repro.scale.analytic import fits
from zero_repro.scale.dryrun import dryrun, maxsize
from zero_repro.scale.dryrun.dryrun import apply_overrides
from zero_repro.scale.dryrun.maxsize import capacity_of
from zero_repro.scale.hardware import Hardware
from zero_repro.scale.paper.clusters import DRYRUN_FIELDS, cluster_overrides, load_cluster
from zero_repro.scale.paper.overrides import setup_overrides
from zero_repro.scale.paper.setups import PaperSetup
from zero_repro.scale.paper.table3 import zero_overrides


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
