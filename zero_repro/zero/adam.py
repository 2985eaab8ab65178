"""AdamW on flat fp32 shards (paper §5.1: P_os, each rank updates only its 1/N_d of the
optimizer state: 12Ψ/N_d bytes = fp32 master 4 + m 4 + v 4).

The arithmetic matches ``torch.optim.AdamW`` (single-tensor path) operation for operation, so a
sharded run equals the unsharded reference to rounding. State lives in three contiguous fp32
tensors (master, m, v) covering this rank's shard; the update runs chunk by chunk (one chunk per
bucket), taking each chunk's gradient in the training dtype and upcasting it transiently.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch


class ShardAdamW:
    """Adam(W) state and update for a shard made of ``chunks`` = [(offset, length), …]."""

    def __init__(self, chunks: Sequence[tuple[int, int]], lp_chunks: Sequence[torch.Tensor],
                 keep_master: bool):
        self.chunks = list(chunks)
        numel = sum(n for _, n in self.chunks)
        self.numel = numel
        self.master = torch.zeros(numel, dtype=torch.float32) if keep_master else None
        if self.master is not None:
            for (off, n), p in zip(self.chunks, lp_chunks):
                self.master[off:off + n].copy_(p)
        self.exp_avg = torch.zeros(numel, dtype=torch.float32)
        self.exp_avg_sq = torch.zeros(numel, dtype=torch.float32)
        self.step_count = 0

    def master_chunk(self, i: int, lp_chunk: torch.Tensor) -> torch.Tensor:
        """fp32 values of chunk i (the lp tensor itself in fp32 mode)."""
        off, n = self.chunks[i]
        return lp_chunk if self.master is None else self.master[off:off + n]

    @torch.no_grad()
    def step(self, lp_chunks: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
             grad_mult: float, lr: float, betas: tuple[float, float], eps: float,
             weight_decay: float) -> None:
        """One AdamW step; gradients are multiplied by ``grad_mult`` (unscale × clip) first.
        A missing gradient (None) counts as zero."""
        self.step_count += 1
        b1, b2 = betas
        bc1 = 1 - b1 ** self.step_count
        bc2_sqrt = math.sqrt(1 - b2 ** self.step_count)
        step_size = lr / bc1
        for i, ((off, n), p_lp, g) in enumerate(zip(self.chunks, lp_chunks, grads)):
            p = self.master_chunk(i, p_lp)
            m, v = self.exp_avg[off:off + n], self.exp_avg_sq[off:off + n]
            g32 = torch.zeros_like(p) if g is None else g.float() * grad_mult
            p.mul_(1 - lr * weight_decay)
            m.lerp_(g32, 1 - b1)
            v.mul_(b2).addcmul_(g32, g32, value=1 - b2)
            denom = (v.sqrt() / bc2_sqrt).add_(eps)
            p.addcdiv_(m, denom, value=-step_size)
            if self.master is not None:
                p_lp.copy_(p)  # cast the updated master into the training-dtype shard

    def nbytes(self) -> dict[str, int]:
        return {"master_fp32": 0 if self.master is None else self.master.numel() * 4,
                "adam_m": self.exp_avg.numel() * 4, "adam_v": self.exp_avg_sq.numel() * 4}
