"""The launcher front-end of one training run (one sweep point): what runs in the CLI process.

``check_runnable``: everything about files and devices knowable before a rank starts (the data
file long enough and in the vocabulary, CUDA/NCCL present, the checkpoint directory writable, the
checkpoint to resume committed, of this model and TP degree, not past ``train.steps``, and
writable by this account alone unless ``checkpoint.allow_untrusted``).
``run_training`` validates, writes the resolved config into the run directory and starts the
ranks: ``launcher=local`` as ``world_size`` gloo processes (``runtime.comm.launch.spawn``);
``launcher=torchrun`` / ``slurm`` through ``launch_command`` (``python -m zero_repro.lab.rank
--config resolved.yaml`` on every rank under torchrun or srun). torchrun and its ranks end with
this process: stopped when it is interrupted (the point is then recorded ``cancelled``), sent
SIGTERM by the kernel when it dies (its ranks die with torchrun). A rank the kernel's OOM killer
ended (SIGKILL, and the memory cgroup's OOM-kill count risen: ``lab.host_memory.OomWatch``) fails
the point with an "out of memory" reason naming the cgroup and its limit: recorded ``oom``.
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import difflib
import functools
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
from zero_repro import schema
from zero_repro import validation
from zero_repro.lab import host_memory
from zero_repro.runtime.comm import launch as spawn
from zero_repro.runtime.comm.cpu import host_heap, shm
from zero_repro.runtime.train import checkpoint
from zero_repro.scale.paper import table3
from zero_repro.lab.rank import (DIVERGED_FILE, checkpoint_root, model_identity, rank_main,
                                 resume_path)

log = logging.getLogger(__name__)

TOKEN_CHUNK = 1 << 26  # tokens per step of the vocabulary scan (128 MiB of uint16)
THREADS_VAR = "ZR_THREADS_PER_RANK"  # intra-op threads of each local rank (runtime.comm.launch)


def check_config(cfg: C.Config) -> C.Config:
    """``config.validate`` plus the rules that need the lab's facts; ValueError (one line,
    naming the setting) otherwise. Pure, like ``validate``."""
    validation.validate(cfg)
    _check_table3_name(cfg.zero_r)
    return cfg


def _check_table3_name(zr: C.ZeroRConfig) -> None:
    """A Table 3 name (c1..c5) stands for its ZeRO-R components: a record labelled C4 must
    have run C4's. The stage is free (``zero_r=c4 zero.stage=3`` is C4's components at
    stage 3, README)."""
    if zr.name not in table3.TABLE3:
        return
    want = dataclasses.asdict(table3.zero_r_config(zr.name))
    have = dataclasses.asdict(zr)
    wrong = [k for k in want if k != "name" and want[k] != have[k]]
    if wrong:
        setting = ", ".join(f"zero_r.{k}={str(have[k]).lower()}" for k in wrong)
        raise ValueError(f"zero_r.name={zr.name} names Table 3's {zr.name.upper()}, whose "
                         f"components differ from {setting}: select the preset with "
                         f"zero_r={zr.name} (alone), or name this combination "
                         f"zero_r.name=custom")


def check_runnable(cfg: C.Config, run_dir: str) -> str | None:
    """ValueError (one line, naming the setting) for anything about files, devices and the
    environment that would make the ranks fail: checked in this process, creating nothing.
    Returns the checkpoint the run will resume from (None: fresh)."""
    _check_data(cfg)
    _check_environment(cfg)
    _check_device(cfg)
    root = checkpoint_root(cfg, run_dir)
    if cfg.checkpoint.save_every > 0:
        check_writable(root, "checkpoint.dir")
    return resolve_resume(cfg, run_dir)


def _check_data(cfg: C.Config) -> None:
    t, m = cfg.train, cfg.model
    if t.data != "tokens":
        return
    if not os.path.isfile(t.data_path):
        hint = " (~ is not expanded: write $HOME/...)" if t.data_path.startswith("~") else ""
        raise ValueError(f"train.data_path={t.data_path!r} is not a file{hint}: give a uint16 "
                         f"token file (nanoGPT's train.bin format)")
    size = os.path.getsize(t.data_path)
    if size % 2:
        raise ValueError(f"train.data_path={t.data_path!r} holds {size} bytes, an odd number: "
                         f"not a file of uint16 tokens (nanoGPT's train.bin format)")
    n = size // 2
    if n <= m.seq_len + 1:
        raise ValueError(f"train.data_path={t.data_path!r} holds {n} tokens; model.seq_len="
                         f"{m.seq_len} needs more than {m.seq_len + 1}")
    tokens = np.memmap(t.data_path, dtype=np.uint16, mode="r")
    for start in range(0, n, TOKEN_CHUNK):  # every id: one >= vocab fails mid-run otherwise
        chunk = tokens[start:start + TOKEN_CHUNK]
        top = int(chunk.max())
        if top >= m.vocab_size:
            at = start + int(np.argmax(chunk >= m.vocab_size))
            raise ValueError(f"train.data_path={t.data_path!r} holds token id {top} >= "
                             f"model.vocab_size={m.vocab_size} (first at token {at}): raise "
                             f"model.vocab_size")


def _threads_per_rank() -> str:
    value = os.environ.get(THREADS_VAR, "")
    if value and not (value.isdigit() and int(value) >= 1):
        raise ValueError(f"{THREADS_VAR}={value!r}: give a whole number of threads >= 1, or "
                         f"unset it (1 thread per rank)")
    return value


# every ZR_* variable the ranks read, with its check
ENVIRONMENT = {"ZR_CPU_TRANSPORT": shm.mode, "ZR_HOST_HEAP": host_heap.mode,
               THREADS_VAR: _threads_per_rank}


def _check_environment(cfg: C.Config) -> None:
    """Every ``ZR_*`` variable the ranks read is valid; one that is nearly one of them is a
    typo (refused with the name it resembles); ``/dev/shm`` has room when
    ``ZR_CPU_TRANSPORT=shm`` requires shared memory."""
    for name in sorted(v for v in os.environ if v.startswith("ZR_") and v not in ENVIRONMENT):
        close = difflib.get_close_matches(name, ENVIRONMENT, n=1, cutoff=0.8)
        if close:
            raise ValueError(f"{name}={os.environ[name]!r} is not a variable zero-repro reads "
                             f"(did you mean {close[0]}?)")
    for check in ENVIRONMENT.values():
        check()
    _check_shared_memory(cfg)


def _check_shared_memory(cfg: C.Config) -> None:
    """``ZR_CPU_TRANSPORT=shm`` with ranks on this host: the DP groups' slot segments fit in
    ``/dev/shm`` by ``shm.room_needed`` (the rule the ranks apply)."""
    if shm.mode() != "shm" or cfg.cluster.backend != "gloo":
        return
    tp, dp = cfg.parallel.tp, cfg.parallel.world_size // cfg.parallel.tp
    if dp < 2:
        return
    groups = min(tp, max(1, local_ranks(cfg) // dp)) if cfg.launcher.name != "local" else tp
    need, have = shm.room_needed(dp, groups), shm.room()
    if have < need:
        raise ValueError(f"ZR_CPU_TRANSPORT=shm needs {need / 2**20:.0f} MiB free in "
                         f"{shm.SHM_DIR} for {groups} data-parallel group(s) of {dp} ranks, "
                         f"{have / 2**20:.0f} MiB are free: free some, or unset "
                         f"ZR_CPU_TRANSPORT (gloo is used where shared memory does not fit)")


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
    # launcher.oversubscribe: the point starts fewer processes than its world has ranks (the
    # GPU proof's paper points: one process plays rank 0 of 400 on the fake group), or the user
    # forces it -- NCCL itself refuses two ranks on one GPU, so nothing silent follows
    if local_ranks(cfg) > n and not cfg.launcher.oversubscribe:
        raise ValueError(f"parallel.world_size={cfg.parallel.world_size} needs "
                         f"{local_ranks(cfg)} GPUs on this machine, which has {n}: lower "
                         f"parallel.world_size or use launcher=slurm (or force it with "
                         f"launcher.oversubscribe=true)")


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


def resolve_resume(cfg: C.Config, run_dir: str) -> str | None:
    """The checkpoint the run resumes from, checked (None: start fresh). A given path must be
    intact; ``auto`` / ``latest`` take the newest committed checkpoint that is intact, saying
    so when they pass over a damaged one (``auto`` starts fresh when none is)."""
    how = cfg.checkpoint.resume
    if how not in ("auto", "latest"):
        path = resume_path(cfg, run_dir)
        if path is not None:
            _check_resume(cfg, path)
        return path
    root = checkpoint_root(cfg, run_dir)
    candidates = checkpoint.committed(root)
    if not candidates:
        return resume_path(cfg, run_dir)  # none: its messages (latest: an error)
    damaged = []
    for path in candidates:
        try:
            checkpoint.read_manifest(path, verify=cfg.checkpoint.verify)
        except checkpoint.CheckpointError as e:
            damaged.append(str(e))
            continue
        if damaged:
            log.warning("checkpoint.resume=%s: %s; resuming from the newest intact one, %s",
                        how, "; ".join(damaged), path)
        _check_resume(cfg, path)
        return path
    if how == "latest":
        raise ValueError(f"checkpoint.resume=latest but no checkpoint in {root!r} is intact: "
                         f"{damaged[0]}; use checkpoint.resume=auto to start fresh")
    log.warning("checkpoint.resume=auto: no checkpoint in %s is intact (%s): starting from "
                "step 0", root, damaged[0])
    return None


def _check_resume(cfg: C.Config, path: str) -> None:
    try:
        manifest = checkpoint.read_manifest(path, verify=cfg.checkpoint.verify)
    except checkpoint.CheckpointError as e:
        raise ValueError(f"checkpoint.resume: {e}") from None
    if not cfg.checkpoint.allow_untrusted:
        try:
            checkpoint.check_trusted(path)
        except checkpoint.CheckpointError as e:
            raise ValueError(f"checkpoint.resume: {e}, or set checkpoint.allow_untrusted=true"
                             ) from None
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


def checked(cfg: C.Config, run_dir: str, resume: str | None) -> tuple:
    """The verdict of a pre-flight that found ``cfg`` in ``run_dir`` runnable and resuming
    from ``resume``, for ``run_training``: (what was checked: the run directory and the
    resolved config, ``resume``, the committed checkpoints then)."""
    return (_fingerprint(cfg, run_dir), resume,
            checkpoint.committed(checkpoint_root(cfg, run_dir)))


def _fingerprint(cfg: C.Config, run_dir: str) -> tuple[str, str]:
    return os.path.abspath(run_dir), json.dumps(schema.summary(cfg), sort_keys=True, default=str)


class RunDiverged(RuntimeError):
    """The ranks stopped because the run diverged; ``result`` holds what it measured until
    then (``metrics.losses``), the message the clean reason."""

    def __init__(self, reason: str, result: dict):
        super().__init__(reason)
        self.result = result


def run_training(cfg: C.Config, run_dir: str, pre: tuple | None = None) -> dict:
    """Check (unless pre-flighted: ``pre``, the point's ``checked``, made for this very config
    and run directory), write the resolved config into ``run_dir`` (with the checkpoint to
    resume from resolved), run all ranks; rank 0's result. ``RunDiverged`` when the run
    diverged."""
    if pre is not None and pre[0] == _fingerprint(cfg, run_dir):
        _, resume, seen = pre
        if checkpoint.committed(checkpoint_root(cfg, run_dir)) != seen:
            # saved since the check (by an earlier point of the sweep): new input
            resume = resolve_resume(cfg, run_dir)
    else:
        check_config(cfg)
        resume = check_runnable(cfg, run_dir)  # files, devices, checkpoint: before spawning
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, "config.yaml")
    # the ranks resume from the checkpoint checked here (hashed here when verify is on)
    ck = dataclasses.replace(cfg.checkpoint, resume=resume or "",
                             verify=cfg.checkpoint.verify and not resume)
    schema.save(dataclasses.replace(cfg, checkpoint=ck), path)
    with contextlib.suppress(FileNotFoundError):  # a diverged earlier run's
        os.unlink(os.path.join(run_dir, DIVERGED_FILE))
    oom_watch = host_memory.OomWatch.start()  # the OOM-kill count before the ranks start
    try:
        if cfg.launcher.name == "local":
            try:
                results = spawn.spawn(rank_main, cfg.parallel.world_size, path,
                                       backend=cfg.cluster.backend,
                                       timeout_s=cfg.launcher.collective_timeout_s)
            except BaseException:
                # every rank has exited (spawn joins them before raising): a save they were
                # in the middle of can never be committed
                for d in checkpoint.discard_partial(checkpoint_root(cfg, run_dir)):
                    log.info("removed the interrupted checkpoint save %s", d)
                raise
            return results[0]
        return _run_external(cfg, run_dir, path)
    except spawn.WorkerFailed as e:
        diverged = _diverged(run_dir)
        if diverged is not None:
            raise RunDiverged(*diverged) from e
        oom = oom_watch.verdict(e.reason)  # a SIGKILLed rank and a risen OOM-kill count
        if oom is None:
            raise
        raise spawn.WorkerFailed(e.rank, oom) from e


def _diverged(run_dir: str) -> tuple[str, dict] | None:
    """(reason, result) a rank left in ``run_dir`` when it stopped the run as diverged."""
    try:
        with open(os.path.join(run_dir, DIVERGED_FILE)) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    return doc["reason"], {"metrics": doc.get("metrics") or {}}


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
               "no such file", "signal", "timeout", "refused", "oom-kill", "out-of-memory")


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


TORCHRUN_STOP_S = 40.0  # torchrun's own grace for its ranks (30 s) and its exit


def _terminate_with_parent(parent: int) -> None:
    """In the child before it execs: SIGTERM when ``parent`` (this process) dies, or now if it
    died before the signal was armed."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(spawn.PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to ``proc``'s process group (torchrun stops its ranks, which die with it in any
    case), SIGKILL after ``TORCHRUN_STOP_S``."""
    for sig, wait_s in ((signal.SIGTERM, TORCHRUN_STOP_S), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


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
    torchrun = cfg.launcher.name == "torchrun"
    # torchrun: its own process group, which this process stops on the way out, and a
    # parent-death signal, so that it (and through it its ranks) ends with this process
    # however this one ends; srun's steps end with their job
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, errors="replace", env=env,
                            **(dict(start_new_session=True, preexec_fn=functools.partial(
                                _terminate_with_parent, os.getpid())) if torchrun else {}))
    reader = threading.Thread(target=_tee, args=(proc.stderr, sys.stderr, tail), daemon=True)
    reader.start()
    try:
        rc = proc.wait()
    except BaseException:  # Ctrl-C, SIGTERM, a point's time limit: the ranks stop too
        if torchrun:
            _stop_group(proc)
        raise
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

