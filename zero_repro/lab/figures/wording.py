"""Numbers in an experiment's result lines (its ``conclude(table)``, printed by ``lab.cli``): short,
rounded, '-' for a value the table does not have."""
from __future__ import annotations

import math

import pandas as pd


def num(v, digits: int = 3) -> str:
    """``v`` to ``digits`` significant digits (``%g``: 40.0 -> '40', 0.000137 -> '0.000137')."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return "-"
    return "-" if math.isnan(f) else f"{f:.{digits}g}"


def pct(e, signed: bool = True) -> str:
    """A relative error (0.299 -> '+30%'), unsigned with ``signed=False``."""
    try:
        f = float(e)
    except (TypeError, ValueError):
        return "-"
    if math.isnan(f):
        return "-"
    return f"{100 * f:+.0f}%" if signed else f"{100 * abs(f):.0f}%"


def column(df: pd.DataFrame, name: str) -> pd.Series:
    """``df[name]`` as floats (NaN where missing), or all NaN when the table has no such column."""
    if name not in df:
        return pd.Series(float("nan"), index=df.index)
    return pd.to_numeric(df[name], errors="coerce")


def mean_max(errors) -> str:
    """'mean/max' of the absolute relative errors ('8%/18%'), '-' without any."""
    e = pd.to_numeric(pd.Series(errors), errors="coerce").abs().dropna()
    return f"{100 * e.mean():.0f}%/{100 * e.max():.0f}%" if len(e) else "-"


def by_kind_and_series(rows: pd.DataFrame):
    """``(kind, series, rows, first)`` in the table's order, each series' rows sorted by
    ``x_value`` as text (C1 .. C5), ``first`` on a kind's first series: the walk of a result
    paragraph per kind (its heading where ``first``), a line per series."""
    for kind in dict.fromkeys(rows["kind"]):
        groups = rows[rows["kind"] == kind].groupby("series", sort=False)
        for i, (series, g) in enumerate(groups):
            yield kind, series, g.sort_values("x_value", key=lambda x: x.astype(str)), i == 0
