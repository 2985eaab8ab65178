"""The training loop (``train``): warm-up steps, timed steps, per-step loss and throughput.

One optimizer step is ``train.step.train_step``; the first ``warmup_steps`` run untimed
(allocator warm-up, lazy optimizer state, connection set-up); step time is wall clock per
step, as the paper reports: on CPU ``time.perf_counter``; on CUDA the interval between events
recorded on the compute stream, the host synchronising once per window of ``CUDA_WINDOW`` steps
(and at warm-up end, checkpoint steps, the last step), so nothing waits for the NCCL stream
between steps and a step's trailing collectives overlap the next forward; a step's skip flag and
gradient norm (``StepInfo``, on the device) are read there too. Measurement has no
side effects: losses are gathered once, at the end, by an object all-gather the ledger does not
count. ``start_step`` resumes at a checkpoint's data position (batches are a function of (seed,
step), so a resumed run sees the uninterrupted run's data). fp16 overflow skips are counted and
logged. ``Diverged`` (status ``diverged``) stops the run at a non-finite loss, ``FLOOR_SKIPS``
consecutive skips at the lowest loss scale (any non-finite gradient for fp32/bf16), or a run whose
every step was skipped.
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


def _note_skip(res: "LoopResult", step: int, info, cfg: Config, topo: Topology) -> None:
    res.skipped_steps += 1
    res.skipped_at.append(step)
    if topo.rank == 0 and cfg.zero.dtype == "fp16":
        log.warning("step %d: fp16 gradient overflow, optimizer step skipped (%d so far); loss "
                    "scale was %g", step, res.skipped_steps, info.loss_scale)
    elif topo.rank == 0:  # fp32/bf16: no loss scale
        log.warning("step %d: non-finite gradient (%s), optimizer step skipped (%d so far)",
                    step, cfg.zero.dtype, res.skipped_steps)


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
    # the same step's bytes by link (``CommLedger.link_bytes``: intra_node, inter_node)
    comm_by_link: dict = field(default_factory=dict)

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
            if inf.skipped:  # read here, once the window's steps are queued (StepInfo)
                _note_skip(res, k, inf, cfg, topo)
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
    res.comm_by_link = topo.ledger.link_bytes()
    # global mean over DP ranks (TP ranks of one DP rank see the same loss)
    per_dp = comm.all_gather_object(local_losses, topo.dp_group)
    res.losses = [sum(v) / len(v) for v in zip(*per_dp)]
    return res
