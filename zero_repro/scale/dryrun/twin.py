"""One traced program, several judged stacks: a dry run's trace reused for a stack that differs
from the traced one only in when a freed block can be reused (paper §10.5, Figure 6's bracket;
``stack.streams``).

The switch ``collective_stream_reuse`` changes no allocation: under ``after_sync`` the tracer
labels a free whose block a collective's stream may still use ``free_held`` and records a
``sync`` event at each synchronisation point that returns held blocks; under ``at_free`` every
free is a plain ``free`` and no ``sync`` is recorded (``tracer.AllocationTracer``). So where the
rest of the program is the same -- the 2019 checkpointing is in place either way and runs its
reentrant path, whose per-layer syncs record nothing -- the ``at_free`` trace is the
``after_sync`` trace with every ``free_held`` made a ``free`` and every ``sync`` dropped
(``at_free``), event for event and storage id for storage id. ``paper2020_least`` (the
bracket's least-memory end) is such a stack; its twin is ``paper2020``.

``trace_config(cfg)``: the configuration whose dry run traces ``cfg``'s program (``cfg`` itself
unless its stack has a twin); ``rejudge(res, cfg)``: that dry run's result as ``cfg``'s dry run
would report it (details off, as the max-size judge runs it): the trace converted, its live
peaks and its judged replay at ``cfg``'s capacity recomputed, ``min_capacity`` not yet known.
"""
from __future__ import annotations

import dataclasses

from zero_repro import config as C
from zero_repro.scale.dryrun import allocator as A
from zero_repro.scale.dryrun.dryrun import DryRunResult, capacity_for, judge, stack_of
from zero_repro.scale.dryrun.stack import streams
from zero_repro.scale.dryrun.stack import switches as S
from zero_repro.scale.dryrun.trace import (device_events, judged_trace, live_peaks, repeat_start,
                                           steady_peak)
from zero_repro.scale.dryrun.tracer import FREE, HELD, SYNC


def twin_stack(stack: S.Stack) -> str | None:
    """Name of the named stack that traces ``stack``'s program with ``after_sync`` labels (module
    docstring), or None where ``stack`` has none."""
    if stack.collective_stream_reuse != streams.AT_FREE or not stack.reentrant_checkpointing:
        return None
    if not (stack.pa_per_layer_checkpoints or stack.contiguous_ckpt_only_with_pa):
        return None  # the 2019 checkpointing would be put in by after_sync alone
    want = dataclasses.replace(stack, collective_stream_reuse=streams.AFTER_SYNC)
    for name in S.STACKS:
        if dataclasses.replace(S.get(name), name=want.name) == want:
            return name
    return None


def trace_config(cfg: C.Config) -> C.Config:
    """The configuration whose dry run traces ``cfg``'s program: ``cfg``, or its stack's twin
    judged at the default outside point (where that stack's own judge runs it)."""
    if cfg.simulate.only_switches:
        return cfg
    name = twin_stack(stack_of(cfg))
    if name is None:
        return cfg
    return dataclasses.replace(cfg, simulate=dataclasses.replace(
        cfg.simulate, stack=name, outside_point=C.SimulateConfig().outside_point))


def at_free(trace: list) -> list:
    """The ``after_sync`` trace as ``at_free`` records it (module docstring)."""
    return [(FREE, *e[1:]) if e[0] == HELD else e for e in trace if e[0] != SYNC]


def rejudge(res: DryRunResult, cfg: C.Config) -> DryRunResult:
    """``res`` (the dry run of ``trace_config(cfg)``, trace kept, details off) as the dry run of
    ``cfg`` reports it: the trace in ``cfg``'s stack's labels, the live peaks, the judged
    replay at ``cfg``'s capacity (``dryrun.dry_run`` computes them alike)."""
    stack = stack_of(cfg)
    if res.stack == stack.name and res.capacity == (capacity_for(cfg, stack) or 0.0):
        return res
    events = res.trace
    if stack.collective_stream_reuse == streams.AT_FREE and res.stack != stack.name:
        events = at_free(events)
    cap = capacity_for(cfg, stack)
    host = set(res.host_sids)
    dev = device_events(events, host)
    peak, by_phase, by_iter = live_peaks(dev)
    judged = judged_trace(events, host, res.judged_with_build)
    alloc = judge(A.replay(judged, capacity=cap, repeat_from=repeat_start(judged),
                           cycles=True).as_dict(),
                  None if res.judged_with_build else A.replay(
                      [e for e in dev if e[3] == "build"], capacity=cap))
    ident = {**res.config, "stack": stack.name}
    return dataclasses.replace(
        res, config=ident, trace=events, live_peak=peak, live_peak_by_phase=by_phase,
        live_peak_by_iteration=by_iter, live_peak_steady=steady_peak(dev),
        allocator=alloc, allocator_with_build=alloc if res.judged_with_build else {},
        n_events=len(events), stack=stack.name, capacity=cap or 0.0, breakdown={},
        _min_capacity=None)
