"""AdamW on flat fp32 shards (paper §5.1, P_os: each rank updates only its 1/N_d of the optimizer
state, 12Ψ/N_d bytes = fp32 master 4 + m 4 + v 4).

``ShardAdamW`` keeps master, m and v in three contiguous fp32 tensors over this rank's shard;
its chunks (one per bucket) are views of them. The update is ``torch.optim.AdamW``'s: torch's
fused kernel (``torch._fused_adamw_``, what ``AdamW(fused=True)`` runs) by default, equal to the
single-tensor arithmetic to rounding (~1 ulp per step); ``fused=False`` is, operation for
operation, ``torch.optim.AdamW(foreach=False)``. Transient memory: at most one chunk's fp32 copy
``grad × grad_mult`` at a time (none for an fp32 gradient with multiplier 1), never 4Ψ/N_d; the
gradient buffers are not modified.

Passes per chunk (fused, on the device): ``grad × grad_mult`` into fp32 in one kernel (it reads
the 2-byte gradient: 6 B/parameter), the fused update, the cast of the master into the training
dtype (6 B). The fused kernel takes one dtype for all its lists (an fp32 master with a bf16
gradient is refused), so the fp32 gradient copy stays; its ``grad_scale`` is not used: it
writes the unscaled gradient back (+4 B) and divides where the reference multiplies. On the CPU
a mixed-dtype multiply makes an fp32 temporary, so there it is a copy then a multiply.
``grad_mult`` may be a device scalar and ``found_inf`` a device flag (``clip.Agreed``): the
overflow skip (parameters, moments and the step count unchanged) is then decided on the device,
with no host read in the step (``step_count`` reads the device counter).

``step(..., on_chunk=f)`` calls ``f(i)`` as soon as chunk i (and its training-dtype cast) is
final, so a stage can put chunk i on the wire while chunk i+1 is updated; bit-identical to one
call over all chunks (the fused kernel updates each tensor of its list on its own with the same
scalars; tests/unit/test_adam.py).
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
                 keep_master: bool, fused: bool | None = None,
                 device: torch.device | None = None):
        self.chunks = list(chunks)
        numel = sum(n for _, n in self.chunks)
        self.numel = numel
        # on ``device``, else that of the parameters it updates (CPU when there are none)
        dev = device if device is not None else \
            lp_chunks[0].device if len(lp_chunks) else torch.device("cpu")
        self.master = torch.zeros(numel, dtype=torch.float32, device=dev) if keep_master else None
        if self.master is not None:
            for (off, n), p in zip(self.chunks, lp_chunks):
                self.master[off:off + n].copy_(p)
        self.exp_avg = torch.zeros(numel, dtype=torch.float32, device=dev)
        self.exp_avg_sq = torch.zeros(numel, dtype=torch.float32, device=dev)
        self.fused = fused_available() if fused is None else bool(fused and fused_available())
        # the fused kernel reads the step from a tensor, counted on the device (a skipped step
        # does not advance it), beside the gradient multiplier: 8 bytes, not in the ledger
        scalars = torch.zeros(2, dtype=torch.float32, device=dev)
        self._step_t, self._mult = scalars[0], scalars[1:]
        self._steps = 0  # the same count on the host: the single-tensor path's

    @property
    def step_count(self) -> int:
        """Updates applied so far (fused: reads the device counter, not for the hot path)."""
        return int(self._step_t.item()) if self.fused else self._steps

    @step_count.setter
    def step_count(self, value: int) -> None:
        self._steps = int(value)
        self._step_t.fill_(value)

    def master_chunk(self, i: int, lp_chunk: torch.Tensor) -> torch.Tensor:
        """fp32 values of chunk i (the lp tensor itself in fp32 mode)."""
        off, n = self.chunks[i]
        return lp_chunk if self.master is None else self.master[off:off + n]

    def _grad32(self, p: torch.Tensor, g: torch.Tensor | None, one: bool) -> torch.Tensor:
        """fp32 ``g × grad_mult`` for chunk ``p`` (``self._mult``; ``one``: the multiplier is
        the float 1.0, an fp32 gradient is then read as it is)."""
        if g is None:
            return torch.zeros_like(p)
        if g.dtype == torch.float32 and one:
            return g  # read only: no copy needed
        out = torch.empty_like(p, dtype=torch.float32)
        if g.dtype != torch.float32 and g.device.type == "cpu":
            return out.copy_(g).mul_(self._mult)  # no fp32 temporary of g (module docstring)
        return torch.mul(g, self._mult, out=out)  # one pass; (1,) fp32: computed in fp32

    @torch.no_grad()
    def step(self, lp_chunks: Sequence[torch.Tensor],
             grads: Sequence[torch.Tensor | None],
             grad_mult: float | torch.Tensor, lr: float, betas: tuple[float, float], eps: float,
             weight_decay: float, on_chunk: Callable[[int], None] | None = None,
             found_inf: torch.Tensor | None = None) -> None:
        """One AdamW step; gradients are multiplied by ``grad_mult`` (unscale × clip: a float,
        or a device scalar) first. A missing gradient (None) counts as zero. ``found_inf``: a
        device scalar, 1.0 = skip this update (``on_chunk`` still runs, on unchanged values).
        ``on_chunk(i)``: called once chunk i of ``lp_chunks`` holds its updated value (see the
        module docstring)."""
        b1, b2 = betas
        ps = [self.master_chunk(i, p_lp) for i, p_lp in enumerate(lp_chunks)]
        ms = [self.exp_avg[off:off + n] for off, n in self.chunks]
        vs = [self.exp_avg_sq[off:off + n] for off, n in self.chunks]
        one = not isinstance(grad_mult, torch.Tensor) and grad_mult == 1.0
        if isinstance(grad_mult, torch.Tensor):
            self._mult.copy_(grad_mult.reshape(1))
        else:
            self._mult.fill_(grad_mult)
        if self.fused:
            self._step_t += 1
            kw = dict(lr=lr, beta1=b1, beta2=b2, weight_decay=weight_decay, eps=eps,
                      amsgrad=False, maximize=False, found_inf=found_inf)
            for i, (p, m, v, g) in enumerate(zip(ps, ms, vs, grads)):
                g32 = self._grad32(p, g, one)  # one fp32 gradient copy at a time
                torch._fused_adamw_([p], [g32], [m], [v], [], [self._step_t], **kw)
                del g32
                if on_chunk is not None:
                    self._chunk_done(i, lp_chunks, ps, on_chunk)
            if found_inf is not None:
                self._step_t -= found_inf
        elif found_inf is not None and bool(found_inf):  # the reference path reads the flag
            for i in range(len(ps) if on_chunk is not None else 0):
                self._chunk_done(i, lp_chunks, ps, on_chunk)
            return
        else:
            self.step_count = step = self._steps + 1
            bc1 = 1 - b1 ** step
            bc2_sqrt = math.sqrt(1 - b2 ** step)
            step_size = lr / bc1
            for i, (p, m, v, g) in enumerate(zip(ps, ms, vs, grads)):
                g32 = self._grad32(p, g, one)
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
