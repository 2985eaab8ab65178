"""Simulated points side by side: an experiment whose points are independent dry runs or closed
forms (``PARALLEL_POINTS = True`` in its module: Figure 6, Table 2, prediction_memory) runs its
local points in ``workers`` processes at once instead of one after another (``lab.sweep``).

Each worker runs ``sweep.run_and_record`` (the sweep's job) on one point at a time -- the same lock, record and
store as the sequential path -- so records, tables and figures do not depend on how many ran at
once. Measured points (real ranks, timings) never run here: they keep the machine to themselves.
``workers``: ``experiment.workers`` (default 1: one after another; 0 = the cores this process
may use; timings side by side: ``results/fig6_max_model/notes.md``). A SIGTERM or Ctrl-C
in the sweep reaches every running point, which records itself ``cancelled`` as it would alone.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import multiprocessing
import os
import signal
from typing import Any, Callable

from zero_repro.runtime.comm.launch import die_with_parent, raise_terminated



STOP_WAIT_S = 60.0  # an interrupted sweep waits this long for its running points' records


def workers_for(cfg, experiment: Any, points: list) -> int:
    """How many of ``points`` (``PlannedPoint``) run at once: 1 unless the experiment declares
    its points independent and none of them is measured; else ``experiment.workers`` (0: the
    cores this process may use), at most one per point."""
    if not getattr(experiment, "PARALLEL_POINTS", False) or len(points) < 2:
        return 1
    if any(pp.point.mode == "measured" for pp in points):
        return 1
    n = cfg.experiment.workers or len(os.sched_getaffinity(0))
    return max(1, min(n, len(points)))


def _init(parent: int) -> None:
    die_with_parent(parent)
    signal.signal(signal.SIGTERM, raise_terminated)  # recorded cancelled, as in the sweep
    logging.basicConfig(level=logging.INFO)


def run_side_by_side(job: Callable, points: list, workers: int, done: Callable) -> None:
    """``job(pp) -> (record, unsaved)`` (picklable: module level) for each of ``points`` (in
    this order) in ``workers`` spawned processes; ``done(record, pp, unsaved)`` as each ends
    (record None: another process held it)."""
    ctx = multiprocessing.get_context("spawn")
    pool = cf.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init,
                                  initargs=(os.getpid(),))
    todo, running = list(points), {}
    try:
        while todo or running:
            # at most one point per worker handed over: an interrupted worker has no next one
            while todo and len(running) < workers:
                pp = todo.pop(0)
                running[pool.submit(job, pp)] = pp
            ended, _ = cf.wait(running, return_when=cf.FIRST_COMPLETED)
            for fut in ended:
                rec, unsaved = fut.result()
                done(rec, running.pop(fut), unsaved)
    except BaseException:
        for proc in list(getattr(pool, "_processes", {}).values()):
            proc.terminate()  # SIGTERM: the running point records itself cancelled
        cf.wait(running, timeout=STOP_WAIT_S)  # their records written before the pool ends
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
