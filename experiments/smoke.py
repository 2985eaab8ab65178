"""Smoke experiment: the whole stack end to end on one tiny point (no paper figure).

A tiny GPT trains for a few steps on ``parallel.world_size`` local ranks (``conf/exp/smoke.yaml``:
2 ranks as DP 2, so ``zero.stage=0..3`` really partition) through
``zero_repro.lab.launcher.run_training``; the record keeps the per-step losses and ``summarize`` turns
them into ``kind=measured`` rows (y_name ``loss`` per ``step``). The check that matters: the loss
goes down (``metrics.loss_decreased``). Series are named from each record's resolved config
(``records.knob_label``: model shape, dtype, stage, ZeRO-R, world/TP/DP, steps) plus the data
source, so an fp32 and a bf16 run, an 8- and a 6-step run, or real text and synthetic tokens,
are two curves. Steps are numbered as the log numbers them (1 = after the first optimizer
step); curves that coincide are drawn apart (line style, marker) and said to coincide. Rows of
records that carry them hold the run's model states per rank and Table 1's value
(``model_state_MiB``, ``table1_MiB``); ``conclude`` states the losses, the coinciding curves
and the model states against Table 1.
"""
from __future__ import annotations

from zero_repro.lab.figures.figures import save_figure
from zero_repro.lab.points import Point
from zero_repro import schema
from zero_repro.lab.records import knob_label, loss_curve
from zero_repro.lab.launcher import run_training

FIGURE = "smoke"


def plan(cfg) -> list[Point]:
    p = cfg.parallel
    return [Point(name=knob_label(schema.summary(cfg)),
                  params={"world_size": p.world_size, "tp": p.tp, "stage": cfg.zero.stage},
                  mode="measured")]


def run_point(cfg, point: Point) -> dict:
    result = run_training(cfg, point.run_dir, point.checked)
    m = result.setdefault("metrics", {})
    losses = m.get("losses") or []
    if losses:
        m["loss_decreased"] = bool(losses[-1] < losses[0])
    return result


def summarize(records) -> list[dict]:
    rows = []
    for r in records:
        if r.status != "ok":
            continue
        data = (r.config.get("train") or {}).get("data", "?")
        series = f"{knob_label(r.config)}, {data} data"
        hw = r.hardware.get("device_name", "")
        m = r.metrics
        memory = {"model_state_MiB": m["model_state_bytes"] / 2**20,
                  "table1_MiB": m["table1_model_state_bytes"] / 2**20,
                  "table1_formula": m.get("table1_formula", "")} \
            if m.get("table1_model_state_bytes") else {}
        for step, loss in loss_curve(r):  # a resumed record starts at its start_step
            rows.append({"figure": FIGURE, "series": series, "x_name": "step",
                         "x_value": step + 1,  # the log's numbering: step 1 = first update
                         "y_name": "loss", "y_value": loss, "unit": "nats", "kind": r.mode,
                         "hardware": hw, **memory})
    return rows


def conclude(table) -> list[str]:
    """Each run's loss first -> last, the runs whose curves coincide, and each run's model
    states per rank beside Table 1's value."""
    ours = table[table["kind"] != "paper"]
    curves = {s: dict(zip(g["x_value"].astype(int), g["y_value"].astype(float)))
              for s, g in ours.groupby("series", sort=False)}
    if not curves:
        return []
    short = dict(zip(curves, _distinct(list(curves)))) if len(curves) > 1 else \
        {s: s for s in curves}
    out = []
    for s, c in curves.items():
        first, last = c[min(c)], c[max(c)]
        line = (f"{short[s]}: loss {first:.3f} -> {last:.3f} over steps {min(c)}-{max(c)} "
                f"({'falls' if last < first else 'does NOT fall'})")
        g = ours[ours["series"] == s]
        if "table1_MiB" in g and g["table1_MiB"].notna().any():
            row = g.iloc[0]
            line += (f"; model states {row['model_state_MiB']:.3g} MiB/rank, Table 1 "
                     f"{row['table1_formula']}: {row['table1_MiB']:.3g} MiB")
        out.append(line)
    for group in coinciding(curves):
        out.append("same loss curve (|Δloss| <= 1e-6 at every step): "
                   + ", ".join(short[s] for s in group))
    return out


COINCIDE = 1e-6  # nats: curves closer than this at every common step are one curve


def coinciding(curves: dict) -> list[list[str]]:
    """Groups (of two or more) of series whose losses agree within ``COINCIDE`` at every step
    they share. ``curves``: {series: {step: loss}}."""
    groups: list[list[str]] = []
    for name, c in curves.items():
        for g in groups:
            ref = curves[g[0]]
            common = c.keys() & ref.keys()
            if common and all(abs(c[s] - ref[s]) <= COINCIDE for s in common):
                g.append(name)
                break
        else:
            groups.append([name])
    return [g for g in groups if len(g) > 1]


FEW_STEPS = 50  # up to this many logged steps: a marker and a tick per step


def plot(table, out_dir: str) -> list[str]:
    """Loss vs step per series; coinciding series get distinct styles and a note."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    import pandas as pd


    ours = table[table["kind"] != "paper"].assign(
        x=lambda d: pd.to_numeric(d["x_value"]), y=lambda d: pd.to_numeric(d["y_value"]))
    curves = {s: dict(zip(g["x"], g["y"])) for s, g in ours.groupby("series", sort=False)}
    fig, ax = plt.subplots(figsize=(9, 5.2 + 0.18 * len(curves)))
    styles = ["-", "--", ":", "-."]
    markers = ["o", "s", "^", "x", "D", "v"]
    for i, (s, c) in enumerate(curves.items()):
        xs = sorted(c)
        ax.plot(xs, [c[x] for x in xs], styles[i % 4], color=f"C{i % 10}", label=s,
                marker=markers[i % 6] if len(xs) <= FEW_STEPS else None,
                markersize=7 - (i % 3) * 1.5)
    groups = coinciding(curves)
    if groups:
        ax.text(0.01, 0.02, "drawn over each other (|Δloss| <= 1e-6 at every step):\n"
                + "\n".join(" = ".join(_distinct(g)) for g in groups),
                transform=ax.transAxes, fontsize=8, va="bottom")
    xs = sorted(ours["x"].unique())
    if xs and len(xs) <= FEW_STEPS:  # a tick per step; a long run gets matplotlib's integer ones
        ax.set_xticks(xs)
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel="optimizer step (as logged)", ylabel="training loss [nats]",
           title="smoke: loss per step (local CPU ranks, measured)")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=1)
    fig.tight_layout()
    return save_figure(fig, out_dir, "smoke", dpi=150)


def _distinct(names: list[str]) -> list[str]:
    """Each name cut to the words that tell it apart from the others in ``names``, with the
    word before each (``stage 0`` rather than ``0``)."""
    words = [n.replace(",", "").split() for n in names]
    if len({len(w) for w in words}) != 1:
        return names
    differ = [i for i in range(len(words[0])) if len({w[i] for w in words}) > 1]
    keep = sorted({j for i in differ for j in (i - 1, i) if j >= 0})
    return [" ".join(w[j] for j in keep) for w in words]
