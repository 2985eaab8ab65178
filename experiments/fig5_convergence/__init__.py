"""Figure 5 analogue: convergence equivalence of ZeRO-DP stages 0-3 and ZeRO-R C1-C5 (paper §10.6).

The paper's Figure 5 (Turing-NLG 17B with ZeRO-100B vs Megatron-LM 8.3B, 300K iterations) cannot
be repeated here; what it rests on can: ZeRO changes *where* states live (§5, §6), never *what*
is computed. With the same data and seed an fp32 run must follow the same loss curve under every
stage and every Table 3 configuration,

    max_t |loss_t(config) - loss_t(stage 0, fp32)|  ~ 1e-6   (reduction order only),

and an fp16/bf16 run (fp32 master weights, §5.1) must track it within a stated tolerance.

Points (``conf/exp/fig5_convergence.yaml``): stages 0-3 with ZeRO-R off and C1-C5 in fp32, plus
fp16 and bf16 variants of a few, on one grid (default world 4 = TP 2 x DP 2), one seed, the
``pystdlib`` text. Rows (``kind=measured``): ``loss`` per ``step`` per series,
``abs_dloss_vs_stage0_fp32`` per step, and one ``max_abs_dloss_vs_stage0_fp32`` row per series
(listed first) with its ``tolerance`` and ``within_tolerance``. The paper's values appear only in
a side panel (kind ``paper``), labelled as a different experiment: not comparable with ours.
"""
from __future__ import annotations

import dataclasses
import json
import logging

from zero_repro.config import ZeroRConfig
from zero_repro.lab.figures import throughput_summary as TS
from experiments.fig5_convergence import figure as CF
from experiments.fig5_convergence.figure import DLOSS, LOSS, MAXD, UNIT
from zero_repro.lab.points import Point
from zero_repro.lab.records import loss_curve, skipped_steps_of
from zero_repro.lab.launcher import run_training
from zero_repro.scale.paper.table1 import STAGE_NOTATION
from zero_repro.scale.paper.table3 import TABLE3, describe, zero_r_config

log = logging.getLogger(__name__)

FIGURE = "fig5_convergence"
PAPER_FIG = "fig5"  # reference-CSV id, for the context panel only (no join: other quantity)
DEFAULTS = {
    "world_size": 4, "tp": 2,  # TP 2 x DP 2: DP sharding and P_a both do something
    "configs": ["stage0", "stage1", "stage2", "stage3", "C1", "C2", "C3", "C4", "C5"],
    "mixed_configs": ["stage2", "C4"],
    "mixed_dtypes": ["fp16", "bf16"],
    # fp16's first loss scale, 2^power. The tiny model's gradients are O(1) per element, so the
    # usual 2^16 overflows at the first gradient spike and dynamic scaling then skips steps
    # until it has halved far enough (measured: 4 skipped steps, a transient 1.2-nat gap that
    # closes again); 2^12 leaves 16x headroom below fp16's 65504 and no step is skipped.
    "fp16_initial_scale_power": 12,
    # max |loss - stage 0 fp32 loss| in nats: fp32 differs only in reduction order; fp16 (11-bit
    # mantissa) and bf16 (8-bit) round activations and gradients, master weights stay fp32
    "tol": {"fp32": 1e-5, "fp16": 0.05, "bf16": 0.15},
}


def params_of(cfg) -> dict:
    return {**DEFAULTS, **dict(cfg.experiment.params or {})}


# ------------------------------------------------------------------------------------ plan
def config_overrides(name: str) -> dict:
    """zero.stage + zero_r.* for ``stage0``..``stage3`` (ZeRO-R off) or Table 3's ``C1``..``C5``."""
    key = name.lower()
    if key.startswith("stage") and key[5:].isdigit():
        stage, zr = int(key[5:]), zero_r_config("off")
    elif key in TABLE3:
        stage, zr = TABLE3[key].stage, zero_r_config(key)
    else:
        raise ValueError(f"fig5_convergence: unknown configuration {name!r}; use stage0..stage3 "
                         f"or C1..C5 in experiment.params.configs / mixed_configs")
    return {"zero.stage": stage, **{f"zero_r.{k}": v for k, v in dataclasses.asdict(zr).items()}}


def label_of(name: str) -> str:
    """'stage 2 (P_os+g)' / 'C4 (P_os+g | C_B+M_D+P_a)'."""
    ov = config_overrides(name)
    if name.lower().startswith("stage"):
        return f"stage {ov['zero.stage']} ({STAGE_NOTATION[ov['zero.stage']]})"
    zr = ZeroRConfig(**{k[len("zero_r."):]: v for k, v in ov.items() if k.startswith("zero_r.")})
    return f"{name.upper()} ({describe(ov['zero.stage'], zr)})"


def plan(cfg) -> list[Point]:
    p = params_of(cfg)
    world, tp = int(p["world_size"]), int(p["tp"])
    runs = [(c, "fp32") for c in p["configs"]]
    runs += [(c, d) for c in p["mixed_configs"] for d in p["mixed_dtypes"]]
    if ("stage0", "fp32") not in runs:  # every deviation is measured against this run
        runs.insert(0, ("stage0", "fp32"))
    points = []
    for name, dtype in runs:
        ov = {"parallel.world_size": world, "parallel.tp": tp, "zero.dtype": dtype,
              **config_overrides(name)}
        if dtype == "fp16":
            ov["zero.initial_scale_power"] = int(p["fp16_initial_scale_power"])
        points.append(Point(
            name=f"{name} {dtype} w{world} tp{tp}",
            params={"config": name, "dtype": dtype, "stage": ov["zero.stage"],
                    "zero_r": ov["zero_r.name"], "world_size": world, "tp": tp},
            overrides=ov, mode="measured"))
    return points


def run_point(cfg, point: Point) -> dict:
    result = run_training(cfg, point.run_dir, point.checked)
    m = result.setdefault("metrics", {})
    losses = [x for x in (m.get("losses") or []) if x is not None]
    if losses:
        m["loss_decreased"] = bool(losses[-1] < losses[0])
    return result


# ------------------------------------------------------------------------------- summarize
def _grid(r) -> str:
    """What must be equal for two runs to be compared step by step: model, grid, training."""
    c = r.config or {}
    train = {k: v for k, v in (c.get("train") or {}).items() if k not in ("progress", "log_every")}
    return json.dumps({"model": c.get("model"), "parallel": c.get("parallel"), "train": train},
                      sort_keys=True, default=str)


def _grid_label(r) -> str:
    c = r.config or {}
    par, tr = c.get("parallel") or {}, c.get("train") or {}
    world, tp = par.get("world_size") or 0, par.get("tp") or 1
    return (f"{(c.get('model') or {}).get('name', '?')} w{world}=tp{tp}xdp{world // tp} "
            f"{tr.get('data', '?')} {tr.get('steps')} steps")


def _is_reference(r) -> bool:
    return r.params.get("config") == "stage0" and r.params.get("dtype") == "fp32"


def summarize(records) -> list[dict]:
    """Loss per step, |loss - stage 0 fp32 loss| per step, and its maximum per series."""
    ok = [r for r in records if r.status == "ok" and r.metrics.get("losses")]
    groups: dict[str, list] = {}
    for r in ok:
        groups.setdefault(_grid(r), []).append(r)
    head, body = [], []
    for recs in groups.values():
        prefix = f"[{_grid_label(recs[0])}] " if len(groups) > 1 else ""
        ref = next((r for r in recs if _is_reference(r)), None)
        ref_losses = dict(loss_curve(ref)) if ref is not None else None
        for r in recs:
            h, b = _series_rows(r, prefix, ref_losses, r is ref)
            head += h
            body += b
    return head + body


def _series_rows(r, prefix: str, ref_losses, is_ref: bool) -> tuple[list, list]:
    q = r.params
    dtype = q.get("dtype", "fp32")
    series = f"{prefix}{label_of(q['config'])} {dtype}"
    extra = {"config": q["config"], "dtype": dtype, "grid": _grid_label(r),
             "hardware": r.hardware.get("device_name", ""),
             "provenance": TS.provenance_label(r)}
    base = {"figure": FIGURE, "series": series, "x_name": "step", "unit": UNIT, "kind": r.mode}
    curve = loss_curve(r)  # (true step, loss): a resumed record starts at its start_step
    skipped = skipped_steps_of(r)  # fp16 overflow: optimizer step skipped
    body = [{**base, "x_value": t, "y_name": LOSS, "y_value": v, **extra,
             "step_skipped": t in skipped} for t, v in curve]
    if ref_losses is None or is_ref:
        return [], body
    # compared at the same step index, over the steps both runs have
    pairs = [(t, a, ref_losses[t]) for t, a in curve if t in ref_losses]
    diffs = [abs(a - b) if a is not None and b is not None else float("nan")
             for _, a, b in pairs]
    body += [{**base, "x_value": t, "y_name": DLOSS, "y_value": d, **extra}
             for (t, _, _), d in zip(pairs, diffs)]
    worst = max(diffs) if diffs and all(d == d for d in diffs) else float("nan")
    tol = tolerance(r)
    log.debug("%-44s max |loss - stage 0 fp32| over %d steps = %.3g (tolerance %g)%s", series,
             len(diffs), worst, tol, "" if worst <= tol else "  EXCEEDED")
    head = [{**base, "x_name": "steps_compared", "x_value": len(diffs), "y_name": MAXD,
             "y_value": worst, **extra, "tolerance": tol, "within_tolerance": bool(worst <= tol),
             "skipped_steps": r.metrics.get("skipped_steps", 0)}]
    return head, body


def tolerance(r) -> float:
    """The run's stated tolerance for its dtype (``experiment.params.tol``)."""
    p = ((r.config or {}).get("experiment") or {}).get("params") or {}
    tol = {**DEFAULTS["tol"], **dict(p.get("tol") or {})}
    return float(tol[r.params.get("dtype", "fp32")])


def conclude(table) -> list[str]:
    """Per dtype: the series compared with stage 0 fp32, their largest |Δloss| against the
    tolerance, and any series beyond it; the reference's loss first -> last."""
    ours = table[table["kind"] == "measured"]
    heads = ours[ours["y_name"] == MAXD]
    out = []
    ref = ours[(ours["y_name"] == LOSS) & (ours["config"] == "stage0")
               & (ours["dtype"] == "fp32")]
    if len(ref):
        y = ref.sort_values("x_value")["y_value"].astype(float)
        out.append(f"stage 0 fp32 (the reference): loss {y.iloc[0]:.3f} -> {y.iloc[-1]:.3f} "
                   f"over {len(y)} steps")
    for dtype, g in heads.groupby("dtype", sort=False):
        worst = g["y_value"].astype(float)
        within = g["within_tolerance"].astype(str) == "True"
        steps = int(g["x_value"].astype(float).max())
        line = (f"{dtype}: {int(within.sum())} of {len(g)} series follow stage 0 fp32 within "
                f"{float(g['tolerance'].iloc[0]):g} nats (largest |Δloss| {worst.max():.2g} over "
                f"{steps} steps, {g.loc[worst.idxmax(), 'series']})")
        out.append(line)
        for _, row in g[~within].iterrows():
            out.append(f"  EXCEEDS: {row['series']}: {float(row['y_value']):.3g} nats")
    return out


def plot(table, out_dir: str) -> list[str]:
    """The figure (``fig5_convergence.figure``): loss vs step per series, |dloss| vs stage 0
    fp32, the paper's Figure 5 for context."""
    return CF.plot(table, out_dir, FIGURE, PAPER_FIG)
