"""Parameter stores of ZeRO-DP stages 0-2 (paper §5): where the training-dtype parameters live,
which chunks of them this rank's optimizer updates (``chunks``), and how the updated chunks
reach every rank (``start_param_sync`` / ``finish_param_sync``; stage 3's store, which gathers
each unit around its use, is ``stage3_p.Units``). Megatron-LM's ``_ParamAndGradBucketGroup``
names the same pair.

* ``ReplicatedParams`` (stage 0): every rank updates every element; nothing to sync.
* ``GatheredParams`` (stages 1, 2): each rank updates its chunks, then every gather bucket
  (``partition.Partition.gather_buckets``, A elements) is all-gathered into the flat parameters
  in place (Ψ elements per step). ``zero.overlap_param_gather`` on: gather bucket j starts as
  soon as the optimizer finished its last chunk, and the next forward waits module by module
  for the gather buckets that module's parameters reach (a forward pre-hook); off: all of them
  start after the update and are waited inside the step. Bit-identical either way. A parameter
  read inside the forward of a module other than its owner must come after the owner's forward
  (GPT's tied head reads ``wte.weight`` after ``wte`` ran), or ``finish_param_sync`` first.
"""
from __future__ import annotations

import torch
from torch import nn

from zero_repro.config import ZeroConfig
from zero_repro.runtime.comm.transport import Transport
from zero_repro.runtime.zero.flat_buffer import FlatParams
from zero_repro.runtime.zero.grads import InFlight


class _Flat:
    """A store of one flat buffer whose parameters stay in place through backward."""

    def pre_backward(self) -> None:
        return None

    def post_backward(self) -> None:
        return None

    def remove_hooks(self) -> None:
        return None


class ReplicatedParams(_Flat):
    """Stage 0: the full parameters on every rank, all of them updated here."""

    def __init__(self, flat: FlatParams):
        self.flat = flat

    def chunks(self) -> list[torch.Tensor]:
        return self.flat.owned_chunks(0)

    def start_param_sync(self, chunk: int | None = None) -> None:
        return None

    def finish_param_sync(self) -> None:
        return None


class GatheredParams(_Flat):
    """Stages 1, 2: this rank's chunks updated here, all-gathered after the update."""

    def __init__(self, flat: FlatParams, rank: int, transport: Transport, zero: ZeroConfig,
                 module: nn.Module):
        self.flat, self.rank, self.transport, self.zero = flat, rank, transport, zero
        self.inflight = InFlight()  # gather buckets started, oldest (lowest index) first
        self.pending: list[int] = []  # their indices, in the same order
        self.started = len(flat.partition.gather_buckets)  # of this round: none left to start
        self.hooks = self._module_hooks(module)

    def chunks(self) -> list[torch.Tensor]:
        return self.flat.owned_chunks(self.rank)

    def overlapped(self) -> bool:
        """``zero.overlap_param_gather``; None (a strategy built directly): on GPU ranks."""
        on = self.zero.overlap_param_gather
        return self.flat.flat.device.type == "cuda" if on is None else on

    def start_param_sync(self, chunk: int | None = None) -> None:
        """``chunk``: the optimizer finished chunk ``chunk`` (overlapped: the gather bucket it
        completes starts now); None: the update is done, every gather bucket not started yet
        starts (and is waited here unless overlapped)."""
        spans = self.flat.partition.gather_buckets
        if chunk is not None:
            if self.overlapped() and self.started < len(spans) and \
                    chunk == spans[self.started].stop - 1:
                self._start()
            return
        while self.started < len(spans):
            self._start()
        if not self.overlapped():
            self.finish_param_sync()

    def _start(self) -> None:
        j = self.started
        part = self.flat.partition
        span, flat = part.gather_buckets[j], self.flat.flat
        works = []
        for b in part.buckets[span.first:span.stop]:
            lo, hi = b.owned(self.rank)
            works.append(self.transport.all_gather(flat[b.start:b.end], flat[lo:hi]))
        self.inflight.add(works)
        self.pending.append(j)
        self.started += 1

    def wait_through(self, j: int) -> None:
        """Until gather buckets 0..j have landed."""
        while self.pending and self.pending[0] <= j:
            self.pending.pop(0)
            self.inflight.wait_oldest()

    def finish_param_sync(self) -> None:
        """Every gather started has landed (the parameters are current, nothing reads this
        rank's chunks any more: the optimizer may write them); the next update's gathers
        start from the first gather bucket."""
        self.inflight.wait_all()
        self.pending = []
        self.started = 0

    def _module_hooks(self, model: nn.Module) -> list:
        """Forward pre-hooks waiting for the gather buckets of each module's own parameters."""
        part, hooks = self.flat.partition, []
        for m in model.modules():
            ends = [part.spans_of(part.gather_buckets, s.offset, s.numel)[-1][0].index
                    for s in (self.flat.slot_of.get(id(p)) for p in m.parameters(recurse=False))
                    if s is not None and s.numel]
            if ends:
                last = max(ends)
                hooks.append(m.register_forward_pre_hook(
                    lambda _m, _args, last=last: self.wait_through(last)))
        return hooks

    def remove_hooks(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []
