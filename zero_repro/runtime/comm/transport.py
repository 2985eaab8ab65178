"""Bucket transports: how one group moves a bucket's reduce-scatter, all-gather and all-reduce
(paper §7). ``bucket_transport(group)`` picks one per group from its backend, as FSDP2 picks its
reduce-scatter once per ``FSDPParamGroup``; the stages never ask which one they hold.

Contract: a bucket of ``n`` elements is ``N_d`` chunks of ``c = n / N_d``; a reduce-scatter
leaves on rank k the sum of chunk k, an all-gather leaves every chunk on every rank, and every
transport moves the same elements to the same ranks with the same §7 volume in the ledger.

* ``NativeTransport`` (NCCL and other backends): the backend's collectives into separate
  outputs, staged in pooled scratch of ``c`` elements, at most ``in_flight_limit`` = 2 in flight.
* ``ShmTransport`` (gloo, the whole group on one host, ``ZR_CPU_TRANSPORT`` not ``pairwise``):
  the group's shared-memory channel (``zero_repro.runtime.comm.cpu.shm``), no socket and no
  torch-heap scratch; buffers from ``shared_buffer`` are read by the peers in place.
* ``PairwiseTransport`` (gloo otherwise): point-to-point exchanges with every peer, the peers'
  contributions received in (N_d - 1)·c elements of pooled scratch.
* ``RootedTransport`` (the dry run's ``fake`` group): N_d rooted reduces / broadcasts per bucket,
  in place, no scratch (a dry run of an NCCL cluster under-counts only constant-size scratch);
  ``dry_run(..., transport_of="gloo" | "shm")`` accounts a CPU transport instead (``models_as``).

``InFlight``, ``BufferPool`` and ``NoBuffers`` are in ``zero_repro.runtime.comm.buffers``;
collectives go through ``comm`` only. Timings of the gloo variants: ``results/peers/notes.md``.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from zero_repro.runtime.comm import comm
from zero_repro.runtime.comm.cpu import shm
from zero_repro.runtime.comm.buffers import BufferPool, InFlight, NoBuffers

# backends whose bucket collectives run as point-to-point exchanges / as rooted reduces and
# broadcasts (see the module docstring)
PAIRWISE_BACKENDS = ("gloo",)
ROOTED_BACKENDS = ("fake",)
MODELLED_SHM = "shm"  # ``Group.models`` of a dry run of gloo ranks on one host (shared memory)
_UNBOUNDED = 1 << 30  # "no limit" on collectives in flight


def _no_shared_buffer(self, numel: int, dtype: torch.dtype) -> None:
    """Transports without memory the peers can read in place: the caller allocates."""
    return None


def _no_fence(self, buf: torch.Tensor) -> None:
    return None


def _collective_all_reduce(self, buf: torch.Tensor) -> list:
    """Async sum of ``buf`` over the group, in place, by the backend's own all-reduce."""
    return [comm.all_reduce(buf, self.group, async_op=True)]


def _all_reduce_whole(self, buf: torch.Tensor) -> tuple[list, list[torch.Tensor]]:
    """``all_reduce_views`` of a transport that always sums in place: the views are ``buf``."""
    return self.all_reduce(buf), [buf]


def _no_release(self, buf: torch.Tensor) -> None:
    return None


class _Collective:
    """Transports on the backend's own collectives or point-to-point messages: the stage's
    all-reduce is the backend's, no memory the peers read in place, results land in the
    transport's own views (accumulated by the caller after)."""

    reduces_into = False

    def __init__(self, group: comm.Group):
        self.group = group

    all_reduce = _collective_all_reduce
    all_reduce_views = _all_reduce_whole
    shared_buffer = _no_shared_buffer
    fence = _no_fence
    release = _no_release


class NativeTransport(_Collective):
    """Native reduce-scatter / all-gather into separate outputs (NCCL and others)."""

    models_as = "native"  # the ``dry_run(transport_of=...)`` that accounts it
    in_flight_limit = 2  # collectives holding pooled scratch at once
    fused_buffers = 2  # fused gradient buckets a stage keeps (filling + on the wire)

    def scratch_numel(self, chunk: int) -> int:
        """Elements of scratch a reduce-scatter of a bucket of ``chunk``-element chunks needs
        (here: its result). Linear in ``chunk``: a stage slices one scratch by it."""
        return chunk

    def scratch_pool(self, chunk: int, dtype: torch.dtype, inflight: InFlight,
                     device: torch.device | str = "cpu"):
        """Pooled reduce-scatter scratch (``scratch_numel(chunk)`` elements per buffer)."""
        return BufferPool(chunk, dtype, inflight, device=device)

    def gather_pool(self, chunk: int, dtype: torch.dtype, inflight: InFlight,
                    device: torch.device | str = "cpu"):
        """Pooled all-gather input staging (``all_gather_in_place``): ``chunk`` elements."""
        return BufferPool(chunk, dtype, inflight, device=device)

    def reduce_scatter(self, inp: torch.Tensor, scratch: torch.Tensor):
        """Async reduce-scatter of ``inp``; returns (works, the view that will hold this rank's
        reduced chunk): here ``scratch`` (``scratch_numel(chunk)`` elements)."""
        return [comm.reduce_scatter_into(scratch, inp, self.group, async_op=True)], scratch

    def reduce_scatter_in_place(self, inp: torch.Tensor, scratch: torch.Tensor):
        """Reduce-scatter whose result lands in this rank's chunk of ``inp``; returns (works,
        what to run after they complete): copy the result back from ``scratch``."""
        works, out = self.reduce_scatter(inp, scratch)
        own = _own(inp, self.group)
        return works, lambda: own.copy_(out)

    def all_gather(self, full: torch.Tensor, mine: torch.Tensor) -> list:
        """Async all-gather into ``full`` of every rank's ``mine`` (storage apart from full)."""
        return [comm.all_gather_into(full, mine, self.group, async_op=True)]

    def all_gather_in_place(self, full: torch.Tensor, scratch: torch.Tensor) -> list:
        """All-gather where this rank's chunk of ``full`` holds its values: staged through
        ``scratch`` first (the native input must not alias the output)."""
        scratch.copy_(_own(full, self.group))
        return self.all_gather(full, scratch)


class _NoScratch:
    """Transports that reduce and gather in place in the bucket: no scratch of the torch heap."""

    def scratch_numel(self, chunk: int) -> int:
        return 0

    def scratch_pool(self, chunk: int, dtype: torch.dtype, inflight: InFlight,
                     device: torch.device | str = "cpu") -> NoBuffers:
        return NoBuffers(dtype, device)

    gather_pool = scratch_pool


class RootedTransport(_Collective, _NoScratch):
    """Per-chunk rooted reduces / broadcasts, in place in the bucket (gloo, fake)."""

    models_as = "fake"  # the ``dry_run(transport_of=...)`` that accounts it
    in_flight_limit = _UNBOUNDED  # nothing staged, nothing to wait for
    fused_buffers = 4  # nothing limits what is in flight: 4 fused buckets, not 2 (peers notes)

    def reduce_scatter(self, inp: torch.Tensor, scratch: torch.Tensor | None = None):
        """One async reduce per chunk to its owner: afterwards this rank's chunk of ``inp`` (the
        returned view) holds the sum and the other chunks are undefined. ``scratch`` unused."""
        return reduce_chunks(inp, inp.numel() // self.group.size, self.group), \
            _own(inp, self.group)

    def reduce_scatter_in_place(self, inp: torch.Tensor, scratch: torch.Tensor | None = None):
        """The result already is this rank's chunk of ``inp``: nothing to do after."""
        return self.reduce_scatter(inp)[0], _nothing

    def all_gather(self, full: torch.Tensor, mine: torch.Tensor) -> list:
        """``mine`` is copied into this rank's chunk of ``full``, then one async broadcast per
        chunk from its owner."""
        _own(full, self.group).copy_(mine)
        return self.all_gather_in_place(full)

    def all_gather_in_place(self, full: torch.Tensor, scratch: torch.Tensor | None = None):
        """This rank's chunk of ``full`` holds its values: broadcast every chunk from its owner."""
        return broadcast_chunks(full, full.numel() // self.group.size, self.group)


def _own(buf: torch.Tensor, group: comm.Group) -> torch.Tensor:
    """This rank's chunk of a bucket ``buf`` split over ``group``."""
    c = buf.numel() // group.size
    return buf[group.rank * c:(group.rank + 1) * c]


def _peers(group: comm.Group) -> list[int]:
    """The other ranks of ``group``, in rank order."""
    return [q for q in range(group.size) if q != group.rank]


def _nothing() -> None:
    return None


def reduce_chunks(buf: torch.Tensor, chunk: int, group: comm.Group) -> list:
    """Reduce-scatter of ``buf`` (group.size chunks of ``chunk`` elements) as one async reduce
    per chunk to its owner, in place. Returns the work handles."""
    return [comm.reduce(buf[k * chunk:(k + 1) * chunk], k, group, async_op=True)
            for k in range(group.size)]


def broadcast_chunks(buf: torch.Tensor, chunk: int, group: comm.Group) -> list:
    """All-gather in place: this rank's chunk of ``buf`` must hold its values; afterwards every
    chunk holds its owner's. One async broadcast per chunk; returns the work handles."""
    return [comm.broadcast(buf[k * chunk:(k + 1) * chunk], k, group, async_op=True)
            for k in range(group.size)]


class PairwiseTransport(_Collective):
    """gloo: a bucket's reduce-scatter and all-gather as point-to-point exchanges with every
    peer (``comm.exchange``), faster on gloo than its collectives (results/peers/notes.md):
    each rank sends every peer that peer's chunk and receives its own chunk from
    each peer into scratch, then adds them into its chunk; an all-gather sends the own chunk
    to every peer and receives each peer's chunk in place. Per rank (N-1)·c elements out and
    in, as a ring; counted as the ``reduce_scatter`` / ``all_gather`` of the bucket they make
    up, so the §7 volume is the same. The sum is taken by the chunk's owner alone (own chunk,
    then the peers' in rank order) and gathered from it, so every rank holds the same values."""

    models_as = "gloo"  # the ``dry_run(transport_of=...)`` that accounts it
    in_flight_limit = _UNBOUNDED  # the scratch pools bound what is in flight
    fused_buffers = 4  # as the rooted transport: gloo drains slower than backward fills
    RS_TAG, AG_TAG = 1, 2  # reduce-scatters and all-gathers match in order within their kind

    def scratch_numel(self, chunk: int) -> int:
        return (self.group.size - 1) * chunk  # one chunk from every peer

    def scratch_pool(self, chunk: int, dtype: torch.dtype, inflight: InFlight,
                     device: torch.device | str = "cpu") -> BufferPool:
        return BufferPool(self.scratch_numel(chunk), dtype, inflight,
                          max_buffers=self.fused_buffers, device=device)

    def gather_pool(self, chunk: int, dtype: torch.dtype, inflight: InFlight,
                    device: torch.device | str = "cpu") -> NoBuffers:
        return NoBuffers(dtype, device)  # gathers straight into the bucket

    def reduce_scatter(self, inp: torch.Tensor, scratch: torch.Tensor):
        """Async reduce-scatter of ``inp``; ``scratch``: ``scratch_numel(chunk)`` elements that
        receive the peers' contributions. Returns (works, this rank's chunk of ``inp``, which
        holds the sum once the works are waited; the other chunks are left as they were)."""
        g = self.group
        c, peers = inp.numel() // g.size, _peers(g)
        slots = [scratch[j * c:(j + 1) * c] for j in range(len(peers))]
        own = _own(inp, g)
        comm.record("reduce_scatter", g, inp.numel(), inp.element_size())
        works = comm.exchange([(inp[q * c:(q + 1) * c], q) for q in peers],
                              list(zip(slots, peers)), g, self.RS_TAG)
        return works + [_Then(lambda: [own.add_(s) for s in slots])], own

    def reduce_scatter_in_place(self, inp: torch.Tensor, scratch: torch.Tensor):
        return self.reduce_scatter(inp, scratch)[0], _nothing

    def all_gather(self, full: torch.Tensor, mine: torch.Tensor) -> list:
        _own(full, self.group).copy_(mine)
        return self.all_gather_in_place(full)

    def all_gather_in_place(self, full: torch.Tensor, scratch: torch.Tensor | None = None):
        g = self.group
        c, peers = full.numel() // g.size, _peers(g)
        comm.record("all_gather", g, full.numel(), full.element_size())
        return comm.exchange([(_own(full, g), q) for q in peers],
                             [(full[q * c:(q + 1) * c], q) for q in peers], g, self.AG_TAG)


class ShmTransport(_NoScratch):
    """gloo ranks on one host: a bucket's reduce-scatter and all-gather through the group's
    shared-memory channel (``cpu.shm``), faster than gloo's sockets (results/peers/notes.md).
    Every piece of a reduce-scatter is published as the peers' chunks of it (one slot, (N-1)
    parts) and summed by its owner (own chunk, then the peers' in rank order, as the pairwise
    transport); an all-gather publishes the own chunk and copies the peers'. No scratch of the
    torch heap: the slots are constant host shared memory (``shm.segment_bytes()`` per rank),
    as NCCL's buffers are. Counted as the ``reduce_scatter`` / ``all_gather`` of the bucket.
    With no channel (a dry run modelling it on the ``fake`` group) only the ledger counts."""

    models_as = "shm"  # the ``dry_run(transport_of=...)`` that accounts it
    in_flight_limit = 4
    fused_buffers = 4
    reduces_into = True  # ``reduce_scatter(..., into=)`` writes the sum where it is wanted

    def __init__(self, group: comm.Group, channel: shm.Channel | None):
        self.group, self.channel = group, channel

    def shared_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """Collectively: a zeroed buffer the peers map too (``shm.Channel.shared_buffer``): a
        collective on a view of it reads the peers' values in place, without the copy into
        the slots. ``fence`` it before writing it again. None without a channel or room."""
        return None if self.channel is None else self.channel.shared_buffer(numel, dtype)

    def fence(self, buf: torch.Tensor) -> None:
        if self.channel is not None:
            self.channel.fence(buf)

    def release(self, buf: torch.Tensor) -> None:
        """Collectively: this rank is done reading the views ``all_reduce_views`` gave on
        shared buffer ``buf`` (the peers' parts, in place); their owners' ``fence`` waits."""
        if self.channel is not None and self.group.size > 1:
            self.channel.release(buf)

    def _pieces(self, numel: int, dtype: torch.dtype, parts: int) -> list[tuple[int, int]]:
        step = self.channel.piece_numel(dtype, parts)
        return [(a, min(step, numel - a)) for a in range(0, numel, step)]

    def _rs_pieces(self, inp: torch.Tensor, res: torch.Tensor):
        """Pieces of a reduce-scatter of ``inp`` (N chunks of ``c``) whose sum (own chunk, then
        the peers' in rank order) lands in ``res``; and the shared buffer ``inp`` lies in, if
        any (then the peers read it in place: one piece, nothing written into the slots)."""
        g, ch = self.group, self.channel
        c, peers, me, own = inp.numel() // g.size, _peers(g), g.rank, _own(inp, g)
        shared = ch.region_of(inp)
        if shared is not None:
            region, off = shared

            def read_shared(seq):
                src = own
                for q in peers:
                    torch.add(src, region.tensors[q][off + me * c:off + (me + 1) * c], out=res)
                    src = res

            return [(_no_write, read_shared)], region
        parts = len(peers)

        def write(seq, a, m):
            slot = ch.slot(me, seq, inp.dtype, parts * m)
            for j, q in enumerate(peers):
                slot[j * m:(j + 1) * m].copy_(inp[q * c + a:q * c + a + m])

        def read(seq, a, m):
            src, dst = own[a:a + m], res[a:a + m]
            for q in peers:
                part = me - (1 if q < me else 0)  # this rank's part: peers skip themselves
                torch.add(src, ch.slot(q, seq, inp.dtype, parts * m)[part * m:(part + 1) * m],
                          out=dst)
                src = dst

        return [(functools.partial(write, a=a, m=m), functools.partial(read, a=a, m=m))
                for a, m in self._pieces(c, inp.dtype, parts)], None

    def _ag_pieces(self, full: torch.Tensor, region: shm.Region | None = None,
                   offset_of: Callable[[int], int] | None = None) -> list:
        """Pieces of an all-gather into ``full`` whose own chunk holds this rank's values:
        through the slots, or (``region``) each peer's chunk read from its shared buffer at
        element ``offset_of(peer)``."""
        g, ch = self.group, self.channel
        c, peers, me, own = full.numel() // g.size, _peers(g), g.rank, _own(full, g)
        if region is not None:
            def read_shared(seq):
                for q in peers:
                    full[q * c:(q + 1) * c].copy_(region.tensors[q][offset_of(q):offset_of(q) + c])

            return [(_no_write, read_shared)]

        def write(seq, a, m):
            ch.slot(me, seq, full.dtype, m).copy_(own[a:a + m])

        def read(seq, a, m):
            for q in peers:
                full[q * c + a:q * c + a + m].copy_(ch.slot(q, seq, full.dtype, m))

        return [(functools.partial(write, a=a, m=m), functools.partial(read, a=a, m=m))
                for a, m in self._pieces(c, full.dtype, 1)]

    def _issue(self, pieces: list, region: shm.Region | None, after: int = -1) -> list:
        work = self.channel.issue(pieces, after=after)
        if region is not None:  # its owner's next write waits for these pieces' readers
            region.last_seq = self.channel.assigned
        return [work]

    def reduce_scatter(self, inp: torch.Tensor, scratch: torch.Tensor | None = None,
                       into: torch.Tensor | None = None):
        """Async reduce-scatter of ``inp``: returns (works, the view that holds the sum once
        they are waited): ``into`` (``c`` elements, e.g. a gradient shard's piece: the sum is
        written there, no copy after) if given, else this rank's chunk of ``inp``; the other
        chunks of ``inp`` are left as they were."""
        g, own = self.group, _own(inp, self.group)
        res = own if into is None else into
        comm.record("reduce_scatter", g, inp.numel(), inp.element_size())
        if self.channel is None or g.size == 1:
            if into is not None:
                into.copy_(own)
            return [], res
        pieces, region = self._rs_pieces(inp, res)
        return self._issue(pieces, region), res

    def reduce_scatter_in_place(self, inp: torch.Tensor, scratch: torch.Tensor | None = None):
        return self.reduce_scatter(inp)[0], _nothing

    def all_gather(self, full: torch.Tensor, mine: torch.Tensor) -> list:
        g, ch = self.group, self.channel
        _own(full, g).copy_(mine)
        shared = None if ch is None or g.size == 1 else ch.region_of(mine)
        if shared is None:
            return self.all_gather_in_place(full)
        # ``mine`` lies in a shared buffer (stage 3's shards): each peer's chunk sits at the
        # same offset of its buffer, read in place
        comm.record("all_gather", g, full.numel(), full.element_size())
        region, off = shared
        return self._issue(self._ag_pieces(full, region, lambda q: off), region)

    def all_gather_in_place(self, full: torch.Tensor, scratch: torch.Tensor | None = None):
        """All-gather where this rank's chunk of ``full`` holds its values; on a shared buffer
        (stages 1-2's flat parameters) each peer's chunk is read in place, at the same offset
        of its buffer (its owner ``fence``s it before writing it again)."""
        g, ch = self.group, self.channel
        comm.record("all_gather", g, full.numel(), full.element_size())
        if ch is None or g.size == 1:
            return []
        shared = ch.region_of(full)
        if shared is None:
            return self._issue(self._ag_pieces(full), None)
        region, off = shared
        c = full.numel() // g.size
        return self._issue(self._ag_pieces(full, region, lambda q: off + q * c), region)

    def all_reduce(self, buf: torch.Tensor) -> list:
        """Async sum of ``buf`` over the group, in place, as a reduce-scatter of its first
        ``N·c`` elements (``c = n // N``) and an all-gather of the sums (half the additions and
        memory traffic of every rank summing every rank's buffer, at N = 2), its last ``n % N``
        elements summed by every rank in rank order; the same bits on every rank. The gather
        half is published only after the reduce-scatter half is read: on a shared buffer the
        sums it writes over are then no longer read by any peer."""
        g, ch = self.group, self.channel
        comm.record("all_reduce", g, buf.numel(), buf.element_size())
        if ch is None or g.size == 1:
            return []
        pieces, region, body, _, c = self._sum_half(buf)
        after = len(pieces)
        if region is None:
            pieces += self._ag_pieces(body)
        else:  # each peer's own chunk of its shared buffer holds its sums
            off = ch.region_of(body)[1]
            pieces += self._ag_pieces(body, region, lambda q: off + q * c)
        return self._issue(pieces, region, after=after)

    def all_reduce_views(self, buf: torch.Tensor) -> tuple[list, list[torch.Tensor]]:
        """Async sum of ``buf`` over the group; returns (works, views): once the works are
        waited, ``views`` (consecutive tensors, ``buf.numel()`` elements in all) hold the sum.
        On a shared buffer only the reduce-scatter half runs: the views are every rank's own
        chunk of the sums in its own buffer (the peers' read in place) and the tail in
        ``buf``: no gather copy, ~40% of an all-reduce's memory traffic saved at N = 2. The
        reader then ``release``s ``buf`` when done with the views (before that no peer writes
        its buffer again); counted as the all-reduce it stands for. Elsewhere the whole
        ``all_reduce`` and ``[buf]``."""
        g, ch = self.group, self.channel
        shared = None if ch is None or g.size == 1 else ch.region_of(buf.view(-1))
        if shared is None:
            return self.all_reduce(buf), [buf]
        comm.record("all_reduce", g, buf.numel(), buf.element_size())
        pieces, region, _, tail, c = self._sum_half(buf)
        off = shared[1]
        # an empty piece published once this rank's sums are complete: waiting for it is
        # waiting for every peer's sums (what the views read)
        pieces.append((_no_write, _no_write))
        views = [region.tensors[q][off + q * c:off + (q + 1) * c] for q in range(g.size)]
        return (self._issue(pieces, region, after=len(pieces) - 1),
                views + ([tail] if tail.numel() else []))

    def _sum_half(self, buf: torch.Tensor):
        """The pieces of an all-reduce's reduce-scatter half: the sum of this rank's chunk
        of the first ``N·c`` elements (``c = n // N``) lands in that chunk of ``buf``, the raw
        ``n % N`` tails go through the slots and every rank sums them in place. Returns
        (pieces, the shared region ``buf`` lies in or None, body, tail, c)."""
        g = self.group
        flat, me = buf.view(-1), g.rank
        c = flat.numel() // g.size
        body, tail = flat[:c * g.size], flat[c * g.size:]
        pieces, region = self._rs_pieces(body, body[me * c:(me + 1) * c])
        if tail.numel():
            pieces.append(self._tail_piece(tail))
        return pieces, region, body, tail, c

    def _tail_piece(self, tail: torch.Tensor):
        """The piece of an all-reduce's last ``n % N`` elements: the raw tails through the
        slots, each rank sums them in place (in rank order: the same bits everywhere)."""
        g, ch = self.group, self.channel

        def tail_write(seq):
            ch.slot(g.rank, seq, tail.dtype, tail.numel()).copy_(tail)

        def tail_read(seq):
            for q in range(g.size):  # this rank's own values are in its slot
                src = ch.slot(q, seq, tail.dtype, tail.numel())
                tail.copy_(src) if q == 0 else tail.add_(src)

        return tail_write, tail_read


def _no_write(seq: int) -> None:
    """The write of a piece whose data the peers read in place (a shared buffer); the write
    and read of an empty piece (its counters are the message)."""
    return None


class _Then:
    """A work handle that runs ``fn`` when waited: the local part of a collective (e.g. the sum
    of a pairwise reduce-scatter), queued after the handles of its exchanges."""

    def __init__(self, fn: Callable[[], object]):
        self.fn = fn

    def wait(self) -> None:
        self.fn()


Transport = NativeTransport | RootedTransport | PairwiseTransport | ShmTransport


def bucket_transport(group: comm.Group) -> Transport:
    """The transport for ``group``, chosen once from the backend its collectives run on (or
    the one a dry run models on it, ``Group.models``). On gloo: shared memory where the group
    is on one host and ``ZR_CPU_TRANSPORT`` allows it (building the channel is collective:
    every rank of the group asks at the same point), else point-to-point."""
    backend = group.models or group.backend
    if backend == MODELLED_SHM:
        return ShmTransport(group, None)
    if backend in PAIRWISE_BACKENDS:
        channel = shm.channel_for(group)
        return ShmTransport(group, channel) if channel is not None else PairwiseTransport(group)
    if backend in ROOTED_BACKENDS:
        return RootedTransport(group)
    return NativeTransport(group)
