"""One training run of the runtime (torchtitan's ``Trainer`` is the model), ``Trainer``: build ->
steps -> named callbacks. Every caller that trains goes through it -- the rank program, the GPU
proof's checks, the benchmark, the live-peak measurement, the peers race's runner of this
runtime, the dry run and the examples -- so the step contract is written once.

    trainer = Trainer(cfg, topo, device)       build: TP -> act. ckpt -> ZeRO -> optimizer
    trainer.resume(path)                       optional: a checkpoint's state and data position
    trainer.fit(source, callbacks=[log, ...])  steps start..train.steps-1 (``loop.train``);
                                               each callback(step, loss, seconds, StepInfo)
    trainer.step(micro_batches, ...)           or one step at a time (``step.train_step``)
    trainer.close()                            hooks off: no reference keeps the groups alive

``fit(..., checkpoint_root=DIR)`` saves a checkpoint every ``checkpoint.save_every`` steps
(``checkpoint.save``: sharded, any stage or DP size resumes it) with the global losses so far,
so a resumed run knows its past (``history``). What a caller adds -- records, W&B, the per-step
line, fault injection -- are callbacks; the trainer knows nothing of them.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from zero_repro.config import effective_zero
from zero_repro.runtime.comm import comm
from zero_repro.runtime.comm.topology import Topology
from zero_repro.runtime.train import checkpoint, loop
from zero_repro.runtime.train.build import build
from zero_repro.runtime.train.step import Batch, train_step
from zero_repro.runtime.zero import build_strategy
from zero_repro.runtime.zero.ledger import MemoryLedger
from zero_repro.runtime.zero.strategy import StepInfo
from zero_repro.validation import ranks_per_node

Callback = Callable[[int, float, float, StepInfo], None]  # (step, loss, seconds, info)


class Trainer:
    """Build, train, checkpoint one run (module docstring). ``build_kw`` go to ``build``."""

    def __init__(self, cfg, topo: Topology | None = None, device: torch.device | None = None,
                 *, model: nn.Module | None = None, **build_kw: Any):
        """``model``: a model already made (your own, or one the caller shares with other
        frameworks) wrapped as it is (``build_strategy``; ``build_kw`` its keywords: units,
        optimizer, init); without it ``build`` makes the config's model (``build_kw``: its
        keywords)."""
        self.cfg = cfg
        # "node" (zero.shard_size) decided as validation decided it
        self.topo = topo if topo is not None else Topology.build(
            cfg.parallel.tp, ranks_per_node=ranks_per_node(cfg))
        self.device = device if device is not None else torch.device("cpu")
        if model is None:
            self.model, self.ckpt, self.strategy = build(cfg, self.topo, self.device,
                                                         **build_kw)
        else:
            zero = effective_zero(cfg.zero, cfg.cluster.device)
            self.model, self.ckpt = model, None
            self.strategy = build_strategy(model, self.topo, zero, cfg.train, cfg.zero_r,
                                           **build_kw)
        self.start_step = 0
        self.history: dict = {"losses": [], "skipped_at": []}  # of the steps before start
        self.local_losses: list[float] = []  # this rank's, of the steps ``fit`` ran

    # ------------------------------------------------------------------ steps
    def step(self, micro_batches: Iterable[Batch], **kw) -> StepInfo:
        """One optimizer step over ``micro_batches`` (``step.train_step``'s keywords)."""
        return train_step(self.strategy, micro_batches, **kw)

    def fit(self, source, callbacks: Sequence[Callback] = (), *,
            before_update: Callable[[int], None] | None = None,
            checkpoint_root: str | None = None,
            checkpoint_extra: dict | None = None) -> loop.LoopResult:
        """Steps ``start_step .. train.steps - 1`` on ``source`` (``loop.train``: warm-up,
        timing, divergence); after each, every callback in order, then the checkpoint when one
        is due. ``before_update(step)`` runs between the backward passes and the update."""
        every = self.cfg.checkpoint.save_every
        skipped = list(self.history["skipped_at"])
        self.local_losses = []

        def on_step(step: int, loss: float, dt: float, info: StepInfo) -> None:
            self.local_losses.append(loss)
            if info.skipped:
                skipped.append(step)
            for cb in callbacks:
                cb(step, loss, dt, info)
            if checkpoint_root and every and (step + 1) % every == 0:
                losses = self.history["losses"] + self._global_losses()
                extra = {**(checkpoint_extra or {}),
                         "history": {"losses": losses if len(losses) == step + 1 else [],
                                     "skipped_at": list(skipped)}}
                self.save(checkpoint_root, step + 1, extra)

        return loop.train(self.strategy, source, self.cfg, self.topo, self.device,
                          on_step=on_step, start_step=self.start_step,
                          before_step=before_update)

    def _global_losses(self) -> list[float]:
        """The global mean loss of each step ``fit`` ran so far (collective over DP)."""
        per_dp = comm.all_gather_object(self.local_losses, self.topo.dp_group)
        return [sum(v) / len(v) for v in zip(*per_dp)]

    # ------------------------------------------------------------------ checkpoints
    def save(self, root: str, step: int, extra: dict | None = None,
             stateful: dict | None = None) -> str:
        """Collective: checkpoint after ``step`` steps into ``root`` (``checkpoint.save``;
        ``stateful``: schedulers, data positions)."""
        return checkpoint.save(root, self.strategy, self.topo, step, self.cfg.checkpoint.keep,
                               extra=extra, stateful=stateful)

    def resume(self, path: str, verify: bool = True, trust: bool = False,
               stateful: dict | None = None) -> dict:
        """Collective: the state of checkpoint ``path`` (any stage or DP size) and its data
        position; the steps before it (their losses, the skipped ones) into ``history``.
        Returns the manifest. ValueError when it is at or past ``train.steps``; ``trust``:
        load a checkpoint another account owns or may write (``checkpoint.load``)."""
        manifest = checkpoint.load(path, self.strategy, self.topo, verify, trust=trust,
                                   stateful=stateful)
        start = manifest["step"]
        if start >= self.cfg.train.steps:
            raise ValueError(f"checkpoint {path} is at step {start}: nothing left to do with "
                             f"train.steps={self.cfg.train.steps}; raise train.steps")
        past = (manifest.get("extra") or {}).get("history") or {}
        losses = list(past.get("losses") or [])
        self.start_step = start
        self.history = {"losses": losses[:start] if len(losses) >= start else [],
                        "skipped_at": [s for s in past.get("skipped_at") or [] if s < start]}
        return manifest

    # ------------------------------------------------------------------ the end
    def memory_ledger(self) -> MemoryLedger:
        """The strategy's bytes per category and the checkpointing's (ZeRO-R)."""
        ledger = self.strategy.memory_ledger()
        if self.ckpt is not None:
            self.ckpt.add_to_ledger(ledger)
        return ledger

    def close(self) -> None:
        """Hooks off and references dropped: the hooks hold the strategy, which holds the
        module and the groups' users; without this, gloo objects outlive the process group."""
        if self.strategy is not None:
            self.strategy.remove_hooks()
        self.model = self.ckpt = self.strategy = None

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
