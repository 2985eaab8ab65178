"""A shared cluster node: other jobs of the same user, other accounts, containers sharing
``/tmp``, jobs killed at any instant. What the suite guarantees there (docs/running.md, "Shared
nodes"), its processes and ports (the checkpoints: ``test_shared_node_checkpoints.py``):

* Shared-memory segments have no name anyone can see or guess: a rank killed while they are set
  up leaves nothing behind, and another account watching the segment directory cannot force the
  slow path.
* The rendezvous port is bound by its owner before any rank is told it; two Slurm steps of one
  allocation do not collide.
* Stale spawn directories are removed only when their owner's lock is free (a PID in another
  PID namespace proves nothing).
* ``launcher=torchrun``: the ranks die with the launcher and the record says ``cancelled``.
* A rank waiting on a stopped peer backs off; Hydra run folders are unique per run.

Tests that need a second account (``setpriv``, root) or a PID namespace (``unshare``) say so
where they skip; CI runs as root, where they run.
"""
from __future__ import annotations

import datetime
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import pytest
import torch

from zero_repro import schema
from zero_repro.runtime.comm import launch
from zero_repro.runtime.comm.cpu import shm
from zero_repro.runtime.comm.launch import WorkerFailed, spawn
from zero_repro.runtime.comm.topology import Topology
from zero_repro.runtime.comm.transport import bucket_transport
from tests import REPO
from tests.integration.shared_node_helpers import as_other, shared_tmp


# ----------------------------------------------------------- shared-memory segments
def _killed_while_mapping(rank: int, world: int, seg_dir: str) -> None:
    shm.SHM_DIR = seg_dir  # a private directory: no other job's segments are counted
    real = torch.from_file
    if rank == 1:
        def from_file(*a, **k):  # SIGKILL right after the first segment is mapped: mid set-up
            t = real(*a, **k)
            os.kill(os.getpid(), signal.SIGKILL)
            return t
        torch.from_file = from_file
    bucket_transport(Topology.build(tp=1).dp_group)


def test_a_rank_killed_while_segments_are_set_up_leaves_no_segment(tmp_path, monkeypatch):
    monkeypatch.setenv("ZR_CPU_TRANSPORT", "auto")
    with pytest.raises(WorkerFailed):
        spawn(_killed_while_mapping, 2, str(tmp_path), timeout_s=20)
    # rank 1 was killed, rank 0 raised (its peer died): neither left a file
    assert os.listdir(tmp_path) == []


WATCHER = r"""
import os, sys, time
d, until = sys.argv[1], time.time() + float(sys.argv[2])
seen, planted = set(), 0
while time.time() < until:
    for f in os.listdir(d):
        if f.startswith("zr-") and f not in seen:
            seen.add(f)
            token = f.split("-")[1]
            for g in ("dp", "tp", "world"):
                for what in ["slots"] + ["buf%d" % i for i in range(16)]:
                    for q in range(8):
                        try:
                            os.close(os.open(os.path.join(d, "zr-%s-%s-%s-%d" % (token, g, what, q)),
                                             os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
                            planted += 1
                        except OSError:
                            pass
    if os.path.exists(os.path.join(d, "stop")):
        break
    time.sleep(0.0005)
print(len(seen), planted)
"""


def _shared_buffers(rank: int, world: int, seg_dir: str) -> dict:
    shm.SHM_DIR = seg_dir
    t = bucket_transport(Topology.build(tp=1).dp_group)
    time.sleep(0.5)  # the model is built between the channel and its buffers
    bufs = [t.buffer(1024, torch.float32) for _ in range(3)]
    return {"kind": type(t).__name__,
            "shared": [getattr(t, "channel", None) is not None
                       and t.channel.region_of(b) is not None for b in bufs]}


def test_another_account_watching_segments_cannot_force_the_slow_path(monkeypatch):
    """An account polling the segment directory plants every name it can derive from what it
    sees; the job keeps its shared-memory transport and buffers (the same account stands in
    where no second account can be made: the names are as visible to it)."""
    monkeypatch.setenv("ZR_CPU_TRANSPORT", "auto")
    seg_dir = shared_tmp()
    try:
        watcher = subprocess.Popen([*(as_other() or []), "/usr/bin/env", "python3", "-c",
                                    WATCHER, seg_dir, "60"], stdout=subprocess.PIPE, text=True)
        try:
            res = spawn(_shared_buffers, 2, seg_dir, timeout_s=60)
        finally:
            open(os.path.join(seg_dir, "stop"), "w").close()
            seen, planted = watcher.communicate(timeout=30)[0].split()
        assert [r["kind"] for r in res] == ["ShmTransport"] * 2
        assert all(all(r["shared"]) for r in res), (res, seen, planted)
        assert int(seen) == 0  # nothing of the job was there to see
    finally:
        shutil.rmtree(seg_dir, ignore_errors=True)


def _refused_step_line(rank: int, world: int, seg_dir: str) -> tuple[str, str, str]:
    """A DP group on one host whose peer's segment cannot be mapped (the kernel's answer
    stood in by an OSError): its transport, the reason kept on the group, rank 0's step line."""
    from zero_repro.lab.rank_log import dp_transport_note, step_line
    from zero_repro.runtime.zero.strategy import StepInfo

    shm.SHM_DIR = seg_dir

    def full(offer, nbytes):
        raise OSError(28, "No space left on device")
    shm._peer_segment = full
    group = Topology.build(tp=1).dp_group
    transport = bucket_transport(group)
    _, note = dp_transport_note(group, transport.name)
    info = StepInfo(skipped=False, grad_norm=1.0, loss_scale=1.0)
    line = step_line(0, 4, 3.0, info, 0.1, 1000, 1.0, 0.0, "mem", torch.device("cpu"), 2,
                     transport_note=note)
    return transport.name, group.channel_refused, line


def test_a_fallback_to_gloo_is_said_on_the_step_line(tmp_path, monkeypatch):
    """Where a DP group on one host falls back to point-to-point (a peer's segment cannot be
    mapped), the step line names the transport it fell back to and the group's reason."""
    monkeypatch.setenv("ZR_CPU_TRANSPORT", "auto")
    res = spawn(_refused_step_line, 2, str(tmp_path), timeout_s=60)
    for name, refused, line in res:
        assert name == "gloo" and "No space left on device" in refused, (name, refused)
        assert line.endswith(f"[dp {name} (shared memory refused: {refused})]"), line


# ----------------------------------------------------------------------- rendezvous
def _rank_of(rank, world):
    return rank


def test_the_rendezvous_port_is_bound_before_any_rank_is_told(monkeypatch):
    """Another account binds the port the ranks are given, as they start (before: bound by
    rank 0 seconds later; the run failed, reported as a hung rank)."""
    from multiprocessing.context import SpawnProcess

    squat: dict = {}
    real = SpawnProcess.start

    def start(self):
        if not squat:
            port = self._args[3]
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind(("0.0.0.0", port))
                s.listen()
                squat.update(sock=s, bound=True)
            except OSError as e:
                s.close()
                squat.update(bound=False, error=str(e))
        real(self)

    monkeypatch.setattr(SpawnProcess, "start", start)
    try:
        assert spawn(_rank_of, 1, timeout_s=30) == [0]
        assert squat["bound"] is False
    finally:
        if squat.get("sock"):
            squat["sock"].close()


SLURM_RANK = r"""
import os, sys, time
from zero_repro.runtime.comm import comm, launch
kw = {"rendezvous_dir": sys.argv[2]} if len(sys.argv) > 2 else {}
launch.init_from_env("gloo", 30, **kw)
print("up", os.environ.get("MASTER_PORT", ""), flush=True)
comm.barrier()
if sys.argv[1] == "hold":
    sys.stdin.read()
launch.teardown()
print("ok", flush=True)
"""


def _slurm_env(job: int, step: int, rank: int, world: int) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SLURM_") and k not in ("MASTER_PORT", "MASTER_ADDR", "RANK",
                                                       "WORLD_SIZE", "LOCAL_RANK")}
    env.update(SLURM_JOB_ID=str(job), SLURM_STEP_ID=str(step), SLURM_PROCID=str(rank),
               SLURM_NTASKS=str(world), SLURM_LOCALID=str(rank), SLURM_NNODES="1",
               SLURM_LAUNCH_NODE_IPADDR="127.0.0.1", PYTHONPATH=REPO)
    return env


def test_two_slurm_steps_of_one_job_do_not_share_a_port(tmp_path):
    """Two sweeps in one allocation: a step still running (world 1) and a second step (world 2)
    of the same job (before: both on 20000 + job % 20000; the second failed)."""
    job = 20000 + int(uuid.uuid4().int % 10000)
    hold = subprocess.Popen([sys.executable, "-c", SLURM_RANK, "hold"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_slurm_env(job, 0, 0, 1))
    try:
        assert hold.stdout.readline().startswith("up"), hold.stderr.read()[-2000:]
        second = [subprocess.Popen([sys.executable, "-c", SLURM_RANK, "go"],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env=_slurm_env(job, 1, r, 2)) for r in range(2)]
        outs = [p.communicate(timeout=120) for p in second]
        for p, (out, err) in zip(second, outs):
            assert p.returncode == 0 and out.strip().endswith("ok"), err[-2000:]
    finally:
        hold.communicate(input="", timeout=60)


@pytest.mark.slow  # CI's real Slurm runs (marker slurm) take this path at 2 and 4 ranks
def test_a_slurm_step_hands_its_port_on_through_the_run_directory(tmp_path):
    """Rank 0 binds a port the kernel chooses and its peer learns it from the run directory;
    the file goes once every rank has it."""
    ranks = [subprocess.Popen([sys.executable, "-c", SLURM_RANK, "go", str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=_slurm_env(777, 3, r, 2)) for r in range(2)]
    outs = [p.communicate(timeout=120) for p in ranks]
    for p, (out, err) in zip(ranks, outs):
        assert p.returncode == 0 and out.strip().endswith("ok"), err[-2000:]
    ports = {out.split()[1] for out, _ in outs}
    assert len(ports) == 1 and int(ports.pop()) > 0
    assert os.listdir(tmp_path) == []


def test_a_taken_rendezvous_port_is_one_clear_error(tmp_path):
    """A fixed MASTER_PORT someone else holds: one error naming the port and the cause."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        env = dict(_slurm_env(12345, 0, 0, 1), MASTER_PORT=str(port))
        p = subprocess.run([sys.executable, "-c", SLURM_RANK, "go"], capture_output=True,
                           text=True, env=env, timeout=120)
    assert p.returncode != 0
    line = [ln for ln in p.stderr.splitlines() if "rendezvous port" in ln]
    assert line and str(port) in line[-1] and "in use" in line[-1], p.stderr[-2000:]


# ------------------------------------------------------------------ spawn directories
def _wait_for(rank, world, flag):
    end = time.monotonic() + 120
    while not os.path.exists(flag) and time.monotonic() < end:
        time.sleep(0.1)
    return 7


def _unshare_pid() -> list[str] | None:
    """``unshare`` into a new PID namespace (as root, or in a user namespace), or None."""
    if not shutil.which("unshare"):
        return None
    for cmd in (["unshare", "--pid", "--fork", "--mount-proc"],
                ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc"]):
        if subprocess.run([*cmd, "true"], capture_output=True).returncode == 0:
            return cmd
    return None


def test_a_container_job_does_not_remove_a_live_spawn_directory(tmp_path, monkeypatch):
    """A job in another PID namespace sharing TMPDIR starts a spawn while this one runs: this
    job's directory stays (before: its owner's PID is not alive *there*, so it was removed
    and this run lost its results)."""
    unshare = _unshare_pid()
    if unshare is None:
        pytest.skip("no PID namespace can be made here (unshare needs root or user namespaces)")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    flag = str(tmp_path / "go")
    out: dict = {}

    def run():
        try:
            out["result"] = spawn(_wait_for, 1, flag, timeout_s=60)
        except BaseException as e:  # noqa: BLE001 - reported below
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    try:
        end = time.monotonic() + 60
        while not [d for d in os.listdir(tmp) if d.startswith(launch.SPAWN_PREFIX)]:
            assert time.monotonic() < end and t.is_alive(), out
            time.sleep(0.1)
        other = subprocess.run(
            [*unshare, sys.executable, "-c",
             "from zero_repro.runtime.comm import launch\n"
             "from tests.integration.test_shared_node import _rank_of\n"
             "assert launch.spawn(_rank_of, 1) == [0]"],
            capture_output=True, text=True, timeout=120, cwd=REPO,
            env=dict(os.environ, TMPDIR=str(tmp), PYTHONPATH=REPO))
        assert other.returncode == 0, other.stderr[-2000:]
    finally:
        open(flag, "w").close()
        t.join(120)
    assert out.get("result") == [7], out


def test_stale_spawn_directories_go_by_their_lock():
    """A spawn directory whose owner is gone is removed; one whose owner holds its lock stays,
    whatever its name says."""
    tmp = tempfile.mkdtemp(prefix="zr-test-spawn-")
    try:
        dead = launch.make_spawn_dir(tmp)
        launch.release_spawn_dir(dead)  # its owner died: nothing holds the lock
        live = launch.make_spawn_dir(tmp)
        launch.remove_stale_spawn_dirs(tmp)
        assert not os.path.exists(dead.path) and os.path.isdir(live.path)
        launch.release_spawn_dir(live)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# -------------------------------------------------------------------- waiting, folders
class _Group:
    name, rank, size = "dp", 0, 2

    def global_rank(self, r):
        return r


def test_a_rank_waiting_on_a_stopped_peer_backs_off():
    """Waiting 3 s on a peer that never comes costs a few percent of a core, not ~14%."""
    segments = [torch.zeros(shm.segment_bytes(), dtype=torch.uint8) for _ in range(2)]
    ch = shm.Channel(_Group(), segments, datetime.timedelta(seconds=3))
    cpu0, t0 = time.process_time(), time.monotonic()
    with pytest.raises(shm.ShmError, match="timed out"):
        ch._await(shm._READY, 1, "piece 1")
    cpu, wall = time.process_time() - cpu0, time.monotonic() - t0
    assert wall >= 3
    assert cpu / wall < 0.04, f"{cpu:.2f} s of CPU in {wall:.1f} s of waiting"


def test_hydra_run_folders_are_unique_per_run(monkeypatch, tmp_path):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from zero_repro import paths
    from zero_repro.lab import cli
    monkeypatch.setenv(paths.HOME_ENV, str(tmp_path))
    schema.register_configs()
    dirs = []
    for _ in range(2):  # within one second
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=cli.conf_dir(), version_base="1.3"):
            d = compose("config", overrides=["+exp=smoke"], return_hydra_config=True)
            dirs.append((str(d.hydra.run.dir), str(d.hydra.sweep.dir)))
    GlobalHydra.instance().clear()
    assert dirs[0][0] != dirs[1][0] and dirs[0][1] != dirs[1][1], dirs


# ----------------------------------------------------------------------------- torchrun
@pytest.mark.parametrize("sig", [signal.SIGTERM,
                                 pytest.param(signal.SIGKILL, marks=pytest.mark.slow)])
def test_torchrun_ranks_die_with_the_launcher(tmp_path, sig):
    """``launcher=torchrun``: the CLI signalled mid-training leaves no torchrun and no rank
    behind (before: both trained on to the end); SIGTERM records the point ``cancelled``."""
    from tests.integration.test_trust import _tagged
    from zero_repro.lab import records as R
    if not shutil.which("torchrun", path=os.path.dirname(sys.executable)):
        pytest.skip("no torchrun beside this Python")
    tag, results = uuid.uuid4().hex, tmp_path / "results"
    env = dict(os.environ, ZR_TEST_TAG=tag,
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    p = subprocess.Popen([sys.executable, os.path.join(REPO, "run.py"), "+exp=smoke",
                          "parallel.tp=1", "launcher=torchrun", "train.steps=100000",
                          "train.progress=false", "train.log_every=1",
                          f"experiment.results_dir={results}",
                          f"hydra.run.dir={tmp_path / 'hydra'}"],
                         cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env)
    deadline = time.monotonic() + 180
    for line in p.stderr:  # the ranks train
        if "step " in line and "loss" in line:
            break
        assert time.monotonic() < deadline
    assert p.poll() is None
    p.send_signal(sig)
    threading.Thread(target=p.stderr.read, daemon=True).start()
    p.wait(timeout=60)
    t0 = time.monotonic()
    while _tagged(tag) and time.monotonic() - t0 < 15:
        time.sleep(0.2)
    left = _tagged(tag)
    for q in left:  # not to leave them training
        q.kill()
    assert left == [], f"{len(left)} processes outlived the launcher by 15 s after {sig.name}"
    if sig == signal.SIGTERM:
        recs = R.RecordStore.for_experiment(str(results), "smoke").load()
        assert [r.status for r in recs] == ["cancelled"], [(r.status, r.reason) for r in recs]
