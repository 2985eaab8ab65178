"""Live W&B logging of one training run (one sweep point), from rank 0, while it trains.

With ``logging.wandb=true`` rank 0 opens one W&B run when training starts and logs ONE dict per
optimizer step holding every series: ``loss`` (rank 0's loss: its DP shard of the batch; the
record keeps the DP mean), ``grad_norm``, ``loss_scale``, ``step_time_s``, throughput
(``tokens_per_s``, ``tflops_per_gpu``, from that step's wall time) and memory (``memory/...``:
CUDA allocated/reserved and their peaks on GPU, the process's peak RSS on CPU; the worker
measures them). One call per step
matters: W&B drops a ``log`` whose step is lower than the last one, so logging each series in its
own pass from step 0 keeps one point of every series but the first.

The run's config is the point's resolved config; at the end its summary gets the final metrics
and the memory/communication ledgers, and the run is finished (exit code 1 if training raised).
Group, job type and name come from W&B's own environment variables (``WANDB_RUN_GROUP``,
``WANDB_JOB_TYPE``, ``WANDB_NAME``), which the sweep sets for each point and every rank
inherits (srun and the local spawn pass the environment on). The mode is
``logging.wandb_mode`` (offline by default: ``wandb sync`` uploads later).

Never fatal: if wandb is missing or fails, a warning is logged and the logger turns itself off.
"""
from __future__ import annotations

import logging
import os
from typing import Any

from zero_repro import config as C

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
            directory = os.environ.get("WANDB_DIR") or run_dir
            os.makedirs(directory, exist_ok=True)
            run = backend.init(project=lc.wandb_project, entity=lc.wandb_entity or None,
                               config=C.summary(cfg), mode=lc.wandb_mode, dir=directory,
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
