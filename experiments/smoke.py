"""Smoke experiment: the whole stack end to end on one tiny point (no paper figure).

A tiny GPT trains for a few steps on ``parallel.world_size`` local ranks (``conf/exp/smoke.yaml``:
2 ranks as DP 2, so ``zero.stage=0..3`` really partition) through
``zero_repro.lab.launcher.run_training``; the record keeps the per-step losses and ``summarize`` turns
them into ``kind=measured`` rows (y_name ``loss`` per ``step``). The check that matters: the loss
goes down (``metrics.loss_decreased``). Series are named from each record's resolved config
(``records.knob_label``: model shape, dtype, stage, ZeRO-R, world/TP/DP, steps), so an fp32 and a
bf16 run, or an 8- and a 6-step run, are two curves.
"""
from __future__ import annotations

from zero_repro.lab.points import Point
from zero_repro import config as C
from zero_repro.lab.records import knob_label, loss_curve
from zero_repro.lab.launcher import run_training

FIGURE = "smoke"


def plan(cfg) -> list[Point]:
    p = cfg.parallel
    return [Point(name=knob_label(C.summary(cfg)),
                  params={"world_size": p.world_size, "tp": p.tp, "stage": cfg.zero.stage},
                  mode="measured")]


def run_point(cfg, point: Point) -> dict:
    result = run_training(cfg, point.run_dir)
    m = result.setdefault("metrics", {})
    losses = m.get("losses") or []
    if losses:
        m["loss_decreased"] = bool(losses[-1] < losses[0])
    return result


def summarize(records) -> list[dict]:
    rows = []
    for r in records:
        if r.status != "ok":
            continue
        series = knob_label(r.config)
        hw = r.hardware.get("device_name", "")
        for step, loss in loss_curve(r):  # a resumed record starts at its start_step
            rows.append({"figure": FIGURE, "series": series, "x_name": "step", "x_value": step,
                         "y_name": "loss", "y_value": loss, "unit": "nats", "kind": r.mode,
                         "hardware": hw})
    return rows
