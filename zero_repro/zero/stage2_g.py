"""P_os+g: optimizer-state and gradient partitioning (paper §5.2).

Memory per rank: 2Ψ params + 2Ψ/N_d gradient shard + 12Ψ/N_d optimizer = 2Ψ + 14Ψ/N_d bytes,
plus constant-size fused buckets (C_B, §6.3). Communication per step: reduce-scatter of the
gradients (Ψ) + all-gather of the parameters (Ψ) = 2Ψ elements (§7.2.1).

During backward each gradient is copied into the fused buffer of the bucket(s) it belongs to
(a bucket is a consecutive range of the flat layout, so its gradients become ready together);
a complete bucket is reduce-scattered asynchronously while backward continues, and this rank
adds the reduced chunk into its persistent gradient shard. The full gradient never exists on
any rank. With gradient accumulation every micro-batch is reduce-scattered (the shard
accumulates), which keeps the gradient memory at Ψ/N_d at the price of k reduce-scatters.

ZeRO-R knobs: ``constant_buffers`` false sizes the fused buffer to the whole model (the
baseline behaviour the paper's C_B fixes); ``contiguous_memory`` (M_D) true keeps the gradient
shard in one pre-allocated contiguous tensor, false allocates each bucket's chunk when its first
reduced gradient arrives and frees them all in ``zero_grad`` (fragmenting the heap).

A fused buffer is not zeroed when it is taken from the pool: every gradient is copied into it,
divided by N_d on the way (``buckets.scale_into``, one pass instead of a copy and a division),
and only what stays unwritten (padding, parameters without a gradient this micro-batch) is
zeroed when the bucket is launched. Collectives go through the DP group's transport
(``distributed.transport``): a pool entry is the fused bucket plus the transport's scratch for
the reduced chunk (gloo's pairwise transport: the peers' (N_d - 1) contributions to it; none for
the rooted, in-place one of the dry run; both keep 4 fused buckets in flight instead of 2); the parameter all-gather is ``buckets.ParamGather``, shared
with stage 1 (overlapped with the step and the next forward under
``zero.overlap_param_gather``). Same 2Ψ ledger volume either way.
"""
from __future__ import annotations

import torch

from zero_repro.config import TrainConfig, ZeroConfig, ZeroRConfig
from zero_repro.distributed.topology import Topology
from zero_repro.distributed.buffers import BufferPool, InFlight
from zero_repro.distributed.transport import bucket_transport
from zero_repro.zero.ledger import MemoryLedger
from zero_repro.zero.buckets import (Arrivals, GatheredAfterStep, bucket_pieces, reduce_to_shard,
                                     scale_into, slot_pieces)
from zero_repro.zero.flat_buffer import FlatParams, GradShards
from zero_repro.zero.partition import Bucket
from zero_repro.zero.strategy import Strategy


class Stage2G(GatheredAfterStep, Strategy):
    stage = 2

    def __init__(self, model: torch.nn.Module, topo: Topology, zero: ZeroConfig,
                 train: TrainConfig, zero_r: ZeroRConfig | None = None):
        super().__init__(model, topo, zero, train, zero_r)
        self.flat = FlatParams("model", self.named, self.dtype, self.n_d,
                               self._bucket_capacity())
        part = self.flat.partition
        self.cap = part.capacity
        self.cap_chunk = max((b.chunk for b in part.buckets), default=0)
        t = self.transport = bucket_transport(self.dp_group)
        # one collective in flight per fused bucket; a pool entry = fused input bucket
        # [0, cap) + the transport's scratch for the reduced chunk
        self.inflight = InFlight(max_in_flight=t.fused_buffers)
        numel = self.cap + t.scratch_numel(self.cap_chunk)
        # where the transport offers memory the peers map (CPU ranks on one host), the fused
        # buckets live there: a reduce-scatter reads the peers' chunks in place instead of
        # their copies in the slots; a bucket is refilled after its ``fence`` (its readers are
        # done). Buckets take the buffers in the same order on every rank (same hooks).
        shared = [t.shared_buffer(numel, self.dtype) for _ in range(t.fused_buffers)] \
            if part.buckets else []
        shared = shared if shared and all(b is not None for b in shared) else None
        self.pool = BufferPool(numel, self.dtype, self.inflight, max_buffers=t.fused_buffers,
                               device=self.device, buffers=shared,
                               before_write=t.fence if shared else None)
        self.ag_inflight = InFlight(t.in_flight_limit)
        self.ag_pool = t.gather_pool(self.cap_chunk, self.dtype, self.ag_inflight, self.device)
        self.grads = GradShards([b.chunk for b in part.buckets], self.dtype,
                                self.zero_r.contiguous_memory, self.device)
        self._filling: dict[int, torch.Tensor] = {}  # bucket index -> pool buffer
        self._arrivals = Arrivals(part)
        self._slot_idx = {id(p): i for i, p in enumerate(self.flat.params)}
        self._got: list[set[int]] = [set() for _ in part.buckets]  # slots copied into bucket
        self._pieces = slot_pieces(self.flat)
        self._attach_param_gather(self.flat, t, self.ag_pool, self.ag_inflight)
        self._attach([self.flat], shard_rank=self.dp_rank, counts_norm=True)

    # ------------------------------------------------------------------ backward
    @torch.no_grad()
    def _on_grad(self, p: torch.Tensor) -> None:
        s = self.flat.slot_of[id(p)]
        grad = p.grad.reshape(-1)
        for b, lo, hi in bucket_pieces(self.flat.partition, s):
            buf = self._bucket_buffer(b)
            # divided by N_d on the way in (every micro-batch is reduced on its own)
            scale_into(buf[lo - b.start:hi - b.start], grad[lo - s.offset:hi - s.offset],
                       self.n_d)
            self._got[b.index].add(self._slot_idx[id(p)])
            if self._arrivals.add(b, hi - lo):
                self._launch(b)
        p.grad = None  # only the shard is kept

    def _bucket_buffer(self, b: Bucket) -> torch.Tensor:
        buf = self._filling.get(b.index)
        if buf is None:
            buf = self.pool.acquire()  # not zeroed: see _launch
            self._filling[b.index] = buf
        return buf

    def _launch(self, b: Bucket) -> None:
        buf = self._filling.pop(b.index)
        part = self.flat.partition
        got = self._got[b.index]
        if not self._arrivals.complete(b):  # missing gradients reduce as zeros
            for i, lo, hi in self._pieces[b.index]:
                if i not in got:
                    buf[lo - b.start:hi - b.start].zero_()
        if b.end > part.numel:  # padding
            buf[max(part.numel - b.start, 0):b.size].zero_()
        self._arrivals.reset(b)
        self._got[b.index] = set()
        inp = buf[:b.size]  # already divided by N_d (_on_grad); zeros stay zeros
        # the reduced own chunk: in the scratch after the fused bucket, or (in place) in it
        t = self.transport
        works, finish = reduce_to_shard(t, self.grads, b.index, inp,
                                        buf[self.cap:self.cap + t.scratch_numel(b.chunk)])

        def done():
            finish()
            self.pool.release(buf)

        self.inflight.launch(works, done)

    def _finish_backward(self) -> None:
        # buckets with parameters that got no gradient this micro-batch: send what arrived
        for idx in sorted(self._filling):
            self._launch(self.flat.partition.buckets[idx])

    def _wait_reductions(self) -> None:
        self.inflight.wait_all()

    # ------------------------------------------------------------------ shards
    def _param_chunks(self) -> list[torch.Tensor]:
        return self.flat.owned_chunks(self.dp_rank)

    def _grad_chunks(self) -> list[torch.Tensor | None]:
        return self.grads.chunks()

    def _zero_grads(self) -> None:
        self.grads.zero()

    def _ledger(self, ledger: MemoryLedger) -> None:
        ledger.add("params_lp", self.flat.nbytes)
        elt = self.dtype.itemsize
        ledger.add("grads", self.flat.partition.shard_numel * elt)  # persistent shard
        ledger.add("comm_buffers", self.pool.capacity_bytes + self.ag_pool.capacity_bytes)
