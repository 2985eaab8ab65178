"""Contiguous flat buffers for ZeRO-DP (paper §5): parameters as views into one flat tensor, this
rank's shard as views of its chunks, and the gradient shard.

``FlatParams`` owns one group of parameters (the whole model for stages 0-2, one unit for stage
3): it casts them to the training dtype, lays them end to end (``partition.layout``), pads to the
bucket grid (``partition.Partition``) and re-points every ``param.data`` at its view of the flat
tensor (made by ``alloc``, e.g. the transport's ``buffer``), so writing the flat tensor updates
the module in place. Parameters built without storage (the ``meta`` device: partitioned
construction) are not copied: each is swapped for its view (``torch.utils.swap_tensors``: the
same Python object, its attributes kept) and filled by the caller's initialisation afterwards.
Stage 3 frees the storage (``free``) and re-allocates it (``materialize``)
around each use; the views stay valid (storage resized, not replaced, so tensors autograd saved
see the re-gathered values). ``PeakBytes`` tracks stage 3's gathered units; ``GradShards`` is
the reduced gradient shard of stages 2 and 3.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Sequence

import torch
from torch import nn

from zero_repro.runtime.zero.partition import Partition, Slot, layout


class FlatParams:
    """One flat, padded, bucketed buffer holding a group of parameters."""

    def __init__(self, name: str, named_params: Sequence[tuple[str, nn.Parameter]],
                 dtype: torch.dtype, n_shards: int, buckets: tuple[int, int],
                 alloc: Callable[[int, torch.dtype], torch.Tensor] | None = None,
                 device: torch.device | None = None, copy: bool = True):
        """``buckets``: (R, A), the gradient and gather bucket capacities in elements;
        ``alloc(numel, dtype)``: a zeroed tensor for the flat buffer (default: the torch heap,
        on ``device``, by default the parameters'); ``copy``: copy the parameters' values in
        (False: they have none yet, the caller initialises the views)."""
        self.name = name
        self.params = [p for _, p in named_params]
        self.names = [n for n, _ in named_params]
        self.slots, numel = layout(self.names, [tuple(p.shape) for _, p in named_params])
        self.partition = Partition(numel, n_shards, *buckets)  # n_shards: 1 or N_d
        self.dtype = dtype
        # the model's parameters are re-pointed into it
        if device is None:
            device = self.params[0].device if self.params else torch.device("cpu")
        n = self.partition.padded_numel
        self.flat = (torch.zeros(n, dtype=dtype, device=device) if alloc is None
                     else alloc(n, dtype))
        if copy:
            with torch.no_grad():
                for s, p in zip(self.slots, self.params):
                    self.flat[s.offset:s.end].copy_(p.detach().reshape(-1))
        for s, p in zip(self.slots, self.params):
            point(p, self.view(s))
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

    def free(self) -> None:
        """Free the flat storage; the parameter views keep their metadata (no data)."""
        self.flat.untyped_storage().resize_(0)

    def materialize(self) -> None:
        """Re-allocate the flat storage (contents undefined until written)."""
        if not self.is_materialized():
            self.flat.untyped_storage().resize_(self.nbytes)


def point(p: nn.Parameter, view: torch.Tensor) -> None:
    """Make ``p`` a view of ``view``'s storage, in place: ``p.data = view``, or, where the
    tensor types differ (a ``meta`` parameter materialised on a device), swap ``p``'s contents
    for a parameter of ``view`` (the object, its Python attributes and its identity kept)."""
    if p.device != view.device:
        # an empty parameter of the view's kind first; then, as for every parameter, ``.data``
        # (its own version counter: writes into the flat buffer elsewhere do not bump it)
        q = nn.Parameter(torch.empty(0, dtype=view.dtype, device=view.device),
                         requires_grad=p.requires_grad)
        q.__dict__.update(p.__dict__)
        torch.utils.swap_tensors(p, q)
    p.data = view


class PeakBytes:
    """High-water mark of transient allocations (stage 3's gathered units)."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0

    def alloc(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def free(self, nbytes: int) -> None:
        self.live -= nbytes


class GradShards:
    """This rank's reduced gradient shard, one part per bucket (stages 2 and 3).

    M_D (paper §6.3) on: one pre-allocated contiguous buffer of Ψ/N_d elements and a view per
    bucket, so the long-lived gradient shard never interleaves with short-lived tensors. Off:
    each bucket's part is allocated when its first reduced gradient arrives (the fragmenting
    behaviour M_D removes). Parts accumulate across micro-batches until ``zero``, which writes
    nothing: a part's first reduced gradient after it is written straight in (``claim``: one
    pass over Ψ/N_d a step instead of a zero fill plus an addition); a part still unwritten
    when read is zeroed then.
    """

    def __init__(self, sizes: Sequence[int], dtype: torch.dtype, contiguous: bool,
                 device: torch.device | str = "cpu"):
        self.buffer = (torch.zeros(sum(sizes), dtype=dtype, device=device)  # (Ψ/N_d,)
                       if contiguous else None)
        self.sizes, self.dtype, self.device = list(sizes), dtype, device
        self.parts: list[torch.Tensor | None] = [None] * len(sizes)
        if self.buffer is not None:
            offsets = [0]
            for n in sizes:
                offsets.append(offsets[-1] + n)
            self.parts = [self.buffer[a:b] for a, b in zip(offsets, offsets[1:])]
        # parts that hold zeros in meaning, not in memory (all of them until the first write)
        self._unwritten: set[int] = set(range(len(sizes))) if contiguous else set()

    def accumulate(self, index: int, reduced: torch.Tensor) -> None:
        if self.parts[index] is None:
            self.parts[index] = reduced.clone()  # M_D off: allocated as it arrives
        elif index in self._unwritten:
            self._unwritten.discard(index)
            self.parts[index].copy_(reduced)
        else:
            self.parts[index].add_(reduced)

    def claim(self, index: int) -> torch.Tensor | None:
        """Part ``index`` for a reduction to write its result into when it holds nothing yet
        this step (M_D off: allocated now), counted as written; else None (the result is
        ``accumulate``d)."""
        if self.buffer is None and self.parts[index] is None:
            self.parts[index] = torch.empty(self.sizes[index], dtype=self.dtype,
                                            device=self.device)
            return self.parts[index]
        if index not in self._unwritten:
            return None
        self._unwritten.discard(index)
        return self.parts[index]

    def chunks(self) -> list[torch.Tensor | None]:
        for i in self._unwritten:
            self.parts[i].zero_()
        self._unwritten.clear()
        return list(self.parts)

    def zero(self) -> None:
        if self.buffer is not None:
            self._unwritten = set(range(len(self.parts)))
        else:
            self.parts = [None] * len(self.parts)
