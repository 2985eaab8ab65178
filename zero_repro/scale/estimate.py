"""Will it fit, which stage, how fast: per-rank memory of ZeRO-DP stages 0-3 from the dry run,
the largest micro-batch that fits, and the step time over the cluster's links (paper §5 Table 1,
§6 ZeRO-R, §7 communication; the practitioner's question Table 1 starts from).

For each stage (with one ZeRO-R setting, ``ZERO_R``) ``estimate`` reports, per rank:
  * model states: the dry run's ledger (must equal Table 1, ``model_state_bytes(Ψ_padded,
    stage, N_d)``) beside Table 1's closed form at Ψ = param_count / tp;
  * the live bytes at the training live peak by what holds them (``PARTS``): model states
    (stage 3: the own shard), gathered parameters (stage 3's units in use), buffers (C_B
    buckets, gather buffers), activations (checkpoints, the working layer, logits and loss),
    other (step transients); they sum to the live peak;
  * the allocator's extra: the judged caching-allocator replay's peak reserved minus the live
    peak (rounding, fragmentation, cached blocks; steady state, ``dryrun.judged_events``), and
    the verdict: neither the build (replayed on its own: partitioned construction holds the
    largest unit + the shards) nor the judged steps run out of memory at the device capacity;
  * the largest micro-batch that fits (``largest_batch``);
  * time, tokens/s, MFU / HFU and the traffic per rank and step (``scale.estimate_time``): by
    default today's stack on the cluster's GPU (``scale.modern_step``: every term and a band
    from the kernel inputs' spread), or the paper's Fig 2-calibrated V100 model (paper2020);
  * the modern stack's bytes outside the caching allocator (CUDA context, NCCL;
    ``scale.outside_modern``, the middle of its bracket) are taken off the device before every
    verdict; the paper2020 time model keeps the estimate as it was (the whole device);
  * the verdict with a band (``scale.limit``): within the band's reach of the device (the
    replay's fragmentation either way, the outside bracket's ends) it is "at the limit";
  * the stack it assumes (``scale.era``): with ``--time-model paper2020`` the 2020 stack,
    whose dry run holds the 2019 Megatron layer's activation extras (GPT, stages 0-2);
  * selective activation checkpointing (every k-th block checkpointed): one dry run with every
    block checkpointed and one with none, each picture and peak reserved interpolated at the
    checkpointed fraction c = 1/k (first order: a block holds either its checkpoint or all its
    activations), judged by the interpolated peak reserved;
  * unfused attention (the modern time model's ``attention=unfused``): the dry run runs the
    fused kernel, so the s x s probabilities are added per sample, b·(a/t)·s²·(2·l·(1 - c) + 6)
    bytes (each block not checkpointed keeps its bf16 probabilities; the working layer holds
    scores, probabilities and their gradient), to the activations and every judgement.
``recommend``: the smallest stage that fits at the requested micro-batch, unless the next one
fits a larger micro-batch that runs faster (tokens/s, each at its largest micro-batch).
Hierarchical sharding (``shard_size`` G, ``hpz``): stages 1-3 run at G (stage 0 shards nothing);
hpZ's secondary shard at stage 3 (2Ψ/k, k a node's DP ranks) is Table 1's closed form, held
through the step: added to the dry run's model states and peak and taken off the capacity it is
judged at. ``shard_choice`` then compares G = all, node and the sizes between, and hpZ, on the
cluster's links (``Estimate.choices``, ``Estimate.hierarchy``).

Mechanism and what is approximated:
  * one dry run per stage (``dryrun.dry_run``: meta tensors, the tracer's output cache, two
    steps), run at micro-batch b = ``PRIME_BATCH``, a prime; every trace event's size is then
    alpha + beta·b: a forward or backward storage whose size is a multiple of the prime holds b
    samples (activations b·s·x), every other one is constant (model states, buffers, the
    step's transients; constant sizes are products of model dimensions, all smaller than the
    prime, or flat-buffer counts, a multiple of it by chance 1/65521). ``BatchTraces`` writes
    the judged trace (``dryrun.judged_events``) at any b: the requested micro-batch (picture,
    verdict, peak reserved: the judged replay to the allocator's steady state) and every
    candidate of the search. Approximated: a size affine in b with an offset (P_a's slice
    padding ceil(b·s·h/m) when m does not divide s·h) is taken as constant;
    ``tests/unit/test_estimate.py`` holds the written trace to dry runs at other batch sizes;
  * the largest micro-batch: a bracketing search (seeded by the live peak's slope in b) of
    judged replays at the device capacity; the answer fits and the next micro-batch does not;
  * the stages run side by side in helper processes (``workers``, forked: no second import);
  * buffers follow the transport of the cluster's ranks (``dry_run(transport_of=...)``): NCCL's
    native one on a CUDA cluster.
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import multiprocessing
import os
import time
from dataclasses import dataclass, field

from omegaconf import OmegaConf

from zero_repro import config as C
from zero_repro import gpus
from zero_repro import schema
from zero_repro import validation
from zero_repro.runtime.model import flops
from zero_repro.scale import offload_time as OT
from zero_repro.scale import calibrate, era, limit, modern_step, outside_modern, perf_model
from zero_repro.scale import shard_choice
from zero_repro.scale.shard_choice import hpz_bytes  # noqa: F401 (re-exported)
from zero_repro.scale import estimate_time as T
from zero_repro.scale.batch_traces import (  # noqa: F401 (re-exported)
    MAX_BATCH, PRIME_BATCH, BatchTraces, largest_batch)
from zero_repro.scale.dryrun import allocator as A
from zero_repro.scale.dryrun.dryrun import build_events, dry_run
from zero_repro.scale.dryrun.stack import categories as K
from zero_repro.scale.dryrun.stack import switches as S
from zero_repro.scale.hardware import Hardware
from zero_repro.runtime.zero.ledger import is_host
from zero_repro.scale.paper.table1 import model_state_bytes, offload_bytes

log = logging.getLogger(__name__)

GB = 1e9
# DeepSpeed's default fused-buffer sizes (DeepSpeed@0.19.8 deepspeed/runtime/zero/config.py:
# reduce_bucket_size and allgather_bucket_size 5e8 elements): what a practitioner's run uses
BUCKET = 500_000_000
# ZeRO-R settings (paper §6, Table 3's columns): activation checkpointing with C_B and M_D (C1 /
# C3), + P_a (C2 / C4), + P_a+cpu (C5), or no checkpointing (C_B, M_D for gradients only)
ZERO_R = {
    "ckpt": dict(activation_checkpointing=True, constant_buffers=True, contiguous_memory=True),
    "pa": dict(activation_checkpointing=True, partition_activations=True,
               constant_buffers=True, contiguous_memory=True),
    "pa_cpu": dict(activation_checkpointing=True, partition_activations=True,
                   cpu_checkpointing=True, constant_buffers=True, contiguous_memory=True),
    "none": dict(activation_checkpointing=False, constant_buffers=True, contiguous_memory=True),
}
# what holds the bytes at the live peak, from the dry run's categories (stack.categories)
PARTS = ("model_states", "gathered_params", "buffers", "activations", "other")
_PART_OF = {S.FP16_PARAMS: "model_states", S.MASTER_ADAM: "model_states",
            S.GRAD_PARTITION: "model_states", S.BUCKETS: "buffers", S.GATHER: "buffers",
            S.CHECKPOINTS: "activations", S.WORKING_LAYER: "activations",
            S.LOGITS_LOSS: "activations"}


def zero_r_name(name: str, tp: int) -> str:
    """``auto``: P_a when TP > 1 (it partitions checkpoints over the TP ranks), else plain
    checkpointing with C_B and M_D."""
    if name == "auto":
        return "pa" if tp > 1 else "ckpt"
    if name == "selective":  # every k-th block checkpointed (module doc)
        return name
    if name not in ZERO_R:
        raise ValueError(f"zero_r={name!r}: choose auto, selective or one of {sorted(ZERO_R)}")
    if name in ("pa", "pa_cpu") and tp == 1:
        raise ValueError(f"zero_r={name} partitions checkpoints over TP ranks: it needs tp > 1")
    return name


def stage_config(base: C.Config, stage: int, zero_r: str, batch: int,
                 offload: str | None = None, shard_size: str | None = None) -> C.Config:
    """``base`` at ZeRO ``stage``, ZeRO-R setting ``zero_r`` (``ZERO_R``), micro-batch ``batch``,
    DeepSpeed's bucket sizes unless ``base`` sets others, the offload mode ``offload``
    (``C.OFFLOAD_MODES``: ``zero.offload_optimizer`` and, at stage 3, ``zero.offload_param``;
    None: ``base``'s), ``zero.shard_size`` ``shard_size`` at stages 1-3 (None: ``base``'s)
    (validated)."""
    z = dataclasses.replace(base.zero, stage=stage)
    if shard_size is not None:
        z = dataclasses.replace(z, shard_size=str(shard_size) if stage else "all")
    if offload is not None:
        opt, par = C.OFFLOAD_MODES[offload]
        z = dataclasses.replace(z, offload_optimizer=opt,
                                offload_param=par if stage == 3 else "none")
    zr = C.ZeroRConfig(name="custom", **ZERO_R[zero_r])
    t = dataclasses.replace(base.train, micro_batch_size=batch)
    return validation.validate(dataclasses.replace(base, zero=z, zero_r=zr, train=t))


# ------------------------------------------------------------------------------ memory
def memory_picture(events: list, rep: int | None, category_of: dict, ledger: dict,
                   stage: int) -> dict:
    """Bytes by ``PARTS`` at the training live peak of a judged trace (its repeated step
    written out once more: the steady state) and the live peak."""
    steady = events + events[rep:] if rep is not None else events
    live, best, at = 0, -1, 0
    for i, e in enumerate(steady):
        live += e[2] if e[0] == "alloc" else -e[2]
        if live > best:
            best, at = live, i + 1
    cats = K.live_by_category(steady, category_of, at)
    parts = dict.fromkeys(PARTS, 0)
    for cat, nbytes in cats.items():
        parts[_PART_OF.get(cat, "other")] += nbytes
    # stage 3: the lp parameters beyond the own shard are gathered units
    own, lp = ledger.get("params_lp", 0), cats.get(S.FP16_PARAMS, 0)
    if stage == 3 and lp > own:
        parts["gathered_params"] += lp - own
        parts["model_states"] -= lp - own
    return {"parts": parts, "live_peak": best, "categories": cats}


# ------------------------------------------------------------------------------ time
workload = T.workload  # the performance models' view of a config (``estimate_time``)
performance = T.performance


# ------------------------------------------------------------------------------ one stage
@dataclass
class StageEstimate:
    stage: int
    zero_r: str
    batch: int  # the requested micro-batch
    n_d: int
    psi_rank: int  # this rank's parameters (TP shard, exact)
    psi_padded: int  # elements of this rank's flat buffers
    table1: float  # Table 1's closed form at Ψ = param_count / tp, bytes
    model_states: int  # the dry run's ledger (Table 1 at Ψ_padded)
    parts: dict  # PARTS -> bytes at the live peak
    live_peak: int
    peak_reserved: int  # judged replay, steady state, no capacity
    build_live_peak: int  # the build's live peak (stage 3: the largest unit + the shards)
    capacity: float  # bytes the allocator may use (the device less what sits outside it)
    fits: bool  # the judged replay at the capacity does not run out of memory
    max_batch: int = 0  # largest micro-batch that fits (0: not even 1)
    max_batch_method: str = ""
    perf: dict = field(default_factory=dict)  # at the requested micro-batch
    perf_max: dict = field(default_factory=dict)  # at the largest micro-batch
    seconds: dict = field(default_factory=dict)
    categories: dict = field(default_factory=dict)  # dry-run categories at the live peak
    gathered_ledger: int = 0  # stage 3: the runtime's own peak of gathered units (ledger)
    build_peak_reserved: int = 0  # the build's own replay (judged: ``fits`` covers it)
    build_fits: bool = True
    device_capacity: float = 0.0  # bytes of the device as it reports itself
    # ZeRO-Offload (zero.offload_optimizer): the host's part, per rank
    offload: str = "none"
    table1_host: float = 0.0  # Table 1's offload column, host bytes (0 without offload)
    host_bytes: int = 0  # the dry run's ledger: host categories (offloaded optimizer, P_a+cpu)
    host_capacity: float = 0.0  # the host RAM a rank has (0: unknown, not judged)
    host_fits: bool = True
    device_fits: bool = True  # the device's verdict alone (``fits`` also needs the host's)
    shard_size: int = 0  # G of zero.shard_size (N_d: plain ZeRO)
    hpz: bool = False  # stage 3 with hpZ's secondary shard over a node's DP ranks
    limit: dict = field(default_factory=dict)  # the verdict with its band (``scale.limit``)

    @property
    def allocator_extra(self) -> int:
        return self.peak_reserved - self.live_peak


def prime_trace(cfg: C.Config, rank: int = 0, transport_of: str = "fake"
                ) -> tuple[BatchTraces, object]:
    """(the judged trace at any micro-batch, the dry run) of ``cfg`` from one dry run of rank
    ``rank`` at b = ``PRIME_BATCH`` (``dryrun.dry_run``'s ``transport_of``: whose bucket
    transport the buffers follow; ``fake`` for GPU clusters)."""
    at_p = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train,
                                                              micro_batch_size=PRIME_BATCH))
    r = dry_run(at_p, rank=rank, iterations=2, keep_trace=True, details=False,
                transport_of=transport_of)
    return BatchTraces.from_prime(r.judged_events(), r.category_of), r


def _stage_memory(cfg_dict: dict, search: bool, rank: int = 0,
                  transport_of: str = "fake", judge: dict | None = None) -> dict:
    """One stage's memory at ``cfg``'s micro-batch b0 (module level: runs in a helper
    process): the judged trace written at b0 (picture, verdict, peak reserved) from one dry
    run (``prime_trace``) and the largest micro-batch that fits (judged replays of the trace
    written at each candidate). ``judge`` (module doc): ``outside`` bytes off the device,
    ``extra`` bytes per sample (unfused attention), ``none_cfg`` and ``frac`` (selective
    checkpointing: a second dry run, interpolated)."""
    judge = judge or {}
    held = int(judge.get("held", 0))  # hpZ's secondary shard (closed form, module doc)
    cfg = schema.to_config(cfg_dict)
    b0 = cfg.train.micro_batch_size
    t0, cpu0 = time.perf_counter(), time.process_time()
    bt, r = prime_trace(cfg, rank, transport_of)
    alt = (prime_trace(schema.to_config(judge["none_cfg"]), rank, transport_of)
           if judge.get("none_cfg") else None)
    t1 = time.perf_counter()
    ev = bt.events(b0)
    pic = _picture(bt, r, cfg.zero.stage, b0, alt, judge)
    reserved = _reserved(bt, b0, alt, judge)
    cap = r.capacity - judge.get("outside", 0) - held if r.capacity else None
    # the build judged on its own (it holds no activations: the same at every micro-batch);
    # a model whose build does not fit fits at no micro-batch
    build = A.replay(build_events(r.trace, r.host_sids), capacity=cap)
    fits_steps = _fits(bt, alt, cap, judge)

    def fits(b: int) -> bool:
        return not build.oom and fits_steps(b)

    fits0 = cap is None or fits(b0)
    best, n = 0, 0
    if search and cap is not None and not build.oom:
        # seed: the live peak is affine in b (model states + b x activations)
        slope = max(1, _picture(bt, r, cfg.zero.stage, b0 + 1, alt, judge)["live_peak"]
                    - pic["live_peak"])
        seed = b0 + int((cap - reserved) // slope)
        best, n = largest_batch(fits, b0, fits0, seed)
    if held:
        pic["parts"]["model_states"] += held
        pic["live_peak"] += held
    return {"psi": r.psi, "psi_padded": r.psi_padded, "model_states": r.model_state_bytes + held,
            "host_bytes": sum(v for k, v in r.ledger.items() if is_host(k)),
            "ledger": {k: v for k, v in r.ledger.items()},
            "capacity": cap + held if cap else 0.0, "device_capacity": r.capacity, **pic,
            "peak_reserved": reserved + held, "fits": fits0, "max_batch": best,
            "judgements": n, "build_live_peak": r.live_peak_by_phase.get("build", 0),
            "build_peak_reserved": build.peak_reserved, "build_fits": not build.oom,
            "seconds": {"dry_run_s": t1 - t0, "search_s": time.perf_counter() - t1,
                        "cpu_s": time.process_time() - cpu0, "pid": os.getpid(),
                        "n_events": len(ev), "n_ops": r.n_ops}}


def _interp(every: float, none: float, frac: float) -> float:
    """The value with a fraction ``frac`` of the blocks checkpointed (module doc)."""
    return frac * every + (1.0 - frac) * none


def _picture(bt: BatchTraces, r, stage: int, b: int, alt, judge: dict) -> dict:
    """``memory_picture`` at micro-batch b: interpolated with the no-checkpoint dry run
    ``alt`` (selective), plus the unfused attention's bytes (``judge``, module doc)."""
    pic = memory_picture(bt.events(b), bt.rep, r.category_of, r.ledger, stage)
    if alt is not None:
        p2 = memory_picture(alt[0].events(b), alt[0].rep, alt[1].category_of, alt[1].ledger,
                            stage)
        f = judge["frac"]
        cats = set(pic["categories"]) | set(p2["categories"])
        pic = {"parts": {k: int(_interp(pic["parts"][k], p2["parts"][k], f)) for k in PARTS},
               "categories": {k: int(_interp(pic["categories"].get(k, 0),
                                             p2["categories"].get(k, 0), f)) for k in cats}}
        pic["live_peak"] = sum(pic["parts"].values())
    extra = int(judge.get("extra", 0) * b)
    if extra:
        pic["parts"]["activations"] += extra
        pic["live_peak"] += extra
    return pic


def _reserved(bt: BatchTraces, b: int, alt, judge: dict) -> int:
    """Peak reserved of the judged replay at micro-batch b, steady state, no capacity
    (interpolated and with the unfused attention's bytes as ``_picture``)."""
    res = A.replay(bt.events(b), capacity=None, repeat_from=bt.rep).peak_reserved
    if alt is not None:
        other = A.replay(alt[0].events(b), capacity=None, repeat_from=alt[0].rep).peak_reserved
        res = int(_interp(res, other, judge["frac"]))
    return res + int(judge.get("extra", 0) * b)


def _fits(bt: BatchTraces, alt, cap: float | None, judge: dict):
    """b -> whether micro-batch b fits: the judged replay at the capacity less the unfused
    attention's bytes; selective: the interpolated peak reserved within the capacity."""
    if cap is None:
        return lambda b: True
    if alt is None:
        return lambda b: bt.fits(b, cap - judge.get("extra", 0) * b)
    return lambda b: _reserved(bt, b, alt, judge) <= cap


def _cfg_dict(cfg: C.Config) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)


def _stage_result(cfg: C.Config, zr: str, mem: dict, search: bool, hw: Hardware,
                  params, timing: T.Timing, hpz: bool = False) -> StageEstimate:
    p = cfg.parallel
    n_d = p.world_size // p.tp
    psi_tp = flops.param_count(cfg.model, p.tp) / p.tp
    opt, par = cfg.zero.offload_optimizer, cfg.zero.offload_param
    off = {v: k for k, v in C.OFFLOAD_MODES.items()}[(opt, par)]
    lp = 4 if cfg.zero.dtype == "fp32" else 2
    g, hpz = T.shard_of(cfg) or n_d, hpz and cfg.zero.stage == 3
    table1 = (offload_bytes(psi_tp, cfg.zero.stage, n_d, lp_bytes=lp, optimizer=opt, param=par)
              if off != "none" else
              {"device": model_state_bytes(psi_tp, cfg.zero.stage, n_d, shard_size=g,
                                           hpz_size=shard_choice.per_node(cfg) if hpz else None),
               "host": 0.0})
    host_fits = not hw.host_bytes or mem["host_bytes"] <= hw.host_bytes
    est = StageEstimate(
        stage=cfg.zero.stage, zero_r=zr, batch=cfg.train.micro_batch_size, n_d=n_d,
        psi_rank=mem["psi"], psi_padded=mem["psi_padded"],
        table1=table1["device"], table1_host=table1["host"], offload=off,
        host_bytes=mem["host_bytes"], host_capacity=hw.host_bytes, host_fits=host_fits,
        device_fits=mem["fits"],
        model_states=mem["model_states"], parts=mem["parts"], live_peak=mem["live_peak"],
        peak_reserved=mem["peak_reserved"], build_live_peak=mem["build_live_peak"],
        build_peak_reserved=mem["build_peak_reserved"], build_fits=mem["build_fits"],
        capacity=mem["capacity"], fits=mem["fits"] and host_fits,
        max_batch=mem["max_batch"] if host_fits else 0,
        max_batch_method=(f"judged replays of the dry run's trace written at each micro-batch "
                          f"(one dry run per stage at b = {PRIME_BATCH})" if search
                          else "not searched"),
        seconds={**mem["seconds"], "search_judgements": mem["judgements"]},
        categories=mem["categories"], gathered_ledger=mem["ledger"].get("params_gathered", 0),
        device_capacity=mem["device_capacity"], shard_size=g, hpz=hpz)
    est.perf = performance(cfg, hw, params, timing, zr, hpz=hpz)
    if est.max_batch:
        at_max = dataclasses.replace(cfg, train=dataclasses.replace(
            cfg.train, micro_batch_size=est.max_batch))
        est.perf_max = performance(at_max, hw, params, timing, zr, hpz=hpz)
    return est


# ------------------------------------------------------------------------------ the estimate
@dataclass
class Estimate:
    model: dict  # name, family, shape, Ψ (exact, TP 1), nominal
    cluster: dict  # name, device bytes, capacity, GPUs per node, peak, links
    world_size: int
    tp: int
    batch: int
    seq: int
    dtype: str
    zero_r: str
    stages: list  # StageEstimate per stage
    recommendation: tuple  # (stage or None, reason)
    perf_params: dict
    seconds: float  # wall
    workers: int
    cpu: dict = field(default_factory=dict)  # CPU seconds: parent, per helper process
    timing: dict = field(default_factory=dict)  # the time model and its switches
    outside: dict = field(default_factory=dict)  # bytes outside the allocator, low/mid/high
    offload: str = "none"  # the offload mode of every stage (``C.OFFLOAD_MODES``)
    shard_size: str = "all"  # zero.shard_size of stages 1-3
    hpz: bool = False  # stage 3 with hpZ
    choices: list = field(default_factory=list)  # shard_choice.Choice per (stage, G, hpZ)
    hierarchy: tuple = (None, "")  # (the best Choice, why) of ``choices``
    stack: str = "modern"  # the software stack assumed (``scale.era``)


def recommend(stages: list[StageEstimate]) -> tuple[int | None, str]:
    """The smallest stage that fits at the requested micro-batch, unless the next one fits a
    larger micro-batch that is faster (tokens/s, each at its largest micro-batch)."""
    ok = [s for s in sorted(stages, key=lambda s: s.stage) if s.fits]
    if not ok:
        best = max(stages, key=lambda s: s.stage)
        if not best.host_fits:
            return None, (f"no stage fits micro-batch {best.batch}: stage {best.stage}'s host "
                          f"needs {best.host_bytes / GB:.1f} GB of {best.host_capacity / GB:.1f}"
                          f" GB per rank; add GPUs (the host part is 1/N_d) or hosts")
        return None, (f"no stage fits micro-batch {best.batch}: stage {best.stage} needs "
                      f"{best.peak_reserved / GB:.1f} GB of {best.capacity / GB:.1f} GB; "
                      f"raise TP, add GPUs, or offload (zero.offload_optimizer=cpu, P_a+cpu)")
    pick = ok[0]
    why = (f"stage {pick.stage} is the smallest stage that fits micro-batch {pick.batch} "
           f"({pick.peak_reserved / GB:.1f} of {pick.capacity / GB:.1f} GB)")
    for nxt in ok[1:]:
        if nxt.stage != pick.stage + 1:
            break
        a, b = pick.perf_max.get("tokens_per_s"), nxt.perf_max.get("tokens_per_s")
        if nxt.max_batch <= pick.max_batch:
            why += (f"; stage {nxt.stage} fits no larger micro-batch ({nxt.max_batch} vs "
                    f"{pick.max_batch})")
            break
        if a is None or b is None or b <= a:
            if a is not None and b is not None:
                why += (f"; stage {nxt.stage} fits micro-batch {nxt.max_batch} (vs "
                        f"{pick.max_batch}) but is not faster ({b:,.0f} vs {a:,.0f} tokens/s)")
            break
        why += (f"; stage {nxt.stage} fits micro-batch {nxt.max_batch} instead of "
                f"{pick.max_batch} and runs {b / a - 1:.0%} faster there ({b:,.0f} vs "
                f"{a:,.0f} tokens/s)")
        pick = nxt
    return pick.stage, why


def _pool(workers: int):
    if workers <= 1:
        return None
    methods = multiprocessing.get_all_start_methods()
    # fork: the helpers start without importing torch again (nothing here has started
    # threads yet: meta tensors run no kernels)
    ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    return cf.ProcessPoolExecutor(workers, mp_context=ctx)


def offload_stages(stages, offload: str, n_d: int) -> tuple:
    """The stages that run with offload mode ``offload``: stage 0 offloads the optimizer on one
    DP rank only; the parameters offload at stage 3 only (mode ``param``)."""
    opt, par = C.OFFLOAD_MODES[offload]
    return tuple(s for s in stages if not (opt == "cpu" and s == 0 and n_d > 1)
                 and not (par == "cpu" and opt == "none" and s != 3))


def estimate(base: C.Config, stages=(0, 1, 2, 3), zero_r: str = "auto", search: bool = True,
             workers: int | None = None, perf_params: perf_model.PerfParams | None = None,
             timing: T.Timing | None = None, offload: str | None = None,
             shard_size: str | None = None, hpz: bool = False) -> Estimate:
    """Every stage of ``stages`` for ``base`` (model, parallel, train.micro_batch_size,
    zero.dtype and buckets, cluster: a CUDA cluster with device memory; module docstring).
    ``timing``: the time model (default: modern, or paper2020 when ``perf_params`` is given).
    ``offload``: the offload mode of every stage (``C.OFFLOAD_MODES``; None: ``base``'s; the
    stages a mode cannot run are left out, ``offload_stages``). ``shard_size``: the
    ``zero.shard_size`` of stages 1-3 (None: ``base``'s); ``hpz``: stage 3 with hpZ, its
    primary partition over every DP rank (module doc)."""
    t0, cpu0 = time.perf_counter(), time.process_time()
    if offload is None:
        offload = {v: k for k, v in C.OFFLOAD_MODES.items()}[
            (base.zero.offload_optimizer, base.zero.offload_param)]
    base = dataclasses.replace(base, zero=dataclasses.replace(
        base.zero, offload_optimizer="none", offload_param="none"))
    stages = offload_stages(stages, offload, base.parallel.world_size // base.parallel.tp)
    if not stages:
        raise ValueError(f"no stage to estimate with offload {offload}: stage 0 offloads on "
                         f"one DP rank only, the parameters at stage 3 only")
    zr = zero_r_name(zero_r, base.parallel.tp)
    if base.cluster.device_memory_gb <= 0:
        raise ValueError("the estimate needs the device memory: choose a cluster with "
                         "device_memory_gb or give it")
    timing = timing or T.Timing(model="paper2020" if perf_params else "modern")
    b0 = base.train.micro_batch_size
    full = zero_r_name("auto", base.parallel.tp) if zr == "selective" else zr
    stack = era.stack_of(timing.model)
    # hpZ's primary partition is over every DP rank: stage 3 at G = all
    cfgs = {s: era.with_stack(stage_config(base, s, full, b0, offload,
                                           "all" if hpz and s == 3 else shard_size), stack)
            for s in stages}
    judges, outside = _judges(base, stages, zr, timing, offload)
    if hpz and 3 in stages:
        judges[3]["held"] = shard_choice.hpz_bytes(cfgs[3])
    workers = min(2, os.cpu_count() or 1) if workers is None else workers
    hw = T.hardware_for(base)
    params = perf_params or (calibrate.calibration().params if timing.model == "paper2020"
                             else None)
    pool = _pool(workers)
    mems: dict = {}
    try:
        # one dry run per stage at b = PRIME_BATCH, stage 3 (the slowest) first
        order = sorted(stages, key=lambda s: -s)
        # the buffers of the transport the cluster's ranks use: NCCL's native one on GPUs
        # (two fused gradient buckets + reduce-scatter scratch), the rooted one otherwise
        transport = "native" if base.cluster.device == "cuda" else "fake"
        args = {s: (_cfg_dict(cfgs[s]), search, 0, transport, judges[s]) for s in order}
        if pool is None:
            mems = {s: _stage_memory(*args[s]) for s in order}
        else:
            futs = {s: pool.submit(_stage_memory, *args[s]) for s in order}
            mems = {s: f.result() for s, f in futs.items()}
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    out = [_stage_result(cfgs[s], zr, mems[s], search, hw, params, timing, hpz) for s in stages]
    limit.judge_stages(out, outside, stack)
    chs, best = shard_choice.for_estimate(out, cfgs, hw, params, timing, zr, base)
    m, c = base.model, base.cluster
    return Estimate(
        model={"name": m.name, "family": m.family, "n_layer": m.n_layer, "hidden": m.n_embd,
               "heads": m.n_head, "kv_heads": C.kv_heads(m), "ffn": C.ffn_width(m),
               "vocab": m.vocab_size, "params": flops.param_count(m, padded=False),
               "nominal": m.nominal},
        cluster={"name": c.name, "device_bytes": c.device_memory_gb * GB,
                 "gpus_per_node": c.gpus_per_node, "peak_tflops": c.peak_tflops,
                 "intra_node_gbps": c.intra_node_gbps, "inter_node_gbps": c.inter_node_gbps,
                 "pcie_gbps": c.pcie_gbps, "host_bytes": hw.host_bytes,
                 "host_cores": hw.host_cores, "host_memory_gbps": hw.host_mem_bw / GB,
                 "host_core_rate": OT.core_rate(hw.host_lanes, hw.host_clock),
                 "host_lanes": hw.host_lanes, "host_ghz": [f / 1e9 for f in hw.host_clock]},
        world_size=base.parallel.world_size, tp=base.parallel.tp, batch=b0, seq=m.seq_len,
        dtype=base.zero.dtype, zero_r=zr, stages=out, recommendation=recommend(out),
        perf_params=dataclasses.asdict(params) if params else {},
        seconds=time.perf_counter() - t0, workers=workers, cpu=_cpu(mems, cpu0, pool is not None),
        timing={**dataclasses.asdict(timing), "gpu": T.gpu_of(c, timing.gpu)
                if timing.model == "modern" else ""}, outside=outside, offload=offload,
        shard_size=str(shard_size or base.zero.shard_size), hpz=hpz, choices=chs,
        hierarchy=best, stack=stack)


def _judges(base: C.Config, stages, zr: str, timing: T.Timing, offload: str = "none"
            ) -> tuple[dict, dict]:
    """Per stage what the modern stack changes in the memory judgement (``_stage_memory``'s
    ``judge``), and the bracket outside the allocator ({} for paper2020 or no GPU named)."""
    gpu = T.gpu_of(base.cluster, timing.gpu) if timing.model == "modern" else ""
    outside, judge = {}, {}
    if gpu:
        comms = 1 + (base.parallel.tp > 1)  # the DP group, + the TP group
        outside = outside_modern.bracket(gpus.gpu(gpu).gen, comms,
                                         base.cluster.gpus_per_node, gpus.gpu(gpu).nvlink)
        judge["outside"] = outside["mid"]
        frac = modern_step.recompute_fraction(modern_step.Modern(ac=T.ac_of(zr),
                                                                 every=timing.every))
        if timing.attention == "unfused":
            m, t = base.model, base.parallel.tp
            judge["extra"] = m.n_head / t * m.seq_len ** 2 * (2 * m.n_layer * (1 - frac) + 6)
    judges = {s: dict(judge) for s in stages}
    if zr == "selective":
        for s in stages:
            judges[s].update(none_cfg=_cfg_dict(stage_config(
                base, s, "none", base.train.micro_batch_size, offload)), frac=1.0 / timing.every)
    return judges, outside


def _cpu(mems: dict, cpu0: float, pooled: bool) -> dict:
    """CPU seconds of the estimate: this process's (the stages' too when run here) and each
    helper's; with 2 idle cores the wall time is about parent + the busiest helper."""
    per: dict = {}
    for m in mems.values():
        if pooled:
            pid = str(m["seconds"]["pid"])
            per[pid] = per.get(pid, 0.0) + m["seconds"]["cpu_s"]
    return {"parent_s": time.process_time() - cpu0, "helpers_s": per,
            "critical_s": time.process_time() - cpu0 + max(per.values(), default=0.0)}


def bandwidth_sweep(base: C.Config, stages, zero_r: str, gbps,
                    perf_params: perf_model.PerfParams | None = None,
                    timing: T.Timing | None = None) -> dict:
    """Step time (s) per stage at each inter-node bandwidth in ``gbps`` (Gbit/s per node), the
    rest of ``base``'s cluster as it is (``estimate_time``; memory does not depend on it)."""
    timing = timing or T.Timing(model="paper2020" if perf_params else "modern")
    zr = zero_r_name(zero_r, base.parallel.tp)
    full = zero_r_name("auto", base.parallel.tp) if zr == "selective" else zr
    cfgs = {s: stage_config(base, s, full, base.train.micro_batch_size) for s in stages}
    return T.bandwidth_sweep(cfgs, gbps, perf_params, timing, zr)


def closed_form(psi: float, n_d: int, offload: str = "none", shard_size: int | None = None,
                hpz_size: int | None = None) -> dict:
    """Table 1's model states per GPU (bytes) at Ψ parameters, K = 12, for stages 0-3 (stages
    1-3 over ``shard_size`` G ranks; stage 3 with hpZ's secondary over ``hpz_size``); with an
    offload mode (``C.OFFLOAD_MODES``) the device's part (the offload column,
    ``table1.offload_bytes``; the parameters at stage 3 only)."""
    if offload == "none":
        return {s: model_state_bytes(psi, s, n_d, shard_size=None if hpz_size and s == 3
                                     else shard_size, hpz_size=hpz_size if s == 3 else None)
                for s in range(4)}
    opt, par = C.OFFLOAD_MODES[offload]
    return {s: offload_bytes(psi, s, n_d, optimizer=opt, param=par if s == 3 else "none")
            ["device"] for s in range(4)}


def dp_volume(psi: float, stage: int) -> float:
    """Elements per rank and step over DP (§7): 2Ψ (stages 0-2), 3Ψ (stage 3)."""
    return (3 if stage == 3 else 2) * psi


__all__ = ["BatchTraces", "Estimate", "StageEstimate", "ZERO_R", "bandwidth_sweep",
           "closed_form", "estimate", "largest_batch", "memory_picture", "performance",
           "prime_trace", "recommend", "stage_config", "workload"]
