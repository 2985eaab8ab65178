"""Gradient stores of the ZeRO-DP stages (paper §5, gradient buckets of R elements, §6.3).

A store takes each parameter's gradient from its post-accumulate hook (``add``), starts the
reduction of a gradient bucket (``partition.Partition.grad_buckets``) as soon as every gradient
in it has arrived (``start_grad_sync``: backward goes on while it is on the wire), waits for
the reductions before the optimizer reads them (``finish_grad_sync``) and hands the optimizer
this rank's reduced chunks (``chunks``: plain tensors, already the mean over DP ranks, still
loss-scaled). Megatron-LM's ``_ParamAndGradBucketGroup`` names the same pair.

* ``FullGrads`` (stages 0, 1; stage 2 without C_B): the full local gradient in the flat layout,
  accumulated over micro-batches and reduced in place on the last one, bucket by bucket:
  all-reduced (stage 0) or reduce-scattered into the own chunks (stages 1-2). Without C_B a
  gradient bucket is the whole model: its one fused buffer is this buffer, and the shard lives
  in it (a separate shard would hold Ψ/N_d more for nothing).
* ``FusedGrads`` (stages 2, 3): each micro-batch's gradients copied into fused buffers of one
  gradient bucket each, reduce-scattered into this rank's gradient shard (``GradShards``); the
  full gradient never exists. A pool of ``depth`` fused buffers (one being filled, one on the
  wire; C_B off: one buffer of the largest group), never more than there are gradient buckets;
  a gradient that finds every buffer filling (it arrived out of bucket order) is kept until
  one lands.

Every gradient is divided by N_d on its way in (``scale_into``), so the sum is the mean. With
replicas (``zero.shard_size`` G < N_d, the DP mesh of ``comm.topology``: HSDP's order) the
reductions above run inside the shard group (G ranks, N_d/G = R of them) and ``finish_grad_sync``
then all-reduces each owned chunk over the replicate group (``replicas``, R ranks): the sum over
all N_d ranks, Ψ/G elements per rank, 2Ψ/G in §7's count, once per step whatever the number of
micro-batches (the sum is linear: the shard group's partial sums accumulate, the replicas add
them once; not overlapped with backward). The ledger reads ``grad_bytes`` (persistent gradients)
and ``buffer_bytes`` (fused buffers). With ZeRO-Offload every stage uses ``FusedGrads`` whose
shards are the host's (``offload.HostGradShards``): each reduced chunk is copied to the host
as its reduction lands.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch
from torch import nn

from zero_repro.runtime.comm.transport import Transport
from zero_repro.runtime.comm.work import Work
from zero_repro.runtime.zero.flat_buffer import FlatParams, GradShards
from zero_repro.runtime.zero.partition import Span


def scale_into(dst: torch.Tensor, grad: torch.Tensor, n_d: int) -> None:
    """``dst = grad / n_d`` in one pass (the values of ``copy_`` then ``div_``: the same op on
    the same dtype); a plain copy when ``n_d`` is 1."""
    if n_d > 1 and grad.dtype == dst.dtype:
        torch.div(grad, n_d, out=dst)
    else:
        dst.copy_(grad)
        if n_d > 1:
            dst.div_(n_d)


def sum_replicas(chunks: list[torch.Tensor | None], replicas: Transport) -> None:
    """Each owned chunk summed over the replicate group, in place (all of them started, then
    waited): the second reduction of hierarchical sharding."""
    works = [replicas.all_reduce(c) for c in chunks if c is not None]
    for w in works:
        w.wait()


class InFlight:
    """Started collectives, each with what to run once it completes; waited oldest first."""

    def __init__(self) -> None:
        self._q: deque = deque()

    def __len__(self) -> int:
        return len(self._q)

    def add(self, works: list[Work], then: Callable[[], None] | None = None) -> None:
        self._q.append((works, then))

    def wait_oldest(self) -> None:
        works, then = self._q.popleft()
        for w in works:
            w.wait()
        if then is not None:
            then()

    def wait_all(self) -> None:
        while self._q:
            self.wait_oldest()


class FullGrads:
    """Full local gradients of one flat group, reduced in place bucket by bucket (stages 0, 1).

    ``zero`` does not write the buffer: it marks every slot as empty; the first gradient of a
    slot after it is copied in (instead of added to zeros), and the slots that got no gradient
    at all are zeroed when their bucket starts. A gradient that is the slot's only one (one
    micro-batch) is divided by N_d while it is copied in, as torch DDP's reducer does
    (``mul_out`` into the bucket view, torch/csrc/distributed/c10d/reducer.cpp); accumulated
    slots are divided when their bucket starts. The same values either way, one pass over Ψ
    less. ``all_reduce``: stage 0 (every rank then holds the whole sum), else stage 1 (each
    rank's own chunks hold their sums, the rest of the buffer is stale).
    """

    def __init__(self, g: FlatParams, n_d: int, rank: int, transport: Transport,
                 all_reduce: bool, dp_rank: int = 0, replicas: Transport | None = None):
        """``rank``: whose chunks this rank owns (0 when nothing is sharded: stage 0);
        ``dp_rank``: this rank in the DP group (stage 0: DP rank 0 carries an earlier
        backward's all-reduced sum into the next reduction, ``_carry``); ``replicas``: the
        replicate group's transport (module docstring), None without replicas."""
        self.group, self.n_d, self.rank, self.dp_rank = g, n_d, rank, dp_rank
        self.transport, self.all_reduce, self.replicas = transport, all_reduce, replicas
        part = g.partition
        self.buffer = transport.buffer(g.flat.numel(), g.flat.dtype)  # (padded,) persistent
        self.arrived = [0] * len(part.grad_buckets)
        self.started = [False] * len(part.grad_buckets)
        self.slot_idx = {id(p): i for i, p in enumerate(g.params)}
        self.written = [False] * len(g.slots)  # slot got a gradient since zero()
        self.scaled = [False] * len(g.slots)  # ... and was divided by N_d as it was copied in
        self.slots_in = [[(i, lo, hi) for i, s in enumerate(g.slots)
                          for sp, lo, hi in part.spans_of([span], s.offset, s.numel)]
                         for span in part.grad_buckets]
        self.inflight = InFlight()
        self.reduced = False  # the last micro-batch's reductions started, no step since

    @torch.no_grad()
    def add(self, p: nn.Parameter, last: bool) -> None:
        """Accumulate ``p.grad`` (then drop it); ``last``: last micro-batch, start the buckets
        this completes."""
        part = self.group.partition
        if self.reduced:
            self._carry()  # a backward after the last micro-batch's (torch-style accumulation)
        s, i = self.group.slot_of[id(p)], self.slot_idx[id(p)]
        dst, grad = self.buffer[s.offset:s.end], p.grad.reshape(-1)
        if self.written[i] and self.scaled[i]:  # the slot holds a mean: add this one's share
            dst.add_(grad / self.n_d if self.n_d > 1 else grad)
        elif self.written[i]:
            dst.add_(grad)
        elif last:  # the slot's only gradient this step: divided on the way in
            scale_into(dst, grad, self.n_d)
            self.written[i] = self.scaled[i] = True
        else:
            dst.copy_(grad)
            self.written[i] = True
        p.grad = None  # the flat buffer is the only persistent gradient storage
        if not last:
            return  # accumulate locally; reduce on the last micro-batch only
        for span, lo, hi in part.spans_of(part.grad_buckets, s.offset, s.numel):
            self.arrived[span.index] += hi - lo
            if self.arrived[span.index] == part.real_in(span):
                self._start(span)

    def _carry(self) -> None:
        """A backward after a reduced one in the same step (two ``strategy.backward`` calls
        with ``grad_accum=1``, as torch users accumulate): the reduced sum R is carried into
        the next reduction, so it ends as R + mean(g) (DDP's result). R is kept where it is
        final and reduced once more: stage 0 by DP rank 0 only (every rank holds all of it),
        stages 1-2 in each rank's own chunks (the rest of the buffer is stale); everything
        else is zeroed. Every slot then holds a mean: later gradients are divided on the way
        in. Waits for the reductions in flight first."""
        self.inflight.wait_all()
        part = self.group.partition
        for span in part.grad_buckets:
            if not self.started[span.index]:
                continue
            if self.all_reduce:
                if self.dp_rank != 0:
                    self.buffer[span.start:span.end].zero_()
                continue
            pos = span.start
            for b in part.buckets[span.first:span.stop]:
                lo, hi = b.owned(self.rank)
                self.buffer[pos:lo].zero_()
                pos = hi
            self.buffer[pos:span.end].zero_()
        n = len(self.written)  # every slot now holds zeros or a carried mean
        self.written, self.scaled = [True] * n, [True] * n
        self._new_round()

    def _new_round(self) -> None:
        self.arrived = [0] * len(self.arrived)
        self.started = [False] * len(self.started)
        self.reduced = False

    def start_grad_sync(self, last: bool = True) -> None:
        """End of the last micro-batch's backward (``last``): start every bucket not started
        yet (its missing gradients reduce as zeros). Earlier micro-batches: nothing."""
        if not last:
            return
        for span in self.group.partition.grad_buckets:
            if not self.started[span.index]:
                self._start(span)
        self.reduced = True

    def _start(self, span: Span) -> None:
        self.started[span.index] = True
        for i, lo, hi in self.slots_in[span.index]:
            if not self.written[i]:  # no gradient since zero(): reduce zeros
                self.buffer[lo:hi].zero_()
            elif not self.scaled[i] and self.n_d > 1:
                # mean over DP ranks; dividing first keeps fp16 sums in range
                self.buffer[lo:hi].div_(self.n_d)
        part, transport = self.group.partition, self.transport
        if span.end > part.numel:  # padding: a reduction may leave it undefined on non-owners
            self.buffer[max(span.start, part.numel):span.end].zero_()
        if self.all_reduce:
            works = [transport.all_reduce(self.buffer[span.start:span.end])]
        else:  # this rank's chunk of each bucket receives its sum, in place
            buckets = part.buckets[span.first:span.stop]
            works = [transport.reduce_scatter(self._own(b), self.buffer[b.start:b.end])
                     for b in buckets]
        self.inflight.add(works)

    def finish_grad_sync(self) -> None:
        """Start what is left (e.g. a step after backward under ``no_sync``), wait for every
        reduction; the next backward counts afresh."""
        self.start_grad_sync()
        self.inflight.wait_all()
        if self.replicas is not None:
            sum_replicas(self.chunks(), self.replicas)
        self._new_round()

    def _own(self, b) -> torch.Tensor:
        lo, hi = b.owned(self.rank)
        return self.buffer[lo:hi]

    def chunks(self) -> list[torch.Tensor]:
        return [self._own(b) for b in self.group.partition.buckets]

    def zero(self) -> None:
        """Forget this step's gradients (also ones reduced without a step since)."""
        self.inflight.wait_all()
        self._new_round()
        self.written = [False] * len(self.written)
        self.scaled = [False] * len(self.scaled)

    @property
    def grad_bytes(self) -> int:
        """The persistent gradient storage: the full buffer (its own chunks hold the sums)."""
        return self.buffer.numel() * self.buffer.element_size()

    buffer_bytes = 0  # buckets are reduced in place in it: no fused buffer of its own


class FusedGrads:
    """Gradients of flat groups (stage 2: the model; stage 3: one group per unit) copied into
    fused buffers, one gradient bucket each, and reduce-scattered into ``shards`` (stages 2, 3).

    A fused buffer is not zeroed when it is taken: every gradient is copied into it, divided by
    N_d on the way, and only what stays unwritten (padding, parameters without a gradient this
    micro-batch) is zeroed when the bucket starts. A bucket's reduction writes straight into the
    shard where the shard holds nothing yet this step (``GradShards.claim``), else into the
    bucket's own chunk, added to the shard once it lands. Buffers are taken in the same order on
    every rank (the same hooks fire in the same order), so a transport may place them where the
    peers read them in place. ``on_filled(group index)``: every gradient of a group has been
    copied in (stage 3 frees the unit's gathered parameters then)."""

    def __init__(self, groups: list[FlatParams], n_d: int, rank: int, transport: Transport,
                 depth: int, contiguous: bool, device: torch.device,
                 on_filled: Callable[[int], None] | None = None, shards=None,
                 replicas: Transport | None = None):
        """``shards``: where the reduced chunks go (default a ``GradShards`` on ``device``;
        ZeRO-Offload: ``offload.HostGradShards``, the host); ``replicas``: the replicate
        group's transport (module docstring), None without replicas."""
        self.groups, self.n_d, self.rank, self.transport = groups, n_d, rank, transport
        self.replicas = replicas
        self.unsummed = False  # reductions landed in the shards since the replicas' sum
        self.on_filled = on_filled
        self.where = {id(p): (gi, s) for gi, g in enumerate(groups) for s, p in zip(g.slots,
                                                                                   g.params)}
        self.first_bucket = []  # index of each group's first bucket in the shard
        n = 0
        for g in groups:
            self.first_bucket.append(n)
            n += len(g.partition.buckets)
        self.shards = shards if shards is not None else GradShards(
            [b.chunk for g in groups for b in g.partition.buckets],
            groups[0].dtype if groups else torch.float32, contiguous, device)
        n_spans = sum(len(g.partition.grad_buckets) for g in groups)
        cap = max((g.partition.capacity for g in groups), default=0)
        dtype = groups[0].dtype if groups else torch.float32
        self.free = [transport.buffer(cap, dtype) for _ in range(min(depth, n_spans))]
        # the fused buffers; the gradient shard (Ψ/N_d at its peak, also without M_D)
        self.buffer_bytes = sum(b.numel() * b.element_size() for b in self.free)
        self.grad_bytes = sum(b.chunk for g in groups for b in g.partition.buckets) * \
            torch.empty(0, dtype=dtype).element_size() if shards is None else \
            shards.device_bytes
        self.filling: dict[tuple[int, int], torch.Tensor] = {}  # (group, span) -> buffer
        self.deferred: dict[tuple[int, int], list] = {}  # (group, span) -> kept gradients
        self.arrived: dict[tuple[int, int], int] = {}
        self.got: dict[tuple[int, int], set[int]] = {}  # slots copied into a filling bucket
        self.group_arrived = [0] * len(groups)
        self.inflight = InFlight()

    @torch.no_grad()
    def add(self, p: nn.Parameter, last: bool = True) -> None:
        """Copy ``p.grad`` into the buckets it lies in (then drop it); start those it
        completes. Every micro-batch is reduced on its own (``last`` changes nothing)."""
        gi, s = self.where[id(p)]
        g = self.groups[gi]
        part, grad = g.partition, p.grad.reshape(-1)
        for span, lo, hi in part.spans_of(part.grad_buckets, s.offset, s.numel):
            key = (gi, span.index)
            part_grad = grad[lo - s.offset:hi - s.offset]
            if key in self.filling or (key not in self.deferred and self._take(key)):
                self._copy(key, s.offset, lo, part_grad)
            else:  # every buffer is filling: kept until one lands (gradients out of order)
                self.deferred.setdefault(key, []).append((s.offset, lo, part_grad))
        p.grad = None  # only the shard is kept
        self.group_arrived[gi] += s.numel
        if self.group_arrived[gi] == part.numel:
            self.group_arrived[gi] = 0
            if self.on_filled is not None:
                self.on_filled(gi)

    def _take(self, key: tuple[int, int]) -> bool:
        """A buffer for bucket ``key``, once the oldest on the wire has landed if need be;
        False while every buffer is filling."""
        while not self.free and len(self.inflight):
            self.inflight.wait_oldest()
        if not self.free:
            return False
        self.filling[key] = self.free.pop()
        return True

    def _copy(self, key: tuple[int, int], slot: int, lo: int, grad: torch.Tensor) -> None:
        gi, si = key
        part = self.groups[gi].partition
        span = part.grad_buckets[si]
        scale_into(self.filling[key][lo - span.start:lo - span.start + grad.numel()], grad,
                   self.n_d)
        self.got.setdefault(key, set()).add(slot)
        self.arrived[key] = self.arrived.get(key, 0) + grad.numel()
        if self.arrived[key] == part.real_in(span):
            self._start(key)

    def _drain(self) -> None:
        """Buckets whose gradients were kept: each into a buffer as one frees up."""
        while self.deferred and self._take(key := min(self.deferred)):
            for slot, lo, grad in self.deferred.pop(key):
                if key in self.filling:
                    self._copy(key, slot, lo, grad)

    def start_grad_sync(self, last: bool = True) -> None:
        """End of a backward (every micro-batch): start every bucket still filling (the
        gradients it misses reduce as zeros), then the kept ones."""
        while self.filling or self.deferred:
            for key in sorted(self.filling):
                self._start(key)
            self._drain()
        self.group_arrived = [0] * len(self.groups)

    def _start(self, key: tuple[int, int]) -> None:
        gi, si = key
        g = self.groups[gi]
        part = g.partition
        span = part.grad_buckets[si]
        buf = self.filling.pop(key)
        got = self.got.pop(key, set())
        if self.arrived.pop(key, 0) < part.real_in(span):  # missing gradients reduce as zeros
            for s in g.slots:
                if s.offset not in got:
                    for _, lo, hi in part.spans_of([span], s.offset, s.numel):
                        buf[lo - span.start:hi - span.start].zero_()
        if span.end > part.numel:  # padding
            buf[max(part.numel - span.start, 0):span.size].zero_()
        works, later = [], []
        for k in range(span.first, span.stop):
            b = part.buckets[k]
            inp = buf[b.start - span.start:b.end - span.start]
            index = self.first_bucket[gi] + k
            out = self.shards.claim(index)
            if out is None:  # accumulate: reduced into the bucket's own chunk, added after
                out = inp[self.rank * b.chunk:(self.rank + 1) * b.chunk]
                later.append((index, out))
            works.append(self.transport.reduce_scatter(out, inp))

        def landed():
            for index, out in later:
                self.shards.accumulate(index, out)
            self.free.append(buf)

        self.inflight.add(works, landed)
        self.unsummed = True
        if self.deferred:
            self._drain()

    def finish_grad_sync(self) -> None:
        self.inflight.wait_all()
        if self.replicas is not None and self.unsummed:
            sum_replicas(self.shards.chunks(), self.replicas)
        self.unsummed = False

    def chunks(self) -> list[torch.Tensor | None]:
        return self.shards.chunks()

    def zero(self) -> None:
        self.shards.zero()
        self.unsummed = False
