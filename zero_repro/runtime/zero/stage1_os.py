"""P_os: optimizer-state partitioning (paper §5.1), ``Stage1Os``.

Memory per rank: 2Ψ params + 2Ψ grads + 12Ψ/N_d optimizer (fp32 master, m, v of this rank's
shard) = 4Ψ + 12Ψ/N_d bytes. Communication per step: reduce-scatter of the gradients (Ψ) +
all-gather of the updated parameters (Ψ) = 2Ψ elements, as baseline DP (§7.2.1). With
``zero.shard_size`` = G < N_d (``strategy``): N_d reads G above, plus an all-reduce of the owned
Ψ/G gradient elements over the N_d/G replicas (2Ψ/G).

Full gradients accumulate as in stage 0 (``grads.FullGrads``); on the last micro-batch each
complete gradient bucket is reduce-scattered through the DP group's transport into this rank's
range. After AdamW on the fp32 shard the updated chunks are all-gathered gather bucket by gather
bucket into the flat parameters (``params.GatheredParams``; with ``zero.overlap_param_gather``
overlapped with the step and the next forward).
"""
from __future__ import annotations

import torch

from zero_repro.config import TrainConfig, ZeroConfig, ZeroRConfig
from zero_repro.runtime.comm.topology import Topology
from zero_repro.runtime.zero.flat_buffer import FlatParams
from zero_repro.runtime.zero.grads import FullGrads
from zero_repro.runtime.zero.ledger import MemoryLedger
from zero_repro.runtime.zero.params import GatheredParams
from zero_repro.runtime.zero.strategy import Strategy


class Stage1Os(Strategy):
    stage = 1

    def __init__(self, model: torch.nn.Module, topo: Topology, zero: ZeroConfig,
                 train: TrainConfig, zero_r: ZeroRConfig | None = None, **kw):
        super().__init__(model, topo, zero, train, zero_r, **kw)
        transport, shard = self.transport, self.mesh.shard  # shard over G ranks (HSDP: G < N_d)
        self.flat = FlatParams("model", self.named, self.dtype, shard.size, self.buckets,
                               alloc=transport.buffer, device=self.device, copy=self.init is None)
        self.frozen_flat = self._place_frozen()
        if self.init is not None:  # partitioned construction: one placement, filled here
            self.init(self.named + self.frozen)
        grads = self._fused_grads([self.flat]) if zero.offload_optimizer == "cpu" else \
            FullGrads(self.flat, self.n_d, shard.rank, transport, all_reduce=False,
                      replicas=self.replicas)
        params = GatheredParams(self.flat, shard.rank, transport, self.zero, self.module)
        # replicas hold the same shard: the first replica counts it in the norm
        self._compose(params, grads, [self.flat], shard_rank=shard.rank,
                      counts_norm=self.mesh.replicate.rank == 0)

    def _ledger(self, ledger: MemoryLedger) -> None:
        ledger.add("params_lp", self.flat.nbytes)
        if self.frozen_flat is not None:
            ledger.add("params_frozen", self.frozen_flat.nbytes)
        ledger.add("grads", self.grads.grad_bytes)  # offload: none (the host holds them)
        ledger.add("comm_buffers", self.grads.buffer_bytes)  # offload's fused buffers
