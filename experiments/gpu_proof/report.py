"""The GPU proof's summaries (``experiments/gpu_proof/``): its table rows from the records
(``summarize``), its figure and ``report.md`` (``plot``), its result lines (``conclude``). The report
states each part's checks and, per paper point (paper §10.5), the measured and dry-run peak device
memory by category (``lab.cuda_memory``): when the real / predicted peak-allocated ratio misses
its band, which category misses and the reasons known to make it.
"""
from __future__ import annotations

import math
import os

import matplotlib

from experiments.gpu_proof import offload_param
from zero_repro.lab import cuda_memory

matplotlib.use("Agg")

FIGURE = "gpu_proof"
GB = 1e9
MFU_TARGET = 0.40  # one GPU, eager bf16 1.5B (no torch.compile, unfused LayerNorm/GELU)


def summarize(records) -> list[dict]:
    newest: dict = {}
    for r in records:
        if r.status == "ok" and (r.point not in newest
                                 or r.timestamp >= newest[r.point].timestamp):
            newest[r.point] = r
    rows = []

    def row(r, series, x, y_name, y, unit):
        rows.append({"figure": FIGURE, "series": series, "x_name": "point", "x_value": x,
                     "y_name": y_name, "y_value": y, "unit": unit, "kind": r.mode,
                     "device_name": r.metrics.get("device_name", "")})

    thr = {}
    for r in newest.values():
        m = r.metrics
        part = m.get("part")
        row(r, part, r.point, "wall_s", m.get("wall_s"), "s")
        if "passed" in m:
            row(r, part, r.point, "passed", float(m["passed"]), "bool")
        if part == "equivalence":
            for k, c in m["configs"].items():
                row(r, part, k, "max_abs_diff", c["max_abs_diff"], "abs")
        elif part == "throughput":
            thr[m["stage"]] = r
            for y, unit in (("step_time_s", "s"), ("mfu", "fraction"), ("hfu", "fraction"),
                            ("model_tflops_per_gpu", "TFLOPs")):
                if m.get(y) is not None:
                    row(r, part, r.point, y, m[y], unit)
        elif part == "paper":
            for y in ("cuda_max_allocated", "predicted_peak_allocated", "model_state_bytes",
                      "predicted_model_state_bytes"):
                if m.get(y) is not None:
                    row(r, part, m["point"], f"{y}_GB", m[y] / GB, "GB")
            for y in ("model_states_ratio", "allocated_ratio", "reserved_ratio"):
                if m.get(y) is not None:
                    row(r, part, m["point"], y, m[y], "x")
            for side, cats in (m.get("memory_by_category") or {}).items():
                for c, v in cats.items():
                    if v is not None:
                        row(r, part, m["point"], f"{side}_{c}_GB", v / GB, "GB")
            for y, v in zip(("allocated_ratio_low", "allocated_ratio_high"),
                            m.get("ratio_range") or ()):
                row(r, part, m["point"], y, v, "x")
        elif part == "zero_offload":  # offload.PART
            for x, y, v, unit in _offload_rows(m):
                row(r, part, x, y, v, unit)
        elif part == "zero_offload_param":  # offload_param.PART
            for x, y, v, unit in offload_param.rows(m):
                row(r, part, x, y, v, unit)
        elif part == "node":
            for k, s in m["stages"].items():
                row(r, part, f"stage{k}", "step_s", s["step_s"], "s")
                row(r, part, f"stage{k}", "peak_GB", s["peak_bytes"] / GB, "GB")
                if s.get("nccl_overlapped_share") is not None:
                    row(r, part, f"stage{k}", "nccl_overlapped_share",
                        s["nccl_overlapped_share"], "fraction")
    if 0 in thr and 3 in thr:
        ratio = thr[3].metrics["step_time_s"] / thr[0].metrics["step_time_s"]
        row(thr[3], "throughput", "stage3/stage0", "step_time_ratio", ratio, "x")
        if thr[0].metrics.get("device") == "cuda":  # targets: a miss is a result, not a failure
            row(thr[3], "throughput", "targets", "stage3_over_stage0<=1.10", float(ratio <= 1.10),
                "bool")
            if thr[0].metrics.get("mfu") is not None:
                row(thr[0], "throughput", "targets", f"mfu_stage0>={MFU_TARGET}",
                    float(thr[0].metrics["mfu"] >= MFU_TARGET), "bool")
    return rows


def plot(table, out_dir: str) -> list[str]:
    """A bar per part (wall time, passed or not) and ``report.md``: the proof's short report."""
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    ours = table[table["kind"] != "paper"]
    walls = ours[ours["y_name"] == "wall_s"]
    passed = {(r.series, r.x_value): r.y_value for r in ours[ours["y_name"] == "passed"]
              .itertuples()}
    fig, ax = plt.subplots(figsize=(7, 3.2))
    colors = ["tab:green" if passed.get((r.series, r.x_value), 1.0) else "tab:red"
              for r in walls.itertuples()]
    ax.barh([str(x) for x in walls["x_value"]], walls["y_value"], color=colors)
    ax.set_xlabel("wall time (s); red = a check failed")
    ax.set_title("GPU proof: parts in order (" + ", ".join(sorted(
        {str(d) for d in ours["device_name"].dropna().unique() if d})) + ")", fontsize=9)
    ax.invert_yaxis()
    fig.tight_layout()
    paths = []
    for ext in ("png", "pdf"):
        path = os.path.join(out_dir, f"{FIGURE}.{ext}")
        fig.savefig(path, dpi=110)
        paths.append(path)
    plt.close(fig)
    report = os.path.join(out_dir, "report.md")
    with open(report, "w") as f:
        f.write(report_text(ours))
    return paths + [report]


def paper_memory(rows) -> dict:
    """Per paper point of the table's rows: (measured, dry run) bytes by category
    (``lab.cuda_memory``), the real / predicted peak-allocated ratio (None off CUDA), its band."""
    out: dict = {}
    for r in rows[rows["series"] == "paper"].itertuples():
        d = out.setdefault(str(r.x_value), {"measured": {}, "dry_run": {}, "ratio": None,
                                            "band": [None, None]})
        name, v = str(r.y_name), float(r.y_value)
        for side in ("measured", "dry_run"):
            if name.startswith(side + "_") and name.endswith("_GB"):
                d[side][name[len(side) + 1:-3]] = round(v * GB)
        if name == "allocated_ratio":
            d["ratio"] = v
        elif name in ("allocated_ratio_low", "allocated_ratio_high"):
            d["band"][name.endswith("high")] = v
    return {k: v for k, v in out.items() if v["dry_run"]}


def _memory_section(rows) -> list[str]:
    lines = []
    for point, d in paper_memory(rows).items():
        real, pred = ({c: d[side].get(c) for c in cuda_memory.CATEGORIES}
                      for side in ("measured", "dry_run"))
        lines += ["", f"### paper {point}: peak device memory by category", "",
                  *cuda_memory.table(real, pred), ""]
        if d["ratio"] is None:
            lines.append("No CUDA peak (the CPU dry path): the ledger's categories only.")
        else:
            lo, hi = d["band"]
            why = cuda_memory.miss(real, pred, d["ratio"], (lo, hi))
            lines.append(why[0].upper() + why[1:] + "." if why else
                         f"Peak allocated {d['ratio']:.3f}x the dry run's, inside [{lo}, {hi}].")
    return (["", "## Paper points: measured and dry-run peaks by category",
             "", "held (model states, buffers, gathered parameters, device checkpoints) from "
             "the ledgers; working = peak requested - held, rounding = peak allocated - peak "
             "requested, cached_free = peak reserved - peak allocated, from "
             "`torch.cuda.memory_stats` and the dry run's allocator replay."] + lines
            if lines else [])


def report_text(ours) -> str:
    """The proof's short report from the table's rows (measured; device names as recorded):
    the paper points' memory by category (``_memory_section``), then every row."""
    lines = ["# GPU proof report", "",
             "Generated from the records (`python -m experiments.plot gpu_proof`). Measured on: "
             + (", ".join(sorted({str(d) for d in ours["device_name"].dropna().unique() if d}))
                or "?") + ". World 1 = DP 1: no NCCL communicator carries a bucket there.",
             *_memory_section(ours), "", "## Every row", "",
             "| part | point | y | value | unit |", "|---|---|---|---|---|"]
    for r in ours.itertuples():
        v = r.y_value
        txt = f"{v:.4g}" if isinstance(v, float) and math.isfinite(v) else str(v)
        lines.append(f"| {r.series} | {r.x_value} | {r.y_name} | {txt} | {r.unit} |")
    return "\n".join(lines) + "\n"


def conclude(table) -> list[str]:
    """The result lines: each part passed or not, stage 0's MFU, and per paper point the peak
    allocated against the dry run with the category that misses (``lab.cuda_memory.miss``)."""
    ours = table[table["kind"] != "paper"]
    lines = []
    for r in ours[ours["y_name"] == "passed"].itertuples():
        lines.append(f"{r.x_value}: {'passed' if r.y_value else 'FAILED'}")
    mfu = ours[(ours["series"] == "throughput") & (ours["y_name"] == "mfu")]
    for r in mfu.itertuples():
        lines.append(f"{r.x_value}: MFU {float(r.y_value):.3f}")
    for point, d in paper_memory(ours).items():
        real, pred = d["measured"], d["dry_run"]
        if d["ratio"] is None:
            lines.append(f"paper {point}: model states {real.get('model_states', 0) / GB:.2f} "
                         f"GB, as the dry run's {pred.get('model_states', 0) / GB:.2f} GB (CPU "
                         f"dry path: no CUDA peak)")
            continue
        full = {side: {c: d[side].get(c) for c in cuda_memory.CATEGORIES}
                for side in ("measured", "dry_run")}
        why = cuda_memory.miss(full["measured"], full["dry_run"], d["ratio"], tuple(d["band"]))
        lines.append(f"paper {point}: peak allocated {d['ratio']:.3f}x the dry run's"
                     + (f" -- {why}" if why else f", inside {d['band']}"))
    return lines


def _offload_rows(m: dict) -> list[tuple[str, str, float, str]]:
    """(x, y_name, value, unit) rows of the ZeRO-Offload part for the proof's table."""
    out = []
    for dtype, r in m.items():
        if not isinstance(r, dict) or "max_abs_param_diff" not in r:
            continue
        out += [(dtype, "max_abs_param_diff", r["max_abs_param_diff"], "abs"),
                (dtype, "step_s_device_optimizer", r["step_s_device_optimizer"], "s"),
                (dtype, "step_s_offload", r["step_s_offload"], "s"),
                (dtype, "peak_GB_device_optimizer",
                 r["peak_allocated_device_optimizer"] / 1e9, "GB"),
                (dtype, "peak_GB_offload", r["peak_allocated_offload"] / 1e9, "GB")]
    hs = m.get("host_step")
    if hs:
        out.append(("host step", "G_elements_per_s", hs["elements_per_s"] / 1e9, "G/s"))
    return out
