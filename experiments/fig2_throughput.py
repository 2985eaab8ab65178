"""Figure 2: throughput per GPU of ZeRO-100B vs the Megatron-LM baseline, 1.5B-170B parameters on
400 V100 GPUs (paper §10.2, setups Table 5). ZeRO-100B = P_os+g + ZeRO-R with MP inside a node
(MP <= 16); beyond ~40B the baseline's MP crosses nodes and its TP all-reduces (12·s·h·b bytes
per block) ride InfiniBand (~5 TFLOPs/GPU, the paper's collapse).

ZeRO-100B = P_os+g + ZeRO-R with Megatron MP inside a node (MP <= 16); the baseline needs MP
across nodes beyond ~40B, where its TP all-reduces (12·s·h·b bytes per block) cross InfiniBand
and collapse to ~5 TFLOPs/GPU.

* simulated (paper scale): Table 5 setups through the performance model; its parameters are
  fitted on THIS figure's ZeRO series at the paper's batches (so the "paper batch" ZeRO rows
  are the fit, in-sample), everything else is a prediction: the baseline, the speed-up bars
  (ZeRO / baseline per model size, as the paper's), and the series at the batch the paper2020
  memory dry run says fits;
* measured (cluster): the same setups as real points (``cluster=dgx2_v100 launcher=slurm``);
* measured (local): ``local_models`` at world 2: C3 (P_os+g, DP 2) vs stage 0 with Megatron TP
  ``local_baseline_tp``, x = parameters in B.
"""
from __future__ import annotations

import pandas as pd

from zero_repro.lab.throughput import plan as T
from zero_repro.lab.throughput import run as TR
from zero_repro.lab.throughput import setups as TN
from zero_repro.lab.figures import throughput_plots as TP
from zero_repro.lab import records as R
from zero_repro.lab.figures import throughput_summary as TS
from zero_repro.lab.figures.wording import mean_max, num

PARAMS = TN.PARAMS  # the experiment.params keys it reads (cli.check_params)

FIGURE = "fig2"
PAPER_FIGURE = "fig2"
ZERO = "ZeRO-100B (ZeRO-DP Pos+g + ZeRO-R, with Megatron MP)"
BASE_IN = "Baseline-MP (Megatron-LM, MP within node)"
BASE_OUT = "Baseline w. internode MP (Megatron-LM)"
SPEEDUP = "ZeRO speed-up bar (ZeRO/baseline)"
# our paper-scale series carry the paper's names; the paper-batch ones map onto them too
SERIES_FAMILY: dict = {n + TN.PAPER_BATCH: n for n in (ZERO, BASE_IN, BASE_OUT, SPEEDUP)}
# summarize() shows the newest record of every point (lab.figures.regenerate): a re-run at another
# device capacity (new point keys) replaces the figure's values; older records stay as history
NEWEST_ONLY = True
GPUS_PER_NODE = 16  # DGX-2: the paper's split of the baseline into two series


def series_of(s) -> str:
    if s.series == "ZeRO":
        return ZERO
    return BASE_IN if s.tp <= GPUS_PER_NODE else BASE_OUT


def _local(cfg, p: dict) -> list:
    pts = []
    for model in p.get("local_models", ["tiny", "small", "gpt_20m"]):
        pts.append(T.local_point(FIGURE, f"local {model} ZeRO C3 w2", model, 2, 1, "C3", p,
                                 series="ZeRO"))
        tp = int(p.get("local_baseline_tp", 2))
        pts.append(T.local_point(FIGURE, f"local {model} baseline tp{tp} w2", model, 2, tp,
                                 "baseline", p, series="Baseline"))
    return pts


def plan(cfg) -> list:
    return T.plan_points(cfg, FIGURE, _local)


def run_point(cfg, point) -> dict:
    return TR.run_point(cfg, point)


def _speedups(rows: list[dict], zero: str, bases: tuple, series: str) -> list[dict]:
    out = []
    for kind in dict.fromkeys(r["kind"] for r in rows):
        z = {r["x_value"]: r for r in rows if r["kind"] == kind and r["series"] == zero}
        b = {r["x_value"]: r for r in rows if r["kind"] == kind and r["series"] in bases}
        for x in z:
            if x in b and b[x]["y_value"] > 0 and z[x]["y_value"] == z[x]["y_value"]:
                out.append({**z[x], "series": series, "y_name": "speedup", "unit": "x",
                            "y_value": z[x]["y_value"] / b[x]["y_value"], "in_sample": ""})
    return out


def summarize(records) -> list[dict]:
    records = R.newest_ok(records)
    rows = TS.paper_scale_rows(records, FIGURE, series_of, lambda s: s.size_b)
    for sfx in ("", TN.PAPER_BATCH):
        rows += _speedups([r for r in rows if str(r["series"]).endswith(sfx) or not sfx],
                          ZERO + sfx, (BASE_IN + sfx, BASE_OUT + sfx), SPEEDUP + sfx)
    local = []
    for r in TS.ok_records(records, "measured_local"):
        q = r.params
        if q["series"] == "ZeRO":
            name = "local ZeRO: P_os+g + ZeRO-R (C3), DP 2"
        else:
            name = f"local baseline: stage 0, Megatron TP {q['tp']}"
        x = round(r.metrics["params_total"] / 1e9, 6)
        local.append(TS.base_row(r, FIGURE, name, x, r.metrics["tflops_per_gpu"]))
    zero_local = "local ZeRO: P_os+g + ZeRO-R (C3), DP 2"
    bases = tuple({r["series"] for r in local} - {zero_local})
    local += _speedups(local, zero_local, bases, "local speed-up (ZeRO/baseline)")
    return rows + local


def _errors(table, series: str, y_name: str = TN.Y_NAME) -> str:
    e = pd.to_numeric(table.loc[(table["series"] == series) & (table["y_name"] == y_name),
                                "rel_error_vs_paper"], errors="coerce").abs().dropna()
    return f"mean |err| {100 * e.mean():.0f}%, max {100 * e.max():.0f}%" if len(e) else "-"


def error_lines(table) -> list[str]:
    """The fitted and the unfitted errors vs the paper, apart (figure title and README)."""
    pb = TN.PAPER_BATCH
    base = table[table["series"].isin([BASE_IN + pb, BASE_OUT + pb])].assign(series="b")
    base_mf = table[table["series"].isin([BASE_IN, BASE_OUT])].assign(series="b")
    return [f"paper batch: ZeRO (FITTED, in-sample) {_errors(table, ZERO + pb)}; baseline "
            f"(predicted) {_errors(base, 'b')}; speed-up (predicted) "
            f"{_errors(table, SPEEDUP + pb, 'speedup')}",
            f"predicted batch (memory dry run): ZeRO {_errors(table, ZERO)}; baseline "
            f"{_errors(base_mf, 'b')}; speed-up {_errors(table, SPEEDUP, 'speedup')}"]


def _by_size(rows, series: tuple, y_name: str = TN.Y_NAME) -> dict:
    """{model size B: y} of ``series`` (the baseline's two series are one line)."""
    g = rows[rows["series"].isin(series) & (rows["y_name"] == y_name)]
    return {float(x): float(y) for x, y in zip(pd.to_numeric(g["x_value"], errors="coerce"),
                                               pd.to_numeric(g["y_value"], errors="coerce"))
            if x == x}


def conclude(table: pd.DataFrame) -> list[str]:
    """The figure in words, per model size: ZeRO's and the baseline's TFLOPs/GPU and the
    speed-up bars at the batch the memory dry run fits, each beside the paper's; the mean/max
    |error| of the fitted series (ZeRO at the paper's batch) apart from the unfitted ones; the
    local measured speed-ups."""
    big, local = TP.split(table)
    paper = big[big["kind"] == "paper"]
    out = []
    for kind in [k for k in dict.fromkeys(big["kind"]) if k != "paper"]:
        mine = big[big["kind"] == kind]
        sizes = sorted(_by_size(mine, (ZERO, BASE_IN, BASE_OUT)))
        if not sizes:
            continue
        out.append(f"{kind}, 400 V100, batch the memory dry run fits; model sizes [B]: "
                   + " ".join(num(x) for x in sizes))
        for label, series, y_name in (("ZeRO TFLOPs/GPU", (ZERO,), TN.Y_NAME),
                                      ("baseline TFLOPs/GPU", (BASE_IN, BASE_OUT), TN.Y_NAME),
                                      ("speed-up", (SPEEDUP,), "speedup")):
            ours, theirs = _by_size(mine, series, y_name), _by_size(paper, series, y_name)
            out.append(f"{label} " + " ".join(num(ours.get(x)) for x in sizes)
                       + (", paper " + " ".join(num(theirs.get(x)) for x in sizes)
                          if theirs else ""))
        if kind == "simulated" and "rel_error_vs_paper" in mine:
            def err(series, y_name=TN.Y_NAME):
                return mine.loc[mine["series"].isin(series) & (mine["y_name"] == y_name),
                                "rel_error_vs_paper"]
            pb = TN.PAPER_BATCH
            out.append(f"|error| mean/max: fitted (ZeRO, paper's batch) {mean_max(err((ZERO + pb,)))}"
                       f"; unfitted: ZeRO {mean_max(err((ZERO,)))}, baseline "
                       f"{mean_max(err((BASE_IN, BASE_OUT)))}, speed-up "
                       f"{mean_max(err((SPEEDUP,), 'speedup'))}")
    up = local[local["y_name"] == "speedup"]
    up = up.assign(_x=pd.to_numeric(up["x_value"], errors="coerce")).sort_values("_x")
    for series, g in up.groupby("series", sort=False):  # one per source (this machine, reference)
        src = str(series).split(" · ", 1)[1].split(":")[0] + ", " if " · " in str(series) else ""
        ranks = pd.to_numeric(g.get("num_gpus"), errors="coerce").max() if "num_gpus" in g else 0
        out.append(f"measured ({src}local{f', {int(ranks)} CPU ranks' if ranks == ranks and ranks else ''})"
                   " speed-up ZeRO/baseline: " + ", ".join(
                       f"{num(y)} at {num(x * 1e3)}M" for x, y in zip(g["_x"], g["y_value"]))
                   + " params")
    return out


def _speedup_panel(ax, table) -> None:
    sp = table[(table["y_name"] == "speedup") & ~table["hardware"].fillna("").str.contains(
        "CPU rank")].copy() if "hardware" in table else table[table["y_name"] == "speedup"]
    sp["series"] = sp["series"].map(lambda s: s.replace(SPEEDUP, "ZeRO / baseline"))
    xs = sorted({float(x) for x in sp["x_value"]})
    sp = sp.assign(x_value=sp["x_value"].astype(float))
    TP.draw_bars(ax, sp, xs, ylabel="speed-up of ZeRO over the baseline [x]",
                 palette=["tab:blue", "tab:cyan", "tab:red"])
    ax.set_xticks(range(len(xs)), [f"{x:g}B" for x in xs])
    ax.set_xlabel(TP.axis_label("model_size_B"))
    zero = table[(table["series"] == ZERO) & (table["y_name"] == TN.Y_NAME)]
    for x in zero.loc[zero.get("fits", pd.Series(True, index=zero.index)).eq(False), "x_value"]:
        ax.annotate("predicted batch:\nZeRO does not fit", (xs.index(float(x)), 0.3),
                    fontsize=6.5, ha="center", va="bottom", rotation=90)
    ax.set_title("Fig 2 speed-up bars (ZeRO / baseline per model size), all unfitted", fontsize=9)
    TP.legend_below(ax)



def plot(table: pd.DataFrame, out_dir: str) -> list[str]:
    """Per-GPU throughput (paper overlaid), the speed-up bars beside the paper's, and the
    local panel; the title gives the fitted and the unfitted errors apart."""
    TS.write_predictions(table, out_dir)
    big, local = TP.split(table)
    per = big[big["y_name"] == TN.Y_NAME]
    n = 2 + bool(len(local))
    fig, axes = TP._pyplot().subplots(1, n, figsize=(7.2 * n, 7.2), squeeze=False)
    ax = axes[0][0]
    TP.draw_lines(ax, per)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.set_ylabel(TP.axis_label(TN.Y_NAME))
    ax.set_xlabel(TP.axis_label("model_size_B"))
    ax.set_title("Fig 2: 400 V100 GPUs, ZeRO-100B vs Megatron-LM (paper scale)\n"
                 + "\n".join(ln.replace("; ", ";\n    ") for ln in error_lines(table)),
                 fontsize=7.5, loc="left")
    TP.legend_below(ax, fontsize=7)
    _speedup_panel(axes[0][1], big)
    if len(local):
        lp = local[local["y_name"] == TN.Y_NAME]
        lp = lp.assign(x_value=[f"{float(x) * 1e3:.3g}M" for x in lp["x_value"]])
        ax = axes[0][2]
        TP.draw_bars(ax, lp, list(dict.fromkeys(lp["x_value"])))
        ax.set_xlabel("model size [million parameters]")
        ax.set_title(TP.local_title(local), fontsize=9)
        TP.legend_below(ax)
    return TP.save(fig, out_dir, "fig2_throughput")
