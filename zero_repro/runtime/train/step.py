"""One optimizer step through a ZeRO-DP strategy (paper §5), ``train_step``: the only place the step
sequence is written down (the loop, the dry run, the benchmark, the peers race and the tests).

    for each of k = train.grad_accum micro-batches:   forward -> strategy.backward(loss)
    before_update()                                   (fault injection in the loop)
    strategy.step()  -> StepInfo (skipped?, grad norm, loss scale)
    strategy.zero_grad()

``strategy.backward`` divides the loss by k (k micro-batches of b = one batch of k·b). ``phase``
wraps each forward, backward and the update (the dry run attributes allocations to phases); a
micro-batch's loss goes to ``on_loss`` and is dropped after backward (nothing outlives it).
"""
from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Iterable

import torch

from zero_repro.runtime.zero.strategy import StepInfo, Strategy

Batch = tuple[torch.Tensor, torch.Tensor]  # (tokens, targets), (b, s) each


def _no_phase(name: str) -> ContextManager:
    return contextlib.nullcontext()


def train_step(strategy: Strategy, micro_batches: Iterable[Batch], *,
               phase: Callable[[str], ContextManager] = _no_phase,
               on_loss: Callable[[torch.Tensor], None] | None = None,
               after_forward: Callable[[], None] | None = None,
               before_update: Callable[[], None] | None = None) -> StepInfo:
    """Forward + backward every micro-batch of ``micro_batches`` (an iterator is advanced
    inside the forward phase, so the batch's allocation counts there), then the optimizer
    step and ``zero_grad``. Returns the strategy's ``StepInfo``."""
    batches = iter(micro_batches)
    while True:
        with phase("forward"):
            batch = next(batches, None)
            if batch is None:
                break
            # the logits are not kept: a name bound to them would hold b·s·V/t elements through
            # backward and the step (found by the dry run's trace: a storage of the forward
            # freed only when the next iteration rebinds the name)
            loss = strategy.module(*batch)[1]
            if on_loss is not None:
                on_loss(loss.detach())
            if after_forward is not None:
                after_forward()
        with phase("backward"):
            strategy.backward(loss)
            del loss, batch
    if before_update is not None:
        before_update()
    with phase("step"):
        info = strategy.step()
        strategy.zero_grad()
    return info
