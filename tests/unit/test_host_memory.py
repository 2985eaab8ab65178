"""The host memory local ranks may use and the kernel's OOM killer (``lab.host_memory``): the
pre-flight takes the smallest of MemAvailable, the memory cgroup's limit and Slurm's ``--mem``
and names it; a rank the OOM killer ends is recorded ``oom`` with the cgroup and its limit, not
``failed`` as a rank "killed by SIGKILL". Fake cgroup trees (v1 and v2) cover the parsing; where this
account can make a child memory cgroup (root on cgroup v1 or v2), a real 2-rank job runs in one
whose limit it cannot fit: the pre-flight refuses it, and forced (``launcher.oversubscribe``) a
rank is OOM-killed and the record says ``oom``."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import pytest

from zero_repro import config as C
from zero_repro.lab import host_memory as H
from zero_repro.lab import launcher, preflight
from zero_repro.lab import records as R
from zero_repro.runtime.comm import launch
from tests import REPO

MB = 1 << 20


def _write(path, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def _proc(tmp_path, cgroup: str, mountinfo: str) -> tuple[str, str]:
    _write(tmp_path / "proc" / "cgroup", cgroup)
    _write(tmp_path / "proc" / "mountinfo", mountinfo)
    return str(tmp_path / "proc" / "cgroup"), str(tmp_path / "proc" / "mountinfo")


def _v1_tree(tmp_path, oom_kill: int = 0):
    """A v1 memory hierarchy: /slurm (limit 8 GiB, 7 used) / job_1 (limit 4 GiB, 3.5 GiB used of
    which 1 GiB inactive file pages) / step_0 (no limit), the process in step_0."""
    mnt = tmp_path / "sys" / "memory"
    levels = {"": (H.UNLIMITED * 2, 20 << 30, 0), "slurm": (8 << 30, 7 << 30, 0),
              "slurm/job_1": (4 << 30, 3584 * MB, 1 << 30),
              "slurm/job_1/step_0": (9223372036854771712, 3584 * MB, 1 << 30)}
    for rel, (limit, usage, inactive) in levels.items():
        d = mnt / rel
        _write(d / "memory.limit_in_bytes", f"{limit}\n")
        _write(d / "memory.usage_in_bytes", f"{usage}\n")
        _write(d / "memory.stat", f"cache 5\ntotal_inactive_file {inactive}\n")
    _write(mnt / "slurm/job_1/step_0/memory.oom_control",
           f"oom_kill_disable 0\nunder_oom 0\noom_kill {oom_kill}\n")
    return _proc(tmp_path, "5:cpu:/\n4:memory:/slurm/job_1/step_0\n0::/\n",
                 f"35 31 0:32 / {mnt} rw,relatime - cgroup cgroup rw,memory\n"
                 f"41 31 0:38 / {tmp_path}/sys/unified rw - cgroup2 cgroup2 rw\n")


def _v2_tree(tmp_path):
    """A v2 hierarchy mounted from /user.slice (a container's view): job.scope (memory.max
    2 GiB, 1.5 GiB current, no inactive file pages); its parent unlimited ("max")."""
    mnt = tmp_path / "sys" / "fs" / "cgroup"
    _write(mnt / "memory.max", "max\n")
    _write(mnt / "memory.current", "123\n")
    d = mnt / "job.scope"
    _write(d / "memory.max", f"{2 << 30}\n")
    _write(d / "memory.current", f"{1536 * MB}\n")
    _write(d / "memory.stat", "anon 5\ninactive_file 0\n")
    _write(d / "memory.events", "low 0\nhigh 0\nmax 4\noom 1\noom_kill 1\n")
    return _proc(tmp_path, "0::/user.slice/job.scope\n",
                 f"30 23 0:27 /user.slice {mnt} rw - cgroup2 cgroup2 rw,nsdelegate\n")


def test_v1_cgroup_found_and_its_tightest_ancestor_bounds(tmp_path):
    cg = H.find(*_v1_tree(tmp_path, oom_kill=3))
    assert cg is not None and cg.version == 1 and cg.path.endswith("slurm/job_1/step_0")
    free, limit, where = cg.headroom()
    # job_1: 4 GiB - (3.5 GiB - 1 GiB inactive) = 1.5 GiB; /slurm: 8 - 7 = 1 GiB (tighter)
    assert (free, limit) == (1 << 30, 8 << 30) and where.endswith("/memory/slurm")
    assert cg.oom_kills() == 3


def test_v2_cgroup_below_a_mounted_subtree(tmp_path):
    cg = H.find(*_v2_tree(tmp_path))
    assert cg is not None and cg.version == 2 and cg.path.endswith("cgroup/job.scope")
    assert cg.headroom() == (512 * MB, 2 << 30, cg.path)
    assert cg.oom_kills() == 1


def test_no_cgroup_readable_is_none(tmp_path):
    assert H.find(str(tmp_path / "nope"), str(tmp_path / "nope")) is None
    cg = H.find(*_proc(tmp_path, "4:memory:/x\n", "35 31 0:32 / /nonexistent rw - cgroup "
                                                  "cgroup rw,memory\n"))
    assert cg is None


def test_slurm_mem_per_node_and_per_cpu():
    assert H.slurm_mem_bytes({"SLURM_MEM_PER_NODE": "100"}) is None  # not in a job
    job = {"SLURM_JOB_ID": "7"}
    assert H.slurm_mem_bytes({**job, "SLURM_MEM_PER_NODE": "4096"}) == 4 << 30
    assert H.slurm_mem_bytes({**job, "SLURM_MEM_PER_CPU": "1000",
                              "SLURM_CPUS_ON_NODE": "8"}) == 8000 * MB
    assert H.slurm_mem_bytes({**job, "SLURM_MEM_PER_NODE": "0"}) is None  # --mem=0: all


def test_available_is_the_smallest_limit_and_names_it(tmp_path):
    cg = H.find(*_v2_tree(tmp_path))
    have, what = H.available(cg, env={})
    assert have == 512 * MB and "memory cgroup's limit of 2.15 GB" in what and cg.path in what
    have, what = H.available(cg, env={"SLURM_JOB_ID": "1", "SLURM_MEM_PER_NODE": "1"})
    assert have < MB and "Slurm's --mem" in what
    have, what = H.available(None, env={})
    assert what == "this machine's MemAvailable" and have > 512 * MB


def _big_cpu_config() -> C.Config:
    cfg = C.Config(parallel=C.ParallelConfig(world_size=2, tp=1))
    cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head = 8, 1024, 16  # ~150M params
    return cfg


def test_preflight_refuses_what_the_cgroup_cannot_hold(tmp_path, monkeypatch):
    cg = H.find(*_v2_tree(tmp_path))
    monkeypatch.setattr(H, "find", lambda: cg)
    with pytest.raises(ValueError, match=r"bound by the memory cgroup's limit of 2\.15 GB"):
        preflight.check_resources(_big_cpu_config())


def test_a_sigkill_with_a_risen_oom_count_is_recorded_oom(tmp_path, monkeypatch):
    """``run_training``: a rank SIGKILLed while the cgroup's oom_kill count rose fails the point
    "out of memory" naming the cgroup and its limit (recorded ``oom``); a SIGKILL without a rise
    (a user's kill -9) stays ``failed``."""
    paths = _v2_tree(tmp_path)
    cg = H.find(*paths)
    monkeypatch.setattr(H, "find", lambda: cg)
    events = os.path.join(cg.path, "memory.events")
    killed = f"process {launch.exit_text(-9)} before reporting"

    def spawn(fn, world, *a, rise: int, **k):
        _write(events, f"oom 1\noom_kill {1 + rise}\n")
        raise launch.WorkerFailed(1, killed)

    cfg = C.Config(parallel=C.ParallelConfig(world_size=2, tp=1))
    for rise, want in ((1, "oom"), (0, "failed")):
        _write(events, "oom 1\noom_kill 1\n")
        monkeypatch.setattr(launcher.spawn, "spawn",
                            lambda *a, rise=rise, **k: spawn(*a, rise=rise, **k))
        with pytest.raises(launch.WorkerFailed) as e:
            launcher.run_training(cfg, str(tmp_path / "run"), pre=None)
        status, reason = R.classify_failure(e.value)
        assert status == want, reason
        if want == "oom":
            assert "OOM killer" in reason and cg.path in reason and "limit 2.15 GB" in reason
            assert "oom_kill 1 -> 2" in reason and "\n" not in reason


def test_slurm_cgroup_oom_lines_are_oom():
    err = launch.WorkerFailed(-1, "srun exited with status 137; its last error lines:\n"
                                  "slurmstepd: error: Detected 1 oom-kill event(s) in "
                                  "StepId=12.0. Some of your processes may have been killed "
                                  "by the cgroup out-of-memory handler.")
    assert R.classify_failure(err)[0] == "oom"


# ------------------------------------------------------------------ a real memory cgroup
LIMIT = 1500 * MB  # the CLI and two ranks start (~1 GB); the 150M-parameter model does not fit


@pytest.fixture
def child_cgroup():
    """A child of this process's memory cgroup with ``LIMIT``, removed after; skips where
    this account cannot make one (not root, a read-only hierarchy, v2 without the memory
    controller delegated)."""
    cg = H.find()
    if cg is None:
        pytest.skip("no memory cgroup is mounted here")
    d = os.path.join(cg.path, f"zr_test_{uuid.uuid4().hex[:8]}")
    limit_file = "memory.limit_in_bytes" if cg.version == 1 else "memory.max"
    try:
        os.mkdir(d)
    except OSError as e:
        pytest.skip(f"cannot make a child memory cgroup in {cg.path}: {e}")
    try:
        with open(os.path.join(d, limit_file), "w") as f:
            f.write(str(LIMIT))
    except OSError as e:
        os.rmdir(d)
        pytest.skip(f"cannot set {limit_file} of a child memory cgroup: {e}")
    yield d
    for _ in range(100):  # the job's last processes may still be exiting
        try:
            os.rmdir(d)
            return
        except OSError:
            time.sleep(0.1)


def _cli_in(cgroup: str, results: str, *extra: str) -> subprocess.CompletedProcess:
    def enter():
        with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    return subprocess.run(
        [sys.executable, "run.py", "+exp=smoke", "model=small", "model.n_layer=8",
         "model.n_embd=1024", "model.n_head=16", "train.steps=2",
         f"experiment.results_dir={results}", *extra],
        cwd=REPO, preexec_fn=enter, capture_output=True, text=True, timeout=240)


def test_real_cgroup_limit_stops_the_preflight(child_cgroup, tmp_path):
    p = _cli_in(child_cgroup, str(tmp_path / "r"))
    err = p.stderr.strip().splitlines()
    assert p.returncode == 2 and err and "memory cgroup's limit of 1.57 GB" in err[-1], \
        (p.returncode, p.stderr[-2000:])
    assert child_cgroup in err[-1]


@pytest.mark.slow  # ~20-35 s: the CLI and two ranks start
def test_real_cgroup_oom_kill_is_recorded_oom(child_cgroup, tmp_path):
    results = tmp_path / "r"
    p = _cli_in(child_cgroup, str(results), "launcher.oversubscribe=true")
    with open(results / "smoke" / "points.jsonl") as f:
        (rec,) = [json.loads(line) for line in f]
    assert rec["status"] == "oom", (rec["status"], rec["reason"], p.stderr[-2000:])
    assert "OOM killer" in rec["reason"] and child_cgroup in rec["reason"], rec["reason"]
    assert "limit 1.57 GB" in rec["reason"], rec["reason"]
