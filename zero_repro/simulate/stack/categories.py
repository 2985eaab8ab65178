"""Memory categories of a dry-run trace: "where did the memory go" at the peak (paper §10.5,
Figure 7's max cached memory split into what holds it).

Today's trace events ``(kind, sid, nbytes, phase, iteration)`` carry no category. The minimal
mechanism added here: ``CategoryTracer`` (an ``AllocationTracer``) keeps a current category,
set by the ``tracer.category(name)`` context manager (or the module-level ``category`` helper,
which is a no-op when no tracer is active), and records ``category_of[sid]`` for every storage
allocated while it is set. The event tuples stay as they are, so the allocator replay and
every existing consumer are unchanged. Storages allocated with no category set are
attributed by phase (build -> build_transient, step -> step_transient, else other).

``breakdown(events, category_of, host_sids)`` replays the device trace through the caching-
allocator model and reports, at the point where the reserved bytes peak ("max cached"), the
live requested bytes per category plus two allocator terms:
    allocator_slack   = handed-out (rounded) bytes - requested bytes   (512 B rounding, unsplit
                        block remainders <= 1 MiB)
    cached_free       = reserved - handed-out bytes                     (cached, not in use)
so that sum(categories) + allocator_slack + cached_free == peak_reserved exactly.
"""
from __future__ import annotations

import contextlib

from zero_repro.simulate import allocator as A
from zero_repro.simulate.dryrun import ALLOC, AllocationTracer
from zero_repro.simulate.stack import switches as S

_ACTIVE: list["CategoryTracer"] = []  # the tracer(s) currently recording, innermost last


class CategoryTracer(AllocationTracer):
    """``AllocationTracer`` that also records which category each storage belongs to."""

    def __init__(self) -> None:
        super().__init__()
        self.current: str | None = None
        self.category_of: dict[int, str] = {}

    @contextlib.contextmanager
    def category(self, name: str):
        old, self.current = self.current, name
        try:
            yield
        finally:
            self.current = old

    def __enter__(self):
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE.remove(self)
        return super().__exit__(*exc)

    def _record(self, kind: str, sid: int, nbytes: int) -> None:
        if kind == ALLOC and sid not in self.category_of:
            self.category_of[sid] = self.current or _by_phase(self.phase)
        super()._record(kind, sid, nbytes)


def _by_phase(phase: str) -> str:
    return {"build": S.BUILD, "step": S.STEP_TEMP}.get(phase, S.OTHER)


@contextlib.contextmanager
def category(name: str):
    """Tag allocations made inside with ``name`` on the active ``CategoryTracer`` (if any)."""
    if not _ACTIVE:
        yield
        return
    with _ACTIVE[-1].category(name):
        yield


def live_by_category(events, category_of: dict[int, str], upto: int | None = None
                     ) -> dict[str, int]:
    """Live bytes per category after the first ``upto`` events (all when None)."""
    live: dict[int, tuple[str, int]] = {}
    for kind, sid, nbytes, *_ in events[:upto]:
        if kind == ALLOC:
            live[sid] = (category_of.get(sid, S.OTHER), nbytes)
        else:
            live.pop(sid, None)
    out: dict[str, int] = {}
    for cat, nbytes in live.values():
        out[cat] = out.get(cat, 0) + nbytes
    return out


def breakdown(events, category_of: dict[int, str], host_sids=frozenset(),
              capacity: float | None = None) -> dict:
    """Per-category bytes at the peak of reserved memory of the device trace ``events``.

    Returns {"peak_reserved", "at_event", "categories": {cat: bytes}, "allocator_slack",
    "cached_free", "live_peak", "live_peak_categories"} (bytes)."""
    dev = [e for e in events if e[1] not in host_sids]
    alloc = A.CachingAllocator(capacity)
    blocks: dict[int, tuple] = {}
    best = (-1, 0, 0, 0)  # (reserved, index, allocated, requested)
    live = live_best = live_at = 0
    for i, (kind, sid, nbytes, *_rest) in enumerate(dev):
        if kind == ALLOC:
            blocks[sid] = (alloc.malloc(nbytes), nbytes)
            live += nbytes
            if alloc.reserved > best[0]:
                best = (alloc.reserved, i + 1, alloc.allocated, alloc.requested)
            if live > live_best:
                live_best, live_at = live, i + 1
        else:
            blk = blocks.pop(sid, None)
            if blk is not None:
                alloc.free(*blk)
                live -= blk[1]
    reserved, at, allocated, requested = best
    return {"peak_reserved": max(reserved, 0), "at_event": at,
            "categories": live_by_category(dev, category_of, at),
            "allocator_slack": allocated - requested, "cached_free": reserved - allocated,
            "live_peak": live_best,
            "live_peak_categories": live_by_category(dev, category_of, live_at)}


def format_breakdown(b: dict, unit: float = 2**30) -> str:
    """A small table (GiB by default) of ``breakdown``'s result."""
    rows = sorted(b["categories"].items(), key=lambda kv: -kv[1])
    rows += [("allocator_slack", b["allocator_slack"]), ("cached_free", b["cached_free"])]
    lines = [f"{name:<20s} {v / unit:10.3f}" for name, v in rows]
    lines.append(f"{'peak_reserved':<20s} {b['peak_reserved'] / unit:10.3f}")
    return "\n".join(lines)
