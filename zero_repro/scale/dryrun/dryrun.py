"""Paper-scale memory dry run (paper §10.5, Figures 6-7; Tables 1-2 memory columns): one rank's
real build and training steps on data-free tensors under a ``fake`` process group.

``dry_run(cfg, rank)`` runs what a rank of ``zero_repro.lab.rank`` runs -- a ``train.trainer.Trainer``
(its build: GPT -> activation checkpointing -> ZeRO strategy, the same functions, no simulation
copy) and ``iterations`` of its steps -- on PyTorch's ``meta`` device (``backend``
``meta``; ``fake``: ``FakeTensorMode`` CPU tensors) with a ``fake`` group of
``parallel.world_size`` ranks, so a 100B-parameter rank fits a laptop. Meta kernels follow CUDA's
dtype rules and the model takes the fused attention kernel a GPU takes.

What it reports and must satisfy (Ψ = this rank's flat-buffer elements): the project's ledgers,
model states equal to Table 1 exactly (``model_state_bytes(Ψ_padded, stage, N_d,
shard_size=G)``; ``zero.shard_size=node``: the cluster's DP ranks per node), checkpoints
b·s·h·l·2 bytes (/m with P_a, 0 on the device with P_a+cpu); the allocation trace
(``tracer.AllocationTracer``) and its replay through the caching-allocator model (``allocator``):
peak allocated, peak reserved ("max cached", Figure 7), fragmentation, and ``live_peak_steady``
(the next step's live peak: the last step's curve plus the state it created lazily). Judged
replays run to the steady state: the last traced step (2 steps by default; the first also
creates the lazy state) is repeated until the allocator's layout stops changing
(``allocator.replay(repeat_from=...)``); a last step that is not closed is judged as traced.
A model fits when neither its build nor its training steps run out: where the judged trace
starts after the build (``modern``: as after ``empty_cache()``), the build is replayed on its
own (the runtime's partitioned construction: stage 3 holds one unit whole + its shards) and
``allocator["oom"]`` is the verdict over both (``judge``); ``oom_training`` the steps' alone.

``cfg.simulate.stack`` (``stack``): ``modern`` runs this runtime as it is; ``paper2020`` swaps
in the 2019 Megatron layer and checkpointing and DeepSpeed 0.2's stage 1-2 allocation sequence,
judged with its build (no ``empty_cache``: "max cached" from process start) against the device
less the CUDA context + NCCL; ``DryRunResult.breakdown`` says where the memory went at the peak.
Data-dependent reads answer 0 (finite gradients, no overflow: the most-allocating path). P_a+cpu
and ZeRO-Offload (``zero.offload_optimizer``) host storages are excluded from device numbers (C5 under-counts one b·s·h/m·2-byte slice, 1 MB
at 100B). The fake group is process-global: ``dry_run`` creates and destroys it; inside a
process that has a group use ``dry_run_subprocess``. Speeds: ``results/fig6_max_model/notes.md``.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import multiprocessing
import os
import time
import traceback
from dataclasses import dataclass, field

import torch
from omegaconf import OmegaConf
from torch._subclasses.fake_tensor import FakeTensorMode

from zero_repro import config as C
from zero_repro import schema
from zero_repro import validation
from zero_repro.runtime.comm import comm, launch
from zero_repro.runtime.comm.topology import Topology
from zero_repro.scale.hardware import device_bytes
from zero_repro.scale.paper.clusters import DRYRUN_FIELDS, PAPER_CLUSTER, cluster_overrides
from zero_repro.scale.paper.overrides import paper_overrides
from zero_repro.scale.paper.overrides import setup_overrides as paper_setup_overrides
from zero_repro.scale.paper.setups import PaperSetup
from zero_repro.scale.paper.setups import setups
from zero_repro.scale.dryrun import allocator as A
from zero_repro.scale.dryrun import host_storage as HS
from zero_repro.scale.dryrun import snapshot
from zero_repro.scale.dryrun.stack import categories as K
from zero_repro.scale.dryrun.stack import checkpoint2019, deepspeed02, megatron2019, streams
from zero_repro.scale.dryrun.stack import switches as S
from zero_repro.scale.dryrun.trace import (  # noqa: F401 (re-exported)
    build_events, device_events, judged_trace, live_peaks, repeat_start, steady_peak,
    without_teardown)
from zero_repro.scale.dryrun.tracer import ALLOC, FREE, AllocationTracer  # noqa: F401 (re-exported)
from zero_repro.runtime.model import model_class
from zero_repro.runtime.train.trainer import Trainer

log = logging.getLogger(__name__)

PHASES = ("build", "forward", "backward", "step")


# ------------------------------------------------------------------------------ results
@dataclass
class DryRunResult:
    """One rank's memory at paper scale (bytes). ``trace`` is the raw event list."""

    config: dict  # the identifying knobs (model, parallel, stage, zero_r)
    psi: int  # this rank's parameters (exact, before padding)
    psi_padded: int  # elements of this rank's flat buffers (padded to the bucket grid)
    n_buckets: int
    ledger: dict  # category -> bytes, the project's ledgers
    model_state_bytes: int  # sum of the Table 1 categories of the ledger
    live_peak: int  # peak of live device bytes (exact sizes, no allocator rounding)
    live_peak_by_phase: dict  # phase -> peak live device bytes during it (all iterations)
    live_peak_by_iteration: dict  # iteration -> peak live device bytes (training phases)
    host_bytes: int  # bytes identified as host memory (P_a+cpu, ZeRO-Offload's optimizer)
    allocator: dict  # training-phase replay through the caching-allocator model
    allocator_with_build: dict  # replay including the build phase (no empty_cache)
    timings: dict  # seconds: build, per iteration, total
    n_events: int
    n_ops: int
    # live peak the NEXT iteration would reach: the last iteration's live curve plus the state
    # it created lazily (alive at its end, so present from the start of the next one); equal to
    # the last iteration's peak when one iteration already shows the steady state
    live_peak_steady: int = 0
    trace: list = field(default_factory=list, repr=False)
    host_sids: frozenset = frozenset()
    # software stack (``simulate.stack``): its name, whether ``allocator`` (the judged replay)
    # includes the build phase (paper2020: no empty_cache, "max cached" from process start),
    # the judged capacity (device bytes less what sits outside the allocator)
    stack: str = "modern"
    judged_with_build: bool = False
    capacity: float = 0.0
    breakdown: dict = field(default_factory=dict)  # categories.breakdown at the judged peak
    category_of: dict = field(default_factory=dict, repr=False)  # sid -> category (trace kept)
    module_of: dict = field(default_factory=dict, repr=False)  # sid -> module (trace kept)
    backend: str = "meta"  # how it ran without data (dry_run's ``backend``)
    _min_capacity: int | None = field(default=None, repr=False)  # memo of min_capacity()
    cached_ops: int = 0  # ops the tracer answered from its output cache (backend meta)

    def summary(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("trace")
        d.pop("host_sids")
        d.pop("category_of")
        d.pop("module_of")
        d.pop("_min_capacity")
        return d

    def judged_events(self) -> list:
        """The device trace the judge replays: with the build phase (``judged_with_build``) or
        as after ``empty_cache()`` at the end of the build."""
        if not self.trace:
            raise ValueError("replay needs the trace: run dry_run(..., keep_trace=True)")
        return judged_trace(self.trace, self.host_sids, self.judged_with_build)

    def build_judged_apart(self) -> bool:
        """Whether the build is judged by its own replay (the judged trace starts after it)."""
        return not self.judged_with_build

    def replay(self, capacity: float | None) -> dict:
        """The judged allocator replay again (to the steady state), with another capacity
        (needs the trace: ``keep_trace=True``); e.g. one dry run both probes and judges.
        ``oom``: the build or the training steps ran out (``judge``)."""
        ev = self.judged_events()
        train = A.replay(ev, capacity=capacity, repeat_from=repeat_start(ev)).as_dict()
        build = None
        if self.build_judged_apart():
            build = A.replay(build_events(self.trace, self.host_sids), capacity=capacity)
        return judge(train, build)

    def needs_at_most(self, bound: float) -> bool:
        """``min_capacity() <= bound``, with as few replays as decide it (``allocator.min_capacity``
        ``bound``) where ``min_capacity`` is not computed yet."""
        if self._min_capacity is not None:
            return self._min_capacity <= bound
        ev = self.judged_events()
        known = ((self.capacity, not self.allocator["oom_training"]) if self.capacity else None)
        if A.min_capacity(ev, repeat_from=repeat_start(ev), known=known, bound=bound) > bound:
            return False
        return not self.build_judged_apart() or A.min_capacity(
            build_events(self.trace, self.host_sids), bound=bound) <= bound

    def min_capacity(self, compute: bool = True) -> int | None:
        """Smallest device capacity (bytes, allocator's share) at which neither the judged
        replay (in the steady state) nor, where judged apart, the build's runs out of memory
        (``allocator.min_capacity``; needs the trace). Computed once; ``compute=False``: None
        unless computed before."""
        if self._min_capacity is None and compute:
            ev = self.judged_events()
            known = ((self.capacity, not self.allocator["oom_training"])
                     if self.capacity else None)
            need = A.min_capacity(ev, repeat_from=repeat_start(ev), known=known)
            if self.build_judged_apart():
                need = max(need, A.min_capacity(build_events(self.trace, self.host_sids)))
            self._min_capacity = need
        return self._min_capacity


def judge(train: dict, build) -> dict:
    """The judged replay's result (``train``, ``ReplayResult.as_dict()``) with the build's
    replay (``build``, a ``ReplayResult`` or None where the build is part of ``train``):
    ``oom`` is the verdict over both -- the larger peak decides -- ``oom_training`` the
    training steps' alone; ``build_peak_reserved`` / ``build_oom`` the build's."""
    out = dict(train, oom_training=train["oom"])
    if build is not None:
        out.update(build_peak_reserved=build.peak_reserved, build_oom=build.oom,
                   oom=train["oom"] or build.oom)
    return out


# ------------------------------------------------------------------------------ the run
def stack_of(cfg: C.Config) -> S.Stack:
    """The software stack ``cfg.simulate`` names (``only_switches``: modern plus those
    paper2020 switches)."""
    sim = cfg.simulate
    if sim.only_switches:
        for name in sim.only_switches:
            S.describe(name)  # ValueError naming the valid switches
        return S.paper2020().with_only(*sim.only_switches)
    return S.get(sim.stack)


def changes_layer(stack: S.Stack) -> bool:
    """Whether ``stack`` runs the 2019 Megatron layer / loss instead of ``model.gpt``."""
    return (stack.materialized_scores or stack.dropout_masks or stack.tanh_gelu_intermediates
            or stack.fp32_logits)


def builders(stack: S.Stack, cfg: C.Config) -> dict:
    """``train.build.build`` keyword arguments that put ``stack``'s parts in (empty: the
    runtime as it is)."""
    # the 2020 build made the whole model before DeepSpeed flattened it (no partitioned
    # construction): where the stack models that build, so does the dry run
    fp32_first = stack.fp32_model_on_gpu_before_half
    kw: dict = {"partitioned": not (stack.build_sequence or fp32_first)}
    if changes_layer(stack):
        kw["make_model"] = lambda c, topo, device, dtype: megatron2019.GPT2019(
            c.model, stack, topo.tp_group, device=device, dtype=dtype)
    if fp32_first:
        kw["make_model"] = megatron2019.fp32_then_half(
            kw.get("make_model") or (lambda c, topo, device, dtype: model_class(c.model)(
                c.model, tp_group=topo.tp_group, device=device, dtype=dtype)))
    if (stack.pa_per_layer_checkpoints or stack.contiguous_ckpt_only_with_pa
            or stack.reentrant_checkpointing
            or stack.collective_stream_reuse == streams.AFTER_SYNC):  # its per-layer syncs
        kw["make_ckpt"] = checkpoint2019.make_ckpt(stack)
    if deepspeed02.uses_deepspeed02(stack, cfg.zero.stage):
        kw["make_strategy"] = deepspeed02.make_strategy(stack)
    return kw


def _build_polling(tracer: AllocationTracer, stack: S.Stack, cfg: C.Config, kw: dict):
    """Poll every storage during the build (``tracer.polling_all``) unless no storage can be
    resized in place there: DeepSpeed 0.2's whole-model build (``deepspeed02``, not partitioned)
    makes new tensors only -- in-place storage resizes live in the runtime's flat buffers and
    stage 3 alone. Polling costs one size read per storage per allocating op, quadratic in
    depth (most of a paper2020 build at 200 layers); skipping it leaves the trace unchanged."""
    if deepspeed02.uses_deepspeed02(stack, cfg.zero.stage) and not kw["partitioned"]:
        return contextlib.nullcontext()
    return tracer.polling_all()


def judges_with_build(stack: S.Stack, cfg: C.Config) -> bool:
    """paper2020 counts the build's cached blocks (no empty_cache in DS@f2ac7eafd nor
    DSE@405ce794) where its build is modelled: DeepSpeed 0.2's stages 1/2."""
    return stack.build_sequence and deepspeed02.uses_deepspeed02(stack, cfg.zero.stage)


def capacity_for(cfg: C.Config, stack: S.Stack) -> float | None:
    """Bytes the caching allocator may use: the cluster's device memory as the device reports
    it (``scale.hardware.device_bytes``) less what ``stack`` puts outside the allocator (CUDA
    context, NCCL) at ``simulate.outside_point`` of its bracket; None when unbounded."""
    dev = device_bytes(cfg.cluster)
    return stack.capacity_bytes(dev, cfg.simulate.outside_point) if dev > 0 else None


BACKENDS = ("meta", "meta_uncached", "fake")


def node_shard_size(cfg: C.Config) -> C.Config:
    """``cfg`` with ``zero.shard_size=node`` as the number G of the cluster's DP ranks per node
    (``validation.shard_size_of``): the fake group has no node to ask."""
    if cfg.zero.shard_size != "node":
        return cfg
    tp = max(1, cfg.parallel.tp)
    g = validation.shard_size_of("node", cfg.parallel.world_size // tp,
                                 cfg.cluster.gpus_per_node // tp)
    return dataclasses.replace(cfg, zero=dataclasses.replace(cfg.zero, shard_size=str(g)))


def dry_run(cfg: C.Config, rank: int = 0, iterations: int = 2, keep_trace: bool = True,
            allocator_capacity: float | None = None, stack: S.Stack | None = None,
            backend: str = "meta", details: bool = True,
            transport_of: str = "fake") -> DryRunResult:
    """Run ``iterations`` training steps of rank ``rank`` of ``cfg`` under fake tensors.

    ``stack``: the software stack to execute (default ``cfg.simulate``: modern = this
    runtime, paper2020 = the 2020 stack, ``scale.dryrun.stack``).
    ``allocator_capacity``: device bytes for the allocator replay (default: ``capacity_for``,
    the device as it reports itself less the stack's bytes outside the allocator; unbounded
    when the cluster has no device size);
    an allocation the replay cannot place even after releasing cached segments is reported as
    ``allocator["oom"]``.
    ``backend``: ``meta`` (tensors on the meta device, the tracer's output cache),
    ``meta_uncached`` (every meta kernel run: the cache's reference) or ``fake``
    (``FakeTensorMode`` CPU tensors, the slower original mechanism; ``tracer``).
    ``details=False``: leave ``breakdown`` and (where the judge replays without the build)
    ``allocator_with_build`` empty -- a replay each, ~5-10% of a dry run; the max-layers search
    needs only the judged replay, which then stops at the first recurring allocator state
    (``allocator.replay`` ``cycles``: the verdict and the peaks are the same, ``repeats``
    counts to the recurrence).
    ``transport_of``: whose bucket transport the ranks' buffers follow (``runtime.comm.transport``):
    ``fake`` (default) the rooted, in-place one, which holds no scratch -- for an NCCL cluster
    it under-counts only constant-size scratch -- or the transport a run used (its ``name``,
    ``real_ledgers``' ``transport``): ``native`` (NCCL's, staging scratch), ``gloo``
    (point-to-point, receive scratch) or ``shm`` (shared memory, its segment), which reproduce
    that run's ledgers exactly."""
    cfg = node_shard_size(validation.validate(cfg))
    if comm.is_initialized():
        raise RuntimeError("dry_run needs its own fake process group but one is already "
                           "initialised in this process: use dry_run_subprocess(cfg)")
    stack = stack_of(cfg) if stack is None else stack
    cap = allocator_capacity
    if cap is None:
        cap = capacity_for(cfg, stack)
    m, t = cfg.model, cfg.train
    if backend not in BACKENDS:
        raise ValueError(f"dry-run backend {backend!r}: choose one of {BACKENDS}")
    on_meta = backend.startswith("meta")
    tracer = K.CategoryTracer(on_meta=on_meta, cache=backend == "meta",
                              streams=stack.collective_stream_reuse == streams.AFTER_SYNC)
    host: set[int] = set()
    timings: dict[str, float] = {}
    t_start = time.perf_counter()
    launch.init_fake(rank, cfg.parallel.world_size)
    try:
        # meta: factories without a device default to meta (torch.tensor, randint, ...)
        with torch.device("meta") if on_meta else FakeTensorMode(), tracer:
            topo = Topology.build(cfg.parallel.tp)
            if transport_of != "fake":
                topo.model_transport(transport_of)
            t0 = time.perf_counter()
            # partitioned construction resizes each unit's buffer as it goes: every storage
            # is polled during the build, none of the skeleton's is recorded
            kw = builders(stack, cfg)
            with tracer.category(S.FP16_PARAMS), _build_polling(tracer, stack, cfg, kw):
                trainer = Trainer(cfg, topo, torch.device("meta" if on_meta else "cpu"),
                                  skeleton_scope=tracer.untracked, **kw)
            model, ckpt, strategy = trainer.model, trainer.ckpt, trainer.strategy
            HS.build_host(tracer, strategy, host)
            HS.offload_host(tracer, strategy, host)
            HS.watch_flat_buffers(tracer, strategy)
            hooks = K.tag_model(tracer, model) + K.tag_modules(tracer, model)
            timings["build_s"] = time.perf_counter() - t0
            for it in range(iterations):
                t0 = time.perf_counter()
                one_step(trainer, tracer, host, cfg, it)
                K.tag_strategy(tracer, strategy)
                timings[f"iteration{it}_s"] = time.perf_counter() - t0
            for h in hooks:
                h.remove()
            ledger = trainer.memory_ledger()
            HS.checkpoint_host(tracer, ckpt, host)
            psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
            psi_padded, n_buckets = _geometry(strategy)
            del model, ckpt, strategy, trainer
    finally:
        comm.destroy_process_group()
    events = without_teardown(tracer.events)
    dev = device_events(events, host)
    host_bytes = sum(e[2] for e in events if e[1] in host and e[0] == ALLOC)
    peak, by_phase, by_iter = live_peaks(dev)
    with_build = judges_with_build(stack, cfg)
    judged = judged_trace(events, host, with_build)
    rep = repeat_start(judged)
    if rep is None and iterations > 1:
        log.warning("dry run: the last step is not closed (it keeps a storage into the next "
                    "or frees an older one): judged as traced, without the steady state")
    # without details nothing reads how often the step repeated (the breakdown does): the
    # replay may stop at a recurring state (``allocator.replay`` cycles: same verdict, peaks)
    alloc_judged = judge(A.replay(judged, capacity=cap, repeat_from=rep,
                                  cycles=not details).as_dict(),
                         None if with_build else A.replay([e for e in dev if e[3] == "build"],
                                                          capacity=cap))
    alloc_all, brk = (alloc_judged if with_build else {}), {}
    if details:
        if not with_build:
            alloc_all = A.replay(dev, capacity=cap, repeat_from=repeat_start(dev)).as_dict()
        # the breakdown reads the peak of the steady replay: the trace with the repeated step
        # written out as often as the judged replay repeated it (same storage ids: it is closed)
        steady = judged + (judged[rep:] * alloc_judged["repeats"] if rep is not None else [])
        brk = K.breakdown(steady, tracer.category_of, capacity=cap)
    timings["total_s"] = time.perf_counter() - t_start
    ident = {"model": m.name, "n_layer": m.n_layer, "n_embd": m.n_embd, "n_head": m.n_head,
             "seq_len": m.seq_len, "world_size": cfg.parallel.world_size, "tp": cfg.parallel.tp,
             "stage": cfg.zero.stage, "dtype": cfg.zero.dtype, "zero_r": cfg.zero_r.name,
             "micro_batch_size": t.micro_batch_size, "rank": rank}
    if cfg.zero.shard_size != "all":
        ident["shard_size"] = cfg.zero.shard_size
    if stack.name != "modern":
        ident["stack"] = stack.name
    led = ledger.as_dict()
    log.info("dry run %s: %d events, peak live %.2f GB, peak reserved %.2f GB, %.1f s",
             ident, len(events), peak / 1e9, alloc_judged["peak_reserved"] / 1e9,
             timings["total_s"])
    return DryRunResult(config=ident, psi=psi, psi_padded=psi_padded, n_buckets=n_buckets,
                        ledger=led, model_state_bytes=ledger.model_states(), live_peak=peak,
                        live_peak_by_phase=by_phase, live_peak_by_iteration=by_iter,
                        host_bytes=host_bytes, allocator=alloc_judged,
                        allocator_with_build=alloc_all, timings=timings,
                        n_events=len(events), n_ops=tracer.n_ops,
                        live_peak_steady=steady_peak(dev),
                        trace=events if keep_trace else [], host_sids=frozenset(host),
                        stack=stack.name, judged_with_build=with_build, capacity=cap or 0.0,
                        breakdown=brk,
                        category_of=dict(tracer.category_of) if keep_trace else {},
                        module_of=dict(tracer.module_of) if keep_trace else {},
                        backend=backend,
                        cached_ops=tracer._cache.hits if tracer._cache is not None else 0)


def _geometry(strategy) -> tuple[int, int]:
    """(flat-buffer elements of this rank, number of buckets) of the runtime's strategy or of
    the DeepSpeed 0.2 path."""
    if hasattr(strategy, "psi_padded"):
        return strategy.psi_padded, strategy.n_buckets
    groups = strategy.groups
    return (sum(g.partition.padded_numel for g in groups),
            sum(len(g.partition.buckets) for g in groups))


def one_step(trainer: Trainer, tracer: AllocationTracer | None, host: set[int],
              cfg: C.Config, it: int) -> None:
    """One optimizer step exactly as ``train.loop.train`` drives the strategy (``tracer``
    None: a real run, e.g. ``real_ledgers``)."""
    t, m, ckpt = cfg.train, cfg.model, trainer.ckpt

    def phase(name: str):
        return tracer.in_phase(name, it) if tracer is not None else contextlib.nullcontext()

    def after_forward() -> None:
        if tracer is not None:  # per-block CPU copies are alive only until backward
            HS.checkpoint_host(tracer, ckpt, host)
            if ckpt is not None and hasattr(tracer, "category_of"):
                K.tag(tracer, (st.data for st in list(ckpt.kept)), S.CHECKPOINTS)

    batches = ((torch.randint(0, m.vocab_size, (t.micro_batch_size, m.seq_len)),
                torch.randint(0, m.vocab_size, (t.micro_batch_size, m.seq_len)))
               for _ in range(t.grad_accum))

    @contextlib.contextmanager
    def synced(name: str):
        # the training loop's phase boundaries are synchronisation points (DeepSpeed's timers,
        # ``stack.streams``; a no-op without the streams switch)
        with phase(name):
            yield
            streams.sync(f"{name} end")

    trainer.step(batches, phase=synced, after_forward=after_forward)


# ------------------------------------------------------------------------------ subprocess
def _child(cfg_dict: dict, rank: int, iterations: int, keep_trace: bool, capacity, conn) -> None:
    try:
        res = dry_run(schema.to_config(cfg_dict), rank, iterations, keep_trace, capacity)
        conn.send(("ok", res))
    except BaseException as e:  # noqa: BLE001 - report to the parent
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        conn.close()


def dry_run_subprocess(cfg: C.Config, rank: int = 0, iterations: int = 2,
                       keep_trace: bool = False, allocator_capacity: float | None = None,
                       timeout_s: float = 1800.0) -> DryRunResult:
    """``dry_run`` in a fresh child process (for callers that already hold a process group)."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    cfg_dict = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    p = ctx.Process(target=_child, args=(cfg_dict, rank, iterations, keep_trace,
                                         allocator_capacity, child))
    p.start()
    child.close()
    try:
        if not parent.poll(timeout_s):
            raise TimeoutError(f"dry run did not finish within {timeout_s:.0f}s")
        status, value = parent.recv()
    finally:
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join()
    if status != "ok":
        raise RuntimeError(f"dry run failed in the child process: {value}")
    return value


# ------------------------------------------------------------------------------ benchmark
def apply_overrides(cfg: C.Config, overrides: dict) -> C.Config:
    """``cfg`` with dotted ``overrides`` applied, validated."""
    base = OmegaConf.structured(cfg)
    for k, v in overrides.items():
        OmegaConf.update(base, k, v, merge=False)
    return validation.validate(schema.to_config(base))


def setup_overrides(s: PaperSetup, cluster: str = PAPER_CLUSTER, **kw) -> dict:
    """Overrides for a dry run of paper setup ``s`` (``paper.overrides.setup_overrides``, ``kw``
    passed on) with the device facts of ``cluster``."""
    return {**paper_setup_overrides(s, **kw), **cluster_overrides(cluster, DRYRUN_FIELDS)}


def bench_config(n_layer: int = 125, zero_config: str = "C4", cluster: str = PAPER_CLUSTER,
                 **shape):
    """The paper's 100B setup (Table 8: 125 x 8192, 64 heads, batch 32/GPU, 400 GPUs, MP 16)
    under ``zero_config`` with the paper harness's buckets; ``shape`` (hidden, heads, gpus,
    tp, batch) replaces what is given (e.g. the 1T model: 25600, 160 heads, 1024 GPUs)."""
    s = next(s for s in setups("fig7") if s.size_label == "100B")
    ov = setup_overrides(s, cluster)
    given = {k: v for k, v in shape.items() if v is not None}
    ov.update(paper_overrides(n_layer, given.get("hidden", s.hidden),
                              given.get("heads", s.heads), given.get("gpus", s.gpus),
                              given.get("tp", s.tp), given.get("batch", s.batch_per_gpu),
                              zero_config))
    return apply_overrides(C.Config(), ov)


def main(argv=None) -> int:
    """``python -m zero_repro.scale.dryrun.dryrun --bench``: time one paper-scale dry run (100B,
    400 GPUs, C4 by default) and print one line: wall time, phases, ops, peaks."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--bench", action="store_true", help="run the benchmark (the default)")
    ap.add_argument("--config", default="C4", help="ZeRO configuration C1..C5")
    ap.add_argument("--layers", type=int, default=125)
    ap.add_argument("--iterations", type=int, default=2,
                    help="traced steps (2: what the experiments judge, the 2nd replayed to the "
                         "allocator's steady state)")
    ap.add_argument("--stack", default="modern", choices=sorted(S.STACKS),
                    help="software stack (simulate.stack)")
    ap.add_argument("--backend", default="meta", choices=(*BACKENDS, "both"),
                    help="how to run without data (both: meta and fake, side by side)")
    for name in ("hidden", "heads", "gpus", "tp", "batch", "stage"):
        ap.add_argument(f"--{name}", type=int, default=None,
                        help=f"{name} (default: the 100B setup's; stage: the config's)")
    ap.add_argument("--cluster", default=PAPER_CLUSTER, help="conf/cluster/NAME")
    ap.add_argument("--snapshot", metavar="FILE",
                    help="also write the judged replay as a PyTorch memory snapshot (snapshot.py)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    extra = {"simulate.stack": args.stack}
    if args.stage is not None:
        extra["zero.stage"] = args.stage
    cfg = apply_overrides(bench_config(args.layers, args.config, args.cluster,
                                       hidden=args.hidden, heads=args.heads, gpus=args.gpus,
                                       tp=args.tp, batch=args.batch), extra)
    walls = {}
    for backend in (("meta", "fake") if args.backend == "both" else (args.backend,)):
        t0 = time.perf_counter()
        r = dry_run(cfg, iterations=args.iterations, keep_trace=bool(args.snapshot),
                    backend=backend)
        walls[backend] = wall = time.perf_counter() - t0
        if args.snapshot:
            print(snapshot.report_written(r, args.snapshot), flush=True)
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        its = " ".join(f"it{k[9:-2]} {v:.1f}s" for k, v in r.timings.items()
                       if k.startswith("iteration"))
        print(f"dry-run bench: {cfg.model.name} {args.config} stage {cfg.zero.stage} "
              f"{args.stack} {backend} world {cfg.parallel.world_size} "
              f"tp {cfg.parallel.tp} batch {cfg.train.micro_batch_size}: {wall:.1f} s wall "
              f"(build {r.timings['build_s']:.1f}s {its}; {r.n_ops} ops ({r.cached_ops} "
              f"cached), {r.n_events} events, {r.n_buckets} buckets; steady after "
              f"{r.allocator['repeats']} repeats) "
              f"peak live {max(r.live_peak_by_iteration.values()) / 1e9:.2f} "
              f"GB, steady {r.live_peak_steady / 1e9:.2f} GB, reserved "
              f"{r.allocator['peak_reserved'] / 1e9:.2f} GB; build: peak live "
              f"{r.live_peak_by_phase.get('build', 0) / 1e9:.2f} GB, reserved "
              f"{r.allocator.get('build_peak_reserved', 0) / 1e9:.2f} GB; "
              f"{'OOM' if r.allocator['oom'] else 'fits'} at {r.capacity / 1e9:.1f} GB; "
              f"{os.cpu_count()} cpus, "
              f"load {load:.1f}", flush=True)
    if len(walls) == 2:
        print(f"dry-run bench: fake / meta wall time = {walls['fake'] / walls['meta']:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
