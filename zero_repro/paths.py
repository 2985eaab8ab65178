"""Where the repository's files are: the repository root, ``conf/`` (Hydra configs) and
``results/`` (committed results, the paper's reference numbers). The one place that turns
``__file__`` into paths; everyone else asks here (layer 0: imports nothing from the project).
"""
from __future__ import annotations

import os
from pathlib import Path

# zero_repro/paths.py -> zero_repro/ -> the repository root (a source checkout)
REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "results"
REFERENCE_CSV = RESULTS_DIR / "paper" / "reference.csv"


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
