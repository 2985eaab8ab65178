"""The training loop: warm-up steps, timed steps, per-step loss and throughput.

One optimizer step (``train.step.train_step``) = ``grad_accum`` micro-batches of forward +
backward through the strategy, then ``strategy.step()``. The first ``warmup_steps`` steps are
run but not timed (allocator warm-up, lazy optimizer state, connection set-up).

Timing without stalling the device: on CUDA a step's time is the interval between CUDA events
recorded on the compute stream at the start of consecutive steps (the GPU's timeline, idle gaps
included: wall time per step once the GPU is busy); the host synchronises once per *window*
(``CUDA_WINDOW`` steps, and at the end of warm-up, at a checkpoint step and at the last step),
where the window's losses are read and the per-step callbacks run. Nothing waits for the NCCL
stream between steps, so a step's trailing collectives (stages 1-2's parameter all-gather,
stage 3's prefetch) overlap the next step's forward as designed. On CPU every step is its own
window, timed with ``time.perf_counter`` (nothing is asynchronous there).

Measurement has no side effects on training: losses are collected locally and gathered once
at the end with an object all-gather that the communication ledger does not count.

Resuming: ``start_step`` is the data position restored from a checkpoint (batches are a pure
function of (seed, step), so starting the step loop there replays exactly the data the
uninterrupted run would have seen). fp16 overflow skips are data: counted, their step indices
kept, and each one logged.

Divergence (``Diverged``, recorded as status ``diverged``): a non-finite loss, or
``FLOOR_SKIPS`` consecutive skipped steps at the lowest loss scale (fp16 at
``zero.min_loss_scale``; fp32/bf16 have no scale to lower, so any non-finite gradient counts),
stops the run when its window is read (on CPU at once, on CUDA within ``CUDA_WINDOW`` steps); a
run in which every step was skipped ends as diverged too. Training on would only write steps
that trained nothing.
"""
from __future__ import annotations

import functools
import logging
import math
import statistics
import time
from dataclasses import dataclass, field

import torch

from zero_repro.config import Config
from zero_repro.runtime.comm import comm
from zero_repro.runtime.comm.topology import Topology
from zero_repro.runtime.train.data import TokenSource, rank_batch
from zero_repro.runtime.train.step import train_step

log = logging.getLogger(__name__)

FLOOR_SKIPS = 3  # consecutive skipped steps at the lowest loss scale that mean "diverged"
CUDA_WINDOW = 8  # steps between host synchronisations on CUDA (see the module docstring)


class Diverged(RuntimeError):
    """The run stopped training: non-finite loss, or no step can be taken any more."""


def _check_divergence(step: int, loss: float, info, cfg: Config, floor_run: int) -> int:
    """Raise Diverged if this step shows the run cannot train; else the updated count of
    consecutive skipped steps at the lowest loss scale."""
    if not math.isfinite(loss):
        raise Diverged(f"diverged at step {step}: loss is {loss} (lower train.lr, or for fp16 "
                       f"check zero.initial_scale_power)")
    at_floor = cfg.zero.dtype != "fp16" or info.loss_scale <= cfg.zero.min_loss_scale
    floor_run = floor_run + 1 if info.skipped and at_floor else 0
    if floor_run >= FLOOR_SKIPS:
        what = (f"the loss scale is at its floor zero.min_loss_scale={cfg.zero.min_loss_scale:g}"
                if cfg.zero.dtype == "fp16" else f"gradients are non-finite in {cfg.zero.dtype}")
        raise Diverged(f"diverged at step {step}: {floor_run} consecutive steps skipped and "
                       f"{what}; lower train.lr")
    return floor_run


@dataclass
class LoopResult:
    losses: list = field(default_factory=list)  # global mean loss per optimizer step
    step_times: list = field(default_factory=list)  # seconds, timed steps only
    skipped_steps: int = 0  # fp16 overflow skips
    skipped_at: list = field(default_factory=list)  # step indices of those skips
    start_step: int = 0  # first step run (> 0 when resumed from a checkpoint)
    grad_norms: list = field(default_factory=list)
    loss_scales: list = field(default_factory=list)
    comm_per_step: dict = field(default_factory=dict)  # ledger of the last timed step

    @property
    def median_step_time(self) -> float:
        return statistics.median(self.step_times) if self.step_times else float("nan")


class _Clock:
    """Step start marks (CUDA events on the current stream, else ``perf_counter``) and the
    seconds between consecutive marks, read once per window."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def seconds(self, marks: list) -> list[float]:
        """Seconds between consecutive ``marks`` (one host synchronisation on CUDA)."""
        if not self.cuda:
            return [b - a for a, b in zip(marks, marks[1:])]
        marks[-1].synchronize()
        return [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])]


def train(strategy, source: TokenSource, cfg: Config, topo: Topology, device: torch.device,
          on_step=None, start_step: int = 0, before_step=None) -> LoopResult:
    """Run steps ``start_step .. train.steps - 1``. ``before_step(step)`` runs after the
    backward passes and before the optimizer step; ``on_step(step, loss, dt, info)`` after it,
    at the end of the step's window (checkpointing happens there, outside the timed region: a
    checkpoint step always ends its window)."""
    t = cfg.train
    res = LoopResult(start_step=start_step)
    local_losses = []
    clock = _Clock(device)
    window = CUDA_WINDOW if clock.cuda else 1
    every = cfg.checkpoint.save_every
    pending: list = []  # (step, loss tensors, info) of the open window
    marks: list = []
    floor_run = 0
    for step in range(start_step, t.steps):
        if step == t.steps - 1:
            topo.ledger.reset()  # the ledger of exactly one (the last) step
        marks.append(clock.mark())
        losses: list[torch.Tensor] = []
        batches = (rank_batch(source, step, t.micro_batch_size, topo.dp, topo.dp_rank, k,
                              t.grad_accum) for k in range(t.grad_accum))
        info = train_step(strategy, ((x.to(device, non_blocking=True),
                                      y.to(device, non_blocking=True)) for x, y in batches),
                          on_loss=losses.append,
                          before_update=None if before_step is None
                          else functools.partial(before_step, step))
        pending.append((step, losses, info))
        if info.skipped:
            res.skipped_steps += 1
            res.skipped_at.append(step)
            if topo.rank == 0:
                what = ("fp16 gradient overflow" if cfg.zero.dtype == "fp16"
                        else f"non-finite gradient ({cfg.zero.dtype})")
                log.warning("step %d: %s, optimizer step skipped (%d so far); loss scale was %g",
                            step, what, res.skipped_steps, info.loss_scale)
        ends = (len(pending) >= window or step == t.steps - 1
                or step == start_step + t.warmup_steps - 1 or (every and (step + 1) % every == 0))
        if not ends:
            continue
        marks.append(clock.mark())
        for (k, ls, inf), dt in zip(pending, clock.seconds(marks)):
            step_loss = 0.0
            for loss in ls:  # same order and arithmetic as summing inside the micro-batch loop
                step_loss += float(loss) / t.grad_accum
            if k >= start_step + t.warmup_steps or k == t.steps - 1:
                res.step_times.append(dt)
            local_losses.append(step_loss)
            floor_run = _check_divergence(k, step_loss, inf, cfg, floor_run)
            res.grad_norms.append(float(inf.grad_norm))
            res.loss_scales.append(float(inf.loss_scale))
            if on_step is not None:  # per-step log line, checkpoints, W&B (zero_repro.lab.rank)
                on_step(k, step_loss, dt, inf)
        pending, marks = [], []
    if res.skipped_steps == t.steps - start_step:
        raise Diverged(f"every step ({res.skipped_steps}) was skipped: nothing was trained; "
                       f"lower train.lr (fp16: zero.initial_scale_power)")
    res.comm_per_step = topo.ledger.as_dict()
    # global mean over DP ranks (TP ranks of one DP rank see the same loss)
    per_dp = comm.all_gather_object(local_losses, topo.dp_group)
    res.losses = [sum(v) / len(v) for v in zip(*per_dp)]
    return res
