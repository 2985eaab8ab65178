"""P_os+g: optimizer-state and gradient partitioning (paper §5.2).

Memory per rank: 2Ψ params + 2Ψ/N_d gradient shard + 12Ψ/N_d optimizer = 2Ψ + 14Ψ/N_d bytes,
plus the fused gradient buffers (C_B, §6.3: two of R elements). Without C_B a gradient bucket
is the whole model, the full gradient exists before it can be reduced: its one fused buffer of Ψ
is stage 1's flat gradient buffer, reduce-scattered in place on the last micro-batch, the shard
in it (4Ψ + 12Ψ/N_d, stage 1's memory: P_g saves gradient memory only with C_B).
Communication per step: reduce-scatter of the gradients (Ψ) + all-gather of the parameters (Ψ)
= 2Ψ elements (§7.2.1).

During backward each gradient is copied into the fused buffer of the gradient bucket(s) it
belongs to (a bucket is a consecutive range of the flat layout, so its gradients become ready
together); a complete bucket is reduce-scattered asynchronously while backward continues, into
this rank's persistent gradient shard (``grads.FusedGrads``). The full gradient never exists on
any rank. With gradient accumulation every micro-batch is reduce-scattered (the shard
accumulates), which keeps the gradient memory at Ψ/N_d at the price of k reduce-scatters. The
parameter all-gather after the step is stage 1's (``params.GatheredParams``).

ZeRO-R knobs: ``constant_buffers`` false: one fused buffer of the whole model (above);
``contiguous_memory`` (M_D) true keeps the gradient shard in one pre-allocated contiguous tensor,
false allocates each bucket's chunk when its first reduced gradient arrives and frees them all
in ``zero_grad`` (fragmenting the heap).
"""
from __future__ import annotations

import torch

from zero_repro.config import TrainConfig, ZeroConfig, ZeroRConfig
from zero_repro.runtime.comm.topology import Topology
from zero_repro.runtime.zero.flat_buffer import FlatParams
from zero_repro.runtime.zero.grads import FullGrads, FusedGrads
from zero_repro.runtime.zero.ledger import MemoryLedger
from zero_repro.runtime.zero.params import GatheredParams
from zero_repro.runtime.zero.strategy import Strategy


class Stage2G(Strategy):
    stage = 2

    def __init__(self, model: torch.nn.Module, topo: Topology, zero: ZeroConfig,
                 train: TrainConfig, zero_r: ZeroRConfig | None = None):
        super().__init__(model, topo, zero, train, zero_r)
        transport = self.transport
        self.flat = FlatParams("model", self.named, self.dtype, self.n_d, self.buckets,
                               alloc=transport.buffer)
        if self.zero_r.constant_buffers:
            grads = FusedGrads([self.flat], self.n_d, self.dp_rank, transport, self.fused_depth,
                               self.zero_r.contiguous_memory, self.device)
        else:  # one gradient bucket of the whole model: stage 1's store, the shard inside it
            grads = FullGrads(self.flat, self.n_d, self.dp_rank, transport, all_reduce=False)
        params = GatheredParams(self.flat, self.dp_rank, transport, self.zero, self.module)
        self._compose(params, grads, [self.flat], shard_rank=self.dp_rank, counts_norm=True)

    def _ledger(self, ledger: MemoryLedger) -> None:
        ledger.add("params_lp", self.flat.nbytes)
        ledger.add("grads", self.grads.grad_bytes)  # the shard (C_B off: the buffer holding it)
        ledger.add("comm_buffers", self.grads.buffer_bytes)  # the fused gradient buffers
