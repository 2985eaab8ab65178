"""Command line: ``python run.py +exp=NAME [overrides]`` (Hydra) -> validate -> plan -> run.

Every paper figure or table (§10) is ``conf/exp/NAME.yaml`` + ``experiments/NAME.py``. Hydra
composes ``conf/config.yaml`` (schema: ``zero_repro.config``) -> ``schema.to_config`` ->
``validation.validate`` -> the points are planned and each point's config validated -> only then does
anything run. ``experiment.action``: ``run`` (default; the points not yet recorded, through
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
and the output directories checked writable); that plan is the one the job runs (planned
once, handed on). Results go to ``experiment.results_dir`` (default
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
from omegaconf import OmegaConf

from zero_repro import schema
from zero_repro.runtime.comm import launch
from zero_repro.lab import sweep
from zero_repro.lab.figures import regenerate
from zero_repro.lab.wandb_runs import WandbMirror

from zero_repro.lab.cli_checks import (  # noqa: F401 (the command's checks, named here too)
    _INFO_FLAGS, _PLAIN_FLAGS, MAX_VALIDATED_JOBS, USAGE_ERROR, UserError, _jobs, _overrides,
    _task_of, check_args,
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
        # the plans check_args makes, by each job's overrides, handed to the jobs Hydra runs
        # (planned once)
        plans: dict[tuple, tuple] = {}
        if not any(a in _INFO_FLAGS or a.startswith("--cfg=") for a in argv):
            try:
                for job, prepared, composed in check_args(argv, keep=True):
                    plans[_task_of(job)] = (prepared, composed)
            except UserError as e:
                fail(str(e))
        # a Hydra launcher plugin (hydra/launcher=submitit_slurm) pickles the task for other
        # machines: they plan their job there (the plans hold live objects)
        _run_hydra({} if any(a.startswith("hydra/launcher=") for a in argv) else plans)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM through launch.Terminated
        signum = getattr(e, "signum", signal.SIGINT)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)  # the line below is the last word
        print(interrupted_line(e, signum), file=sys.stderr)
        sys.exit(128 + int(signum))


def _run_hydra(plans: dict[tuple, tuple]) -> None:
    started = {"task": False}

    @hydra.main(config_path=conf_dir(), config_name="config", version_base="1.3")
    def _task(dcfg) -> None:
        started["task"] = True
        dispatch(dcfg, plans)

    try:
        _task()
    except SystemExit as e:
        # Hydra reports composition errors (unknown +exp=NAME, unknown group option, a value of
        # the wrong type) with one message and exit status 1 before our task starts: they are
        # usage errors
        if e.code == 1 and not started["task"]:
            sys.exit(USAGE_ERROR)
        raise


def _prepared_for(dcfg, plans: dict[tuple, tuple]):
    """The plan ``check_args`` made for this job (``plans``, by the job's overrides), if it is
    this very config (planned once)."""
    try:
        job = tuple(HydraConfig.get().overrides.task)
    except ValueError:  # not under Hydra
        return None
    prepared, composed = plans.pop(job, (None, None))
    return prepared if composed == OmegaConf.to_container(dcfg) else None


def dispatch(dcfg, plans: dict[tuple, tuple] | None = None) -> None:
    """Run the job ``dcfg`` with its plan from ``plans`` (``main``'s checks), or checked and
    planned here (a job they did not see)."""
    prepared = _prepared_for(dcfg, plans or {})
    if prepared is None:  # a job check_args did not see (more than MAX_VALIDATED_JOBS)
        try:
            check_keys(dcfg)
            prepared = prepare(dcfg)
        except UserError as e:
            fail(str(e))
            return
    cfg, experiment, plan = prepared
    logging.getLogger().setLevel(cfg.logging.level.upper())
    action = cfg.experiment.action
    if action == "list":
        print_experiments(conf_dir())
    elif action == "plan":
        print_plan(cfg, experiment, plan)
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
