"""The rank program of one training run: what runs in every rank (its log lines, resume).

The CLI resolves the Hydra config once and writes it to the run directory; ranks read that file
(ranks never run ``@hydra.main`` themselves: run directories and sweeps would differ per rank).
``rank_main`` is called by the local launcher (``zero_repro.lab.launcher``) in each spawned
process, or by ``main`` (``python -m zero_repro.lab.rank --config resolved.yaml``) when torchrun
or srun started the processes.

Parallelism is applied to the model from outside in a fixed order by ``runtime.train.build``:
TP (inside the model constructor) -> activation checkpointing (ZeRO-R) -> ZeRO wrap -> optimizer.

Checkpoints (``zero_repro.runtime.train.checkpoint``): saved every ``checkpoint.save_every``
steps into ``<run dir>/checkpoints`` (or ``checkpoint.dir``); with ``checkpoint.resume`` set the
rank loads the strategy state (any stage / DP size) and continues from the saved data position.
A checkpoint carries the loss history up to its step (``extra.history``) and the model shape it
belongs to (``extra.model``): a resumed run's record keeps ``losses`` from ``start_step`` on and
the earlier ones in ``losses_before_start``, so a table drawn from it equals the uninterrupted
run's. ``fault.*`` injects a rank failure mid-step (tests). Ranks drop the strategy's gradient
hooks (a reference cycle hooks -> strategy -> module) before their process groups are destroyed.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import os
import platform
import resource
import signal
import time

import torch

from zero_repro.runtime.train import checkpoint
from zero_repro import config as C
from zero_repro.runtime.comm import comm, launch
from zero_repro.runtime.comm.topology import Topology
from zero_repro.runtime.model import flops
from zero_repro.runtime.train import data, loop
from zero_repro.runtime.train.build import build
from zero_repro.runtime.train.build import device_for
from zero_repro.lab import wandb_runs

log = logging.getLogger(__name__)

# Slurm's time-limit warning (submitit submits with --signal=USR2@<launcher.signal_delay_s>):
# Slurm sends it to every task of the job's steps, i.e. to these ranks, which would die of it
# (SIGUSR2's default action). submitit's own handler lives in the batch process, which does not
# get the signal. The ranks note it and go on: the point ends at its time limit at the latest.
TIME_LIMIT_SIGNAL = signal.SIGUSR2
_signals_seen: list[dict] = []


def _note_time_limit_signal(signum, frame) -> None:
    _signals_seen.append({"signal": signal.Signals(signum).name, "time": time.time()})
    log.warning("%s received (Slurm's time-limit warning): ignored, training goes on; the job "
                "is killed at its time limit", signal.Signals(signum).name)


def hardware_info(device: torch.device) -> dict:
    info = {"torch": torch.__version__, "python": platform.python_version(),
            "host": platform.node(), "cpu_count": os.cpu_count(), "device": device.type,
            "threads_per_rank": torch.get_num_threads()}
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
    else:
        info["device_name"] = platform.processor() or platform.machine()
    return info


def memory_series(device: torch.device) -> dict:
    """This step's memory numbers (bytes) for the live W&B series."""
    if device.type == "cuda":
        return {"memory/allocated": torch.cuda.memory_allocated(device),
                "memory/reserved": torch.cuda.memory_reserved(device),
                "memory/max_allocated": torch.cuda.max_memory_allocated(device),
                "memory/max_reserved": torch.cuda.max_memory_reserved(device)}
    # Linux reports ru_maxrss in KiB
    return {"memory/max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def step_line(step: int, steps: int, loss: float, info, dt: float, tokens_per_step: int,
              tflops: float, peak_tflops: float, ledger_bytes: int,
              device: torch.device) -> str:
    """The per-step log line (rank 0, every ``train.log_every`` steps): rank 0's loss (its DP
    shard of the batch), loss scale, gradient norm, tokens/s, TFLOPs/GPU (+ MFU when
    ``cluster.peak_tflops`` is known), the memory ledger's total and, on CUDA, the caching
    allocator's allocated/reserved bytes."""
    line = (f"step {step + 1:>4}/{steps}  loss {loss:.4f}  scale {float(info.loss_scale):g}  "
            f"grad_norm {float(info.grad_norm):.3g}  {tokens_per_step / dt:,.0f} tok/s  "
            f"{tflops:.4g} TFLOPs/GPU")
    if peak_tflops > 0:
        line += f" (MFU {100 * tflops / peak_tflops:.1f}%)"
    line += f"  ledger {ledger_bytes / 2**20:.1f} MiB"
    if device.type == "cuda":
        line += (f"  alloc {torch.cuda.memory_allocated(device) / 2**30:.2f} GiB"
                 f"  reserved {torch.cuda.memory_reserved(device) / 2**30:.2f} GiB")
    return line + f"  {dt:.3f} s" + ("  (skipped)" if info.skipped else "")


def summary_line(cfg: C.Config, metrics: dict, ledger_bytes: int) -> str:
    """The end-of-point line (rank 0)."""
    t = cfg.train
    line = (f"done: {len(metrics['losses'])} steps ({t.warmup_steps} warm-up), loss "
            f"{metrics['loss_first']:.4f} -> {metrics['loss_last']:.4f}, median step "
            f"{metrics['step_time_s']:.3f} s, {metrics['tokens_per_s']:,.0f} tok/s, "
            f"{metrics['tflops_per_gpu']:.4g} TFLOPs/GPU")
    if "mfu" in metrics:
        line += f" (MFU {100 * metrics['mfu']:.1f}%)"
    line += (f", ledger {ledger_bytes / 2**20:.1f} MiB/rank, {metrics['skipped_steps']} "
             f"skipped; world {cfg.parallel.world_size} = TP {cfg.parallel.tp} x DP "
             f"{cfg.parallel.world_size // cfg.parallel.tp}, stage {cfg.zero.stage}, "
             f"{cfg.zero.dtype}")
    return line


def _rank_logging(cfg: C.Config, rank: int) -> None:
    """Spawned ranks start without logging handlers: give them one (stderr, like the CLI's),
    tagged with the rank, so rank 0's step lines reach the user."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=cfg.logging.level.upper(),
                            format=f"[rank {rank}] %(message)s")


def checkpoint_root(cfg: C.Config, run_dir: str) -> str:
    return cfg.checkpoint.dir or os.path.join(run_dir, "checkpoints")


def resume_path(cfg: C.Config, run_dir: str) -> str | None:
    """The checkpoint to resume from (None: start fresh). ValueError if ``resume=latest`` and
    there is none; called before any rank starts, so that is a user error. ``auto`` and
    ``latest`` take the newest *committed* checkpoint (an interrupted save is passed over)."""
    how = cfg.checkpoint.resume
    if not how:
        return None
    if how in ("auto", "latest"):
        root = checkpoint_root(cfg, run_dir)
        path = checkpoint.latest(root)
        if path is None:
            broken = checkpoint.uncommitted(root)
            why = (f"holds {len(broken)} step directories but none is committed (no "
                   f"{checkpoint.MANIFEST}: the save was interrupted or the manifest deleted)"
                   if broken else "holds no committed checkpoint")
            if how == "latest":
                raise ValueError(f"checkpoint.resume=latest but {root!r} {why}; use "
                                 f"checkpoint.resume=auto to start fresh when there is none")
            if broken:
                log.warning("checkpoint.resume=auto: %s %s; starting from step 0", root, why)
        return path
    return how


def model_identity(model: C.ModelConfig) -> dict:
    """What a checkpoint's parameters depend on (shapes), for the compatibility check."""
    d = dataclasses.asdict(model)
    return {k: d[k] for k in ("n_layer", "n_embd", "n_head", "seq_len", "vocab_size",
                              "vocab_pad_multiple", "bias")}














def inject_fault(fault: C.FaultConfig, rank: int, step: int) -> None:
    """``fault.rank`` fails at ``fault.step``, after backward, before the optimizer step (its
    peers are then blocked in the step's collectives): the failure path under test."""
    if rank != fault.rank or step != fault.step:
        return
    log.error("fault injection: rank %d %s at step %d", rank, fault.mode, step)
    if fault.mode == "kill":
        os._exit(9)  # no cleanup, like the OOM killer or a lost node
    if fault.mode == "raise":
        raise RuntimeError(f"fault injection: rank {rank} raised at step {step}")
    while True:  # hang: alive but silent; peers must time out, not wait forever
        time.sleep(60)


def rank_main(rank: int, world_size: int, config_path: str, local_rank: int | None = None) -> dict:
    cfg = C.load(config_path)
    _rank_logging(cfg, rank)
    device = device_for(cfg, rank if local_rank is None else local_rank)
    topo = Topology.build(cfg.parallel.tp)
    model, ckpt, strategy = build(cfg, topo, device)
    source = data.make_source(cfg.train.data, cfg.model.seq_len, cfg.model.vocab_size,
                              cfg.train.seed, cfg.train.data_path)
    run_dir = os.path.dirname(os.path.abspath(config_path))
    root = checkpoint_root(cfg, run_dir)
    start, resumed, history = 0, resume_path(cfg, run_dir), []
    if resumed is not None:
        manifest = checkpoint.load(resumed, strategy, topo, cfg.checkpoint.verify)
        start = manifest["step"]
        if start >= cfg.train.steps:
            raise ValueError(f"checkpoint {resumed} is at step {start}: nothing left to do with "
                             f"train.steps={cfg.train.steps}; raise train.steps")
        past = (manifest.get("extra") or {}).get("history") or {}
        history = list(past.get("losses") or [])
        history = history[:start] if len(history) >= start else []  # unknown: keep none
        skipped_before = [s for s in past.get("skipped_at") or [] if s < start]
    local_losses: list[float] = []
    skipped = list(skipped_before) if resumed is not None else []

    m, t = cfg.model, cfg.train
    tokens_per_step = t.micro_batch_size * t.grad_accum * topo.dp * m.seq_len
    fl = flops.flops_per_iteration(t.micro_batch_size * t.grad_accum * topo.dp, m.seq_len,
                                   m.n_layer, m.n_embd, C.padded_vocab(m, 1),
                                   recompute=cfg.zero_r.activation_checkpointing)
    # W&B: one run per point, logged live by rank 0 (a no-op unless logging.wandb=true)
    live = wandb_runs.StepLogger.start(cfg, run_dir, enabled=topo.rank == 0)

    every_log = cfg.train.log_every if topo.rank == 0 else 0

    def on_step(step, loss, dt, info):
        local_losses.append(loss)
        if every_log and ((step + 1) % every_log == 0 or step == cfg.train.steps - 1):
            log.info(step_line(step, cfg.train.steps, loss, info, dt, tokens_per_step,
                               flops.tflops_per_gpu(fl, dt, world_size),
                               cfg.cluster.peak_tflops, strategy.memory_ledger().total(),
                               device))
        if info.skipped:
            skipped.append(step)
        every = cfg.checkpoint.save_every
        if every and (step + 1) % every == 0:
            # the global mean loss of every step so far, so a resumed run knows its past
            per_dp = comm.all_gather_object(local_losses, topo.dp_group)
            losses = history + [sum(v) / len(v) for v in zip(*per_dp)]
            extra = {"model": model_identity(cfg.model),
                     "history": {"losses": losses if len(losses) == step + 1 else [],
                                 "skipped_at": list(skipped)}}
            checkpoint.save(root, strategy, topo, step + 1, cfg.checkpoint.keep, extra=extra)
        if live.active:
            live.log_step(step, loss=loss, grad_norm=float(info.grad_norm),
                          loss_scale=float(info.loss_scale), step_time_s=dt,
                          tokens_per_s=tokens_per_step / dt,
                          tflops_per_gpu=flops.tflops_per_gpu(fl, dt, world_size),
                          **memory_series(device))

    try:
        res = loop.train(strategy, source, cfg, topo, device, on_step=on_step,
                         start_step=start,
                         before_step=functools.partial(inject_fault, cfg.fault, topo.rank))
    except BaseException as e:
        live.finish({"status": "failed", "reason": f"{type(e).__name__}: {e}"[:500]}, 1)
        raise
    finally:
        # the hooks hold the strategy, which holds the module and the groups' users: without
        # this cycle broken, gloo objects outlive destroy_process_group
        strategy.remove_hooks()
    mem = strategy.memory_ledger()
    if ckpt is not None:
        ckpt.add_to_ledger(mem)
    step_s = res.median_step_time
    metrics = {
        "losses": res.losses, "loss_first": res.losses[0], "loss_last": res.losses[-1],
        "step_time_s": step_s, "step_times_s": res.step_times,
        "tokens_per_s": tokens_per_step / step_s,
        "tflops_per_gpu": flops.tflops_per_gpu(fl, step_s, world_size),
        "skipped_steps": res.skipped_steps, "skipped_at": res.skipped_at,
        "start_step": res.start_step, "resumed_from": resumed or "",
        "losses_before_start": history,
        "skipped_before_start": [s for s in skipped if s < res.start_step],
        "grad_norms": res.grad_norms,
        "loss_scales": res.loss_scales,
        "params_total": flops.param_count(m),
    }
    if cfg.cluster.peak_tflops > 0:
        metrics["mfu"] = metrics["tflops_per_gpu"] / cfg.cluster.peak_tflops
    if _signals_seen:
        metrics["signals"] = list(_signals_seen)
    if topo.rank == 0:
        log.info(summary_line(cfg, metrics, mem.total()))
    out = {"rank": rank, "metrics": metrics, "memory": mem.as_dict(),
           "comm": res.comm_per_step, "topology": topo.describe(),
           "hardware": {**hardware_info(device),
                        # how the DP buckets travelled (gloo on one host: shared memory)
                        "dp_transport": strategy.transport.name}}
    if device.type == "cuda":
        out["memory"]["cuda_max_allocated"] = torch.cuda.max_memory_allocated(device)
        out["memory"]["cuda_max_reserved"] = torch.cuda.max_memory_reserved(device)
    if live.active:
        metrics["wandb_run"] = live.finish(wandb_runs.summary_of(out), 0)
    model = ckpt = strategy = None  # noqa: F841 - drop the references (teardown: no gloo user alive)
    return out














def main(argv=None) -> None:
    """``python -m zero_repro.lab.rank --config resolved.yaml [--out result.json]`` on every rank
    (torchrun / srun)."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    signal.signal(TIME_LIMIT_SIGNAL, _note_time_limit_signal)
    cfg = C.load(args.config)
    cpus = os.environ.get("SLURM_CPUS_PER_TASK", "")
    if cfg.cluster.device == "cpu" and cpus.isdigit():
        # CPU ranks under srun: as many threads as the task has cores (env.sh's OMP_NUM_THREADS
        # is for GPU ranks; oversubscribed gloo ranks run ~50x slower)
        torch.set_num_threads(int(cpus))
    rank, world, local = launch.init_from_env(cfg.cluster.backend,
                                              cfg.launcher.collective_timeout_s)
    try:
        result = rank_main(rank, world, args.config, local)
    finally:
        comm.destroy_process_group()
    if rank == 0 and args.out:
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1, default=str)
        os.replace(tmp, args.out)


if __name__ == "__main__":
    main()
