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

import dataclasses
import difflib
import itertools
import logging
import os
import re
import signal
import sys
import typing

from zero_repro import paths

import hydra
import pandas as pd
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from zero_repro import config
from zero_repro import schema
from zero_repro.runtime.comm import launch
from zero_repro.lab import rank, registry, slurm, sweep
from zero_repro.lab import records as R
from zero_repro.lab.figures import regenerate
from zero_repro.lab.wandb_runs import WandbMirror
from zero_repro.lab.launcher import check_config, check_writable

log = logging.getLogger(__name__)

USAGE_ERROR = 2
schema.register_resolvers()  # ${zr_home:} in conf/config.yaml, in any process of a job


def conf_dir() -> str:
    """Absolute path of the ``conf/`` directory: ``$ZERO_REPRO_CONF_DIR``, else the one next to
    the package (source checkout), else ``./conf``."""
    return str(paths.conf_dir())


class UserError(Exception):
    """A mistake in the command line or config: reported as one line, exit status 2."""


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(USAGE_ERROR)


def check_conf_dir() -> None:
    """``ZERO_REPRO_CONF_DIR``, when set, must be a ``conf/`` directory."""
    env = os.environ.get("ZERO_REPRO_CONF_DIR")
    if env and not os.path.isfile(os.path.join(env, "config.yaml")):
        what = "does not exist" if not os.path.exists(env) else "holds no config.yaml"
        fail(f"ZERO_REPRO_CONF_DIR={env!r} {what}: point it at the repository's conf/ "
             f"directory, or unset it")


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
    print(f"\nactions: experiment.action=run (default) | plot | plan | list;  results go to "
          f"{paths.results_path(paths.LOCAL_RESULTS)}/NAME/ (experiment.results_dir=DIR; "
          f"experiment.publish=true: the committed results/)")
    print("more: README.md;  every key with its default: python run.py --cfg job;  "
          "Hydra's own flags: --hydra-help")


def names_an_experiment(argv: list[str]) -> bool:
    """Does the command line choose an experiment (``+exp=NAME`` or ``experiment.name=``)?"""
    return any(re.match(r"[+~]{0,2}(exp|experiment\.name)=", a) for a in argv)


def refuse_no_experiment(argv: list[str]) -> None:
    """``python run.py`` without an experiment: the list and how to run one, exit 2 (instead
    of running the schema's default point under the name ``smoke``)."""
    if names_an_experiment(argv) or any(a in _INFO_FLAGS or a.startswith("--cfg=")
                                        for a in argv):
        return
    print_experiments(conf_dir())
    print("\nrun one:  python run.py +exp=smoke    (see it first: python run.py +exp=smoke "
          "experiment.action=plan)")
    print("error: no experiment chosen: add +exp=NAME (one of the experiments above)",
          file=sys.stderr)
    sys.exit(USAGE_ERROR)


# flags after which Hydra prints something and runs no job: nothing to validate
_INFO_FLAGS = ("--hydra-help", "--cfg", "-c", "--info", "-i",
               "--shell-completion", "-sc", "--version")
# flags without a value that Hydra reads anywhere on the command line (its parser wants them
# before the overrides)
_PLAIN_FLAGS = ("-m", "--multirun", "-r", "--run")
MAX_VALIDATED_JOBS = 1000  # a multirun larger than this is validated job by job as it runs
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


def _overrides(argv: list[str]) -> list[str]:
    return [a for a in argv if not a.startswith("-")]


def _jobs(argv: list[str]) -> list[list[str]]:
    """The override list of every job the command line runs (one unless ``-m``)."""
    overrides = _overrides(argv)
    if not any(a in ("-m", "--multirun") for a in argv):
        return [overrides]
    # Hydra's basic sweeper's expansion (hydra/_internal/core_plugins/basic_sweeper.py,
    # split_arguments), through the public override API: per key its values (a discrete sweep
    # gives several), the jobs their product in the order the keys first appear
    per_key: dict[str, list[str]] = {}
    for o in OverridesParser.create().parse_overrides(overrides):
        key = o.get_key_element()
        if not o.is_sweep_override():
            per_key[key] = [f"{key}={o.get_value_element_as_str()}"]
        elif o.is_discrete_sweep():
            per_key[key] = [f"{key}={v}" for v in o.sweep_string_iterator()]
        else:
            raise UserError(f"{key}: Hydra's basic sweeper runs discrete sweeps only (a,b,c or "
                            f"choice(...)), not {o.value_type.name.lower()}")
    return [list(job) for job in itertools.product(*per_key.values())]


def _unreadable(arg: str) -> str:
    """What to do when Hydra's grammar cannot read the override ``arg``."""
    key, _, value = arg.partition("=")
    if "~" in value:
        return (f"{arg}: Hydra cannot read ~ in a value and the shell expands it only at the "
                f"start of a word: write {key}=$HOME{value.split('~', 1)[1]}")
    return (f"{arg}: Hydra cannot read this value unquoted: quote it for Hydra inside the "
            f"shell's quotes, '{key}=\"{value}\"'")


def check_command_line(argv: list[str]) -> None:
    """UserError for what the command line itself gets wrong: an override Hydra cannot read
    (with what to do), a setting given twice (Hydra would take the last silently), a boolean
    given as a number."""
    parser = OverridesParser.create()
    seen: dict[tuple, str] = {}
    for arg in _overrides(argv):
        try:
            o = parser.parse_override(arg)
        except Exception as e:  # noqa: BLE001 - Hydra's grammar errors
            if "LexerNoViableAlt" in str(e) or "token recognition" in str(e):
                raise UserError(_unreadable(arg)) from None
            raise UserError(_first_line(e)) from None
        where = (o.key_or_group, o.package)
        if where in seen:
            raise UserError(f"{o.key_or_group} is given twice ({seen[where]} and {arg}): keep "
                            f"one (Hydra would take the last one without a word)")
        seen[where] = arg
        values = [] if o.is_delete() else (
            list(o.sweep_iterator()) if o.is_sweep_override() else [o.value()])
        if _is_bool_field(o.key_or_group) and any(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            raise UserError(f"{arg}: {o.key_or_group} is a boolean: give true or false")


def _schema_field(dotted: str):
    """(dataclass, field) of a dotted schema key, or None."""
    cls, field = config.Config, None
    for part in dotted.split("."):
        if cls is None or not dataclasses.is_dataclass(cls):
            return None
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if part not in fields:
            return None
        field = fields[part]
        owner = cls
        cls = field.default_factory if dataclasses.is_dataclass(field.default_factory) else None
    return owner, field


def _is_bool_field(dotted: str) -> bool:
    found = _schema_field(dotted)
    if found is None:
        return False
    hint = typing.get_type_hints(found[0]).get(found[1].name)
    return hint is bool or hint == typing.Optional[bool]


def check_keys(node, cls=config.Config, prefix: str = "") -> None:
    """UserError for a key of the composed config that the schema does not have (a typo, one
    added with ``+``), with the nearest schema key."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in node.keys():
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.6)
            hint = f" (did you mean {prefix}{close[0]}?)" if close else \
                f": {prefix.rstrip('.') or 'the config'} has {sorted(fields)}"
            raise UserError(f"{prefix}{key} is not a setting{hint}")
        sub = fields[key].default_factory
        if dataclasses.is_dataclass(sub) and isinstance(node[key], DictConfig):
            check_keys(node[key], sub, f"{prefix}{key}.")


def experiment_params(name: str, experiment) -> set:
    """The ``experiment.params`` keys experiment ``name`` reads: those of its overlay
    ``conf/exp/NAME.yaml``, its ``DEFAULTS`` and its ``PARAMS``."""
    overlay = os.path.join(conf_dir(), "exp", f"{name}.yaml")
    known: set = set()
    if os.path.isfile(overlay):
        doc = OmegaConf.to_container(OmegaConf.load(overlay))
        known |= set(((doc.get("experiment") or {}).get("params") or {}))
    known |= set(getattr(experiment, "DEFAULTS", None) or ())
    known |= set(getattr(experiment, "PARAMS", None) or ())
    return known


def _not_a_param(key: str, name: str, known: set) -> UserError:
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    hint = f"did you mean experiment.params.{close[0]}?" if close else \
        f"it reads {sorted(known) or 'none'}"
    return UserError(f"experiment.params.{key} is not a parameter of experiment {name!r} "
                     f"({hint})")


def check_params(cfg, experiment, job: list[str]) -> None:
    """UserError for an ``experiment.params.KEY`` on the command line that the experiment
    does not read (``experiment_params``)."""
    given = {o.split("=", 1)[0].lstrip("+~").split(".")[2] for o in job
             if o.lstrip("+~").startswith("experiment.params.")}
    known = experiment_params(cfg.experiment.name, experiment) if given else set()
    for key in sorted(given - known):
        raise _not_a_param(key, cfg.experiment.name, known)


def _unknown_key(e: BaseException, job: list[str]) -> UserError | None:
    """Hydra's "Could not override 'KEY'" (with its advice to add it with ``+``) for a key the
    schema, or the experiment's params, does not have: said with the key it resembles."""
    m = re.match(r"Could not override '([\w.]+)'", str(e).strip())
    if not m:
        return None
    key = m[1]
    if key.startswith("experiment.params.") and key.count(".") >= 2:
        name = next((o.split("=", 1)[1] for o in job if o.startswith("+exp=")), None)
        name = next((o.split("=", 1)[1] for o in job if o.startswith("experiment.name=")),
                    name)
        try:
            experiment = registry.get(name) if name else None
        except ValueError:
            experiment = None
        known = experiment_params(name, experiment) if experiment is not None else set()
        if experiment is None or key.split(".")[2] in known:
            return None  # Hydra's own words say it: add it with +
        return _not_a_param(key.split(".")[2], name, known)
    parts = key.split(".")
    try:
        check_keys(OmegaConf.create(_nested(parts)))
    except UserError as err:
        return err
    return None


def _nested(parts: list[str]) -> dict:
    out: dict = {}
    for part in reversed(parts):
        out = {part: out or None}
    return out


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


def check_args(argv: list[str], keep: bool = False) -> list[tuple]:
    """Everything ``main`` checks before Hydra runs a job (see the module docstring), in this
    process; UserError with one line naming the setting. Returns (cfg, experiment, plan) per
    job, or with ``keep`` (job overrides, that, the composed config) for ``dispatch``."""
    check_command_line(argv)
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
                raise _unknown_key(e, job) or UserError(_first_line(e)) from None
            prefix = f"job {job}: " if multirun else ""
            try:
                check_keys(dcfg)
                check_writable(out_dir, "hydra.sweep.dir" if multirun else "hydra.run.dir")
                prepared = prepare(dcfg, machine=here, job=job)
            except (UserError, ValueError) as e:
                raise UserError(prefix + _first_line(e)) from None
            out.append((job, prepared, OmegaConf.to_container(dcfg)) if keep else prepared)
    GlobalHydra.instance().clear()
    return out


def prepare(dcfg, machine: bool = True, job: list[str] | None = None):
    """DictConfig -> (checked Config, experiment, its ``sweep.Plan`` or None for ``plot`` /
    ``list``); UserError if invalid. For ``action=run`` the points still to run are checked
    against this machine (``machine=False``: configuration only)."""
    try:
        cfg = check_config(schema.to_config(dcfg))
        experiment = registry.get(cfg.experiment.name)
        check_params(cfg, experiment, job or [])
        check_writable(cfg.experiment.results_dir, "experiment.results_dir")
        action = cfg.experiment.action
        plan = sweep.make_plan(cfg, experiment, machine=machine and action == "run") \
            if action in ("run", "plan") else None
    except (ValueError, OmegaConfBaseException) as e:
        raise UserError(_first_line(e)) from None
    return cfg, experiment, plan


def _task_of(job: list[str]) -> tuple:
    """A job's overrides as Hydra's ``overrides.task`` lists them (without hydra's own)."""
    return tuple(o for o in job if not o.lstrip("+~").startswith(("hydra.", "hydra/")))


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
        parts.append(rank.memory_text(rank.memory_parts(rec.memory), t1))
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


def print_plan(cfg, experiment, plan) -> None:
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
    try:
        out_dir = os.path.join(HydraConfig.get().runtime.output_dir, "points")
    except ValueError:  # not under Hydra (called from Python)
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
