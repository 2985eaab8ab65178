"""What the command line is checked for before anything runs (``cli``'s contract: one
``error:`` line naming the setting, exit 2): the command line itself (overrides Hydra cannot
read, settings given twice, a multirun's jobs), the config groups and keys, the experiment's
parameters, nested launches, and ``check_args``: every job composed, validated and planned
(``prepare``), its output directories checked writable.
"""
from __future__ import annotations

import dataclasses
import difflib
import itertools
import logging
import os
import re
import sys
import typing

from zero_repro import paths

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from zero_repro import config
from zero_repro import schema
from zero_repro.lab import jobs, registry, sweep
from zero_repro.lab.launcher import check_config, check_writable

from zero_repro.lab.cli_output import print_experiments

log = logging.getLogger(__name__)

# flags after which Hydra prints something and runs no job: nothing to validate
_INFO_FLAGS = ("--hydra-help", "--cfg", "-c", "--info", "-i",
               "--shell-completion", "-sc", "--version")
# flags without a value that Hydra reads anywhere on the command line (its parser wants them
# before the overrides)
_PLAIN_FLAGS = ("-m", "--multirun", "-r", "--run")


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


MAX_VALIDATED_JOBS = 1000  # a multirun larger than this is validated job by job as it runs
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


def is_multirun(argv: list[str], jobs: list[list[str]]) -> bool:
    return len(jobs) > 1 or any(a in ("-m", "--multirun") for a in argv)


def runs_here(argv: list[str]) -> bool:
    """Does this process run the jobs (``jobs.run``)? Not when a Hydra launcher or sweeper
    plugin is chosen (``hydra/launcher=submitit_slurm``): that plugin composes its jobs
    where it runs them (this machine's share is checked there)."""
    return not any(a.lstrip("+~").startswith(("hydra/launcher=", "hydra/sweeper="))
                   for a in argv)


def check_args(argv: list[str], keep: bool = False) -> list:
    """Everything ``main`` checks before a job runs (see the module docstring), in this
    process; UserError with one line naming the setting. Composes the first
    ``MAX_VALIDATED_JOBS`` jobs once (``jobs.compose_job``), checks and plans each
    (``compose_and_check``). Returns (cfg, experiment, plan) per job, or with ``keep`` the
    ``jobs.Job`` objects themselves (``prepared`` set), which ``cli`` runs as they are."""
    check_command_line(argv)
    schema.register_configs()  # the schema's config groups (idempotent)
    overrides = job_overrides(argv)
    multirun = is_multirun(argv, overrides)
    out: list = []
    with jobs.composing(conf_dir()):
        for num, job in enumerate(overrides[:MAX_VALIDATED_JOBS]):
            out.append(compose_and_check(argv, job, num, multirun,
                                         jobs.sweep_dir(out[0]) if multirun and out else None))
    return out if keep else [j.prepared for j in out]


def job_overrides(argv: list[str]) -> list[list[str]]:
    """Every job's overrides (``_jobs``), Hydra's grammar errors as UserError."""
    try:
        return _jobs(argv)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - Hydra's override grammar errors
        raise UserError(_first_line(e)) from None


def compose_and_check(argv: list[str], job: list[str], num: int, multirun: bool,
                      sweep: str | None) -> "jobs.Job":
    """Compose job ``num`` (inside ``jobs.composing``) and check and plan it: the ``Job``
    with ``prepared`` set; UserError (prefixed with the job in a multirun) if it is wrong."""
    try:
        composed = jobs.compose_job(job, num, multirun, sweep)
    except Exception as e:  # noqa: BLE001 - every composition error is a usage error
        raise _unknown_key(e, job) or UserError(_first_line(e)) from None
    prefix = f"job {job}: " if multirun else ""
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    try:
        dcfg = composed.task_config()
        check_keys(dcfg)
        check_writable(jobs.sweep_dir(composed) if multirun else composed.output_dir, key)
        composed.prepared = prepare(dcfg, machine=runs_here(argv), job=job)
    except (UserError, ValueError) as e:
        raise UserError(prefix + _first_line(e)) from None
    return composed


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
