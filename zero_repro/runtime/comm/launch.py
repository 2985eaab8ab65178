"""Process launch: local spawn of gloo CPU ranks (``spawn``), torchrun / Slurm environments (NCCL,
``init_from_env``) and the ``fake`` group of paper-scale dry runs (``init_fake``).

``spawn(fn, world_size, *args)`` starts fresh processes (``spawn`` start method: no CUDA or gloo
state inherited); each initialises the default group, runs ``fn(rank, world_size, *args)`` and
returns its result through a per-rank pickle file. Invariants: a rank that raises, dies or hangs
is named in ``WorkerFailed`` and the others are terminated (none is left in a collective); ranks
die with their parent (``PR_SET_PDEATHSIG``, else a watchdog thread), and an interrupted parent
terminates them; a rank that returned destroys its groups and leaves with ``os._exit(0)`` (no
gloo object outlives ``destroy_process_group`` into teardown, where gloo aborts).

On a shared node: the ranks meet at a TCPStore the parent has bound (loopback, a port the
kernel chose) before any rank is told its port, so nobody can take it in between; a spawn
directory is private (0700) and locked by its parent while it lives (``flock``), and the next
spawn removes only directories whose lock is free, whatever PID namespace made them. Under
Slurm (``init_from_env``) the port is the one given (``MASTER_PORT``), else the step's
reserved one (``srun --resv-ports``), else rank 0 binds one the kernel chooses and hands it to
the step's other ranks through a file in ``rendezvous_dir`` (the run directory, on the shared
filesystem); a port someone else holds is one error naming it. Ranks under torchrun die with
its agent.
"""
from __future__ import annotations

import contextlib
import ctypes
import datetime
import fcntl
import gc
import glob
import hashlib
import json
import logging
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import socket
import stat
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


SPAWN_LOCK = ".lock"  # in a spawn directory: held (flock) by its parent while it runs


class SpawnDir:
    """A spawn's private temporary directory and the descriptor of its lock (held)."""

    def __init__(self, path: str, lock_fd: int):
        self.path, self.lock_fd = path, lock_fd


def make_spawn_dir(parent: str | None = None) -> SpawnDir:
    """A fresh directory ``<parent>/zr_spawn_<pid>_<random>`` (0700; ``parent``: the temporary
    directory) whose lock this process holds until ``release_spawn_dir`` or its end. It gets
    its name only once locked, so no one ever sees it unlocked while its owner lives."""
    parent = parent or tempfile.gettempdir()
    hidden = tempfile.mkdtemp(prefix=f".{SPAWN_PREFIX}", dir=parent)
    fd = os.open(os.path.join(hidden, SPAWN_LOCK), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    path = os.path.join(parent, f"{SPAWN_PREFIX}{os.getpid()}_" +
                        os.path.basename(hidden)[len(SPAWN_PREFIX) + 1:])
    os.rename(hidden, path)
    return SpawnDir(path, fd)


def release_spawn_dir(sd: SpawnDir) -> None:
    """Let go of ``sd``'s lock (what its owner's end does); the directory stays."""
    if sd.lock_fd >= 0:
        os.close(sd.lock_fd)
        sd.lock_fd = -1


def remove_stale_spawn_dirs(parent: str | None = None) -> list[str]:
    """Remove this account's spawn directories whose owner is gone: their lock is free (a PID
    tells nothing across PID namespaces, e.g. containers sharing ``/tmp``). Directories with
    no lock (made by older versions) and others' are left alone. Returns what was removed."""
    gone = []
    for path in glob.glob(os.path.join(parent or tempfile.gettempdir(), f"{SPAWN_PREFIX}*_*")):
        try:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                continue
            fd = os.open(os.path.join(path, SPAWN_LOCK), os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its owner lives
            os.close(fd)
            continue
        shutil.rmtree(path, ignore_errors=True)
        os.close(fd)
        gone.append(path)
    return gone


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


# torch before 2.8: the libuv TCPStore ignores a listening socket handed to it
LIBUV_TAKES_LISTEN_FD = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 8)


def own_store(timeout_s: float, host: str = "127.0.0.1") -> tuple[Any, int]:
    """(a TCPStore server this process owns, its port): bound on ``host`` to a port the kernel
    chooses before anyone is told it, so nobody can take it in between."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen(1024)
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    kw = {} if LIBUV_TAKES_LISTEN_FD else {"use_libuv": False}
    store = torch.distributed.TCPStore(host, port, None, True,
                                       datetime.timedelta(seconds=timeout_s),
                                       wait_for_workers=False, master_listen_fd=sock.detach(),
                                       **kw)
    return store, port


def _client(host: str, port: int, timeout_s: float):
    return torch.distributed.TCPStore(host, port, None, False,
                                      datetime.timedelta(seconds=timeout_s))


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
        # the parent's store, bound before this process started
        comm.init_process_group(backend, rank, world_size, timeout_s=timeout_s,
                                store=_client("127.0.0.1", port, timeout_s),
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



GLOO_SETTLE_S = 0.2  # time for gloo's worker threads to drop their finished work (teardown)
# torch before 2.8 (the floor, 2.7.1): gloo's shutdown in destroy_process_group waits, holding
# the GIL, for an asynchronous operation still posted (seen with the native bucket transport:
# both ranks hang after reporting); the rank then exits without it and the OS closes its sockets
GLOO_SHUTDOWN_WAITS = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 8)


def teardown() -> None:
    """The end of a rank's process group: ``comm.destroy_process_group`` (on gloo before torch
    2.8 not: its shutdown can hang; the process exits without it and the OS closes its
    sockets). On gloo the rank first sleeps ``GLOO_SETTLE_S`` with the GIL released: a gloo
    worker thread destroys a finished collective's work after the caller's wait returned, and
    that decrefs the Python objects of its tensors; when the interpreter is already
    finalising, the thread is cancelled inside a noexcept frame and the process aborts
    ("terminate called without an active exception": seen in 2-4 of 8 runs of
    examples/own_model at world 2, whose last act is a collective; a gloo thread in
    ``~AsyncAllgatherWork`` in the core dump). Every rank program ends with this, not with
    ``destroy_process_group``."""
    if comm.is_initialized() and comm.backend() == "gloo":
        time.sleep(GLOO_SETTLE_S)
        if GLOO_SHUTDOWN_WAITS:
            return
    comm.destroy_process_group()


def spawn(fn: Callable[..., Any], world_size: int, *args, backend: str = "gloo",
          timeout_s: float = 300.0, join_timeout_s: float | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local processes; return results.

    ``fn`` must be importable (module level). Raises ``WorkerFailed`` naming the first rank that
    raised or exited abnormally; the remaining ranks are terminated.
    """
    ctx = mp.get_context("spawn")
    remove_stale_spawn_dirs()
    store, port = own_store(timeout_s)
    sd = make_spawn_dir()
    try:
        return _spawn(ctx, fn, world_size, args, port, backend, timeout_s, join_timeout_s,
                      sd.path)
    finally:
        shutil.rmtree(sd.path, ignore_errors=True)
        release_spawn_dir(sd)
        del store


def _spawn(ctx, fn, world_size, args, port, backend, timeout_s, join_timeout_s,
           out_dir) -> list[Any]:
    """``spawn``'s ranks, met at the store on ``port``, reporting into ``out_dir``."""
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
    return f"process {exit_text(exitcode)} before reporting"


def exit_text(exitcode) -> str:
    """How a process ended, from ``multiprocessing``'s exit code: a negative code is the signal
    that killed it (named: SIGKILL is also what the kernel's OOM killer sends), a positive one
    the code it exited with (an uncaught exception exits 1)."""
    if exitcode is None:
        return "did not exit"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        hint = " (the OOM killer's signal, among others)" if -exitcode == signal.SIGKILL else ""
        return f"was killed by {name}{hint}"
    return f"exited with code {exitcode}"


def init_from_env(backend: str, timeout_s: float = 1800.0,
                  rendezvous_dir: str | None = None) -> tuple[int, int, int]:
    """torchrun / srun launch: init the default group from the environment (NCCL: on this
    rank's GPU, made current first). Under torchrun this rank dies with its agent. Under srun
    the store's port: ``MASTER_PORT`` if given, else the step's reserved port, else one rank 0
    binds and hands on through ``rendezvous_dir`` (shared by the step's ranks; without one: a
    port derived from the job and step ids, so steps of one job differ). RuntimeError naming
    the port where someone else holds it."""
    global _rendezvous
    info = comm.env_rank_info()
    if info is None:
        raise RuntimeError("no RANK/WORLD_SIZE (torchrun) or SLURM_PROCID/SLURM_NTASKS (srun) "
                           "in the environment; use the local launcher instead")
    rank, world, local = info
    device = _group_device(backend, local)
    if "RANK" in os.environ:
        _rendezvous = "torchrun"
        if os.environ.get("TORCHELASTIC_RUN_ID"):  # torchrun's worker: its agent is the parent
            die_with_parent(os.getppid())
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        with _port_error(os.environ["MASTER_PORT"], "MASTER_PORT"):
            comm.init_process_group(backend, rank, world, timeout_s=timeout_s,
                                    init_method="env://", device_id=device)
        return rank, world, local
    _rendezvous = "slurm"
    os.environ.setdefault("MASTER_ADDR", os.environ.get("SLURM_LAUNCH_NODE_IPADDR", "127.0.0.1"))
    port, where = _slurm_port(world, rendezvous_dir)
    if port is None:  # rank 0 binds one and hands it on through rendezvous_dir
        store, handed_on = _handed_on_store(os.environ["MASTER_ADDR"], rank, world, timeout_s,
                                            rendezvous_dir)
        comm.init_process_group(backend, rank, world, timeout_s=timeout_s, store=store,
                                device_id=device)
        comm.barrier()  # every rank has read the port: its file goes
        if rank == 0:
            with contextlib.suppress(OSError):
                os.unlink(handed_on)
        return rank, world, local
    os.environ["MASTER_PORT"] = str(port)
    with _port_error(port, where):
        comm.init_process_group(backend, rank, world, timeout_s=timeout_s, init_method="env://",
                                device_id=device)
    return rank, world, local


@contextlib.contextmanager
def _port_error(port, where: str):
    """A store that cannot listen on ``port`` because it is taken: one RuntimeError naming it."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - torch's DistNetworkError and kin
        if "EADDRINUSE" not in str(e) and "address already in use" not in str(e).lower():
            raise
        raise RuntimeError(
            f"rendezvous port {port} ({where}) is in use on {socket.gethostname()}: another "
            f"job or user holds it; unset MASTER_PORT (a port is then chosen for this step) or "
            f"give another") from None


def _step_ports() -> list[int]:
    """The ports Slurm reserved for this step (``srun --resv-ports``): "12000-12003" or
    "12000,12005"."""
    out = []
    for part in os.environ.get("SLURM_STEP_RESV_PORTS", "").split(","):
        lo, _, hi = part.strip().partition("-")
        if lo.isdigit() and (hi.isdigit() or not hi):
            out += list(range(int(lo), int(hi or lo) + 1))
    return out


STEP_PORT_BASE, STEP_PORT_SPAN = 20000, 12000  # derived ports: below the kernel's ephemeral range


def _slurm_port(world: int, rendezvous_dir: str | None) -> tuple[int | None, str]:
    """(the port of a Slurm step's store, where it comes from), or (None, "") when rank 0 is
    to bind one the kernel chooses and hand it on through ``rendezvous_dir``."""
    if os.environ.get("MASTER_PORT"):
        return int(os.environ["MASTER_PORT"]), "MASTER_PORT"
    if _step_ports():
        return _step_ports()[0], "SLURM_STEP_RESV_PORTS"
    if world == 1:
        return 0, "any"  # nobody to tell: the kernel chooses
    if rendezvous_dir:
        return None, ""
    job = os.environ.get("SLURM_JOB_ID", "")
    step = os.environ.get("SLURM_STEP_ID", "batch")
    digest = hashlib.sha256(f"{job}.{step}".encode()).digest()
    return (STEP_PORT_BASE + int.from_bytes(digest[:4], "big") % STEP_PORT_SPAN,
            f"derived from job {job} step {step}")


def _handed_on_store(addr: str, rank: int, world: int, timeout_s: float,
                     rendezvous_dir: str):
    """(the step's store, the file through which rank 0 handed its port on): rank 0 binds a
    port the kernel chooses (every interface) and writes it there; the others wait for it. The
    step's own identity (the same in every task of one srun) tells a stale file apart."""
    job = os.environ.get("SLURM_JOB_ID", "")
    step = os.environ.get("SLURM_STEP_ID", "batch")
    ident = ".".join(os.environ.get(k, "") for k in (
        "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_SRUN_COMM_PORT", "SLURM_STEP_LAUNCHER_PORT"))
    path = os.path.join(rendezvous_dir, f".rendezvous-{job}.{step}.json")
    if rank == 0:
        store = torch.distributed.TCPStore("127.0.0.1", 0, world, True,
                                           datetime.timedelta(seconds=timeout_s),
                                           wait_for_workers=False)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"step": ident, "port": store.port}, f)
        os.replace(tmp, path)
        os.environ["MASTER_PORT"] = str(store.port)
        return store, path
    end = time.monotonic() + timeout_s
    while True:
        try:
            with open(path) as f:
                doc = json.load(f)
            if doc.get("step") == ident:
                break
        except (OSError, ValueError):
            pass
        if time.monotonic() > end:
            raise RuntimeError(f"rank 0 of Slurm step {job}.{step} did not hand on its "
                               f"rendezvous port ({path}) within {timeout_s:.0f} s")
        time.sleep(0.1)
    os.environ["MASTER_PORT"] = str(doc["port"])
    return _client(addr, int(doc["port"]), timeout_s), path


def init_fake(rank: int, world_size: int) -> None:
    """The ``fake`` backend: collectives are no-ops on fake tensors (memory dry runs at paper
    scale on one CPU process)."""
    # torch's internal testing package: imported only by dry runs
    from torch.testing._internal.distributed.fake_pg import FakeStore

    comm.init_process_group("fake", rank, world_size, store=FakeStore())
