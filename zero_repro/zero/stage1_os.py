"""P_os: optimizer-state partitioning (paper §5.1).

Memory per rank: 2Ψ params + 2Ψ grads + 12Ψ/N_d optimizer (fp32 master, m, v of this rank's
shard) = 4Ψ + 12Ψ/N_d bytes. Communication per step: reduce-scatter of the gradients (Ψ) +
all-gather of the updated parameters (Ψ) = 2Ψ elements, the same as baseline DP (§7.2.1).

Full training-dtype gradients are accumulated as in stage 0; on the last micro-batch each
bucket is reduce-scattered as soon as it is complete, and this rank's reduced chunk lands in its
own range of the gradient buffer (the rest of the buffer is stale and unused). After the AdamW
step on the fp32 shard, the updated chunks are all-gathered bucket by bucket (constant-size
pieces) straight into the flat parameter buffer.

Collectives: on NCCL (and the fake process group) a native reduce-scatter into a pooled output
buffer (copied back over the own range) and an all-gather from a pooled copy of the own chunk
(its input must not alias the output). On gloo, whose reduce-scatter / all-gather are emulated
and slow, the same data movement runs as N_d rooted reduces / broadcasts per bucket, in place in
the gradient / parameter buffer (``flat_buffer.rooted_collectives``): no pooled buffers, no
copies, no limit on collectives in flight, and the same 2Ψ in the §7 ledger (recorded as
``reduce`` Ψ + ``broadcast`` Ψ).
"""
from __future__ import annotations

import torch

from zero_repro.distributed import comm
from zero_repro.zero.ledger import MemoryLedger
from zero_repro.zero.flat_buffer import (BufferPool, FlatParams, InFlight, broadcast_chunks,
                                         reduce_chunks, rooted_collectives)
from zero_repro.zero.partition import Bucket
from zero_repro.zero.stage0_ddp import Stage0DDP


def gather_updated(g: FlatParams, rank: int, dp: comm.Group, pool: BufferPool | None,
                   inflight: InFlight) -> None:
    """All-gather every bucket's owned chunks into ``g.flat`` (stages 1 and 2); ``pool=None``:
    in place, as rooted broadcasts (gloo)."""
    for b in g.partition.buckets:
        if pool is None:
            inflight.launch(broadcast_chunks(g.flat[b.start:b.end], b.chunk, dp), lambda: None)
            continue
        lo, hi = b.owned(rank)
        buf = pool.acquire()
        tmp = buf[:b.chunk]
        tmp.copy_(g.flat[lo:hi])  # gather input must not alias the output buffer
        work = comm.all_gather_into(g.flat[b.start:b.end], tmp, dp, async_op=True)
        inflight.launch([work], lambda buf=buf: pool.release(buf))
    inflight.wait_all()


class Stage1Os(Stage0DDP):
    stage = 1

    def _partition_world(self) -> int:
        return self.n_d

    def _counts_norm(self) -> bool:
        return True  # each rank counts its own shard

    def _build_groups(self, named) -> list[FlatParams]:
        groups = super()._build_groups(named)
        self.rooted = rooted_collectives()
        if self.rooted:  # in place: nothing pooled, nothing limits the collectives in flight
            self.inflight = InFlight(max_in_flight=1 << 30)
            self.ag_inflight = InFlight(max_in_flight=1 << 30)
            self.rs_pool = self.ag_pool = None
            return groups
        chunk = max((b.chunk for b in self.flat.partition.buckets), default=0)
        self.inflight = InFlight(max_in_flight=2)
        self.rs_pool = BufferPool(chunk, self.dtype, self.inflight)
        self.ag_inflight = InFlight(max_in_flight=2)
        self.ag_pool = BufferPool(chunk, self.dtype, self.ag_inflight)
        return groups

    def _reduce(self, b: Bucket, buf: torch.Tensor) -> None:
        if self.rooted:  # the own chunk of buf (= its range of grad_flat) receives the sum
            self.inflight.launch(reduce_chunks(buf, b.chunk, self.dp), lambda: None)
            return
        full = self.rs_pool.acquire()
        out = full[:b.chunk]
        work = comm.reduce_scatter_into(out, buf, self.dp, async_op=True)
        lo, hi = b.owned(self.dp_rank)

        def done():
            self.grad_flat[lo:hi].copy_(out)
            self.rs_pool.release(full)

        self.inflight.launch([work], done)

    def _publish(self) -> None:
        gather_updated(self.flat, self.dp_rank, self.dp, self.ag_pool, self.ag_inflight)

    def _ledger(self, ledger: MemoryLedger) -> None:
        ledger.add("params_lp", self.flat.nbytes)
        ledger.add("grads", self.grad_flat.numel() * self.grad_flat.element_size())
        pools = [p for p in (self.rs_pool, self.ag_pool) if p is not None]
        ledger.add("comm_buffers", sum(p.capacity_bytes for p in pools))
