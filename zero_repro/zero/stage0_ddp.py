"""Baseline data parallelism (paper §3.1, §7.1): every rank keeps all model states.

Memory per rank (mixed precision, Adam): 2Ψ params + 2Ψ grads + 12Ψ optimizer = 16Ψ bytes.
Communication per step: one all-reduce of the gradients = 2Ψ elements (reduce-scatter +
all-gather, §7.1).

Gradients are accumulated into one flat buffer in the parameter layout. Buckets are
consecutive ranges of that buffer (C_B elements each), so a bucket is all-reduced *in place*
as soon as its last gradient arrives, overlapping the rest of backward (no separate fused copy:
the flat gradient buffer is the fused buffer). Gradients are divided by N_d before the sum,
so the reduced gradient is the mean over DP ranks. Stage 1 (P_os) subclasses this class.

``zero_grad`` does not write the buffer: it marks every parameter's range as empty, the first
gradient of a range after it is copied in (instead of added to zeros), and the ranges that got
no gradient at all are zeroed when their bucket is reduced. Same result as zeroing, one pass
over Ψ less per step.
"""
from __future__ import annotations

import torch

from zero_repro.distributed import comm
from zero_repro.zero.ledger import MemoryLedger
from zero_repro.zero.flat_buffer import FlatParams, InFlight
from zero_repro.zero.partition import Bucket, intersect
from zero_repro.zero.strategy import Strategy


class Stage0DDP(Strategy):
    stage = 0

    def _partition_world(self) -> int:
        return 1  # full optimizer state on every rank

    def _counts_norm(self) -> bool:
        return self.dp_rank == 0  # gradients are identical on every DP rank after all-reduce

    def _build_groups(self, named) -> list[FlatParams]:
        g = FlatParams("model", named, self.dtype, self._partition_world(),
                       self._bucket_capacity())
        self.flat = g
        self.grad_flat = torch.zeros_like(g.flat)  # (padded,) persistent full gradients
        nb = len(g.partition.buckets)
        self._arrived = [0] * nb
        self._launched = [False] * nb
        self._slot_idx = {id(p): i for i, p in enumerate(g.params)}
        self._written = [False] * len(g.slots)  # slot got a gradient since zero_grad
        # per bucket: (slot index, flat lo, flat hi) of every slot piece inside it
        self._pieces: list[list[tuple[int, int, int]]] = [[] for _ in range(nb)]
        for i, s in enumerate(g.slots):
            for b in g.partition.buckets_of(s.offset, s.numel):
                lo, hi = intersect(b.start, b.end, s.offset, s.end)
                self._pieces[b.index].append((i, lo, hi))
        self.inflight = InFlight(max_in_flight=1 << 30)
        return [g]

    # ------------------------------------------------------------------ backward
    @torch.no_grad()
    def _on_grad(self, p: torch.Tensor) -> None:
        g = self.flat
        s = g.slot_of[id(p)]
        i = self._slot_idx[id(p)]
        if self._written[i]:
            self.grad_flat[s.offset:s.end].add_(p.grad.reshape(-1))
        else:
            self.grad_flat[s.offset:s.end].copy_(p.grad.reshape(-1))
            self._written[i] = True
        p.grad = None  # the flat buffer is the only persistent gradient storage
        if not self._is_last:
            return  # accumulate locally; reduce on the last micro-batch only
        for b in g.partition.buckets_of(s.offset, s.numel):
            lo, hi = intersect(b.start, b.end, s.offset, s.end)
            self._arrived[b.index] += hi - lo
            if self._arrived[b.index] == g.partition.real_in_bucket(b):
                self._launch(b)

    def _finish_backward(self) -> None:
        if self._is_last:  # buckets of parameters that got no gradient
            self._launch_remaining()

    def _launch_remaining(self) -> None:
        for b in self.flat.partition.buckets:
            if not self._launched[b.index]:
                self._launch(b)

    def _launch(self, b: Bucket) -> None:
        self._launched[b.index] = True
        for i, lo, hi in self._pieces[b.index]:
            if not self._written[i]:  # no gradient since zero_grad: reduce zeros
                self.grad_flat[lo:hi].zero_()
        numel = self.flat.partition.numel
        if b.end > numel:  # padding: a rooted reduce may leave it undefined on non-owners
            self.grad_flat[max(b.start, numel):b.end].zero_()
        buf = self.grad_flat[b.start:b.end]
        if self.n_d > 1:
            buf.div_(self.n_d)  # mean over DP ranks; dividing first keeps fp16 sums in range
        self._reduce(b, buf)

    def _reduce(self, b: Bucket, buf: torch.Tensor) -> None:
        work = comm.all_reduce(buf, self.dp, async_op=True)
        self.inflight.launch([work], lambda: None)

    def _wait_reductions(self) -> None:
        self._launch_remaining()  # e.g. step() after backward under no_sync()
        self.inflight.wait_all()
        self._arrived = [0] * len(self._arrived)
        self._launched = [False] * len(self._launched)

    # ------------------------------------------------------------------ shards
    def _param_chunks(self) -> list[torch.Tensor]:
        return self.flat.owned_chunks(self._shard_rank())

    def _grad_chunks(self) -> list[torch.Tensor | None]:
        r = self._shard_rank()
        return [self.grad_flat[b.owned(r)[0]:b.owned(r)[1]] for b in self.flat.partition.buckets]

    def _zero_grads(self) -> None:
        self._written = [False] * len(self._written)  # see the module docstring

    def _ledger(self, ledger: MemoryLedger) -> None:
        ledger.add("params_lp", self.flat.nbytes)
        ledger.add("grads", self.grad_flat.numel() * self.grad_flat.element_size())
        ledger.add("comm_buffers", 0)  # buckets are reduced in place in grad_flat
