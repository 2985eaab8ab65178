"""Figure 3: super-linear scalability of ZeRO-100B (60B model, 64-400 V100 GPUs; paper §10.3).
P_os+g's model states shrink as 2Ψ + 14Ψ/N_d, so a larger DP degree buys a larger batch per GPU
(Table 6: 16 -> 48 -> 48 -> 64) and higher arithmetic intensity: per-GPU throughput rises and the
aggregate more than doubles from 64 to 128 GPUs (paper: 2.93x).

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

from zero_repro.lab.throughput import plan as T
from zero_repro.lab.throughput import run as TR
from zero_repro.lab.throughput import setups as TN
from experiments.fig3_scaling import figure as SF
from zero_repro.lab import records as R
from zero_repro.lab.figures import throughput_summary as TS

PARAMS = TN.PARAMS  # the experiment.params keys it reads (cli.check_params)

FIGURE = "fig3"
PAPER_FIGURE = "fig3"
BARS = "ZeRO-100B 60B model, per-GPU throughput"
AGG = "ZeRO-100B 60B model, aggregate throughput"
LINEAR = "perfect linear scaling"
# our series -> the paper's (reference.csv keeps the digitisation notes in its names)
PAPER_NAMES = {BARS: "ZeRO-100B 60B model, Performance/GPU (bars)",
               AGG: "ZeRO-100B 60B model, Observed Performance (green line)",
               LINEAR: "Perfect Linear Scalability (blue line)"}
SERIES_FAMILY: dict = {**PAPER_NAMES, **{k + TN.PAPER_BATCH: v for k, v in PAPER_NAMES.items()}}
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
    return TR.run_point(cfg, point)


def speedup_series(a: int, b: int) -> str:
    return f"aggregate speedup {a}->{b} GPUs (ideal {b / a})"


def _aggregate_and_speedups(rows: list[dict], series: str, agg_series: str, pairs,
                            prefix: str = "", suffix: str = "", y_name: str = TN.AGG_NAME,
                            unit: str = TN.AGG_UNIT) -> list:
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
    for sfx in ("", TN.PAPER_BATCH):
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


def plot(table: pd.DataFrame, out_dir: str) -> list[str]:
    """Figure 3 (``fig3_scaling.figure``): the paper-scale scaling panel with the speed-up table
    and the simulated conclusion, the local panel beside it when there are local points."""
    return SF.plot(table, out_dir, "fig3_scaling", figure=FIGURE, bars=BARS, display=DISPLAY,
                   linear=LINEAR, pairs=PAIRS, at=SENSITIVITY_AT, tokens=TOKENS,
                   tokens_agg=TOKENS_AGG)


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
        per = own[own["y_name"] == TN.Y_NAME].sort_values("x_value",
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
    out += SF.conclusion(table, sim, paper_up, FIGURE, SENSITIVITY_AT)
    meas = table[table["kind"] == "measured"]
    for src, g in meas.groupby(meas["series"].astype(str).map(
            lambda s: s.split(" · ", 1)[1] if " · " in s else "these records"), sort=False):
        ups = g[g["y_name"] == "speedup"]
        text = ", ".join(f"{r.x_value} ranks {float(r.y_value):.2f}x (ideal {ideal(r.x_value)})"
                         for r in ups.itertuples())
        out.append(f"measured, {src}: aggregate tokens/s speed-up {text or '-'}")
    return out
