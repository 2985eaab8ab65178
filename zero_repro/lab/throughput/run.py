"""Running one point of a throughput figure: the calibration (written to
``results/calibration/``: the one file side effect here, the calibration being shared by the
four figures), a simulated point (``simulate``), or a measured one through the launcher
(``lab.launcher.run_training``), its ``hardware`` column saying what it ran on.
"""
from __future__ import annotations

from zero_repro.lab.launcher import run_training
from zero_repro.lab.points import Point
from zero_repro.lab.throughput.simulate import simulate, simulate_max_fit
from zero_repro.scale.calibrate import calibration, calibration_summary, write_calibration
from zero_repro.scale.hardware import cpu_model


def run_point(cfg, point: Point) -> dict:
    role = point.params.get("role")
    if role == "calibration":
        cal = calibration(point.params["cluster"], bool(point.params.get("use_fig3")))
        summ = calibration_summary(cal)
        summ["files"] = write_calibration(cal, cfg.experiment.results_dir)
        return summ
    if role == "simulated":
        q = point.params
        if q.get("batch_rule") == "max_fit":
            return simulate_max_fit(q)
        return simulate(q["figure"], q["setup"], q["series"], q["batch"], q["sim_cluster"],
                        bool(q.get("use_fig3")), q, zero_config=q.get("zero_config"))
    result = run_training(cfg, point.run_dir, point.checked)
    m = result.setdefault("metrics", {})
    m["aggregate_tflops"] = m["tflops_per_gpu"] * cfg.parallel.world_size
    hw = result.setdefault("hardware", {})
    if hw.get("device") == "cpu":
        hw["cpu_model"] = cpu_model()
    return result
