"""Memory categories of a dry-run trace: where the memory went at the peak (paper §10.5, Figure 7's
max cached memory split into what holds it).

``CategoryTracer`` (an ``AllocationTracer``) keeps a current category, set by its
``category(name)`` context manager (or the module-level ``category``, a no-op without an active
tracer), and records ``category_of[sid]`` for every storage allocated under it; the trace events
are unchanged, so every consumer of the trace is too. Storages allocated with no category are
attributed by phase (build -> build_transient, step -> step_transient, else other).

``breakdown(events, category_of, host_sids)`` replays the device trace through the caching-
allocator model and reports, at the event where the reserved bytes peak (among those, the most
handed out), the live requested bytes per category plus three allocator terms:
    allocator_slack   = handed-out (rounded) bytes - requested bytes   (512 B rounding, unsplit
                        block remainders <= 1 MiB)
    stream_held       = blocks freed by Python but held for a collective's stream (PyTorch 1.x
                        recordStream, ``allocator`` module docstring; 0 without streams)
    cached_free       = reserved - handed-out - held bytes
Invariant: sum(categories) + allocator_slack + stream_held + cached_free == peak_reserved.
"""
from __future__ import annotations

import contextlib

import torch

from zero_repro.scale.dryrun import allocator as A
from zero_repro.scale.dryrun.tracer import ALLOC, HELD, SYNC, AllocationTracer
from zero_repro.scale.dryrun.stack import switches as S

_ACTIVE: list["CategoryTracer"] = []  # the tracer(s) currently recording, innermost last


class CategoryTracer(AllocationTracer):
    """``AllocationTracer`` that also records which category each storage belongs to."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.current: str | None = None
        self.category_of: dict[int, str] = {}
        self.module: str | None = None  # the innermost module running its forward (``tag_modules``)
        self.module_of: dict[int, str] = {}  # sid -> that module's qualified name at allocation

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
            if self.module is not None:
                self.module_of[sid] = self.module
        super()._record(kind, sid, nbytes)


def _by_phase(phase: str) -> str:
    # untagged forward/backward storages are the working layer's (activations, their
    # gradients, a recompute's intermediates, transient parameter gradients)
    return {"build": S.BUILD, "step": S.STEP_TEMP, "forward": S.WORKING_LAYER,
            "backward": S.WORKING_LAYER}.get(phase, S.OTHER)


def tag(tracer: "CategoryTracer", tensors, name: str) -> None:
    """Attribute the storages of ``tensors`` (alive now) to category ``name``, whatever was
    current when they were allocated (e.g. checkpoints kept after a forward)."""
    for t in tensors:
        if isinstance(t, torch.Tensor):
            sid = tracer.sid_of(t)
            if sid is not None:
                tracer.category_of[sid] = name


def tag_strategy(tracer: "CategoryTracer", strategy) -> None:
    """Categories of the runtime strategy's own storages (``zero.stage*``; a no-op for the
    DeepSpeed 0.2 path, which tags its allocations itself): flat parameter buffers, fp32 master
    and Adam moments, gradient buffers/shards, fused buckets and gather scratch. Called after
    each step, while the pools hold their buffers."""
    opt = getattr(strategy, "opt", None)
    if opt is not None:
        tag(tracer, (opt.master, opt.exp_avg, opt.exp_avg_sq), S.MASTER_ADAM)
    for g in getattr(strategy, "groups", ()):
        tag(tracer, (g.flat,), S.FP16_PARAMS)
    # stage 3's vocabulary table gathered a row slice at a time: its two slice buffers
    tag(tracer, getattr(getattr(strategy, "params", None), "row_buffers", ()), S.FP16_PARAMS)
    grads = getattr(strategy, "grads", None)
    if grads is not None and not isinstance(grads, dict):
        tag(tracer, [getattr(grads, "buffer", None)] + list(getattr(grads, "pieces", ())),
            S.GRAD_PARTITION)
    for attr, name in (("pool", S.BUCKETS), ("rs_pool", S.BUCKETS), ("ag_pool", S.GATHER)):
        tag(tracer, getattr(getattr(strategy, attr, None), "_free", ()), name)


def tag_model(tracer: "CategoryTracer", model) -> list:
    """Forward hooks that attribute the final LayerNorm, LM head and loss of ``model.gpt.GPT``
    to logits/loss (the 2019 model tags them itself). Returns the hook handles."""
    if getattr(model, "stack", None) is not None or not hasattr(model, "ln_f"):
        return []

    def enter(_mod, _args):
        tracer.current = S.LOGITS_LOSS

    def leave(_mod, _args, _out):
        tracer.current = None

    return [model.ln_f.register_forward_pre_hook(enter), model.register_forward_hook(leave)]


def tag_modules(tracer: "CategoryTracer", model) -> list:
    """Forward pre/post hooks on every submodule of ``model`` that keep ``tracer.module`` the
    qualified name of the innermost module running (its forward, or its recompute under
    activation checkpointing, whose early stop raises out of it: ``always_call``), so each
    storage records the module that made it (``module_of``; the memory snapshot's frames).
    Returns the hook handles."""
    stack: list = []

    def enter(name):
        def hook(_mod, _args):
            stack.append(tracer.module)
            tracer.module = name
        return hook

    def leave(_mod, _args, _out):
        tracer.module = stack.pop() if stack else None

    handles = []
    for name, mod in model.named_modules():
        if name:
            handles += [mod.register_forward_pre_hook(enter(name)),
                        mod.register_forward_hook(leave, always_call=True)]
    return handles


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
    "stream_held", "stream_held_categories" (the held blocks' bytes by the category of the
    storage that held them), "cached_free", "live_peak", "live_peak_categories"} (bytes)."""
    dev = [e for e in events if e[1] not in host_sids]
    alloc = A.CachingAllocator(capacity)
    blocks: dict[int, tuple] = {}
    held: dict[int, tuple] = {}  # block id -> (sid, block size) of the held blocks
    best = (-1, 0, 0, 0, 0, {})  # (reserved, index, allocated, requested, held, held blocks)
    live = live_best = live_at = 0
    for i, (kind, sid, nbytes, *_rest) in enumerate(dev):
        if kind == ALLOC:
            blocks[sid] = (alloc.malloc(nbytes), nbytes)
            if not alloc._held:
                held.clear()  # returned to the pool (an allocation that failed reclaims)
            live += nbytes
            # the fullest moment of the peak: max reserved, then the most of it handed out
            if (alloc.reserved, alloc.allocated) > (best[0], best[2]):
                best = (alloc.reserved, i + 1, alloc.allocated, alloc.requested, alloc.held,
                        dict(held))
            if live > live_best:
                live_best, live_at = live, i + 1
        elif kind == SYNC:
            alloc.sync()
            held.clear()
        else:
            blk = blocks.pop(sid, None)
            if blk is not None:
                if kind == HELD:
                    held[id(blk[0])] = (sid, blk[0].size)
                alloc.free(*blk, held=kind == HELD)
                live -= blk[1]
    reserved, at, allocated, requested, held_bytes, held_at = best
    by_cat: dict[str, int] = {}
    for sid, size in held_at.values():
        cat = category_of.get(sid, S.OTHER)
        by_cat[cat] = by_cat.get(cat, 0) + size
    return {"peak_reserved": max(reserved, 0), "at_event": at,
            "categories": live_by_category(dev, category_of, at),
            "allocator_slack": allocated - requested, "stream_held": held_bytes,
            "stream_held_categories": by_cat,
            "cached_free": reserved - allocated - held_bytes,
            "live_peak": live_best,
            "live_peak_categories": live_by_category(dev, category_of, live_at)}


def format_breakdown(b: dict, unit: float = 2**30) -> str:
    """A small table (GiB by default) of ``breakdown``'s result."""
    rows = sorted(b["categories"].items(), key=lambda kv: -kv[1])
    rows += [("allocator_slack", b["allocator_slack"]),
             ("stream_held", b.get("stream_held", 0)), ("cached_free", b["cached_free"])]
    lines = [f"{name:<20s} {v / unit:10.3f}" for name, v in rows]
    lines.append(f"{'peak_reserved':<20s} {b['peak_reserved'] / unit:10.3f}")
    return "\n".join(lines)
