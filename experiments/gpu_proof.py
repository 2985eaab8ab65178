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
  it is compared with: real / predicted peak allocated.
* one GPU -- ``zero_offload`` (``experiments/gpu_proof_offload.py``): stage 2 with the optimizer
  on the device, then on the host (``zero.offload_optimizer=cpu``): parameters equal, the
  device's peak falls by the optimizer state, the ledger equals Table 1's offload column.
* a node -- ``node``: the 1.5B GPT in bf16 at DP 8, stages 0-3: step time over a window of CUDA
  events, NCCL kernels' overlap with compute from one profiled step, peak memory per stage
  (must fall stage 0 > 1 > 2 > 3).

World 1 is DP 1: no collective moves data and no NCCL communicator carries a bucket; its
records say so (``nccl_exercised``). ``device: cpu`` is the dry path CI runs
(tests/test_gpu_proof.py): the same code at tiny sizes on gloo ranks (world 1, or 4 for
``gpus: 8``: DP 4 and TP 2 x DP 2) with the NCCL ranks' bucket transport forced onto gloo, the
ledger for CUDA memory, no targets.

    python run.py +exp=gpu_proof                            # one GPU
    python run.py +exp=gpu_proof experiment.params.gpus=8   # one node of 8 GPUs
    python run.py +exp=gpu_proof experiment.action=plan     # the parts in order + time estimate
    python run.py +exp=gpu_proof experiment.params.device=cpu   # the CI dry path
"""
from __future__ import annotations

import gc
import math
import os
import platform
import time

import matplotlib
import torch

from zero_repro import config as C
from zero_repro.lab.launcher import run_training
from zero_repro.lab.points import Point
from zero_repro.lab.sweep import point_config
from zero_repro.runtime.comm import comm, launch
from zero_repro.runtime.comm.launch import spawn
from zero_repro.runtime.comm.topology import Topology
from zero_repro.runtime.model import flops
from zero_repro.runtime.model.gpt import GPT, gather_full_state
from zero_repro.runtime.train.build import build
from zero_repro.runtime.train.step import train_step
from zero_repro.runtime.zero import build_strategy
from zero_repro.scale.dryrun.dryrun import dry_run, setup_overrides
from zero_repro.scale.hardware import device_bytes, load_cluster
from zero_repro.scale.paper.setups import setups

from experiments import gpu_proof_offload as zero_offload  # the ZeRO-Offload part

matplotlib.use("Agg")

FIGURE = "gpu_proof"
GB = 1e9
SEED = 7
MICRO = 2  # sequences per DP rank in the equivalence part
CPU_WORLD = {1: 1, 8: 4}  # gloo ranks of the CPU dry path per ``gpus``
# time-estimate constants (``estimate_s``; the records' wall_s are the measurement)
SPAWN_S = 20.0  # a spawned point: interpreter + torch import + CUDA context + NCCL init
DEVICE_INIT_PER_S = 5e9  # the same on a GPU (conservative)
EAGER_EFFICIENCY = 0.35  # fraction of the bf16 peak an eager 1.5B step reaches (estimate)
MFU_TARGET = 0.40  # one GPU, eager bf16 1.5B (no torch.compile, unfused LayerNorm/GELU)
DRY_RUN_S_PER_LAYER = 0.3  # paper-scale dry run, 2 iterations (0.23 s/layer on 2 cores)


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


def _cluster_overrides(name: str) -> dict:
    c = load_cluster(name)
    return {f"cluster.{k}": getattr(c, k) for k in ("name", "device", "backend",
                                                     "gpus_per_node", "device_memory_gb",
                                                     "device_memory_mib", "peak_tflops")}


def _model_overrides(spec) -> dict:
    spec = C.model_conf(spec) if isinstance(spec, str) else dict(spec)
    return {f"model.{k}": v for k, v in spec.items()}


def plan(cfg) -> list[Point]:
    p, dev, gpus = _params(cfg)
    cuda = dev == "cuda"
    world = gpus if cuda else CPU_WORLD[gpus]
    base = {"parallel.world_size": world, "parallel.tp": 1, "train.progress": False,
            **(_cluster_overrides(p.get("cluster", "h200")) if cuda else {})}
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
    cluster = p.get("cluster", "h200")
    for s in setups("fig7"):
        label = f"{s.size_label} {s.zero_config}"
        if label not in list(pp.get("points") or []):
            continue
        ov = setup_overrides(s, cluster if cuda else "dgx2_v100")
        if cuda:
            ov.update(_cluster_overrides(cluster))
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
def estimate_s(cfg, point: Point) -> float:
    """Seconds ``point`` (of ``cfg``'s plan, its config ``point_cfg``) is expected to take on the
    cluster's GPUs: process start, initialisation and steps at ``EAGER_EFFICIENCY`` of the
    peak (the constants above). On the CPU dry path: 0 (not estimated)."""
    q = point.params
    if q["device"] != "cuda":
        return 0.0
    pc = _point_cfg(cfg, point)
    m, peak = pc.model, max(pc.cluster.peak_tflops, 1.0) * 1e12
    psi = flops.param_count(m)
    step_flops = flops.hardware_flops_per_iteration(
        pc.train.micro_batch_size, m.seq_len, m.n_layer, m.n_embd, C.padded_vocab(m, 1),
        pc.zero_r.activation_checkpointing)
    compute = step_flops / (EAGER_EFFICIENCY * peak)
    part = q["part"]
    if part == "probe":
        return SPAWN_S + 5
    if part == "equivalence":
        return SPAWN_S + 4.0 * len(q["tps"]) * len(q["stages"])
    if part == "offload":
        return SPAWN_S + 2 * (psi / DEVICE_INIT_PER_S + q["steps"] * (compute + 1.0))
    if part == zero_offload.PART:
        return zero_offload.estimate_s(q, psi, compute, SPAWN_S, DEVICE_INIT_PER_S)
    if part == "throughput":  # built on the device (train.build), the real trainer's steps
        return SPAWN_S + psi / DEVICE_INIT_PER_S + 10 + pc.train.steps * compute
    if part == "paper":
        tp = pc.parallel.tp
        return (psi / DEVICE_INIT_PER_S + q["iterations"] * compute / tp + 10
                + DRY_RUN_S_PER_LAYER * m.n_layer)
    # node: per stage a build on the device, warm-up + timed + one profiled step
    return SPAWN_S + len(q["stages"]) * (psi / DEVICE_INIT_PER_S + 10
                                         + (q["warmup"] + q["steps"] + 1) * compute)


def _point_cfg(cfg, point: Point):
    return point_config(cfg, point.overrides)


def plan_note(cfg, points: list[Point]) -> list[str]:
    """Lines the plan prints under the points: the time estimate against the budget."""
    p, dev, gpus = _params(cfg)
    if dev != "cuda":
        return ["CPU dry path (tiny sizes on gloo): no time estimate; the GPU run is "
                "experiment.params.device=cuda"]
    budget = float(p.get("budget_min", 10)) * 60
    est = [(pt.name, estimate_s(cfg, pt)) for pt in points]
    total = sum(s for _, s in est)
    name = p.get("cluster", "h200")
    lines = [f"time estimate on {gpus} x {name} GPU(s): {total / 60:.1f} min of the "
             f"{budget / 60:.0f} min budget (experiment.params.budget_min), parts in the "
             f"order above:",
             "  " + " | ".join(f"{n} {s / 60:.1f}" for n, s in est),
             f"  (an estimate: {SPAWN_S:.0f} s per spawned point, weights drawn on the "
             f"device at {DEVICE_INIT_PER_S / 1e9:.0f}G samples/s, steps at "
             f"{EAGER_EFFICIENCY:.0%} of the peak, the dry run {DRY_RUN_S_PER_LAYER} s per "
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
        out = _run_paper(cfg, point)
    elif part == "throughput":
        out = _run_throughput(cfg, point)
    else:
        fn = {"probe": probe_rank, "equivalence": equivalence_rank, "offload": offload_rank,
              "node": node_rank, zero_offload.PART: zero_offload.zero_offload_rank}[part]
        one = part in ("offload", zero_offload.PART)
        res = spawn(fn, 1 if one else world, cfg, dict(q), backend=backend,
                    timeout_s=cfg.launcher.collective_timeout_s)
        out = {"metrics": _judge(part, q, res[0])}
    out.setdefault("metrics", {}).update({
        "part": part, "device": q["device"], "gpus": q["gpus"],
        "device_name": torch.cuda.get_device_name(0) if q["device"] == "cuda"
        else f"cpu ({torch.__version__})", "wall_s":
        time.perf_counter() - t0, "estimate_s": estimate_s(cfg, point),
        # world 1 = DP 1: every collective returns early, no NCCL communicator moves a bucket
        "nccl_exercised": q["device"] == "cuda" and world > 1 and part not in ("paper",)})
    return out


def _judge(part: str, q: dict, m: dict) -> dict:
    """The part's pass/fail checks (``checks``) from what rank 0 returned."""
    checks = {}
    if part == "probe":
        checks = {k: bool(v) for k, v in m["checks"].items()}
    elif part == "equivalence":
        checks = {k: r["max_abs_diff"] <= q["tol"] for k, r in m["configs"].items()}
    elif part == "offload":
        checks = {"losses": m["max_loss_rel_diff"] <= q["loss_rtol"],
                  "parameters": m["max_abs_param_diff"] <= q["param_atol"],
                  "ckpt_cpu": m["ckpt_cpu_bytes"] > 0}
    elif part == zero_offload.PART:
        checks = zero_offload.checks(q, m)
    elif part == "node":
        # CUDA: the training steps' real peak; CPU: the ledger's model states (a tiny model's
        # gather buffers would outweigh what the stages save)
        key = "peak_bytes" if q["device"] == "cuda" else "model_state_bytes"
        vals = [m["stages"][str(k)][key] for k in q["stages"]]
        checks[f"{key}_falls_with_stage"] = all(a > b for a, b in zip(vals, vals[1:]))
        if q["device"] == "cuda":
            m["targets"] = node_targets(m["stages"])
    return {**m, "checks": checks, "passed": all(checks.values())}


def node_targets(stages: dict) -> dict:
    """The node's speed targets (a miss is a result, not a failed proof): stages 1-2 within 5%
    of stage 0's step, stage 3 within 25%, >= 60% of NCCL time under compute at stages 0-2."""
    out = {}
    for k, s in stages.items():
        if k in ("1", "2"):
            out[f"stage{k}_step<=1.05x"] = s["step_over_stage0"] <= 1.05
        if k == "3":
            out["stage3_step<=1.25x"] = s["step_over_stage0"] <= 1.25
        if k in ("0", "1", "2") and s.get("nccl_overlapped_share") is not None:
            out[f"stage{k}_overlap>=0.6"] = s["nccl_overlapped_share"] >= 0.6
    return out


def _rank_device(dev: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dev == "cuda" \
        else torch.device("cpu")


def _strict_fp32(device: torch.device) -> None:
    """Full fp32 matmuls (no TF32) for the equivalence checks."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False


def _topology(tp: int, force_native: bool) -> Topology:
    topo = Topology.build(tp)
    if force_native:  # the NCCL ranks' bucket transport (NativeTransport), on gloo
        topo.model_transport("native")
    return topo


# ------------------------------------------------------------------------------ (1) probe
def probe_rank(rank: int, world: int, cfg: C.Config, q: dict) -> dict:
    """Versions, the device kernels the runtime relies on, and at world > 1 the collectives
    of known values. Module level, for ``spawn``."""
    device = _rank_device(q["device"])
    info = {"torch": torch.__version__, "cuda": torch.version.cuda or "",
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
            else platform.machine(), "backend": comm.backend(), "world": world}
    if device.type == "cuda":
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
        v = torch.cuda.nccl.version()  # a tuple; an int on older torch
        info["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    checks = {}
    p = torch.randn(1000, device=device)
    g, m, v = torch.randn_like(p), torch.zeros_like(p), torch.zeros_like(p)
    ref = p.clone()
    torch._fused_adamw_([p], [g], [m], [v], [], [torch.tensor(1.0, device=device)], lr=1e-3,
                        beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False,
                        maximize=False)
    checks["fused_adamw"] = bool(torch.isfinite(p).all()) and not torch.equal(p, ref)
    xs = [torch.randn(100, device=device, dtype=torch.bfloat16) for _ in range(3)]
    norms = torch._foreach_norm(xs, 2, dtype=torch.float32)
    checks["foreach_norm_bf16_fp32"] = all(n.dtype == torch.float32 for n in norms)
    t = torch.arange(4096.0, device=device)
    st = t.untyped_storage()
    size = st.nbytes()
    st.resize_(0)
    st.resize_(size)
    t.copy_(torch.arange(4096.0, device=device))
    checks["storage_resize"] = float(t[-1]) == 4095.0
    if world > 1:
        topo = Topology.build(1)
        x = torch.full((world * 4,), float(rank + 1), device=device)
        comm.all_reduce(x, topo.world)
        checks["all_reduce"] = bool((x == world * (world + 1) / 2).all())
        out = torch.empty(4, device=device)
        comm.reduce_scatter_into(out, torch.arange(world * 4.0, device=device), topo.world)
        checks["reduce_scatter"] = bool((out == world * torch.arange(
            rank * 4.0, rank * 4.0 + 4, device=device)).all())
        full = torch.empty(world * 4, device=device)
        comm.all_gather_into(full, torch.full((4,), float(rank), device=device), topo.world)
        checks["all_gather"] = bool((full == torch.arange(world, device=device)
                                     .repeat_interleave(4)).all())
    return {**info, "checks": checks}


# ------------------------------------------------------------------------ (2) equivalence
class _Reference:
    """The TP=1 model, ``torch.optim.AdamW`` + ``clip_grad_norm_`` on the global batch."""

    def __init__(self, m: C.ModelConfig, device, train: C.TrainConfig, clip: float):
        self.model = GPT(m, device=device, dtype=torch.float32, seed=SEED)
        self.clip = clip
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=train.lr,
                                     betas=(train.beta1, train.beta2), eps=train.eps,
                                     weight_decay=train.weight_decay)

    def step(self, idx, tgt) -> None:
        _, loss = self.model(idx, tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.opt.zero_grad()


def _batch(m: C.ModelConfig, step: int, rows: int):
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randint(0, m.vocab_size, (rows, m.seq_len), generator=g),
            torch.randint(0, m.vocab_size, (rows, m.seq_len), generator=g))


def _tp1_params(strategy, topo: Topology, m: C.ModelConfig, device) -> dict:
    """The strategy's parameters gathered over DP, then over TP: the TP=1 model's tensors."""
    full = strategy.full_parameters()
    shadow = GPT(m, topo.tp_group, device=device, dtype=torch.float32, seed=SEED)
    with torch.no_grad():
        for n, p in shadow.named_parameters():
            p.copy_(full[n])
    enabled, topo.ledger.enabled = topo.ledger.enabled, False
    try:
        return gather_full_state(shadow, topo.tp_group)
    finally:
        topo.ledger.enabled = enabled


def equivalence_rank(rank: int, world: int, cfg: C.Config, q: dict) -> dict:
    """Every (TP layout, stage) of ``q`` against the reference (on global rank 0)."""
    device = _rank_device(q["device"])
    _strict_fp32(device)
    m = cfg.model
    train = C.TrainConfig(micro_batch_size=MICRO, lr=1e-3, eps=1e-6, weight_decay=0.1)
    configs = {}
    for tp in q["tps"]:
        for stage in q["stages"]:
            topo = _topology(tp, force_native=q["device"] == "cpu")
            model = GPT(m, topo.tp_group, device=device, dtype=torch.float32, seed=SEED)
            zero = C.ZeroConfig(stage=stage, dtype="fp32", grad_clip=1.0,
                                reduce_bucket_size=q["bucket"],
                                allgather_bucket_size=q["bucket"])
            zr = C.ZeroRConfig(name="custom", constant_buffers=True)
            strategy = build_strategy(model, topo, C.effective_zero(zero, device.type), train,
                                      zr)
            ref = _Reference(m, device, train, 1.0) if rank == 0 else None
            losses: list = []
            for step in range(q["steps"]):
                idx, tgt = _batch(m, step, topo.dp * MICRO)
                r0 = topo.dp_rank * MICRO
                train_step(strategy, [(idx[r0:r0 + MICRO].to(device),
                                       tgt[r0:r0 + MICRO].to(device))], on_loss=losses.append)
                if ref is not None:
                    ref.step(idx.to(device), tgt.to(device))
            theta = _tp1_params(strategy, topo, m, device)
            if ref is not None:
                want = dict(ref.model.named_parameters())
                diff = max(float((theta[n] - want[n].detach()).abs().max()) for n in theta)
                configs[f"tp{tp} dp{topo.dp} stage{stage}"] = {
                    "max_abs_diff": diff, "losses": [float(v) for v in losses],
                    "transport": strategy.transport.name}
            strategy.remove_hooks()
    return {"configs": configs, "dtype": "fp32", "tf32": False, "steps": q["steps"]}


# ---------------------------------------------------------------------- (3) offload (P_a+cpu)
def offload_rank(rank: int, world: int, cfg: C.Config, q: dict) -> dict:
    """Stage 2 fp32 at world 1: checkpoints on the device, then P_a+cpu, same seeds."""
    device = _rank_device(q["device"])
    _strict_fp32(device)
    runs = {}
    for where, cpu in (("device", False), ("cpu", True)):
        c = C.Config(model=cfg.model, train=C.TrainConfig(
            micro_batch_size=cfg.train.micro_batch_size, lr=1e-3, seed=SEED))
        c.parallel.world_size, c.cluster = 1, cfg.cluster
        c.zero = C.ZeroConfig(stage=2, dtype="fp32", reduce_bucket_size=50_000_000,
                              allgather_bucket_size=50_000_000)
        c.zero_r = C.ZeroRConfig(name="custom", activation_checkpointing=True,
                                 partition_activations=True, cpu_checkpointing=cpu,
                                 constant_buffers=True, contiguous_memory=True)
        topo = Topology.build(1)
        model, ckpt, strategy = build(c, topo, device)
        losses: list = []
        for step in range(q["steps"]):
            idx, tgt = _batch(c.model, step, c.train.micro_batch_size)
            train_step(strategy, [(idx.to(device), tgt.to(device))], on_loss=losses.append)
        runs[where] = {"losses": [float(v) for v in losses], "memory": ckpt.memory(),
                       "theta": {n: p.float().cpu() for n, p in
                                 strategy.full_parameters().items()}}
        strategy.remove_hooks()
        del model, ckpt, strategy
        gc.collect()
    a, b = runs["device"], runs["cpu"]
    return {"losses_device": a["losses"], "losses_cpu": b["losses"],
            "max_loss_rel_diff": max(abs(x - y) / abs(x) for x, y in
                                     zip(a["losses"], b["losses"])),
            "max_abs_param_diff": max(float((a["theta"][n] - b["theta"][n]).abs().max())
                                      for n in a["theta"]),
            "ckpt_cpu_bytes": b["memory"].get("ckpt_cpu", 0),
            "ckpt_device_bytes_without_offload": a["memory"].get("ckpt_device", 0)}


# ------------------------------------------------------------------ (4) throughput, one GPU
def _run_throughput(cfg, point: Point) -> dict:
    res = run_training(cfg, point.run_dir or "outputs/gpu_proof_throughput")
    m = res["metrics"]
    keep = ("step_time_s", "tflops_per_gpu", "model_tflops_per_gpu", "hardware_tflops_per_gpu",
            "mfu", "hfu", "tokens_per_s", "params_total", "loss_first", "loss_last",
            "skipped_steps")
    return {"metrics": {"stage": cfg.zero.stage, **{k: m[k] for k in keep if k in m}},
            "memory": res["memory"], "hardware": res.get("hardware", {})}


# ---------------------------------------------------------------- (5) paper points, one rank
def _run_paper(cfg, point: Point) -> dict:
    q = point.params
    its = int(q["iterations"])
    real = _one_rank_real(cfg, q["device"], its)
    # the dry run accounts the same (NCCL's) bucket transport as the real rank ran
    pred = dry_run(cfg, rank=0, iterations=its, keep_trace=False, transport_of="native",
                   allocator_capacity=device_bytes(cfg.cluster) or None)
    m = {"point": q["point"], "n_layer": cfg.model.n_layer, "paper_n_layer": q["paper_n_layer"],
         "world_size": cfg.parallel.world_size, "tp": cfg.parallel.tp, "stage": cfg.zero.stage,
         "zero_r": cfg.zero_r.name, "micro_batch_size": cfg.train.micro_batch_size,
         "transport": "native", **real,
         "predicted_model_state_bytes": pred.model_state_bytes,
         "predicted_comm_buffers": pred.ledger.get("comm_buffers", 0),
         "predicted_peak_allocated": pred.allocator["peak_allocated"],
         "predicted_peak_reserved": pred.allocator["peak_reserved"],
         "predicted_oom": pred.allocator["oom"], "dry_run_s": pred.timings["total_s"]}
    m["model_states_ratio"] = real["model_state_bytes"] / pred.model_state_bytes
    m["comm_buffers"] = real["ledger"].get("comm_buffers", 0)
    checks = {"model_states": m["model_states_ratio"] == 1.0,
              "same_transport_buffers": m["comm_buffers"] == m["predicted_comm_buffers"],
              "no_skipped_steps": real["skipped_steps"] == 0}
    if q["device"] == "cuda":
        m["allocated_ratio"] = real["cuda_max_allocated"] / pred.allocator["peak_allocated"]
        m["reserved_ratio"] = real["cuda_max_reserved"] / pred.allocator["peak_reserved"]
        lo, hi = q["ratio_range"]
        checks["allocated_ratio"] = lo <= m["allocated_ratio"] <= hi
    return {"metrics": {**m, "checks": checks, "passed": all(checks.values())},
            "memory": pred.ledger}


def _one_rank_real(cfg, dev: str, iterations: int) -> dict:
    """Rank 0 of ``cfg``'s world on the fake process group, real tensors on ``dev``, built on
    the device, NCCL's bucket transport (its buffers; the collectives do nothing)."""
    if comm.is_initialized():
        raise RuntimeError("the paper points need their own fake process group: run the "
                           "gpu_proof experiment in a process without one")
    device = launch.cuda_device(0) if dev == "cuda" else torch.device("cpu")
    launch.init_fake(0, cfg.parallel.world_size)
    out: dict = {}
    try:
        topo = _topology(cfg.parallel.tp, force_native=True)
        t0 = time.perf_counter()
        model, ckpt, strategy = build(cfg, topo, device, make_model=_device_built_gpt)
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
            x = torch.randint(0, m.vocab_size, (t.micro_batch_size, m.seq_len), device=device)
            # under the fake group a collective leaves its output as it was: a skipped (fp16
            # overflow) step is possible and is counted, not hidden
            info = train_step(strategy, [(x, torch.roll(x, -1, 1))])
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


def _device_built_gpt(cfg, topo, device, dtype) -> GPT:
    """``build``'s model step with the weights drawn on the device (seconds for a paper rank)."""
    return GPT(cfg.model, tp_group=topo.tp_group, device=device, dtype=dtype, init_on="device")


# -------------------------------------------------------------------- (6) one node, stages 0-3
def node_rank(rank: int, world: int, cfg: C.Config, q: dict) -> dict:
    """Stages 0-3 of the 1.5B GPT (bf16, C_B on) at DP ``world``: windowed step time, one
    profiled step's NCCL/compute overlap, the training steps' peak memory."""
    device = _rank_device(q["device"])
    m, t = cfg.model, cfg.train
    stages = {}
    for stage in q["stages"]:
        topo = _topology(1, force_native=q["device"] == "cpu")
        model = GPT(m, topo.tp_group, device=device, dtype=torch.bfloat16, seed=SEED,
                    init_on="device")
        zero = C.ZeroConfig(stage=stage, dtype="bf16", reduce_bucket_size=q["bucket"],
                            allgather_bucket_size=q["bucket"])
        zr = C.ZeroRConfig(name="custom", constant_buffers=True)
        strategy = build_strategy(model, topo, C.effective_zero(zero, device.type),
                                  C.TrainConfig(micro_batch_size=t.micro_batch_size), zr)
        batches = [tuple(x.to(device) for x in _batch(m, k, t.micro_batch_size))
                   for k in range(2)]

        def one(k: int, strategy=strategy) -> None:
            train_step(strategy, [batches[k % 2]])

        for k in range(q["warmup"]):
            one(k)
        peak0 = _reset_peak(device)
        step_s = _window(device, one, q["steps"])
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
        ledger = strategy.memory_ledger()
        stages[str(stage)] = {"step_s": step_s, "peak_bytes": peak or ledger.total(),
                              "peak_kind": "cuda_max_allocated" if peak else "ledger_total",
                              "build_peak_bytes": peak0,
                              "model_state_bytes": ledger.model_states(),
                              "transport": strategy.transport.name,
                              **overlap_of_step(device, lambda: one(0))}
        strategy.remove_hooks()
        del model, strategy
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    base = stages[str(q["stages"][0])]["step_s"]
    for s in stages.values():
        s["step_over_stage0"] = s["step_s"] / base
    return {"stages": stages, "world": world, "dtype": "bf16"}


def _reset_peak(device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    return peak


def _window(device, one, steps: int) -> float:
    """Mean seconds per step over ``steps`` steps: CUDA events around the window, one sync."""
    if device.type == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for k in range(steps):
            one(k)
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3 / steps
    t0 = time.perf_counter()
    for k in range(steps):
        one(k)
    return (time.perf_counter() - t0) / steps


def overlap_of_step(device, one) -> dict:
    """One step under ``torch.profiler``: its CUDA kernels split into NCCL and compute
    (``overlap_stats``). On CPU there are no kernels to split: the keys hold None."""
    if device.type != "cuda":
        return {"nccl_s": None, "nccl_overlapped_share": None, "nccl_exposed_s": None}
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        one()
        torch.cuda.synchronize(device)
    kernels = [(e.name, e.time_range.start / 1e6, e.time_range.end / 1e6)
               for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return overlap_stats(kernels)


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def overlap_stats(kernels: list[tuple[str, float, float]]) -> dict:
    """(name, start_s, end_s) of a step's kernels -> NCCL kernel time (union), the share of it
    that ran while some compute kernel ran, and the exposed rest (NCCL time with no compute)."""
    nccl = _union([(a, b) for n, a, b in kernels if "nccl" in n.lower()])
    compute = _union([(a, b) for n, a, b in kernels if "nccl" not in n.lower()])
    total = sum(b - a for a, b in nccl)
    under = sum(max(0.0, min(b, d) - max(a, c)) for a, b in nccl for c, d in compute)
    return {"nccl_s": total, "nccl_overlapped_share": under / total if total else None,
            "nccl_exposed_s": total - under}


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

    thr = {}
    for r in newest.values():
        m = r.metrics
        part = m.get("part")
        row(r, part, r.point, "wall_s", m.get("wall_s"), "s")
        if "passed" in m:
            row(r, part, r.point, "passed", float(m["passed"]), "bool")
        if part == "equivalence":
            for k, c in m["configs"].items():
                row(r, part, k, "max_abs_diff", c["max_abs_diff"], "abs")
        elif part == "throughput":
            thr[m["stage"]] = r
            for y, unit in (("step_time_s", "s"), ("mfu", "fraction"), ("hfu", "fraction"),
                            ("model_tflops_per_gpu", "TFLOPs")):
                if m.get(y) is not None:
                    row(r, part, r.point, y, m[y], unit)
        elif part == "paper":
            for y in ("cuda_max_allocated", "predicted_peak_allocated", "model_state_bytes",
                      "predicted_model_state_bytes"):
                if m.get(y) is not None:
                    row(r, part, m["point"], f"{y}_GB", m[y] / GB, "GB")
            for y in ("model_states_ratio", "allocated_ratio", "reserved_ratio"):
                if m.get(y) is not None:
                    row(r, part, m["point"], y, m[y], "x")
        elif part == zero_offload.PART:
            for x, y, v, unit in zero_offload.rows(m):
                row(r, part, x, y, v, unit)
        elif part == "node":
            for k, s in m["stages"].items():
                row(r, part, f"stage{k}", "step_s", s["step_s"], "s")
                row(r, part, f"stage{k}", "peak_GB", s["peak_bytes"] / GB, "GB")
                if s.get("nccl_overlapped_share") is not None:
                    row(r, part, f"stage{k}", "nccl_overlapped_share",
                        s["nccl_overlapped_share"], "fraction")
    if 0 in thr and 3 in thr:
        ratio = thr[3].metrics["step_time_s"] / thr[0].metrics["step_time_s"]
        row(thr[3], "throughput", "stage3/stage0", "step_time_ratio", ratio, "x")
        if thr[0].metrics.get("device") == "cuda":  # targets: a miss is a result, not a failure
            row(thr[3], "throughput", "targets", "stage3_over_stage0<=1.10", float(ratio <= 1.10),
                "bool")
            if thr[0].metrics.get("mfu") is not None:
                row(thr[0], "throughput", "targets", f"mfu_stage0>={MFU_TARGET}",
                    float(thr[0].metrics["mfu"] >= MFU_TARGET), "bool")
    return rows


def plot(table, out_dir: str) -> list[str]:
    """A bar per part (wall time, passed or not) and ``report.md``: the proof's short report."""
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    ours = table[table["kind"] != "paper"]
    walls = ours[ours["y_name"] == "wall_s"]
    passed = {(r.series, r.x_value): r.y_value for r in ours[ours["y_name"] == "passed"]
              .itertuples()}
    fig, ax = plt.subplots(figsize=(7, 3.2))
    colors = ["tab:green" if passed.get((r.series, r.x_value), 1.0) else "tab:red"
              for r in walls.itertuples()]
    ax.barh([str(x) for x in walls["x_value"]], walls["y_value"], color=colors)
    ax.set_xlabel("wall time (s); red = a check failed")
    ax.set_title("GPU proof: parts in order (" + ", ".join(sorted(
        {str(d) for d in ours["device_name"].dropna().unique() if d})) + ")", fontsize=9)
    ax.invert_yaxis()
    fig.tight_layout()
    paths = []
    for ext in ("png", "pdf"):
        path = os.path.join(out_dir, f"{FIGURE}.{ext}")
        fig.savefig(path, dpi=110)
        paths.append(path)
    plt.close(fig)
    report = os.path.join(out_dir, "report.md")
    with open(report, "w") as f:
        f.write(report_text(ours))
    return paths + [report]


def report_text(ours) -> str:
    """The proof's short report from the table's rows (measured; device names as recorded)."""
    lines = ["# GPU proof report", "",
             "Generated from the records (`python -m experiments.plot gpu_proof`). Measured on: "
             + (", ".join(sorted({str(d) for d in ours["device_name"].dropna().unique() if d}))
                or "?") + ". World 1 = DP 1: no NCCL communicator carries a bucket there.", "",
             "| part | point | y | value | unit |", "|---|---|---|---|---|"]
    for r in ours.itertuples():
        v = r.y_value
        txt = f"{v:.4g}" if isinstance(v, float) and math.isfinite(v) else str(v)
        lines.append(f"| {r.series} | {r.x_value} | {r.y_name} | {txt} | {r.unit} |")
    return "\n".join(lines) + "\n"
