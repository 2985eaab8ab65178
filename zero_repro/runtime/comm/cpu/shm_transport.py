"""The bucket transport of gloo ranks on one host: the group's shared-memory channel
(``shm``), behind the contract of ``comm.transport``.

Each rank writes what its peers need into its own ``/dev/shm`` slots and reads theirs: no socket,
no scratch of the torch heap. ``buffer`` places a persistent bucket or shard in shared memory
every peer maps (``shm.Channel.shared_buffer``): a collective on a view of it copies nothing
into the slots, the peers read it in place. A reduce-scatter's chunk is summed by its owner
(own chunk, then the peers' in rank order) straight into ``out``; an all-gather copies the peers'
chunks; an all-reduce on one buffer runs as a reduce-scatter then an all-gather of the sums (the
gather published only once the reduce-scatter half is read, so no sum overwrites a value a peer
still reads), its ``n % N`` tail summed by every rank. ``wait()`` returns once this rank's part
is done and, where the peers read this rank's buffer in place, once they have read it: the
caller may write it then. ``held_bytes``: this rank's segment of slots
(``shm.segment_bytes()``). With no channel (a dry run modelling it on the ``fake`` group) only
the ledgers count.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from zero_repro.runtime.comm import comm
from zero_repro.runtime.comm.cpu import shm
from zero_repro.runtime.comm.work import DONE, Work, own_chunk, peers


class ShmTransport:
    name = "shm"  # the ``dry_run(transport_of=...)`` that accounts it

    def __init__(self, group: comm.Group, channel: shm.Channel | None,
                 device: torch.device | str = "cpu"):
        self.group, self.channel, self.device = group, channel, torch.device(device)

    def buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Collectively (every rank of the group at the same point): shared memory the peers
        map, or the torch heap where there is no channel or no room."""
        shared = None
        if self.channel is not None and self.group.size > 1:
            shared = self.channel.shared_buffer(numel, dtype)
        return torch.zeros(numel, dtype=dtype, device=self.device) if shared is None else shared

    def held_bytes(self) -> int:
        return shm.segment_bytes() if self.group.size > 1 else 0

    def _live(self) -> bool:
        return self.channel is not None and self.group.size > 1

    def _pieces(self, numel: int, dtype: torch.dtype, parts: int) -> list[tuple[int, int]]:
        step = self.channel.piece_numel(dtype, parts)
        return [(a, min(step, numel - a)) for a in range(0, numel, step)]

    def _issue(self, pieces: list, region: shm.Region | None, after: int = -1) -> Work:
        ch = self.channel
        handle = ch.issue(pieces, after=after)
        if region is None:
            return Work([handle])
        through = ch.assigned  # the peers read this rank's buffer up to this piece
        return Work([handle], lambda: ch.await_readers(through))

    # ------------------------------------------------------------------ reduce-scatter
    def _rs_pieces(self, inp: torch.Tensor, res: torch.Tensor):
        """Pieces of a reduce-scatter of ``inp`` (N chunks of ``c``) whose sum (own chunk, then
        the peers' in rank order) lands in ``res``; and the shared buffer ``inp`` lies in, if
        any (then the peers read it in place: one piece, nothing written into the slots)."""
        g, ch = self.group, self.channel
        c, others, me, own = inp.numel() // g.size, peers(g), g.rank, own_chunk(inp, g)
        shared = ch.region_of(inp)
        if shared is not None:
            region, off = shared

            def read_shared(seq):
                src = own
                for q in others:
                    torch.add(src, region.tensors[q][off + me * c:off + (me + 1) * c], out=res)
                    src = res

            return [(_no_write, read_shared)], region
        parts = len(others)

        def write(seq, a, m):
            slot = ch.slot(me, seq, inp.dtype, parts * m)
            for j, q in enumerate(others):
                slot[j * m:(j + 1) * m].copy_(inp[q * c + a:q * c + a + m])

        def read(seq, a, m):
            src, dst = own[a:a + m], res[a:a + m]
            for q in others:
                part = me - (1 if q < me else 0)  # this rank's part: peers skip themselves
                torch.add(src, ch.slot(q, seq, inp.dtype, parts * m)[part * m:(part + 1) * m],
                          out=dst)
                src = dst

        return [(functools.partial(write, a=a, m=m), functools.partial(read, a=a, m=m))
                for a, m in self._pieces(c, inp.dtype, parts)], None

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        g = self.group
        comm.record("reduce_scatter", g, inp.numel(), inp.element_size())
        if not self._live():
            if not comm.same_memory(out, own_chunk(inp, g)):
                out.copy_(own_chunk(inp, g))
            return DONE
        pieces, region = self._rs_pieces(inp, out)
        return self._issue(pieces, region)

    # ------------------------------------------------------------------ all-gather
    def _ag_pieces(self, full: torch.Tensor, region: shm.Region | None = None,
                   offset_of: Callable[[int], int] | None = None) -> list:
        """Pieces of an all-gather into ``full`` whose own chunk holds this rank's values:
        through the slots, or (``region``) each peer's chunk read from its shared buffer at
        element ``offset_of(peer)``."""
        g, ch = self.group, self.channel
        c, others, me, own = full.numel() // g.size, peers(g), g.rank, own_chunk(full, g)
        if region is not None:
            def read_shared(seq):
                for q in others:
                    full[q * c:(q + 1) * c].copy_(region.tensors[q][offset_of(q):offset_of(q) + c])

            return [(_no_write, read_shared)]

        def write(seq, a, m):
            ch.slot(me, seq, full.dtype, m).copy_(own[a:a + m])

        def read(seq, a, m):
            for q in others:
                full[q * c + a:q * c + a + m].copy_(ch.slot(q, seq, full.dtype, m))

        return [(functools.partial(write, a=a, m=m), functools.partial(read, a=a, m=m))
                for a, m in self._pieces(c, full.dtype, 1)]

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        """``out`` in a shared buffer (stages 1-2's flat parameters, the own chunk holding this
        rank's values): each peer's chunk read in place at its own offset of it; else ``inp``
        in one (stage 3's shards): each peer's chunk at the same offset of its buffer."""
        g, ch = self.group, self.channel
        own = own_chunk(out, g)
        if not comm.same_memory(own, inp):
            own.copy_(inp)
        comm.record("all_gather", g, out.numel(), out.element_size())
        if not self._live():
            return DONE
        c = out.numel() // g.size
        shared = ch.region_of(out)
        if shared is not None:
            region, off = shared
            return self._issue(self._ag_pieces(out, region, lambda q: off + q * c), region)
        shared = ch.region_of(inp)
        if shared is not None:
            region, off = shared
            return self._issue(self._ag_pieces(out, region, lambda q: off), region)
        return self._issue(self._ag_pieces(out), None)

    # ------------------------------------------------------------------ all-reduce
    def all_reduce(self, buf: torch.Tensor) -> Work:
        """Sum over the group in place: a reduce-scatter of the first ``N·c`` elements (``c = n
        // N``) and an all-gather of the sums (half the additions and memory traffic of every
        rank summing every rank's buffer, at N = 2), the last ``n % N`` elements summed by
        every rank in rank order; the same bits on every rank."""
        g, ch = self.group, self.channel
        comm.record("all_reduce", g, buf.numel(), buf.element_size())
        if not self._live():
            return DONE
        flat, me = buf.view(-1), g.rank
        c = flat.numel() // g.size
        body, tail = flat[:c * g.size], flat[c * g.size:]
        pieces, region = self._rs_pieces(body, body[me * c:(me + 1) * c])
        if tail.numel():
            pieces.append(self._tail_piece(tail))
        after = len(pieces)
        if region is None:
            pieces += self._ag_pieces(body)
        else:  # each peer's own chunk of its shared buffer holds its sums
            off = ch.region_of(body)[1]
            pieces += self._ag_pieces(body, region, lambda q: off + q * c)
        return self._issue(pieces, region, after=after)

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
    """The write of a piece whose data the peers read in place (a shared buffer)."""
    return None
