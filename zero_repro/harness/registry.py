"""The experiment registry: figure modules under ``experiments/`` (one per paper table or
figure, §10) found by name, plus experiment objects registered at run time (tests, notebooks).

Discovery imports ``experiments.<name>`` dynamically (``importlib``): the registry sits below
the figure modules and never imports them statically.
"""
from __future__ import annotations

import difflib
import importlib
import pkgutil
import types
from typing import Any

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
    names = {m.name for m in pkgutil.iter_modules(package.__path__)
             if not m.name.startswith("_") and m.name not in _NOT_EXPERIMENTS}
    return sorted(names | set(_REGISTERED))


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
        raise ValueError(f"experiment {name!r} does not define {missing} (see zero_repro/harness/points.py)")


def _suggest(name: str) -> str:
    close = difflib.get_close_matches(name, available(), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
