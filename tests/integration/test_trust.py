"""Runs and records a user can trust: what a signal, a divergence, a resume or a second sweep
may and may not do.

* SIGTERM / SIGINT / SIGKILL of the CLI mid-training: no rank outlives it by 10 s, no
  temporary file is left (a SIGKILLed spawn's directory is removed by the next spawn), SIGINT
  and SIGTERM print one line (no traceback) and record the point ``cancelled``.
* A diverging fp16 run stops within a few steps as ``diverged``, exit status non-zero.
* A run extended past its last checkpoint (``train.steps`` raised, ``checkpoint.resume=auto``)
  continues it, and its table equals the uninterrupted run's.
* Two sweeps started together run every point once.
* Records: a non-``ok`` record never replaces an ``ok`` one; a killed writer's temporary file
  is removed; a JSON line that is not an object is skipped.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid

import psutil
import pytest

from experiments import fig5_convergence, smoke
from tests import REPO
from zero_repro.runtime.train import checkpoint
from zero_repro.lab import cli
from zero_repro import config as C
from zero_repro import validation
from zero_repro.runtime.comm import launch
from zero_repro.lab import records as R
from zero_repro.lab import sweep
from zero_repro.lab.points import Point
from zero_repro.runtime.train import loop
from zero_repro.lab.rank import resume_path
from zero_repro.lab.launcher import RunDiverged, run_training
from zero_repro.runtime.zero.strategy import StepInfo



def _tagged(tag: str) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get("ZR_TEST_TAG") == tag and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (psutil.Error, OSError):
            continue
    return out


def _ranks(tag: str) -> list[psutil.Process]:
    found = []
    for p in _tagged(tag):
        try:
            if "spawn_main" in " ".join(p.cmdline()):
                found.append(p)
        except psutil.Error:
            continue
    return found


def _tmp_files(root) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".tmp")]


def _noop(rank, world):
    return rank


@pytest.mark.parametrize("sig", [signal.SIGTERM,
                                 pytest.param(signal.SIGINT, marks=pytest.mark.slow),
                                 pytest.param(signal.SIGKILL, marks=pytest.mark.slow)])
def test_signalled_cli_leaves_no_rank_and_no_temp_file(tmp_path, sig):
    tag = uuid.uuid4().hex
    results = tmp_path / "results"
    p = subprocess.Popen([sys.executable, os.path.join(REPO, "run.py"), "+exp=smoke",
                          "parallel.tp=1", "train.steps=5000", "train.progress=false",
                          "checkpoint.save_every=1", f"experiment.results_dir={results}",
                          f"hydra.run.dir={tmp_path / 'hydra'}"],
                         cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, ZR_TEST_TAG=tag))
    deadline = time.monotonic() + 120
    while len(_ranks(tag)) < 2:  # both ranks started ...
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()
        time.sleep(0.2)
    ck = results / "smoke" / "runs"
    while not any(n.startswith("step_") for _, ds, _ in os.walk(ck) for n in ds):
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()
        time.sleep(0.2)  # ... and are training (saving a checkpoint every step)
    p.send_signal(sig)
    out, err = p.communicate(timeout=60)
    t0 = time.monotonic()
    while _tagged(tag) and time.monotonic() - t0 < 10:
        time.sleep(0.2)
    assert _tagged(tag) == [], f"processes outlived the CLI by 10 s after {sig.name}"
    if sig == signal.SIGKILL:
        stale = [d for d in os.listdir(tempfile.gettempdir())
                 if d.startswith(f"{launch.SPAWN_PREFIX}{p.pid}_")]
        launch.spawn(_noop, 1)  # the next spawn removes what the killed one left
        assert not [d for d in stale if os.path.exists(os.path.join(tempfile.gettempdir(), d))]
        store = R.RecordStore.for_experiment(str(results), "smoke")
        assert all(r.status != "ok" for r in store.load())
    else:
        assert p.returncode == 128 + sig, (p.returncode, err[-2000:])
        assert "Traceback" not in out + err, err[-3000:]
        lines = [ln for ln in err.splitlines() if ln.startswith("interrupted")]
        assert len(lines) == 1, err[-2000:]
        recs = R.RecordStore.for_experiment(str(results), "smoke").load()
        assert [r.status for r in recs] == ["cancelled"]
        assert not [d for d in os.listdir(tempfile.gettempdir())
                    if d.startswith(f"{launch.SPAWN_PREFIX}{p.pid}_")]
        # the CLI removed the save its ranks were in the middle of
        assert not [d for _, ds, _ in os.walk(ck) for d in ds if d.endswith(".partial")]
    leftover = _tmp_files(results)
    if sig == signal.SIGKILL:  # nobody is left to clean up: only a save that was never
        # committed may hold a temporary file, and no resume takes it (the next save removes it)
        assert all(os.path.basename(os.path.dirname(f)).endswith(".partial")
                   for f in leftover), leftover
        for root in {os.path.dirname(os.path.dirname(f)) for f in leftover}:
            assert not (checkpoint.latest(root) or "").endswith(".partial")
    else:
        assert leftover == []


def _cfg(tmp_path, **over) -> C.Config:
    cfg = C.Config()
    cfg.model = C.ModelConfig(n_layer=2, n_embd=32, n_head=4, seq_len=16, vocab_size=128,
                              vocab_pad_multiple=8)
    cfg.parallel.world_size, cfg.parallel.tp = 2, 1
    cfg.train.steps, cfg.train.warmup_steps, cfg.train.progress = 40, 1, False
    cfg.train.micro_batch_size = 2
    cfg.launcher.collective_timeout_s = 30.0
    cfg.experiment.results_dir = str(tmp_path / "results")
    for dotted, v in over.items():
        sec, key = dotted.split("__")
        setattr(getattr(cfg, sec), key, v)
    return validation.validate(cfg)


def test_diverging_fp16_run_stops_within_a_few_steps_as_diverged(tmp_path):
    cfg = _cfg(tmp_path, zero__dtype="fp16", train__lr=1000.0, zero__initial_scale_power=8)
    t0 = time.monotonic()
    with pytest.raises(RunDiverged) as e:
        run_training(cfg, str(tmp_path / "run"))
    assert "diverged at step" in str(e.value), e.value
    step = int(str(e.value).split("diverged at step ")[1].split(":")[0])
    assert step < 6, f"trained on until step {step}"
    assert R.classify_failure(e.value)[0] == "diverged"
    # what it measured until then comes with it: the steps before the diverging one
    assert len(e.value.result["metrics"]["losses"]) == step
    assert time.monotonic() - t0 < 60


def test_diverged_cli_run_exits_nonzero_and_is_recorded(tmp_path):
    p = subprocess.run([sys.executable, os.path.join(REPO, "run.py"), "+exp=smoke",
                        "parallel.tp=1", "zero.dtype=fp16", "train.lr=1000",
                        "zero.initial_scale_power=8", "train.steps=40", "train.progress=false",
                        f"experiment.results_dir={tmp_path}",
                        f"hydra.run.dir={tmp_path / 'hydra'}"],
                       cwd=REPO, capture_output=True, text=True, timeout=180)
    assert p.returncode == 1, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    assert "diverged" in p.stdout
    rec = R.RecordStore.for_experiment(str(tmp_path), "smoke").load()[-1]
    assert rec.status == "diverged" and "diverged at step" in rec.reason
    # a clean reason (one line, no traceback, no machine paths) and the losses until then
    assert "\n" not in rec.reason and "Traceback" not in rec.reason and "/" not in rec.reason
    step = int(rec.reason.split("diverged at step ")[1].split(":")[0])
    assert len(rec.metrics["losses"]) == step
    assert rec.metrics["losses_of"].endswith("'s micro-batches")


def _info(skipped: bool, scale: float) -> StepInfo:
    return StepInfo(skipped=skipped, grad_norm=float("inf") if skipped else 1.0,
                    loss_scale=scale)


def test_divergence_rules():
    fp32, fp16 = C.Config(), C.Config()
    fp16.zero.dtype, fp16.zero.min_loss_scale = "fp16", 1.0
    with pytest.raises(loop.Diverged, match="loss is nan"):
        loop._check_divergence(0, float("nan"), _info(False, 1.0), fp32, 0)
    run = 0
    for step in range(loop.FLOOR_SKIPS - 1):  # fp32: a skipped step is at the floor already
        run = loop._check_divergence(step, 3.0, _info(True, 1.0), fp32, run)
    with pytest.raises(loop.Diverged, match="non-finite in fp32"):
        loop._check_divergence(9, 3.0, _info(True, 1.0), fp32, run)
    run = 0
    for step in range(20):  # fp16 above the floor: overflow skips are how scaling works
        run = loop._check_divergence(step, 3.0, _info(True, 2.0 ** 16), fp16, run)
    assert run == 0
    for step in range(loop.FLOOR_SKIPS - 1):
        run = loop._check_divergence(step, 3.0, _info(True, 1.0), fp16, run)
    with pytest.raises(loop.Diverged, match="floor"):
        loop._check_divergence(9, 3.0, _info(True, 1.0), fp16, run)


def _table(results: str, steps: int) -> list[tuple]:
    """(step, loss) rows smoke.summarize makes from the run of ``steps`` steps."""
    recs = [r for r in R.RecordStore.for_experiment(results, "smoke").load()
            if r.config["train"]["steps"] == steps]
    return [(row["x_value"], row["y_value"]) for row in smoke.summarize(recs)]


@pytest.mark.slow
def test_extended_run_continues_its_checkpoint_and_gives_the_uninterrupted_table(tmp_path):
    """steps=6 uninterrupted == steps=4 (checkpoint every 2) then steps=6 resume=auto."""
    def cfg(results, **over):
        c = _cfg(tmp_path, **{"train__steps": 6, "checkpoint__save_every": 2, **over})
        c.experiment.name, c.experiment.results_dir = "smoke", str(results)
        return c

    full, part = tmp_path / "full", tmp_path / "part"
    sweep.run_sweep(cfg(full), smoke, progress=False)
    sweep.run_sweep(cfg(part, train__steps=4), smoke, progress=False)
    res = sweep.run_sweep(cfg(part, checkpoint__resume="auto"), smoke, progress=False)
    (rec,) = res.records
    assert rec.status == "ok", rec.reason
    assert rec.metrics["start_step"] == 4 and len(rec.metrics["losses"]) == 2
    want, got = _table(str(full), 6), _table(str(part), 6)
    assert [x for x, _ in want] == [1, 2, 3, 4, 5, 6]  # 1-based optimizer steps
    assert [x for x, _ in got] == [1, 2, 3, 4, 5, 6]
    assert got[:4] == want[:4]  # carried over from the checkpoint: the same numbers
    assert [y for _, y in got] == pytest.approx([y for _, y in want], abs=1e-6)


def test_fig5_places_a_resumed_records_steps(tmp_path):
    """A resumed fig5 record (losses from start_step, the earlier ones from its checkpoint)
    gives the same rows as the uninterrupted one: before the fix it was compared position by
    position (steps 3.. against the reference's 0..)."""
    ref = [3.0, 2.5, 2.0, 1.8, 1.7, 1.6]
    base = dict(experiment="fig5_convergence", mode="measured", status="ok",
                config={"model": {"name": "tiny"}, "parallel": {"world_size": 4, "tp": 2},
                        "train": {"steps": 6}})

    def record(name, **metrics):
        return R.Record(key=name, point=name, params={"config": name, "dtype": "fp32"},
                        metrics=metrics, **base)

    whole = [record("stage0", losses=ref), record("stage1", losses=ref)]
    resumed = [record("stage0", losses=ref),
               record("stage1", losses=ref[3:], start_step=3, losses_before_start=ref[:3])]
    assert fig5_convergence.summarize(resumed) == fig5_convergence.summarize(whole)
    (head,) = [r for r in fig5_convergence.summarize(resumed) if r["y_name"].startswith("max")]
    assert head["y_value"] == 0.0 and head["x_value"] == 6


def test_resume_falls_back_to_the_newest_committed_checkpoint(tmp_path):
    root = tmp_path / "ck"
    for step, committed in [(2, True), (4, True), (6, False)]:
        d = root / f"step_{step:08d}"
        d.mkdir(parents=True)
        if committed:
            (d / "manifest.json").write_text("{}")
    (root / "latest").write_text("step_00000006\n")
    assert checkpoint.latest(str(root)) == str(root / "step_00000004")
    os.remove(root / "step_00000004" / "manifest.json")  # a deleted manifest
    assert checkpoint.latest(str(root)) == str(root / "step_00000002")
    os.remove(root / "step_00000002" / "manifest.json")
    cfg = C.Config()
    cfg.checkpoint.dir, cfg.checkpoint.resume = str(root), "latest"
    with pytest.raises(ValueError, match="3 step directories but none is committed"):
        resume_path(cfg, str(tmp_path))
    cfg.checkpoint.resume = "auto"
    assert resume_path(cfg, str(tmp_path)) is None


_EXP = '''
import os, time
from zero_repro.lab.points import Point
def plan(cfg):
    return [Point(name=f"p{i}", params={"i": i}, mode="measured") for i in range(4)]
def run_point(cfg, point):
    with open(os.environ["ZR_CALLS"], "a") as f:
        f.write(f"{os.getpid()} {point.name}\\n")
    time.sleep(1.0)
    return {"y": point.params["i"]}
def summarize(records):
    return []
'''

_RUN = '''
import sys
import zr_lock_exp
from zero_repro import config as C
from zero_repro import validation
from zero_repro.lab import sweep
cfg = C.Config()
cfg.experiment.name, cfg.experiment.results_dir = "lockexp", sys.argv[1]
cfg.train.progress = False
res = sweep.run_sweep(cfg, zr_lock_exp, progress=False)
print("ran", len(res.records), "busy", len(res.busy), "skipped", len(res.skipped))
'''


def test_two_concurrent_sweeps_run_each_point_once(tmp_path):
    (tmp_path / "zr_lock_exp.py").write_text(textwrap.dedent(_EXP))
    calls = tmp_path / "calls.txt"
    env = dict(os.environ, ZR_CALLS=str(calls),
               PYTHONPATH=os.pathsep.join([str(tmp_path), REPO]))
    results = str(tmp_path / "results")
    procs = [subprocess.Popen([sys.executable, "-c", _RUN, results], env=env, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=180) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    ran = [line.split()[1] for line in calls.read_text().splitlines()]
    assert sorted(ran) == ["p0", "p1", "p2", "p3"], ran  # each point once, by one of them
    recs = R.RecordStore.for_experiment(results, "lockexp").load()
    assert sorted(r.point for r in recs) == ["p0", "p1", "p2", "p3"]
    assert len({r.key for r in recs}) == 4


def _rec(key, status, point="p") -> R.Record:
    return R.Record(key=key, experiment="x", point=point, params={}, mode="measured",
                    status=status, timestamp=R.now_utc())


def test_non_ok_never_replaces_ok_unless_forced(tmp_path):
    store = R.RecordStore(str(tmp_path / "x" / "points.jsonl"))
    store.put(_rec("k", "ok"))
    for status in ("failed", "diverged", "cancelled", "timeout", "node_fail", "oom"):
        assert store.put(_rec("k", status)) is False
    assert [r.status for r in store.load()] == ["ok"]
    assert store.put(_rec("k", "failed"), replace_ok=True)
    assert [r.status for r in store.load()] == ["failed"]
    assert set(R.STATUSES) >= {"ok", "oom", "diverged", "cancelled", "timeout", "node_fail",
                               "failed"}
    assert set(R.DONE_STATUSES) == {"ok", "oom"}


def test_store_removes_killed_writers_temp_files_and_skips_non_objects(tmp_path):
    store = R.RecordStore(str(tmp_path / "x" / "points.jsonl"))
    store.put(_rec("a", "ok"))
    litter = tmp_path / "x" / "points.jsonl.99999999.tmp"
    litter.write_text("half a file")
    with open(store.path, "a") as f:
        f.write("[1, 2, 3]\n42\n\"text\"\nnull\n")
    assert [r.key for r in store.load()] == ["a"]  # no crash on valid JSON that is no object
    store.put(_rec("b", "ok"))
    assert not litter.exists()
    assert [r.key for r in store.load()] == ["a", "b"]
    assert json.loads(open(store.path).read().splitlines()[0])["key"] == "a"


def test_classify_cpu_allocation_failure_and_signals():
    cpu = RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't "
                       "allocate memory: you tried to allocate 1099511627776 bytes")
    assert R.classify_failure(launch.WorkerFailed(0, f"RuntimeError: {cpu}"))[0] == "oom"
    assert R.classify_failure(KeyboardInterrupt())[0] == "cancelled"
    assert R.classify_failure(launch.Terminated(signal.SIGTERM))[0] == "cancelled"


@pytest.mark.slow
def test_fifty_world3_spawns_without_a_false_failure(tmp_path):
    """The teardown abort (gloo objects destroyed at interpreter exit) is gone: 50 runs of
    3 ranks, each to the end, report no failure."""
    failures = []
    for i in range(50):
        cfg = _cfg(tmp_path, parallel__world_size=3, train__steps=2, zero__stage=2)
        try:
            run_training(cfg, str(tmp_path / f"r{i}"))
        except launch.WorkerFailed as e:
            failures.append(str(e).splitlines()[0])
    assert failures == []


def test_local_point_past_its_time_limit_is_recorded_timeout(tmp_path):
    """launcher.timeout_min on the local launcher: the point's ranks are stopped, its record
    says ``timeout``, the CLI exits non-zero, no rank outlives it."""
    tag = uuid.uuid4().hex
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, os.path.join(REPO, "run.py"), "+exp=smoke",
                        "parallel.tp=1", "train.steps=100000", "train.progress=false",
                        "launcher.timeout_min=0.15", f"experiment.results_dir={tmp_path}",
                        f"hydra.run.dir={tmp_path / 'hydra'}"],
                       cwd=REPO, capture_output=True, text=True, timeout=240,
                       env=dict(os.environ, ZR_TEST_TAG=tag))
    assert p.returncode == 1, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    assert time.monotonic() - t0 < 120
    assert "Traceback" not in p.stdout + p.stderr, p.stderr[-3000:]
    (rec,) = R.RecordStore.for_experiment(str(tmp_path), "smoke").load()
    assert rec.status == "timeout" and "launcher.timeout_min" in rec.reason, rec.reason
    assert 9 <= rec.duration_s < 60, rec.duration_s
    deadline = time.monotonic() + 10
    while _tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _tagged(tag) == []


class _OomExperiment:
    """Two points: one fits, one runs out of memory."""

    @staticmethod
    def plan(cfg):
        return [Point(name=f"p{i}", params={"i": i}, mode="simulated") for i in range(2)]

    @staticmethod
    def run_point(cfg, point):
        if point.params["i"] == 1:
            raise MemoryError("CPU allocation of 10 GB failed")
        return {"y": 1.0}

    @staticmethod
    def summarize(records):
        return []


def test_cli_exits_nonzero_when_a_point_ran_out_of_memory(tmp_path, capsys):
    """An ``oom`` record is a result (kept, not run again) but not a success: exit 1."""
    cfg = C.Config()
    cfg.experiment.name, cfg.experiment.results_dir = "oomexp", str(tmp_path)
    cfg.train.progress = False
    with pytest.raises(SystemExit) as e:
        cli.run(cfg, _OomExperiment)
    assert e.value.code == 1
    recs = R.RecordStore.for_experiment(str(tmp_path), "oomexp").load()
    assert sorted(r.status for r in recs) == ["ok", "oom"]
    assert "oom 1" in capsys.readouterr().out
