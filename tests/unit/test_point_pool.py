"""Independent simulated points side by side (``lab.point_pool``): the same records as one after
another, made in other processes; measured points and undeclared experiments stay sequential."""
from __future__ import annotations

import os
import sys
import textwrap

from zero_repro import config as C
from zero_repro.lab import point_pool
from zero_repro.lab import records as R
from zero_repro.lab import sweep
from zero_repro.lab.points import Point
from zero_repro.lab.sweep import PlannedPoint

EXPERIMENT = textwrap.dedent('''
    import os, time
    from zero_repro.lab.points import Point

    PARALLEL_POINTS = True

    def plan(cfg):
        return [Point(name=f"p{i}", params={"i": i}, mode="simulated") for i in range(4)]

    def run_point(cfg, point):
        open(os.path.join(point.run_dir, "started"), "w").close()
        time.sleep(0.5)  # long enough that the other worker takes the next point
        return {"y": point.params["i"] ** 2, "pid": os.getpid()}

    def summarize(records):
        return [{"figure": "pp", "series": "s", "x_name": "i", "x_value": r.params["i"],
                 "y_name": "y", "y_value": r.metrics["y"], "unit": "u", "kind": r.mode}
                for r in records]
''')


def _cfg(tmp_path, workers: int) -> C.Config:
    cfg = C.Config()
    cfg.experiment.name = "pp"
    cfg.experiment.results_dir = str(tmp_path / f"results{workers}")
    cfg.experiment.workers = workers
    cfg.train.progress = False
    return cfg


def test_side_by_side_points_give_the_sequential_records(tmp_path, monkeypatch):
    (tmp_path / "pp_experiment.py").write_text(EXPERIMENT)
    monkeypatch.syspath_prepend(str(tmp_path))  # the spawned workers import it by name
    import pp_experiment

    try:
        runs = {}
        for workers in (1, 2):
            res = sweep.run_sweep(_cfg(tmp_path, workers), pp_experiment)
            recs = R.RecordStore.for_experiment(str(tmp_path / f"results{workers}"),
                                                "pp").load()
            assert len(res.records) == 4 and all(r.status == "ok" for r in recs)
            runs[workers] = {r.point: r for r in recs}
        assert {p: r.metrics["y"] for p, r in runs[1].items()} == \
               {p: r.metrics["y"] for p, r in runs[2].items()}
        assert {r.metrics["pid"] for r in runs[1].values()} == {os.getpid()}
        pids = {r.metrics["pid"] for r in runs[2].values()}
        assert len(pids) == 2 and os.getpid() not in pids  # two workers, not this process
    finally:
        sys.modules.pop("pp_experiment", None)


def test_measured_points_and_undeclared_experiments_run_one_at_a_time():
    cfg = C.Config()
    sim = [PlannedPoint(Point(name=f"s{i}", mode="simulated"), cfg, f"k{i}") for i in range(3)]
    meas = sim + [PlannedPoint(Point(name="m", mode="measured"), cfg, "km")]

    class Declared:
        PARALLEL_POINTS = True

    cfg.experiment.workers = 2
    assert point_pool.workers_for(cfg, Declared, sim) == 2
    assert point_pool.workers_for(cfg, Declared, meas) == 1
    assert point_pool.workers_for(cfg, object(), sim) == 1
    assert point_pool.workers_for(cfg, Declared, sim[:1]) == 1
    cfg.experiment.workers = 0  # the cores this process may use, at most one per point
    assert point_pool.workers_for(cfg, Declared, sim) == min(3, len(os.sched_getaffinity(0)))


def test_a_terminated_sweep_starts_no_more_points_and_records_none_done(tmp_path):
    import signal
    import subprocess
    import time

    (tmp_path / "pp_slow.py").write_text(EXPERIMENT.replace("time.sleep(0.5)", "time.sleep(60)"))
    script = textwrap.dedent(f'''
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import signal
        from zero_repro import config as C
        from zero_repro.lab import sweep
        from zero_repro.runtime.comm.launch import raise_terminated
        import pp_slow
        signal.signal(signal.SIGTERM, raise_terminated)
        cfg = C.Config()
        cfg.experiment.name, cfg.experiment.results_dir = "pp", {str(tmp_path / "res")!r}
        cfg.experiment.workers, cfg.train.progress = 2, False
        sweep.run_sweep(cfg, pp_slow)
    ''')
    proc = subprocess.Popen([sys.executable, "-c", script])
    runs = tmp_path / "res" / "pp" / "runs"
    deadline = time.time() + 240
    while time.time() < deadline and len(list(runs.glob("*/started"))) < 2:
        time.sleep(0.5)  # both workers run a point (spawning one takes seconds)
    time.sleep(1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(120) != 0
    recs = R.RecordStore.for_experiment(str(tmp_path / "res"), "pp").load()
    # nothing recorded done; the stopped points that left a record left it cancelled (one of
    # two running points may go unrecorded: it is then not done, and runs again next time)
    assert recs and {r.status for r in recs} == {"cancelled"}
    assert len(list(runs.glob("*/started"))) == 2  # no third point started after the signal


def _uses_the_judge_helper() -> None:
    from zero_repro.scale.dryrun import maxsize

    assert maxsize._helper().submit(abs, -3).result() == 3


def test_a_worker_that_used_the_judges_helper_process_exits():
    # a multiprocessing child joins its own children before atexit: the max-size judge's
    # helper must be shut down before that (a point_pool worker hung there after its points)
    import multiprocessing

    p = multiprocessing.get_context("spawn").Process(target=_uses_the_judge_helper)
    p.start()
    p.join(180)
    alive = p.is_alive()
    if alive:
        p.kill()
    assert not alive and p.exitcode == 0
