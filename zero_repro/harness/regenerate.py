"""Tables and figures regenerated from ``results/`` alone.

``python -m experiments.plot NAME`` (= ``python -m zero_repro.harness.regenerate NAME``, or
``python run.py +exp=NAME experiment.action=plot``)
reads ``results/NAME/points.jsonl`` and ``results/paper/reference.csv`` and writes

* ``results/NAME/table.csv``: the experiment's ``summarize`` rows (newest record per point) in
  the long format of the reference CSV (figure, series, x_name, x_value, y_name, y_value, unit,
  kind) plus the paper's rows for the experiment's ``PAPER_FIGURE`` (kind ``paper``), and for
  our rows ``paper_series``, ``paper_value`` and ``rel_error_vs_paper``;
* ``results/NAME/NAME.png`` and ``.pdf``: the experiment's ``plot`` or ``default_plot``: one
  panel per (figure, y_name), same axes and units as the paper, paper values overlaid with
  their own marker (X), ours by kind (measured o, simulated s, analytic ^).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

import pandas as pd

from zero_repro.harness import paper_compare as paper
from zero_repro.harness import records as R
from zero_repro.harness import registry
from zero_repro.harness.figures import LINESTYLES, MARKERS, plt, save_figure
from zero_repro.harness.points import MODES, TABLE_COLUMNS

log = logging.getLogger(__name__)

def summary_frame(experiment: Any, records: list) -> pd.DataFrame:
    rows = experiment.summarize(R.latest(records))
    df = rows.copy() if isinstance(rows, pd.DataFrame) else pd.DataFrame(list(rows or []))
    missing = [c for c in TABLE_COLUMNS if c not in df.columns]
    if len(df) and missing:
        raise ValueError(f"summarize() rows lack columns {missing} (see zero_repro/harness/points.py)")
    if not len(df):
        return pd.DataFrame(columns=TABLE_COLUMNS)
    bad = sorted(set(df["kind"]) - set(MODES))
    if bad:
        raise ValueError(f"summarize() rows have kind {bad}: use one of {list(MODES)} "
                         f"(paper rows come from the reference CSV)")
    return df


def build_table(experiment: Any, records: list, ref: pd.DataFrame) -> pd.DataFrame:
    """Our rows (+ relative error vs the paper) followed by the paper's rows."""
    ours = summary_frame(experiment, records)
    figures = getattr(experiment, "PAPER_FIGURE", None)
    if not figures:
        return ours.reset_index(drop=True)
    ours = paper.compare(ours, ref, getattr(experiment, "SERIES_FAMILY", {}))
    y_names = set(ours["y_name"]) if len(ours) else None
    theirs = paper.paper_rows(ref, figures, y_names=y_names)
    return pd.concat([ours, theirs], ignore_index=True)


def regenerate(name: str, results_dir: str = "results", experiment: Any = None,
               records: list | None = None) -> dict:
    """Write table.csv and NAME.png/.pdf for experiment ``name``; return their paths."""
    experiment = experiment or registry.get(name)
    out_dir = os.path.join(results_dir, name)
    if records is None:
        records = R.RecordStore.for_experiment(results_dir, name).load()
    ref = paper.load_reference(paper.reference_path(results_dir))
    table = build_table(experiment, records, ref)
    os.makedirs(out_dir, exist_ok=True)
    table_path = os.path.join(out_dir, "table.csv")
    table.to_csv(table_path + ".tmp", index=False)
    os.replace(table_path + ".tmp", table_path)
    figures = []
    if len(table):
        custom = getattr(experiment, "plot", None)
        figures = list(custom(table, out_dir) if callable(custom)
                       else default_plot(table, out_dir, name))
    return {"table": table_path, "figures": figures, "rows": len(table),
            "records": len(records)}


def _panel_keys(table: pd.DataFrame) -> list[tuple[str, str]]:
    ours = table[table["kind"] != "paper"]
    src = ours if len(ours) else table
    return list(dict.fromkeys(zip(src["figure"], src["y_name"])))


def default_plot(table: pd.DataFrame, out_dir: str, name: str) -> list[str]:
    """One panel per (figure, y_name); colour = series family, marker/line = kind."""
    panels = _panel_keys(table)
    ncol = min(2, len(panels))
    nrow = -(-len(panels) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(6.4 * ncol, 4.4 * nrow), squeeze=False)
    for ax, (figure, y_name) in zip(axes.flat, panels):
        _draw_panel(ax, table[(table["figure"] == figure) & (table["y_name"] == y_name)],
                    figure, y_name)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    paths = save_figure(fig, out_dir, name, dpi=150)
    return paths


def _draw_panel(ax, df: pd.DataFrame, figure: str, y_name: str) -> None:
    df = df.copy()
    family = df["series"].where(df["kind"] == "paper",
                                df.get("paper_series", pd.Series("", index=df.index)))
    df["_family"] = family.where(family.fillna("") != "", df["series"])
    xnum = pd.to_numeric(df["x_value"], errors="coerce")
    categorical = xnum.isna().any()
    if categorical:  # e.g. stage names or "C1".."C5": positions in order of appearance
        cats = list(dict.fromkeys(df["x_value"].astype(str)))
        df["_x"] = df["x_value"].astype(str).map(cats.index)
        ax.set_xticks(range(len(cats)), cats, rotation=20)
    else:
        df["_x"] = xnum
    df["_y"] = pd.to_numeric(df["y_value"], errors="coerce")
    colors = {f: f"C{i % 10}" for i, f in enumerate(dict.fromkeys(df["_family"]))}
    for (series, kind), g in df.groupby(["series", "kind"], sort=False):
        g = g.sort_values("_x")
        label = f"{series} [{kind}]"
        ax.plot(g["_x"], g["_y"], marker=MARKERS.get(kind, "o"),
                linestyle=LINESTYLES.get(kind, "-"), color=colors[g["_family"].iloc[0]],
                markersize=9 if kind == "paper" else 5,
                markeredgecolor="black" if kind == "paper" else None, label=label)
    unit = next((u for u in df["unit"] if isinstance(u, str) and u), "")
    ax.set_xlabel(str(df["x_name"].iloc[0]))
    ax.set_ylabel(f"{y_name} [{unit}]" if unit else y_name)
    title = str(figure)
    if "rel_error_vs_paper" in df and df["rel_error_vs_paper"].notna().any():
        err = pd.to_numeric(df["rel_error_vs_paper"], errors="coerce").abs().mean()
        title += f"  (mean |rel. error| vs paper {100 * err:.1f}%)"
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="best")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Regenerate results/NAME/table.csv and NAME.png/"
                                             ".pdf from results/NAME/points.jsonl alone.")
    ap.add_argument("name")
    ap.add_argument("--results-dir", default="results")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        out = regenerate(args.name, args.results_dir)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{out['records']} records -> {out['table']} ({out['rows']} rows)"
          + "".join(f"\n  {p}" for p in out["figures"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
