"""AdamW on flat fp32 shards (paper §5.1, P_os: each rank updates only its 1/N_d of the optimizer
state, 12Ψ/N_d bytes = fp32 master 4 + m 4 + v 4).

``ShardAdamW`` keeps master, m and v in three contiguous fp32 tensors over this rank's shard;
its chunks (one per bucket) are views of them. The update is ``torch.optim.AdamW``'s: torch's
fused kernel (``torch._fused_adamw_``, what ``AdamW(fused=True)`` runs) by default, equal to the
single-tensor arithmetic to rounding (~1 ulp per step); ``fused=False`` is, operation for
operation, ``torch.optim.AdamW(foreach=False)``. Transient memory: at most one chunk's fp32 copy
``grad × grad_mult`` at a time (none for an fp32 gradient with multiplier 1), never 4Ψ/N_d; the
gradient buffers are not modified.

``step(..., on_chunk=f)`` calls ``f(i)`` as soon as chunk i (and its training-dtype cast) is
final, so a stage can put chunk i on the wire while chunk i+1 is updated; bit-identical to one
call over all chunks (the fused kernel updates each tensor of its list on its own with the same
scalars; tests/test_adam_chunks.py).
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
