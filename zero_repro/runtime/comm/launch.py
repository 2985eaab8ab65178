"""Process launch: local spawn of gloo CPU ranks (``spawn``), torchrun / Slurm environments (NCCL,
``init_from_env``) and the ``fake`` group of paper-scale dry runs (``init_fake``).

``spawn(fn, world_size, *args)`` starts fresh processes (``spawn`` start method: no CUDA or gloo
state inherited); each initialises the default group, runs ``fn(rank, world_size, *args)`` and
returns its result through a per-rank pickle file. Invariants: a rank that raises, dies or hangs
is named in ``WorkerFailed`` and the others are terminated (none is left in a collective); ranks
die with their parent (``PR_SET_PDEATHSIG``, else a watchdog thread), and an interrupted parent
terminates them; a rank that returned destroys its groups and leaves with ``os._exit(0)`` (no
gloo object outlives ``destroy_process_group`` into teardown, where gloo aborts); the next spawn
removes the temporary directories of dead parents.
"""
from __future__ import annotations

import contextlib
import ctypes
import gc
import glob
import logging
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable

import torch

from zero_repro.runtime.comm import comm
from zero_repro.runtime.comm.cpu import host_heap


PR_SET_PDEATHSIG = 1  # linux/prctl.h
SPAWN_PREFIX = "zr_spawn_"


class WorkerFailed(RuntimeError):
    def __init__(self, rank: int, reason: str):
        super().__init__(f"rank {rank} failed: {reason}")
        self.rank = rank
        self.reason = reason


class Terminated(KeyboardInterrupt):
    """Raised in the main thread by a SIGTERM handler (``kill``, ``timeout``, ``docker stop``,
    Slurm's scancel): unwinds like Ctrl-C, so ``spawn`` stops its ranks on the way out."""

    def __init__(self, signum: int):
        super().__init__(f"terminated by signal {signal.Signals(signum).name}")
        self.signum = signum


def raise_terminated(signum, frame) -> None:
    """A ``signal.signal`` handler: turn SIGTERM into ``Terminated``."""
    raise Terminated(signum)


def die_with_parent(parent_pid: int) -> None:
    """This process ends when ``parent_pid`` (its parent) does: the kernel's parent-death
    signal on Linux, else a watchdog thread. If the parent is already gone, exit now."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        armed = libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux
        armed = False
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(1)
    if not armed:
        threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(1)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _remove_stale_spawn_dirs() -> None:
    """Spawn directories whose parent process is gone (it was SIGKILLed mid-run)."""
    for path in glob.glob(os.path.join(tempfile.gettempdir(), f"{SPAWN_PREFIX}*_*")):
        head = os.path.basename(path)[len(SPAWN_PREFIX):].split("_", 1)[0]
        if head.isdigit() and int(head) != os.getpid() and not _pid_alive(int(head)):
            shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def _environment(env: dict[str, str] | None):
    """``os.environ`` replaced by ``env`` (None: unchanged) for the block, then restored."""
    if env is None:
        yield
        return
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def cuda_device(local_rank: int) -> torch.device:
    """This rank's GPU, made current: device ``local_rank % torch.cuda.device_count()`` (a site
    that binds one visible GPU to each task, e.g. Slurm's ``--gpus-per-task=1``, shows every rank
    its GPU as device 0). Called before the process group exists, so NCCL's communicators are
    created on it eagerly (``device_id``). fp32 matmuls use TF32 tensor cores unless
    ``ZR_TF32=0`` (PyTorch's own default is off since 1.12)."""
    n = torch.cuda.device_count()
    if n == 0:
        raise RuntimeError("a CUDA rank but no CUDA device is visible (CUDA_VISIBLE_DEVICES?)")
    device = torch.device("cuda", local_rank % n)
    torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32()
    return device


def tf32() -> bool:
    """Whether CUDA ranks run fp32 matmuls on TF32 tensor cores (``ZR_TF32``, default 1)."""
    want = os.environ.get("ZR_TF32", "1")
    if want not in ("0", "1"):
        raise ValueError(f"ZR_TF32={want!r}: use 1 (TF32 for fp32 matmuls) or 0 (full fp32)")
    return want == "1"


def _group_device(backend: str, local_rank: int) -> torch.device | None:
    """The device an NCCL process group binds to (set current first), None for gloo/fake."""
    return cuda_device(local_rank) if backend == "nccl" else None


# how this process's default group was set up: spawn (the local launcher), torchrun or slurm
_rendezvous = ""


def rendezvous() -> str:
    return _rendezvous


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world_size, port, backend, timeout_s, out_dir, args, parent_pid=None):
    die_with_parent(parent_pid if parent_pid is not None else os.getppid())
    # Ctrl-C reaches the whole process group: the parent alone handles it (and stops us)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    # one intra-op thread per rank: the machines running this have few cores, and
    # oversubscription makes collectives time out for no good reason
    torch.set_num_threads(max(1, int(os.environ.get("ZR_THREADS_PER_RANK", "1"))))
    path = os.path.join(out_dir, f"rank{rank}.pkl")
    try:
        global _rendezvous
        _rendezvous = "spawn"
        comm.init_process_group(backend, rank, world_size, timeout_s=timeout_s,
                                init_method=f"tcp://127.0.0.1:{port}",
                                device_id=_group_device(backend, rank))
        result = fn(rank, world_size, *args)
        payload = ("ok", result)
    except BaseException as e:  # noqa: BLE001 - report any failure to the parent
        payload = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    code = 1
    try:
        with open(path + ".tmp", "wb") as f:
            pickle.dump(payload, f)
        os.replace(path + ".tmp", path)
        if payload[0] == "ok":
            result = payload = None
            gc.collect()  # cycles (hooks -> strategy -> module) that still hold group handles
            teardown()
            code = 0
    finally:
        # no interpreter teardown: nothing of gloo may be destroyed after this point; a
        # failed rank does not wait in destroy for peers that will never come
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(code)



# torch before 2.8 (the floor, 2.7.1): gloo's shutdown in destroy_process_group waits, holding
# the GIL, for an asynchronous operation still posted (seen with the native bucket transport:
# both ranks hang after reporting); the rank then exits without it and the OS closes its sockets
GLOO_SHUTDOWN_WAITS = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 8)


def teardown() -> None:
    """The end of a rank's process group: ``comm.destroy_process_group``, except on gloo before
    torch 2.8, where its shutdown can hang (the process exits without it; every rank program
    ends with this, not with ``destroy_process_group``)."""
    if GLOO_SHUTDOWN_WAITS and comm.is_initialized() and comm.backend() == "gloo":
        return
    comm.destroy_process_group()


def spawn(fn: Callable[..., Any], world_size: int, *args, backend: str = "gloo",
          timeout_s: float = 300.0, join_timeout_s: float | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local processes; return results.

    ``fn`` must be importable (module level). Raises ``WorkerFailed`` naming the first rank that
    raised or exited abnormally; the remaining ranks are terminated.
    """
    ctx = mp.get_context("spawn")
    port = free_port()
    _remove_stale_spawn_dirs()
    with tempfile.TemporaryDirectory(prefix=f"{SPAWN_PREFIX}{os.getpid()}_") as out_dir:
        procs = [ctx.Process(target=_entry, daemon=False,
                             args=(fn, r, world_size, port, backend, timeout_s, out_dir, args,
                                   os.getpid()))
                 for r in range(world_size)]
        # CPU ranks start on a caching malloc (host_heap): the environment is what a spawned
        # interpreter is exec'd with, so it is set around the starts only
        with _environment(host_heap.rank_env() if backend == "gloo" else None):
            for p in procs:
                p.start()
        deadline = None if join_timeout_s is None else time.monotonic() + join_timeout_s
        failure: WorkerFailed | None = None
        try:
            while any(p.is_alive() for p in procs):
                if any(p.exitcode not in (0, None) for p in procs):
                    failure = _root_failure(procs, out_dir)
                    break
                if deadline is not None and time.monotonic() > deadline:
                    failure = WorkerFailed(-1, f"timed out after {join_timeout_s:.0f}s")
                    break
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
            for p in procs:
                p.join(5)
                if p.is_alive():
                    p.kill()
                    p.join()
        if failure is None and any(p.exitcode != 0 for p in procs):  # all died at once
            failure = _root_failure(procs, out_dir, grace_s=0.0)
        if failure is not None:
            raise failure
        results = []
        for r, p in enumerate(procs):
            if p.exitcode != 0:
                raise WorkerFailed(r, _reason(out_dir, r, p.exitcode))
            status, value = _load(out_dir, r)
            if status != "ok":
                raise WorkerFailed(r, value)
            results.append(value)
        return results


# a rank that reports one of these lost a peer: a consequence of another rank's failure
_PEER_LOSS = ("connection closed by peer", "connection reset by peer", "broken pipe",
              "timed out", "timeout", "econnreset", "distnetworkerror", "socket closed")


def _root_failure(procs, out_dir: str, grace_s: float = 1.0) -> WorkerFailed:
    """The failure to report once some rank failed: wait ``grace_s`` for the peers it takes
    down, then prefer a rank that was killed or raised a non-communication error over ranks
    that only lost their peer (their collectives fail right after). Ranks still alive then
    (e.g. hung ones) are named in the message."""
    end = time.monotonic() + grace_s
    while time.monotonic() < end and any(p.is_alive() for p in procs):
        time.sleep(0.05)
    failed = [(r, _reason(out_dir, r, p.exitcode)) for r, p in enumerate(procs)
              if p.exitcode not in (0, None)]
    alive = [r for r, p in enumerate(procs) if p.is_alive()]
    primary = [(r, why) for r, why in failed
               if not any(m in why.lower() for m in _PEER_LOSS)]
    if not primary and alive:
        # every failed rank only lost a peer (timed out waiting) while others are still
        # running: those are the ones that hung, and the headline names them
        first = failed[0][1].split("\n", 1)[0]
        return WorkerFailed(alive[0], f"hung: ranks {alive} made no progress while ranks "
                                      f"{[r for r, _ in failed]} timed out waiting for them "
                                      f"(launcher.collective_timeout_s); first peer error: "
                                      f"{first}")
    rank, why = (primary or failed)[0]
    others = [r for r, _ in failed if r != rank]
    notes = []
    if others:
        notes.append(f"then ranks {others} failed too")
    if alive:
        notes.append(f"ranks {alive} were still running (hung?) and were terminated")
    first, *rest = why.split("\n", 1)
    text = first + (f" [{'; '.join(notes)}]" if notes else "")
    return WorkerFailed(rank, text + ("\n" + rest[0] if rest else ""))


def _load(out_dir: str, rank: int):
    path = os.path.join(out_dir, f"rank{rank}.pkl")
    if not os.path.exists(path):
        return ("error", "exited without reporting a result")
    with open(path, "rb") as f:
        return pickle.load(f)


def _reason(out_dir: str, rank: int, exitcode) -> str:
    status, value = _load(out_dir, rank)
    if status == "error" and value != "exited without reporting a result":
        return value
    return f"process exited with code {exitcode} (killed or crashed) before reporting"


def init_from_env(backend: str, timeout_s: float = 1800.0) -> tuple[int, int, int]:
    """torchrun / srun launch: init the default group from the environment (NCCL: on this
    rank's GPU, made current first)."""
    global _rendezvous
    info = comm.env_rank_info()
    if info is None:
        raise RuntimeError("no RANK/WORLD_SIZE (torchrun) or SLURM_PROCID/SLURM_NTASKS (srun) "
                           "in the environment; use the local launcher instead")
    rank, world, local = info
    os.environ.setdefault("MASTER_ADDR", os.environ.get("SLURM_LAUNCH_NODE_IPADDR", "127.0.0.1"))
    # slurm/env.sh's per-job port when nothing exported one (a Hydra submitit job does not
    # source env.sh): two jobs sharing a node must not both listen on 29500
    job = os.environ.get("SLURM_JOB_ID", "")
    os.environ.setdefault("MASTER_PORT", str(20000 + int(job) % 20000) if job.isdigit() else "29500")
    _rendezvous = "torchrun" if "RANK" in os.environ else "slurm"
    comm.init_process_group(backend, rank, world, timeout_s=timeout_s, init_method="env://",
                            device_id=_group_device(backend, local))
    return rank, world, local


def init_fake(rank: int, world_size: int) -> None:
    """The ``fake`` backend: collectives are no-ops on fake tensors (memory dry runs at paper
    scale on one CPU process)."""
    # torch's internal testing package: imported only by dry runs
    from torch.testing._internal.distributed.fake_pg import FakeStore

    comm.init_process_group("fake", rank, world_size, store=FakeStore())
