"""Smoke experiment: the whole stack end to end on one tiny point (no paper figure).

A tiny GPT trains for a few steps on ``parallel.world_size`` local ranks (``conf/exp/smoke.yaml``:
2 ranks as TP 2) through ``zero_repro.worker.run_training``; the record keeps the per-step losses
and ``summarize`` turns them into ``kind=measured`` rows (y_name ``loss`` per ``step``). The check
that matters: the loss goes down (``metrics.loss_decreased``).
"""
from __future__ import annotations

from zero_repro.harness.points import Point
from zero_repro.harness.records import loss_curve
from zero_repro.worker import run_training

FIGURE = "smoke"


def plan(cfg) -> list[Point]:
    p = cfg.parallel
    return [Point(name=f"tiny_w{p.world_size}_tp{p.tp}_stage{cfg.zero.stage}",
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
        series = f"{r.point} ({r.config.get('cluster', {}).get('name', '?')})"
        hw = r.hardware.get("device_name", "")
        for step, loss in loss_curve(r):  # a resumed record starts at its start_step
            rows.append({"figure": FIGURE, "series": series, "x_name": "step", "x_value": step,
                         "y_name": "loss", "y_value": loss, "unit": "nats", "kind": r.mode,
                         "hardware": hw})
    return rows
