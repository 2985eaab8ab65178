"""The memory breakdown figure (``experiments/memory_breakdown/``; paper §3, §5-§6: where a
GPU's memory goes): per setup x stack the bytes at the peak of cached memory by category, the
bytes outside the caching allocator on top, the device as it reports itself; what each 2020
mechanism adds; each ``paper2020`` switch's cost alone; and the same in words (``conclude``).
Reads the experiment's table only.
"""
from __future__ import annotations

from zero_repro.lab.figures.figures import save_figure
from zero_repro.lab.figures.wording import column, num
from zero_repro.scale.dryrun.stack import switches as S


def _plot_mechanisms(mx, table, figure: str, mechanism_at) -> None:
    """Middle panel: what each Fidelity III mechanism adds (needed capacity: solid; max cached:
    hatched) at each setup of ``mechanism_at``."""
    mt = table[table["figure"] == f"{figure}_mechanisms"]
    names = list(dict.fromkeys(mt["x_value"])) if len(mt) else []
    if not names:
        mx.set_axis_off()
        return
    width = 0.8 / (2 * len(mechanism_at))
    k = 0
    for j, label in enumerate(mechanism_at):
        for y, hatch in (("needs_change", None), ("max_cached_change", "///")):
            d = mt[(mt["setup"] == label) & (mt["y_name"] == y)].set_index("x_value")
            vals = [float(d["y_value"].get(n, 0.0)) for n in names]
            pos = [i + (k - (2 * len(mechanism_at) - 1) / 2) * width for i in range(len(names))]
            mx.barh(pos, vals, width, color=f"C{j + 2}", hatch=hatch, edgecolor="white",
                    label=f"{label}: " + ("capacity needed" if y == "needs_change"
                                          else "max cached"))
            for p_, v in zip(pos, vals):
                mx.annotate(f"{v:+.2f}", (max(v, 0.0), p_), va="center", fontsize=6,
                            xytext=(3, 0), textcoords="offset points")
            k += 1
    lo, hi = mx.get_xlim()
    mx.set_xlim(lo, hi + 0.12 * (hi - lo))  # room for the labels
    mx.set_yticks(range(len(names)), [n.replace(" (vs", "\n(vs") for n in names], fontsize=7)
    mx.invert_yaxis()
    mx.axvline(0, color="0.3", lw=0.8)
    mx.set_xlabel("paper2020 with the mechanism minus without (GiB)")
    mx.set_title("What each 2020 mechanism adds (simulated)\n40B C1 = Table 8, 60B on 64 GPUs "
                 "b16 C5 = Table 6", fontsize=9)
    mx.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=1,
              frameon=False)
    mx.grid(True, axis="x", alpha=0.3)


def plot(table, out_dir: str, figure: str, rows, mechanism_at, device_gib: float) -> list[str]:
    """Stacked bars: per setup x stack, the bytes at the peak of cached memory by category
    (GiB; stream_held: blocks held for a collective's stream), the CUDA context + NCCL outside
    the allocator hatched on top, the V100's 32 GB as a line; middle panel: what each Fidelity
    III mechanism adds at Table 8's and Table 6's setups; right panel: each paper2020 switch's
    change of max cached at 40B C4 (alone vs modern, in context vs paper2020)."""

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = table[table["figure"] == figure]
    series = list(dict.fromkeys(t["series"]))
    fig, (ax, mx, bx) = plt.subplots(1, 3, figsize=(21, 7.2),
                                     gridspec_kw={"width_ratios": [1.25, 1, 1.1]})
    _plot_mechanisms(mx, table, figure, mechanism_at)
    cats = [c for c in rows if (t[t["x_value"] == c]["y_value"] > 0).any()]
    cmap = plt.get_cmap("tab20")
    for i, s in enumerate(series):
        d = t[t["series"] == s].set_index("x_value")["y_value"]
        bottom = 0.0
        for k, c in enumerate(cats):
            v = float(d.get(c, 0.0))
            ax.bar(i, v, 0.6, bottom=bottom, color=cmap(k), label=c if i == 0 else None,
                   edgecolor="white", lw=0.4)
            bottom += v
        out = float(d.get(S.OUTSIDE, 0.0))
        more = float(d.get(f"{S.OUTSIDE} (to high end)", 0.0))
        if out:
            ax.bar(i, out, 0.6, bottom=bottom, color="white", edgecolor="0.3", hatch="xx",
                   label="outside allocator, bracket low end (CUDA context + NCCL)")
        if more:
            ax.bar(i, more, 0.6, bottom=bottom + out, color="white", edgecolor="0.65",
                   hatch="..", label="outside allocator, up to the bracket's high end")
        out += more
        # the cached total (GiB) above the bar and its hatched box, on a white box so that
        # the capacity line behind it does not run through the digits
        ax.annotate(f"{bottom:.1f}", (i, bottom + out), ha="center", va="bottom", fontsize=8,
                    xytext=(0, 3), textcoords="offset points",
                    bbox={"boxstyle": "square,pad=0.15", "fc": "white", "ec": "none"})
    ax.axhline(device_gib, color="0.4", ls="--", lw=1,
               label=f"V100-32GB as it reports itself: {device_gib:.2f} GiB")
    ax.set_xticks(range(len(series)), [s.replace(", ", "\n").replace(" 64GPUs", "\n64 GPUs")
                                       for s in series], fontsize=7.5)
    ax.set_ylabel("Bytes per GPU at the peak of cached memory (GiB = 2^30 B)")
    ax.set_title("Where did the memory go (400 V100, MP 16; simulated)", fontsize=9.5)
    handles, labels = ax.get_legend_handles_labels()
    seen = dict(zip(labels, handles))
    ax.legend(seen.values(), seen.keys(), fontsize=7, loc="upper center",
              bbox_to_anchor=(0.5, -0.12), ncol=2, frameon=False)
    ax.set_ylim(0, 36)
    sw = table[table["figure"] == f"{figure}_switches"]
    names = list(dict.fromkeys(sw["x_value"]))
    # only the comparisons this run computed ("in context" is an optional second series)
    hows = [h for h in ("alone", "in_context") if "how" in sw and (sw["how"] == h).any()]
    width = 0.76 / max(len(hows), 1)
    for k, how in enumerate(hows):
        col = {"alone": "C0", "in_context": "C3"}[how]
        d = sw[sw["how"] == how].set_index("x_value")["y_value"]
        ys = [float(d.get(n, 0.0)) for n in names]
        pos = [j + (k - (len(hows) - 1) / 2) * width for j in range(len(names))]
        bx.barh(pos, ys, width, color=col,
                label={"alone": "alone: modern + this switch, minus modern",
                       "in_context": "in context: paper2020 minus (paper2020 without it)"}[how])
        for y, v in zip(pos, ys):
            if abs(v) >= 0.005:
                bx.annotate(f"{v:+.2f}", (max(v, 0.0), y), va="center", fontsize=6.5,
                            xytext=(3, 0), textcoords="offset points")
    if "capacity_change_GiB" in sw:
        for j, n in enumerate(names):
            cap = sw[(sw["x_value"] == n)]["capacity_change_GiB"].min()
            if cap == cap and cap:
                bx.annotate(f"usable capacity {cap:+.2f} GiB at the bracket's low end", (0, j),
                            fontsize=6.5, va="center", xytext=(4, 0),
                            textcoords="offset points", color="C3")
    lo, hi = bx.get_xlim()
    bx.set_xlim(lo, hi + 0.08 * (hi - lo))  # room for the value labels
    bx.set_yticks(range(len(names)), names, fontsize=7)
    bx.invert_yaxis()
    bx.axvline(0, color="0.3", lw=0.8)
    bx.set_xlabel("Change of max cached memory at 40B C4 (GiB)")
    bx.set_title("Cost of each paper2020 switch at 40B C4\n(outside_allocator: capacity, not cache)",
                 fontsize=9)
    bx.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=1,
              frameon=False)
    bx.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    return save_figure(fig, out_dir, figure, dpi=150)


PEAK = "peak_reserved (max cached)"


def conclude(table, figure: str, mechanism_at, short: dict, most: int = 4) -> list[str]:
    """The table in words (``experiments/memory_breakdown/``'s result lines): the bytes
    outside the allocator per stack (the bracket's low .. high end); at the paper's own runs
    (``mechanism_at``: Table 8's 40B C1, Table 6's 60B on 64 GPUs) per stack the max cached
    memory and the ``most`` largest categories that hold it (the rest summed); the two 2020
    mechanisms that move the needed capacity most at each (named as ``short`` shortens them);
    and the ``paper2020`` switches that cost the most alone. The other setups are in the
    table. Rows: ``figure``'s, ``figure``_mechanisms' and ``figure``_switches'."""
    t = table[(table["figure"] == figure) & (table["y_name"] == "bytes_at_peak")]
    out = []
    if len(t):
        outside = {}
        for series, g in t.groupby("series", sort=False):
            stack = str(series).rpartition(", ")[2]
            lo = column(g[g["x_value"] == S.OUTSIDE], "y_value").sum()
            hi = lo + column(g[g["x_value"] == f"{S.OUTSIDE} (to high end)"], "y_value").sum()
            outside.setdefault(stack, f"{num(lo)}..{num(hi)}" if hi > lo else num(lo))
        out.append(f"{t['kind'].iloc[0]} (dry run): max cached [GiB] by category; outside the "
                   "allocator: " + ", ".join(f"{k} {v}" for k, v in outside.items()))
    shown = t["series"].astype(str).str.rpartition(", ")[0].isin(mechanism_at)
    for series, g in t[shown].groupby("series", sort=False):
        peak = column(g[g["x_value"] == PEAK], "y_value")
        cats = g[~g["x_value"].astype(str).isin([PEAK, S.OUTSIDE, f"{S.OUTSIDE} (to high end)"])]
        cats = cats.assign(_y=column(cats, "y_value")).sort_values("_y", ascending=False)
        top, rest = cats.head(most), cats["_y"].iloc[most:].sum()
        out.append(f"{series} {num(peak.max())}: " + ", ".join(
            f"{x} {num(y)}" for x, y in zip(top["x_value"], top["_y"]))
            + (f", rest {num(rest)}" if rest > 0 else ""))
    mt = table[(table["figure"] == f"{figure}_mechanisms")
               & (table["y_name"] == "needs_change")]
    if len(mt):
        parts = []
        for setup, g in mt.groupby("setup", sort=False):
            g = g.assign(_y=column(g, "y_value"))
            g = g.reindex(g["_y"].abs().sort_values(ascending=False).index).head(2)
            parts.append(f"{setup} " + ", ".join(
                f"{short.get(str(x).split('=')[0], x)} {y:+.2f}"
                for x, y in zip(g["x_value"], g["_y"])))
        out.append("mechanisms, needs [GiB]: " + "; ".join(parts))
    sw = table[table["figure"] == f"{figure}_switches"]
    for series, g in sw.groupby("series", sort=False):
        g = g.assign(_y=column(g, "y_value")).sort_values("_y", ascending=False)
        costs = g[(g["_y"] != 0) | (column(g, "capacity_change_GiB").fillna(0) != 0)]
        out.append(f"switches, {series} [GiB]: " + ", ".join(
            f"{x} {y:+.3g}" for x, y in zip(costs["x_value"].head(2), costs["_y"].head(2)))
            + (f", +{len(costs) - 2} more" if len(costs) > 2 else "")
            + f"; {len(g) - len(costs)} of {len(g)} change nothing")
    return out
