"""The jobs of one command line, composed once and run here (``cli``'s contract).

``compose_job`` turns a job's overrides into its config, Hydra's node included, through Hydra's
public compose API; ``cli_checks.check_args`` checks and plans it; ``run`` runs the same
object: the steps of Hydra's ``run_job`` (hydra/core/utils.py, Hydra 1.3) done on the config
already composed instead of composing it again:

- the output folder: ``hydra.run.dir``; in a multirun (``-m``) ``hydra.sweep.dir`` (resolved
  once, for every job, as Hydra's basic sweeper does) / ``hydra.sweep.subdir`` with
  ``hydra.job.num`` = the job's index; ``hydra.runtime.output_dir`` set to it;
- ``HydraConfig`` set to the job's config while it runs (``${hydra:...}`` resolves);
- logging from ``hydra.job_logging`` and ``hydra.verbose`` (Hydra's ``configure_log``), the
  log file ``<output>/<hydra.job.name>.log``;
- ``<output>/<hydra.output_subdir>/{config,hydra,overrides}.yaml`` and, for a multirun,
  ``<sweep dir>/multirun.yaml``; ``hydra.job.chdir`` and ``hydra.job.env_set`` honoured.

Jobs run one after another, as Hydra's basic launcher runs them. A job that fails (an
exception, or a non-zero exit other than a usage error) does not stop the jobs after it; the
command then ends with the first failure (its exception, or its exit status). Ctrl-C, SIGTERM
and a usage error stop at once. Hydra's own launcher and sweeper plugins
(``hydra/launcher=...``, ``hydra/sweeper=...``) compose their jobs where they run them: those
command lines go through ``@hydra.main`` (``cli``).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import os
import sys

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import configure_log, env_override
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

log = logging.getLogger(__name__)

JOB_NAME = "cli"  # hydra.job.name: the log file's name (what @hydra.main in cli.py called it)


@dataclasses.dataclass
class Job:
    """One job of a command line: its overrides, its index, the config composed once (with
    Hydra's node, the output folder resolved into ``hydra.runtime.output_dir``) and what
    ``check_args`` made of it (``(cfg, experiment, plan)``, or None until checked)."""
    overrides: list[str]
    num: int
    config: DictConfig
    prepared: tuple | None = None

    @property
    def output_dir(self) -> str:
        return str(self.config.hydra.runtime.output_dir)

    def task_config(self) -> DictConfig:
        """The config without Hydra's node (what a ``@hydra.main`` task receives)."""
        cfg = copy.deepcopy(self.config)
        with read_write(cfg), open_dict(cfg):
            del cfg["hydra"]
        return cfg


@contextlib.contextmanager
def composing(conf_dir: str):
    """Hydra's compose API initialised on ``conf_dir`` (the global state cleared after)."""
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=conf_dir, version_base="1.3", job_name=JOB_NAME):
            yield
    finally:
        GlobalHydra.instance().clear()


def compose_job(overrides: list[str], num: int, multirun: bool,
                sweep_dir: str | None = None) -> Job:
    """Compose one job (inside ``composing``) and fix its output folder: ``hydra.run.dir``, or
    ``sweep_dir`` (the first job's ``hydra.sweep.dir`` when None) / ``hydra.sweep.subdir``.
    Every interpolation of the folder (``${now:}``, ``${zr_run_id:}``) is resolved here, once."""
    dcfg = compose("config", overrides=list(overrides), return_hydra_config=True)
    with read_write(dcfg.hydra), open_dict(dcfg.hydra):
        dcfg.hydra.mode = "MULTIRUN" if multirun else "RUN"
        if multirun:
            dcfg.hydra.job.id = num
            dcfg.hydra.job.num = num
            sweep = sweep_dir if sweep_dir is not None else str(dcfg.hydra.sweep.dir)
            dcfg.hydra.sweep.dir = sweep
            out = os.path.join(sweep, str(dcfg.hydra.sweep.subdir))
        else:
            out = str(dcfg.hydra.run.dir)
            dcfg.hydra.run.dir = out
        dcfg.hydra.runtime.output_dir = os.path.abspath(out)
    return Job(list(overrides), num, dcfg)


def sweep_dir(job: Job) -> str:
    """The multirun folder every job of a ``-m`` command line sits in."""
    return str(job.config.hydra.sweep.dir)


def run(jobs, task, multirun: bool) -> None:
    """Run ``task(job)`` for every job of ``jobs`` (an iterable: the jobs past the ones checked
    up front are composed and checked as they come), Hydra's steps around each (module
    docstring); then end with the first failure, if any."""
    failures: list[BaseException] = []
    jobs = iter(jobs)
    first = next(jobs, None)
    if first is None:
        return
    if multirun:
        configure_log(first.config.hydra.hydra_logging, first.config.hydra.verbose)
        os.makedirs(sweep_dir(first), exist_ok=True)
        OmegaConf.save(first.config, os.path.join(sweep_dir(first), "multirun.yaml"))
        log.info("multirun: jobs in %s", sweep_dir(first))
    for job in _chain(first, jobs):
        if multirun:
            log.info("#%d : %s", job.num, " ".join(job.overrides))
        try:
            _run_one(job, task)
        except SystemExit as e:
            if not multirun or e.code in (0, None, 2):
                raise
            failures.append(e)
        except Exception as e:  # noqa: BLE001 - a failed job does not stop the sweep
            if not multirun:
                raise
            log.error("job #%d (%s) failed: %s", job.num, " ".join(job.overrides), e)
            failures.append(e)
        if multirun:
            configure_log(first.config.hydra.hydra_logging, first.config.hydra.verbose)
    if failures:
        print(f"multirun: {len(failures)} job(s) failed; the first failure ends the command",
              file=sys.stderr)
        raise failures[0]


def _chain(first, rest):
    yield first
    yield from rest


def _run_one(job: Job, task) -> None:
    hcfg = job.config.hydra
    out = job.output_dir
    os.makedirs(out, exist_ok=True)
    previous, old_cwd = HydraConfig.instance().cfg, os.getcwd()
    HydraConfig.instance().set_config(job.config)
    try:
        if hcfg.job.chdir:
            os.chdir(out)
        configure_log(hcfg.job_logging, hcfg.verbose)
        if hcfg.output_subdir is not None:
            sub = os.path.join(out, str(hcfg.output_subdir))
            os.makedirs(sub, exist_ok=True)
            OmegaConf.save(job.task_config(), os.path.join(sub, "config.yaml"))
            OmegaConf.save(OmegaConf.create({"hydra": OmegaConf.to_container(hcfg)}),
                           os.path.join(sub, "hydra.yaml"))
            OmegaConf.save(hcfg.overrides.task, os.path.join(sub, "overrides.yaml"))
        with env_override({str(k): str(v) for k, v in (hcfg.job.env_set or {}).items()}):
            task(job)
    finally:
        for h in logging.getLogger().handlers:
            h.flush()
        HydraConfig.instance().cfg = previous
        os.chdir(old_cwd)
