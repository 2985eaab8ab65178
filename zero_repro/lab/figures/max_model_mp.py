"""Table 2 as a figure (``experiments/table2_max_model.py``; paper §5 Table 2: the largest model
per ZeRO-DP stage vs the model-parallel degree on 32 GB V100s, N_d = 64): theoretical sizes,
dry-run judged ones per stack with the bracket of the 2020 stack's open choices, the paper's
printed values. Reads the experiment's table and the paper's values only.
"""
from __future__ import annotations

from zero_repro.lab.figures.figures import save_figure


def plot(table, out_dir: str, paper: dict, schemes: dict, measured: dict, note: str
         ) -> list[str]:
    """Table 2 as a figure: max model size (B parameters, log scale) vs MP, one colour per
    scheme; theoretical (analytic, dotted), dry-run judged (simulated, squares) and the
    paper's printed values (X) -- both its theoretical and its measured columns. ``paper``:
    (series, MP) -> (printed, value); ``schemes``: stage -> the series' scheme name;
    ``measured``: stage -> the series name of its dry-run rows; ``note``: the caption."""

    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.4, 6.4))
    colour = {name: f"C{i}" for i, name in enumerate(schemes.values())}
    for stage, name in schemes.items():
        c = colour[name]
        th = table[table["series"] == f"theoretical {name}"].sort_values("x_value")
        if len(th):
            ax.plot(th["x_value"].astype(int), th["y_value"].astype(float), ls=":", marker="^",
                    ms=4, color=c, label=f"{name}: theoretical [analytic]")
        pts = sorted((mp, v / 1e9) for (s, mp), (_, v) in paper.items()
                     if s == f"theoretical {name}")
        if pts:
            ax.plot(*zip(*pts), ls="none", marker="X", ms=8, mfc="none", color=c)
        if stage in measured:
            for stack, ls, mk in (("paper2020", "-", "D"), ("modern", "--", "s")):
                ms = table[table["series"] == f"{measured[stage]} [dry run, {stack}]"]
                ms = ms.sort_values("x_value")
                if len(ms):
                    ax.plot(ms["x_value"].astype(int), ms["y_value"].astype(float), ls=ls,
                            marker=mk, ms=8, color=c, mec="white", zorder=6, alpha=0.85,
                            label=f"{name}: dry run, {stack} stack [simulated]")
                    if "B_outside_high" in ms and ms["B_outside_high"].notna().any():
                        for _, q in ms.iterrows():  # the outside-allocator bracket's two ends
                            lo_b, hi_b = sorted((float(q["B_outside_high"]),
                                                 float(q["B_outside_low"])))
                            ax.plot([int(q["x_value"])] * 2, [lo_b, hi_b], color=c, lw=2.2,
                                    alpha=0.6, zorder=5)
                            # a few percent: narrower than the marker on a log axis, so written
                            below = stage != 0  # the baseline's own lines run just below it
                            ax.annotate(f"{lo_b:.3g}..{hi_b:.3g}",
                                        (int(q["x_value"]), lo_b if below else hi_b),
                                        xytext=(0, -9) if below else (-7, 5),
                                        textcoords="offset points",
                                        ha="center" if below else "right",
                                        va="top" if below else "bottom", fontsize=5.8,
                                        color=c)
            pm = sorted((mp, v / 1e9) for (s, mp), (_, v) in paper.items()
                        if s == measured[stage])
            if pm:
                ax.plot(*zip(*pm), ls="-", lw=0.8, marker="X", ms=7, color=c, zorder=4,
                        markeredgecolor="black", label=f"{name}: measured [paper]")
    ax.plot([], [], ls="none", marker="X", ms=8, mfc="none", color="0.3",
            label="theoretical [paper, printed]")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks([1, 2, 4, 8, 16], ["1 (64)", "2 (128)", "4 (256)", "8 (512)", "16 (1024)"])
    ax.set_xlabel("MP (GPUs), N_d = 64")
    ax.set_ylabel("Max model size (B parameters)")
    ax.set_title("Table 2: max model size on 32 GB V100s (N_d = 64)", fontsize=10)
    fig.text(0.5, 0.005, "\n".join(textwrap.wrap(note, 160)), ha="center", va="bottom",
             fontsize=6.3)
    ax.grid(True, which="both", alpha=0.25)
    # below the axes: inside, it covered the Pos+g+p points at MP 1-4
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2,
              frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    paths = save_figure(fig, out_dir, 'table2_max_model', dpi=150)
    return paths
