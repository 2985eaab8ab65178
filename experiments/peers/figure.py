"""The peers race's figure, its ``report.md`` and its result lines (``experiments/peers/``
summarises the records into the table these read): step time over the lower bound and over the
best peer, the size series, live-storage peaks, the largest model within the per-rank budget.
"""
from __future__ import annotations

import pandas as pd

from zero_repro.lab.figures.figures import save_figure
from zero_repro.lab.peers import report
from zero_repro.lab.peers.report_md import pd_numeric, repeats_of as _reps, write_report
from zero_repro.lab.peers.spec import FRAMEWORKS, LOWER_BOUND

FIGURE = "peers"
RACERS = [f for f in FRAMEWORKS if f != LOWER_BOUND]  # what the memory tables measure


P2P = "_p2p"  # zero_repro stages on gloo point-to-point (the peers' transport)
HYBRID = "torch_ddp_shm"  # DDP on zero_repro's shared-memory transport


def _color(name: str) -> str:
    if name.startswith("zero_repro"):
        return "#a6dba0" if name.endswith(P2P) else "C2"
    return ("C1" if name.startswith("deepspeed") else "0.5" if name == LOWER_BOUND
            else "C9" if name == HYBRID else "C0")


def plot(table, out_dir: str) -> list[str]:
    """Linear axes, time above, memory below: (a) every framework's step time / the lower
    bound, same kernel; (b) the project's stage k / the best peer at stage k, same kernel vs as
    shipped; (c) the size series, step time / lower bound at stages 2 and 3 against the
    parameter count; (d) every framework's per-rank live-storage peak, its max RSS growth beside
    it; (e) the project's peak / the best peer's at each stage; (f) the largest model each
    framework trains within the per-rank budget. Error bars: min-max over the repeats. Writes
    report.md."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    t = table[table["kind"] != "paper"].copy()
    # records of a point that differ in a config knob (e.g. a default that changed) come as
    # separate variants (lab.figures.regenerate): the figure and report show the newest race
    t = newest(t)
    t = own_tables_first(t)
    t["y"] = pd.to_numeric(t["y_value"], errors="coerce")
    fig, axes = plt.subplots(2, 3, figsize=(18, 10.4),
                             gridspec_kw={"width_ratios": [2.2, 1, 1.2]})
    _panel_bound(axes[0][0], t)
    _panel_best_peer(axes[0][1], t)
    _panel_size(axes[0][2], t)
    _panel_memory(axes[1][0], t)
    _panel_memory_peer(axes[1][1], t)
    _panel_budget(axes[1][2], t)
    fig.suptitle("ZeRO stages vs peers, measured on CPU ranks, world 2, fp32: step time (top), "
                 "per-rank memory (bottom); bars: median, whiskers: min-max of 3 repeats\n"
                 "blue torch (gloo), cyan DDP on zero_repro's shared-memory transport, orange "
                 "DeepSpeed (gloo), green zero_repro (shared memory; light green: _p2p, on gloo "
                 "point-to-point like the peers), grey lower bound", fontsize=10)
    fig.tight_layout()
    paths = save_figure(fig, out_dir, FIGURE, dpi=130)
    paths.append(write_report(t, out_dir))
    return paths


def _errbar(ys, reps):
    lo = [y - min(r) if r else 0 for y, r in zip(ys, reps)]
    hi = [max(r) - y if r else 0 for y, r in zip(ys, reps)]
    return [[max(0, v) for v in lo], [max(0, v) for v in hi]]


def _models(d) -> str:
    """The model(s) a panel's rows are of, for its title."""
    return ", ".join(sorted(set(d["model"].astype(str)))) or "not measured"


def _panel_bound(ax, t) -> None:
    d = t[(t["table"] == "same_kernel") & (t["y_name"] == "ratio_to_bound")]
    d = d.sort_values(["stage", "x_value"])
    reps = [_reps(v) for v in d["repeats"]]
    ax.bar(range(len(d)), d["y"], color=[_color(x) for x in d["x_value"]],
           yerr=_errbar(list(d["y"]), reps), capsize=2)
    ax.set_xticks(range(len(d)), [f"{x}\n(stage {s})" if s >= 0 else f"{x}" for x, s in
                                  zip(d["x_value"], d["stage"])],
                  rotation=60, fontsize=7, ha="right")
    ax.axhline(1.0, color="0.4", linestyle=":", linewidth=1, label="lower bound (1.0)")
    ax.axhline(report.GOAL_BOUND, color="C3", linestyle="--", linewidth=1,
               label=f"goal for zero_repro: <= {report.GOAL_BOUND:.2f} x lower bound")
    top = max([1.2] + [max(r) for r in reps if r] + list(d["y"].dropna()))
    ax.set_ylim(0, top * 1.08)  # whiskers included
    ax.set_ylabel("step time / lower bound [x], same fused AdamW")
    ax.set_title(f"(a) distance to the lower bound ({_models(d)})", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(True, axis="y", alpha=0.3)


def _panel_best_peer(ax, t) -> None:
    d = t[(t["y_name"] == "ratio_to_best_peer") & t["x_value"].str.startswith("zero_repro")
          & t["table"].isin(["same_kernel", "as_shipped"])]
    width = 0.2
    bars = (("same_kernel", False, "C2", "", "shared memory; peers with fused AdamW"),
            ("as_shipped", False, "#a6dba0", "//", "shared memory; peers as shipped"),
            ("same_kernel", True, "#e5f5e0", "xx", "gloo p2p (_p2p); peers with fused AdamW"),
            ("as_shipped", True, "#e5f5e0", "\\\\", "gloo p2p (_p2p); peers as shipped"))
    for i, (table, p2p, color, hatch, label) in enumerate(bars):
        e = d[(d["table"] == table) & (d["x_value"].str.endswith(P2P) == p2p)].sort_values("stage")
        if e.empty:  # not measured: no legend entry
            continue
        reps = [_reps(v) for v in e["repeats"]]
        ax.bar(e["stage"] + (i - 1.5) * width, e["y"], width=width, color=color, hatch=hatch,
               edgecolor="0.3", yerr=_errbar(list(e["y"]), reps), capsize=2, label=label)
    ax.axhline(1.0, color="0.4", linestyle=":", linewidth=1, label="parity with the best peer")
    for k, goal in sorted(report.GOAL_RATIO.items()):
        ax.hlines(goal, k - 0.45, k + 0.45, colors="C3", linestyles="--", linewidth=1,
                  label="goal: <= 0.95 (stages 0-1), 0.80 (2-3)" if k == 0 else None)
    ax.set_xticks(range(4), [f"stage {k}" for k in range(4)])
    tops = [max(r) for v in d["repeats"] for r in [_reps(v)] if r]
    ax.set_ylim(0, max([1.3] + tops) * 1.45)  # room for the legend above the bars
    ax.set_ylabel("zero_repro / best peer at the stage [x]")
    ax.set_title(f"(b) step time vs the best peer ({_models(d)})", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(True, axis="y", alpha=0.3)


def _panel_size(ax, t) -> None:
    d = t[(t["y_name"] == "ratio_to_bound") & (t["stage"].isin([2, 3]))
          & t["table"].isin(["same_kernel", "size"])].copy()
    d = d[d["x_value"].isin(set(d.loc[d["table"] == "size", "x_value"]))]  # the series' own
    d["params_m"] = pd_numeric(d["params"]) / 1e6
    for (name, stage), e in d.groupby(["x_value", "stage"]):
        e = e.sort_values("params_m")
        reps = [_reps(v) for v in e["repeats"]]
        ax.errorbar(e["params_m"], e["y"], yerr=_errbar(list(e["y"]), reps), marker="o",
                    color=_color(name), linestyle="-" if stage == 2 else "--", capsize=2,
                    label=f"{name} (stage {stage})")
    ax.axhline(1.0, color="0.4", linestyle=":", linewidth=1)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("model parameters [M] (seq 64, micro-batch 4 per rank)")
    ax.set_ylabel("step time / lower bound [x], same fused AdamW")
    ax.set_title("(c) size series, stages 2 (solid) and 3 (dashed)", fontsize=9)
    ax.legend(fontsize=6)
    ax.grid(True, alpha=0.3)


def newest(t):
    """The newest row per table, model, framework and quantity (by ``measured_at``); the budget
    table's per framework and quantity (its ``model`` is the result: the largest model that
    fitted, which a new race may change)."""
    if "measured_at" not in t:
        return t
    t = t.sort_values("measured_at", kind="stable")
    key = t["model"].astype(str).where(t["table"] != "budget", "")
    return t[~pd.DataFrame({"table": t["table"], "model": key, "x": t["x_value"],
                            "y": t["y_name"]}).duplicated(keep="last")]


def own_tables_first(t):
    """A user's table beside the committed reference set (``lab.figures.regenerate``, column
    ``source``): a table the user measured shows the user's rows only (its panels compare the
    frameworks of one race on one model; the reference set's race is of another model or day),
    a table the user did not measure shows the reference set's."""
    if "source" not in t:
        return t
    own = t["source"].fillna("") != "reference"
    mine = set(t.loc[own, "table"])
    return t[own | ~t["table"].isin(mine)]


def _memory_source(t):
    """Per-framework memory rows: the memory table's (each framework alone), else the race's
    live peaks (same kernel)."""
    d = t[t["table"] == "memory"]
    return d if not d.empty else t[(t["table"] == "same_kernel")]


def _not_measured(ax, what: str) -> None:
    """A panel whose records do not exist yet: said in words, no empty axes."""
    ax.text(0.5, 0.5, f"{what}: not measured in these records\n(python run.py +exp=peers "
            "experiment.force=true)", ha="center", va="center", transform=ax.transAxes)
    ax.set_axis_off()


def _panel_memory(ax, t) -> None:
    d = _memory_source(t)
    peak = d[d["y_name"] == "live_peak_bytes"].sort_values(["stage", "x_value"])
    if peak.empty:
        _not_measured(ax, "memory")
        return
    xs = range(len(peak))
    ax.bar(xs, peak["y"] / 2**20, color=[_color(x) for x in peak["x_value"]],
           label="live-storage peak (largest rank)")
    growth = d[d["y_name"] == "rss_growth_bytes"].set_index("x_value")["y"]
    if not growth.empty:
        ax.plot(list(xs), [growth.get(x, float("nan")) / 2**20 for x in peak["x_value"]], "kD",
                markersize=4, linestyle="none",
                label="max RSS - RSS before the build (cross-check)")
    ax.set_xticks(list(xs), [f"{x}\n(stage {s})" for x, s in zip(peak["x_value"], peak["stage"])],
                  rotation=60, fontsize=7, ha="right")
    model = peak["model"].iloc[0]
    ax.set_ylabel("per-rank memory [MiB]")
    ax.set_title(f"(d) per-rank peak memory ({model}; one accounting for all: live tensor "
                 f"storages)", fontsize=9)
    top = max(peak["y"].max(), growth.max() if not growth.empty else 0) / 2**20
    ax.set_ylim(0, top * 1.25)  # headroom: the legend covers no point
    ax.legend(fontsize=7, loc="upper right")
    ax.grid(True, axis="y", alpha=0.3)


def _panel_memory_peer(ax, t) -> None:
    d = _memory_source(t)
    peak = d[d["y_name"] == "live_peak_bytes"].set_index("x_value")["y"]
    if peak.empty:
        _not_measured(ax, "memory")
        return
    width = 0.35
    for i, p2p in enumerate((False, True)):
        ks, ys = [], []
        for k in range(4):
            ours = f"zero_repro_s{k}{P2P if p2p else ''}"
            peers_k = [peak[n] for n in peak.index if FRAMEWORKS.get(n, (-1, ""))[0] == k
                       and FRAMEWORKS[n][1] not in ("zero_repro", "bound", "hybrid")]
            if ours in peak and peers_k:
                ks.append(k)
                ys.append(peak[ours] / min(peers_k))
        if ks:
            ax.bar([k + (i - 0.5) * width for k in ks], ys, width=width,
                   color="#e5f5e0" if p2p else "C2", edgecolor="0.3",
                   hatch="xx" if p2p else "",
                   label="gloo p2p (_p2p)" if p2p else "shared memory")
    ax.axhline(1.0, color="0.4", linestyle=":", linewidth=1, label="the best peer's peak")
    ax.set_xticks(range(4), [f"stage {k}" for k in range(4)])
    ax.set_ylim(0, max(1.5, ax.get_ylim()[1]) * 1.15)
    ax.set_ylabel("zero_repro peak / best peer's peak [x]")
    ax.set_title("(e) memory vs the best peer (lower is less)", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(True, axis="y", alpha=0.3)


def _panel_budget(ax, t) -> None:
    d = t[(t["table"] == "budget") & (t["y_name"] == "max_params_in_budget")]
    d = d.sort_values(["stage", "x_value"])
    if d.empty:
        _not_measured(ax, "largest model in a per-rank budget")
        return
    ys = range(len(d))
    ax.barh(list(ys), d["y"] / 1e6, color=[_color(x) for x in d["x_value"]])
    for y, (v, m) in zip(ys, zip(d["y"], d["model"])):
        ax.text(v / 1e6, y, f" {m}", va="center", fontsize=6)
    ax.set_yticks(list(ys), [f"{x} (stage {s})" for x, s in zip(d["x_value"], d["stage"])],
                  fontsize=7)
    ax.invert_yaxis()
    budget = d["detail"].iloc[0].split(":")[0]
    ax.set_xlabel("parameters of the largest model trained [M]")
    ax.set_title(f"(f) largest model within a per-rank {budget.replace('budget ', '')} "
                 f"budget (live peak)", fontsize=9)
    ax.grid(True, axis="x", alpha=0.3)


def _memory_conclusion(t) -> list[str]:
    """The memory half: zero_repro's live peak over the best peer's per stage (each framework
    alone), and per stage the largest ladder model zero_repro and the best peer train within
    the budget."""
    out = []
    mem = t[(t["table"] == "memory") & (t["y_name"] == "memory_to_best_peer")
            & t["x_value"].astype(str).str.fullmatch(r"zero_repro_s\d")]
    if len(mem):
        out.append("memory, " + str(mem["model"].iloc[0]) + ": live peak, zero_repro / best peer: "
                   + ", ".join(f"s{int(r.stage)} {float(r.y_value):.2f} ({r.best_peer})"
                               for r in mem.sort_values("stage").itertuples()))
    bud = t[(t["table"] == "budget") & (t["y_name"] == "max_params_in_budget")]
    if len(bud):
        per = []
        for st, g in bud.groupby("stage"):
            ours = g[g["x_value"].astype(str).str.startswith("zero_repro")]["y_value"].astype(float)
            peers = g[~g["x_value"].astype(str).str.startswith("zero_repro")]["y_value"]
            best = f"{peers.astype(float).max() / 1e6:.1f}M" if len(peers) else "-"
            if len(ours):
                per.append(f"s{int(st)} {ours.max() / 1e6:.1f}M vs {best}")
        out.append("budget: largest model trained per rank budget, zero_repro vs best peer: "
                   + ", ".join(per))
    return out


def conclude(table) -> list[str]:
    """Per table of the race (same kernel, as shipped) and per set of records (this machine,
    the reference): zero_repro's step time per stage over the best peer's of that stage and
    over the lower bound; then the largest tolerance ratio of the equivalence check (< 1:
    every framework's parameters equal the reference within tolerance)."""
    import re

    t = table[table["kind"] == "measured"]
    t = newest(t)  # the newest race of every table, as the figure and report show
    source = t["series"].astype(str).map(
        lambda s: f" ({s.split(' · ', 1)[1].split(':')[0]})" if " · " in s else "")
    out = []
    def span(v) -> str:
        lo, hi = f"{v.min():.2f}", f"{v.max():.2f}"
        return lo if lo == hi else f"{lo}-{hi}"

    keys = [t["table"].astype(str), t["model"].astype(str), source]
    for (name, model, src), g in t.groupby(keys, sort=False):
        ours = g[g["x_value"].astype(str).str.fullmatch(r"zero_repro_s\d")]
        best = ours[ours["y_name"] == "ratio_to_best_peer"]
        bound = ours[ours["y_name"] == "ratio_to_bound"]["y_value"].astype(float)
        if not len(best):
            continue
        per = ", ".join(f"s{int(st)} {span(b['y_value'].astype(float))} "
                        f"({'/'.join(dict.fromkeys(b['best_peer'].astype(str)))})"
                        for st, b in best.groupby("stage"))
        out.append(f"{name}{src}, {model}: step time, zero_repro / best peer: {per}; "
                   f"zero_repro / lower bound {span(bound)}")
    out += _memory_conclusion(t)
    tol = pd_numeric(t[t["y_name"] == "tolerance_ratio"]["y_value"]).dropna()
    if len(tol):
        out.append(f"equivalence: largest tolerance ratio {tol.max():.3f} over {len(tol)} "
                   f"framework runs ({'all within' if tol.max() < 1 else 'SOME BEYOND'} "
                   f"tolerance)")
    return [re.sub(r"\s+", " ", line) for line in out]
