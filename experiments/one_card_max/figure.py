"""The one-GPU table as a picture (``experiments.one_card_max``): largest parameters per GPU kind,
one bar per offload mode on a log scale, hatched where the host's memory binds rather than the
device's, open where the depth is extrapolated rather than judged, the papers' claims as black
markers. Reads the experiment's table only.
"""
from __future__ import annotations

from zero_repro.lab.figures.figures import save_figure

COLOUR = {"none": "C0", "cpu": "C1", "param": "C2", "cpu+param": "C3"}
LABEL = {"none": "no offload (stage 0)", "cpu": "optimizer + gradients on host (stage 2)",
         "param": "parameters on host (stage 3)", "cpu+param": "all on host (stage 3)"}


def plot(table, out_dir: str, figure: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    t = table[table["figure"] == figure]
    clusters = list(dict.fromkeys(t["x_value"]))
    modes = [m for m in COLOUR if f"offload {m}" in set(t["series"])]
    w = 0.8 / max(1, len(modes))
    fig, ax = plt.subplots(figsize=(10, 6.6))
    for k, mode in enumerate(modes):
        g = t[t["series"] == f"offload {mode}"]
        for r in g.itertuples():
            x = clusters.index(r.x_value) + (k - (len(modes) - 1) / 2) * w
            ext = r.method == "extrapolated"
            ax.bar(x, r.y_value, w * 0.92, color="white" if ext else COLOUR[mode],
                   edgecolor=COLOUR[mode], hatch="//" if r.binds == "host" else None,
                   linewidth=1.2)
            ax.annotate(f"{r.y_value:.3g}", (x, r.y_value), ha="center", va="bottom",
                        fontsize=7)
            claim = str(getattr(r, "paper_claim_B", ""))
            if claim not in ("", "nan"):
                ax.plot(x, float(claim), "k_", markersize=16, markeredgewidth=2.5)
    ax.set_yscale("log")
    first = t.drop_duplicates("x_value").set_index("x_value")
    ax.set_xticks(range(len(clusters)), [
        f"{c}\n{first.loc[c, 'device_GB']:g} GB device\n{first.loc[c, 'host_GB']:g} GB host"
        for c in clusters])
    ax.set(xlabel="one GPU of the cluster, with its whole node's host memory",
           ylabel="largest model [billion parameters]",
           title="Largest GPT-2-shaped model one GPU trains (simulated: dry run + allocator "
                 "replay,\nmicro-batch 1, full checkpointing); papers' claims as black bars")
    handles = [Patch(color=COLOUR[m], label=LABEL[m]) for m in modes] + [
        Patch(facecolor="white", edgecolor="grey", hatch="//", label="host memory binds"),
        Patch(facecolor="white", edgecolor="grey", label="open: extrapolated depth"),
        Line2D([], [], color="k", marker="_", linestyle="", markersize=14,
               markeredgewidth=2.5, label="paper's claim")]
    ax.legend(handles=handles, fontsize=8, loc="upper center", ncol=3,
              bbox_to_anchor=(0.5, -0.22))
    ax.grid(axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    return save_figure(fig, out_dir, figure, dpi=150)
