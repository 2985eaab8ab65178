"""Largest trainable model judged by the dry run (paper §10.5 Figure 6, Table 2 "measured").

The question "does a model of l layers (hidden h fixed, the paper's Table 7 families) train on
a device of C bytes" is answered by running the real runtime on fake tensors
(``simulate.dryrun``) and replaying its allocation trace through the caching-allocator model
with capacity C: the model fits iff that replay never runs out of memory (after releasing
cached segments, as PyTorch does before raising "CUDA out of memory").

Search: memory per rank is affine in l to a very good approximation (model states and
checkpoints grow linearly, working memory does not), so two cheap dry runs at small l give a
seed ``l* = l_a + (C - M(l_a)) / slope`` (M = the allocator model's peak allocated bytes); the
dry run at full size then decides, and secant steps through the judged points close the
bracket [fits, does not fit] (each judgement a full dry run; results are memoised). The analytic model (``measure.analytic``) is the fallback seed. Returns the
largest l that fits and its parameter count ``flops.param_count`` (padded vocabulary, TP 1).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

from zero_repro import config as C

log = logging.getLogger(__name__)

# paper harness bucket sizes (REFERENCE.md, DeepSpeedExamples hyperscale scripts, inferred):
# reduce 5e8, all-gather 2e8 elements. Used by the paper-scale memory experiments.
PAPER_BUCKETS = {"zero.reduce_bucket_size": 500_000_000,
                 "zero.allgather_bucket_size": 200_000_000}


def paper_overrides(n_layer: int, hidden: int, heads: int, gpus: int, mp: int, batch: int,
                    zero_config: str, seq: int = 1024, vocab: int = 50257) -> dict:
    """Dotted config overrides for one paper setup (fp16, Table 3 configuration C1..C5)."""
    from zero_repro.zero_r.configs import TABLE3

    zc = zero_config.lower()
    row = TABLE3[zc]
    return {"model.name": f"gpt_{n_layer}x{hidden}", "model.n_layer": n_layer,
            "model.n_embd": hidden, "model.n_head": heads, "model.seq_len": seq,
            "model.vocab_size": vocab, "model.vocab_pad_multiple": 128, "model.dropout": 0.0,
            "parallel.world_size": gpus, "parallel.tp": mp, "zero.stage": row.stage,
            "zero.dtype": "fp16", "zero_r.name": zc,
            "zero_r.activation_checkpointing": row.activation_checkpointing,
            "zero_r.partition_activations": row.partition_activations,
            "zero_r.cpu_checkpointing": row.cpu_checkpointing,
            "zero_r.constant_buffers": row.constant_buffers,
            "zero_r.contiguous_memory": row.contiguous_memory,
            "train.micro_batch_size": batch, "train.grad_accum": 1}


def apply_overrides(cfg: C.Config, overrides: dict) -> C.Config:
    from omegaconf import OmegaConf

    base = OmegaConf.structured(cfg)
    for k, v in overrides.items():
        OmegaConf.update(base, k, v, merge=False)
    return C.validate(C.to_config(base))


def capacity_of(cfg: C.Config) -> float:
    cap = cfg.cluster.device_memory_gb * 1e9
    if cap <= 0:
        raise ValueError(f"cluster {cfg.cluster.name!r} has no device_memory_gb: choose a "
                         f"cluster with a device size (e.g. cluster=dgx2_v100)")
    return cap


@dataclass
class Judgement:
    n_layer: int
    fits: bool
    peak_reserved: int  # replay with the capacity (<= capacity unless it ran out)
    peak_allocated: int  # allocator model, rounded blocks
    peak_live: int  # exact live bytes, last iteration
    ledger_model_states: int
    seconds: float


@dataclass
class MaxSizeResult:
    n_layer: int  # largest number of layers that fits (0: not even one)
    params: int  # parameter count of that model (TP 1, padded vocabulary)
    capacity: float
    seed: int
    seed_from: str  # "probe" (two small dry runs) | "analytic"
    judgements: list = field(default_factory=list)  # Judgement, in evaluation order
    seconds: float = 0.0

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        return d


class DryRunJudge:
    """``judge(n_layer) -> bool``: the dry run at that depth fits ``capacity``. Memoised."""

    def __init__(self, cfg: C.Config, capacity: float, iterations: int = 2):
        self.cfg, self.capacity, self.iterations = cfg, capacity, iterations
        self.memo: dict[int, Judgement] = {}
        self.order: list[Judgement] = []

    def run(self, n_layer: int, capacity: float | None):
        from zero_repro.simulate.dryrun import dry_run

        cfg = dataclasses.replace(self.cfg, model=dataclasses.replace(self.cfg.model,
                                                                        n_layer=n_layer))
        return dry_run(cfg, iterations=self.iterations, keep_trace=False,
                       allocator_capacity=capacity)

    def __call__(self, n_layer: int) -> bool:
        if n_layer in self.memo:
            return self.memo[n_layer].fits
        t0 = time.perf_counter()
        res = self.run(n_layer, self.capacity)
        a = res.allocator
        j = Judgement(n_layer, not a["oom"], a["peak_reserved"], a["peak_allocated"],
                      res.live_peak_by_iteration.get(max(res.live_peak_by_iteration, default=0),
                                                     0),
                      res.model_state_bytes, time.perf_counter() - t0)
        self.memo[n_layer] = j
        self.order.append(j)
        log.info("dry-run judge: %d layers -> %s (reserved %.2f GB, %.1f s)", n_layer,
                 "fits" if j.fits else "OOM", j.peak_reserved / 1e9, j.seconds)
        return j.fits

    def probe(self, n_layer: int) -> int:
        """Peak allocated bytes (allocator model) at a small depth, for the seed."""
        return self.run(n_layer, None).allocator["peak_allocated"]


def _analytic_seed(cfg: C.Config, capacity: float) -> int:
    from zero_repro.measure import analytic

    m, p = cfg.model, cfg.parallel
    zr = cfg.zero_r
    mc = analytic.MemConfig(stage=cfg.zero.stage, checkpointing=zr.activation_checkpointing,
                            p_a=zr.partition_activations, cpu=zr.cpu_checkpointing,
                            c_b=zr.constant_buffers, m_d=zr.contiguous_memory)
    n, _ = analytic.max_model_size(capacity, mc, p.tp, p.world_size // p.tp,
                                   cfg.train.micro_batch_size, m.n_embd, m.n_head,
                                   seq=m.seq_len, vocab=m.vocab_size)
    return max(n, 1)


def max_layers(cfg: C.Config, capacity: float | None = None, probes: tuple[int, int] = (2, 6),
               max_n: int = 2000, iterations: int = 2) -> MaxSizeResult:
    """Largest ``model.n_layer`` (hidden, heads and everything else from ``cfg``) whose dry run
    fits ``capacity`` bytes (default: the cluster's device memory)."""
    from zero_repro.model import flops

    t0 = time.perf_counter()
    cap = capacity_of(cfg) if capacity is None else capacity
    judge = DryRunJudge(cfg, cap, iterations)
    points: list[tuple[int, float]] = []
    try:
        a, b = probes
        ma, mb = judge.probe(a), judge.probe(b)
        points = [(a, ma), (b, mb)]
        slope = (mb - ma) / (b - a)
        seed, seed_from = int(a + (cap - ma) // slope), "probe"
        if slope <= 0:
            raise ValueError("memory does not grow with depth")
    except (ValueError, ZeroDivisionError) as e:
        log.warning("probe seed failed (%s); using the analytic seed", e)
        seed, seed_from = _analytic_seed(cfg, cap), "analytic"
    seed = min(max(seed, 1), max_n)
    n = _search(judge, seed, max_n, points, cap)
    params = flops.param_count(dataclasses.replace(cfg.model, n_layer=n)) if n else 0
    return MaxSizeResult(n, params, cap, seed, seed_from, list(judge.order),
                         time.perf_counter() - t0)


def _search(judge, seed: int, max_n: int, points: list[tuple[int, float]] | None = None,
            capacity: float | None = None) -> int:
    """Largest n in [0, max_n] with judge(n) true (monotone judge), starting at ``seed``.

    Secant steps on the judged peak allocated bytes (memory is ~affine in n) pick the next
    depth inside the open bracket (lo fits, hi does not); each judged depth shrinks it, so the
    search ends, usually after 2-4 full dry runs."""
    pts = list(points or [])
    lo, hi, n = 0, max_n + 1, seed
    while hi - lo > 1:
        n = min(max(n, lo + 1), hi - 1)
        ok = judge(n)
        if ok:
            lo = n
        else:
            hi = n
        memo = getattr(judge, "memo", {})
        if capacity is None or n not in memo:
            n = (lo + hi) // 2
            continue
        pts = [p for p in pts if p[0] != n] + [(n, memo[n].peak_allocated)]
        (n1, p1), (n2, p2) = sorted(pts)[-2:] if len(pts) > 1 else ((0, 0.0), pts[0])
        slope = (p2 - p1) / (n2 - n1) if n2 != n1 else 0.0
        est = n + int((capacity - memo[n].peak_allocated) // slope) if slope > 0 else n
        # the estimate, nudged off the bracket end just judged so the bracket always shrinks
        n = est if lo < est < hi else (lo + 1 if ok else hi - 1)
    return lo


def cluster_overrides(name: str) -> dict:
    """The device facts of ``conf/cluster/<name>.yaml`` the memory dry run needs, as overrides
    (device and backend stay local: a dry run runs on this machine with the fake backend)."""
    from zero_repro.simulate.hardware import load_cluster

    c = load_cluster(name)
    return {"cluster.name": c.name, "cluster.device_memory_gb": c.device_memory_gb,
            "cluster.gpus_per_node": c.gpus_per_node}


def setup_overrides(s, cluster: str, buckets: dict | None = None) -> dict:
    """Overrides for a ``simulate.paper_setups.PaperSetup`` on ``cluster``."""
    return {**paper_overrides(s.n_layer, s.hidden, s.heads, s.gpus, s.mp, s.batch_per_gpu,
                              s.zero_config),
            **(PAPER_BUCKETS if buckets is None else buckets), **cluster_overrides(cluster)}
