"""Weights & Biases runs for the sweep's points (optional; the records in results/ are the truth).

With ``logging.wandb=true`` every point becomes one W&B run: ``group`` = experiment name,
``job_type`` = sweep id, ``name`` = point name. A training point is logged LIVE by its rank 0
while it trains (``zero_repro.train.wandb_live``: one ``log`` per step with every series, config,
final summary); the sweep only names it, through W&B's environment variables
(``point_environment``), and its record then carries ``metrics.wandb_run``. Every other record
(simulated/analytic points, points that failed before training) is mirrored here once it is
recorded: ``config`` = the point's resolved config plus its params, key, mode and status;
per-step series in the metrics (``losses``, ``step_times_s``, ``grad_norms``, ``loss_scales``),
if any, as one ``log`` per step holding all of them; scalar metrics, the memory ledger
(``memory/<category>`` in bytes) and the communication ledger (``comm/...``, flattened) in the
run summary. The mode comes from ``logging.wandb_mode`` (``offline`` by
default: nothing leaves the machine; upload later with ``wandb sync wandb/offline-run-*``).

A no-op when ``logging.wandb`` is false, the mode is ``disabled``, or wandb cannot be imported:
the sweep never fails because of W&B (errors are logged and the mirror switches itself off).
The ``backend`` argument is a seam for tests (any object with wandb's ``init`` API).
"""
from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

from zero_repro.train.wandb_live import flatten

log = logging.getLogger(__name__)

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
                 directory: str | None = None):
        self.cfg = logging_cfg
        self.sweep_id = sweep_id
        self.directory = directory or os.environ.get("WANDB_DIR") or None
        self.enabled = bool(logging_cfg.wandb) and logging_cfg.wandb_mode != "disabled"
        self.backend = None
        self.runs: list[str] = []  # run directories written (offline) or run ids
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

    def _log(self, record: Any) -> None:
        config = {"point": record.point, "key": record.key, "mode": record.mode,
                  "status": record.status, "params": record.params, "git_sha": record.git_sha,
                  **record.config}
        kwargs = dict(project=self.cfg.wandb_project, entity=self.cfg.wandb_entity or None,
                      group=record.experiment, job_type=self.sweep_id, name=record.point,
                      config=config, mode=self.cfg.wandb_mode)
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
