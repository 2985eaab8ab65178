"""GPU proof: what one GPU can prove about the runtime in <= 8 minutes (paper §10.2 throughput,
§10.5 / Figure 7 memory, §5 equivalence), as an experiment writing records like any other
(``results/gpu_proof/``), each labelled with the device name. One point per part:

  (a) ``mfu``: a ~1.5B GPT (``conf/model/gpt_1p5b_48x1600``) in bf16 at world 1, stages 0 and 3
      through the real trainer (``launcher.run_training``); MFU = model TFLOPs / the device's
      dense bf16 peak. Targets (CUDA only, ``summarize``): MFU >= 0.50 at stage 0 and
      step(stage 3) / step(stage 0) <= 1.10.
  (b) ``paper``: rank 0 of the paper's 40B C4 and 100B C5 points at 400 GPUs, MP 16 (Table 8,
      ``zero_repro.scale.paper.setups`` "fig7"), run for real (``train.build.build`` +
      ``train.step.train_step`` on the device under the ``fake`` group: collectives are no-ops,
      memory is real); ``torch.cuda.max_memory_allocated/reserved`` of the training steps beside
      the dry run's prediction (``zero_repro.scale.dryrun.dryrun.dry_run``). ``paper_layers`` sets
      a smaller depth where the full one does not fit (stated in the record).
  (c) ``equivalence``: stages 0-3 in bf16 at world 1 against a plain fp32 ``torch.optim.AdamW``
      reference (loss within ``loss_rel_tol``, update direction within ``update_rel_tol``) and
      stages 1-3 against stage 0 in bf16 within ``stage_tol``.

``device: cpu`` (the CI path, tests/test_gpu_proof.py) runs the same code at tiny sizes (no MFU
targets; the CPU ledger in place of the CUDA memory statistics).

    python run.py +exp=gpu_proof                                 # on one H200 (<= 8 min)
    python run.py +exp=gpu_proof experiment.params.device=cpu    # the CI path
"""
from __future__ import annotations

import gc
import logging
import math
import time

import torch

from zero_repro import config as C
from zero_repro.runtime.comm import comm, launch
from zero_repro.runtime.comm.launch import spawn
from zero_repro.runtime.comm.topology import Topology
from zero_repro.lab.points import Point
from zero_repro.runtime.model.gpt import GPT
from zero_repro.scale.dryrun.dryrun import dry_run, setup_overrides
from zero_repro.scale.hardware import load_cluster
from zero_repro.scale.paper.setups import setups
from zero_repro.runtime.train.build import build
from zero_repro.runtime.train.data import make_source, rank_batch
from zero_repro.runtime.train.step import train_step
from zero_repro.lab.launcher import run_training
from zero_repro.runtime.zero import build_strategy

log = logging.getLogger(__name__)

FIGURE = "gpu_proof"
GB = 1e9


def _device(p) -> str:
    d = str(p.get("device", "cuda"))
    if d not in ("cuda", "cpu"):
        raise ValueError(f"experiment.params.device={d!r}: choose cuda or cpu")
    if d == "cuda" and not torch.cuda.is_available():
        raise ValueError("experiment.params.device=cuda but no CUDA device is visible; "
                         "run the CI path with experiment.params.device=cpu")
    return d


def _cluster_overrides(name: str) -> dict:
    c = load_cluster(name)
    return {f"cluster.{k}": getattr(c, k) for k in ("name", "device", "backend",
                                                     "gpus_per_node", "device_memory_gb",
                                                     "peak_tflops")}


def plan(cfg) -> list[Point]:
    p = cfg.experiment.params
    dev = _device(p)
    cuda = dev == "cuda"
    pts = []
    mfu = p.get("mfu") or {}
    model = mfu.get("model", "gpt_1p5b_48x1600") if cuda else mfu.get("cpu_model", "tiny")
    base = {f"model.{k}": v for k, v in C.model_conf(model).items()}
    base.update({"parallel.world_size": 1, "parallel.tp": 1, "zero.dtype": "bf16",
                 "zero.reduce_bucket_size": 500_000_000,
                 "zero.allgather_bucket_size": 500_000_000,
                 "train.micro_batch_size": int(mfu.get("batch", 8) if cuda else 2),
                 "train.steps": int(mfu.get("steps", 10) if cuda else 4),
                 "train.warmup_steps": int(mfu.get("warmup", 3) if cuda else 1),
                 "train.progress": False})
    if cuda:
        base.update(_cluster_overrides(p.get("cluster", "h200")))
    for stage in mfu.get("stages", [0, 3]):
        pts.append(Point(name=f"mfu stage{stage}", params={"part": "mfu", "stage": stage,
                                                           "model": model, "device": dev},
                         overrides={**base, "zero.stage": stage}, mode="measured"))
    layers = dict(p.get("paper_layers") or {})
    for s in setups("fig7"):
        label = f"{s.size_label} {s.zero_config}"
        if label not in list(p.get("paper_points") or []):
            continue
        ov = setup_overrides(s, p.get("cluster", "h200") if cuda else "dgx2_v100")
        if cuda:
            ov.update(_cluster_overrides(p.get("cluster", "h200")))
            n = int(layers.get(label, s.n_layer))
        else:  # tiny stand-in of the same point: TP 16, the same ZeRO-R config, tiny shape
            small = dict(p.get("cpu_paper") or {})
            n = int(small.get("n_layer", 2))
            ov.update({"model.n_embd": int(small.get("n_embd", 256)),
                       "model.n_head": int(small.get("n_head", 16)),
                       "model.seq_len": int(small.get("seq_len", 64)),
                       "train.micro_batch_size": int(small.get("batch", 2)),
                       "zero.reduce_bucket_size": 50_000, "zero.allgather_bucket_size": 50_000,
                       "cluster.device_memory_gb": 0.0})
        ov["model.n_layer"] = n
        ov["model.name"] = f"gpt_{n}x{ov['model.n_embd']}"
        # ONE process plays rank 0 of the paper's world on the fake process group: the local
        # rank/core and whole-world memory pre-flight checks do not apply
        ov["launcher.oversubscribe"] = True
        pts.append(Point(name=f"paper {label}", params={
            "part": "paper", "point": label, "n_layer": n, "paper_n_layer": s.n_layer,
            "device": dev, "iterations": int(p.get("paper_iterations", 2))},
            overrides=ov, mode="measured"))
    eqp = p.get("equivalence") or {}
    emodel = eqp.get("model", "small") if cuda else eqp.get("cpu_model", "tiny")
    ov = {f"model.{k}": v for k, v in C.model_conf(emodel).items()}
    ov.update({"parallel.world_size": 1, "parallel.tp": 1, "zero.dtype": "bf16",
               "zero.grad_clip": 0.0, "train.steps": int(eqp.get("steps", 5)),
               "train.micro_batch_size": int(eqp.get("batch", 4)), "train.lr": 1e-3,
               "zero.reduce_bucket_size": 50_000, "zero.allgather_bucket_size": 50_000})
    if cuda:
        ov.update(_cluster_overrides(p.get("cluster", "h200")))
    pts.append(Point(name="equivalence bf16", params={
        "part": "equivalence", "model": emodel, "device": dev,
        "stages": list(eqp.get("stages", [0, 1, 2, 3]))}, overrides=ov, mode="measured"))
    return pts


def _device_label(dev: str) -> str:
    return torch.cuda.get_device_name(0) if dev == "cuda" else f"cpu ({torch.__version__})"


def run_point(cfg, point: Point) -> dict:
    part = point.params["part"]
    t0 = time.perf_counter()
    if part == "mfu":
        out = _run_mfu(cfg, point)
    elif part == "paper":
        out = _run_paper(cfg, point)
    else:
        out = _run_equivalence(cfg, point)
    out.setdefault("metrics", {}).update({"part": part, "device": point.params["device"],
                                          "device_name": _device_label(point.params["device"]),
                                          "wall_s": time.perf_counter() - t0})
    return out


# ------------------------------------------------------------------------------ (a) MFU
def _run_mfu(cfg, point: Point) -> dict:
    res = run_training(cfg, point.run_dir or "outputs/gpu_proof_mfu")
    m = res["metrics"]
    return {"metrics": {"stage": cfg.zero.stage, "step_time_s": m["step_time_s"],
                        "tflops_per_gpu": m["tflops_per_gpu"], "mfu": m.get("mfu"),
                        "tokens_per_s": m["tokens_per_s"], "params": m["params_total"],
                        "loss_first": m["loss_first"], "loss_last": m["loss_last"],
                        "skipped_steps": m["skipped_steps"]},
            "memory": res["memory"], "hardware": res.get("hardware", {})}


# ------------------------------------------------------------------ (b) paper points, one rank
def _run_paper(cfg, point: Point) -> dict:
    dev = point.params["device"]
    its = int(point.params.get("iterations", 2))
    real = _one_rank_real(cfg, dev, its)
    pred = dry_run(cfg, rank=0, iterations=its, keep_trace=False,
                   allocator_capacity=cfg.cluster.device_memory_gb * GB or None)
    m = {"point": point.params["point"], "n_layer": cfg.model.n_layer,
         "paper_n_layer": point.params["paper_n_layer"], "world_size": cfg.parallel.world_size,
         "tp": cfg.parallel.tp, "stage": cfg.zero.stage, "zero_r": cfg.zero_r.name,
         "micro_batch_size": cfg.train.micro_batch_size, **real,
         "predicted_model_state_bytes": pred.model_state_bytes,
         "predicted_peak_allocated": pred.allocator["peak_allocated"],
         "predicted_peak_reserved": pred.allocator["peak_reserved"],
         "predicted_live_peak_steady": pred.live_peak_steady,
         "predicted_peak_allocated_with_build": pred.allocator_with_build["peak_allocated"],
         "predicted_oom": pred.allocator["oom"], "dry_run_s": pred.timings["total_s"]}
    m["model_states_ratio"] = real["model_state_bytes"] / pred.model_state_bytes
    if dev == "cuda":
        m["allocated_ratio"] = real["cuda_max_allocated"] / pred.allocator["peak_allocated"]
        m["reserved_ratio"] = real["cuda_max_reserved"] / pred.allocator["peak_reserved"]
    return {"metrics": m, "memory": pred.ledger}


def _one_rank_real(cfg, dev: str, iterations: int) -> dict:
    """Rank 0 of ``cfg``'s world on the fake process group, real tensors on ``dev``."""
    if comm.is_initialized():
        raise RuntimeError("the paper points need their own fake process group: run the "
                           "gpu_proof experiment in a process without one")
    device = torch.device(dev, 0) if dev == "cuda" else torch.device("cpu")
    launch.init_fake(0, cfg.parallel.world_size)
    out: dict = {}
    try:
        topo = Topology.build(cfg.parallel.tp)
        t0 = time.perf_counter()
        model, ckpt, strategy = build(cfg, topo, device)
        out["build_s"] = time.perf_counter() - t0
        if dev == "cuda":
            torch.cuda.synchronize()
            out["cuda_max_allocated_with_build"] = torch.cuda.max_memory_allocated(device)
            torch.cuda.empty_cache()  # the dry run's training trace starts after the build too
            torch.cuda.reset_peak_memory_stats(device)
        m, t = cfg.model, cfg.train
        skipped = 0
        for it in range(iterations):
            t0 = time.perf_counter()
            # under the fake group a collective leaves its output as it was: a skipped (fp16
            # overflow) step is possible and is counted, not hidden
            info = train_step(strategy, [(torch.randint(0, m.vocab_size,
                                                        (t.micro_batch_size, m.seq_len),
                                                        device=device),
                                          torch.randint(0, m.vocab_size,
                                                        (t.micro_batch_size, m.seq_len),
                                                        device=device))])
            skipped += int(info.skipped)
            out[f"iteration{it}_s"] = time.perf_counter() - t0
        ledger = strategy.memory_ledger()
        if ckpt is not None:
            ckpt.add_to_ledger(ledger)
        out.update({"model_state_bytes": ledger.model_states(), "ledger": ledger.as_dict(),
                    "skipped_steps": skipped})
        if dev == "cuda":
            torch.cuda.synchronize()
            out["cuda_max_allocated"] = torch.cuda.max_memory_allocated(device)
            out["cuda_max_reserved"] = torch.cuda.max_memory_reserved(device)
        strategy.remove_hooks()
        del model, ckpt, strategy
    finally:
        comm.destroy_process_group()
        gc.collect()
        if dev == "cuda":
            torch.cuda.empty_cache()
    return out


# ------------------------------------------------------------------------ (c) equivalence
def _run_equivalence(cfg, point: Point) -> dict:
    p = cfg.experiment.params.get("equivalence") or {}
    backend = "nccl" if point.params["device"] == "cuda" else "gloo"
    (res,) = spawn(equivalence_rank, 1, cfg, tuple(point.params["stages"]),
                   point.params["device"], backend=backend)
    tol = {"loss_rel_tol": float(p.get("loss_rel_tol", 0.02)),
           "update_rel_tol": float(p.get("update_rel_tol", 0.25)),
           "stage_tol": float(p.get("stage_tol", 1e-2))}
    checks = {}
    for k, r in res["stages"].items():
        checks[f"stage{k}_loss"] = r["max_loss_rel_diff"] <= tol["loss_rel_tol"]
        checks[f"stage{k}_update"] = r["update_rel_diff"] <= tol["update_rel_tol"]
        if "max_abs_vs_stage0" in r:
            checks[f"stage{k}_vs_stage0"] = r["max_abs_vs_stage0"] <= tol["stage_tol"]
    return {"metrics": {**res, "tolerances": tol, "checks": checks,
                        "equivalent": all(checks.values())}}


def equivalence_rank(rank: int, world_size: int, cfg: C.Config, stages, dev: str) -> dict:
    """World 1 on ``dev``: the fp32 torch AdamW reference and the project's stages in bf16,
    the same init and batches. Module level, for ``launch.spawn``."""
    device = torch.device(dev, 0) if dev == "cuda" else torch.device("cpu")
    if dev == "cuda":
        torch.cuda.set_device(device)
    m, t = cfg.model, cfg.train
    source = make_source(t.data, m.seq_len, m.vocab_size, t.seed)
    batches = [tuple(x.to(device) for x in rank_batch(source, s, t.micro_batch_size, 1, 0))
               for s in range(t.steps)]
    ref = GPT(m, device=device, dtype=torch.float32, seed=t.seed)
    theta0 = {n: p.detach().clone() for n, p in ref.named_parameters()}
    opt = torch.optim.AdamW(ref.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                            weight_decay=t.weight_decay, fused=True)
    ref_losses = []
    for x, y in batches:
        _, loss = ref(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref_losses.append(float(loss))
    ref_theta = {n: p.detach() for n, p in ref.named_parameters()}
    out, stage0 = {}, None
    for k in stages:
        model = GPT(m, device=device, dtype=torch.bfloat16, seed=t.seed)
        topo = Topology.build(tp=1, ledger=comm.CommLedger())
        zero = C.ZeroConfig(**{**vars(cfg.zero), "stage": int(k)})
        strategy = build_strategy(model, topo, zero, t)
        losses: list = []
        for x, y in batches:
            train_step(strategy, [(x, y)], on_loss=losses.append)
        losses = [float(v) for v in losses]
        theta = {n: p.float() for n, p in strategy.full_parameters().items()}
        num = math.sqrt(sum(float((theta[n] - ref_theta[n]).pow(2).sum()) for n in theta))
        den = math.sqrt(sum(float((ref_theta[n] - theta0[n]).pow(2).sum()) for n in theta))
        r = {"losses": losses,
             "max_loss_rel_diff": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
             "update_rel_diff": num / den if den else math.inf}
        if stage0 is None:
            stage0 = theta
        else:
            r["max_abs_vs_stage0"] = max(float((theta[n] - stage0[n]).abs().max())
                                         for n in theta)
        strategy.remove_hooks()
        out[str(k)] = r
    return {"reference_losses": ref_losses, "stages": out, "dtype": "bf16",
            "model": m.name, "steps": t.steps}


# ------------------------------------------------------------------------------ summaries
def summarize(records) -> list[dict]:
    newest: dict = {}
    for r in records:
        if r.status == "ok" and (r.point not in newest
                                 or r.timestamp >= newest[r.point].timestamp):
            newest[r.point] = r
    rows = []

    def row(r, series, x, y_name, y, unit):
        rows.append({"figure": FIGURE, "series": series, "x_name": "point", "x_value": x,
                     "y_name": y_name, "y_value": y, "unit": unit, "kind": r.mode,
                     "device_name": r.metrics.get("device_name", "")})

    mfu = {}
    for r in newest.values():
        m = r.metrics
        if m.get("part") == "mfu":
            mfu[m["stage"]] = r
            row(r, "mfu", r.point, "step_time_s", m["step_time_s"], "s")
            row(r, "mfu", r.point, "tflops_per_gpu", m["tflops_per_gpu"], "TFLOPs")
            if m.get("mfu") is not None:
                row(r, "mfu", r.point, "mfu", m["mfu"], "fraction")
        elif m.get("part") == "paper":
            for y in ("model_state_bytes", "predicted_model_state_bytes", "cuda_max_allocated",
                      "predicted_peak_allocated", "cuda_max_reserved",
                      "predicted_peak_reserved"):
                if m.get(y) is not None:
                    row(r, "paper", m["point"], f"{y}_GB", m[y] / GB, "GB")
            for y in ("model_states_ratio", "allocated_ratio", "reserved_ratio"):
                if m.get(y) is not None:
                    row(r, "paper", m["point"], y, m[y], "x")
        elif m.get("part") == "equivalence":
            for k, s in m["stages"].items():
                row(r, "equivalence", f"stage{k}", "max_loss_rel_diff",
                    s["max_loss_rel_diff"], "fraction")
                row(r, "equivalence", f"stage{k}", "update_rel_diff", s["update_rel_diff"],
                    "fraction")
            row(r, "equivalence", "all", "equivalent", float(m["equivalent"]), "bool")
    if 0 in mfu and 3 in mfu:
        r0, r3 = mfu[0], mfu[3]
        ratio = r3.metrics["step_time_s"] / r0.metrics["step_time_s"]
        row(r3, "mfu", "stage3/stage0", "step_time_ratio", ratio, "x")
        if r0.metrics.get("device") == "cuda":
            row(r3, "mfu", "targets", "stage3_over_stage0_met", float(ratio <= 1.10), "bool")
            if r0.metrics.get("mfu") is not None:
                row(r0, "mfu", "targets", "mfu_stage0_met", float(r0.metrics["mfu"] >= 0.50),
                    "bool")
    return rows
