"""The largest model one GPU trains, per GPU kind and offload mode: ZeRO-Offload's question
(Ren et al., USENIX ATC 2021, §6.2: "over 13 billion parameters on a single GPU") asked of every
cluster this project knows, simulated, with the papers' own claims beside it.

* simulated: per cluster (``experiment.params.clusters``: its GPU and its node's host, the
  whole host for the one rank) and offload mode (``experiment.params.modes``; the stage each
  runs at is ``MODE_STAGE``: ZeRO-Offload is stage 2, parameter offload stage 3; at N_d = 1 the
  stage changes no model-state byte without offload), the largest depth of a GPT-2-shaped
  family (``experiment.params.shape``) that the estimate judges to fit, device and host
  (``one_card_max.search``: two judged depths, the affine crossing, the answer judged where it
  is at most ``confirm_max`` layers deep), micro-batch 1, full activation checkpointing, the
  modern stack's allocator; its parameters, the memory that binds and the tokens/s the time
  model gives there.
* paper: ``CLAIMS`` (the papers' sentences, not measurements), drawn beside the V100 row.

Figure ``results/one_card_max/one_card_max.png``: largest parameters per GPU kind, one bar per
mode (log scale), hatched where the host binds, claims as markers.
"""
from __future__ import annotations

import dataclasses

from zero_repro import config as C
from zero_repro.lab.points import Point
from zero_repro.lab.records import newest_ok
from zero_repro.scale import estimate as E
from zero_repro.scale.paper.clusters import load_cluster

from experiments.one_card_max import figure as F
from experiments.one_card_max import search as S

FIGURE = "one_card_max"
NEWEST_ONLY = True
MODE_STAGE = {"none": 0, "cpu": 2, "param": 3, "cpu+param": 3}
# what the papers say one GPU trains (claims, drawn as such; cluster -> mode -> (B, source))
CLAIMS = {"dgx2_v100": {
    "none": (1.4, "ZeRO-Offload (arXiv:2101.06840) abstract: PyTorch alone, 1.4B the largest "
                  "without running out of memory (V100 32 GB)"),
    "cpu": (13.0, "ZeRO-Offload (arXiv:2101.06840) abstract: over 13B on a single GPU "
                  "(V100 32 GB, DGX-2 host)"),
    "cpu+param": (40.0, "DeepSpeed ZeRO-3 Offload announcement (deepspeed.ai, March 2021): up "
                        "to 40B on a single GPU")}}


def plan(cfg) -> list[Point]:
    p = cfg.experiment.params
    shape = dict(p["shape"])
    return [Point(name=f"one {cluster} GPU, offload {mode}",
                  params={"cluster": cluster, "dtype": str(dtype), "mode": mode,
                          "stage": MODE_STAGE[mode], "shape": shape,
                          "probes": list(p["probes"]), "confirm_max": int(p["confirm_max"]),
                          "batch": int(cfg.train.micro_batch_size)},
                  mode="simulated")
            for cluster, dtype in p["clusters"].items() for mode in p["modes"]]


def _config(params: dict, depth: int) -> C.Config:
    sh = params["shape"]
    m = C.ModelConfig(name=f"gpt_{depth}x{sh['hidden']}", family="gpt", bias=True,
                      n_layer=depth, n_embd=sh["hidden"], n_head=sh["heads"],
                      seq_len=sh["seq"], vocab_size=sh["vocab"])
    cl = dataclasses.replace(load_cluster(params["cluster"]), device="cuda", backend="nccl")
    cfg = C.Config(model=m, parallel=C.ParallelConfig(world_size=1, tp=1), cluster=cl)
    cfg.zero = dataclasses.replace(cfg.zero, dtype=params["dtype"],
                                   reduce_bucket_size=E.BUCKET, allgather_bucket_size=E.BUCKET)
    cfg.train = dataclasses.replace(cfg.train, micro_batch_size=params["batch"])
    return cfg


def judge(params: dict, depth: int) -> dict:
    """The estimate's verdict for one depth (one dry run, no micro-batch search)."""
    # workers=2: the dry run in a forked helper (a dry run's fake process group leaves state
    # in the process that runs it; hundreds of them in one process pile it up)
    est = E.estimate(_config(params, depth), stages=(params["stage"],), search=False,
                     workers=2, offload=params["mode"])
    s = est.stages[0]
    return {"params": est.model["params"], "fits": s.fits, "device_fits": s.device_fits,
            "host_fits": s.host_fits, "peak_reserved": s.peak_reserved,
            "capacity": s.capacity, "host_bytes": s.host_bytes,
            "host_capacity": s.host_capacity,
            "tokens_per_s": s.perf.get("tokens_per_s", 0.0)}


def run_point(cfg, point: Point) -> dict:
    p = point.params
    ans = S.largest_depth(lambda d: judge(p, d), tuple(p["probes"]), p["confirm_max"])
    a, b = (ans.judged[d] for d in p["probes"])
    per_layer = (b["params"] - a["params"]) / (b["depth"] - a["depth"])
    params = a["params"] + per_layer * (ans.depth - a["depth"]) if ans.depth else 0
    at = ans.judged.get(ans.depth, {})
    out = {"depth": ans.depth, "params": int(params), "binds": ans.binds,
           "method": ans.method, "judged": {str(d): v for d, v in sorted(ans.judged.items())}}
    if at.get("tokens_per_s"):  # the time model at the answer, where it was judged
        out["tokens_per_s"] = at["tokens_per_s"]
    return out


def summarize(records) -> list[dict]:
    rows = []
    for r in newest_ok(records):
        if r.status != "ok":
            continue
        p, m = r.params, r.metrics
        claim = CLAIMS.get(p["cluster"], {}).get(p["mode"])
        probe = m["judged"][str(p["probes"][0])]
        rows.append({"figure": FIGURE, "series": f"offload {p['mode']}",
                     "x_name": "cluster", "x_value": p["cluster"],
                     "y_name": "largest_model_params", "y_value": round(m["params"] / 1e9, 2),
                     "unit": "B", "kind": "simulated", "stage": p["stage"],
                     "depth": m["depth"], "hidden": p["shape"]["hidden"],
                     "binds": m["binds"], "method": m["method"],
                     "device_GB": load_cluster(p["cluster"]).device_memory_gb,
                     "host_GB": round(probe["host_capacity"] / 1e9, 1),
                     "tokens_per_s": (round(m["tokens_per_s"], 1)
                                      if m.get("tokens_per_s") else ""),
                     "paper_claim_B": claim[0] if claim else "",
                     "paper_source": claim[1] if claim else ""})
    return rows


def conclude(table) -> list[str]:
    """Per cluster the largest model of each mode, what binds it, and the claims beside."""
    t = table[table["figure"] == FIGURE]
    out = []
    for cluster, g in t.groupby("x_value", sort=False):
        cells = []
        for r in g.itertuples():
            claim = getattr(r, "paper_claim_B", "")
            claim = f", paper {claim}B" if claim == claim and str(claim) not in ("", "nan") \
                else ""
            cells.append(f"{str(r.series).split(' ', 1)[1]} {r.y_value:g}B "
                         f"({r.binds}{', extrapolated' if r.method == 'extrapolated' else ''}"
                         f"{claim})")
        out.append(f"one {cluster} GPU, largest model (simulated): " + "; ".join(cells))
    return out


def plot(table, out_dir: str) -> list[str]:
    """Bars per GPU kind, one per mode (log scale), hatched where the host binds; claims as
    black markers (``figure.plot``)."""
    return F.plot(table, out_dir, FIGURE)
