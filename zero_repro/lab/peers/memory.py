"""One accounting of a rank's memory for every framework of the peers race: the live bytes of
the tensor storages a framework creates, and their peak (``LivePeak``), beside the process's
max RSS (``max_rss``) as a cross-check.

``LivePeak`` is a ``TorchDispatchMode``: while it is active, every storage an op creates (an
output that aliases none of the op's inputs: Python ops, the frameworks' C++ calls through the
dispatcher, c10d) is counted once until it dies (a weak reference on the storage), and
``UntypedStorage.resize_`` changes its size (FSDP2 and zero_repro's stage 3 free gathered
parameters that way). A storage mapped from a shared file (``from_file(shared=True)``: memory
every rank of a group maps, e.g. zero_repro's shared-memory buckets) counts 1/N of its bytes on
each of the N ranks mapping it, as the kernel's proportional set size does, so memory one rank
maps from its peers is not counted twice. Storages that existed before (the training batches)
are not the framework's. Each framework has its own tracker, active during its build and its
untimed steps (the dispatch costs time); storages it counted stay counted, and leave the count
when they die, whichever tracker is active. torch's ``MemTracker``
(torch/distributed/_tools/mem_tracker.py) takes the same approach, with per-module attribution
this race does not need.
"""
from __future__ import annotations

import resource
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_OWNER: dict[int, tuple["LivePeak", int]] = {}  # storage (cdata) -> (tracker, counted bytes)
_RESIZE = torch.UntypedStorage.resize_


def _resize(st: torch.UntypedStorage, n: int):
    out = _RESIZE(st, n)
    hit = _OWNER.get(st._cdata)
    if hit is not None:
        tracker, counted = hit
        now = st.nbytes() // tracker._share.get(st._cdata, 1)
        _OWNER[st._cdata] = (tracker, now)
        tracker._add(now - counted)
    return out



def _storages(xs) -> list[torch.UntypedStorage]:
    out = []
    for x in tree_flatten(xs)[0]:
        if isinstance(x, torch.Tensor) and x.device.type != "meta":
            out.append(x.untyped_storage())
    return out


class LivePeak(TorchDispatchMode):
    """Live storage bytes of what is created while active, and their peak (module docstring);
    ``world``: the ranks that map a shared file (its bytes count 1/``world`` here)."""

    def __init__(self, world: int = 1):
        super().__init__()
        torch.UntypedStorage.resize_ = _resize  # every tracker's storages, whichever is active
        self.world = world
        self.live = 0
        self.peak = 0
        self._share: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}

    def _add(self, n: int) -> None:
        self.live += n
        self.peak = max(self.peak, self.live)

    def _gone(self, cdata: int) -> None:
        _, counted = _OWNER.pop(cdata, (None, 0))
        self._refs.pop(cdata, None)
        self._share.pop(cdata, None)
        self.live -= counted

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(getattr(t, "__name__", "") == "DTensor" for t in types):
            return NotImplemented  # let DTensor run its local ops under this mode
        kwargs = kwargs or {}
        res = func(*args, **kwargs)
        inputs = {st._cdata for st in _storages((args, kwargs))}
        shared = func is torch.ops.aten.from_file.default and bool(
            kwargs.get("shared", args[1] if len(args) > 1 else False))
        for st in _storages(res):
            key = st._cdata
            if key in inputs or key in _OWNER:
                continue
            share = self.world if shared else 1
            n = st.nbytes() // share
            self._share[key] = share
            self._refs[key] = weakref.ref(st, lambda _, key=key: self._gone(key))
            _OWNER[key] = (self, n)
            self._add(n)
        return res


def max_rss() -> int:
    """The process's peak resident set (bytes; Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss() -> int:
    """The process's resident set now (bytes), from /proc/self/statm."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * resource.getpagesize()
    except OSError:
        return 0
