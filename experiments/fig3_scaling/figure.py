"""Figure 3 as drawn (``experiments/fig3_scaling/``; paper §10.3: super-linear scalability of
ZeRO-100B, a 60B model on 64-400 V100 GPUs): the paper-scale scaling panel (per-GPU TFLOPs as
bars, the aggregate as lines, perfect linear scaling; ``fig3_scaling.panel``), under it
the aggregate speed-ups against the paper's and the ideal b/a (``speedup_text``) and what the
simulation concludes (``conclusion``: whether memory caps the 64-GPU batch at Table 6's 16, the
64->128 step, the bytes that would have to be missing for 16 to be the largest); the local
panel beside it. Reads the experiment's table only.
"""
from __future__ import annotations

import pandas as pd

from experiments.fig3_scaling import panel as SP
from zero_repro.lab.throughput import setups as T
from zero_repro.lab.figures import throughput_plots as TP
from zero_repro.lab.figures import throughput_summary as TS
from zero_repro.lab.figures.figures import plt, save_figure


def speedup_text(table, pairs) -> str:
    """The speed-up table of the bottom strip: per GPU-count pair (a, b) of ``pairs`` the
    aggregate speed-up of the paper, at the predicted batch and at the paper's batch, beside
    the ideal b/a."""
    sp = table[table["y_name"] == "speedup"]
    lines = ["aggregate speed-up  paper  | predicted batch | paper batch"]
    for a, b in pairs:
        x = f"{a}->{b}"
        got = {}
        for _, r in sp[sp["x_value"].astype(str) == x].iterrows():
            key = "paper" if r["kind"] == "paper" else (
                "pb" if str(r["series"]).endswith(T.PAPER_BATCH) else "mf")
            got[key] = float(r["y_value"])
        f = lambda k: f"{got[k]:.2f}x" if k in got else "  -  "  # noqa: E731
        lines.append(f"{x:>8} (ideal {b / a:.2f}x): {f('paper')} | {f('mf')} | {f('pb')}")
    return "\n".join(lines)


def plot(table: pd.DataFrame, out_dir: str, file_name: str, *, figure: str, bars: str,
         display: dict, linear: str, pairs, at: int, tokens: str, tokens_agg: str
         ) -> list[str]:
    """Figure 3 as ``out_dir/file_name``.png and .pdf (the predictions' inputs written beside it):
    the paper-scale panel, per-GPU ``bars`` and the aggregate, the paper's series under
    ``display``'s plain names and its ``linear`` line dotted; the bottom strip: the speed-up
    table (``speedup_text`` over ``pairs``) and what the simulation concludes (``conclusion``);
    the local panel (``tokens`` per rank, ``tokens_agg``) beside it when the table has local
    rows."""
    TS.write_predictions(table, out_dir)
    big, local = TP.split(table)
    sp = big[big["y_name"] == "speedup"]
    big = big[big["y_name"].isin([T.Y_NAME, T.AGG_NAME])].copy()
    big["series"] = big["series"].map(lambda s: display.get(s, s))
    n = 1 + bool(len(local))
    fig, axes = plt.subplots(1, n, figsize=(7.8 * n, 8.6), squeeze=False)
    ax = axes[0][0]
    per = big[(big["y_name"] == T.Y_NAME) & (big["kind"] != "paper")]
    err = pd.to_numeric(per.get("rel_error_vs_paper"), errors="coerce").abs()
    title = "Fig 3: 60B model, 64-400 V100 GPUs (paper scale; simulated = predicted)"
    for sfx, name in (("", "predicted batch"), (T.PAPER_BATCH, "paper batch")):
        e = err[per["series"] == bars + sfx]
        if e.notna().any():
            title += f"\nper-GPU vs paper, {name}: mean |err| {100 * e.mean():.0f}%, max " \
                     f"{100 * e.max():.0f}%"
    SP.panel(ax, big, title, TP.axis_label("num_gpus"), T.Y_NAME, T.AGG_NAME,
           TP.axis_label(T.Y_NAME), TP.axis_label(T.AGG_NAME), linear=linear)
    bs = per[per["series"] == bars][["x_value", "batch_per_gpu", "zero_config"]]
    note = ", ".join(f"{int(x)}: b{int(b)} {c}" for x, b, c in bs.itertuples(index=False))
    fig.text(0.01, 0.01, speedup_text(pd.concat([sp, table[(table["kind"] == "paper") & (
        table["y_name"] == "speedup")]]), pairs) + ("\npredicted batch/GPU (memory dry run, "
                                              "paper2020): " + note if note else ""),
            va="bottom", ha="left", fontsize=7.5, family="monospace",
            bbox=dict(facecolor="white", edgecolor="0.7"))  # under the legend, off the data
    if len(local):
        lt = local[local["y_name"] == tokens]
        bl = ", ".join(f"{int(x)} rank(s): batch {int(b)}" for x, b in
                       lt[["x_value", "batch_per_gpu"]].drop_duplicates().itertuples(index=False))
        SP.panel(axes[0][1], local, TP.local_title(local) + f"\nbatch per rank: {bl} (largest "
               "that fits one per-rank budget, memory dry run)",
               "number of CPU ranks (DP degree)", tokens, tokens_agg,
               "tokens/s per rank", "aggregate tokens/s", unit="rank", linear=linear)
    sim = table[table["kind"] == "simulated"]
    paper_up = {str(r.x_value): float(r.y_value) for r in table[
        (table["kind"] == "paper") & (table["y_name"] == "speedup")].itertuples()}
    said = conclusion(table, sim, paper_up, figure, at)
    if said:  # the figure states its conclusion (simulated), right of the speed-up table
        fig.text(0.99, 0.01, "simulated:\n" + "\n".join(said), va="bottom", ha="right",
                 fontsize=7.2, bbox=dict(facecolor="lightyellow", edgecolor="0.7"))
    fig.tight_layout(rect=(0, 0.13, 1, 1))  # the bottom strip: the speed-up table
    return save_figure(fig, out_dir, file_name, dpi=130)


def conclusion(table, sim, paper_up: dict, figure: str, at: int) -> list[str]:
    """Whether the super-linear 64->128 step emerges from memory (the batch the dry run fits
    at ``at`` GPUs against Table 6's 16; the step's speed-up at the predicted and at the paper's
    batches against the paper's, ``paper_up``), and the sensitivity lines (``figure``'s
    ``_sensitivity`` rows)."""
    per = sim[(sim["y_name"] == T.Y_NAME)
              & ~sim["series"].astype(str).str.contains("(paper batch)", regex=False)]
    b64 = per[per["x_value"].astype(float) == at]
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
    sen = table[table["figure"] == f"{figure}_sensitivity"]
    for zc, g in sen.groupby("zero_config", sort=False):
        parts = [f"b{int(float(r.x_value))} {float(r.y_value):.2f} (needs "
                 f"{float(r.needs_GiB):.2f}/{float(r.capacity_GiB):.2f})"
                 for r in g.itertuples()]
        out.append(f"sensitivity, {zc}, GiB/GPU missing for 16 to be the largest: "
                   + ", ".join(parts))
    return out
