"""The paper's numbers (arXiv:1910.02054v3) as data, and the join of our rows against them.

``results/paper/reference.csv`` is the only source of paper values (never typed into code). It
is in long format: figure, series, x_name, x_value, y_name, y_value, unit, source, confidence.
Values are kept as text there (some are ranges or ">=24"); ``load_reference`` adds numeric
``x_num``/``y_num`` columns (NaN when not a plain number).

``compare(ours, family)`` joins our rows to the paper's on (figure, x_value, y_name) with a
*series-family mapping* (our series -> the paper's series name) and adds
``paper_value`` and ``rel_error_vs_paper = (y_value - paper_value) / |paper_value|``.
"""
from __future__ import annotations

import pandas as pd

from zero_repro import paths
from zero_repro.lab.points import TABLE_COLUMNS

DEFAULT_REFERENCE = str(paths.REFERENCE_CSV)


def reference_path(results_dir: str | None = None) -> str:
    """``<results_dir>/paper/reference.csv`` if present, else the repository's copy."""
    return str(paths.reference_csv(results_dir))


def _num(s: pd.Series) -> pd.Series:
    return pd.to_numeric(s, errors="coerce")


def load_reference(path: str | None = None) -> pd.DataFrame:
    df = pd.read_csv(path or DEFAULT_REFERENCE, dtype=str, keep_default_na=False)
    df["x_num"] = _num(df["x_value"])
    df["y_num"] = _num(df["y_value"])
    return df


def paper_rows(ref: pd.DataFrame, figures, y_names=None, series=None) -> pd.DataFrame:
    """The reference rows of ``figures`` (str or list) as table rows with ``kind="paper"``,
    optionally restricted to some y_names / paper series; only rows with a numeric y."""
    figures = [figures] if isinstance(figures, str) else list(figures or [])
    sel = ref["figure"].isin(figures) & ref["y_num"].notna()
    if y_names is not None:
        sel &= ref["y_name"].isin(list(y_names))
    if series is not None:
        sel &= ref["series"].isin(list(series))
    rows = ref[sel].copy()
    rows["y_value"] = rows["y_num"]
    rows["x_value"] = [_plain(n, t) for n, t in zip(rows["x_num"], rows["x_value"])]
    rows["kind"] = "paper"
    extra = [c for c in ("source", "confidence") if c in rows]
    return rows[TABLE_COLUMNS + extra].reset_index(drop=True)


def _plain(num: float, text: str):
    """A reference x as a number when it is one (8 rather than 8.0), else its text."""
    if num != num:  # NaN: not a number ("C1", "1 (64)")
        return text
    return int(num) if float(num).is_integer() else float(num)


def _xkey(v) -> str:
    """Join key for x values: 8 and "8" and 8.0 match; text compares as text."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return str(v).strip()
    return repr(round(f, 9))


def compare(ours: pd.DataFrame, ref: pd.DataFrame, family: dict | None = None) -> pd.DataFrame:
    """``ours`` with ``paper_series``, ``paper_value`` and ``rel_error_vs_paper`` added.

    ``family`` maps our series name to the paper's series name; a series not in the mapping is
    compared with the paper series of the same name (if any)."""
    out = ours.copy()
    family = family or {}
    out["paper_series"] = out["series"].map(lambda s: family.get(s, s))
    paper = ref[ref["y_num"].notna()][["figure", "series", "x_value", "y_name", "y_num"]].copy()
    paper["_x"] = paper["x_value"].map(_xkey)
    paper = paper.drop_duplicates(["figure", "series", "_x", "y_name"])
    paper = paper.rename(columns={"series": "paper_series", "y_num": "paper_value"})
    out["_x"] = out["x_value"].map(_xkey)
    merged = out.merge(paper.drop(columns=["x_value"]), how="left",
                       on=["figure", "paper_series", "_x", "y_name"])
    y = _num(merged["y_value"])
    p = merged["paper_value"]
    merged["rel_error_vs_paper"] = (y - p) / p.abs().where(p != 0)
    merged.loc[merged["paper_value"].isna(), "paper_series"] = ""
    return merged.drop(columns=["_x"])
