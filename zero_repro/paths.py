"""Where the repository's files are: the repository root, ``conf/`` (Hydra configs) and
``results/`` (committed results, the paper's reference numbers), and where a run's own files go
(``home()``: ``results/local/``, Hydra's ``outputs/`` and ``multirun/``, the W&B offline runs),
never the working directory. The one place that turns ``__file__`` into paths; everyone else
asks here (layer 0: imports nothing from the project).
"""
from __future__ import annotations

import os
from pathlib import Path

# zero_repro/paths.py -> zero_repro/ -> the repository root (a source checkout)
REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "results"
REFERENCE_CSV = RESULTS_DIR / "paper" / "reference.csv"
HOME_ENV = "ZERO_REPRO_HOME"
# an installed (non-editable) package has no repository around it: its outputs go here
INSTALLED_HOME = Path("~") / "zero_repro"
# the names a config gives its results directories (``experiment.results_dir``): resolved by
# ``results_path`` against ``home()`` / the repository, never against the working directory
LOCAL_RESULTS = "results/local"
REFERENCE_RESULTS = "results"


def is_checkout() -> bool:
    """Does the package run from a source checkout (``pip install -e .`` or ``PYTHONPATH``)?"""
    return (REPO_ROOT / "pyproject.toml").is_file() and (REPO_ROOT / "zero_repro").is_dir()


def home() -> Path:
    """The folder a run's own files go under: ``$ZERO_REPRO_HOME`` if set, else the source
    checkout the package runs from, else (an installed package) ``~/zero_repro``."""
    env = os.environ.get(HOME_ENV)
    if env:
        return Path(env).expanduser().resolve()
    if is_checkout():
        return REPO_ROOT
    return INSTALLED_HOME.expanduser().resolve()


def results_path(results_dir: str | os.PathLike) -> Path:
    """``experiment.results_dir`` as an absolute path: ``results/local`` (the default) ->
    ``home()/results/local``; ``results`` (the reference set) -> the repository's ``results/``;
    any other relative path is the user's own and is taken as given (from the working
    directory); absolute paths stay."""
    text = os.fspath(results_dir)
    if text.rstrip("/") == LOCAL_RESULTS:
        return home() / LOCAL_RESULTS
    if text.rstrip("/") == REFERENCE_RESULTS:
        return RESULTS_DIR
    return Path(os.path.abspath(os.path.expanduser(text)))


def wandb_dir(results_dir: str | os.PathLike) -> Path:
    """The folder W&B writes its runs under (``dir=``): its offline runs land in
    ``<results_dir>/wandb/offline-run-*`` (``wandb sync <results_dir>/wandb`` uploads them all)."""
    return Path(results_dir)


def conf_dir() -> Path:
    """The ``conf/`` directory: ``$ZERO_REPRO_CONF_DIR``, else the one next to the package
    (source checkout), else ``./conf``."""
    env = os.environ.get("ZERO_REPRO_CONF_DIR")
    if env:
        return Path(env).resolve()
    beside = REPO_ROOT / "conf"
    if (beside / "config.yaml").is_file():
        return beside
    return (Path.cwd() / "conf").resolve()


def conf_group_dir(group: str) -> Path:
    """``conf/<group>/`` (e.g. ``cluster``, ``model``)."""
    return conf_dir() / group


def reference_csv(results_dir: str | os.PathLike | None = None) -> Path:
    """``<results_dir>/paper/reference.csv`` if present, else the repository's copy."""
    if results_dir:
        p = Path(results_dir) / "paper" / "reference.csv"
        if p.exists():
            return p
    return REFERENCE_CSV
