"""The GPU proof's time estimate (``experiments/gpu_proof/``: its plan prints it against the
budget, each record keeps it beside its measured ``wall_s``): seconds per part on the cluster's
GPUs = process start + weights drawn on the device + steps, a step's time its hardware FLOPs
(``runtime.model.flops.hardware_flops_per_iteration``: the model FLOPs plus the recomputed
forward) at ``EAGER_EFFICIENCY`` of the cluster's peak. An estimate, not a measurement: the
constants below are conservative guesses.
"""
from __future__ import annotations

from zero_repro import config as C
from experiments.gpu_proof import offload as zero_offload
from experiments.gpu_proof import offload_param
from zero_repro.lab.points import Point
from zero_repro.lab.sweep import point_config
from zero_repro.runtime.model import flops

# time-estimate constants (``estimate_s``; the records' wall_s are the measurement)
SPAWN_S = 20.0  # a spawned point: interpreter + torch import + CUDA context + NCCL init
DEVICE_INIT_PER_S = 5e9  # the same on a GPU (conservative)
EAGER_EFFICIENCY = 0.35  # fraction of the bf16 peak an eager 1.5B step reaches (estimate)
DRY_RUN_S_PER_LAYER = 0.3  # paper-scale dry run, 2 iterations (0.23 s/layer on 2 cores)


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
    if part == offload_param.PART:
        return offload_param.estimate_s(q, psi, compute, SPAWN_S, DEVICE_INIT_PER_S)
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
