"""Sweep runner: plan points -> skip those already done -> run each -> record it (the loop behind
every figure, paper §10). Entry points: ``run_sweep(cfg, experiment)`` and, on a compute node,
``python -m zero_repro.lab.sweep --point-file FILE`` (files from ``write_point_files``).

Contract: an experiment module (protocol: ``zero_repro.lab.points``) plans the points; each
point's config (experiment config + the point's overrides) is validated, and every point that
starts ranks here pre-flighted (``zero_repro.lab.preflight``), before any point runs. A point
recorded ``ok`` or ``oom`` at this code is skipped unless ``experiment.force=true``
(``reusable_keys``); the sweep says so, with that setting, and warns for a reused measured point
that ran on a loaded machine (``records.heavy_load``). Every point that runs leaves a Record
(``RecordStore.put``, atomic), whatever its end (``oom``, ``diverged``, ``failed`` + reason,
``timeout`` past ``launcher.timeout_min``), with the machine's load while it ran
(``records.load_between``); the sweep goes on. An interrupt records the running point
``cancelled`` and stops; re-running picks up where it stopped. One writer per point: a point runs only under its lock
(``runs/.locks/<key>.lock``), so concurrent sweeps skip each other's points. Checkpoints live in
``runs/ckpt-<id>/``, ``<id>`` the key without ``train.steps``/``train.warmup_steps``, so a longer
run resumes a shorter one.

Where points run: ``launcher=local`` / ``torchrun`` one after another here (an experiment whose
simulated points are independent, ``PARALLEL_POINTS``, runs them side by side with
``experiment.workers`` > 1 or 0 = the cores: ``lab.point_pool``); ``launcher=slurm``
submits each *measured* point as its own job through ``submitit`` (``nodes_for``), which runs
``run_and_record`` and writes its record itself; simulated and analytic points, and every point
inside an allocation (``SLURM_JOB_ID``), run here. A job that Slurm stopped or that died without
a record is recorded with Slurm's state and its log's last error lines (``zero_repro.lab.slurm``).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import dataclasses
import datetime
import functools
import logging
import math
import os
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import submitit
from filelock import FileLock, Timeout
from omegaconf import OmegaConf
from tqdm.auto import tqdm

from zero_repro import config as C
from zero_repro import schema
from zero_repro.paths import REPO_ROOT
from zero_repro.runtime.comm.launch import Terminated
from zero_repro.lab import launcher, point_pool, preflight
from zero_repro.lab import provenance as P
from zero_repro.lab import records as R
from zero_repro.lab import slurm as S
from zero_repro.lab.points import Point
from zero_repro.lab.registry import module_path
from zero_repro.lab.wandb_runs import point_environment

log = logging.getLogger(__name__)

RESULT_SECTIONS = ("memory", "comm", "topology", "hardware")


@dataclass
class PlannedPoint:
    point: Any  # zero_repro.lab.points.Point (run_dir filled in)
    cfg: C.Config  # the point's own validated config
    key: str

    @property
    def nodes(self) -> int:
        return nodes_for(self.cfg)


@dataclass
class SweepResult:
    sweep_id: str
    planned: list = field(default_factory=list)  # list[PlannedPoint]
    skipped: list = field(default_factory=list)  # keys
    reused: list = field(default_factory=list)  # the records standing for the skipped keys
    records: list = field(default_factory=list)  # Records written by this sweep
    busy: list = field(default_factory=list)  # keys another live process was running
    # records that could not be written into points.jsonl: (record, where it is instead)
    unsaved: list = field(default_factory=list)

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.records)


@dataclass
class Plan:
    """One command's plan, made once (``make_plan``) and handed on: the points with their
    validated configs and keys, the keys whose records stand for running them (``done``),
    and whether the points to run were pre-flighted on this machine."""

    cfg: C.Config
    experiment: Any
    points: list  # list[PlannedPoint]
    done: set = field(default_factory=set)
    checked: bool = False
    reused: dict = field(default_factory=dict)  # key -> the record that stands for it

    @property
    def todo(self) -> list:
        return [pp for pp in self.points if pp.key not in self.done]


def make_plan(cfg: C.Config, experiment: Any, machine: bool = True) -> Plan:
    """Plan the points (ValueError for an invalid point), find the done ones and, with
    ``machine``, pre-flight the others that start ranks here (ValueError naming the first that
    cannot run)."""
    points = plan(cfg, experiment)
    store = R.RecordStore.for_experiment(cfg.experiment.results_dir, cfg.experiment.name)
    out = Plan(cfg, experiment, points,
               set() if cfg.experiment.force else reusable_keys(store, points))
    if out.done:
        recs = store.done_records()
        out.reused = {k: recs[k] for k in out.done if k in recs}
    if machine:
        preflight.check_points(out.todo)
        out.checked = True
    return out


def new_sweep_id(name: str) -> str:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"{name}-{stamp}-{uuid.uuid4().hex[:6]}"


def nodes_for(cfg: C.Config) -> int:
    return max(1, math.ceil(cfg.parallel.world_size / max(1, cfg.cluster.gpus_per_node)))


def point_config(cfg: C.Config, overrides: dict) -> C.Config:
    """``cfg`` with dotted ``overrides`` applied, typed and validated (ValueError if bad)."""
    base = OmegaConf.structured(cfg)
    for dotted, value in overrides.items():
        if OmegaConf.select(base, dotted, default="__missing__") == "__missing__":
            raise ValueError(f"point override {dotted}={value!r} names no config key")
        OmegaConf.update(base, dotted, value, merge=False)
    return launcher.check_config(schema.to_config(base))


def plan(cfg: C.Config, experiment: Any) -> list[PlannedPoint]:
    """The experiment's points with their configs and keys; raises ValueError before anything
    runs if a point's config is invalid or two points share a key."""
    name = cfg.experiment.name
    out: list[PlannedPoint] = []
    seen: dict[str, str] = {}
    for point in experiment.plan(cfg):
        if not isinstance(point, Point):
            raise TypeError(f"{name}.plan() must return zero_repro.lab.points.Point objects")
        try:
            pcfg = point_config(cfg, point.overrides)
        except ValueError as e:
            raise ValueError(f"point {point.name!r} of experiment {name!r}: {e}") from None
        summary = schema.summary(pcfg)
        key = R.point_key(point.params, point.mode, summary)
        if key in seen:
            raise ValueError(f"points {seen[key]!r} and {point.name!r} of experiment {name!r} "
                             f"have the same params/config: give them distinct params")
        seen[key] = point.name
        runs = os.path.join(cfg.experiment.results_dir, name, "runs")
        if not pcfg.checkpoint.dir:
            pcfg.checkpoint.dir = os.path.join(runs, f"ckpt-{checkpoint_id(point, summary)}")
        out.append(PlannedPoint(dataclasses.replace(point, run_dir=os.path.join(runs, key)),
                                pcfg, key))
    return out


def checkpoint_id(point: Any, summary: dict) -> str:
    """The point key without the run length: runs that differ only in ``train.steps`` /
    ``warmup_steps`` (data is a function of (seed, step), warm-up only untimed) share
    checkpoints, so a longer run can continue a shorter one."""
    summary = copy.deepcopy(summary)
    for k in ("steps", "warmup_steps"):
        summary["train"][k] = None
    return R.point_key(point.params, point.mode, summary)


def reusable_keys(store: R.RecordStore, planned: list[PlannedPoint]) -> set[str]:
    """Keys of ``planned`` whose recorded result may stand for running them now: done (ok /
    oom) and made at this code, and for measured points on this machine
    (``lab.provenance.reusable``). The rest run (again)."""
    recs = store.done_records()
    return {pp.key for pp in planned if pp.key in recs and P.reusable(recs[pp.key], pp.cfg)}


def point_lock(pp: PlannedPoint) -> FileLock:
    folder = os.path.join(pp.cfg.experiment.results_dir, pp.cfg.experiment.name, "runs",
                          ".locks")
    os.makedirs(folder, exist_ok=True)
    return FileLock(os.path.join(folder, f"{pp.key}.lock"), timeout=0)


# ---------------------------------------------------------------------------- one point
class PointTimedOut(BaseException):
    """Raised in the main thread when a point runs past ``launcher.timeout_min`` on the local
    launcher (a BaseException, so no ``except Exception`` on the way swallows it; ``spawn``
    stops the ranks as it unwinds). Inside a Slurm job Slurm enforces the limit instead."""


def point_time_limit_s(cfg: C.Config) -> float:
    """Wall-clock seconds a point may run on the local launcher (0: no limit here)."""
    if os.environ.get("SLURM_JOB_ID"):
        return 0.0  # Slurm's --time (the same launcher.timeout_min) ends the job: its state
    return float(cfg.launcher.timeout_min) * 60.0


@contextlib.contextmanager
def wall_clock_limit(seconds: float, what: str):
    """Raise ``PointTimedOut`` in the main thread after ``seconds`` (SIGALRM); a no-op for
    ``seconds <= 0``, off the main thread, or where there is no ``setitimer``."""
    if (seconds <= 0 or not hasattr(signal, "setitimer")
            or threading.current_thread() is not threading.main_thread()):
        yield
        return

    def _fire(signum, frame):
        raise PointTimedOut(f"{what} ran past its wall-clock limit of {seconds / 60:g} min "
                            f"(launcher.timeout_min): its ranks were stopped")

    old = signal.signal(signal.SIGALRM, _fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def run_and_record(experiment: Any, pp: PlannedPoint, sweep_id: str,
                   store: R.RecordStore | None = None,
                   unsaved: list | None = None) -> R.Record | None:
    """Run one point under its lock, turn its outcome (result, OOM, divergence, failure) into a
    Record and store it. None: another live process holds the point, or finished it while
    this one waited (nothing run).

    KeyboardInterrupt / ``Terminated`` are recorded as ``cancelled`` and propagate."""
    cfg, point = pp.cfg, pp.point
    store = store or R.RecordStore.for_experiment(cfg.experiment.results_dir,
                                                  cfg.experiment.name)
    try:
        lock = point_lock(pp)
        lock.acquire()
    except Timeout:
        log.warning("point %s (%s) is running in another process: skipped here", point.name,
                    pp.key)
        return None
    except OSError as e:  # the results directory cannot be written: run it, keep its record
        log.warning("point %s: cannot take its lock (%s): running it without", point.name,
                    e.strerror or e)
        lock = None
    try:
        if not cfg.experiment.force and _finished_elsewhere(store, pp):
            log.info("point %s was finished by another process meanwhile", point.name)
            return None
        return _run_locked(experiment, pp, sweep_id, store, unsaved)
    finally:
        if lock is not None:
            lock.release()


def _finished_elsewhere(store: R.RecordStore, pp: PlannedPoint) -> bool:
    """Under the point's lock: a record of it that stands now (another sweep finished it since
    the plan looked)."""
    rec = store.done_records().get(pp.key)
    return rec is not None and P.reusable(rec, pp.cfg)


def _run_locked(experiment: Any, pp: PlannedPoint, sweep_id: str, store: R.RecordStore,
                unsaved: list | None = None) -> R.Record:
    cfg, point = pp.cfg, pp.point
    t0, load0 = time.perf_counter(), R.load_snapshot()
    status, reason, result = "ok", "", {}
    try:
        try:
            os.makedirs(point.run_dir, exist_ok=True)
        except OSError as e:  # a point that needs it fails on its own; others need not
            log.warning("point %s: no run directory (%s)", point.name, e.strerror or e)
        # names the point's live W&B run (logged by its rank 0, which inherits the environment)
        with point_environment(sweep_id, cfg.experiment.name, point.name), \
                wall_clock_limit(point_time_limit_s(cfg), f"point {point.name!r}"):
            result = experiment.run_point(cfg, point) or {}
    except PointTimedOut as e:
        status, reason = "timeout", str(e)
        log.warning("point %s (timeout): %s", point.name, reason)
    except (KeyboardInterrupt, Terminated) as e:
        _, reason = R.classify_failure(e)
        with R.signals_deferred():
            record = make_record(cfg, point, pp.key, "cancelled", reason or "interrupted", {},
                                 sweep_id, time.perf_counter() - t0, R.load_between(load0))
            e.interrupted_point = point.name
            e.recorded_in = keep_record(record, store, point.run_dir, unsaved)
        raise
    except Exception as e:  # noqa: BLE001 - every failure of a point is data
        status, reason = S.in_job(*R.classify_failure(e))  # Slurm's word, if inside a job
        # what the point measured before it failed (a diverged run's losses)
        result = getattr(e, "result", None) or {}
        log.warning("point %s (%s): %s", point.name, status, reason.splitlines()[0])
    with R.signals_deferred():  # a finished measurement is recorded before any interrupt
        record = make_record(cfg, point, pp.key, status, reason, result, sweep_id,
                             time.perf_counter() - t0, R.load_between(load0))
        keep_record(record, store, point.run_dir, unsaved)
    return record


RECORD_FILE = "record.json"  # in the point's run directory: a record points.jsonl refused


def keep_record(record: R.Record, store: R.RecordStore, run_dir: str,
                unsaved: list | None = None) -> str:
    """Write ``record`` into ``store`` (signals held back meanwhile); when that fails, into
    ``<run_dir>/record.json``, else print it as one JSON line; say where in an ``error:``
    line. Returns where it is (a path, or ``stdout``). Never raises for a write that failed:
    the sweep goes on."""
    try:
        store.put(record)  # (signals held back inside)
        return store.path
    except OSError as e:
        why = f"{store.path}: {e.strerror or e}"
    where = os.path.join(run_dir, RECORD_FILE)
    try:
        with R.signals_deferred():
            os.makedirs(run_dir, exist_ok=True)
            R.write_atomic(where, record.to_json() + "\n")
    except OSError as e:
        where = "stdout"
        why += f"; {os.path.join(run_dir, RECORD_FILE)}: {e.strerror or e}"
    if unsaved is not None:
        unsaved.append((record, where))
    if where == "stdout":
        print(f"error: point {record.point!r}: its record could not be written ({why}); "
              f"here it is, one JSON line to append to {store.path}:", file=sys.stderr)
        print(record.to_json(), flush=True)
    else:
        print(f"error: point {record.point!r}: its record could not be written ({why}); it "
              f"is kept in {where}: append that line to {store.path} when it can be written",
              file=sys.stderr)
    return where


def make_record(cfg: C.Config, point: Any, key: str, status: str, reason: str, result: dict,
                sweep_id: str, duration_s: float, load: dict | None = None) -> R.Record:
    """Record from a run_point result: either flat metrics or the run_training shape."""
    if "metrics" in result and isinstance(result["metrics"], dict):
        metrics = dict(result["metrics"])
        sections = {s: dict(result.get(s) or {}) for s in RESULT_SECTIONS}
    else:
        metrics = dict(result)
        sections = {s: {} for s in RESULT_SECTIONS}
    host = R.host_info()
    hardware = {**host, **sections["hardware"]}
    topology = {"world_size": cfg.parallel.world_size, "tp": cfg.parallel.tp,
                "dp": cfg.parallel.world_size // cfg.parallel.tp, "nodes": nodes_for(cfg),
                "gpus_per_node": cfg.cluster.gpus_per_node, "cluster": cfg.cluster.name,
                **sections["topology"]}
    return R.Record(key=key, experiment=cfg.experiment.name, point=point.name,
                    params=dict(point.params), mode=point.mode, status=status, reason=reason,
                    metrics=metrics, memory=sections["memory"], comm=sections["comm"],
                    topology=topology, hardware=hardware, hostname=host["hostname"],
                    config=schema.summary(cfg), git_sha=R.git_sha(), sweep_id=sweep_id,
                    timestamp=R.now_utc(), duration_s=round(duration_s, 3),
                    provenance=P.signature_of(point.mode, cfg), load=dict(load or {}))


# ------------------------------------------------------------------------------- sweeps
def run_sweep(cfg: C.Config, experiment: Any, *, plan: Plan | None = None,
              progress: bool | None = None, mirror: Any = None, sweep_id: str | None = None,
              submit: Callable | None = None) -> SweepResult:
    """Run ``plan`` (default: ``make_plan(cfg, experiment)``): skip its done points, run the
    rest (locally or as Slurm jobs), record each.

    ``mirror``: an object with ``log_record(record)`` (``zero_repro.lab.wandb_runs.WandbMirror``).
    ``submit``: replaces the Slurm submission (tests); default ``submit_slurm``."""
    name = cfg.experiment.name
    sweep_id = sweep_id or new_sweep_id(name)
    store = R.RecordStore.for_experiment(cfg.experiment.results_dir, name)
    if plan is None:
        plan = make_plan(cfg, experiment)
    elif not plan.checked:  # planned without this machine in mind (a Hydra launcher plugin)
        preflight.check_points(plan.todo)
    planned, done, todo = plan.points, plan.done, plan.todo
    result = SweepResult(sweep_id, planned, [pp.key for pp in planned if pp.key in done])
    result.reused = [plan.reused[k] for k in result.skipped if k in plan.reused]
    log.info("experiment %s: %d points, %d already done%s, %d to run (sweep %s)",
             name, len(planned), len(result.skipped),
             f" (reused; {FORCE} re-runs them)" if result.skipped else "", len(todo), sweep_id)
    for rec in result.reused:
        warn_if_loaded(rec)
        if mirror is not None and hasattr(mirror, "log_reused"):
            mirror.log_reused(rec)

    # inside an allocation already (salloc, an sbatch script, a hydra-submitit job) the points
    # run here: run_training's srun uses this allocation instead of submitting new jobs
    submit_jobs = cfg.launcher.name == "slurm" and "SLURM_JOB_ID" not in os.environ
    remote = [pp for pp in todo if submit_jobs and pp.point.mode == "measured"]
    remote_keys = {pp.key for pp in remote}
    local = [pp for pp in todo if pp.key not in remote_keys]
    show = cfg.train.progress if progress is None else progress
    # stays on screen (leave=True): points done / total, elapsed and ETA
    bar = tqdm(total=len(todo), desc=name, unit="pt", disable=not show or not todo, leave=True,
               bar_format="{desc}: {n_fmt}/{total_fmt} points |{bar}| [{elapsed}<{remaining}]"
                          "{postfix}")

    def _done(rec: R.Record | None, key: str = "") -> None:
        if rec is None:  # another process holds (or finished) the point
            result.busy.append(key)
            bar.update(1)
            return
        result.records.append(rec)
        if mirror is not None:
            mirror.log_record(rec)
        bar.set_postfix_str(f"{rec.point}: {rec.status}")
        bar.update(1)

    try:
        if remote:
            (submit or submit_slurm)(experiment, remote, sweep_id, _done)
        workers = point_pool.workers_for(cfg, experiment, local)
        if workers > 1:  # independent simulated points, side by side (lab.point_pool)
            bar.set_description(f"{name} [{workers} at once]")
            def _ended(rec: R.Record | None, pp: PlannedPoint, unsaved: list) -> None:
                result.unsaved.extend(unsaved)
                _done(rec, pp.key)

            job = functools.partial(_pool_job, module_path(experiment), sweep_id)
            point_pool.run_side_by_side(job, local, workers, _ended)
        for pp in local if workers == 1 else ():
            bar.set_description(f"{name} [{pp.point.name}]")
            _done(run_and_record(experiment, pp, sweep_id, store, result.unsaved), pp.key)
    finally:
        bar.close()
    return result


FORCE = "experiment.force=true"  # the setting every message about reuse names


def warn_if_loaded(rec: R.Record) -> None:
    """A reused measured point that ran on a loaded machine: one warning, with the re-run
    setting (its timings may be off; simulated/analytic numbers do not depend on load)."""
    why = R.heavy_load(rec.load) if rec.mode == "measured" else ""
    if why:
        log.warning("point %s is reused from %s, measured while %s: its timings may be off; "
                    "%s re-measures it", rec.point, rec.timestamp or "an earlier sweep",
                    why, FORCE)


# -------------------------------------------------------------------------------- Slurm
def slurm_parameters(cfg: C.Config, name: str) -> dict:
    """submitit SlurmExecutor parameters for one point: its own node count; one submitit task
    (the point runner, on the first node) in an allocation of one task per GPU that
    ``run_training`` fills with ``srun``."""
    per_node = min(cfg.cluster.gpus_per_node, cfg.parallel.world_size)
    # submitit counts nodes * ntasks_per_node tasks and waits for a result from each; the
    # point runner is ONE process (use_srun=False), so submitit is told 1 x 1 and the real
    # allocation goes in through additional_parameters, which override those #SBATCH lines
    params: dict[str, Any] = {
        "job_name": f"zr-{name}", "nodes": 1, "ntasks_per_node": 1,
        "time": max(1, math.ceil(cfg.launcher.timeout_min)), "use_srun": False,  # whole min
        "additional_parameters": {"nodes": nodes_for(cfg), "ntasks_per_node": per_node},
        "setup": [f"source {REPO_ROOT / 'slurm' / 'env.sh'}"],
        # --signal=USR2@<s>: the ranks note it and go on (zero_repro.lab.rank)
        "signal_delay_s": cfg.launcher.signal_delay_s,
    }
    if cfg.cluster.device == "cuda":
        params["gpus_per_node"] = per_node
        params["exclusive"] = True
    if cfg.launcher.partition:
        params["partition"] = cfg.launcher.partition
    if cfg.launcher.account:
        params["account"] = cfg.launcher.account
    return params


def submit_slurm(experiment: Any, points: list[PlannedPoint], sweep_id: str,
                 on_record: Callable[[R.Record], None]) -> None:
    """Submit every point as its own job, then wait for them. Records are written by the jobs; a
    job that ends without one (cancelled, out of time, killed) is recorded here with Slurm's
    state as its status (``lab.slurm``), and so is a job whose own record only saw its
    ranks die because Slurm cancelled it."""
    modname = module_path(experiment)
    jobs = []
    for pp in points:
        # the job may start in another directory: give it absolute paths
        pp = copy.deepcopy(pp)
        pp.cfg.experiment.results_dir = os.path.abspath(pp.cfg.experiment.results_dir)
        pp.point = dataclasses.replace(pp.point, run_dir=os.path.abspath(pp.point.run_dir))
        pp.cfg.checkpoint.dir = os.path.abspath(pp.cfg.checkpoint.dir)
        folder = os.path.join(pp.cfg.experiment.results_dir, pp.cfg.experiment.name, "runs",
                              "submitit", "%j")
        ex = submitit.SlurmExecutor(folder=folder)
        ex.update_parameters(**slurm_parameters(pp.cfg, f"{pp.cfg.experiment.name}-{pp.key}"))
        job = ex.submit(_slurm_job, modname, pp, sweep_id)
        log.info("point %s -> Slurm job %s (%d nodes)", pp.point.name, job.job_id, pp.nodes)
        jobs.append((pp, job))

    def store_of(pp: PlannedPoint) -> R.RecordStore:
        return R.RecordStore.for_experiment(pp.cfg.experiment.results_dir, pp.cfg.experiment.name)

    def on_result(item, value) -> None:
        pp, job = item
        if value is None:  # the job found the point running in another sweep: nothing recorded
            return
        if isinstance(value, R.Record):
            status, reason = S.correct_status(value.status, value.reason, job.job_id,
                                              _logs(job))
            rec = value
            if status != value.status:
                rec = dataclasses.replace(value, status=status, reason=reason)
                keep_record(rec, store_of(pp), pp.point.run_dir)
        else:  # the job raised outside run_and_record
            status, reason = R.classify_failure(value)
            status, reason = S.correct_status(status, reason, job.job_id, _logs(job))
            rec = make_record(pp.cfg, pp.point, pp.key, status, reason, {}, sweep_id, 0.0)
            keep_record(rec, store_of(pp), pp.point.run_dir)
        on_record(rec)

    def on_lost(item, job, state, code) -> None:
        pp, _ = item
        reason = S.describe_end(job.job_id, state, code, _logs(job))
        # COMPLETED without a record: the runner died quietly (e.g. a killed child): failed
        status = S.status_of(state) if state != "COMPLETED" else "failed"
        rec = make_record(pp.cfg, pp.point, pp.key, status, reason,
                          {"slurm_job_id": job.job_id}, sweep_id, 0.0)
        log.warning("point %s: %s", pp.point.name, reason.splitlines()[0])
        keep_record(rec, store_of(pp), pp.point.run_dir)
        on_record(rec)

    S.wait_for_jobs([((pp, job), job) for pp, job in jobs], on_result, on_lost)


def _logs(job) -> list[str]:
    return [str(p) for p in (job.paths.stderr, job.paths.stdout) if p.exists()]


def _pool_job(modname: str, sweep_id: str, pp: PlannedPoint) -> tuple:
    """One point in a ``lab.point_pool`` worker: (its record, what could not be stored)."""
    unsaved: list = []
    return run_and_record(importlib.import_module(modname), pp, sweep_id, None, unsaved), unsaved


def _slurm_job(modname: str, pp: PlannedPoint, sweep_id: str) -> R.Record:
    logging.basicConfig(level=logging.INFO)
    return run_and_record(importlib.import_module(modname), pp, sweep_id)


# --------------------------------------------------------------- point files (manual sbatch)
def write_point_files(planned: list[PlannedPoint], experiment: Any, sweep_id: str,
                      out_dir: str, done: set | frozenset = frozenset()) -> list[str]:
    """One YAML per point that needs a cluster (measured, not in ``done``) for
    ``sbatch slurm/<template> FILE`` (``lab.slurm.sbatch_command``; slurm/README.md).
    Simulated/analytic points run where they are planned."""
    todo = [pp for pp in planned if pp.point.mode == "measured" and pp.key not in done]
    if todo:
        os.makedirs(out_dir, exist_ok=True)
    paths = []
    for pp in todo:
        doc = {"experiment_module": module_path(experiment), "sweep_id": sweep_id, "key": pp.key,
               "nodes": pp.nodes, "point": pp.point.as_dict(), "config": schema.summary(pp.cfg)}
        path = os.path.join(out_dir, f"{pp.key}.yaml")
        OmegaConf.save(OmegaConf.create(doc), path + ".tmp")
        os.replace(path + ".tmp", path)
        paths.append(path)
    return paths


def run_point_file(path: str) -> R.Record | None:
    """Run the point described by a point file and record it (on a compute node)."""
    doc = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    cfg = launcher.check_config(schema.to_config(OmegaConf.create(doc["config"])))
    pp = PlannedPoint(Point.from_dict(doc["point"]), cfg, doc["key"])
    return run_and_record(importlib.import_module(doc["experiment_module"]), pp,
                          doc.get("sweep_id", ""))


def main(argv=None) -> int:
    """``python -m zero_repro.lab.sweep --point-file FILE``: run one planned point."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--point-file", required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    rec = run_point_file(args.point_file)
    if rec is None:
        log.info("point of %s: running or finished in another process", args.point_file)
        return 0
    log.info("point %s: %s %s", rec.point, rec.status, rec.reason.splitlines()[0] if rec.reason
             else "")
    return 0 if rec.status in R.DONE_STATUSES else 1


if __name__ == "__main__":
    raise SystemExit(main())
