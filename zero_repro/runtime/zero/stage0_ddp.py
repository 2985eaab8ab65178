"""Baseline data parallelism (paper §3.1, §7.1): every rank keeps all model states (``Stage0DDP``).

Memory per rank (mixed precision, Adam): 2Ψ params + 2Ψ grads + 12Ψ optimizer = 16Ψ bytes.
Communication per step: one all-reduce of the gradients = 2Ψ elements (§7.1).

Gradients accumulate in one flat buffer in the parameter layout (``buckets.FullGrads``, shared
with stage 1); a bucket (C_B consecutive elements of it) is all-reduced in place through the DP
group's transport as soon as its last gradient arrives, overlapping the rest of backward.
Gradients are divided by N_d before the sum, so the result is the mean over DP ranks.
"""
from __future__ import annotations

import torch

from zero_repro.config import TrainConfig, ZeroConfig, ZeroRConfig
from zero_repro.runtime.comm.topology import Topology
from zero_repro.runtime.comm.buffers import InFlight
from zero_repro.runtime.comm.transport import bucket_transport
from zero_repro.runtime.zero.ledger import MemoryLedger
from zero_repro.runtime.zero.buckets import FullGrads, TiedIntoFullGrads
from zero_repro.runtime.zero.flat_buffer import FlatParams, Pieces
from zero_repro.runtime.zero.partition import Bucket
from zero_repro.runtime.zero.strategy import Strategy


class Stage0DDP(TiedIntoFullGrads, Strategy):
    stage = 0

    def __init__(self, model: torch.nn.Module, topo: Topology, zero: ZeroConfig,
                 train: TrainConfig, zero_r: ZeroRConfig | None = None):
        super().__init__(model, topo, zero, train, zero_r)
        # one shard: full parameters and optimizer state on every rank
        self.flat = FlatParams("model", self.named, self.dtype, 1, self._bucket_capacity())
        self.transport = bucket_transport(self.dp_group)
        self.grads = FullGrads(self.flat, self.n_d, self._all_reduce, self.transport)
        self.inflight = InFlight(max_in_flight=1 << 30)  # in place: nothing limits it
        # per bucket, where its sums are read once reduced (``transport.all_reduce_views``)
        self._sums: list[torch.Tensor | Pieces | None] = [None] * len(self.flat.partition.buckets)
        # gradients are identical on every DP rank after the all-reduce: DP rank 0 counts them
        self._attach([self.flat], shard_rank=0, counts_norm=self.dp_rank == 0)
        self._tied = self._tied_weight(self.flat)

    # ------------------------------------------------------------------ backward
    def _on_grad(self, p: torch.Tensor) -> None:
        self.grads.add(p, launch=self._is_last)

    def _finish_backward(self) -> None:
        if self._is_last:  # buckets of parameters that got no gradient
            self.grads.launch_remaining()

    def _all_reduce(self, b: Bucket, buf: torch.Tensor) -> None:
        works, views = self.transport.all_reduce_views(buf)
        self._sums[b.index] = views[0] if len(views) == 1 else Pieces(views)
        self.inflight.launch(works, lambda: None)

    def _wait_reductions(self) -> None:
        self.grads.launch_remaining()  # e.g. step() after backward under no_sync()
        self.inflight.wait_all()
        self.grads.end_step()

    # ------------------------------------------------------------------ shards
    def _param_chunks(self) -> list[torch.Tensor]:
        return self.flat.owned_chunks(self.shard_rank)

    def _grad_chunks(self) -> list[torch.Tensor | Pieces | None]:
        # where a bucket was reduced, its sums as the transport left them to be read
        return [own if s is None else s
                for own, s in zip(self.grads.chunks(self.shard_rank), self._sums)]

    def _after_step(self) -> None:
        # the peers' sums were read in place (every rank at the same point, step taken or
        # skipped): the peers may write their gradient buffers again
        self.transport.release(self.grads.buffer)
        self._sums = [None] * len(self._sums)

    def _zero_grads(self) -> None:
        self.grads.zero()

    def _ledger(self, ledger: MemoryLedger) -> None:
        ledger.add("params_lp", self.flat.nbytes)
        ledger.add("grads", self.grads.nbytes)
        ledger.add("comm_buffers", 0)  # buckets are reduced in place in the gradient buffer
