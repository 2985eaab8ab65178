"""Contiguous flat buffers for ZeRO-DP (paper §5): parameters as views into one flat tensor,
this rank's shard as views of its chunks, and the bucket machinery shared by all stages.

``FlatParams`` owns one group of parameters (the whole model for stages 0-2, one unit for
stage 3). It casts them to the training dtype, lays them end to end (``partition.layout``),
pads to the bucket grid (``partition.Partition``) and re-points every ``param.data`` at its view
of the flat tensor. After that, writing the flat tensor (e.g. an all-gather of updated chunks)
updates the module's parameters in place; stage 3 additionally frees the flat storage
(``release``) and re-allocates it (``materialize``) around each use, which leaves the
parameters' views in place (their storage is resized, not replaced, so tensors autograd saved
for backward see the re-gathered values).

``InFlight`` keeps async collective handles with a completion callback, waited oldest first;
``BufferPool`` hands out constant-size fused buffers (C_B) and records its capacity for the
memory ledger. ``reduce_chunks`` / ``broadcast_chunks`` realise a bucket's reduce-scatter /
all-gather as N_d rooted reduces / broadcasts, one per chunk, in place (used on gloo, see
``rooted_collectives``). Collectives go through ``zero_repro.distributed.comm`` only.
"""
from __future__ import annotations

from collections import deque
from typing import Callable, Sequence

import torch
from torch import nn

from zero_repro.distributed import comm
from zero_repro.zero.partition import Partition, Slot, layout


def rooted_collectives() -> bool:
    """Whether bucket reduce-scatters / all-gathers run as N_d rooted reduces / broadcasts.

    Only on gloo: its reduce-scatter and all-gather are emulated and measured 1.5-2× slower
    than rooted reduces / broadcasts of the same elements (world 2, 10 buckets of 2M fp32:
    reduce-scatter 99 ms vs 2×10 reduces 65 ms; all-gather 87 ms vs 2×10 broadcasts 44 ms).
    The same elements arrive at the same ranks and the §7 ledger volume is the same (a reduce
    or broadcast of n counts n, so N_d of them over chunks of c count N_d·c = the bucket, like
    the reduce-scatter / all-gather they replace); the ledger records them as ``reduce`` /
    ``broadcast``. NCCL keeps the native collectives. The fake process group of the memory
    dry run (``simulate.dryrun``) follows gloo, so a dry run reproduces the CPU run's ledger
    exactly; for an NCCL run it then under-counts only constant-size buffers (``comm_buffers``:
    stage 1 two pooled C_B/N_d gather + reduce-scatter buffers, stage 2 the reduce-scatter
    output halves, stage 3 one unit-shard output per reduction in flight), never model states."""
    return comm.backend() in ("gloo", "fake")


def reduce_chunks(buf: torch.Tensor, chunk: int, group: comm.Group) -> list:
    """Reduce-scatter of ``buf`` (group.size chunks of ``chunk`` elements) as one async reduce
    per chunk to its owner, in place: afterwards this rank's chunk of ``buf`` holds the sum over
    ranks and the other chunks are undefined. Returns the work handles."""
    return [comm.reduce(buf[k * chunk:(k + 1) * chunk], k, group, async_op=True)
            for k in range(group.size)]


def broadcast_chunks(buf: torch.Tensor, chunk: int, group: comm.Group) -> list:
    """All-gather in place: this rank's chunk of ``buf`` must hold its values; afterwards every
    chunk holds its owner's. One async broadcast per chunk; returns the work handles."""
    return [comm.broadcast(buf[k * chunk:(k + 1) * chunk], k, group, async_op=True)
            for k in range(group.size)]


class FlatParams:
    """One flat, padded, bucketed buffer holding a group of parameters."""

    def __init__(self, name: str, named_params: Sequence[tuple[str, nn.Parameter]],
                 dtype: torch.dtype, world: int, bucket_capacity: int):
        self.name = name
        self.params = [p for _, p in named_params]
        self.slots, numel = layout([n for n, _ in named_params],
                                   [tuple(p.shape) for _, p in named_params])
        self.partition = Partition(numel, world, bucket_capacity)
        self.dtype = dtype
        self.flat = torch.zeros(self.partition.padded_numel, dtype=dtype)  # (padded,)
        with torch.no_grad():
            for s, p in zip(self.slots, self.params):
                self.flat[s.offset:s.end].copy_(p.detach().reshape(-1))
        for s, p in zip(self.slots, self.params):
            p.data = self.view(s)
        self.slot_of = {id(p): s for s, p in zip(self.slots, self.params)}

    # ------------------------------------------------------------------ views
    def view(self, slot: Slot) -> torch.Tensor:
        return self.flat[slot.offset:slot.end].view(slot.shape)

    @property
    def numel(self) -> int:
        return self.partition.numel

    def owned_chunks(self, rank: int) -> list[torch.Tensor]:
        """Views of the chunks of ``flat`` that ``rank`` owns, one per bucket."""
        return [self.flat[b.owned(rank)[0]:b.owned(rank)[1]] for b in self.partition.buckets]

    # ------------------------------------------------------------------ stage 3 storage
    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def is_materialized(self) -> bool:
        return self.flat.untyped_storage().nbytes() == self.nbytes

    def release(self) -> None:
        """Free the flat storage; the parameter views keep their metadata (no data)."""
        self.flat.untyped_storage().resize_(0)

    def materialize(self) -> None:
        """Re-allocate the flat storage (contents undefined until written)."""
        if not self.is_materialized():
            self.flat.untyped_storage().resize_(self.nbytes)


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
                 max_buffers: int = 2):
        self.numel, self.dtype, self.inflight = int(numel), dtype, inflight
        self.max_buffers = max_buffers
        self._free: list[torch.Tensor] = []
        self.allocated = 0

    def acquire(self) -> torch.Tensor:
        while (not self._free and self.allocated >= self.max_buffers
               and self.inflight is not None and len(self.inflight)):
            self.inflight.wait_oldest()
        if self._free:
            return self._free.pop()
        self.allocated += 1
        return torch.empty(self.numel, dtype=self.dtype)

    def release(self, buf: torch.Tensor) -> None:
        self._free.append(buf)

    @property
    def capacity_bytes(self) -> int:
        # counted at capacity: the buffers this pool may hold, allocated or not yet
        n = max(self.allocated, self.max_buffers)
        return n * self.numel * torch.empty((), dtype=self.dtype).element_size()


class PeakBytes:
    """High-water mark of transient allocations (stage 3 gathered units and grad buffers)."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0

    def alloc(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def free(self, nbytes: int) -> None:
        self.live -= nbytes


class GradShards:
    """This rank's reduced gradient shard, one piece per bucket (stages 2 and 3).

    M_D (paper §6.3) on: one pre-allocated contiguous buffer of Ψ/N_d elements and a view per
    piece, so the long-lived gradient shard never interleaves with short-lived tensors. Off: each
    piece is allocated when its first reduced gradient arrives (the fragmenting behaviour M_D
    removes). Pieces accumulate across micro-batches until ``zero``.
    """

    def __init__(self, sizes: Sequence[int], dtype: torch.dtype, contiguous: bool):
        self.buffer = torch.zeros(sum(sizes), dtype=dtype) if contiguous else None  # (Ψ/N_d,)
        self.pieces: list[torch.Tensor | None] = [None] * len(sizes)
        if self.buffer is not None:
            offsets = [0]
            for n in sizes:
                offsets.append(offsets[-1] + n)
            self.pieces = [self.buffer[a:b] for a, b in zip(offsets, offsets[1:])]

    def accumulate(self, index: int, reduced: torch.Tensor) -> None:
        if self.pieces[index] is None:
            self.pieces[index] = reduced.clone()  # M_D off: allocated as it arrives
        else:
            self.pieces[index].add_(reduced)

    def chunks(self) -> list[torch.Tensor | None]:
        return list(self.pieces)

    def zero(self) -> None:
        if self.buffer is not None:
            self.buffer.zero_()
        else:
            self.pieces = [None] * len(self.pieces)
