"""Command line: ``python run.py +exp=NAME [overrides]`` (Hydra) -> validate -> plan -> run.

Every paper figure or table (§10) is ``conf/exp/NAME.yaml`` + ``experiments/NAME.py``. Each job
of the command line (one, or every job of a ``-m`` multirun) is composed once from
``conf/config.yaml`` (schema: ``zero_repro.config``) through Hydra's compose API
(``zero_repro.lab.jobs``) -> ``schema.to_config`` -> ``validation.validate`` -> the points are
planned and each point's config validated -> only then does anything run, and ``jobs.run`` runs
that very job object in its Hydra folder (no second composition). Information flags
(``--cfg``, ``--info``) and Hydra's launcher / sweeper plugins (``hydra/launcher=submitit_slurm``)
go through ``@hydra.main``: the plugin composes each job where it runs it.
``experiment.action``: ``run`` (default; the points not yet recorded, through
``zero_repro.lab.sweep.run_sweep``, ``experiment.force=true`` re-runs; W&B mirror; table and
figure regenerated, then a few lines stating the result: the experiment's optional
``conclude(table) -> list[str]``, else ``default_conclusion``; exit 1 if a point that ran ended
other than ``ok``), ``plot`` (from ``results/`` alone, with the same lines), ``list`` (also
``--help``), ``plan`` (print the points, one short line each, their overrides with
``experiment.verbose=true``, and write a point file per measured point to do, for
``sbatch slurm/<template> FILE``). Without an experiment (``python run.py`` alone) it lists the
experiments and exits 2.

Contract: a user error prints one ``error: <message>`` line naming the setting and exits 2 before
any rank starts (``check_args``: every job of the command line composed, validated and planned;
for ``action=run`` every point that starts ranks here pre-flighted, ``zero_repro.lab.preflight``,
and the output directories checked writable); that plan is the one the job runs (composed and
planned once, handed on). Results go to ``experiment.results_dir`` (default
``results/local/`` of the repository, ``zero_repro.paths.results_path``; Hydra's folders too sit
under ``paths.home()``: nothing is written into the working directory); a recorded point is reused only at this code and, if measured, on this
machine (``zero_repro.lab.provenance``); ``experiment.publish=true`` writes the reference set
``results/``. Started as one of several ranks (torchrun, srun) it refuses (exit 2) instead of
nesting launches. SIGTERM unwinds like Ctrl-C: the running point is recorded ``cancelled``, one
line is printed, exit 128 + the signal number (130 SIGINT, 143 SIGTERM); ranks die with this
process (``zero_repro.runtime.comm.launch``).
"""
from __future__ import annotations

import logging
import signal
import sys


import hydra
from hydra.core.hydra_config import HydraConfig

from zero_repro import schema
from zero_repro.runtime.comm import launch
from zero_repro.lab import jobs, sweep
from zero_repro.lab.figures import regenerate
from zero_repro.lab.wandb_runs import WandbMirror

from zero_repro.lab.cli_checks import (  # noqa: F401 (the command's checks, named here too)
    _INFO_FLAGS, _PLAIN_FLAGS, MAX_VALIDATED_JOBS, USAGE_ERROR, UserError, _jobs, _overrides,
    check_args, compose_and_check, is_multirun, job_overrides, runs_here,
    check_command_line, check_conf_dir, check_group_choices, check_keys, check_params,
    conf_dir, experiment_params, fail, launcher_rank, names_an_experiment, prepare,
    refuse_nested_launch, refuse_no_experiment)
from zero_repro.lab.cli_output import (  # noqa: F401 (what the command prints, named here too)
    MAX_POINT_FILE_LINES, _regenerate, conclusion, default_conclusion, print_experiments,
    print_outputs, print_plan, print_result, record_line, short_series)

log = logging.getLogger(__name__)

schema.register_resolvers()  # ${zr_home:} in conf/config.yaml, in any process of a job

_signalled: list[int] = []


def _on_signal(signum, frame) -> None:
    """SIGINT / SIGTERM: the first one unwinds (KeyboardInterrupt / ``launch.Terminated``);
    later ones are ignored while the run stops and writes its record."""
    if _signalled:
        return
    _signalled.append(signum)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise launch.Terminated(signum)


def interrupted_line(e: BaseException, signum: int) -> str:
    """The one line an interrupt ends with: where the running point's record is."""
    head = f"interrupted ({signal.Signals(signum).name}): "
    point, where = getattr(e, "interrupted_point", None), getattr(e, "recorded_in", None)
    if point is None:
        return head + "no point was running; every finished point is recorded"
    if where == "stdout":
        return (head + f"point {point!r} could not be recorded: its record is the JSON line "
                f"printed above; run the same command again to continue")
    return (head + f"point {point!r} is recorded as cancelled in {where}; run the same "
            f"command again to continue")


def main() -> None:
    argv = sys.argv[1:]
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    check_conf_dir()
    if any(a in ("--help", "-h") for a in argv) or "experiment.action=list" in argv:
        print_experiments(conf_dir())
        return
    refuse_nested_launch()
    refuse_no_experiment(argv)
    # -m anywhere (Hydra documents `python run.py -m key=a,b`; its parser takes the flag only
    # before the overrides)
    argv = [a for a in argv if a in _PLAIN_FLAGS] + [a for a in argv if a not in _PLAIN_FLAGS]
    sys.argv[1:] = argv
    try:
        check_group_choices(argv, conf_dir())
        schema.register_configs()
        info = any(a in _INFO_FLAGS or a.startswith("--cfg=") for a in argv)
        checked = [] if info else _check(argv)  # every job composed once, checked, planned
        if info or not runs_here(argv):
            # Hydra prints what was asked (--cfg, --info) and runs no job, or its launcher /
            # sweeper plugin composes the jobs where it runs them
            _run_hydra()
            return
        overrides = job_overrides(argv)
        multirun = is_multirun(argv, overrides)
        jobs.run(_all_jobs(argv, overrides, checked, multirun), _run_job, multirun)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM through launch.Terminated
        signum = getattr(e, "signum", signal.SIGINT)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)  # the line below is the last word
        print(interrupted_line(e, signum), file=sys.stderr)
        sys.exit(128 + int(signum))


def _check(argv: list[str]) -> list:
    """``check_args`` (the jobs composed once, checked and planned); a UserError is the one
    ``error:`` line and exit 2."""
    try:
        return check_args(argv, keep=True)
    except UserError as e:
        fail(str(e))
        return []


def _all_jobs(argv: list[str], overrides: list[list[str]], checked: list, multirun: bool):
    """The checked jobs, then (a multirun past ``MAX_VALIDATED_JOBS``) the rest of
    ``overrides``, each composed and checked as it comes."""
    yield from checked
    rest = overrides[len(checked):]
    sweep = jobs.sweep_dir(checked[0]) if checked else None
    for num, job in enumerate(rest, start=len(checked)):
        try:
            with jobs.composing(conf_dir()):
                composed = compose_and_check(argv, job, num, multirun, sweep)
        except UserError as e:
            fail(str(e))
        yield composed


def _run_job(job) -> None:
    """Run one composed and checked job (``jobs.run`` calls this in its output folder)."""
    dispatch(job.prepared, job.output_dir)


def _run_hydra() -> None:
    """Hand the command line to ``@hydra.main`` (information flags, Hydra's launcher and
    sweeper plugins): each job is checked and planned in ``_hydra_task``."""
    started = {"task": False}

    @hydra.main(config_path=conf_dir(), config_name="config", version_base="1.3")
    def _task(dcfg) -> None:
        started["task"] = True
        _hydra_task(dcfg)

    try:
        _task()
    except SystemExit as e:
        # Hydra reports composition errors (unknown +exp=NAME, unknown group option, a value of
        # the wrong type) with one message and exit status 1 before our task starts: they are
        # usage errors
        if e.code == 1 and not started["task"]:
            sys.exit(USAGE_ERROR)
        raise


def _hydra_task(dcfg) -> None:
    """A job Hydra composed (a launcher plugin's, on the machine that runs it): checked,
    planned and dispatched."""
    try:
        check_keys(dcfg)
        prepared = prepare(dcfg)
    except UserError as e:
        fail(str(e))
        return
    dispatch(prepared, HydraConfig.get().runtime.output_dir)


def dispatch(prepared: tuple, output_dir: str | None = None) -> None:
    """Do what ``experiment.action`` says with a checked, planned job ``(cfg, experiment,
    plan)``; ``output_dir`` is the job's folder (a plan's point files go there)."""
    cfg, experiment, plan = prepared
    logging.getLogger().setLevel(cfg.logging.level.upper())
    action = cfg.experiment.action
    if action == "list":
        print_experiments(conf_dir())
    elif action == "plan":
        print_plan(cfg, experiment, plan, output_dir)
    elif action == "plot":
        print_outputs(_regenerate(cfg, experiment), experiment)
    else:
        run(cfg, experiment, plan)


def run(cfg, experiment, plan=None) -> None:
    name = cfg.experiment.name
    sweep_id = sweep.new_sweep_id(name)
    mirror = WandbMirror(cfg.logging, sweep_id, results_dir=cfg.experiment.results_dir)
    try:
        result = sweep.run_sweep(cfg, experiment, plan=plan, mirror=mirror, sweep_id=sweep_id)
    finally:
        mirror.close()
    try:
        out = _regenerate(cfg, experiment)
    except OSError as e:  # a results directory that can no longer be written
        out = None
        print(f"error: the table and figure of {name} could not be written "
              f"({e.filename}: {e.strerror}); regenerate them later with "
              f"python -m experiments.plot {name} --results-dir {cfg.experiment.results_dir}",
              file=sys.stderr)
    counts = ", ".join(f"{st} {result.count(st)}" for st in
                       dict.fromkeys(["ok", "oom", "failed"] + [r.status for r in result.records]))
    busy = f", {len(result.busy)} running elsewhere (skipped)" if result.busy else ""
    reused = (f" (reused, not run again: {sweep.FORCE} re-runs them)" if result.skipped
              else "")
    print(f"experiment {name}: {len(result.planned)} points, {len(result.skipped)} already done "
          f"here{reused}{busy}, ran {len(result.records)} ({counts}); sweep {sweep_id}")
    for rec in result.records:
        print("  " + record_line(rec))
    for line in mirror.report(sum(bool(r.metrics.get("wandb_run")) for r in result.records)):
        print(line)
    if out is not None:
        print_outputs(out, experiment)
    if not regenerate.is_reference(cfg.experiment.results_dir):
        print("(your own results, git-ignored; the figure shows them beside the committed "
              "reference set's measured points; experiment.publish=true writes into results/)")
    for rec, where in result.unsaved:
        print(f"error: point {rec.point!r} is not in points.jsonl: its record is "
              f"{'the JSON line printed above' if where == 'stdout' else 'in ' + where}",
              file=sys.stderr)
    if any(r.status != "ok" for r in result.records) or result.unsaved or out is None:
        sys.exit(1)
