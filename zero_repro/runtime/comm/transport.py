"""Bucket transports: how one group moves a bucket's reduce-scatter, all-gather and all-reduce
(paper §7), behind one narrow contract (FSDP2's ``_fsdp_api`` plug-ins are the model).
``bucket_transport(group)`` picks one per group from its backend; the stages never ask which.

What a ZeRO-DP stage may do with its DP group's transport (``Transport``), and nothing else:
``buffer(numel, dtype)`` (a zeroed tensor where a persistent bucket or shard should live; the
caller owns and counts it), ``reduce_scatter(out, inp)`` (``out``, c elements, receives the sum
of every rank's chunk ``rank`` of ``inp``, N·c; ``out`` may be that chunk of ``inp``; the other
chunks are undefined afterwards), ``all_gather(out, inp)`` (``out``, N·c, receives every rank's
``inp`` in rank order; ``inp`` may be this rank's chunk of ``out``), ``all_reduce(buf)`` (in
place) and ``held_bytes()`` (what the transport holds itself, for the ledger). A collective
returns a ``work.Work``: once ``wait()`` returns the result is in place and the inputs may be
written again (peers that read them in place are done). Scratch, in-flight limits and whatever
a transport does to be fast stay inside it; ``name`` says which ran (records, dry runs).

* ``NativeTransport`` (NCCL and others; gloo with ``ZR_CPU_TRANSPORT=native``): the backend's
  collectives into separate outputs; an in-place request is staged through at most 2 scratch
  chunks (``work.Scratch``).
* ``PairwiseTransport`` (gloo across hosts, or ``ZR_CPU_TRANSPORT=pairwise``): point-to-point
  exchanges with every peer; a reduce-scatter receives (N - 1)·c elements of scratch, one chunk
  straight into a separate output, at most 2 in flight; an all-gather receives in place.
* ``RootedTransport`` (the dry run's ``fake`` group): one in-place reduce-scatter / all-gather
  per bucket, no scratch.
* ``cpu.shm_transport.ShmTransport`` (gloo ranks on one host, the default there): the group's
  shared-memory channel, its ``buffer``s mapped by the peers.

Invariant: all move the same elements to the same ranks with the same §7 volume; a chunk's sum
is taken by its owner (own chunk, then the peers' in rank order on the CPU transports), so every
rank holds the same values. Timings of the gloo variants: ``results/peers/notes.md``.
"""
from __future__ import annotations

from typing import Protocol

import torch

from zero_repro.runtime.comm import comm
from zero_repro.runtime.comm.cpu import shm
from zero_repro.runtime.comm.cpu.shm_transport import ShmTransport
from zero_repro.runtime.comm.work import DONE, Scratch, Work, overlaps, own_chunk, peers

SCRATCH_DEPTH = 2  # collectives holding scratch at once: one being filled, one on the wire


class Transport(Protocol):
    name: str

    def buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor: ...

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor) -> Work: ...

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> Work: ...

    def all_reduce(self, buf: torch.Tensor) -> Work: ...

    def held_bytes(self) -> int: ...


class _OnHeap:
    """Buffers of the torch heap on the ranks' device; the backend's own all-reduce."""

    def __init__(self, group: comm.Group, device: torch.device | str = "cpu"):
        self.group, self.device = group, torch.device(device)
        self.scratch = Scratch(SCRATCH_DEPTH, self.device)

    def buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, device=self.device)

    def all_reduce(self, buf: torch.Tensor) -> Work:
        return Work([comm.all_reduce(buf, self.group, async_op=True)])

    def held_bytes(self) -> int:
        return self.scratch.nbytes


def _copy_unless_same(dst: torch.Tensor, src: torch.Tensor) -> None:
    if not comm.same_memory(dst, src):
        dst.copy_(src)


class NativeTransport(_OnHeap):
    """Native reduce-scatter / all-gather into separate outputs (NCCL and others)."""

    name = "native"

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        g = self.group
        if g.size == 1:
            _copy_unless_same(out, inp)
            return DONE
        if not overlaps(out, inp):
            return Work([comm.reduce_scatter_into(out, inp, g, async_op=True)])

        def start(tmp):
            return ([comm.reduce_scatter_into(tmp, inp, g, async_op=True)],
                    lambda: out.copy_(tmp))

        return self.scratch.run(out.numel(), out.dtype, start)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        g = self.group
        if g.size == 1:
            _copy_unless_same(out, inp)
            return DONE
        if not overlaps(out, inp):
            return Work([comm.all_gather_into(out, inp, g, async_op=True)])

        def start(tmp):
            tmp.copy_(inp)
            return [comm.all_gather_into(out, tmp, g, async_op=True)], None

        return self.scratch.run(inp.numel(), inp.dtype, start)


class RootedTransport(_OnHeap):
    """In place in the bucket, no scratch (the dry run's ``fake`` group, whose collectives move
    nothing): one in-place reduce-scatter into this rank's chunk, one in-place all-gather from
    it (NCCL's in-place forms), each one call whatever N_d -- a 64-rank DP group is 1 call per
    bucket, not 64 rooted ones."""

    name = "fake"  # the ``dry_run(transport_of=...)`` that accounts it

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        g = self.group
        own = own_chunk(inp, g)
        return Work([comm.reduce_scatter_into(own, inp, g, async_op=True)],
                    lambda: _copy_unless_same(out, own))

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        g = self.group
        own = own_chunk(out, g)
        _copy_unless_same(own, inp)
        return Work([comm.all_gather_into(out, own, g, async_op=True)])


class PairwiseTransport(_OnHeap):
    """gloo: a bucket's reduce-scatter and all-gather as point-to-point exchanges with every
    peer (``comm.exchange``): each rank sends every peer that peer's chunk and receives its own
    chunk from each peer into scratch, then sums them (own chunk, then the peers' in rank
    order); an all-gather sends the own chunk to every peer and receives each peer's in place.
    Per rank (N-1)·c elements out and in, as a ring; counted as the ``reduce_scatter`` /
    ``all_gather`` of the bucket, so the §7 volume is the same."""

    name = "gloo"  # the ``dry_run(transport_of=...)`` that accounts it
    RS_TAG, AG_TAG = 1, 2  # reduce-scatters and all-gathers match in order within their kind

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        """The first peer's contribution is received straight into ``out`` where it is not
        this rank's chunk of ``inp`` (then own + it, the same bits as it + own), the others
        into scratch: (N - 1) chunks in place, (N - 2) chunks otherwise."""
        g = self.group
        c, others, own = inp.numel() // g.size, peers(g), own_chunk(inp, g)
        comm.record("reduce_scatter", g, inp.numel(), inp.element_size())
        if not others:
            _copy_unless_same(out, own)
            return DONE
        direct = not overlaps(out, inp)
        sends = [(inp[q * c:(q + 1) * c], q) for q in others]

        def start(tmp):
            slots = ([out] if direct else []) + [tmp[j * c:(j + 1) * c]
                                                 for j in range(len(others) - direct)]
            handles = comm.exchange(sends, list(zip(slots, others)), g, self.RS_TAG)

            def total():
                src = own
                for s in slots:
                    torch.add(src, s, out=out)
                    src = out

            return handles, total

        n = (len(others) - direct) * c
        if n == 0:
            handles, total = start(out[:0])
            return Work(handles, total)
        return self.scratch.run(n, inp.dtype, start)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        g = self.group
        c, others = out.numel() // g.size, peers(g)
        _copy_unless_same(own_chunk(out, g), inp)
        comm.record("all_gather", g, out.numel(), out.element_size())
        return Work(comm.exchange([(own_chunk(out, g), q) for q in others],
                                  [(out[q * c:(q + 1) * c], q) for q in others], g, self.AG_TAG))


def held_bytes_of(name: str, n_d: int, chunk: int, elt: int, staged: int,
                  reduce_scatters: int, rs_in_place: bool) -> int:
    """What transport ``name`` holds itself (its ``held_bytes``) over ``n_d`` ranks once
    collectives on chunks of at most ``chunk`` elements of ``elt`` bytes ran: ``staged`` the
    most in flight at once whose output aliases the input (native: staged through a chunk of
    scratch each), ``reduce_scatters`` the most reduce-scatters in flight at once (pairwise:
    receive scratch of N - 1 chunks each where ``rs_in_place``, else N - 2); either capped by
    the scratch depth."""
    if n_d == 1:
        return 0
    if name == ShmTransport.name:
        return shm.segment_bytes()
    if name == NativeTransport.name:
        return min(SCRATCH_DEPTH, staged) * chunk * elt
    if name == PairwiseTransport.name:
        per = n_d - 1 if rs_in_place else n_d - 2
        return min(SCRATCH_DEPTH, reduce_scatters) * per * chunk * elt
    return 0


def bucket_transport(group: comm.Group, device: torch.device | str = "cpu") -> Transport:
    """The transport for ``group`` (its buffers on ``device``), chosen once from the backend its
    collectives run on (or the one a dry run models on it, ``Group.models``). On gloo: shared
    memory where the group is on one host and ``ZR_CPU_TRANSPORT`` allows it (building the
    channel is collective: every rank of the group asks at the same point), point-to-point
    otherwise, the native collectives with ``ZR_CPU_TRANSPORT=native``."""
    backend = group.models or group.backend
    if backend == ShmTransport.name:
        return ShmTransport(group, None, device)
    if backend == PairwiseTransport.name:
        if group.backend == "gloo" and shm.mode() == "native":
            return NativeTransport(group, device)
        channel = shm.channel_for(group)
        if channel is not None:
            return ShmTransport(group, channel, device)
        return PairwiseTransport(group, device)
    if backend == RootedTransport.name:
        return RootedTransport(group, device)
    return NativeTransport(group, device)
