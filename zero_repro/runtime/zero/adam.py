"""AdamW on flat fp32 shards (paper §5.1: P_os, each rank updates only its 1/N_d of the
optimizer state: 12Ψ/N_d bytes = fp32 master 4 + m 4 + v 4).

The update is ``torch.optim.AdamW``'s: by default torch's fused AdamW kernel
(``torch._fused_adamw_``, what ``AdamW(fused=True)`` runs), one pass over master, m, v and
gradient per chunk instead of the ~8 passes of the single-tensor path (5-6× faster on CPU, where
the update is memory-bound). It equals the single-tensor arithmetic to rounding (~1 ulp per
step); ``fused=False`` selects the single-tensor path, operation for operation
``torch.optim.AdamW(foreach=False)``. State lives in three contiguous fp32 tensors (master, m,
v) covering this rank's shard; chunks (one per bucket) are views of them. An fp32 gradient with
multiplier 1 (no unscale, no clip) is used as it is; otherwise one transient fp32 copy
``grad × grad_mult`` is made per chunk, stepped and dropped before the next chunk's copy is made,
so the step's transient is one chunk (at most one bucket's shard, 4 bytes per element), not
4Ψ/N_d bytes for the whole shard (the gradient buffers are never modified).

The chunks are updated one kernel call each, in order. ``step(..., on_chunk=f)`` calls ``f(i)``
as soon as chunk i (and its training-dtype cast) is final, so a stage can put chunk i on the
wire while chunk i+1 is updated. Bit-identical to one call over all chunks: the fused kernel
updates each tensor of its list on its own with the same scalars (CPU: one kernel per tensor;
CUDA: element-wise arithmetic independent of how the list is chunked); tested in
tests/test_adam_chunks.py.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch


def fused_available() -> bool:
    return hasattr(torch, "_fused_adamw_")


class ShardAdamW:
    """Adam(W) state and update for a shard made of ``chunks`` = [(offset, length), …]."""

    def __init__(self, chunks: Sequence[tuple[int, int]], lp_chunks: Sequence[torch.Tensor],
                 keep_master: bool, fused: bool | None = None):
        self.chunks = list(chunks)
        numel = sum(n for _, n in self.chunks)
        self.numel = numel
        # on the device of the parameters it updates (CPU when there are none)
        dev = lp_chunks[0].device if len(lp_chunks) else torch.device("cpu")
        self.master = torch.zeros(numel, dtype=torch.float32, device=dev) if keep_master else None
        if self.master is not None:
            for (off, n), p in zip(self.chunks, lp_chunks):
                self.master[off:off + n].copy_(p)
        self.exp_avg = torch.zeros(numel, dtype=torch.float32, device=dev)
        self.exp_avg_sq = torch.zeros(numel, dtype=torch.float32, device=dev)
        self.step_count = 0
        self.fused = fused_available() if fused is None else bool(fused and fused_available())
        # the fused kernel reads the step from a tensor (4 bytes, not counted in the ledger)
        self._step_t = torch.zeros((), dtype=torch.float32, device=dev)

    def master_chunk(self, i: int, lp_chunk: torch.Tensor) -> torch.Tensor:
        """fp32 values of chunk i (the lp tensor itself in fp32 mode)."""
        off, n = self.chunks[i]
        return lp_chunk if self.master is None else self.master[off:off + n]

    @staticmethod
    def _grad32(p: torch.Tensor, g: torch.Tensor | None, grad_mult: float) -> torch.Tensor:
        if g is None:
            return torch.zeros_like(p)
        if g.dtype == torch.float32 and grad_mult == 1.0:
            return g  # read only: no copy needed
        return g.to(torch.float32, copy=True).mul_(grad_mult)

    @torch.no_grad()
    def step(self, lp_chunks: Sequence[torch.Tensor],
             grads: Sequence[torch.Tensor | None],
             grad_mult: float, lr: float, betas: tuple[float, float], eps: float,
             weight_decay: float, on_chunk: Callable[[int], None] | None = None) -> None:
        """One AdamW step; gradients are multiplied by ``grad_mult`` (unscale × clip) first.
        A missing gradient (None) counts as zero. ``on_chunk(i)``: called once chunk i of
        ``lp_chunks`` holds its updated value (see the module docstring)."""
        self.step_count += 1
        b1, b2 = betas
        ps = [self.master_chunk(i, p_lp) for i, p_lp in enumerate(lp_chunks)]
        ms = [self.exp_avg[off:off + n] for off, n in self.chunks]
        vs = [self.exp_avg_sq[off:off + n] for off, n in self.chunks]
        if self.fused and ps:
            self._step_t.fill_(self.step_count)
            kw = dict(lr=lr, beta1=b1, beta2=b2, weight_decay=weight_decay, eps=eps,
                      amsgrad=False, maximize=False)
            for i, (p, m, v, g) in enumerate(zip(ps, ms, vs, grads)):
                g32 = self._grad32(p, g, grad_mult)  # one fp32 gradient copy at a time
                torch._fused_adamw_([p], [g32], [m], [v], [], [self._step_t], **kw)
                del g32
                if on_chunk is not None:
                    self._chunk_done(i, lp_chunks, ps, on_chunk)
        else:
            bc1 = 1 - b1 ** self.step_count
            bc2_sqrt = math.sqrt(1 - b2 ** self.step_count)
            step_size = lr / bc1
            for i, (p, m, v, g) in enumerate(zip(ps, ms, vs, grads)):
                g32 = self._grad32(p, g, grad_mult)
                p.mul_(1 - lr * weight_decay)
                m.lerp_(g32, 1 - b1)
                v.mul_(b2).addcmul_(g32, g32, value=1 - b2)
                del g32  # before the next chunk's copy is made
                denom = v.sqrt().div_(bc2_sqrt).add_(eps)
                p.addcdiv_(m, denom, value=-step_size)
                if on_chunk is not None:
                    self._chunk_done(i, lp_chunks, ps, on_chunk)
        if on_chunk is not None:
            return
        if self.master is not None:  # cast the updated master into the training-dtype shard
            for p_lp, p in zip(lp_chunks, ps):
                p_lp.copy_(p)

    def _chunk_done(self, i: int, lp_chunks: Sequence[torch.Tensor], ps: list[torch.Tensor],
                    on_chunk: Callable[[int], None]) -> None:
        if self.master is not None:  # cast the updated master chunk into the training dtype
            lp_chunks[i].copy_(ps[i])
        on_chunk(i)

    def nbytes(self) -> dict[str, int]:
        return {"master_fp32": 0 if self.master is None else self.master.numel() * 4,
                "adam_m": self.exp_avg.numel() * 4, "adam_v": self.exp_avg_sq.numel() * 4}
