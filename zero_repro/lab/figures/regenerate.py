"""Tables and figures regenerated from ``results/`` alone.

``python -m experiments.plot NAME`` (or ``python run.py +exp=NAME experiment.action=plot``; both
then print the experiment's result lines; ``python -m zero_repro.lab.figures.regenerate NAME``
writes the same files without them) reads ``results/NAME/points.jsonl`` and ``results/paper/reference.csv`` and writes

* ``results/NAME/table.csv``: the experiment's ``summarize`` rows (newest record per point) in
  the long format of the reference CSV (figure, series, x_name, x_value, y_name, y_value, unit,
  kind) plus the paper's rows for the experiment's ``PAPER_FIGURE`` (kind ``paper``), and for
  our rows ``paper_series``, ``paper_value`` and ``rel_error_vs_paper``;
* ``results/NAME/NAME.png`` and ``.pdf``: the experiment's ``plot`` or ``default_plot``: one
  panel per (figure, y_name), same axes and units as the paper, paper values overlaid with
  their own marker (X), ours by kind (measured o, simulated s, analytic ^).

A user's own results directory (any other than the committed reference set ``results/``, by
default ``results/local/``) gets the reference set's *measured* rows beside its own: each
measured series is labelled with the hardware it ran on (``· this machine: <hw>`` /
``· reference: <hw>``) and the table's ``source`` column says which set a row is from; the
simulated and analytic rows are the user's own (recomputed at this code).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

import pandas as pd

from zero_repro import paths
from zero_repro.lab.figures import paper_compare
from zero_repro.lab import provenance as P
from zero_repro.lab import records as R
from zero_repro.lab import registry
from zero_repro.lab.figures.figures import LINESTYLES, MARKERS, plt, save_figure
from zero_repro.lab.points import MODES, TABLE_COLUMNS

log = logging.getLogger(__name__)

def _knob_suffix(layer: list, others: list) -> str:
    """`` [train.steps=6, zero.dtype=bf16]``: the knobs in which this layer's records differ
    from the other records of the same points."""
    idents = {}
    for r in others:
        idents.setdefault((r.point, repr(r.params), r.mode), []).append(r)
    diffs: dict = {}
    for r in layer:
        rivals = [o for o in idents.get((r.point, repr(r.params), r.mode), []) if o is not r]
        if rivals:
            diffs.update(R.knob_diff(r, rivals))
    return " [" + ", ".join(f"{k}={v}" for k, v in diffs.items()) + "]" if diffs else ""


def summary_frame(experiment: Any, records: list) -> pd.DataFrame:
    """The experiment's rows. Records of one point that differ in a config knob are
    summarized layer by layer (``records.variants``) and their series carry the knobs that
    tell them apart, so no record silently replaces another -- unless the experiment declares
    ``NEWEST_ONLY = True``: its ``summarize`` picks the newest record of every point itself
    (``records.newest_ok``: a re-run with a new method replaces the old result in the table and
    figure, the older records stay in points.jsonl as history) and gets all records at once."""
    if getattr(experiment, "NEWEST_ONLY", False):
        layers = [list(records)]
    else:
        layers = R.variants(records) or [[]]  # summarize([]) too: its rows are checked
    frames = []
    for layer in layers:
        rows = experiment.summarize(layer)
        frames.append(rows.copy() if isinstance(rows, pd.DataFrame)
                      else pd.DataFrame(list(rows or [])))
    if len(frames) > 1:  # a series named in two layers is named by its knobs in each
        names = [set(f["series"]) if "series" in f else set() for f in frames]
        for i, (layer, df) in enumerate(zip(layers, frames)):
            clash = names[i] & set().union(*(n for j, n in enumerate(names) if j != i))
            if not clash:
                continue
            suffix = _knob_suffix(layer, [r for j, other in enumerate(layers) if j != i
                                          for r in other])
            hit = df["series"].isin(clash)
            df.loc[hit, "series"] = df.loc[hit, "series"].astype(str) + suffix
    df = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    missing = [c for c in TABLE_COLUMNS if c not in df.columns]
    if len(df) and missing:
        raise ValueError(f"summarize() rows lack columns {missing} (see zero_repro/lab/points.py)")
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
    ours = paper_compare.compare(ours, ref, getattr(experiment, "SERIES_FAMILY", {}))
    y_names = set(ours["y_name"]) if len(ours) else None
    theirs = paper_compare.paper_rows(ref, figures, y_names=y_names)
    return pd.concat([ours, theirs], ignore_index=True)


def is_reference(results_dir: str) -> bool:
    """Is ``results_dir`` the committed reference set (``results/`` of this checkout)?"""
    return os.path.realpath(results_dir) == os.path.realpath(paths.RESULTS_DIR)


def _hardware_of(records: list) -> str:
    labels = dict.fromkeys(P.machine_label(r) for r in records
                           if r.mode == "measured" and r.done)
    return " / ".join(labels) or "?"


def _label_measured(df: pd.DataFrame, records: list, source: str) -> pd.DataFrame:
    df = df.copy()
    df["source"] = source
    measured = df["kind"] == "measured"
    df.loc[measured, "series"] = df.loc[measured, "series"].astype(str) + (
        f" · {source}: {_hardware_of(records)}")
    return df


def with_reference(table: pd.DataFrame, experiment: Any, records: list,
                   ref_records: list) -> pd.DataFrame:
    """The user's table with the reference set's measured rows beside its own, each
    measured series labelled with its hardware (module docstring)."""
    if not ref_records:
        return table
    theirs = summary_frame(experiment, ref_records)
    theirs = theirs[theirs["kind"] == "measured"]
    if not len(theirs):
        return table
    paper_rows = table[table["kind"] == "paper"]
    ours = _label_measured(table[table["kind"] != "paper"], records, "this machine")
    theirs = _label_measured(theirs, ref_records, "reference")
    return pd.concat([ours, theirs, paper_rows], ignore_index=True)


def regenerate(name: str, results_dir: str = "results", experiment: Any = None,
               records: list | None = None, reference: bool | None = None) -> dict:
    """Write table.csv and NAME.png/.pdf for experiment ``name``; return their paths.
    ``reference``: overlay the committed reference set's measured rows (default: when
    ``results_dir`` is not the reference set itself and ``records`` are read from it)."""
    experiment = experiment or registry.get(name)
    out_dir = os.path.join(results_dir, name)
    if reference is None:
        reference = records is None and not is_reference(results_dir)
    if records is None:
        records = R.RecordStore.for_experiment(results_dir, name).load()
    ref = paper_compare.load_reference(paper_compare.reference_path(results_dir))
    table = build_table(experiment, records, ref)
    if reference:
        ref_records = R.RecordStore.for_experiment(str(paths.RESULTS_DIR), name).load()
        table = with_reference(table, experiment, records, ref_records)
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


def main(argv=None, report=None) -> int:
    """``report(out, experiment)``, if given, runs after a table is written (``experiments.plot``
    passes ``lab.cli.print_result``: the result lines)."""
    ap = argparse.ArgumentParser(description="Regenerate results/NAME/table.csv and NAME.png/"
                                             ".pdf from results/NAME/points.jsonl alone.")
    ap.add_argument("name", nargs="?")
    ap.add_argument("--results-dir", default="results",
                    help="results/ (the committed reference set, default) or e.g. "
                         "results/local (your own runs, with the reference's measured points)")
    args = ap.parse_args(argv)
    if not args.name:
        print("experiments (python -m experiments.plot NAME):")
        for name, line in registry.describe():
            print(f"  {name:<20} {line}")
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        out = regenerate(args.name, args.results_dir)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{out['records']} records -> {out['table']} ({out['rows']} rows)"
          + "".join(f"\n  {p}" for p in out["figures"]))
    if report is not None:
        report(out, registry.get(args.name))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
