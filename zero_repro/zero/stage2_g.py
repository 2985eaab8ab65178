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
and only what stays unwritten (padding, parameters without a gradient this micro-batch) is
zeroed when the bucket is launched. On gloo the reduce-scatter runs as N_d rooted reduces in
place in the fused buffer and the parameter all-gather as N_d rooted broadcasts in place in the
flat parameters (``flat_buffer.rooted_collectives``; same 2Ψ ledger volume).
"""
from __future__ import annotations

import torch

from zero_repro.distributed import comm
from zero_repro.zero.ledger import MemoryLedger
from zero_repro.zero.flat_buffer import (BufferPool, FlatParams, GradShards, InFlight,
                                         reduce_chunks, rooted_collectives)
from zero_repro.zero.partition import Bucket, intersect
from zero_repro.zero.stage1_os import gather_updated
from zero_repro.zero.strategy import Strategy


class Stage2G(Strategy):
    stage = 2

    def _build_groups(self, named) -> list[FlatParams]:
        g = FlatParams("model", named, self.dtype, self.n_d, self._bucket_capacity())
        self.flat = g
        part = g.partition
        nb = len(part.buckets)
        self.cap = part.capacity
        self.cap_chunk = max((b.chunk for b in part.buckets), default=0)
        self.rooted = rooted_collectives()
        if self.rooted:
            # reduced in place: a pool entry is just the fused bucket; 4 of them (instead of
            # 2) let backward run on while gloo's slower collectives drain (measured: with 2
            # the gradient hook blocked backward ~0.2 s per step on GPT-20M)
            self.inflight = InFlight(max_in_flight=4)
            self.pool = BufferPool(self.cap, self.dtype, self.inflight, max_buffers=4)
            self.ag_inflight = InFlight(max_in_flight=1 << 30)  # gathered in place
            self.ag_pool = None
        else:
            self.inflight = InFlight(max_in_flight=2)
            # one pool entry = fused input bucket [0, cap) + reduce-scatter output
            self.pool = BufferPool(self.cap + self.cap_chunk, self.dtype, self.inflight)
            self.ag_inflight = InFlight(max_in_flight=2)
            self.ag_pool = BufferPool(self.cap_chunk, self.dtype, self.ag_inflight)
        self.grads = GradShards([b.chunk for b in part.buckets], self.dtype,
                                self.zero_r.contiguous_memory)
        self._filling: dict[int, torch.Tensor] = {}  # bucket index -> pool buffer
        self._filled = [0] * nb
        self._slot_idx = {id(p): i for i, p in enumerate(g.params)}
        self._got: list[set[int]] = [set() for _ in range(nb)]  # slots copied into the bucket
        # per bucket: (slot index, flat lo, flat hi) of every slot piece inside it
        self._pieces: list[list[tuple[int, int, int]]] = [[] for _ in range(nb)]
        for i, s in enumerate(g.slots):
            for b in part.buckets_of(s.offset, s.numel):
                lo, hi = intersect(b.start, b.end, s.offset, s.end)
                self._pieces[b.index].append((i, lo, hi))
        return [g]

    # ------------------------------------------------------------------ backward
    @torch.no_grad()
    def _on_grad(self, p: torch.Tensor) -> None:
        part = self.flat.partition
        s = self.flat.slot_of[id(p)]
        grad = p.grad.reshape(-1)
        for b in part.buckets_of(s.offset, s.numel):
            buf = self._bucket_buffer(b)
            lo, hi = intersect(b.start, b.end, s.offset, s.end)
            buf[lo - b.start:hi - b.start].copy_(grad[lo - s.offset:hi - s.offset])
            self._got[b.index].add(self._slot_idx[id(p)])
            self._filled[b.index] += hi - lo
            if self._filled[b.index] == part.real_in_bucket(b):
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
        if self._filled[b.index] < part.real_in_bucket(b):  # missing gradients reduce as zeros
            for i, lo, hi in self._pieces[b.index]:
                if i not in got:
                    buf[lo - b.start:hi - b.start].zero_()
        if b.end > part.numel:  # padding
            buf[max(part.numel - b.start, 0):b.size].zero_()
        self._filled[b.index] = 0
        self._got[b.index] = set()
        inp = buf[:b.size]
        if self.n_d > 1:
            inp.div_(self.n_d)
        if self.rooted:  # the own chunk of the fused buffer receives the sum
            r = self.dp_rank
            out = inp[r * b.chunk:(r + 1) * b.chunk]
            works = reduce_chunks(inp, b.chunk, self.dp)
        else:
            out = buf[self.cap:self.cap + b.chunk]
            works = [comm.reduce_scatter_into(out, inp, self.dp, async_op=True)]

        def done():
            self._accumulate(b, out)
            self.pool.release(buf)

        self.inflight.launch(works, done)

    def _accumulate(self, b: Bucket, out: torch.Tensor) -> None:
        self.grads.accumulate(b.index, out)

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

    def _publish(self) -> None:
        gather_updated(self.flat, self.dp_rank, self.dp, self.ag_pool, self.ag_inflight)

    def _zero_grads(self) -> None:
        self.grads.zero()

    def _ledger(self, ledger: MemoryLedger) -> None:
        ledger.add("params_lp", self.flat.nbytes)
        elt = torch.empty((), dtype=self.dtype).element_size()
        ledger.add("grads", self.flat.partition.shard_numel * elt)  # persistent shard
        ag = self.ag_pool.capacity_bytes if self.ag_pool is not None else 0
        ledger.add("comm_buffers", self.pool.capacity_bytes + ag)
