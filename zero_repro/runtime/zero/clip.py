"""Global gradient norm from shard norms (paper §5: with P_g each rank holds 1/N_d of the
gradients, so the global norm is assembled from per-shard sums of squares).

||g||² = Σ_ranks Σ_{elements counted on that rank} g², agreed with one all-reduce of two numbers
(sum of squares, overflow flag) over the world (DP × TP). Invariant: each element is counted
exactly once (stage 0: DP rank 0 only; TP-replicated parameters: TP rank 0 only), yet every
element enters the overflow check (inf/nan propagate into its norm). Coefficient as
``torch.nn.utils.clip_grad_norm_``: min(1, max_norm / (norm + 1e-6)). Norms by
``torch._foreach_norm`` in fp32 (an fp16 2-norm would overflow at 65504), squared and summed in
fp64; a finite gradient whose norm exceeds the fp32 range counts as overflow.

No host synchronisation in the step: ``agree`` returns an ``Agreed`` whose device scalars
(``norm_t``, ``found_inf``) feed the clip multiplier (``grad_multiplier``) and the optimizer's
skip; the host reads the two numbers only when asked (``Agreed.norm`` / ``overflow``: on CUDA a
wait for an event recorded after the all-reduce, not for the step's update). Entry points:
``local_stats``, ``agree``, ``grad_multiplier``, ``clip_coef``.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from zero_repro.runtime.comm import comm


def _segments(n: int, ranges: list[tuple[int, int]]) -> tuple[list[tuple[int, int]],
                                                              list[tuple[int, int]]]:
    """(counted ranges, the gaps between them) covering [0, n) exactly once."""
    gaps, pos = [], 0
    for a, b in sorted(ranges):
        if a > pos:
            gaps.append((pos, a))
        pos = max(pos, b)
    if pos < n:
        gaps.append((pos, n))
    return list(ranges), gaps


def local_stats(grads: Sequence[torch.Tensor | None], counted: Sequence[list[tuple[int, int]]],
                inv_scale: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """(2,) fp64 tensor: [sum of squares of the counted, unscaled elements; 1.0 if any owned
    element is non-finite else 0.0]. No host synchronisation."""
    counted_views, other_views = [], []
    for g, ranges in zip(grads, counted):
        if g is None:
            continue
        flat = g.reshape(-1)
        cnt, gaps = _segments(flat.numel(), ranges)
        counted_views += [flat[a:b] for a, b in cnt]
        other_views += [flat[a:b] for a, b in gaps]
    views = counted_views + other_views
    if not views:
        return torch.zeros(2, dtype=torch.float64, device=device)  # no gradient here
    norms = torch.stack(torch._foreach_norm(views, 2, dtype=torch.float32)).double()
    sq = norms.square()
    nc = len(counted_views)
    sumsq = sq[:nc].sum() * (inv_scale * inv_scale)
    bad = torch.isfinite(sq.sum()).logical_not().double()
    return torch.stack([sumsq, bad])


class Agreed:
    """The world's agreed (norm, overflow) of one step: device scalars for the step, host
    values on demand.

    ``norm_t``: fp64 global norm of the unscaled gradients (inf when some rank overflowed);
    ``found_inf``: fp32 1.0 on overflow else 0.0 (``torch._fused_adamw_``'s skip flag); both
    dropped by ``forget_device`` once the step has queued its last use of them. On CUDA the two
    numbers are copied to pinned host memory behind an event as they are agreed; ``norm`` /
    ``overflow`` wait for that event only (the update, the parameter gathers and the next
    forward stay queued). Elsewhere they are read at once: gloo's all-reduce has already made
    the host wait, and a dry run's tracer answers the read (``deferred`` says which)."""

    def __init__(self, t: torch.Tensor):
        # t: (2,) fp64 [sum of squares (0 if any rank overflowed), overflow count]
        bad = t[1] > 0
        self.norm_t = torch.where(bad, torch.full_like(t[0], math.inf), t[0].sqrt())
        self.found_inf = bad.float()
        self._ready, self._host, self._values = None, None, None
        if not deferred(t):
            self._values = _values(float(t[0]), float(t[1]))
        elif t.is_cuda:
            self._host = torch.empty(2, dtype=t.dtype, pin_memory=True)
            self._host.copy_(t, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = t  # read when asked, as on CUDA

    def forget_device(self) -> None:
        """Drop the device scalars (queued kernels keep what they read: stream order)."""
        self.norm_t = self.found_inf = None

    def _read(self) -> tuple[float, bool]:
        if self._values is None:
            if self._ready is not None:
                self._ready.synchronize()
            self._values = _values(float(self._host[0]), float(self._host[1]))
            self._host = self._ready = None
        return self._values

    @property
    def norm(self) -> float:
        return self._read()[0]

    @property
    def overflow(self) -> bool:
        return self._read()[1]


def deferred(t: torch.Tensor) -> bool:
    """Whether ``Agreed`` reads the agreed numbers of ``t`` when asked (CUDA) or at once."""
    return t.is_cuda


def _values(sumsq: float, bad: float) -> tuple[float, bool]:
    overflow = bad > 0
    return (float("inf") if overflow else math.sqrt(sumsq)), overflow


def agree(stats: torch.Tensor, world: comm.Group) -> Agreed:
    """World all-reduce of ``local_stats`` (sumsq, overflow) -> ``Agreed`` (no host read)."""
    # a rank with a non-finite element contributes 0 to the sum: the norm is reported as inf
    t = torch.stack([torch.where(stats[1] > 0, torch.zeros_like(stats[0]), stats[0]), stats[1]])
    comm.all_reduce(t, world, op="sum")
    return Agreed(t)


def grad_multiplier(agreed: Agreed, max_norm: float, scale: float) -> float | torch.Tensor:
    """The factor every gradient is multiplied by before Adam: unscale (1 / ``scale``) ×
    ``clip_coef`` of the agreed norm -- with clipping on a device scalar (fp64, the host's
    arithmetic; 0 on overflow, a step skipped anyway), else the float 1 / ``scale``."""
    if max_norm <= 0:
        return 1.0 / scale
    return (max_norm / (agreed.norm_t + 1e-6)).clamp_(max=1.0).div_(scale)


def clip_coef(norm: float, max_norm: float) -> float:
    """Multiplier applied to every gradient (1.0 when clipping is off or not needed)."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))
