"""What the command line prints: the experiments (``print_experiments``), a plan
(``print_plan``: a line per point, the time estimate, the point files), the records of a run
(``record_line``), the outputs and the result lines (``conclusion``: the experiment's own
``conclude(table)``, else ``default_conclusion``).
"""
from __future__ import annotations

import logging
import os

from zero_repro import paths

import pandas as pd

from zero_repro.lab import rank_log, registry, slurm, sweep
from zero_repro.lab import records as R
from zero_repro.lab.figures import regenerate

log = logging.getLogger(__name__)


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
    print(f"\nactions: experiment.action=run (default) | plot | plan | list;  results go to "
          f"{paths.results_path(paths.LOCAL_RESULTS)}/NAME/ (experiment.results_dir=DIR; "
          f"experiment.publish=true: the committed results/)")
    print("more: README.md;  every key with its default: python run.py --cfg job;  "
          "Hydra's own flags: --hydra-help")


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
    if m.get("table1_model_state_bytes") and rec.mode == "measured":
        t1 = {"bytes": m["table1_model_state_bytes"], "formula": m.get("table1_formula", "")}
        parts.append(rank_log.memory_text(rank_log.memory_parts(rec.memory), t1))
    elif ledger and rec.mode == "measured":
        parts.append(f"ledger {sum(ledger) / 2**20:.1f} MiB/rank")
    why = R.heavy_load(rec.load) if rec.mode == "measured" else ""
    if why:
        parts.append(f"- loaded machine: {why}")
    if rec.reason:
        parts.append("- " + rec.reason.splitlines()[0])
    return "  ".join(parts)


def print_outputs(out: dict, experiment=None) -> None:
    """Where the table and figures are, then what they show (``print_result``)."""
    print(f"table:   {out['table']} ({out['rows']} rows from {out['records']} records)")
    for p in out["figures"]:
        print(f"figure:  {p}")
    print_result(out, experiment)


def print_result(out: dict, experiment=None) -> None:
    """The ``result:`` lines of a regenerated table (``conclusion``); none for an empty one."""
    table = pd.read_csv(out["table"]) if out["rows"] else None
    lines = conclusion(experiment, table) if table is not None else []
    if lines:
        print("result:")
        for line in lines:
            print(f"  {line}")


def conclusion(experiment, table: pd.DataFrame) -> list[str]:
    """The lines that state an experiment's result: its ``conclude(table)`` if it has one,
    else ``default_conclusion``; a hook that fails costs its lines, never the run."""
    hook = getattr(experiment, "conclude", None)
    if not callable(hook):
        return default_conclusion(table)
    try:
        return [str(line) for line in hook(table) or []]
    except Exception as e:  # noqa: BLE001 - the table and figure are written already
        log.warning("conclude() of the experiment failed (%s: %s): the table says it",
                    type(e).__name__, e)
        return default_conclusion(table)


def default_conclusion(table: pd.DataFrame, most: int = 6) -> list[str]:
    """For an experiment without ``conclude``: its first ``most`` series (per y quantity) with
    their y range, how many more there are, and the error against the paper where the table
    has one."""
    out: list[str] = []
    ours = table[table["kind"] != "paper"]
    groups = list(ours.groupby(["kind", "series", "y_name"], sort=False))
    for (kind, series, y_name), r in groups[:most]:
        y = pd.to_numeric(r["y_value"], errors="coerce").dropna()
        if y.empty:
            continue
        unit = str(r["unit"].iloc[0]) if "unit" in r else ""
        rng = f"{y.iloc[0]:.4g}" if len(y) == 1 else f"{y.min():.4g} .. {y.max():.4g}"
        out.append(f"{kind} {short_series(series)}: {y_name} {rng} {unit} ({len(y)} point"
                   f"{'s' * (len(y) > 1)})")
    if len(groups) > most:
        out.append(f"... {len(groups) - most} more series in the table")
    if "rel_error_vs_paper" in ours.columns:
        err = pd.to_numeric(ours["rel_error_vs_paper"], errors="coerce").abs().dropna()
        if not err.empty:
            out.append(f"against the paper: median |error| {100 * err.median():.1f}%, largest "
                       f"{100 * err.max():.1f}% ({len(err)} values)")
    return out


def short_series(series: str, most: int = 90) -> str:
    """A series name for a result line: the hardware after `` · this machine: `` /
    `` · reference: `` (``lab.figures.regenerate``) dropped to its source, cut at ``most``."""
    name, _, src = str(series).partition(" · ")
    name = f"{name} ({src.split(':')[0]})" if src else name
    return name if len(name) <= most else name[:most - 3] + "..."


def print_plan(cfg, experiment, plan, output_dir: str | None = None) -> None:
    planned, done = plan.points, plan.done
    print(f"experiment {cfg.experiment.name}: {len(planned)} points "
          f"(launcher={cfg.launcher.name}, cluster={cfg.cluster.name})")
    verbose = cfg.experiment.verbose
    for pp in planned:
        state = "done" if pp.key in done and not cfg.experiment.force else "todo"
        ov = " ".join(f"{k}={v}" for k, v in pp.point.overrides.items()) if verbose else ""
        print(f"  {pp.key}  {state}  {pp.point.mode:<9} nodes={pp.nodes:<3} "
              f"world={pp.cfg.parallel.world_size:<4} tp={pp.cfg.parallel.tp:<3} "
              f"{pp.point.name}  {ov}".rstrip())
    if any(pp.key in done for pp in planned) and not cfg.experiment.force:
        print(f"done: recorded here at this code, reused ({sweep.FORCE} re-runs them)")
    if not verbose and any(pp.point.overrides for pp in planned):
        print("each point's config overrides: experiment.verbose=true")
    note = getattr(experiment, "plan_note", None)  # optional: e.g. a time estimate
    for line in note(cfg, [pp.point for pp in planned]) if callable(note) else []:
        print(line)
    if output_dir is not None:  # the job's folder
        out_dir = os.path.join(output_dir, "points")
    else:  # called from Python
        out_dir = os.path.join(cfg.experiment.results_dir, cfg.experiment.name, "runs", "plan")
    skip = done
    try:
        paths = sweep.write_point_files(planned, experiment, "plan", out_dir, done=skip)
    except TypeError:  # a registered (non-module) experiment cannot run from a point file
        return
    by_key = {pp.key: pp for pp in planned}
    commands: dict[str, list[str]] = {}  # sbatch line -> its point files
    for path in paths:
        pp = by_key[os.path.basename(path)[:-len(".yaml")]]
        commands.setdefault(slurm.sbatch_command(pp.cfg, pp.nodes), []).append(path)
    for command, files in commands.items():
        if verbose or len(files) <= MAX_POINT_FILE_LINES:
            for path in files:
                print(f"point file: {command.replace('FILE', path)}")
        else:  # one line for many files of one shape (each file: experiment.verbose=true)
            where = os.path.join(os.path.dirname(files[0]), "<key>.yaml")
            print(f"point files: {len(files)} (the keys above), each: "
                  f"{command.replace('FILE', where)}")


MAX_POINT_FILE_LINES = 3  # a plan prints one sbatch line per point file up to this many
