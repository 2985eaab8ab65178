"""P_os+g: optimizer-state and gradient partitioning (paper §5.2), ``Stage2G``.

Memory per rank: 2Ψ params + 2Ψ/N_d gradient shard + 12Ψ/N_d optimizer = 2Ψ + 14Ψ/N_d bytes,
plus constant-size fused buckets (C_B, §6.3). Communication per step: reduce-scatter of the
gradients (Ψ) + all-gather of the parameters (Ψ) = 2Ψ elements (§7.2.1).

In backward each gradient is copied (divided by N_d, ``buckets.scale_into``) into the fused
buffer of its bucket(s); a complete bucket is reduce-scattered asynchronously and the reduced
chunk added into the persistent gradient shard: the full gradient never exists on any rank.
Every micro-batch is reduce-scattered (gradient memory stays Ψ/N_d). ZeRO-R:
``constant_buffers`` false sizes the fused buffer to the whole model (what C_B fixes);
``contiguous_memory`` (M_D) keeps the shard in one pre-allocated tensor, else each chunk is
allocated on first use and freed in ``zero_grad``. The parameter all-gather is
``buckets.ParamGather``, shared with stage 1; collectives go through the DP group's transport.

``zero.split_tied_grad`` (off by default): the tied embedding's gradient arrives in its two
parts (``GPT.tied_grad_sink``): ``head`` computes the LM head's part bucket piece by piece into
the fused buffers (``buckets.matmul_flat_into``, like Megatron-LM's gradient-accumulation
fusion), reduce-scattered as the head's backward fills them; ``lookup``'s rows and ids are
all-gathered at the end of backward (N_d·B·s·(h+1) elements beyond the 2Ψ) and each owner adds
those in its chunks. No V×h gradient is formed; the sum differs by fp32 rounding
(Σ(h/N) + Σ(l/N), not Σ((h+l)/N)).
"""
from __future__ import annotations

import torch

from zero_repro.config import TrainConfig, ZeroConfig, ZeroRConfig
from zero_repro.runtime.comm.topology import Topology
from zero_repro.runtime.comm.buffers import BufferPool, InFlight
from zero_repro.runtime.comm.transport import bucket_transport
from zero_repro.runtime.zero.ledger import MemoryLedger
from zero_repro.runtime.zero.buckets import (Arrivals, GatheredAfterStep, bucket_pieces,
                                     matmul_flat_into, reduce_to_shard, scale_into, slot_pieces)
from zero_repro.runtime.zero.flat_buffer import FlatParams, GradShards
from zero_repro.runtime.zero.partition import Bucket
from zero_repro.runtime.zero.strategy import Strategy


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
        # zero.split_tied_grad: the GPT's tied embedding gradient as the head's GEMM into the
        # buckets and the lookup's rows exchanged sparse (``head``, ``lookup``)
        self._lookups: list = []  # per micro-batch: (works, gathered rows, gathered grads)
        self._tied = self._tied_weight(self.flat)

    # ------------------------------------------------------------------ tied embedding
    @torch.no_grad()
    def head(self, grad_logits: torch.Tensor, x: torch.Tensor) -> None:
        """The head's part of the tied gradient, ``grad_logits.T @ x / N_d``, computed piece by
        piece straight into the fused buckets; a bucket it completes is reduce-scattered now,
        early in backward (the lookup's rows join the reduced shard in ``_wait_reductions``)."""
        p = self._tied
        s, i = self.flat.slot_of[id(p)], self._slot_idx[id(p)]
        for b, lo, hi in bucket_pieces(self.flat.partition, s):
            buf = self._bucket_buffer(b)
            matmul_flat_into(buf[lo - b.start:hi - b.start], grad_logits, x, lo - s.offset,
                             hi - s.offset, 1.0 / self.n_d)
            self._got[b.index].add(i)
            if self._arrivals.add(b, hi - lo):
                self._launch(b)

    @torch.no_grad()
    def lookup(self, rows: torch.Tensor, grads: torch.Tensor) -> None:
        """The lookup's part: every rank's (rows, grads / N_d), all-gathered (async) and added
        by each owner into its shard once the head's reductions have landed."""
        n, t = self.n_d, self.transport
        rows, grads = rows.contiguous(), (grads / n).reshape(-1)
        all_rows = rows.new_empty(n * rows.numel())
        all_grads = grads.new_empty(n * grads.numel())
        works = t.all_gather(all_rows, rows) + t.all_gather(all_grads, grads)
        self._lookups.append((works, all_rows, all_grads.view(n * rows.numel(), -1)))

    def _add_lookups(self) -> None:
        """Add the gathered lookup rows that fall in this rank's chunks into its shard (each
        row's h elements may straddle a chunk boundary: matched element by element)."""
        lookups, self._lookups = self._lookups, []
        if not lookups:
            return
        for works, _, _ in lookups:
            for w in works:
                w.wait()
        p = self._tied
        if p.device.type == "meta":  # a dry run: nothing to add
            return
        s, d = self.flat.slot_of[id(p)], p.shape[-1]
        shard = self.grads.chunks()
        cols = torch.arange(d, device=p.device)
        for _, rows, grads in lookups:
            for b, lo, hi in bucket_pieces(self.flat.partition, s):
                olo, ohi = b.owned(self.dp_rank)
                lo, hi = max(lo, olo), min(hi, ohi)
                if lo >= hi:
                    continue
                near = (rows >= (lo - s.offset) // d) & (rows < -(-(hi - s.offset) // d))
                e = (rows[near] * d + s.offset).unsqueeze(1) + cols  # flat element indices
                inside = (e >= lo) & (e < hi)
                shard[b.index].index_add_(0, e[inside] - olo, grads[near][inside])

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
        self._add_lookups()

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
