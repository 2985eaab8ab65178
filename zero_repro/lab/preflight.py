"""Pre-flight checks of a sweep's points against this machine, before the first point runs.

``check_points``: what a point needs from the machine that starts its ranks, so a point that
cannot run is a user error (one line, exit 2), not a ``failed`` record or an OOM-killed machine:
files and devices (``launcher.check_runnable``); cores (more local ranks than ``RANKS_PER_CORE``
x the usable cores is refused: gloo ranks spin in their collectives); memory
(``estimate_rank_bytes``: the closed-form estimate of paper §3/§5/§6, ``zero_repro.scale.analytic``,
plus a process per rank, summed over this machine's ranks, against the memory available now --
the smallest of MemAvailable, the memory cgroup's limit and Slurm's ``--mem``,
``lab.host_memory.available`` -- or each device's; with ZeRO-Offload the device's part and the
host's part apart, ``rank_bytes``: the host's, of every local rank, against the host's memory). ``launcher.oversubscribe=true`` skips the
resource checks (and ``launcher.check_runnable``'s GPU count: a point that starts fewer processes than its world has
ranks, as the GPU proof's paper points, one process playing rank 0). Applies to points that
start ranks here (``runs_here``: measured, ``launcher=local|torchrun``, or slurm in an allocation).
"""
from __future__ import annotations

import dataclasses
import os

import torch

from zero_repro import config as C
from zero_repro.lab import host_memory, launcher
from zero_repro.runtime.model import flops
from zero_repro.scale import analytic
from zero_repro.scale.estimate_time import shard_of
from zero_repro.scale.paper.table1 import model_state_bytes, offload_bytes

RANKS_PER_CORE = 4  # fig5's default 4 ranks must run on a 2-core laptop; 64 must not
PROCESS_BYTES = 0.35e9  # one rank's Python + torch + gloo before the model (measured: ~0.3 GB)


def runs_here(cfg: C.Config, mode: str) -> bool:
    """Whether a point of this mode starts ranks on this machine."""
    if mode != "measured":
        return False
    return cfg.launcher.name != "slurm" or "SLURM_JOB_ID" in os.environ


def check_points(planned) -> None:
    """ValueError naming the first point (a PlannedPoint of ``lab.sweep``) that cannot run
    here, and the setting to change. Each point that passes carries the verdict
    (``point.checked``): its ``run_training`` does not check it again."""
    for pp in planned:
        if not runs_here(pp.cfg, pp.point.mode):
            continue
        try:
            resume = launcher.check_runnable(pp.cfg, pp.point.run_dir)
            check_resources(pp.cfg)
        except ValueError as e:
            raise ValueError(f"point {pp.point.name!r}: {e}") from None
        pp.point = dataclasses.replace(pp.point, checked=launcher.checked(
            pp.cfg, pp.point.run_dir, resume))


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def rank_bytes(cfg: C.Config) -> tuple[float, float]:
    """(device, host) closed-form bytes of one rank at its peak: ``estimate_rank_bytes`` with
    the model states of ZeRO-Offload (``zero.offload_optimizer`` / ``offload_param``) split as
    Table 1's offload column says (``table1.offload_bytes``); host 0 without offload."""
    total = estimate_rank_bytes(cfg)
    z = cfg.zero
    if z.offload_optimizer != "cpu" and z.offload_param != "cpu":
        return total, 0.0
    psi = flops.param_count_per_tp_rank(cfg.model, cfg.parallel.tp)
    n_d = cfg.parallel.world_size // cfg.parallel.tp
    lp = 4 if z.dtype == "fp32" else 2
    plain = model_state_bytes(psi, z.stage, n_d, lp_bytes=lp)
    split = offload_bytes(psi, z.stage, n_d, lp_bytes=lp, optimizer=z.offload_optimizer,
                          param=z.offload_param)
    return total - plain + split["device"], split["host"]


def estimate_rank_bytes(cfg: C.Config) -> float:
    """Closed-form bytes one rank holds at its peak (paper §3, §5, §6; ``analytic``)."""
    m, p, z, zr, t = cfg.model, cfg.parallel, cfg.zero, cfg.zero_r, cfg.train
    mem = analytic.MemConfig(stage=z.stage, checkpointing=zr.activation_checkpointing,
                             p_a=zr.partition_activations, cpu=zr.cpu_checkpointing,
                             c_b=zr.constant_buffers, m_d=zr.contiguous_memory)
    parts = analytic.memory_breakdown(
        m.n_layer, m.n_embd, m.n_head, p.tp, p.world_size // p.tp, t.micro_batch_size,
        config=mem, seq=m.seq_len, vocab=C.padded_vocab(m, p.tp),
        reduce_bucket=z.reduce_bucket_size, allgather_bucket=z.allgather_bucket_size,
        dropout=m.dropout > 0, buffer_lp_bytes=4 if z.dtype == "fp32" else 2,
        transport="native" if cfg.cluster.device == "cuda" else "gloo",
        shard_size=shard_of(cfg) or None)
    # the closed form counts 2-byte activations; fp32 runs keep 4-byte ones (model states are
    # 16 bytes/parameter either way: fp32 params+grads+m+v = fp16 params+grads + K=12)
    act = 2.0 if z.dtype == "fp32" else 1.0
    acts = parts["activation_checkpoints"] + parts["activation_working"] + parts["logits"]
    states = sum(v for k, v in parts.items()
                 if k not in ("activation_checkpoints", "activation_working", "logits"))
    return states + act * acts


def check_resources(cfg: C.Config) -> None:
    """ValueError if the point's local ranks oversubscribe this machine's cores or memory
    (skipped with ``launcher.oversubscribe=true``)."""
    if cfg.launcher.oversubscribe:
        return
    ranks = launcher.local_ranks(cfg)
    cores = usable_cores()
    if cfg.cluster.device == "cpu" and ranks > RANKS_PER_CORE * cores:
        raise ValueError(f"parallel.world_size={cfg.parallel.world_size} starts {ranks} ranks on "
                         f"{cores} CPU cores (at most {RANKS_PER_CORE * cores} run usefully): "
                         f"lower parallel.world_size, or force it with "
                         f"launcher.oversubscribe=true")
    per_rank, host_part = rank_bytes(cfg)
    m = cfg.model
    what = (f"model={m.name} ({m.n_layer} layers x {m.n_embd} hidden) with "
            f"train.micro_batch_size={cfg.train.micro_batch_size}")
    if cfg.cluster.device == "cuda" and torch.cuda.is_available():
        have = torch.cuda.get_device_properties(0).total_memory
        if per_rank > have:
            raise ValueError(f"{what} needs ~{per_rank / 1e9:.1f} GB per "
                             f"GPU (analytic estimate), the GPU has {have / 1e9:.1f} GB: use a "
                             f"smaller model or batch, a higher zero.stage, or force it with "
                             f"launcher.oversubscribe=true")
        if host_part:  # ZeRO-Offload: the host's part of every rank on this machine
            need, (have, bound) = ranks * (host_part + PROCESS_BYTES), host_memory.available()
            if need > have:
                raise ValueError(f"{what} with ZeRO-Offload needs ~{need / 1e9:.1f} GB of host "
                                 f"memory for {ranks} ranks (Table 1's offload column), "
                                 f"{have / 1e9:.1f} GB are available (bound by {bound}): add "
                                 f"ranks (the host part is 1/N_d), hosts, or force it with "
                                 f"launcher.oversubscribe=true")
        return
    need = ranks * (per_rank + host_part + PROCESS_BYTES)
    have, bound = host_memory.available()
    if need > have:
        raise ValueError(f"{what} on {ranks} CPU ranks needs ~"
                         f"{need / 1e9:.1f} GB (analytic estimate), {have / 1e9:.1f} GB are "
                         f"available (bound by {bound}): use a smaller model or batch, fewer "
                         f"ranks, a higher zero.stage, or force it with "
                         f"launcher.oversubscribe=true")
