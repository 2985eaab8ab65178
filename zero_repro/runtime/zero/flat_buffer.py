"""Contiguous flat buffers for ZeRO-DP (paper §5): parameters as views into one flat tensor, this
rank's shard as views of its chunks, and the gradient shard.

``FlatParams`` owns one group of parameters (the whole model for stages 0-2, one unit for stage
3): it casts them to the training dtype, lays them end to end (``partition.layout``), pads to the
bucket grid (``partition.Partition``) and re-points every ``param.data`` at its view, so writing
the flat tensor updates the module in place. Stage 3 frees the storage (``release``) and
re-allocates it (``materialize``) around each use; the views stay valid (storage resized, not
replaced, so tensors autograd saved see the re-gathered values). ``PeakBytes`` tracks stage 3's
transients; ``GradShards`` is the reduced gradient shard of stages 2 and 3.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from zero_repro.runtime.zero.partition import Partition, Slot, layout


class Pieces:
    """One chunk's values held in consecutive flat tensors instead of one (stage 0 on shared
    memory: a gradient bucket whose peers' sums are read in place, in the peers' buffers).
    What reads a gradient chunk (``adam``, ``clip``) accepts it wherever it takes a tensor."""

    def __init__(self, parts: Sequence[torch.Tensor]):
        self.parts = [t.reshape(-1) for t in parts]
        self._numel = sum(t.numel() for t in self.parts)

    def numel(self) -> int:
        return self._numel

    def split(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Views of flat ``t`` (same number of elements) cut where the parts are cut."""
        flat, out, a = t.reshape(-1), [], 0
        for p in self.parts:
            out.append(flat[a:a + p.numel()])
            a += p.numel()
        return out

    def ranges(self, lo: int, hi: int) -> list[torch.Tensor]:
        """Views of elements [lo, hi), one per part they reach."""
        out, a = [], 0
        for p in self.parts:
            b = a + p.numel()
            if lo < b and hi > a:
                out.append(p[max(lo, a) - a:min(hi, b) - a])
            a = b
        return out


def ranges_of(g: torch.Tensor | Pieces, lo: int, hi: int) -> list[torch.Tensor]:
    """Views of elements [lo, hi) of a flat gradient chunk (a tensor or ``Pieces``)."""
    return g.ranges(lo, hi) if isinstance(g, Pieces) else [g.reshape(-1)[lo:hi]]


class FlatParams:
    """One flat, padded, bucketed buffer holding a group of parameters."""

    def __init__(self, name: str, named_params: Sequence[tuple[str, nn.Parameter]],
                 dtype: torch.dtype, n_shards: int, bucket_capacity: int):
        self.name = name
        self.params = [p for _, p in named_params]
        self.slots, numel = layout([n for n, _ in named_params],
                                   [tuple(p.shape) for _, p in named_params])
        self.partition = Partition(numel, n_shards, bucket_capacity)  # n_shards: 1 or N_d
        self.dtype = dtype
        # on the parameters' device: the model's parameters are re-pointed into it
        device = self.params[0].device if self.params else torch.device("cpu")
        self.flat = torch.zeros(self.partition.padded_numel, dtype=dtype, device=device)
        with torch.no_grad():
            for s, p in zip(self.slots, self.params):
                self.flat[s.offset:s.end].copy_(p.detach().reshape(-1))
        for s, p in zip(self.slots, self.params):
            p.data = self.view(s)
        self.slot_of = {id(p): s for s, p in zip(self.slots, self.params)}

    def rehome(self, buf: torch.Tensor) -> None:
        """Move the flat tensor into ``buf`` (same size and dtype, e.g. memory the peers map:
        ``transport.shared_buffer``) and re-point every parameter at its view of it."""
        buf.copy_(self.flat)
        self.flat = buf
        for s, p in zip(self.slots, self.params):
            p.data = self.view(s)

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
    removes). Pieces accumulate across micro-batches until ``zero``, which writes nothing: a
    piece's first reduced gradient after it is copied in (one pass over Ψ/N_d a step instead of
    a zero fill plus an addition); a piece still unwritten when read is zeroed then.
    """

    def __init__(self, sizes: Sequence[int], dtype: torch.dtype, contiguous: bool,
                 device: torch.device | str = "cpu"):
        self.buffer = (torch.zeros(sum(sizes), dtype=dtype, device=device)  # (Ψ/N_d,)
                       if contiguous else None)
        self.pieces: list[torch.Tensor | None] = [None] * len(sizes)
        if self.buffer is not None:
            offsets = [0]
            for n in sizes:
                offsets.append(offsets[-1] + n)
            self.pieces = [self.buffer[a:b] for a, b in zip(offsets, offsets[1:])]
        self._unwritten: set[int] = set()  # pieces that hold zeros in meaning, not in memory

    def accumulate(self, index: int, reduced: torch.Tensor) -> None:
        if self.pieces[index] is None:
            self.pieces[index] = reduced.clone()  # M_D off: allocated as it arrives
        elif index in self._unwritten:
            self._unwritten.discard(index)
            self.pieces[index].copy_(reduced)
        else:
            self.pieces[index].add_(reduced)

    def claim(self, index: int) -> torch.Tensor | None:
        """Piece ``index`` for a reduction to write its result into (``reduce_scatter(...,
        into=)``) when it holds nothing yet this step, counted as written; else None (the
        result is ``accumulate``d)."""
        if index not in self._unwritten:
            return None
        self._unwritten.discard(index)
        return self.pieces[index]

    def chunks(self) -> list[torch.Tensor | None]:
        for i in self._unwritten:
            self.pieces[i].zero_()
        self._unwritten.clear()
        return list(self.pieces)

    def zero(self) -> None:
        if self.buffer is not None:
            self._unwritten = set(range(len(self.pieces)))
        else:
            self.pieces = [None] * len(self.pieces)
