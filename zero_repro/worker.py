"""Per-rank entry point and the launcher front-end for one training run (one sweep point).

The CLI resolves the Hydra config once and writes it to the run directory; ranks read that
file (ranks never run ``@hydra.main`` themselves: run directories and sweeps would differ per
rank). ``run_training`` starts the ranks with the configured launcher:

* ``launcher=local``: ``world_size`` local processes on gloo (CPU) via ``launch.spawn``;
* ``launcher=torchrun`` / ``slurm``: the processes already exist (``torchrun`` or ``srun``
  started ``python -m zero_repro.worker --config resolved.yaml`` on every rank); each calls
  ``rank_main`` after initialising from the environment.

Parallelism is applied to the model from outside in a fixed order by ``train.build``:
TP (inside the model constructor) -> activation checkpointing (ZeRO-R) -> ZeRO wrap -> optimizer.

Checkpoints (``checkpoint`` config, ``zero_repro.checkpoint``): saved every
``checkpoint.save_every`` steps into ``<run dir>/checkpoints`` (or ``checkpoint.dir``); a run
with ``checkpoint.resume`` set loads the strategy state (any stage / DP size) and continues
from the saved data position. A checkpoint also carries the loss history up to its step
(``extra.history``) and the model shape it belongs to (``extra.model``): a resumed run's record
keeps ``losses`` from ``start_step`` on and the earlier ones in ``losses_before_start``, so a
table drawn from it equals the uninterrupted run's. ``fault.*`` injects a rank failure
mid-step (tests).

``check_runnable`` is everything about files and devices that can be known before a rank
starts (data file long enough and in the vocabulary, CUDA/NCCL present, checkpoint directory
writable, the checkpoint to resume from committed, of this model and TP degree, not past
``train.steps``); ``run_training`` calls it before spawning, and so does the CLI for every point
before the first one runs. Ranks drop the strategy's gradient hooks (a reference cycle
hooks -> strategy -> module) before their process groups are destroyed.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import logging
import os
import platform
import resource
import signal
import subprocess
import sys
import threading
import tempfile
import time

import numpy as np
import torch

from zero_repro import checkpoint
from zero_repro import config as C
from zero_repro.distributed import comm, host_heap, launch, shm
from zero_repro.distributed.topology import Topology
from zero_repro.model import flops
from zero_repro.train import data, loop
from zero_repro.train.build import build, device_for
from zero_repro.train import wandb_live

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


def check_runnable(cfg: C.Config, run_dir: str) -> str | None:
    """ValueError (one line, naming the setting) for anything about files and devices that
    would make the ranks fail: checked in this process, creating nothing. Returns the
    checkpoint the run will resume from (None: fresh)."""
    _check_data(cfg)
    _check_device(cfg)
    root = checkpoint_root(cfg, run_dir)
    if cfg.checkpoint.save_every > 0:
        check_writable(root, "checkpoint.dir")
    path = resume_path(cfg, run_dir)
    if path is not None:
        _check_resume(cfg, path)
    return path


def _check_data(cfg: C.Config) -> None:
    t, m = cfg.train, cfg.model
    if t.data != "tokens":
        return
    if not os.path.isfile(t.data_path):
        raise ValueError(f"train.data_path={t.data_path!r} is not a file: give a uint16 token "
                         f"file (nanoGPT's train.bin format)")
    n = os.path.getsize(t.data_path) // 2
    if n <= m.seq_len + 1:
        raise ValueError(f"train.data_path={t.data_path!r} holds {n} tokens; model.seq_len="
                         f"{m.seq_len} needs more than {m.seq_len + 1}")
    if n <= 256_000_000:  # a few seconds at most: worth it, an id >= vocab fails mid-run
        top = int(np.memmap(t.data_path, dtype=np.uint16, mode="r")[:n].max())
        if top >= m.vocab_size:
            raise ValueError(f"train.data_path={t.data_path!r} holds token id {top} >= "
                             f"model.vocab_size={m.vocab_size}: raise model.vocab_size")


def local_ranks(cfg: C.Config) -> int:
    """How many ranks this machine starts for one point."""
    if cfg.launcher.name == "local":
        return cfg.parallel.world_size
    return min(cfg.cluster.gpus_per_node, cfg.parallel.world_size)


def _check_device(cfg: C.Config) -> None:
    c = cfg.cluster
    if c.backend == "gloo":
        host_heap.mode()  # ZR_HOST_HEAP, read by every CPU rank when it starts
        shm.mode()  # ZR_CPU_TRANSPORT, read by every CPU rank's DP group
    if c.device != "cuda" and c.backend != "nccl":
        return
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    what = "cluster.device=cuda" if c.device == "cuda" else "cluster.backend=nccl"
    if n == 0:
        raise ValueError(f"{what} but this machine has no CUDA device: use cluster=local "
                         f"(cluster.device=cpu, cluster.backend=gloo)")
    if local_ranks(cfg) > n:
        raise ValueError(f"parallel.world_size={cfg.parallel.world_size} needs "
                         f"{local_ranks(cfg)} GPUs on this machine, which has {n}: lower "
                         f"parallel.world_size or use launcher=slurm")


def check_writable(path: str, key: str) -> None:
    """``path`` (a directory, made later) can be created and written: its nearest existing
    ancestor is a directory in which a file can be created (tried: permission bits do not tell
    for root, read-only mounts or /proc)."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise ValueError(f"{key}={path!r}: {probe!r} is a file, not a directory")
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        raise ValueError(f"{key}={path!r} is not writable ({probe!r}: {e.strerror}): choose "
                         f"another directory") from None


def _check_resume(cfg: C.Config, path: str) -> None:
    try:
        manifest = checkpoint.read_manifest(path, verify=False)  # hashes: checked by the load
    except checkpoint.CheckpointError as e:
        raise ValueError(f"checkpoint.resume: {e}") from None
    if not isinstance(manifest, dict) or not {"tp", "step", "params"} <= set(manifest):
        raise ValueError(f"checkpoint.resume: {path!r} has a manifest without tp/step/params: "
                         f"not a zero-repro checkpoint")
    if manifest["tp"] != cfg.parallel.tp:
        raise ValueError(f"checkpoint.resume: {path!r} was saved with parallel.tp="
                         f"{manifest['tp']}; resume with parallel.tp={manifest['tp']}")
    saved = (manifest.get("extra") or {}).get("model")
    if saved is not None and saved != model_identity(cfg.model):
        diff = sorted(k for k in saved if saved[k] != model_identity(cfg.model).get(k))
        raise ValueError(f"checkpoint.resume: {path!r} is from a different model (model."
                         f"{diff[0] if diff else '?'}={saved.get(diff[0]) if diff else '?'} "
                         f"there): resume with the model it was saved from")
    if manifest["step"] >= cfg.train.steps:
        raise ValueError(f"checkpoint.resume: {path!r} is at step {manifest['step']}: nothing "
                         f"left to do with train.steps={cfg.train.steps}; raise train.steps")


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
    live = wandb_live.StepLogger.start(cfg, run_dir, enabled=topo.rank == 0)

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
                        "dp_transport": strategy.transport.models_as}}
    if device.type == "cuda":
        out["memory"]["cuda_max_allocated"] = torch.cuda.max_memory_allocated(device)
        out["memory"]["cuda_max_reserved"] = torch.cuda.max_memory_reserved(device)
    if live.active:
        metrics["wandb_run"] = live.finish(wandb_live.summary_of(out), 0)
    model = ckpt = strategy = None  # noqa: F841 - drop the references (teardown: no gloo user alive)
    return out


def run_training(cfg: C.Config, run_dir: str) -> dict:
    """Validate, write the resolved config into ``run_dir``, run all ranks; rank 0's result."""
    C.validate(cfg)
    check_runnable(cfg, run_dir)  # files, devices, the checkpoint: fail before spawning
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, "config.yaml")
    C.save(cfg, path)
    if cfg.launcher.name == "local":
        try:
            results = launch.spawn(rank_main, cfg.parallel.world_size, path,
                                   backend=cfg.cluster.backend,
                                   timeout_s=cfg.launcher.collective_timeout_s)
        except BaseException:
            # every rank has exited (spawn joins them before raising): a save they were in
            # the middle of can never be committed
            for d in checkpoint.discard_partial(checkpoint_root(cfg, run_dir)):
                log.info("removed the interrupted checkpoint save %s", d)
            raise
        return results[0]
    return _run_external(cfg, run_dir, path)


def launch_command(cfg: C.Config, config_path: str, out_path: str,
                   env: dict | None = None) -> list[str]:
    """The command that starts every rank of one point under torchrun or srun."""
    env = os.environ if env is None else env
    worker = [sys.executable, "-m", "zero_repro.worker", "--config", config_path,
              "--out", out_path]
    per_node = min(cfg.cluster.gpus_per_node, cfg.parallel.world_size)
    nodes = -(-cfg.parallel.world_size // per_node)
    if cfg.launcher.name == "torchrun":
        if nodes > 1:
            raise ValueError("launcher=torchrun starts one node; for several nodes use "
                             "launcher=slurm (srun starts one process per GPU)")
        return ["torchrun", "--standalone", f"--nproc_per_node={per_node}", "-m",
                "zero_repro.worker", "--config", config_path, "--out", out_path]
    # slurm: inside an allocation (sbatch/submitit job), one task per GPU
    cmd = ["srun", f"--nodes={nodes}", f"--ntasks={cfg.parallel.world_size}",
           f"--ntasks-per-node={per_node}", "--kill-on-bad-exit=1"]
    cpus = int(env.get("SLURM_CPUS_ON_NODE", "0") or 0)
    if cpus:
        # the allocation's cores shared out among this node's ranks: an inherited
        # --cpus-per-task (e.g. a Hydra job's 1 task x N CPUs) would ask for N CPUs per rank
        cmd.append(f"--cpus-per-task={max(1, cpus // per_node)}")
    if "SLURM_STEP_ID" in env:
        # already inside a job step (a Hydra submitit job runs its task with srun): that step
        # holds every CPU of the allocation, so a new step waits forever for them unless it
        # may share them
        cmd.append("--overlap")
    return cmd + worker


# lines of a launcher's error output worth quoting in a record
_ERROR_LINE = ("error", "exception", "traceback", "killed", "cancelled", "failed", "denied",
               "no such file", "signal", "timeout", "refused")


def error_lines(lines, n: int = 6) -> list[str]:
    """The last ``n`` lines that look like an error (else the last ``n`` lines)."""
    lines = [ln.rstrip() for ln in lines if ln.strip()]
    hits = [ln for ln in lines if any(w in ln.lower() for w in _ERROR_LINE)]
    return (hits or lines)[-n:]


def _tee(stream, sink, tail: collections.deque) -> None:
    for line in iter(stream.readline, ""):
        sink.write(line)
        sink.flush()
        tail.append(line)
    stream.close()


def _run_external(cfg: C.Config, run_dir: str, config_path: str) -> dict:
    out_path = os.path.join(run_dir, "result.json")
    cmd = launch_command(cfg, config_path, out_path)
    log.info("launching: %s", " ".join(cmd))
    # the launcher's error output still goes to this job's log, and its last lines are kept: a
    # failed launch's real cause ("execve(): torchrun: No such file", "NCCL not built in", a
    # rank's traceback) is there, not in the exit status
    tail: collections.deque = collections.deque(maxlen=200)
    # CPU ranks start on a caching malloc (distributed.host_heap); srun passes it on
    env = host_heap.rank_env() if cfg.cluster.backend == "gloo" else None
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, errors="replace", env=env)
    reader = threading.Thread(target=_tee, args=(proc.stderr, sys.stderr, tail), daemon=True)
    reader.start()
    rc = proc.wait()
    reader.join(10)
    if rc != 0:
        why = f"{cmd[0]} exited with status {rc}"
        if rc > 128 or rc < 0:
            sig = abs(rc) if rc < 0 else rc - 128
            why += f" (signal {signal.Signals(sig).name})" if sig in signal.valid_signals() else ""
        quoted = "\n".join(error_lines(tail))
        raise launch.WorkerFailed(-1, f"{why}; its last error lines:\n{quoted}" if quoted
                                  else why)
    with open(out_path) as f:
        return json.load(f)


def main(argv=None) -> None:
    """``python -m zero_repro.worker --config resolved.yaml [--out result.json]`` on every rank
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
