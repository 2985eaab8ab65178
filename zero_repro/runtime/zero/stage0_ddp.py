"""Baseline data parallelism (paper §3.1, §7.1): every rank keeps all model states (``Stage0DDP``).

Memory per rank (mixed precision, Adam): 2Ψ params + 2Ψ grads + 12Ψ optimizer = 16Ψ bytes.
Communication per step: one all-reduce of the gradients = 2Ψ elements (§7.1).

Gradients accumulate in one flat buffer in the parameter layout (``grads.FullGrads``, shared with
stage 1); a gradient bucket (R consecutive elements of it) is all-reduced in place through the
DP group's transport as soon as its last gradient arrives, overlapping the rest of backward.
Gradients are divided by N_d before the sum, so the result is the mean over DP ranks.
"""
from __future__ import annotations

import torch

from zero_repro.config import TrainConfig, ZeroConfig, ZeroRConfig
from zero_repro.runtime.comm.topology import Topology
from zero_repro.runtime.zero.flat_buffer import FlatParams
from zero_repro.runtime.zero.grads import FullGrads
from zero_repro.runtime.zero.ledger import MemoryLedger
from zero_repro.runtime.zero.params import ReplicatedParams
from zero_repro.runtime.zero.strategy import Strategy


class Stage0DDP(Strategy):
    stage = 0

    def __init__(self, model: torch.nn.Module, topo: Topology, zero: ZeroConfig,
                 train: TrainConfig, zero_r: ZeroRConfig | None = None, **kw):
        super().__init__(model, topo, zero, train, zero_r, **kw)
        if self.mesh.replicas > 1:
            raise ValueError(f"zero.shard_size={zero.shard_size} at zero.stage=0: stage 0 "
                             f"shards nothing; use zero.stage=1, 2 or 3, or drop "
                             f"zero.shard_size")
        r = self.buckets[0]  # one shard: full parameters and optimizer state on every rank
        self.flat = FlatParams("model", self.named, self.dtype, 1, (r, r), device=self.device,
                               copy=self.init is None)
        self.frozen_flat = self._place_frozen()
        if self.init is not None:  # partitioned construction: one placement, filled here
            self.init(self.named + self.frozen)
        grads = self._fused_grads([self.flat]) if zero.offload_optimizer == "cpu" else \
            FullGrads(self.flat, self.n_d, 0, self.transport, all_reduce=True,
                      dp_rank=self.dp_rank)
        # gradients are identical on every DP rank after the all-reduce: DP rank 0 counts them
        self._compose(ReplicatedParams(self.flat), grads, [self.flat], shard_rank=0,
                      counts_norm=self.dp_rank == 0)

    def _ledger(self, ledger: MemoryLedger) -> None:
        ledger.add("params_lp", self.flat.nbytes)
        if self.frozen_flat is not None:
            ledger.add("params_frozen", self.frozen_flat.nbytes)
        ledger.add("grads", self.grads.grad_bytes)  # offload: none (the host holds them)
        ledger.add("comm_buffers", self.grads.buffer_bytes)  # offload's fused buffers  # buckets are reduced in place in it
