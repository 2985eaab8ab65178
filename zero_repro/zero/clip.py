"""Global gradient norm from shard norms (paper §5: with P_g each rank holds 1/N_d of the
gradients, so the global norm is assembled from per-shard sums of squares).

||g||² = Σ_ranks Σ_{elements counted on that rank} g², one all-reduce of two numbers over the
world (DP × TP): the sum of squares and an overflow flag. Each element must be counted exactly
once: stage 0 keeps full gradients on every DP rank, so only DP rank 0 counts them; TP-replicated
parameters (LayerNorm weights, row-parallel biases, …) are counted on TP rank 0 only. The
clipping coefficient follows ``torch.nn.utils.clip_grad_norm_``: min(1, max_norm/(norm+1e-6)).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from zero_repro.dist import comm


def local_stats(grads: Sequence[torch.Tensor | None], counted: Sequence[list[tuple[int, int]]],
                inv_scale: float) -> tuple[float, bool]:
    """(sum of squares of the counted, unscaled elements; any non-finite element)."""
    sumsq, bad = 0.0, False
    for g, ranges in zip(grads, counted):
        if g is None:
            continue
        # float64 sum: a non-finite element makes it non-finite, a finite fp32 tensor never does
        if not math.isfinite(g.sum(dtype=torch.float64).item()):
            bad = True
            continue
        g32 = g.float()
        for a, b in ranges:
            sumsq += g32[a:b].double().pow(2).sum().item()
    return sumsq * inv_scale * inv_scale, bad


def agree(sumsq: float, overflow: bool, world: comm.Group) -> tuple[float, bool]:
    """World all-reduce of (sumsq, overflow): (global norm, overflow on any rank)."""
    t = torch.tensor([sumsq if not overflow else 0.0, 1.0 if overflow else 0.0],
                     dtype=torch.float64)
    comm.all_reduce(t, world, op="sum")
    overflow = bool(t[1].item() > 0)
    return (math.sqrt(t[0].item()) if not overflow else float("inf")), overflow


def clip_coef(norm: float, max_norm: float) -> float:
    """Multiplier applied to every gradient (1.0 when clipping is off or not needed)."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))
