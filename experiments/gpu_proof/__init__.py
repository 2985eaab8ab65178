"""GPU proof: what one GPU (``gpus: 1``, <= 10 minutes) or one node of 8 GPUs (``gpus: 8``,
<= 10 minutes) proves about the runtime on CUDA/NCCL (paper §5 equivalence, §10.2 throughput,
§10.5 memory), as records in ``results/<dir>/gpu_proof/`` and a short ``report.md`` beside the
figure. Parts, in this order (equivalence first: a wrong runtime makes every later number moot):

* ``probe``: versions; ``torch._fused_adamw_``, ``_foreach_norm`` (bf16 in, fp32 out) and a
  storage ``resize_(0)`` / back on the device; at world > 1 an all-reduce, reduce-scatter and
  all-gather of known values through ``comm``.
* ``equivalence``: stages 0-3 in fp32 (TF32 off) against ``torch.optim.AdamW`` +
  ``clip_grad_norm_`` on the TP=1 model and the global batch, max |θ - θ_ref| <= ``tol``; one
  GPU: DP 1; a node: DP 8 and TP 2 x DP 4 (the bucket transport is the NCCL ranks' one).
* one GPU -- ``offload``: stage 2 fp32, checkpoints on the device vs P_a+cpu (pinned, side
  stream), same seeds: losses within ``loss_rtol``, parameters within ``param_atol``,
  ``ckpt_cpu`` > 0. ``throughput``: a 1.5B GPT in bf16 through the real trainer at stages 0
  and 3 (CUDA-event timing over windows): MFU (model FLOPs, causal) and HFU beside it; at DP 1
  stage 3's extra cost is bookkeeping (its gathers are local copies). ``paper``: rank 0 of the
  paper's 40B C4 and 100B C5 (400 GPUs, MP 16) built on the device at full depth under the
  ``fake`` process group, NCCL's bucket transport modelled in the real rank and in the dry run
  it is compared with: real / predicted peak allocated, and both peaks by category
  (``lab.cuda_memory``: the ledger's held bytes, ``torch.cuda.memory_stats``' peaks) so a miss
  of the band names the category and its known reasons.
* one GPU -- ``zero_offload`` (``gpu_proof.offload``): stage 2 with the optimizer on the
  device, then on the host (``zero.offload_optimizer=cpu``): parameters equal, the device's
  peak falls by the optimizer state, the ledger equals Table 1's offload column.
* a node -- ``node``: the 1.5B GPT in bf16 at DP 8, stages 0-3: step time over a window of CUDA
  events, NCCL kernels' overlap with compute from one profiled step, peak memory per stage
  (must fall stage 0 > 1 > 2 > 3).

World 1 is DP 1: no collective moves data and no NCCL communicator carries a bucket; its
records say so (``nccl_exercised``). The parts' rank programs and verdicts: ``experiments.gpu_proof.parts``. The GPU's peak and memory
come from ``conf/cluster``:
``experiment.params.cluster=auto`` finds it from ``torch.cuda.get_device_name`` and the device
memory (``gpu_cluster``). Table, figure, ``report.md`` and result lines:
``experiments.gpu_proof.report``. ``device: cpu`` is the dry path CI runs
(tests/integration/test_gpu_proof.py): the same code at tiny sizes on gloo ranks (world 1, or 4 for
``gpus: 8``: DP 4 and TP 2 x DP 2) with the NCCL ranks' bucket transport forced onto gloo, the
ledger for CUDA memory, no targets.

    python run.py +exp=gpu_proof                            # one GPU
    python run.py +exp=gpu_proof experiment.params.gpus=8   # one node of 8 GPUs
    python run.py +exp=gpu_proof experiment.action=plan     # the parts in order + time estimate
    python run.py +exp=gpu_proof experiment.params.device=cpu   # the CI dry path
"""
from __future__ import annotations

import time

import torch

from zero_repro import schema
from experiments.gpu_proof import parts as gpu
from experiments.gpu_proof import time_estimate as GT
from experiments.gpu_proof import offload as zero_offload
from experiments.gpu_proof import offload_param
from experiments.gpu_proof.device import (  # noqa: F401 (gpu_cluster: the experiment's interface)
    cluster_name, cluster_overrides, gpu_cluster)
from experiments.gpu_proof.report import (  # noqa: F401 (the experiment's interface)
    FIGURE, MFU_TARGET, conclude, plot, report_text, summarize)
from zero_repro.lab.points import Point
from zero_repro.runtime.comm.launch import spawn
from zero_repro.scale.dryrun.dryrun import setup_overrides
from zero_repro.scale.paper.setups import setups

CPU_WORLD = {1: 1, 8: 4}  # gloo ranks of the CPU dry path per ``gpus``


# ------------------------------------------------------------------------------------ plan
def _params(cfg) -> tuple[dict, str, int]:
    p = cfg.experiment.params
    dev, gpus = str(p.get("device", "cuda")), int(p.get("gpus", 1))
    if dev not in ("cuda", "cpu"):
        raise ValueError(f"experiment.params.device={dev!r}: choose cuda or cpu")
    if gpus not in CPU_WORLD:
        raise ValueError(f"experiment.params.gpus={gpus}: choose 1 (one GPU) or 8 (one node)")
    if (dev == "cuda" and cfg.experiment.action == "run" and
            torch.cuda.device_count() < gpus):
        raise ValueError(f"experiment.params.device=cuda gpus={gpus} but this machine shows "
                         f"{torch.cuda.device_count()} CUDA devices; the CI dry path is "
                         f"experiment.params.device=cpu")
    return p, dev, gpus


def _model_overrides(spec) -> dict:
    spec = schema.model_conf(spec) if isinstance(spec, str) else dict(spec)
    return {f"model.{k}": v for k, v in spec.items()}


def plan(cfg) -> list[Point]:
    p, dev, gpus = _params(cfg)
    cuda = dev == "cuda"
    world = gpus if cuda else CPU_WORLD[gpus]
    base = {"parallel.world_size": world, "parallel.tp": 1, "train.progress": False,
            **(cluster_overrides(cluster_name(p)) if cuda else {})}
    tag = {"device": dev, "gpus": gpus}
    eq = dict(p.get("equivalence") or {})
    pts = [Point(name="probe", params={"part": "probe", **tag}, overrides=dict(base)),
           Point(name="equivalence fp32", params={
               "part": "equivalence", **tag, "tps": [1] if world == 1 else [1, 2],
               "stages": list(eq.get("stages", [0, 1, 2, 3])),
               "steps": int(eq.get("steps", 3)), "tol": float(eq.get("tol", 1e-5)),
               "bucket": int(eq.get("bucket", 6000))},
               overrides={**base, **_model_overrides(eq.get("model" if cuda else "cpu_model",
                                                            "tiny"))})]
    if gpus == 1:
        pts += _one_gpu_points(p, cuda, base, tag)
        pts += zero_offload.points(p, cuda, base, tag, _model_overrides)
        pts += offload_param.points(p, cuda, base, tag, _model_overrides)
    else:
        pts += [_node_point(p, cuda, base, tag)]
    return pts


def _one_gpu_points(p, cuda: bool, base: dict, tag: dict) -> list[Point]:
    off = dict(p.get("offload") or {})
    pts = [Point(name="offload P_a+cpu", params={
        "part": "offload", **tag, "steps": int(off.get("steps", 3)),
        "loss_rtol": float(off.get("loss_rtol", 1e-5)),
        "param_atol": float(off.get("param_atol", 1e-4))},
        overrides={**base, **_model_overrides(off.get("model" if cuda else "cpu_model")),
                   "train.micro_batch_size": int(off.get("batch", 8) if cuda else 2)})]
    tp_ = dict(p.get("throughput") or {})
    model = tp_.get("model", "gpt_1p5b_48x1600") if cuda else tp_.get("cpu_model", "tiny")
    bucket = int(tp_.get("bucket", 50_000_000))
    ov = {**base, **_model_overrides(model), "zero.dtype": "bf16",
          "zero.reduce_bucket_size": bucket, "zero.allgather_bucket_size": bucket,
          "zero_r.name": "custom", "zero_r.constant_buffers": True,
          "train.micro_batch_size": int(tp_.get("batch", 8) if cuda else 2),
          "train.steps": int(tp_.get("steps", 12) if cuda else 4),
          "train.warmup_steps": int(tp_.get("warmup", 3) if cuda else 1)}
    for stage in tp_.get("stages", [0, 3]):
        pts.append(Point(name=f"throughput stage{stage}", params={
            "part": "throughput", **tag, "stage": stage, "model": model},
            overrides={**ov, "zero.stage": stage}))
    pp = dict(p.get("paper") or {})
    cluster = cluster_name(p) if cuda else "dgx2_v100"
    for s in setups("fig7"):
        label = f"{s.size_label} {s.zero_config}"
        if label not in list(pp.get("points") or []):
            continue
        ov = setup_overrides(s, cluster)
        if cuda:
            ov.update(cluster_overrides(cluster))
            n = int((pp.get("layers") or {}).get(label, s.n_layer))
        else:  # a tiny stand-in of the same point: TP 16, its ZeRO-R config, a tiny shape
            small = dict(pp.get("cpu_shape") or {})
            n = int(small.get("n_layer", 2))
            ov.update({"model.n_embd": int(small.get("n_embd", 256)),
                       "model.n_head": int(small.get("n_head", 16)),
                       "model.seq_len": int(small.get("seq_len", 64)),
                       "train.micro_batch_size": int(small.get("batch", 2)),
                       "zero.reduce_bucket_size": 50_000, "zero.allgather_bucket_size": 50_000,
                       "cluster.device_memory_gb": 0.0, "cluster.device_memory_mib": 0})
        ov.update({"model.n_layer": n, "model.name": f"gpt_{n}x{ov['model.n_embd']}",
                   # ONE process plays rank 0 of the paper's world on the fake group: the
                   # local rank / whole-world memory pre-flight checks do not apply
                   "launcher.oversubscribe": True, "train.progress": False})
        pts.append(Point(name=f"paper {label}", params={
            "part": "paper", **tag, "point": label, "n_layer": n, "paper_n_layer": s.n_layer,
            "iterations": int(pp.get("iterations", 2)),
            "ratio_range": list(pp.get("ratio_range", [0.95, 1.10]))}, overrides=ov))
    return pts


def _node_point(p, cuda: bool, base: dict, tag: dict) -> Point:
    nd = dict(p.get("node") or {})
    model = nd.get("model", "gpt_1p5b_48x1600") if cuda else nd.get("cpu_model", "tiny")
    bucket = int(nd.get("bucket", 50_000_000) if cuda else 6000)
    return Point(name="node stages 0-3", params={
        "part": "node", **tag, "model": model, "stages": list(nd.get("stages", [0, 1, 2, 3])),
        "warmup": int(nd.get("warmup", 3) if cuda else 1),
        "steps": int(nd.get("steps", 8) if cuda else 2), "bucket": bucket},
        overrides={**base, **_model_overrides(model), "zero.dtype": "bf16",
                   "train.micro_batch_size": int(nd.get("batch", 8) if cuda else 2)})


# -------------------------------------------------------------------------- time estimate
def plan_note(cfg, points: list[Point]) -> list[str]:
    """Lines the plan prints under the points: the time estimate (``gpu_proof.time_estimate``)
    against the budget."""
    p, dev, gpus = _params(cfg)
    if dev != "cuda":
        return ["CPU dry path (tiny sizes on gloo): no time estimate; the GPU run is "
                "experiment.params.device=cuda"]
    budget = float(p.get("budget_min", 10)) * 60
    est = [(pt.name, GT.estimate_s(cfg, pt)) for pt in points]
    total = sum(s for _, s in est)
    name = cluster_name(p)
    lines = [f"time estimate on {gpus} x {name} GPU(s): {total / 60:.1f} min of the "
             f"{budget / 60:.0f} min budget (experiment.params.budget_min), parts in the "
             f"order above:",
             "  " + " | ".join(f"{n} {s / 60:.1f}" for n, s in est),
             f"  (an estimate: {GT.SPAWN_S:.0f} s per spawned point, weights drawn on the "
             f"device at {GT.DEVICE_INIT_PER_S / 1e9:.0f}G samples/s, steps at "
             f"{GT.EAGER_EFFICIENCY:.0%} of the peak, the dry run {GT.DRY_RUN_S_PER_LAYER} s per "
             f"layer; each record's wall_s is the measurement)"]
    if total > budget:
        lines.append(f"  WARNING: over the budget by {(total - budget) / 60:.1f} min")
    lines.append("  the proof is one process on one node (the paper points play rank 0 of their "
                 "world there): on Slurm run the command above in one job, e.g. sbatch --nodes=1 "
                 f"--gpus-per-node={gpus} --wrap 'python run.py +exp=gpu_proof"
                 f"{'' if gpus == 1 else ' experiment.params.gpus=8'}'")
    return lines


# ----------------------------------------------------------------------------- run a part
def run_point(cfg, point: Point) -> dict:
    part, q = point.params["part"], point.params
    t0 = time.perf_counter()
    backend = "nccl" if q["device"] == "cuda" else "gloo"
    world = cfg.parallel.world_size
    if part == "paper":
        out = gpu.run_paper(cfg, point)
    elif part == "throughput":
        out = gpu.run_throughput(cfg, point)
    else:
        fn = {"probe": gpu.probe_rank, "equivalence": gpu.equivalence_rank,
              "offload": gpu.offload_rank, "node": gpu.node_rank,
              zero_offload.PART: zero_offload.zero_offload_rank,
              offload_param.PART: offload_param.zero_offload_param_rank}[part]
        one = part in ("offload", zero_offload.PART, offload_param.PART)
        res = spawn(fn, 1 if one else world, cfg, dict(q), backend=backend,
                    timeout_s=cfg.launcher.collective_timeout_s)
        out = {"metrics": gpu.judge(part, q, res[0])}
    out.setdefault("metrics", {}).update({
        "part": part, "device": q["device"], "gpus": q["gpus"],
        "device_name": torch.cuda.get_device_name(0) if q["device"] == "cuda"
        else f"cpu ({torch.__version__})", "wall_s":
        time.perf_counter() - t0, "estimate_s": GT.estimate_s(cfg, point),
        # world 1 = DP 1: every collective returns early, no NCCL communicator moves a bucket
        "nccl_exercised": q["device"] == "cuda" and world > 1 and part not in ("paper",)})
    return out


