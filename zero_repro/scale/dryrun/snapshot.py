"""A dry run's caching-allocator replay written as a PyTorch memory snapshot (paper §10.5: where
the "max cached memory" of Figure 7 goes, at any scale, before the run), in the format of
``torch.cuda.memory._snapshot()`` / ``_dump_snapshot`` that ``torch.cuda._memory_viz``
(``trace_plot``, ``segment_plot``, pytorch.org/memory_viz) reads.

``from_events`` replays a device trace (``tracer`` events) through ``allocator.CachingAllocator``
-- the replay the dry run judges with, same rules, same capacity -- and records what PyTorch's
allocator records with ``_record_memory_history``, per event of ``device_traces[device]``:

  * ``alloc`` (block address, requested bytes), ``free_requested`` + ``free_completed`` for a
    free; a ``free_held`` (a block a collective's stream still uses, PyTorch 1.x
    ``recordStream``) records ``free_requested`` only, its ``free_completed`` follows at the
    ``sync`` that returns it (or the failed allocation that reclaims it): until then the block
    is ``active_pending_free`` (the viewer draws it red, "waiting due to record_stream");
  * ``segment_alloc`` / ``segment_free`` (the model's ``cudaMalloc`` / the release of cached
    segments before an allocation fails), ``oom`` at the first allocation past ``capacity``;
  * ``frames``: one frame naming the module that made the storage and its category
    (``"blocks.17.attn (activation checkpoint)"``; a parameter storage last allocated after
    the build -- resized in place, a stage-3 unit gathered and released -- ``ZeRO stage 3
    gather``), the phase and step of its last allocation in its file name; ``category`` the same label (the viewer
    colours the Active Memory Timeline by it).

``segments`` hold the allocator's state at the end (blocks in address order, ``requested_size``
of each live block). Addresses are the model's virtual ones plus ``BASE``. What it must satisfy
(``stats``): the trace's peak of live requested bytes equals the replayed trace's live peak, the
peak of its segment bytes equals the replay's ``peak_reserved``, to the byte; the end state's
segments total ``reserved_end``. ``from_result`` writes a ``DryRunResult``'s judged replay --
the judged trace with its repeated step written out as often as the judge repeated it (the
steady state, as ``categories.breakdown`` reads it) -- so its reserved peak is the dry run's
``allocator["peak_reserved"]`` and its live peak the training steps' live peak.
"""
from __future__ import annotations

import pickle
import time

from zero_repro.scale.dryrun import allocator as A
from zero_repro.scale.dryrun.stack import switches as S
from zero_repro.scale.dryrun.trace import repeat_start
from zero_repro.scale.dryrun.tracer import ALLOC, HELD, SYNC

BASE = 0x7F00_0000_0000  # where the virtual addresses start (a device-looking address)
UNKNOWN = "unknown"  # the viewer's category of events without one (segment events)
LABELS = {  # category -> the label a frame shows
    S.FP16_PARAMS: "fp16 parameters", S.MASTER_ADAM: "fp32 master + Adam",
    S.GRAD_PARTITION: "gradient partition", S.BUCKETS: "C_B bucket",
    S.CHECKPOINTS: "activation checkpoint", S.WORKING_LAYER: "working layer",
    S.LOGITS_LOSS: "logits / loss", S.GATHER: "ZeRO stage 3 gather",
    S.BUILD: "build transient", S.STEP_TEMP: "optimizer step transient", S.OTHER: "other",
}


GATHERED = "ZeRO stage 3 gather"  # the label of a unit's parameters gathered in place


def label(category: str) -> str:
    return LABELS.get(category, category)


class _Recording(A.CachingAllocator):
    """The allocator model, reporting its segment events and held-block returns to ``sink``
    (the model's rules are untouched: only ``_malloc_segment``, ``release_cached`` and ``sync``
    are wrapped)."""

    def __init__(self, capacity, sink):
        super().__init__(capacity)
        self._sink = sink
        self._cap0 = capacity

    def _malloc_segment(self, small, rounded):
        if self.capacity is None and self._cap0 is not None:  # the overflow after an OOM
            self._sink.oom(rounded, self._cap0 - self.reserved)
        b = super()._malloc_segment(small, rounded)
        if b is not None:
            self._sink.segment("segment_alloc", b.addr, b.size)
        return b

    def release_cached(self):
        for head in self._seg_head.values():
            if not head.allocated and head.next is None and head.prev is None:
                self._sink.segment("segment_free", head.addr, head.size)
        return super().release_cached()

    def sync(self):
        for b in self._held:
            self._sink.completed(b)
        super().sync()


class _Sink:
    """Collects the trace entries (torch's ``TraceEntry`` as ``_snapshot`` writes them)."""

    def __init__(self, frames_of):
        self.trace: list[dict] = []
        self.frames_of = frames_of  # sid -> (frames, category label)
        self.sid_of: dict[int, int] = {}  # id(block) -> sid of the storage it holds
        self.size_of: dict[int, int] = {}  # sid -> requested bytes
        self.t = 0

    def _add(self, action, addr, size, frames=(), category=UNKNOWN, **extra):
        self.trace.append({"action": action, "addr": BASE + addr, "size": size, "stream": 0,
                           "frames": frames, "category": category, "time_us": self.t, **extra})

    def segment(self, action, addr, size):
        self._add(action, addr, size, [])

    def oom(self, rounded, free):
        self._add("oom", 0, rounded, [], device_free=max(int(free), 0))

    def alloc(self, sid, blk, nbytes):
        self.sid_of[id(blk)], self.size_of[sid] = sid, nbytes
        frames, cat = self.frames_of(sid)
        self._add("alloc", blk.addr, nbytes, frames, cat)

    def requested(self, sid, blk):
        frames, cat = self.frames_of(sid)
        self._add("free_requested", blk.addr, self.size_of[sid], frames, cat)

    def completed(self, blk):
        sid = self.sid_of.pop(id(blk))
        frames, cat = self.frames_of(sid)
        self._add("free_completed", blk.addr, self.size_of.pop(sid), frames, cat)


def _framer(events, category_of: dict, module_of: dict, rank: int, source: str):
    """sid -> (frames, label): one frame per (module, category, phase, step), shared (the
    pickle stores each once)."""
    where = {e[1]: (e[3], e[4]) for e in events if e[0] == ALLOC}
    memo: dict = {}

    def frames_of(sid):
        cat = category_of.get(sid, S.OTHER)
        mod = module_of.get(sid)
        phase, it = where.get(sid, ("?", 0))
        # a parameter storage (re)allocated after the build -- resized in place: stage 3
        # gathers a unit into its flat buffer before use and releases it after -- is a
        # gathered unit
        cat = GATHERED if cat == S.FP16_PARAMS and phase != "build" else label(cat)
        key = (mod, cat, phase, it)
        got = memo.get(key)
        if got is None:
            name = f"{mod} ({cat})" if mod else cat
            step = "build" if phase == "build" else f"{phase}, step {it}"
            got = memo[key] = ([{"name": name, "filename": f"{source} rank {rank}: {step}",
                                 "line": 0}], cat)
        return got
    return frames_of


def from_events(events, category_of: dict, module_of: dict | None = None,
                capacity: float | None = None, device: int = 0, rank: int = 0,
                meta: dict | None = None, source: str = "dry run") -> dict:
    """The snapshot of replaying device trace ``events`` (module docstring); ``source`` names
    the run in the frames (a dry run, or a real CPU run's measured trace)."""
    sink = _Sink(_framer(events, category_of, module_of or {}, rank, source))
    alloc = _Recording(capacity or None, sink)
    live: dict[int, tuple] = {}
    for i, (kind, sid, nbytes, *_rest) in enumerate(events):
        sink.t = i
        if kind == ALLOC:
            blk = alloc.malloc(nbytes)
            live[sid] = (blk, nbytes)
            if blk is not None:
                sink.alloc(sid, blk, nbytes)
        elif kind == SYNC:
            alloc.sync()
        else:
            blk = live.pop(sid, None)
            if blk is None or blk[0] is None:
                continue
            sink.requested(sid, blk[0])
            alloc.free(*blk, held=kind == HELD)
            if kind != HELD:
                sink.completed(blk[0])
    traces: list[list] = [[] for _ in range(device + 1)]
    traces[device] = sink.trace
    return {"segments": _segments(alloc, sink, device), "device_traces": traces,
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1,
                                   "expandable_segments": False},
            "dry_run": {**(meta or {}), "replay": alloc.result.as_dict()}}


def _segments(alloc: A.CachingAllocator, sink: _Sink, device: int) -> list:
    """The allocator's end state in ``_snapshot``'s layout."""
    held = {id(b) for b in alloc._held}
    out = []
    for seg in sorted(alloc._segments, key=lambda k: alloc._segments[k][0]):
        addr, size, small = alloc._segments[seg]
        blocks, b = [], alloc._seg_head[seg]
        allocated = requested = 0
        while b is not None:
            if b.allocated:
                sid = sink.sid_of[id(b)]
                req, (frames, _cat) = sink.size_of[sid], sink.frames_of(sid)
                state = "active_pending_free" if id(b) in held else "active_allocated"
                allocated, requested = allocated + b.size, requested + req
            else:
                req, frames, state = 0, [], "inactive"
            blocks.append({"address": BASE + b.addr, "size": b.size, "requested_size": req,
                           "state": state, "frames": frames})
            b = b.next
        out.append({"device": device, "address": BASE + addr, "total_size": size,
                    "allocated_size": allocated, "active_size": allocated,
                    "requested_size": requested, "stream": 0,
                    "segment_type": "small" if small else "large",
                    "segment_pool_id": (0, 0), "is_expandable": False, "frames": [],
                    "blocks": blocks})
    return out


def steady_events(result) -> list:
    """The judged trace of ``result`` (a ``DryRunResult`` with its trace) with the repeated step
    written out as often as the judged replay repeated it (same storage ids: it is closed)."""
    judged = result.judged_events()
    rep = repeat_start(judged)
    if rep is None:
        return judged
    return judged + judged[rep:] * result.allocator["repeats"]


def from_result(result, device: int = 0) -> dict:
    """The snapshot of ``result``'s judged replay (module docstring)."""
    if not result.trace:
        raise ValueError("a snapshot needs the trace: run dry_run(..., keep_trace=True)")
    meta = {"config": result.config, "stack": result.stack, "backend": result.backend,
            "judged_with_build": result.judged_with_build, "capacity": result.capacity,
            "live_peak": result.live_peak, "allocator": result.allocator,
            "kind": "simulated (dry run)"}
    return from_events(steady_events(result), result.category_of, result.module_of,
                       capacity=result.capacity or None, device=device,
                       rank=result.config.get("rank", 0), meta=meta)


def stats(snapshot: dict, device: int = 0) -> dict:
    """What a snapshot says, read back from it alone: the peak of live requested bytes over the
    trace (allocated until ``free_requested``), the peak of segment bytes (``segment_alloc`` -
    ``segment_free``), the end state's segment and block totals, event counts."""
    live = live_peak = seg = seg_peak = 0
    counts: dict[str, int] = {}
    for e in snapshot["device_traces"][device]:
        a = e["action"]
        counts[a] = counts.get(a, 0) + 1
        if a == "alloc":
            live += e["size"]
            live_peak = max(live_peak, live)
        elif a == "free_requested":
            live -= e["size"]
        elif a == "segment_alloc":
            seg += e["size"]
            seg_peak = max(seg_peak, seg)
        elif a == "segment_free":
            seg -= e["size"]
    segs = [s for s in snapshot["segments"] if s["device"] == device]
    return {"live_peak": live_peak, "reserved_peak": seg_peak,
            "segments_total": sum(s["total_size"] for s in segs),
            "requested_end": sum(s["requested_size"] for s in segs),
            "live_end": live, "n_segments": len(segs), "actions": counts}


def peak_categories(snapshot: dict, device: int = 0) -> tuple[int, dict]:
    """(live peak, {category: live bytes at its first moment}) read from the snapshot's trace
    alone (``category``: the label of ``LABELS``)."""
    live, best, at = 0, -1, 0
    trace = snapshot["device_traces"][device]
    for i, e in enumerate(trace):
        if e["action"] in ("alloc", "free_requested"):
            live += e["size"] if e["action"] == "alloc" else -e["size"]
            if live > best:
                best, at = live, i + 1
    held: dict[int, tuple[str, int]] = {}
    for e in trace[:at]:
        if e["action"] == "alloc":
            held[e["addr"]] = (e["category"], e["size"])
        elif e["action"] == "free_requested":
            held.pop(e["addr"], None)
    out: dict[str, int] = {}
    for cat, size in held.values():
        out[cat] = out.get(cat, 0) + size
    return max(best, 0), out


def write(snapshot: dict, path) -> dict:
    """Pickle ``snapshot`` to ``path`` (as ``_dump_snapshot`` does; protocol 4, which
    pytorch.org/memory_viz reads when the file is dropped on it). Returns
    {"path", "bytes", "seconds"}."""
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        pickle.dump(snapshot, f, protocol=4)  # the viewer's unpickler reads protocols 2-4
        n = f.tell()
    return {"path": str(path), "bytes": n, "seconds": time.perf_counter() - t0}


def load(path) -> dict:
    """A snapshot pickle (ours or ``torch.cuda.memory._dump_snapshot``'s)."""
    with open(path, "rb") as f:
        return pickle.load(f)


def write_result(result, path, device: int = 0) -> dict:
    """``from_result`` written to ``path``: {"path", "bytes", "seconds" (replay + pickle),
    and ``stats``}."""
    t0 = time.perf_counter()
    snap = from_result(result, device)
    out = write(snap, path)
    out["seconds"] = time.perf_counter() - t0
    return {**out, **stats(snap, device)}


def report_written(result, path, device: int = 0) -> str:
    """``write_result`` and one line saying what was written (the CLIs' ``--snapshot``)."""
    w = write_result(result, path, device)
    return (f"snapshot: {w['path']} ({w['bytes'] / 1e6:.1f} MB, {w['seconds']:.1f} s; "
            f"{sum(w['actions'].values())} events, {w['n_segments']} segments): live peak "
            f"{w['live_peak']} B, reserved peak {w['reserved_peak']} B (dry run: live "
            f"{result.live_peak} B, reserved {result.allocator['peak_reserved']} B); view it "
            f"with python -m zero_repro.lab.memory_view {w['path']}")
