"""P_os+g: optimizer-state and gradient partitioning (paper §5.2), ``Stage2G``.

Memory per rank: 2Ψ params + 2Ψ/N_d gradient shard + 12Ψ/N_d optimizer = 2Ψ + 14Ψ/N_d bytes,
plus the fused gradient buffers (C_B, §6.3: two of R elements). Without C_B a gradient bucket
is the whole model, the full gradient exists before it can be reduced: its one fused buffer of Ψ
is stage 1's flat gradient buffer, reduce-scattered in place on the last micro-batch, the shard
in it (4Ψ + 12Ψ/N_d, stage 1's memory: P_g saves gradient memory only with C_B).
Communication per step: reduce-scatter of the gradients (Ψ) + all-gather of the parameters (Ψ)
= 2Ψ elements (§7.2.1). With ``zero.shard_size`` = G < N_d (``strategy``): N_d reads G above, plus
an all-reduce of the owned Ψ/G gradient elements over the N_d/G replicas (2Ψ/G).

In backward each gradient is copied (divided by N_d) into the fused buffer of its gradient
bucket(s) (``grads.FusedGrads``); a complete bucket is reduce-scattered asynchronously into
this rank's persistent gradient shard: the full gradient never exists on any rank. Every
micro-batch is reduce-scattered (gradient memory stays Ψ/N_d). ZeRO-R: ``constant_buffers``
false: the one model-size bucket above; ``contiguous_memory`` (M_D) keeps the shard in one
pre-allocated tensor, else each chunk is allocated right before its first reduction writes it
and freed in ``zero_grad``. The parameter all-gather is stage 1's (``params.GatheredParams``).
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


class Stage2G(Strategy):
    stage = 2

    def __init__(self, model: torch.nn.Module, topo: Topology, zero: ZeroConfig,
                 train: TrainConfig, zero_r: ZeroRConfig | None = None, **kw):
        super().__init__(model, topo, zero, train, zero_r, **kw)
        transport, shard = self.transport, self.mesh.shard  # shard over G ranks (HSDP: G < N_d)
        self.flat = FlatParams("model", self.named, self.dtype, shard.size, self.buckets,
                               alloc=transport.buffer, device=self.device, copy=self.init is None)
        self.frozen_flat = self._place_frozen()
        if self.init is not None:  # partitioned construction: one placement, filled here
            self.init(self.named + self.frozen)
        if self.zero_r.constant_buffers or zero.offload_optimizer == "cpu":
            grads = self._fused_grads([self.flat])
        else:  # one gradient bucket of the whole model: stage 1's store, the shard inside it
            grads = FullGrads(self.flat, self.n_d, shard.rank, transport, all_reduce=False,
                              replicas=self.replicas)
        params = GatheredParams(self.flat, shard.rank, transport, self.zero, self.module)
        # replicas hold the same shard: the first replica counts it in the norm
        self._compose(params, grads, [self.flat], shard_rank=shard.rank,
                      counts_norm=self.mesh.replicate.rank == 0)

    def _ledger(self, ledger: MemoryLedger) -> None:
        ledger.add("params_lp", self.flat.nbytes)
        if self.frozen_flat is not None:
            ledger.add("params_frozen", self.frozen_flat.nbytes)
        ledger.add("grads", self.grads.grad_bytes)  # the shard (C_B off: the buffer holding it)
        ledger.add("comm_buffers", self.grads.buffer_bytes)  # the fused gradient buffers
