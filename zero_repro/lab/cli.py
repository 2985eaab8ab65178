"""Command line: ``python run.py +exp=NAME [overrides]`` (Hydra) -> validate -> plan -> run.

The user-facing shell of the reproduction suite (every paper figure/table, §10, is one
``conf/exp/NAME.yaml`` + ``experiments/NAME.py``). Flow: Hydra composes ``conf/config.yaml``
(schema in ``zero_repro.config``) -> ``config.to_config`` -> ``config.validate`` -> the
experiment's points are planned and each point's config validated -> only then does anything
run. ``experiment.action`` selects what happens:

* ``run`` (default): run the points not yet in ``results/NAME/points.jsonl``
  (``zero_repro.lab.sweep.run_sweep``; ``experiment.force=true`` re-runs them), mirror records
  to W&B when ``logging.wandb=true``, regenerate ``table.csv`` and ``NAME.png/.pdf``, print a
  summary. Exit status 1 if a point that ran ended other than ``ok`` (``oom`` included: it is
  recorded as a result -- the point does not fit, and it is not run again -- but the command
  did not produce every number it was asked for; diverged, cancelled, timeout and failed are
  run again next time).
* ``plot``: regenerate table and figures from ``results/`` alone (no run).
* ``list`` (also ``python run.py --help``): the experiments, one line each, and the config
  groups with their options.
* ``plan``: print the points (key, nodes, overrides, done or not) and write one point file per
  measured point still to do into the Hydra run directory, for ``sbatch slurm/<template> FILE``
  (the printed hint names the template and, on CPU clusters, the overrides).

User errors print one line ``error: <message>`` naming the setting and exit with status 2,
before any worker process starts: ``check_args`` composes every job of the command line (each
job of a ``-m`` multirun, before the first one runs) with Hydra's compose API, validates it
(``config.validate``), plans the experiment (every point's config validated) and, for
``action=run``, checks every point that would start ranks here against this machine
(``harness.preflight``: files, devices, cores, memory) and that ``experiment.results_dir`` and
the Hydra output directory are writable. Composition errors (unknown group option, a value of
the wrong type, a malformed override) are reported the same way.

Where results go: ``experiment.results_dir`` (default ``results/local/``, git-ignored: this
machine's own records, tables and figures, drawn beside the committed reference set's measured
points). A recorded point is skipped only if it was made at this code and, for measured points,
on this machine (``harness.provenance``). ``experiment.publish=true`` writes into the committed
reference set ``results/`` instead: publishing is an explicit act.

Under a launcher: the CLI starts its own ranks (``launcher=local|torchrun|slurm``), so started
as one of several ranks itself (``torchrun --nproc_per_node N run.py``, ``srun -n N python
run.py``) it refuses with one line and exit status 2 instead of nesting N launches.

Signals: SIGTERM (``kill``, ``timeout``, ``docker stop``) unwinds like Ctrl-C: the ranks of the
running point are stopped, the point is recorded ``cancelled``, one line is printed (no
traceback) and the exit status is 128 + the signal number (130 for SIGINT, 143 for SIGTERM).
Ranks also die on their own if this process is killed outright (``distributed.launch``).
"""
from __future__ import annotations

import difflib
import logging
import os
import re
import signal
import sys

from zero_repro import paths

import hydra
import pandas as pd
from hydra import compose, initialize_config_dir
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from zero_repro import config
from zero_repro.runtime.comm import launch
from zero_repro.lab import preflight, registry, slurm, sweep
from zero_repro.lab.figures import regenerate
from zero_repro.lab.records import RecordStore
from zero_repro.lab.wandb_runs import WandbMirror
from zero_repro.lab.launcher import check_writable

log = logging.getLogger(__name__)

USAGE_ERROR = 2


def conf_dir() -> str:
    """Absolute path of the ``conf/`` directory: ``$ZERO_REPRO_CONF_DIR``, else the one next to
    the package (source checkout), else ``./conf``."""
    return str(paths.conf_dir())


class UserError(Exception):
    """A mistake in the command line or config: reported as one line, exit status 2."""


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(USAGE_ERROR)


def check_group_choices(argv: list[str], conf: str) -> None:
    """One-line error for ``group=option`` / ``+exp=NAME`` naming a YAML that does not exist
    (Hydra's own message for this lists the search path too). Only plain names are checked;
    anything else (sweep syntax, hydra/... groups) is left to Hydra."""
    for arg in argv:
        m = re.fullmatch(r"\+{0,2}([A-Za-z_]\w*)=([\w.,-]+)", arg)
        if not m or not os.path.isdir(os.path.join(conf, m[1])):
            continue
        group, values = m[1], m[2].split(",")
        plus = arg[:len(arg) - len(arg.lstrip("+"))]
        options = sorted(p[:-5] for p in os.listdir(os.path.join(conf, group))
                         if p.endswith(".yaml"))
        for v in values:
            if v not in options and v != f"base_{group}":
                close = difflib.get_close_matches(v, options, n=1)
                hint = f" (did you mean {plus}{group}={close[0]}?)" if close else ""
                fail(f"unknown {group} {v!r}{hint}: choose one of {options} "
                     f"(files in conf/{group}/)")


def launcher_rank() -> str | None:
    """A description of the launcher this process is one rank of, or None. torchrun sets
    RANK/WORLD_SIZE/LOCAL_RANK in every worker; an ``srun`` step of several tasks sets
    SLURM_STEP_NUM_TASKS (a one-task step, e.g. a hydra-submitit job or the batch script,
    is not several ranks)."""
    env = os.environ
    world = env.get("WORLD_SIZE", "")
    if world.isdigit() and int(world) > 1 and ("RANK" in env or "LOCAL_RANK" in env):
        return f"torchrun (RANK={env.get('RANK', '?')}, WORLD_SIZE={world})"
    tasks = env.get("SLURM_STEP_NUM_TASKS", "")
    if "SLURM_STEP_ID" in env and tasks.isdigit() and int(tasks) > 1:
        return f"srun (SLURM_PROCID={env.get('SLURM_PROCID', '?')}, {tasks} tasks)"
    return None


def refuse_nested_launch() -> None:
    """Exit 2 with one line when started as one of several ranks (module docstring). Only
    rank 0 prints, so the line appears once."""
    who = launcher_rank()
    if who is None:
        return
    if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":
        print(f"error: run.py was started as one of several ranks by {who}; it starts its "
              f"own ranks, so each copy would launch a whole run. Run it once from a plain "
              f"shell: `python run.py +exp=NAME parallel.world_size=N` (local ranks), or "
              f"`launcher=torchrun` / `launcher=slurm` to have it call torchrun / srun itself",
              file=sys.stderr)
    sys.exit(USAGE_ERROR)


def print_experiments(conf: str) -> None:
    """``python run.py --help`` / ``experiment.action=list``: experiments and config groups."""
    print("usage: python run.py +exp=NAME [group=option ...] [key=value ...]\n")
    print("experiments (+exp=NAME):")
    for name, line in registry.describe():
        print(f"  {name:<20} {line}")
    print("\nconfig groups (group=option):")
    for group in sorted(os.listdir(conf)):
        folder = os.path.join(conf, group)
        if group == "exp" or not os.path.isdir(folder):
            continue
        options = sorted(p[:-5] for p in os.listdir(folder) if p.endswith(".yaml"))
        print(f"  {group:<9} {' '.join(options)}")
    print("\nactions: experiment.action=run (default) | plot | plan | list;  results go to "
          "results/local/ (experiment.publish=true: the committed results/)")
    print("more: README.md;  every key with its default: python run.py --cfg job;  "
          "Hydra's own flags: --hydra-help")


# flags after which Hydra prints something and runs no job: nothing to validate
_INFO_FLAGS = ("--hydra-help", "--cfg", "-c", "--info", "-i",
               "--shell-completion", "-sc", "--version")
MAX_VALIDATED_JOBS = 1000  # a multirun larger than this is validated job by job as it runs


def main() -> None:
    argv = sys.argv[1:]
    signal.signal(signal.SIGTERM, launch.raise_terminated)
    if any(a in ("--help", "-h") for a in argv) or "experiment.action=list" in argv:
        print_experiments(conf_dir())
        return
    refuse_nested_launch()
    try:
        check_group_choices(argv, conf_dir())
        config.register_configs()
        if not any(a in _INFO_FLAGS or a.startswith("--cfg=") for a in argv):
            try:
                check_args(argv)
            except UserError as e:
                fail(str(e))
        _run_hydra()
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM through launch.Terminated
        signum = getattr(e, "signum", signal.SIGINT)
        print(f"interrupted ({signal.Signals(signum).name}): the running point is recorded as "
              f"cancelled; run the same command again to continue", file=sys.stderr)
        sys.exit(128 + int(signum))


def _run_hydra() -> None:
    started = {"task": False}

    @hydra.main(config_path=conf_dir(), config_name="config", version_base="1.3")
    def _task(dcfg) -> None:
        started["task"] = True
        dispatch(dcfg)

    try:
        _task()
    except SystemExit as e:
        # Hydra reports composition errors (unknown +exp=NAME, unknown group option, a value of
        # the wrong type) with one message and exit status 1 before our task starts: they are
        # usage errors
        if e.code == 1 and not started["task"]:
            sys.exit(USAGE_ERROR)
        raise


def _jobs(argv: list[str]) -> list[list[str]]:
    """The override list of every job the command line runs (one unless ``-m``)."""
    overrides = [a for a in argv if not a.startswith("-")]
    if not any(a in ("-m", "--multirun") for a in argv):
        return [overrides]
    parsed = OverridesParser.create().parse_overrides(overrides)
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def _first_line(e: BaseException) -> str:
    """One line: the message's first line; Hydra's "Error merging override X" / "Could not
    override X" keep the cause that follows them (without OmegaConf's key/type details)."""
    text = str(e).strip() or type(e).__name__
    if e.__cause__ is not None:
        text += "\n" + str(e.__cause__)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    head = lines[0]
    if len(lines) > 1 and (head.startswith("Error merging override")
                           or head.startswith("Could not override")
                           or head.startswith("Error parsing override")):
        head = f"{head}: {lines[1]}"
    # OmegaConf's type errors name the key on a later line ("full_key: model.bias")
    key = getattr(e, "full_key", None) or getattr(e.__cause__, "full_key", None)
    if key and key not in head:
        head = f"{key}: {head}"
    return head


def check_args(argv: list[str]) -> list[tuple]:
    """Everything ``main`` checks before Hydra runs a job (see the module docstring), in this
    process; UserError with one line naming the setting. Returns (cfg, experiment, planned)
    per job."""
    try:
        jobs = _jobs(argv)
    except Exception as e:  # noqa: BLE001 - Hydra's override grammar errors
        raise UserError(_first_line(e)) from None
    multirun = len(jobs) > 1 or any(a in ("-m", "--multirun") for a in argv)
    # a Hydra launcher plugin (hydra/launcher=submitit_slurm) runs the jobs on other machines:
    # they check this machine's share there
    here = not any(a.startswith("hydra/launcher=") for a in argv)
    out = []
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=conf_dir(), version_base="1.3", job_name="check"):
        for job in jobs[:MAX_VALIDATED_JOBS]:
            try:
                dcfg = compose("config", overrides=job, return_hydra_config=True)
                out_dir = OmegaConf.select(dcfg, "hydra.sweep.dir" if multirun
                                           else "hydra.run.dir")
                with open_dict(dcfg):
                    del dcfg["hydra"]
            except Exception as e:  # noqa: BLE001 - every composition error is a usage error
                raise UserError(_first_line(e)) from None
            prefix = f"job {job}: " if multirun else ""
            try:
                check_writable(out_dir, "hydra.sweep.dir" if multirun else "hydra.run.dir")
                out.append(prepare(dcfg, machine=here))
            except (UserError, ValueError) as e:
                raise UserError(prefix + _first_line(e)) from None
    GlobalHydra.instance().clear()
    return out


def prepare(dcfg, machine: bool = True):
    """DictConfig -> (validated Config, experiment, planned points); UserError if invalid.
    For ``action=run`` the points still to run are checked against this machine
    (``machine=False``: configuration only)."""
    try:
        cfg = config.validate(config.to_config(dcfg))
        experiment = registry.get(cfg.experiment.name)
        planned = sweep.plan(cfg, experiment) if cfg.experiment.action != "plot" else []
        check_writable(cfg.experiment.results_dir, "experiment.results_dir")
        if cfg.experiment.action == "run" and machine:
            store = RecordStore.for_experiment(cfg.experiment.results_dir, cfg.experiment.name)
            done = set() if cfg.experiment.force else sweep.reusable_keys(store, planned)
            preflight.check_points([pp for pp in planned if pp.key not in done])
    except (ValueError, OmegaConfBaseException) as e:
        raise UserError(_first_line(e)) from None
    return cfg, experiment, planned


def dispatch(dcfg) -> None:
    try:
        cfg, experiment, planned = prepare(dcfg)
    except UserError as e:
        fail(str(e))
        return
    logging.getLogger().setLevel(cfg.logging.level.upper())
    action = cfg.experiment.action
    if action == "list":
        print_experiments(conf_dir())
    elif action == "plan":
        print_plan(cfg, experiment, planned)
    elif action == "plot":
        print_outputs(_regenerate(cfg, experiment))
    else:
        run(cfg, experiment)


def run(cfg, experiment) -> None:
    name = cfg.experiment.name
    sweep_id = sweep.new_sweep_id(name)
    mirror = WandbMirror(cfg.logging, sweep_id)
    try:
        result = sweep.run_sweep(cfg, experiment, mirror=mirror, sweep_id=sweep_id)
    finally:
        mirror.close()
    out = _regenerate(cfg, experiment)
    counts = ", ".join(f"{st} {result.count(st)}" for st in
                       dict.fromkeys(["ok", "oom", "failed"] + [r.status for r in result.records]))
    busy = f", {len(result.busy)} running elsewhere (skipped)" if result.busy else ""
    print(f"experiment {name}: {len(result.planned)} points, {len(result.skipped)} already done "
          f"here{busy}, ran {len(result.records)} ({counts}); sweep {sweep_id}")
    for rec in result.records:
        print("  " + record_line(rec))
    print_outputs(out, table=False)
    if not regenerate.is_reference(cfg.experiment.results_dir):
        print("(your own results, git-ignored; the figure shows them beside the committed "
              "reference set's measured points; experiment.publish=true writes into results/)")
    if any(r.status != "ok" for r in result.records):
        sys.exit(1)


def _regenerate(cfg, experiment) -> dict:
    return regenerate.regenerate(cfg.experiment.name, cfg.experiment.results_dir, experiment)


def record_line(rec) -> str:
    """One line for a record this run wrote: status, time and its headline numbers."""
    m = rec.metrics or {}
    parts = [f"{rec.point:<30} {rec.mode:<9} {rec.status:<8} {rec.duration_s:7.1f}s"]
    if "tflops_per_gpu" in m:
        parts.append(f"{m['tflops_per_gpu']:.4g} TFLOPs/GPU")
    if "mfu" in m:
        parts.append(f"MFU {100 * m['mfu']:.1f}%")
    if "tokens_per_s" in m:
        parts.append(f"{m['tokens_per_s']:.0f} tok/s")
    if m.get("losses"):
        parts.append(f"loss {m['losses'][0]:.3f} -> {m['losses'][-1]:.3f}")
    ledger = [v for k, v in (rec.memory or {}).items()
              if not k.startswith("cuda_") and isinstance(v, (int, float))]
    if ledger and rec.mode == "measured":
        parts.append(f"ledger {sum(ledger) / 2**20:.1f} MiB/rank")
    if rec.reason:
        parts.append("- " + rec.reason.splitlines()[0])
    return "  ".join(parts)


def print_outputs(out: dict, table: bool = True) -> None:
    table = pd.read_csv(out["table"]) if out["rows"] and table else None
    if table is not None:
        ours = table[table["kind"] != "paper"]
        cols = [c for c in ("series", "x_name", "x_value", "y_name", "y_value", "unit", "kind",
                            "paper_value", "rel_error_vs_paper") if c in ours.columns]
        with pd.option_context("display.width", 160, "display.max_colwidth", 40):
            shown = ours[cols].head(40)
            print(shown.to_string(index=False))
            if len(ours) > len(shown):
                print(f"  ... {len(ours) - len(shown)} more rows")
    print(f"table:   {out['table']} ({out['rows']} rows from {out['records']} records)")
    for p in out["figures"]:
        print(f"figure:  {p}")


def print_plan(cfg, experiment, planned) -> None:
    store = RecordStore.for_experiment(cfg.experiment.results_dir, cfg.experiment.name)
    done = sweep.reusable_keys(store, planned)
    print(f"experiment {cfg.experiment.name}: {len(planned)} points "
          f"(launcher={cfg.launcher.name}, cluster={cfg.cluster.name})")
    for pp in planned:
        state = "done" if pp.key in done and not cfg.experiment.force else "todo"
        ov = " ".join(f"{k}={v}" for k, v in pp.point.overrides.items())
        print(f"  {pp.key}  {state}  {pp.point.mode:<9} nodes={pp.nodes:<3} "
              f"world={pp.cfg.parallel.world_size:<4} tp={pp.cfg.parallel.tp:<3} "
              f"{pp.point.name}  {ov}")
    note = getattr(experiment, "plan_note", None)  # optional: e.g. a time estimate
    for line in note(cfg, [pp.point for pp in planned]) if callable(note) else []:
        print(line)
    try:
        out_dir = os.path.join(HydraConfig.get().runtime.output_dir, "points")
    except ValueError:  # not under Hydra (called from Python)
        out_dir = os.path.join(cfg.experiment.results_dir, cfg.experiment.name, "runs", "plan")
    skip = set() if cfg.experiment.force else done
    try:
        paths = sweep.write_point_files(planned, experiment, "plan", out_dir, done=skip)
    except TypeError:  # a registered (non-module) experiment cannot run from a point file
        return
    by_key = {pp.key: pp for pp in planned}
    for path in paths:
        pp = by_key[os.path.basename(path)[:-len(".yaml")]]
        print(f"point file: {slurm.sbatch_command(pp.cfg, pp.nodes).replace('FILE', path)}")
