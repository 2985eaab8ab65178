"""Analysis of a dry run's allocation trace (``zero_repro.scale.dryrun.dryrun``): events ``(kind,
sid, nbytes, phase, iteration)`` in program order -- which events a judge replays, where the
repeatable last step starts, the live-byte peaks. Pure functions of the event list.
"""
from __future__ import annotations

from zero_repro.scale.dryrun import allocator as A
from zero_repro.scale.dryrun.tracer import ALLOC


def judged_trace(trace, host_sids, with_build: bool) -> list:
    """The device events a judge replays (``DryRunResult.judged_events``)."""
    dev = device_events(trace, set(host_sids))
    return dev if with_build else A.training_trace(dev)


def build_events(trace, host_sids) -> list:
    """The build phase's device events: what the build holds on the device until it ends
    (judged apart from the training steps where the stack's build is not part of the judged
    trace: the peak that decides is the larger of the two)."""
    return [e for e in device_events(trace, set(host_sids)) if e[3] == "build"]


def repeat_start(events) -> int | None:
    """Index of the last training iteration's first event when that iteration can be repeated
    (closed, and not the first: the first creates the lazy state); None otherwise."""
    last = None
    for i in range(len(events) - 1, -1, -1):
        if events[i][3] != "build":
            last = events[i][4]
            break
    if not last:  # no training phase, or only iteration 0
        return None
    start = next(i for i, e in enumerate(events) if e[3] != "build" and e[4] == last)
    end = max(i for i in range(start, len(events)) if events[i][3] != "build") + 1
    # events after the last training event (the run's teardown) are dropped by the caller
    return start if end == len(events) and A.closed_from(events, start) else None


def without_teardown(events) -> list:
    """The trace up to its last training event (what the run frees when it ends is not a
    step: a repeated step must end the trace)."""
    for i in range(len(events) - 1, -1, -1):
        if events[i][3] != "build":
            return events[:i + 1]
    return events


def device_events(events, host_sids: set[int]):
    """The trace without host-memory storages."""
    return [e for e in events if e[1] not in host_sids]


def steady_peak(events) -> int:
    """Live peak of a further iteration, predicted from the last one's trace: at every point
    of the last iteration, its live bytes plus the bytes it allocated later that are still
    alive at its end and never freed in it (lazily created state -- Adam moments, C_B buffers,
    the M_D arena -- which a further iteration finds already allocated; a stage-3 unit gathered
    again at the step's end for the next forward was released in the iteration: not lazy). Exact when the next iteration repeats
    the last one's allocations minus the lazy ones (fake tensors: no data-dependent paths)."""
    train = [e for e in events if e[3] != "build"]
    if not train:
        return 0
    last = train[-1][4]
    start = next(i for i, e in enumerate(events) if e[3] != "build" and e[4] == last)
    alive: dict[int, int] = {}
    cycled: set[int] = set()  # freed in the iteration: gathered and released (stage 3), not lazy
    for kind, sid, nbytes, _ph, _it in events[start:]:
        if kind == ALLOC:
            alive[sid] = nbytes
        else:
            alive.pop(sid, None)
            cycled.add(sid)
    live = sum(e[2] if e[0] == ALLOC else -e[2] for e in events[:start])
    curve = []
    for kind, _sid, nbytes, _ph, _it in events[start:]:
        live += nbytes if kind == ALLOC else -nbytes
        curve.append(live)
    later, best = 0, 0
    for i in range(len(curve) - 1, -1, -1):  # backwards: lazy bytes allocated after i
        best = max(best, curve[i] + later)
        kind, sid, nbytes = events[start + i][:3]
        if kind == ALLOC and alive.get(sid) == nbytes and sid not in cycled:
            later += nbytes
    return best


def live_peaks(events) -> tuple[int, dict, dict]:
    """(overall peak, peak per phase, peak per iteration of the training phases)."""
    live = peak = 0
    by_phase: dict[str, int] = {}
    by_iter: dict[int, int] = {}
    for kind, _sid, nbytes, phase, it in events:
        live += nbytes if kind == ALLOC else -nbytes
        peak = max(peak, live)
        by_phase[phase] = max(by_phase.get(phase, 0), live)
        if phase != "build":
            by_iter[it] = max(by_iter.get(it, 0), live)
    return peak, by_phase, by_iter
