"""The experiment registry: figure modules under ``experiments/`` (one per paper table or
figure, §10) found by name, plus experiment objects registered at run time (tests, notebooks).

Discovery imports ``experiments.<name>`` dynamically (``importlib``): the registry sits below
the figure modules and never imports them statically. An experiment is a module
``experiments/<name>.py`` with its overlay ``conf/exp/<name>.yaml`` (helper modules and scripts
under ``experiments/`` have none); ``describe`` lists them with their docstring's first line,
read with ``ast`` (no import: listing must not pay for torch).
"""
from __future__ import annotations

import ast
import difflib
import importlib
import os
import pkgutil
import types
from typing import Any

from zero_repro.paths import conf_group_dir

# name -> experiment object registered at run time (tests, notebooks); modules under
# experiments/ are found by import and need no registration
_REGISTERED: dict[str, Any] = {}
_PACKAGE = "experiments"
_NOT_EXPERIMENTS = {"plot"}  # experiments/plot.py: the regeneration command, not a figure


def register(name: str, experiment: Any) -> None:
    """Register an experiment object under ``name`` (overrides ``experiments/<name>.py``)."""
    _check(name, experiment)
    _REGISTERED[name] = experiment


def unregister(name: str) -> None:
    _REGISTERED.pop(name, None)


def available() -> list[str]:
    """Names of the experiment modules under experiments/ plus registered ones."""
    package = importlib.import_module(_PACKAGE)
    overlays = {p.stem for p in conf_group_dir("exp").glob("*.yaml")}
    names = {m.name for m in pkgutil.iter_modules(package.__path__)
             if not m.name.startswith("_") and m.name not in _NOT_EXPERIMENTS
             and m.name in overlays}
    return sorted(names | set(_REGISTERED))


def describe() -> list[tuple[str, str]]:
    """(name, one-line description) of every experiment: the first sentence of its module
    docstring (or of a registered object's ``__doc__``)."""
    package = importlib.import_module(_PACKAGE)
    out = []
    for name in available():
        if name in _REGISTERED:
            doc = getattr(_REGISTERED[name], "__doc__", "") or ""
        else:
            # experiments/<name>.py, or the package experiments/<name>/ (its own figure and
            # check modules beside its __init__.py)
            path = next((f for d in package.__path__ for f in
                         (f"{d}/{name}.py", f"{d}/{name}/__init__.py") if os.path.isfile(f)), "")
            with open(path, encoding="utf-8") as f:
                doc = ast.get_docstring(ast.parse(f.read())) or ""
        out.append((name, _first_sentence(doc)))
    return out


def _first_sentence(doc: str, width: int = 110) -> str:
    para = " ".join(doc.strip().split("\n\n")[0].split())
    head = para.split(". ")[0].rstrip(".")
    return head if len(head) <= width else head[:width - 1].rstrip() + "…"


def get(name: str) -> Any:
    """The experiment called ``name``; ValueError (listing the choices) when there is none."""
    if name in _REGISTERED:
        return _REGISTERED[name]
    if not name.isidentifier() or name in _NOT_EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}{_suggest(name)}: choose one of "
                         f"{available()}")
    modname = f"{_PACKAGE}.{name}"
    try:
        module = importlib.import_module(modname)
    except ModuleNotFoundError as e:
        if e.name != modname:  # the module exists but one of its imports is missing
            raise
        raise ValueError(f"unknown experiment {name!r}{_suggest(name)}: choose one of "
                         f"{available()} "
                         f"(or add experiments/{name}.py and conf/exp/{name}.yaml)") from None
    _check(name, module)
    return module


def module_path(experiment: Any) -> str:
    """Importable name of an experiment module (how a Slurm job finds it again)."""
    if isinstance(experiment, types.ModuleType):
        return experiment.__name__
    raise TypeError("only experiment modules can run as Slurm jobs (the job imports them by name)")


def _check(name: str, experiment: Any) -> None:
    missing = [f for f in ("plan", "run_point", "summarize")
               if not callable(getattr(experiment, f, None))]
    if missing:
        raise ValueError(f"experiment {name!r} does not define {missing} (see zero_repro/lab/points.py)")


def _suggest(name: str) -> str:
    close = difflib.get_close_matches(name, available(), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
