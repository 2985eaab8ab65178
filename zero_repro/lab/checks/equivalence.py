"""Equivalence of a ZeRO-DP run with one process training the same model (paper §5: every stage
computes what baseline data parallelism computes): the reference and the comparison, shared by
the GPU proof (``lab.checks.gpu``) and the tests.

The reference is the TP = 1 model with ``torch.optim.AdamW`` (+ ``clip_grad_norm_``) stepping on
the global batch (every DP rank's micro-batches); the run's parameters are read whole, over DP
and TP, through ``strategy.full_state_dict`` (fp32 from the master). ``max_abs_diff`` is the
largest |θ - θ_ref| over every parameter.
"""
from __future__ import annotations

import torch
from torch import nn


class AdamWReference:
    """``model`` trained by ``torch.optim.AdamW`` with ``train``'s hyperparameters, the global
    norm clipped at ``clip`` (0: not clipped)."""

    def __init__(self, model: nn.Module, train, clip: float):
        self.model, self.clip = model, clip
        self.opt = torch.optim.AdamW(model.parameters(), lr=train.lr,
                                     betas=(train.beta1, train.beta2), eps=train.eps,
                                     weight_decay=train.weight_decay)

    def step(self, idx: torch.Tensor, tgt: torch.Tensor) -> float:
        _, loss = self.model(idx, tgt)
        loss.backward()
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.opt.zero_grad()
        return loss.item()


def tp1_parameters(strategy) -> dict[str, torch.Tensor]:
    """The run's state whole under the model's own keys (parameters gathered over DP and TP,
    fp32), on every rank (collective over the world)."""
    return strategy.full_state_dict(torch.float32, rank0_only=False)


def max_abs_diff(theta: dict[str, torch.Tensor], reference: nn.Module) -> tuple[float, str]:
    """(largest |θ - θ_ref|, the parameter where it is) against ``reference``'s parameters."""
    return max(((theta[n].to(p.device) - p.detach()).abs().max().item(), n)
               for n, p in reference.named_parameters())
