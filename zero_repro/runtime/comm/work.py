"""What every bucket transport shares: the handle a collective returns (``Work``) and the
transport's own bounded scratch (``Scratch``). Neither is seen by a ZeRO stage beyond
``Work.wait``.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from zero_repro.runtime.comm import comm


class Work:
    """A started collective. ``wait()`` returns once its result is in place and its inputs may
    be written again (every backend handle waited, then ``then`` run); a second ``wait()`` does
    nothing, so a transport may wait a collective early (to reuse its scratch) and the stage
    waits it again later."""

    def __init__(self, handles=(), then: Callable[[], object] | None = None):
        self._handles, self._then, self.done = list(handles), then, False

    def wait(self) -> None:
        if self.done:
            return
        self.done = True
        handles, then, self._handles, self._then = self._handles, self._then, [], None
        for h in handles:
            h.wait()
        if then is not None:  # dropped once run: a ``then`` that names this Work (``Scratch``)
            then()  # would otherwise hold its buffers in a cycle until the collector runs


DONE = Work()
DONE.done = True


class Scratch:
    """At most ``depth`` scratch buffers of the torch heap, each lent to one collective until
    it is waited: a collective that finds none free first waits for the oldest one in flight,
    so at most ``depth`` of the transport's collectives that need scratch are in flight. Every
    buffer has the size of the largest request so far (a smaller one is dropped once free);
    they are allocated as first needed, so ``nbytes``, what is allocated, is that size times
    the most collectives that held scratch at once."""

    def __init__(self, depth: int, device: torch.device | str):
        self.depth, self.device = depth, torch.device(device)
        self.numel, self.dtype = 0, None
        self.free: list[torch.Tensor] = []
        self.lent: deque[Work] = deque()  # collectives holding a buffer (``.scratch``)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.free + [w.scratch for w in self.lent])

    def _take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if numel > self.numel or dtype != self.dtype:  # larger (or other) requests from now on
            self.numel, self.dtype = max(numel, self.numel if dtype == self.dtype else 0), dtype
            self.free = []
        while not self.free and len(self.lent) >= self.depth:
            self.lent[0].wait()  # the oldest collective: its buffer comes back
        if self.free:
            return self.free.pop()
        return torch.empty(self.numel, dtype=self.dtype, device=self.device)

    def _give_back(self, buf: torch.Tensor) -> None:
        if buf.numel() == self.numel and buf.dtype == self.dtype:
            self.free.append(buf)

    def run(self, numel: int, dtype: torch.dtype,
            start: Callable[[torch.Tensor], tuple[list, Callable[[], object] | None]]) -> Work:
        """A collective on ``numel`` elements of scratch: ``start(buf)`` issues it and returns
        (backend handles, what to run once they complete); the buffer returns to the pool
        after that."""
        buf = self._take(numel, dtype)
        handles, then = start(buf[:numel])

        def finish():
            if then is not None:
                then()
            self.lent.remove(work)
            self._give_back(buf)

        work = Work(handles, finish)
        work.scratch = buf
        self.lent.append(work)
        return work


def own_chunk(buf: torch.Tensor, group: comm.Group) -> torch.Tensor:
    """This rank's chunk of a bucket ``buf`` split over ``group``."""
    c = buf.numel() // group.size
    return buf[group.rank * c:(group.rank + 1) * c]


def peers(group: comm.Group) -> list[int]:
    """The other ranks of ``group``, in rank order."""
    return [q for q in range(group.size) if q != group.rank]


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether contiguous ``a`` and ``b`` share elements of one storage (by storage identity
    and offsets: ``data_ptr`` is 0 for every meta tensor of a dry run)."""
    if a.untyped_storage()._cdata != b.untyped_storage()._cdata:
        return False
    a0, b0 = a.storage_offset(), b.storage_offset()
    return a0 < b0 + b.numel() and b0 < a0 + a.numel()
