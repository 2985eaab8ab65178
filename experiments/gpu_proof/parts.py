"""The GPU proof's parts as rank programs and their verdicts (``experiments/gpu_proof/`` plans
the points and states the time estimate; its docstring says what each part proves): the
probe, the equivalence against ``torch.optim.AdamW`` (``lab.checks.equivalence``, shared with
the tests), P_a+cpu against checkpoints on the device, throughput through the real trainer, a
paper rank against its dry run (peak memory by category, ``lab.cuda_memory``), and one node's
stages 0-3 (step time, NCCL overlap from one profiled step, peak memory).
"""
from __future__ import annotations

import gc
import platform
import time

import torch

from zero_repro import config as C
from zero_repro.lab import cuda_memory
from zero_repro.lab import memory_view
from experiments.gpu_proof import offload, offload_param
from zero_repro.lab.checks.equivalence import AdamWReference, max_abs_diff, tp1_parameters
from zero_repro.lab.launcher import run_training
from zero_repro.lab.points import Point
from zero_repro.lab.rank import reset_peaks
from zero_repro.runtime.comm import comm, launch
from zero_repro.runtime.comm.topology import Topology
from zero_repro.runtime.model.gpt import GPT
from zero_repro.runtime.train.trainer import Trainer
from zero_repro.scale.dryrun.dryrun import dry_run
from zero_repro.scale.hardware import device_bytes

SEED = 7
MICRO = 2  # sequences per DP rank in the equivalence part


def judge(part: str, q: dict, m: dict) -> dict:
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
    elif part == offload.PART:
        checks = offload.checks(q, m)
    elif part == offload_param.PART:
        checks = offload_param.checks(q, m)
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
def _batch(m: C.ModelConfig, step: int, rows: int):
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randint(0, m.vocab_size, (rows, m.seq_len), generator=g),
            torch.randint(0, m.vocab_size, (rows, m.seq_len), generator=g))


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
            run = C.Config(model=m, zero=zero, train=train, cluster=cfg.cluster,
                           zero_r=C.ZeroRConfig(name="custom", constant_buffers=True))
            trainer = Trainer(run, topo, device, model=model)
            strategy = trainer.strategy
            ref = AdamWReference(GPT(m, device=device, dtype=torch.float32, seed=SEED), train,
                                 1.0) if rank == 0 else None
            losses: list = []
            for step in range(q["steps"]):
                idx, tgt = _batch(m, step, topo.dp * MICRO)
                r0 = topo.dp_rank * MICRO
                trainer.step([(idx[r0:r0 + MICRO].to(device),
                               tgt[r0:r0 + MICRO].to(device))], on_loss=losses.append)
                if ref is not None:
                    ref.step(idx.to(device), tgt.to(device))
            theta = tp1_parameters(strategy)
            if ref is not None:
                diff = max_abs_diff(theta, ref.model)[0]
                configs[f"tp{tp} dp{topo.dp} stage{stage}"] = {
                    "max_abs_diff": diff, "losses": [float(v) for v in losses],
                    "transport": strategy.transport.name}
            trainer.close()
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
        trainer = Trainer(c, Topology.build(1), device)
        losses: list = []
        for step in range(q["steps"]):
            idx, tgt = _batch(c.model, step, c.train.micro_batch_size)
            trainer.step([(idx.to(device), tgt.to(device))], on_loss=losses.append)
        runs[where] = {"losses": [float(v) for v in losses], "memory": trainer.ckpt.memory(),
                       "theta": {n: p.float().cpu() for n, p in
                                 trainer.strategy.full_parameters().items()}}
        trainer.close()
        del trainer
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
def run_throughput(cfg, point: Point) -> dict:
    res = run_training(cfg, point.run_dir or "outputs/gpu_proof_throughput", point.checked)
    m = res["metrics"]
    keep = ("step_time_s", "tflops_per_gpu", "model_tflops_per_gpu", "hardware_tflops_per_gpu",
            "mfu", "hfu", "tokens_per_s", "params_total", "loss_first", "loss_last",
            "skipped_steps")
    return {"metrics": {"stage": cfg.zero.stage, **{k: m[k] for k in keep if k in m}},
            "memory": res["memory"], "hardware": res.get("hardware", {})}


# ---------------------------------------------------------------- (5) paper points, one rank
def run_paper(cfg, point: Point) -> dict:
    q = point.params
    its = int(q["iterations"])
    # on CUDA the steps' allocator history is recorded: both snapshots go beside the report
    cuda = q["device"] == "cuda"
    real = _one_rank_real(cfg, q["device"], its, record=cuda)
    # the dry run accounts the same (NCCL's) bucket transport as the real rank ran
    pred = dry_run(cfg, rank=0, iterations=its, keep_trace=cuda, transport_of="native",
                   allocator_capacity=device_bytes(cfg.cluster) or None)
    shots = memory_view.proof_snapshots(cfg, point.name, real.pop("cuda_snapshot"), pred) \
        if cuda else {}
    m = {"point": q["point"], "n_layer": cfg.model.n_layer, "paper_n_layer": q["paper_n_layer"],
         "world_size": cfg.parallel.world_size, "tp": cfg.parallel.tp, "stage": cfg.zero.stage,
         "zero_r": cfg.zero_r.name, "micro_batch_size": cfg.train.micro_batch_size,
         "transport": "native", **real,
         "predicted_model_state_bytes": pred.model_state_bytes,
         "predicted_comm_buffers": pred.ledger.get("comm_buffers", 0),
         "predicted_peak_allocated": pred.allocator["peak_allocated"],
         "predicted_peak_reserved": pred.allocator["peak_reserved"],
         "predicted_oom": pred.allocator["oom"], "dry_run_s": pred.timings["total_s"], **shots}
    m["model_states_ratio"] = real["model_state_bytes"] / pred.model_state_bytes
    m["comm_buffers"] = real["ledger"].get("comm_buffers", 0)
    checks = {"model_states": m["model_states_ratio"] == 1.0,
              "same_transport_buffers": m["comm_buffers"] == m["predicted_comm_buffers"],
              "no_skipped_steps": real["skipped_steps"] == 0}
    # peak device memory by category, measured (ledger + torch.cuda.memory_stats) and predicted
    # (ledger + allocator replay): a miss of the band says which category and why
    cpu_ckpt = cfg.zero_r.cpu_checkpointing
    m["memory_by_category"] = {
        "measured": cuda_memory.measured(real["ledger"], real.get("cuda_memory_stats"), cpu_ckpt),
        "dry_run": cuda_memory.predicted(pred.ledger, pred.allocator, cpu_ckpt)}
    m["ratio_range"] = list(q["ratio_range"])
    m["memory_miss"] = ""
    if q["device"] == "cuda":
        m["allocated_ratio"] = real["cuda_max_allocated"] / pred.allocator["peak_allocated"]
        m["reserved_ratio"] = real["cuda_max_reserved"] / pred.allocator["peak_reserved"]
        lo, hi = q["ratio_range"]
        checks["allocated_ratio"] = lo <= m["allocated_ratio"] <= hi
        m["memory_miss"] = cuda_memory.miss(m["memory_by_category"]["measured"],
                                            m["memory_by_category"]["dry_run"],
                                            m["allocated_ratio"], (lo, hi))
    return {"metrics": {**m, "checks": checks, "passed": all(checks.values())},
            "memory": pred.ledger}


def _one_rank_real(cfg, dev: str, iterations: int, record: bool = False) -> dict:
    """Rank 0 of ``cfg``'s world on the fake process group, real tensors on ``dev``, built on
    the device, NCCL's bucket transport (its buffers; the collectives do nothing). ``record``
    (CUDA): the training steps' allocator history (``torch.cuda.memory.
    _record_memory_history``, from after the build's ``empty_cache`` as the dry run's judged
    trace starts) returned as ``cuda_snapshot`` (``torch.cuda.memory._snapshot()``)."""
    if comm.is_initialized():
        raise RuntimeError("the paper points need their own fake process group: run the "
                           "gpu_proof experiment in a process without one")
    device = launch.cuda_device(0) if dev == "cuda" else torch.device("cpu")
    launch.init_fake(0, cfg.parallel.world_size)
    out: dict = {}
    try:
        topo = _topology(cfg.parallel.tp, force_native=True)
        t0 = time.perf_counter()
        # partitioned construction, each unit's weights drawn on the device (seconds per rank)
        trainer = Trainer(cfg, topo, device)
        out["build_s"] = time.perf_counter() - t0
        if dev == "cuda":
            torch.cuda.synchronize()
            out["cuda_max_allocated_with_build"] = torch.cuda.max_memory_allocated(device)
            torch.cuda.empty_cache()  # the dry run's training trace starts after the build too
            torch.cuda.reset_peak_memory_stats(device)
            if record:
                torch.cuda.memory._record_memory_history(stacks="python", max_entries=2_000_000)
        m, t = cfg.model, cfg.train
        skipped = 0
        for it in range(iterations):
            t0 = time.perf_counter()
            x = torch.randint(0, m.vocab_size, (t.micro_batch_size, m.seq_len), device=device)
            # under the fake group a collective leaves its output as it was: a skipped (fp16
            # overflow) step is possible and is counted, not hidden
            info = trainer.step([(x, torch.roll(x, -1, 1))])
            skipped += int(info.skipped)
            out[f"iteration{it}_s"] = time.perf_counter() - t0
        ledger = trainer.memory_ledger()
        out.update({"model_state_bytes": ledger.model_states(), "ledger": ledger.as_dict(),
                    "skipped_steps": skipped})
        if dev == "cuda":
            torch.cuda.synchronize()
            out["cuda_max_allocated"] = torch.cuda.max_memory_allocated(device)
            out["cuda_max_reserved"] = torch.cuda.max_memory_reserved(device)
            out["cuda_memory_stats"] = cuda_memory.memory_stats(device)
            if record:
                out["cuda_snapshot"] = torch.cuda.memory._snapshot()
                torch.cuda.memory._record_memory_history(enabled=None)
        trainer.close()
        del trainer
    finally:
        comm.destroy_process_group()
        gc.collect()
        if dev == "cuda":
            torch.cuda.empty_cache()
    return out


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
        run = C.Config(model=m, zero=zero, cluster=cfg.cluster,
                       train=C.TrainConfig(micro_batch_size=t.micro_batch_size),
                       zero_r=C.ZeroRConfig(name="custom", constant_buffers=True))
        trainer = Trainer(run, topo, device, model=model)
        strategy = trainer.strategy
        batches = [tuple(x.to(device) for x in _batch(m, k, t.micro_batch_size))
                   for k in range(2)]

        def one(k: int, trainer=trainer) -> None:
            trainer.step([batches[k % 2]])

        for k in range(q["warmup"]):
            one(k)
        peak0 = reset_peaks(device)
        step_s = _window(device, one, q["steps"])
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
        ledger = strategy.memory_ledger()
        stages[str(stage)] = {"step_s": step_s, "peak_bytes": peak or ledger.total(),
                              "peak_kind": "cuda_max_allocated" if peak else "ledger_total",
                              "build_peak_bytes": peak0,
                              "model_state_bytes": ledger.model_states(),
                              "transport": strategy.transport.name,
                              **overlap_of_step(device, lambda: one(0))}
        trainer.close()
        del model, strategy, trainer
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    base = stages[str(q["stages"][0])]["step_s"]
    for s in stages.values():
        s["step_over_stage0"] = s["step_s"] / base
    return {"stages": stages, "world": world, "dtype": "bf16"}


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
