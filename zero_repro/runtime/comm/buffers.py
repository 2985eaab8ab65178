"""Async-collective bookkeeping shared by the bucket transports and the ZeRO-DP stages.

``InFlight`` keeps async collective handles with a completion callback, waited oldest first;
``BufferPool`` hands out constant-size buffers (C_B, paper §6.3: optionally buffers the caller
made, e.g. shared memory the peers read) and reports its capacity for the memory ledger;
``NoBuffers`` is the scratch pool of a transport that works in place (holds nothing).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch


class InFlight:
    """Async collective handles, each with a callback run after it completes (oldest first)."""

    def __init__(self, max_in_flight: int = 2):
        self.max_in_flight = max(1, max_in_flight)
        self._q: deque = deque()

    def __len__(self) -> int:
        return len(self._q)

    def launch(self, works: list, on_done: Callable[[], None]) -> None:
        while len(self._q) >= self.max_in_flight:
            self.wait_oldest()
        self._q.append((works, on_done))

    def wait_oldest(self) -> None:
        works, on_done = self._q.popleft()
        for w in works:
            if w is not None:
                w.wait()
        on_done()

    def wait_all(self) -> None:
        while self._q:
            self.wait_oldest()


class BufferPool:
    """Fixed-capacity buffers of ``numel`` elements (a C_B fused buffer each).

    ``acquire`` prefers a free buffer, then allocates up to ``max_buffers`` (2 = one buffer
    being filled while the previous one is on the wire), then waits for the oldest in-flight
    collective (whose callback ``release``s its buffer); it grows past ``max_buffers`` only when
    nothing is in flight. ``capacity_bytes`` is what the ledger counts.
    """

    def __init__(self, numel: int, dtype: torch.dtype, inflight: InFlight | None = None,
                 max_buffers: int = 2, device: torch.device | str = "cpu",
                 buffers: list[torch.Tensor] | None = None,
                 before_write: Callable[[torch.Tensor], None] | None = None):
        self.numel, self.dtype, self.inflight = int(numel), dtype, inflight
        self.device = torch.device(device)  # the ranks' device: the buffers go on the wire
        self.max_buffers = max_buffers
        # ``buffers``: made by the caller (e.g. ``shared_buffer``s the peers read in place,
        # handed out in the same order on every rank); ``before_write(buf)`` runs on each one
        # handed out (their ``fence``: the peers have read what it held)
        self._free: list[torch.Tensor] = list(buffers or [])
        self.allocated = len(self._free)
        self.before_write = before_write

    def acquire(self) -> torch.Tensor:
        while (not self._free and self.allocated >= self.max_buffers
               and self.inflight is not None and len(self.inflight)):
            self.inflight.wait_oldest()
        if self._free:
            buf = self._free.pop()
            if self.before_write is not None:
                self.before_write(buf)
            return buf
        self.allocated += 1
        return torch.empty(self.numel, dtype=self.dtype, device=self.device)

    def release(self, buf: torch.Tensor) -> None:
        self._free.append(buf)

    @property
    def capacity_bytes(self) -> int:
        # counted at capacity: the buffers this pool may hold, allocated or not yet
        n = max(self.allocated, self.max_buffers)
        return n * self.numel * self.dtype.itemsize


class NoBuffers:
    """The scratch pool of an in-place transport: hands out empty tensors, holds no memory."""

    def __init__(self, dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.dtype, self.device = dtype, torch.device(device)
        self.capacity_bytes = 0

    def acquire(self) -> torch.Tensor:
        return torch.empty(0, dtype=self.dtype, device=self.device)

    def release(self, buf: torch.Tensor) -> None:
        return None
