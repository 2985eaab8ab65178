"""Points and the experiment protocol: what a figure module under ``experiments/`` gives the
harness (paper §10: each figure is a sweep of run points).

A figure of the paper (arXiv:1910.02054, §10) is reproduced by ``conf/exp/<name>.yaml`` (which
sets ``experiment.name: <name>`` and the knobs) plus ``experiments/<name>.py``, a module that
implements the protocol below. The sweep runner (``zero_repro.lab.sweep``) plans the points,
skips those already in ``results/<name>/points.jsonl``, runs the rest and records them; the
experiment module never writes files itself (except in its optional ``plot``).

Contract of an experiment module (functions at module level):

* ``plan(cfg: Config) -> list[Point]``: the sweep. Each Point names its identifying ``params``
  (they, the mode and the run-relevant config sections form the record key) and the dotted config
  ``overrides`` that turn the experiment's base config into this point's config.
* ``run_point(cfg: Config, point: Point) -> dict``: run one point on its own config. Return
  either a flat dict of metrics, or the ``zero_repro.lab.launcher.run_training`` shape
  ``{"metrics": {...}, "memory": {...}, "comm": {...}, "topology": {...}, "hardware": {...}}``.
  Raise on failure: an out-of-memory error (``torch.OutOfMemoryError``, ``MemoryError``, or a
  ``WorkerFailed`` whose reason names one) is recorded as ``status="oom"``, anything else as
  ``status="failed"``; the sweep continues either way.
* ``summarize(records: list[Record]) -> list[dict] | pandas.DataFrame``: rows in the long format
  of ``results/paper/reference.csv`` (``TABLE_COLUMNS``), ``kind`` in measured | simulated |
  analytic. Paper rows are added by the framework from the reference CSV, never by the module.
* optional ``plot(table: DataFrame, out_dir: str) -> list[str]``: custom figure; the default
  (``zero_repro.lab.figures.regenerate.default_plot``) draws one panel per y_name with paper values
  overlaid.
* optional ``PAPER_FIGURE: str | list[str]``: reference-CSV ``figure`` ids to overlay/compare.
* optional ``SERIES_FAMILY: dict[str, str]``: our series name -> the paper's series name, used
  to join our rows to the paper's on (figure, x_value, y_name) for ``rel_error_vs_paper``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from zero_repro.config import Config

MODES = ("measured", "simulated", "analytic")
KINDS = ("paper",) + MODES
TABLE_COLUMNS = ["figure", "series", "x_name", "x_value", "y_name", "y_value", "unit", "kind"]


@dataclass(frozen=True)
class Point:
    """One run point of a sweep.

    ``params`` identify the point (JSON-serialisable scalars/lists); ``overrides`` are dotted
    config keys applied on top of the experiment config (``{"zero.stage": 2}``); ``mode`` says
    how the numbers are obtained; ``run_dir`` is filled in by the orchestrator (a scratch folder
    for this point, ignored by git) and is not part of the identity, nor is ``checked``.
    """

    name: str
    params: dict = field(default_factory=dict)
    overrides: dict = field(default_factory=dict)
    mode: str = "measured"
    run_dir: str = ""
    # the pre-flight's verdict in this process (``preflight.check_points``: the checkpoint it
    # resumes from, the committed checkpoints then), for its ``launcher.run_training``; no
    # part of its identity
    checked: tuple | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"Point {self.name!r}: mode={self.mode!r} is not one of {list(MODES)}")

    def as_dict(self) -> dict:
        return {"name": self.name, "params": dict(self.params),
                "overrides": dict(self.overrides), "mode": self.mode, "run_dir": self.run_dir}

    @classmethod
    def from_dict(cls, d: dict) -> "Point":
        return cls(name=d["name"], params=dict(d.get("params") or {}),
                   overrides=dict(d.get("overrides") or {}), mode=d.get("mode", "measured"),
                   run_dir=d.get("run_dir", ""))


@runtime_checkable
class Experiment(Protocol):
    """What the orchestrator needs from an experiment (usually a module)."""

    def plan(self, cfg: Config) -> list[Point]: ...

    def run_point(self, cfg: Config, point: Point) -> dict[str, Any]: ...

    def summarize(self, records: list) -> Any: ...
