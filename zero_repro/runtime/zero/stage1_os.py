"""P_os: optimizer-state partitioning (paper §5.1), ``Stage1Os``.

Memory per rank: 2Ψ params + 2Ψ grads + 12Ψ/N_d optimizer (fp32 master, m, v of this rank's
shard) = 4Ψ + 12Ψ/N_d bytes. Communication per step: reduce-scatter of the gradients (Ψ) +
all-gather of the updated parameters (Ψ) = 2Ψ elements, as baseline DP (§7.2.1).

Full gradients accumulate as in stage 0 (``buckets.FullGrads``); on the last micro-batch each
complete bucket is reduce-scattered through the DP group's transport into this rank's range.
After AdamW on the fp32 shard the updated chunks are all-gathered bucket by bucket into the flat
parameters (``buckets.ParamGather``; with ``zero.overlap_param_gather`` bucket k is on the wire
while Adam updates chunk k+1, and the next forward waits per module).
"""
from __future__ import annotations

import torch

from zero_repro.config import TrainConfig, ZeroConfig, ZeroRConfig
from zero_repro.runtime.comm.topology import Topology
from zero_repro.runtime.comm.buffers import InFlight
from zero_repro.runtime.comm.transport import bucket_transport
from zero_repro.runtime.zero.ledger import MemoryLedger
from zero_repro.runtime.zero.buckets import FullGrads, GatheredAfterStep, TiedIntoFullGrads
from zero_repro.runtime.zero.flat_buffer import FlatParams
from zero_repro.runtime.zero.partition import Bucket
from zero_repro.runtime.zero.strategy import Strategy


class Stage1Os(TiedIntoFullGrads, GatheredAfterStep, Strategy):
    stage = 1

    def __init__(self, model: torch.nn.Module, topo: Topology, zero: ZeroConfig,
                 train: TrainConfig, zero_r: ZeroRConfig | None = None):
        super().__init__(model, topo, zero, train, zero_r)
        self.flat = FlatParams("model", self.named, self.dtype, self.n_d,
                               self._bucket_capacity())
        t = self.transport = bucket_transport(self.dp_group)
        self.grads = FullGrads(self.flat, self.n_d, self._reduce_scatter, t)
        chunk = max((b.chunk for b in self.flat.partition.buckets), default=0)
        self.inflight = InFlight(t.in_flight_limit)
        self.rs_pool = t.scratch_pool(chunk, self.dtype, self.inflight, self.device)
        self.ag_inflight = InFlight(t.in_flight_limit)
        self.ag_pool = t.gather_pool(chunk, self.dtype, self.ag_inflight, self.device)
        self._attach_param_gather(self.flat, t, self.ag_pool, self.ag_inflight)
        self._attach([self.flat], shard_rank=self.dp_rank, counts_norm=True)
        self._tied = self._tied_weight(self.flat)

    # ------------------------------------------------------------------ backward
    def _on_grad(self, p: torch.Tensor) -> None:
        self.grads.add(p, launch=self._is_last)

    def _finish_backward(self) -> None:
        if self._is_last:  # buckets of parameters that got no gradient
            self.grads.launch_remaining()

    def _reduce_scatter(self, b: Bucket, buf: torch.Tensor) -> None:
        """The own chunk of ``buf`` (= this rank's range of the gradient buffer) gets the sum."""
        scratch = self.rs_pool.acquire()
        works, finish = self.transport.reduce_scatter_in_place(
            buf, scratch[:self.transport.scratch_numel(b.chunk)])

        def done():
            finish()
            self.rs_pool.release(scratch)

        self.inflight.launch(works, done)

    def _wait_reductions(self) -> None:
        self.grads.launch_remaining()  # e.g. step() after backward under no_sync()
        self.inflight.wait_all()
        self.grads.end_step()

    # ------------------------------------------------------------------ shards
    def _param_chunks(self) -> list[torch.Tensor]:
        return self.flat.owned_chunks(self.shard_rank)

    def _grad_chunks(self) -> list[torch.Tensor | None]:
        return self.grads.chunks(self.shard_rank)

    def _zero_grads(self) -> None:
        self.grads.zero()

    def _ledger(self, ledger: MemoryLedger) -> None:
        ledger.add("params_lp", self.flat.nbytes)
        ledger.add("grads", self.grads.nbytes)
        ledger.add("comm_buffers", self.rs_pool.capacity_bytes + self.ag_pool.capacity_bytes)
