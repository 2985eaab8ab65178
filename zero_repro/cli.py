"""Command line: ``python run.py +exp=NAME [overrides]`` (Hydra) -> validate -> plan -> run.

The user-facing shell of the reproduction suite (every paper figure/table, §10, is one
``conf/exp/NAME.yaml`` + ``experiments/NAME.py``). Flow: Hydra composes ``conf/config.yaml``
(schema in ``zero_repro.config``) -> ``config.to_config`` -> ``config.validate`` -> the
experiment's points are planned and each point's config validated -> only then does anything
run. ``experiment.action`` selects what happens:

* ``run`` (default): run the points not yet in ``results/NAME/points.jsonl``
  (``zero_repro.harness.sweep.run_sweep``; ``experiment.force=true`` re-runs them), mirror records
  to W&B when ``logging.wandb=true``, regenerate ``table.csv`` and ``NAME.png/.pdf``, print a
  summary. Exit status 1 if a point failed (OOM is a result, not a failure).
* ``plot``: regenerate table and figures from ``results/`` alone (no run).
* ``plan``: print the points (key, nodes, overrides, done or not) and write one point file per
  measured point still to do into the Hydra run directory, for ``sbatch slurm/<template> FILE``
  (the printed hint names the template and, on CPU clusters, the overrides).

User errors (an invalid setting, an unknown experiment or config group option) print one line
``error: <message>`` (Hydra's own message for composition errors) and exit with status 2,
before any worker process starts.
"""
from __future__ import annotations

import logging
import os
import re
import sys

from zero_repro import paths

import hydra
import pandas as pd
from hydra.core.hydra_config import HydraConfig
from omegaconf.errors import OmegaConfBaseException

from zero_repro import config
from zero_repro.harness import regenerate, registry, slurm, sweep
from zero_repro.harness.records import RecordStore
from zero_repro.harness.wandb_log import WandbMirror

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
        options = sorted(p[:-5] for p in os.listdir(os.path.join(conf, group))
                         if p.endswith(".yaml"))
        for v in values:
            if v not in options and v != f"base_{group}":
                fail(f"unknown {group} {v!r}: choose one of {options} (files in conf/{group}/)")


def main() -> None:
    check_group_choices(sys.argv[1:], conf_dir())
    config.register_configs()
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


def prepare(dcfg):
    """DictConfig -> (validated Config, experiment, planned points); UserError if invalid."""
    try:
        cfg = config.validate(config.to_config(dcfg))
        experiment = registry.get(cfg.experiment.name)
        planned = sweep.plan(cfg, experiment) if cfg.experiment.action != "plot" else []
    except (ValueError, OmegaConfBaseException) as e:
        raise UserError(str(e).strip().splitlines()[0]) from None
    return cfg, experiment, planned


def dispatch(dcfg) -> None:
    try:
        cfg, experiment, planned = prepare(dcfg)
    except UserError as e:
        fail(str(e))
        return
    logging.getLogger().setLevel(cfg.logging.level.upper())
    action = cfg.experiment.action
    if action == "plan":
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
    not_done = [r for r in result.records if not r.done]  # failed, cancelled, timeout, ...
    print(f"experiment {name}: {len(result.planned)} points, {len(result.skipped)} already done"
          f", ran {len(result.records)} (ok {result.count('ok')}, oom {result.count('oom')}, "
          f"failed {len(not_done)}); sweep {sweep_id}")
    for rec in result.records:
        why = f" - {rec.reason.splitlines()[0]}" if rec.reason else ""
        print(f"  {rec.point:<28} {rec.mode:<9} {rec.status:<6} {rec.duration_s:8.1f}s{why}")
    print_outputs(out)
    if not_done:
        sys.exit(1)


def _regenerate(cfg, experiment) -> dict:
    return regenerate.regenerate(cfg.experiment.name, cfg.experiment.results_dir, experiment)


def print_outputs(out: dict) -> None:
    table = pd.read_csv(out["table"]) if out["rows"] else None
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
    done = RecordStore.for_experiment(cfg.experiment.results_dir, cfg.experiment.name).done_keys()
    print(f"experiment {cfg.experiment.name}: {len(planned)} points "
          f"(launcher={cfg.launcher.name}, cluster={cfg.cluster.name})")
    for pp in planned:
        state = "done" if pp.key in done and not cfg.experiment.force else "todo"
        ov = " ".join(f"{k}={v}" for k, v in pp.point.overrides.items())
        print(f"  {pp.key}  {state}  {pp.point.mode:<9} nodes={pp.nodes:<3} "
              f"world={pp.cfg.parallel.world_size:<4} tp={pp.cfg.parallel.tp:<3} "
              f"{pp.point.name}  {ov}")
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
