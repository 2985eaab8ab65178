"""Peer runners: one GPT, seed and sequence of global batches trained by torch DDP, DDP +
ZeroRedundancyOptimizer, FSDP2 ``fully_shard``, DeepSpeed ZeRO 1-3 and this project's stages 0-3,
each in lock step with a single-process reference (paper §5: every stage trains *the same model*
as baseline DP; §7: stages 0-2 move 2Ψ elements per step, stage 3 3Ψ).

``run_peers(rank, world, spec)`` (module level, for ``launch.spawn``): after every step each
framework's parameters are compared with the reference's (``torch.optim.AdamW`` on the TP=1 model
over the full global batch, run redundantly on every rank, untimed) over the elements the rank
holds. Frameworks are interleaved step by step (the order rotates) so machine load hits them
alike; a timed step is barrier -> forward/backward/step/zero_grad -> clock, its time the slowest
rank's. ``optimizer="fused"`` gives every peer ``torch.optim.AdamW(fused=True)``, the kernel of
``ShardAdamW`` (``"as_shipped"``: the peers' defaults); ``lower_bound`` is the same micro-batch's
forward + backward without communication plus the fused AdamW on Ψ/N_d. A framework that patches
torch for the whole process (``PATCHES_TORCH``) runs in a process set of its own
(``process_sets``); the lower bound runs in every set. One untimed step per framework is counted
under ``CommCounter`` in a ``comm.CommLedger`` (§7 convention). Memory, one accounting for every
framework (``lab.live_peak.live_tracer``, one tracer per framework, entered for its build and
each untimed step): the peak live bytes of the storages a framework created over its build and
untimed steps, the distinct storages of its parameters, gradients and optimizer state
after the last step, and the process's max RSS (a cross-check where a framework runs alone).
``run_budget``: the largest model of a ladder a framework trains within a per-rank budget.
"""
from __future__ import annotations

import gc
import logging
import math
import time
from dataclasses import dataclass, field, replace

import torch

from zero_repro.config import ModelConfig
from zero_repro.runtime.comm import comm
from zero_repro.runtime.train.data import make_source, rank_batch
from zero_repro.lab.peers.frameworks import RUNNERS, CommCounter, Reference, Runner
from zero_repro.lab.peers.spec import (  # noqa: F401 (PeerSpec: the runners' entry type)
    FRAMEWORKS, LOWER_BOUND, PATCHES_TORCH, PeerSpec)
from zero_repro.lab.live_peak import live_tracer
from zero_repro.lab.peers.memory import max_rss, rss

log = logging.getLogger(__name__)



def process_sets(frameworks, anchors=(LOWER_BOUND,), by_stage: bool = False
                 ) -> list[tuple[str, ...]]:
    """Split ``frameworks`` into process sets: one for every framework that does not patch
    torch (one per ZeRO stage with ``by_stage``: fewer model copies per process for large
    models), one per patching framework. ``anchors`` (the lower bound) run in every set, so
    each set's times can be put on one scale (ratios across sets divide by the set's bound)."""
    fws = [f for f in frameworks if f not in anchors]
    plain = [f for f in fws if f not in PATCHES_TORCH]
    if by_stage:
        stages = sorted({FRAMEWORKS[f][0] for f in plain})
        sets = [[f for f in plain if FRAMEWORKS[f][0] == k] for k in stages]
    else:
        sets = [plain] if plain else []
    sets += [[f] for f in fws if f in PATCHES_TORCH]
    anchors = [a for a in anchors if a in frameworks]
    return [tuple(s + anchors) for s in sets] or ([tuple(anchors)] if anchors else [])


# ------------------------------------------------------------------------------ the driver
@dataclass
class Trace:
    """What one framework did on this rank."""

    losses: list = field(default_factory=list)
    step_times: list = field(default_factory=list)  # every step (warm-up included)
    dparam: list = field(default_factory=list)  # per step: (max |Δ|, tensor) or None
    comm: dict = field(default_factory=dict)
    memory: dict = field(default_factory=dict)
    # the live-storage peak (``live_peak.live_tracer``) over build + untimed steps, bytes
    live_peak: int = 0
    build_s: float = 0.0


def digest(runner: Runner, ref: dict[str, torch.Tensor]) -> tuple[float, str]:
    """(max |θ_f - θ_ref| over the elements this rank holds, the tensor where it is largest)."""
    c = compare(runner, ref)
    return c[0], c[1]


def compare(runner: Runner, ref: dict[str, torch.Tensor],
            budget: dict[str, torch.Tensor] | None = None, abs_tol: float = 0.0
            ) -> tuple[float, str, float, int]:
    """(max |Δθ|, its tensor, max over elements of |Δθ| / (abs_tol + budget), elements beyond
    ``abs_tol`` but within their budget) over the elements this rank holds, Δθ = θ_f - θ_ref.

    The third value is the verdict (<= 1: equivalent); without ``budget`` it is
    max |Δθ| / abs_tol (inf when abs_tol is 0 and Δθ is not)."""
    worst, where, ratio, n_cond = 0.0, "", 0.0, 0
    for name, t, row0 in runner.views():
        if t.numel() == 0:
            continue
        r = ref[name]
        b = budget.get(name) if budget is not None else None
        if row0 is not None:
            rows = t.shape[0] if t.dim() else 0
            r = r.narrow(0, min(row0, r.shape[0]), rows) if rows else r[:0]
            if b is not None:
                b = b.narrow(0, min(row0, b.shape[0]), rows) if rows else b[:0]
        diff = (t.float() - r.reshape(t.shape)).abs()
        d = float(diff.max())
        if d > worst or not where or math.isnan(d):
            worst, where = d, name
        allowed = abs_tol + (b.reshape(t.shape) if b is not None else 0.0)
        if isinstance(allowed, float) and allowed == 0.0:
            q = 0.0 if d == 0 else math.inf
        else:
            q = float((diff / allowed).max()) if not math.isnan(d) else math.nan
        if not q <= ratio:  # NaN counts as the worst
            ratio = q
        if b is not None:
            n_cond += int(((diff > abs_tol) & (diff <= allowed)).sum())
    return worst, where, ratio, n_cond


def _timed_step(runner: Runner, x, y, world: comm.Group) -> tuple[float, float]:
    comm.barrier(world)
    t0 = time.perf_counter()
    loss = runner.step(x, y)
    return loss, time.perf_counter() - t0


def run_peers(rank: int, world_size: int, spec: PeerSpec) -> dict:
    """Train every framework of ``spec`` (and the reference, unless ``spec.reference`` is
    false) in lock step on this rank.

    Returns ``{"frameworks": {name: Trace as dict}, "reference_losses": [...], "rank": r}``;
    losses are this rank's local losses (the global loss is the mean over ranks). ``dparam``
    entries are ``compare``'s (max |Δθ|, tensor, tolerance ratio, elements within budget
    only)."""
    t = spec.train
    world = None  # comm.barrier(None): the default group, every rank
    source = make_source(t.data, spec.model.seq_len, spec.model.vocab_size, t.seed)
    ref = Reference(spec, rank, world_size) if spec.reference else None
    runners: dict[str, Runner] = {}
    traces: dict[str, Trace] = {}
    trackers: dict = {}  # framework -> its live_tracer
    rss_before = rss()
    for name in spec.frameworks:
        t0 = time.perf_counter()
        with trackers.setdefault(name, live_tracer(world_size)):
            runners[name] = RUNNERS[name](spec, rank, world_size)
        traces[name] = Trace(build_s=time.perf_counter() - t0)
    comm_step = spec.comm_step if spec.comm_step >= 0 else max(0, t.warmup_steps - 1)
    ref_losses = []
    names = list(runners)
    for step in range(t.steps):
        ref_params = None
        if ref is not None:
            gx, gy = rank_batch(source, step, t.micro_batch_size * world_size, 1, 0)
            ref_losses.append(ref.step(gx, gy))
            ref_params = {n: p.detach() for n, p in ref.model.named_parameters()}
        x, y = rank_batch(source, step, t.micro_batch_size, world_size, rank)
        k = step % max(1, len(names))
        last = step == t.steps - 1
        for name in names[k:] + names[:k]:  # rotate: no framework always runs first
            r, tr = runners[name], traces[name]
            if step < t.warmup_steps:  # untimed: its memory is tracked
                with trackers[name]:
                    if step == comm_step:
                        tr.losses.append(_counted_step(r, tr, x, y))
                        tr.step_times.append(float("nan"))
                    else:
                        loss, dt = _timed_step(r, x, y, world)
                        tr.losses.append(loss)
                        tr.step_times.append(dt)
                tr.live_peak = trackers[name].peak
            else:
                loss, dt = _timed_step(r, x, y, world)
                tr.losses.append(loss)
                tr.step_times.append(dt)
            check = ref_params is not None and name != LOWER_BOUND and (
                last or step % spec.digest_every == 0)
            abs_tol = spec.param_tol_rel_lr * t.lr * (step + 1)
            tr.dparam.append(compare(r, ref_params, ref.budget, abs_tol) if check else None)
            if last:
                tr.memory = r.memory()
    return {"rank": rank, "reference_losses": ref_losses,
            "frameworks": {n: vars(tr) for n, tr in traces.items()},
            "max_rss": max_rss(), "rss_before": rss_before}


def run_budget(rank: int, world_size: int, spec: PeerSpec, ladder: list[ModelConfig],
               budget: float) -> dict:
    """The ladder's models (smallest first) trained by ``spec.frameworks[0]`` alone, each for
    ``spec.train.warmup_steps`` steps under its own ``live_tracer``, until one's peak exceeds
    ``budget`` bytes on some rank (every rank agrees: the largest peak over ranks decides).
    Returns ``{"rank", "sizes": [{"model", "live_peak", "max_rss", "fits"}, ...]}``; the max
    RSS after a size is the process's peak so far (sizes grow, so it is that size's)."""
    name = spec.frameworks[0]
    t = spec.train
    world = comm.new_group("world", range(world_size), comm.CommLedger(), rank)
    sizes, rss_before = [], rss()
    for m in ladder:
        s = replace(spec, model=m)
        source = make_source(t.data, m.seq_len, m.vocab_size, t.seed)
        tracker = live_tracer(world_size)
        with tracker:
            runner = RUNNERS[name](s, rank, world_size)
            for step in range(t.warmup_steps):
                x, y = rank_batch(source, step, t.micro_batch_size, world_size, rank)
                runner.step(x, y)
        peak = torch.tensor([float(tracker.peak)])
        comm.all_reduce(peak, world, op="max")
        fits = bool(peak.item() <= budget)
        sizes.append({"model": m.name, "live_peak": tracker.peak, "max_rss": max_rss(),
                      "fits": fits})
        del runner
        gc.collect()
        if not fits:
            break
    return {"rank": rank, "sizes": sizes, "rss_before": rss_before}


def _counted_step(runner: Runner, trace: Trace, x, y) -> float:
    comm.barrier(None)
    own = runner.comm_ledger()
    if own is not None:
        own.reset()
        loss = runner.step(x, y)
        trace.comm = {"source": "zero_repro.runtime.comm.comm ledger", **own.as_dict()}
        return loss
    ledger = comm.CommLedger()
    with CommCounter(ledger):
        loss = runner.step(x, y)
    trace.comm = {"source": "c10d dispatch counter", **ledger.as_dict()}
    return loss


def _single(name: str):
    def run(rank: int, world_size: int, spec: PeerSpec) -> dict:
        return run_peers(rank, world_size, replace(spec, frameworks=(name,)))

    run.__name__ = run.__qualname__ = f"run_{name}"
    run.__doc__ = f"``run_peers`` with the single framework {name!r} (usable with spawn)."
    return run


run_torch_ddp = _single("torch_ddp")
run_torch_zero_redundancy = _single("torch_zero_redundancy")
run_fsdp2_no_reshard = _single("fsdp2_no_reshard")
run_fsdp2_reshard = _single("fsdp2_reshard")
run_deepspeed_z1 = _single("deepspeed_z1")
run_deepspeed_z2 = _single("deepspeed_z2")
run_deepspeed_z3 = _single("deepspeed_z3")
run_zero_repro_s0 = _single("zero_repro_s0")
run_zero_repro_s1 = _single("zero_repro_s1")
run_zero_repro_s2 = _single("zero_repro_s2")
run_zero_repro_s3 = _single("zero_repro_s3")
run_lower_bound = _single(LOWER_BOUND)
