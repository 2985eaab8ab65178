"""Global gradient norm from shard norms (paper §5: with P_g each rank holds 1/N_d of the
gradients, so the global norm is assembled from per-shard sums of squares).

||g||² = Σ_ranks Σ_{elements counted on that rank} g², agreed with one all-reduce of two numbers
(sum of squares, overflow flag) over the world (DP × TP). Invariant: each element is counted
exactly once (stage 0: DP rank 0 only; TP-replicated parameters: TP rank 0 only), yet every
element enters the overflow check (inf/nan propagate into its norm). Coefficient as
``torch.nn.utils.clip_grad_norm_``: min(1, max_norm / (norm + 1e-6)). Norms by
``torch._foreach_norm`` in fp32 (an fp16 2-norm would overflow at 65504), squared and summed in
fp64; a finite gradient whose norm exceeds the fp32 range counts as overflow. The only host
reads are the two agreed numbers. Entry points: ``local_stats``, ``agree``, ``clip_coef``.
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


def agree(stats: torch.Tensor, world: comm.Group) -> tuple[float, bool]:
    """World all-reduce of ``local_stats`` (sumsq, overflow): (global norm, overflow on any
    rank). The one host synchronisation of the step's norm computation."""
    # a rank with a non-finite element contributes 0 to the sum: the norm is reported as inf
    t = torch.stack([torch.where(stats[1] > 0, torch.zeros_like(stats[0]), stats[0]), stats[1]])
    comm.all_reduce(t, world, op="sum")
    overflow = bool(t[1].item() > 0)
    return (math.sqrt(t[0].item()) if not overflow else float("inf")), overflow


def clip_coef(norm: float, max_norm: float) -> float:
    """Multiplier applied to every gradient (1.0 when clipping is off or not needed)."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))
