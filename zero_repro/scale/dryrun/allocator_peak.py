"""The live-byte peaks of a real CPU run as PyTorch's CPU allocator counts them: the yardstick a
real run is measured with when it is held against the dry run or the estimate, independent of
the dry run's tracer (``scale.dryrun.tracer``, a dispatch mode that sizes the storages of the ops
it sees).

Mechanism: under ``torch.profiler.profile(profile_memory=True)`` c10's CPU allocator reports
every block it hands out and every free of a block it handed out while profiling (its
``ProfiledCPUMemoryReporter`` keeps the size of each block by address; a block from before is
not reported when freed), each with a timestamp. The bytes live at an instant are the sum of
the reports before it; a window's peak is the largest such sum inside it, or the sum at its
start. Windows are ``record_function`` ranges (``window(name)``) on the profiler's clock.

Neither counter sees memory that does not come from c10's allocator (gloo's own buffers, a file
mapped with ``from_file(shared=True)``): measure with ``ZR_CPU_TRANSPORT=pairwise``. This one
also counts what a kernel allocates through c10 below the dispatcher (scratch no dispatch mode
sees), and nothing of the tracer's bookkeeping: a shared error of tracer and dry run cannot
pass unseen.
"""
from __future__ import annotations

import bisect
import contextlib
import gc

import torch

WINDOW = "zr.window."  # the record_function names of the windows


class AllocatorPeak:
    """``with AllocatorPeak() as ap:`` ... ``with ap.window("build"):`` ...; then
    ``ap.peaks`` {window name: peak live bytes} and ``ap.peak`` (the whole block's)."""

    def __init__(self) -> None:
        self.peaks: dict[str, int] = {}
        self.peak = 0
        self._prof = None

    def __enter__(self) -> "AllocatorPeak":
        gc.collect()  # an earlier run's garbage is not freed inside this one
        self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                            profile_memory=True)
        self._prof.__enter__()
        return self

    def window(self, name: str) -> contextlib.AbstractContextManager:
        return torch.profiler.record_function(WINDOW + name)

    def __exit__(self, *exc) -> None:
        self._prof.__exit__(*exc)
        events = self._prof.profiler.kineto_results.events()
        self.peaks, self.peak = window_peaks(
            [(e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"],
            [(e.name()[len(WINDOW):], e.start_ns(), e.end_ns()) for e in events
             if e.name().startswith(WINDOW)])
        self._prof = None


def window_peaks(reports: list[tuple[int, int]], windows: list[tuple[str, int, int]]
                 ) -> tuple[dict[str, int], int]:
    """({window: peak}, overall peak) of allocator ``reports`` (time, +/- bytes) over
    ``windows`` (name, start, end); a name given twice keeps the larger peak."""
    reports = sorted(reports)
    times = [t for t, _ in reports]
    level, levels = 0, []
    for _, nbytes in reports:
        level += nbytes
        levels.append(level)
    peaks: dict[str, int] = {}
    for name, start, end in windows:
        lo, hi = bisect.bisect_left(times, start), bisect.bisect_right(times, end)
        at_start = levels[lo - 1] if lo > 0 else 0
        peaks[name] = max(peaks.get(name, 0), at_start, *levels[lo:hi])
    return peaks, max(levels, default=0)
