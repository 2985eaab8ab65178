"""Bucket bookkeeping shared by the ZeRO-DP stages (paper §5, buckets of C_B elements, §6.3).

A bucket is a consecutive range of a group's flat layout (``partition.Bucket``), so the
gradients of its parameters become ready together in backward. What every bucketed stage needs:

* ``bucket_pieces`` / ``slot_pieces``: where each parameter (slot) lies in which bucket;
* ``Arrivals``: how many real (non-padding) gradient elements of each bucket have arrived, so a
  bucket is launched the moment it is complete, overlapping the rest of backward;
* ``FullGrads``: the full training-dtype gradient in the flat layout, accumulated over
  micro-batches and reduced bucket by bucket in place on the last one (stages 0 and 1; stage 0
  all-reduces a bucket, stage 1 reduce-scatters it);
* ``gather_updated``: the all-gather of every bucket's updated chunks into the flat parameters
  after the step (stages 1 and 2; Ψ elements per step).

Communication itself goes through the group's transport (``distributed.transport``).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from zero_repro.distributed.transport import BufferPool, InFlight, NoBuffers, Transport
from zero_repro.zero.flat_buffer import FlatParams
from zero_repro.zero.partition import Bucket, Partition, Slot, intersect


def bucket_pieces(part: Partition, s: Slot) -> Iterator[tuple[Bucket, int, int]]:
    """(bucket, flat lo, flat hi) of every piece of slot ``s``, in bucket order."""
    for b in part.buckets_of(s.offset, s.numel):
        lo, hi = intersect(b.start, b.end, s.offset, s.end)
        yield b, lo, hi


def slot_pieces(g: FlatParams) -> list[list[tuple[int, int, int]]]:
    """Per bucket: (slot index, flat lo, flat hi) of every slot piece inside it."""
    pieces: list[list[tuple[int, int, int]]] = [[] for _ in g.partition.buckets]
    for i, s in enumerate(g.slots):
        for b, lo, hi in bucket_pieces(g.partition, s):
            pieces[b.index].append((i, lo, hi))
    return pieces


class Arrivals:
    """Real gradient elements arrived per bucket since the last reset."""

    def __init__(self, part: Partition):
        self.part = part
        self.count = [0] * len(part.buckets)

    def add(self, b: Bucket, n: int) -> bool:
        """Count ``n`` more elements of ``b``; True when the bucket is now complete."""
        self.count[b.index] += n
        return self.count[b.index] == self.part.real_in_bucket(b)

    def complete(self, b: Bucket) -> bool:
        return self.count[b.index] >= self.part.real_in_bucket(b)

    def reset(self, b: Bucket | None = None) -> None:
        if b is None:
            self.count = [0] * len(self.count)
        else:
            self.count[b.index] = 0


class FullGrads:
    """Full local gradients of one flat group, reduced in place bucket by bucket (stages 0, 1).

    ``zero`` does not write the buffer: it marks every slot as empty; the first gradient of a
    slot after it is copied in (instead of added to zeros), and the slots that got no gradient
    at all are zeroed when their bucket is launched. Same result as zeroing, one pass over Ψ
    less per step. ``reduce(bucket, buf)`` launches the collective on the bucket's range ``buf``
    (already divided by N_d, so the sum is the mean over DP ranks).
    """

    def __init__(self, g: FlatParams, n_d: int, reduce: Callable[[Bucket, torch.Tensor], None]):
        self.group, self.n_d, self.reduce = g, n_d, reduce
        self.buffer = torch.zeros_like(g.flat)  # (padded,) persistent full gradients
        self.arrivals = Arrivals(g.partition)
        self.launched = [False] * len(g.partition.buckets)
        self.slot_idx = {id(p): i for i, p in enumerate(g.params)}
        self.written = [False] * len(g.slots)  # slot got a gradient since zero()
        self.pieces = slot_pieces(g)

    @torch.no_grad()
    def add(self, p: nn.Parameter, launch: bool) -> None:
        """Accumulate ``p.grad`` (then drop it); ``launch``: last micro-batch, reduce the
        buckets this completes."""
        s = self.group.slot_of[id(p)]
        i = self.slot_idx[id(p)]
        if self.written[i]:
            self.buffer[s.offset:s.end].add_(p.grad.reshape(-1))
        else:
            self.buffer[s.offset:s.end].copy_(p.grad.reshape(-1))
            self.written[i] = True
        p.grad = None  # the flat buffer is the only persistent gradient storage
        if not launch:
            return  # accumulate locally; reduce on the last micro-batch only
        for b, lo, hi in bucket_pieces(self.group.partition, s):
            if self.arrivals.add(b, hi - lo):
                self.launch(b)

    def launch_remaining(self) -> None:
        for b in self.group.partition.buckets:
            if not self.launched[b.index]:
                self.launch(b)

    def launch(self, b: Bucket) -> None:
        self.launched[b.index] = True
        for i, lo, hi in self.pieces[b.index]:
            if not self.written[i]:  # no gradient since zero(): reduce zeros
                self.buffer[lo:hi].zero_()
        numel = self.group.partition.numel
        if b.end > numel:  # padding: a rooted reduce may leave it undefined on non-owners
            self.buffer[max(b.start, numel):b.end].zero_()
        buf = self.buffer[b.start:b.end]
        if self.n_d > 1:
            buf.div_(self.n_d)  # mean over DP ranks; dividing first keeps fp16 sums in range
        self.reduce(b, buf)

    def end_step(self) -> None:
        """After the reductions completed: the next backward starts counting afresh."""
        self.arrivals.reset()
        self.launched = [False] * len(self.launched)

    def chunks(self, rank: int) -> list[torch.Tensor]:
        return [self.buffer[b.owned(rank)[0]:b.owned(rank)[1]]
                for b in self.group.partition.buckets]

    def zero(self) -> None:
        self.written = [False] * len(self.written)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


def gather_updated(g: FlatParams, transport: Transport,
                   pool: BufferPool | NoBuffers, inflight: InFlight) -> None:
    """All-gather every bucket's owned chunk (updated in place in ``g.flat``) into ``g.flat``;
    ``pool`` stages the input where the transport needs it (``scratch_pool``)."""
    for b in g.partition.buckets:
        buf = pool.acquire()
        works = transport.all_gather_in_place(g.flat[b.start:b.end], buf[:b.chunk])
        inflight.launch(works, lambda buf=buf: pool.release(buf))
    inflight.wait_all()
