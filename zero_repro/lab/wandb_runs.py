"""Weights & Biases runs for a sweep's points (optional; the records in ``results/`` are the truth).

With ``logging.wandb=true`` every point is one W&B run (``group`` = experiment, ``job_type`` =
sweep id, ``name`` = point, set per point through ``point_environment``), written by one of two
writers: ``StepLogger`` (live, rank 0 of a training point: ONE ``log`` per optimizer step holding
every series, since W&B drops a step lower than the last; the final metrics and ledgers in the
summary; the record then carries ``metrics.wandb_run``) or ``WandbMirror`` (the sweep, after a
record is written, for every other record: config, per-step series, scalars and ledgers; and for
a point the sweep reuses instead of running, its record, tagged ``reused``, unless it was logged
live when it ran). Both write under ``$WANDB_DIR`` or else ``paths.wandb_dir(results_dir)``: the
offline runs are ``<results_dir>/wandb/offline-run-*`` (``wandb sync <results_dir>/wandb`` uploads
them all). Mode ``logging.wandb_mode``
(``offline`` by default: nothing leaves the machine; ``wandb sync`` later). Never fatal: when disabled, or wandb cannot be imported or fails, a warning is logged and
the writer turns itself off. The mirror's ``backend`` argument is a seam for tests.
"""
from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

from zero_repro import config as C
from zero_repro import schema
from zero_repro import paths

log = logging.getLogger(__name__)


def flatten(d: dict, prefix: str = "", sep: str = "/") -> dict:
    """Nested dict -> {"a/b/c": value}; lists are kept as they are."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        name = f"{prefix}{sep}{k}" if prefix else str(k)
        if isinstance(v, dict):
            out.update(flatten(v, name, sep))
        else:
            out[name] = v
    return out


def summary_of(result: dict) -> dict:
    """Run summary from a rank_main result: scalar metrics and the ledgers, flattened."""
    out = {k: v for k, v in flatten(result.get("metrics", {})).items()
           if isinstance(v, (int, float, str, bool))}
    for section in ("memory", "comm"):
        out.update({k: v for k, v in flatten(result.get(section) or {}, section).items()
                    if isinstance(v, (int, float))})
    out["status"] = "ok"
    return out


class StepLogger:
    """``log_step(step, **series)`` once per step; ``finish(summary, exit_code)`` at the end."""

    def __init__(self, run: Any = None):
        self.run = run

    @property
    def active(self) -> bool:
        return self.run is not None

    @classmethod
    def start(cls, cfg: C.Config, run_dir: str, enabled: bool = True,
              backend: Any = None) -> "StepLogger":
        lc = cfg.logging
        if not (enabled and lc.wandb and lc.wandb_mode != "disabled"):
            return cls()
        try:
            if backend is None:
                import wandb as backend  # optional dependency: only when logging.wandb=true
            directory = os.environ.get("WANDB_DIR") or str(
                paths.wandb_dir(cfg.experiment.results_dir))
            os.makedirs(directory, exist_ok=True)
            run = backend.init(project=lc.wandb_project, entity=lc.wandb_entity or None,
                               config=schema.summary(cfg), mode=lc.wandb_mode, dir=directory,
                               name=os.environ.get("WANDB_NAME") or os.path.basename(run_dir),
                               group=os.environ.get("WANDB_RUN_GROUP") or cfg.experiment.name)
        except Exception as e:  # noqa: BLE001 - W&B must never break a training run
            log.warning("W&B: could not start a run (%s): not logging this point", e)
            return cls()
        return cls(run)

    def log_step(self, step: int, **series: float) -> None:
        if self.run is None:
            return
        try:
            self.run.log(dict(series), step=step)
        except Exception as e:  # noqa: BLE001
            log.warning("W&B: log failed at step %d (%s): logging switched off", step, e)
            self.run = None

    def finish(self, summary: dict, exit_code: int) -> str:
        """Write ``summary``, finish the run; return its id ("" if there was none)."""
        run, self.run = self.run, None
        if run is None:
            return ""
        try:
            for k, v in summary.items():
                run.summary[k] = v
            run.finish(exit_code=exit_code)
        except Exception as e:  # noqa: BLE001
            log.warning("W&B: finishing the run failed (%s)", e)
        return str(getattr(run, "id", "") or "")

STEP_SERIES = {"losses": "loss", "step_times_s": "step_time_s", "grad_norms": "grad_norm",
               "loss_scales": "loss_scale"}


@contextlib.contextmanager
def point_environment(sweep_id: str, experiment: str, point: str):
    """W&B's own variables naming the live run of one point, set while it runs (every rank
    inherits them), restored afterwards."""
    names = {"WANDB_RUN_GROUP": experiment, "WANDB_JOB_TYPE": sweep_id, "WANDB_NAME": point}
    saved = {k: os.environ.get(k) for k in names}
    os.environ.update(names)
    try:
        yield names
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def step_rows(metrics: dict) -> list[tuple[int, dict]]:
    """Per-step series of a record as (step, dict) per step at the true step index: the series
    end at the run's last step (step_times_s covers only the timed, last steps); a resumed
    run's series start at ``metrics.start_step``, and the losses it carried over from its
    checkpoint (``losses_before_start``) are logged at steps 0 .. start_step - 1."""
    series = {name: metrics[key] for key, name in STEP_SERIES.items()
              if isinstance(metrics.get(key), list)}
    start = int(metrics.get("start_step") or 0)
    n = max((len(v) for v in series.values()), default=0)
    rows: dict[int, dict] = {}
    before = metrics.get("losses_before_start")
    if n and isinstance(before, list) and len(before) == start:
        for i, v in enumerate(before):
            if v is not None:
                rows.setdefault(i, {})["loss"] = v
    for name, values in series.items():
        for i, v in enumerate(values, start=start + n - len(values)):
            if v is not None:
                rows.setdefault(i, {})[name] = v
    return sorted(rows.items())


def _load_wandb():
    try:
        import wandb
    except Exception as e:  # noqa: BLE001 - any import problem just disables the mirror
        log.warning("logging.wandb=true but wandb cannot be imported (%s): not mirroring", e)
        return None
    return wandb


class WandbMirror:
    """``mirror.log_record(record)`` after each point; ``close()`` at the end of the sweep."""

    def __init__(self, logging_cfg: Any, sweep_id: str, backend: Any = None,
                 directory: str | None = None, results_dir: str | None = None):
        self.cfg = logging_cfg
        self.sweep_id = sweep_id
        self.directory = directory or os.environ.get("WANDB_DIR") or (
            str(paths.wandb_dir(results_dir)) if results_dir else None)
        self.enabled = bool(logging_cfg.wandb) and logging_cfg.wandb_mode != "disabled"
        self.backend = None
        self.runs: list[str] = []  # run directories written (offline) or run ids
        self.reused: list[str] = []  # reused points mirrored from their records
        self.reused_live: list[tuple[str, str]] = []  # (point, run id) logged when they ran
        if self.enabled:
            self.backend = backend if backend is not None else _load_wandb()
            self.enabled = self.backend is not None

    def log_record(self, record: Any) -> None:
        if not self.enabled or record.metrics.get("wandb_run"):
            return  # a training point's run was logged live by its rank 0
        try:
            self._log(record)
        except Exception as e:  # noqa: BLE001 - W&B must never break a sweep
            log.warning("W&B mirror failed for point %s (%s); disabling it", record.point, e)
            self.enabled = False

    def log_reused(self, record: Any) -> None:
        """A point this sweep reuses instead of running: its record mirrored as a run tagged
        ``reused`` (config names the sweep that measured it), unless it was logged live when it
        ran (that run is named instead: ``report``)."""
        if not self.enabled:
            return
        if record.metrics.get("wandb_run"):
            self.reused_live.append((record.point, str(record.metrics["wandb_run"])))
            return
        try:
            self._log(record, reused=True)
            self.reused.append(record.point)
        except Exception as e:  # noqa: BLE001 - W&B must never break a sweep
            log.warning("W&B mirror failed for reused point %s (%s); disabling it",
                        record.point, e)
            self.enabled = False

    def report(self, logged_live: int = 0) -> list[str]:
        """What the mirror did for the points the sweep reused, and where the offline runs are
        (``logged_live``: points of this sweep whose rank 0 logged its own run)."""
        out = []
        where = os.path.join(self.directory or ".", "wandb")
        if self.reused:
            out.append(f"W&B: {len(self.reused)} reused point(s) mirrored from their records "
                       f"(tagged 'reused'; experiment.force=true re-measures instead)"
                       + (f" into {where}" if self.cfg.wandb_mode == "offline" else ""))
        if self.reused_live:
            ids = ", ".join(f"{p} = run {i}" for p, i in self.reused_live)
            out.append(f"W&B: {len(self.reused_live)} reused point(s) were logged live when "
                       f"they ran ({ids}): not logged again")
        if self.cfg.wandb_mode == "offline" and (self.runs or self.reused or logged_live
                                                 or self.reused_live):
            out.append(f"W&B offline runs: {where}/offline-run-*  (upload them all: wandb sync "
                       f"{where})")
        return out

    def _log(self, record: Any, reused: bool = False) -> None:
        config = {"point": record.point, "key": record.key, "mode": record.mode,
                  "status": record.status, "params": record.params, "git_sha": record.git_sha,
                  **record.config}
        if reused:
            config.update(reused=True, measured_in_sweep=record.sweep_id,
                          recorded_at=record.timestamp)
        kwargs = dict(project=self.cfg.wandb_project, entity=self.cfg.wandb_entity or None,
                      group=record.experiment, job_type=self.sweep_id, name=record.point,
                      config=config, mode=self.cfg.wandb_mode)
        if reused:
            kwargs["tags"] = ["reused"]
        if self.directory:
            os.makedirs(self.directory, exist_ok=True)
            kwargs["dir"] = self.directory
        run = self.backend.init(**kwargs)
        try:
            for step, row in step_rows(record.metrics):
                run.log(row, step=step)
            summary = {k: v for k, v in flatten(record.metrics).items()
                       if isinstance(v, (int, float, str, bool)) and k not in STEP_SERIES}
            summary.update({k: v for k, v in flatten(record.memory, "memory").items()
                            if isinstance(v, (int, float))})
            summary.update({k: v for k, v in flatten(record.comm, "comm").items()
                            if isinstance(v, (int, float))})
            summary["status"] = record.status
            if record.reason:
                summary["reason"] = record.reason
            for k, v in summary.items():
                run.summary[k] = v
            self.runs.append(getattr(run, "dir", "") or getattr(run, "id", ""))
        finally:
            run.finish(exit_code=0 if record.status == "ok" else 1)

    def close(self) -> None:
        self.enabled = False
