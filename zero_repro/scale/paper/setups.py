"""The paper's experiment setups (appendix Tables 4-10) and reference values, read from
``results/paper/reference.csv`` (never retyped here; ``zero_repro.paths.REFERENCE_CSV``).

Rows ``figX_config`` hold one (series, point, field) triple each: fields num_gpus, mp_degree,
layers, hidden_size, attention_heads, batch_size_per_gpu, total_batch_size. ``setups(figure)``
returns them as ``PaperSetup`` dataclasses; ``paper_values(figure, series_prefix)`` returns the
digitized y values of a plotted series keyed by x.
"""
from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from functools import lru_cache

from zero_repro.paths import REFERENCE_CSV


@dataclass(frozen=True)
class PaperSetup:
    figure: str  # "fig2", "fig3", ...
    series: str  # "ZeRO" | "Baseline"
    size_label: str  # the paper's nominal size, e.g. "60B"
    point: str  # the CSV's point label, e.g. "60B ZeRO", "128 GPUs", "C4", "60B C2"
    n_layer: int
    hidden: int
    heads: int
    gpus: int
    tp: int  # the tables' "MP" (Megatron tensor-parallel degree)
    batch_per_gpu: int
    total_batch: int
    zero_config: str  # "C1".."C5" when the table names it, "ZeRO" (unspecified), "baseline"

    @property
    def dp(self) -> int:
        return self.gpus // self.tp

    @property
    def size_b(self) -> float:
        return float(self.size_label.rstrip("B"))


@lru_cache(maxsize=4)
def _rows(path: str = str(REFERENCE_CSV)) -> tuple[dict, ...]:
    with open(path, newline="") as f:
        return tuple(csv.DictReader(f))


_FIELDS = {"num_gpus": "gpus", "mp_degree": "tp", "layers": "n_layer", "hidden_size": "hidden",
           "attention_heads": "heads", "batch_size_per_gpu": "batch_per_gpu",
           "total_batch_size": "total_batch"}


def setups(figure: str, path: str = str(REFERENCE_CSV)) -> list[PaperSetup]:
    """All setups of ``figure`` ("fig2".."fig8") in CSV order."""
    groups: dict[tuple[str, str], dict] = {}
    for r in _rows(path):
        if r["figure"] != f"{figure}_config" or r["y_name"] not in _FIELDS:
            continue
        key = (r["series"], r["x_value"])
        groups.setdefault(key, {})[_FIELDS[r["y_name"]]] = int(float(r["y_value"]))
    out = []
    for (series, point), vals in groups.items():
        m = re.search(r"config (\S+B) (ZeRO|Baseline)(?: (C\d))?$", series)
        if not m:
            raise ValueError(f"unrecognised setup series {series!r} in {path}")
        size, kind, cfg = m.group(1), m.group(2), m.group(3)
        c_in_point = re.search(r"\b(C\d)$", point)
        zc = cfg or (c_in_point.group(1) if c_in_point else None)
        zero_config = "baseline" if kind == "Baseline" else (zc or "ZeRO")
        out.append(PaperSetup(figure=figure, series=kind, size_label=size, point=point,
                              zero_config=zero_config, **vals))
    return out


def paper_values(figure: str, series_prefix: str, y_name: str = "throughput_per_gpu",
                 path: str = str(REFERENCE_CSV)) -> dict[float, float]:
    """Numeric paper values {x: y} of the series whose name starts with ``series_prefix``."""
    out = {}
    for r in _rows(path):
        if (r["figure"] == figure and r["series"].startswith(series_prefix)
                and r["y_name"] == y_name):
            try:
                out[float(r["x_value"])] = float(r["y_value"])
            except ValueError:
                continue  # claims like ">38" or ranges are not points
    return out


def reference_rows(figure: str, path: str = str(REFERENCE_CSV)) -> list[dict]:
    """Raw CSV rows of one figure/table (e.g. "table1", "table2", "text")."""
    return [dict(r) for r in _rows(path) if r["figure"] == figure]
