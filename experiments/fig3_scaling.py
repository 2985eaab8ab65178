"""Figure 3: super-linear scalability of ZeRO-100B (60B model, 64-400 V100 GPUs; paper §10.3).
P_os+g's model states shrink as 2Ψ + 14Ψ/N_d, so a larger DP degree buys a larger batch per GPU
(Table 6: 16 -> 48 -> 48 -> 64) and higher arithmetic intensity: per-GPU throughput rises and the
aggregate more than doubles from 64 to 128 GPUs (paper: 2.93x).

The paper's explanation: P_os+g shrinks model-state memory per GPU as 2Ψ + 14Ψ/N_d, so a
larger DP degree frees memory for a larger batch per GPU (Table 6: 16 -> 48 -> 48 -> 64), which
raises arithmetic intensity; per-GPU throughput rises and the aggregate more than doubles from
64 to 128 GPUs (paper: 2.93x).

* simulated (paper scale): Table 6 setups through the performance model calibrated on Figure 2
  only, in two series: at the batch per GPU the paper2020 memory dry run says fits (the
  largest on the batch grid; C4 or C5, whichever is faster at its own largest batch), and at
  the paper's Table 6 batch ("paper batch"); per-GPU TFLOPs, aggregate = per-GPU x GPUs,
  speed-ups between GPU counts;
* measured (cluster): the same four setups as real points (``cluster=dgx2_v100 launcher=slurm``);
* measured (local): ``experiment.params.local_model`` at P_os+g (C3, TP 1) on world sizes
  ``local_worlds`` (1 and 2 ranks), each at the largest batch per rank whose memory dry run
  fits the budget world 1 needs at ``local_base_batch`` (``throughput.local_batch``); per-rank
  tokens/s, median of ``local_repeats`` measurements (range drawn).
"""
from __future__ import annotations

import pandas as pd

from zero_repro.lab.figures import throughput as T

from zero_repro.lab.figures.figures import plt, save_figure
from zero_repro.lab.figures import scaling_panel as SP
from zero_repro.lab.figures import throughput_plots as TP
from zero_repro.lab import records as R
from zero_repro.lab.figures import throughput_summary as TS

PARAMS = T.PARAMS  # the experiment.params keys it reads (cli.check_params)

FIGURE = "fig3"
PAPER_FIGURE = "fig3"
BARS = "ZeRO-100B 60B model, per-GPU throughput"
AGG = "ZeRO-100B 60B model, aggregate throughput"
LINEAR = "perfect linear scaling"
# our series -> the paper's (reference.csv keeps the digitisation notes in its names)
PAPER_NAMES = {BARS: "ZeRO-100B 60B model, Performance/GPU (bars)",
               AGG: "ZeRO-100B 60B model, Observed Performance (green line)",
               LINEAR: "Perfect Linear Scalability (blue line)"}
SERIES_FAMILY: dict = {**PAPER_NAMES, **{k + T.PAPER_BATCH: v for k, v in PAPER_NAMES.items()}}
# summarize() shows the newest record of every point (lab.figures.regenerate): a re-run at another
# device capacity (new point keys) replaces the figure's values; older records stay as history
NEWEST_ONLY = True
DISPLAY = {v: k for k, v in PAPER_NAMES.items()}  # the paper's rows drawn under plain names
PAIRS = [(64, 128), (128, 256), (256, 400), (64, 400)]
# the batches above Table 6's 16 at 64 GPUs that must not fit for 16 to be the largest: the
# next on the search's grid (maxsize.BATCH_GRID) and the next of the paper harness's own 4-node
# sweep (DSE@405ce794 Megatron-LM/scripts/hyperscale/config7_4node.dat: 2, 4, 8, 16, 32)
SENSITIVITY_AT, SENSITIVITY_BATCHES = 64, (24, 32)
GIB = 2**30
TOKENS = "tokens_per_s_per_rank"
TOKENS_AGG = "tokens_per_s"


def _local(cfg, p: dict) -> list:
    model = p.get("local_model", "small")
    return [T.local_point(FIGURE, f"local {model} C3 w{w}", model, int(w), 1, "C3", p)
            for w in p.get("local_worlds", [1, 2])]


def plan(cfg) -> list:
    return T.plan_points(cfg, FIGURE, _local)


def run_point(cfg, point) -> dict:
    return T.run_point(cfg, point)


def speedup_series(a: int, b: int) -> str:
    return f"aggregate speedup {a}->{b} GPUs (ideal {b / a})"


def _aggregate_and_speedups(rows: list[dict], series: str, agg_series: str, pairs,
                            prefix: str = "", suffix: str = "", y_name: str = T.AGG_NAME,
                            unit: str = T.AGG_UNIT) -> list:
    out = []
    for kind in dict.fromkeys(r["kind"] for r in rows):
        mine = {r["x_value"]: r for r in rows if r["kind"] == kind and r["series"] == series}
        for x, r in mine.items():
            out.append({**r, "series": agg_series, "y_name": y_name,
                        "y_value": r["y_value"] * x, "unit": unit,
                        **({"y_min": r["y_min"] * x, "y_max": r["y_max"] * x}
                           if "y_min" in r else {})})
        for a, b in pairs:
            if a in mine and b in mine and mine[a]["y_value"] > 0:
                out.append({**mine[b], "series": prefix + speedup_series(a, b) + suffix,
                            "x_value": f"{a}->{b}", "y_name": "speedup", "unit": "x",
                            "y_value": mine[b]["y_value"] * b / (mine[a]["y_value"] * a)})
    return out


def summarize(records) -> list[dict]:
    records = R.newest_ok(records)
    rows = TS.paper_scale_rows(records, FIGURE, lambda s: BARS, lambda s: s.gpus)
    for sfx in ("", T.PAPER_BATCH):
        rows += _aggregate_and_speedups([r for r in rows if r["series"] == BARS + sfx],
                                        BARS + sfx, AGG + sfx, PAIRS, suffix=sfx)
    local = []
    for r in TS.ok_records(records, "measured_local"):
        q = r.params
        series = f"local {q['model']}: P_os+g (C3), TP 1"
        per_rank = r.metrics["tokens_per_s"] / q["world_size"]
        local.append(TS.base_row(r, FIGURE, series, q["world_size"], per_rank, TOKENS,
                                 "tokens/s per rank"))
    local = TS.repeated(local)
    worlds = sorted({r["x_value"] for r in local})
    pairs = [(a, b) for a, b in zip(worlds, worlds[1:])]
    for model in dict.fromkeys(r["series"] for r in local):
        mine = [r for r in local if r["series"] == model]
        local += _aggregate_and_speedups(mine, model, f"{model} aggregate", pairs, "local ",
                                         y_name=TOKENS_AGG, unit="tokens/s")
    return rows + local + sensitivity_rows(records)


def sensitivity_rows(records) -> list[dict]:
    """Bytes per GPU that would have to be missing from the allocator's share for Table 6's
    batch at ``SENSITIVITY_AT`` GPUs to be the largest that fits: per configuration the
    predicted-batch search judged and per batch of ``SENSITIVITY_BATCHES`` it judged, the
    judged capacity less the capacity that batch needs (<= 0: it does not fit already)."""
    rows = []
    for r in TS.ok_records(records, "simulated"):
        q, m = r.params, r.metrics
        if q.get("setup") != f"{SENSITIVITY_AT} GPUs" or not m.get("alternatives"):
            continue
        for zc, alt in m["alternatives"].items():
            srch = alt.get("search") or {}
            cap = srch.get("capacity")
            needs = {j["batch"]: j["min_capacity"] for j in srch.get("judgements", [])}
            for b in SENSITIVITY_BATCHES:
                if cap is None or b not in needs:
                    continue
                rows.append({"figure": f"{FIGURE}_sensitivity",
                             "series": f"{SENSITIVITY_AT} GPUs, {zc}: bytes missing for batch "
                                       f"{b} not to fit", "x_name": "batch_per_gpu",
                             "x_value": b, "y_name": "missing_bytes",
                             "y_value": round((cap - needs[b]) / GIB, 3), "unit": "GiB",
                             "kind": "simulated", "zero_config": zc,
                             "predicted_batch": alt.get("batch"),
                             "capacity_GiB": round(cap / GIB, 3),
                             "needs_GiB": round(needs[b] / GIB, 3)})
    return rows


def _speedup_text(table) -> str:
    sp = table[table["y_name"] == "speedup"]
    lines = ["aggregate speed-up  paper  | predicted batch | paper batch"]
    for a, b in PAIRS:
        x = f"{a}->{b}"
        got = {}
        for _, r in sp[sp["x_value"].astype(str) == x].iterrows():
            key = "paper" if r["kind"] == "paper" else (
                "pb" if str(r["series"]).endswith(T.PAPER_BATCH) else "mf")
            got[key] = float(r["y_value"])
        f = lambda k: f"{got[k]:.2f}x" if k in got else "  -  "  # noqa: E731
        lines.append(f"{x:>8} (ideal {b / a:.2f}x): {f('paper')} | {f('mf')} | {f('pb')}")
    return "\n".join(lines)


def plot(table: pd.DataFrame, out_dir: str) -> list[str]:
    TS.write_predictions(table, out_dir)
    big, local = TP.split(table)
    sp = big[big["y_name"] == "speedup"]
    big = big[big["y_name"].isin([T.Y_NAME, T.AGG_NAME])].copy()
    big["series"] = big["series"].map(lambda s: DISPLAY.get(s, s))
    n = 1 + bool(len(local))
    fig, axes = plt.subplots(1, n, figsize=(7.8 * n, 8.6), squeeze=False)
    ax = axes[0][0]
    per = big[(big["y_name"] == T.Y_NAME) & (big["kind"] != "paper")]
    err = pd.to_numeric(per.get("rel_error_vs_paper"), errors="coerce").abs()
    title = "Fig 3: 60B model, 64-400 V100 GPUs (paper scale; simulated = predicted)"
    for sfx, name in (("", "predicted batch"), (T.PAPER_BATCH, "paper batch")):
        e = err[per["series"] == BARS + sfx]
        if e.notna().any():
            title += f"\nper-GPU vs paper, {name}: mean |err| {100 * e.mean():.0f}%, max " \
                     f"{100 * e.max():.0f}%"
    SP.panel(ax, big, title, TP.axis_label("num_gpus"), T.Y_NAME, T.AGG_NAME,
           TP.axis_label(T.Y_NAME), TP.axis_label(T.AGG_NAME), linear=LINEAR)
    bs = per[per["series"] == BARS][["x_value", "batch_per_gpu", "zero_config"]]
    note = ", ".join(f"{int(x)}: b{int(b)} {c}" for x, b, c in bs.itertuples(index=False))
    fig.text(0.01, 0.01, _speedup_text(pd.concat([sp, table[(table["kind"] == "paper") & (
        table["y_name"] == "speedup")]])) + ("\npredicted batch/GPU (memory dry run, "
                                              "paper2020): " + note if note else ""),
            va="bottom", ha="left", fontsize=7.5, family="monospace",
            bbox=dict(facecolor="white", edgecolor="0.7"))  # under the legend, off the data
    if len(local):
        lt = local[local["y_name"] == TOKENS]
        bl = ", ".join(f"{int(x)} rank(s): batch {int(b)}" for x, b in
                       lt[["x_value", "batch_per_gpu"]].drop_duplicates().itertuples(index=False))
        SP.panel(axes[0][1], local, TP.local_title(local) + f"\nbatch per rank: {bl} (largest "
               "that fits one per-rank budget, memory dry run)",
               "number of CPU ranks (DP degree)", TOKENS, TOKENS_AGG,
               "tokens/s per rank", "aggregate tokens/s", unit="rank", linear=LINEAR)
    sim = table[table["kind"] == "simulated"]
    paper_up = {str(r.x_value): float(r.y_value) for r in table[
        (table["kind"] == "paper") & (table["y_name"] == "speedup")].itertuples()}
    said = _conclusion(table, sim, paper_up)
    if said:  # the figure states its conclusion (simulated), right of the speed-up table
        fig.text(0.99, 0.01, "simulated:\n" + "\n".join(said), va="bottom", ha="right",
                 fontsize=7.2, bbox=dict(facecolor="lightyellow", edgecolor="0.7"))
    fig.tight_layout(rect=(0, 0.13, 1, 1))  # the bottom strip: the speed-up table
    return save_figure(fig, out_dir, "fig3_scaling", dpi=130)


def _conclusion(table, sim, paper_up: dict) -> list[str]:
    """Whether the super-linear 64->128 step emerges from memory, and the sensitivity line."""
    per = sim[(sim["y_name"] == T.Y_NAME)
              & ~sim["series"].astype(str).str.contains("(paper batch)", regex=False)]
    b64 = per[per["x_value"].astype(float) == SENSITIVITY_AT]
    sp = sim[sim["y_name"] == "speedup"]
    step = "64->128"

    def up(tag: bool):
        g = sp[(sp["x_value"].astype(str) == step) & (sp["series"].astype(str).str.contains(
            "(paper batch)", regex=False) == tag)]
        return float(g["y_value"].iloc[0]) if len(g) else float("nan")

    out = []
    if len(b64) and "batch_per_gpu" in b64:
        b = int(float(b64["batch_per_gpu"].iloc[0]))
        pred, at_paper = up(False), up(True)
        cap = "does not cap" if b > 16 else "caps"
        out.append(f"conclusion: memory {cap} the 64-GPU batch at Table 6's 16 (the dry run "
                   f"fits {b})")
        out.append(f"conclusion: {step} is {pred:.2f}x at the predicted batches, "
                   f"{at_paper:.2f}x at Table 6's (paper {paper_up.get(step, float('nan')):.2f}x)")
    sen = table[table["figure"] == f"{FIGURE}_sensitivity"]
    for zc, g in sen.groupby("zero_config", sort=False):
        parts = [f"b{int(float(r.x_value))} {float(r.y_value):.2f} (needs "
                 f"{float(r.needs_GiB):.2f}/{float(r.capacity_GiB):.2f})"
                 for r in g.itertuples()]
        out.append(f"sensitivity, {zc}, GiB/GPU missing for 16 to be the largest: "
                   + ", ".join(parts))
    return out


def conclude(table: pd.DataFrame) -> list[str]:
    """The figure in words: per simulated series (predicted batch, paper batch) the per-GPU
    TFLOPs against the paper's and the aggregate speed-ups against the paper's and the ideal
    (b/a); each measured set's speed-ups (this machine apart from the reference set)."""
    def ideal(pair: str) -> str:
        a, b = (int(v) for v in str(pair).split("->"))
        return f"{b / a:g}"

    out = []
    sim = table[table["kind"] == "simulated"]
    paper = table[table["kind"] == "paper"]
    paper_up = {str(r.x_value): float(r.y_value) for r in paper[paper["y_name"] == "speedup"]
                .itertuples()}
    for label, tag in (("predicted batch", False), ("paper batch", True)):
        own = sim[sim["series"].astype(str).str.contains("(paper batch)", regex=False) == tag]
        per = own[own["y_name"] == T.Y_NAME].sort_values("x_value",
                                                          key=lambda s: s.astype(float))
        if len(per):
            err = per["rel_error_vs_paper"].astype(float).abs().dropna()
            out.append(f"simulated, {label}: TFLOPs/GPU "
                       + " ".join(f"{float(r.y_value):.1f}" for r in per.itertuples())
                       + f" at {' '.join(str(int(float(x))) for x in per['x_value'])} GPUs"
                       + ("; paper " + " ".join(f"{float(v):.2f}" for v in per["paper_value"])
                          if not tag else "")
                       + (f" (|error| median {100 * err.median():.0f}%, largest "
                          f"{100 * err.max():.0f}%)" if len(err) else ""))
        sp = own[own["y_name"] == "speedup"]
        if len(sp):
            out.append(f"aggregate speed-up, {label} / paper (ideal): " + ", ".join(
                f"{r.x_value} {float(r.y_value):.2f}x / "
                f"{paper_up.get(str(r.x_value), float('nan')):.2f}x ({ideal(r.x_value)})"
                for r in sp.itertuples()))
    out += _conclusion(table, sim, paper_up)
    meas = table[table["kind"] == "measured"]
    for src, g in meas.groupby(meas["series"].astype(str).map(
            lambda s: s.split(" · ", 1)[1] if " · " in s else "these records"), sort=False):
        ups = g[g["y_name"] == "speedup"]
        text = ", ".join(f"{r.x_value} ranks {float(r.y_value):.2f}x (ideal {ideal(r.x_value)})"
                         for r in ups.itertuples())
        out.append(f"measured, {src}: aggregate tokens/s speed-up {text or '-'}")
    return out
