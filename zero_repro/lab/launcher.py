"""The launcher front-end of one training run (one sweep point): what runs in the CLI process.

``check_runnable``: everything about files and devices knowable before a rank starts (the data
file long enough and in the vocabulary, CUDA/NCCL present, the checkpoint directory writable, the
checkpoint to resume committed, of this model and TP degree, not past ``train.steps``).
``run_training`` validates, writes the resolved config into the run directory and starts the
ranks: ``launcher=local`` as ``world_size`` gloo processes (``runtime.comm.launch.spawn``);
``launcher=torchrun`` / ``slurm`` through ``launch_command`` (``python -m zero_repro.lab.rank
--config resolved.yaml`` on every rank under torchrun or srun).
"""
from __future__ import annotations

import collections
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading

import numpy as np
import torch

from zero_repro import config as C
from zero_repro.runtime.comm import launch as spawn
from zero_repro.runtime.comm.cpu import host_heap, shm
from zero_repro.runtime.train import checkpoint
from zero_repro.lab.rank import checkpoint_root, model_identity, rank_main, resume_path

log = logging.getLogger(__name__)


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


def run_training(cfg: C.Config, run_dir: str) -> dict:
    """Validate, write the resolved config into ``run_dir``, run all ranks; rank 0's result."""
    C.validate(cfg)
    check_runnable(cfg, run_dir)  # files, devices, the checkpoint: fail before spawning
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, "config.yaml")
    C.save(cfg, path)
    if cfg.launcher.name == "local":
        try:
            results = spawn.spawn(rank_main, cfg.parallel.world_size, path,
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
    worker = [sys.executable, "-m", "zero_repro.lab.rank", "--config", config_path,
              "--out", out_path]
    per_node = min(cfg.cluster.gpus_per_node, cfg.parallel.world_size)
    nodes = -(-cfg.parallel.world_size // per_node)
    if cfg.launcher.name == "torchrun":
        if nodes > 1:
            raise ValueError("launcher=torchrun starts one node; for several nodes use "
                             "launcher=slurm (srun starts one process per GPU)")
        return ["torchrun", "--standalone", f"--nproc_per_node={per_node}", "-m",
                "zero_repro.lab.rank", "--config", config_path, "--out", out_path]
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
    # CPU ranks start on a caching malloc (runtime.comm.cpu.host_heap); srun passes it on
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
        raise spawn.WorkerFailed(-1, f"{why}; its last error lines:\n{quoted}" if quoted
                                  else why)
    with open(out_path) as f:
        return json.load(f)

