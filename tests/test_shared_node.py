"""A shared cluster node: other jobs of the same user, other accounts, containers sharing
``/tmp``, jobs killed at any instant. What the suite guarantees there (README, "Shared nodes"):

* Shared-memory segments have no name anyone can see or guess: a rank killed while they are set
  up leaves nothing behind, and another account watching the segment directory cannot force the
  slow path.
* The rendezvous port is bound by its owner before any rank is told it; two Slurm steps of one
  allocation do not collide.
* Stale spawn directories are removed only when their owner's lock is free (a PID in another
  PID namespace proves nothing).
* Checkpoints are private (0700 / 0600); a checkpoint another account owns or may write is
  refused unless ``checkpoint.allow_untrusted=true``; nothing in one is unpickled beyond the
  checkpoint format's own data types.
* No fixed name under the temporary directory; a planted symlink is never followed.
* Two runs sharing a checkpoint directory never delete each other's saves.
* ``launcher=torchrun``: the ranks die with the launcher and the record says ``cancelled``.
* A rank waiting on a stopped peer backs off; Hydra run folders are unique per run.

Tests that need a second account (``setpriv``, root) or a PID namespace (``unshare``) say so
where they skip; CI runs as root, where they run.
"""
from __future__ import annotations

import datetime
import json
import os
import pickle
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import pytest
import torch

from zero_repro import config as C
from zero_repro import schema
from zero_repro.runtime.comm import launch
from zero_repro.runtime.comm.cpu import shm
from zero_repro.runtime.comm.launch import WorkerFailed, spawn
from zero_repro.runtime.comm.topology import Topology
from zero_repro.runtime.comm.transport import bucket_transport
from zero_repro.runtime.train import checkpoint as ck

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OTHER = "zr-other"  # the second account (created where the tests run as root)


# ----------------------------------------------------------------------------- helpers
def as_other() -> list[str] | None:
    """A command prefix that runs a command as a second account, or None where this machine
    cannot (not root, no setpriv/useradd)."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        return None
    try:
        pw = pwd.getpwnam(OTHER)
    except KeyError:
        if not shutil.which("useradd"):
            return None
        # exit 9: created meanwhile by a test running beside this one
        p = subprocess.run(["useradd", "--system", "--no-create-home", "--shell",
                            "/usr/sbin/nologin", OTHER], capture_output=True, text=True)
        if p.returncode not in (0, 9):
            return None
        pw = pwd.getpwnam(OTHER)
    return ["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--clear-groups"]


def shared_tmp() -> str:
    """A fresh world-writable sticky directory (like /tmp or /dev/shm), removed by the caller."""
    d = tempfile.mkdtemp(prefix="zr-test-shared-")
    os.chmod(d, 0o1777)
    return d


def small_strategy(stage: int = 2):
    """A one-process (world 1) ZeRO strategy of a tiny GPT: enough to save and load."""
    from tests.test_checkpoint import make
    topo = Topology.build(tp=1)
    return make(topo, stage), topo


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


def test_a_fallback_to_gloo_is_said_on_the_step_line():
    """Where a DP group on one host falls back to point-to-point, the step line says so."""
    from zero_repro.lab.rank import step_line
    from zero_repro.runtime.zero.strategy import StepInfo
    info = StepInfo(skipped=False, grad_norm=1.0, loss_scale=1.0)
    line = step_line(0, 4, 3.0, info, 0.1, 1000, 1.0, 0.0, "mem", torch.device("cpu"), 2,
                     transport_note="dp pairwise (shared memory refused: /dev/shm full)")
    assert "dp pairwise (shared memory refused: /dev/shm full)" in line


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
             "from tests.test_shared_node import _rank_of\n"
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


# ------------------------------------------------------------------------ checkpoints
def _modes(root: str) -> set[tuple[str, str]]:
    out = set()
    for d, dirs, files in os.walk(root):
        out |= {("dir", oct(stat.S_IMODE(os.stat(os.path.join(d, x)).st_mode))) for x in dirs}
        out |= {("file", oct(stat.S_IMODE(os.stat(os.path.join(d, x)).st_mode))) for x in files}
    return out


def test_checkpoints_are_private(tmp_path):
    strategy, topo = small_strategy()
    root = str(tmp_path / "ck")
    ck.save(root, strategy, topo, 1)
    assert oct(stat.S_IMODE(os.stat(root).st_mode)) == "0o700"
    assert _modes(root) <= {("dir", "0o700"), ("file", "0o600")}, _modes(root)


def test_resume_refuses_a_checkpoint_others_can_write(tmp_path):
    strategy, topo = small_strategy()
    path = ck.save(str(tmp_path / "ck"), strategy, topo, 1)
    os.chmod(path, 0o777)
    with pytest.raises(ck.CheckpointError, match="writable by others"):
        ck.load(path, strategy, topo)
    assert ck.load(path, strategy, topo, trust=True)["step"] == 1  # the user said so


def test_resume_refuses_a_checkpoint_of_another_account(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("giving a checkpoint to another account needs root")
    other = as_other()
    if other is None:
        pytest.skip("no second account can be made here (useradd/setpriv)")
    strategy, topo = small_strategy()
    path = ck.save(str(tmp_path / "ck"), strategy, topo, 1)
    uid = pwd.getpwnam(OTHER).pw_uid
    for d, _, files in os.walk(path):
        for f in [d] + [os.path.join(d, x) for x in files]:
            os.chown(f, uid, -1)
    with pytest.raises(ck.CheckpointError, match=f"owned by uid {uid}"):
        ck.load(path, strategy, topo)


def test_resume_check_before_any_process_starts(tmp_path, monkeypatch):
    """The CLI's pre-flight refuses an untrusted checkpoint with the knob that allows it."""
    from zero_repro.lab import launcher
    strategy, topo = small_strategy()
    path = ck.save(str(tmp_path / "ck"), strategy, topo, 1)
    os.chmod(path, 0o775)
    cfg = C.Config()
    cfg.train.steps = 4
    cfg.checkpoint.resume = path
    with pytest.raises(ValueError, match="checkpoint.allow_untrusted=true"):
        launcher._check_resume(cfg, path)
    cfg.checkpoint.allow_untrusted = True
    launcher._check_resume(cfg, path)


class _Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _rehash(path: str) -> None:
    """What anyone who can write the directory can do: the manifest's hashes made to match."""
    with open(os.path.join(path, ck.MANIFEST)) as f:
        manifest = json.load(f)
    manifest["files"] = {n: ck._sha256(os.path.join(path, n)) for n in manifest["files"]}
    with open(os.path.join(path, ck.MANIFEST), "w") as f:
        json.dump(manifest, f)


def test_a_planted_metadata_pickle_is_not_run(tmp_path):
    strategy, topo = small_strategy()
    path = ck.save(str(tmp_path / "ck"), strategy, topo, 1)
    marker = tmp_path / "pwned"
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(_Payload(str(marker)), f)
    _rehash(path)
    _load_refused(path, strategy, topo, marker)


def _load_refused(path, strategy, topo, marker) -> None:
    """Loading ``path`` (this account's, private) raises CheckpointError, the payload unrun."""
    try:
        ck.load(path, strategy, topo)
        err = None
    except BaseException as e:  # noqa: BLE001 - DCP's own exception is a BaseException
        err = e
    assert not marker.exists(), "the planted payload ran"
    assert isinstance(err, ck.CheckpointError), repr(err)


def test_a_planted_byte_entry_is_not_unpickled(tmp_path):
    """The metadata names an entry as pickled bytes (DCP then ``torch.load``s it with
    weights_only=False): refused, the payload not run."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    strategy, topo = small_strategy()
    path = ck.save(str(tmp_path / "ck"), strategy, topo, 1)
    marker = tmp_path / "pwned"
    with open(os.path.join(path, ".metadata"), "rb") as f:
        md = pickle.load(f)
    key = "rng/rank0"
    payload = pickle.dumps(_Payload(str(marker)))
    with open(os.path.join(path, "__0_0.distcp"), "ab") as f:
        offset = f.tell()
        f.write(payload)
    md.state_dict_metadata[key] = BytesStorageMetadata()
    for idx in [i for i in md.storage_data if i.fqn == key]:
        info = md.storage_data.pop(idx)
        md.storage_data[type(idx)(key)] = type(info)(info.relative_path, offset, len(payload))
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    _rehash(path)
    _load_refused(path, strategy, topo, marker)


def test_latest_never_follows_a_planted_symlink(tmp_path):
    root = tmp_path / "ck"
    root.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("mine\n")
    os.symlink(victim, root / "latest.tmp")
    ck._write_latest(str(root), "step_00000001")
    assert victim.read_text() == "mine\n"
    assert (root / "latest").read_text().strip() == "step_00000001"


def test_the_example_has_no_fixed_checkpoint_directory(tmp_path):
    """``examples/minimal.py`` with no ``--ckpt-dir``: a fresh private directory, not a fixed
    name in the temporary directory (there a planted ``latest.tmp`` symlink overwrote a file
    of the user's)."""
    tmp = tmp_path / "tmp"
    fixed = tmp / "zr_minimal_ckpt"
    fixed.mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.write_text("mine\n")
    os.symlink(victim, fixed / "latest.tmp")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, TMPDIR=str(tmp), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPATH=REPO)
    p = subprocess.run([sys.executable, "-m", "zero_repro.examples.minimal", "--steps", "1"],
                       capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stderr[-2000:]
    assert victim.read_text() == "mine\n"
    saved = [ln for ln in p.stderr.splitlines() if "checkpoint " in ln][-1].rsplit(" ", 1)[1]
    assert os.path.dirname(saved) != str(fixed)
    assert oct(stat.S_IMODE(os.stat(os.path.dirname(saved)).st_mode)) == "0o700"


SAVER = r"""
import os, sys, time
import torch.distributed.checkpoint as dcp
from tests.test_shared_node import small_strategy
from zero_repro.runtime.train import checkpoint as ck
root, flag = sys.argv[1], sys.argv[2]
real = dcp.save
def paused(*a, **k):  # this run's save is written, not yet committed, while another saves
    out = real(*a, **k)
    print("writing", flush=True)
    while not os.path.exists(flag):
        time.sleep(0.05)
    return out
dcp.save = paused
strategy, topo = small_strategy()
print(ck.save(root, strategy, topo, 5), flush=True)
"""


def test_a_save_never_deletes_another_runs_save_in_progress(tmp_path):
    """Two runs sharing a checkpoint directory (runs that differ only in ``train.steps``): one
    saves while the other's save is being written (before: every save removed every unfinished
    save: FileNotFoundError in the other run)."""
    root, flag = str(tmp_path / "ck"), str(tmp_path / "go")
    other = subprocess.Popen([sys.executable, "-c", SAVER, root, flag], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=dict(os.environ, PYTHONPATH=REPO))
    try:
        line = other.stdout.readline()
        assert line.strip() == "writing", other.stderr.read()[-2000:]
        strategy, topo = small_strategy()
        ck.save(root, strategy, topo, 7)
    finally:
        open(flag, "w").close()
        out, err = other.communicate(timeout=120)
    assert other.returncode == 0, err[-2000:]
    assert [os.path.basename(p) for p in ck.committed(root)] == ["step_00000007",
                                                                 "step_00000005"]


@pytest.mark.slow
def test_two_runs_of_different_length_share_a_checkpoint_directory(tmp_path):
    """Two sweeps started together in one results directory, 60 and 64 steps, saving every
    step into their shared checkpoint directory: both end ``ok`` (before: the 64-step run
    failed with FileNotFoundError on its own .partial directory)."""
    from zero_repro.lab import records as R
    runs = [subprocess.Popen([sys.executable, os.path.join(REPO, "run.py"), "+exp=smoke",
                              f"train.steps={n}", "checkpoint.save_every=1",
                              "train.progress=false", "train.data=synthetic",
                              f"experiment.results_dir={tmp_path / 'results'}",
                              f"hydra.run.dir={tmp_path / str(n)}"],
                             cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for n in (60, 64)]
    outs = [p.communicate(timeout=900) for p in runs]
    for p, (out, _) in zip(runs, outs):
        assert p.returncode == 0, out[-2000:]
    recs = R.RecordStore.for_experiment(str(tmp_path / "results"), "smoke").load()
    assert sorted((r.config["train"]["steps"], r.status) for r in recs) == [(60, "ok"),
                                                                            (64, "ok")]


def test_an_interrupted_save_of_a_dead_run_is_removed(tmp_path):
    """What a killed run left (its lock is free) goes at the next save, as before."""
    root = tmp_path / "ck"
    (root / "step_00000003.partial").mkdir(parents=True)
    strategy, topo = small_strategy()
    ck.save(str(root), strategy, topo, 4)
    assert sorted(os.listdir(root)) == ["latest", "step_00000004"]


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
    from tests.test_trust import _tagged
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
