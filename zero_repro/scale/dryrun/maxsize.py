"""Largest trainable model judged by the dry run (paper §10.5 Figure 6, Table 2 "measured").

``max_layers(cfg, capacity)``: the largest depth l (hidden, heads and the rest from ``cfg``, the
paper's Table 7 families) that trains on a device of C bytes. Depth l fits iff the steady-state
replay of its dry run's trace (``zero_repro.scale.dryrun.dryrun``) through the caching-allocator
model never runs out of memory at C (after releasing cached segments, as PyTorch does before
raising); M(l), the smallest such capacity (``allocator.min_capacity``), decides: fits iff
M(l) <= C.

Search: two probes (``probe_depths``) seed l* = l_b + (C - M(l_b)) / slope (M is close to
affine in l once the gradient buckets are full); the depth search (``scale.dryrun.depth_search``:
secant steps, the end game, and the reported answer, the paper's increasing sweep) picks the
depths the judge dry-runs (``n_layer``; ``scan`` judges a range). The analytic model
(``zero_repro.scale.analytic``) is logged beside the seed and is the fallback. Returns the depth
and its ``flops.param_count`` (padded vocabulary, TP 1); judgements are memoised per process,
and across processes and experiments where a ``store`` is given (``lab.judged``). One trace
serves every stack that runs the same program (``twin``: the bracket's least-memory end is
judged from paper2020's traces).
Judged trace: ``modern`` after ``empty_cache()`` following the build, the build judged by its
own replay (partitioned construction: the largest unit + the shards; ``dryrun.judge``);
``paper2020`` with its build against the device less its CUDA context + NCCL. Rounds and timings:
``results/fig6_max_model/notes.md``.
"""
from __future__ import annotations

import argparse
import atexit
import concurrent.futures as cf
import dataclasses
import json
import logging
import multiprocessing
import multiprocessing.util
import os
import time
from dataclasses import dataclass, field

from omegaconf import OmegaConf

from zero_repro import config as C
from zero_repro import schema
from zero_repro.scale import analytic
from zero_repro.runtime.model import flops
from zero_repro.scale.hardware import device_bytes
from zero_repro.scale.paper.setups import setups
from zero_repro.scale.dryrun.dryrun import (apply_overrides, dry_run, judges_with_build,
                                        setup_overrides, stack_of)
from zero_repro.scale.dryrun import twin
from zero_repro.scale.dryrun.depth_search import increasing_sweep, search
from zero_repro.scale.dryrun.stack import switches as S

log = logging.getLogger(__name__)


def capacity_of(cfg: C.Config, point: str | None = None) -> float:
    """Bytes the judge's allocator may use: the device as it reports itself
    (``scale.hardware.device_bytes``) less what the software stack (``cfg.simulate``) keeps
    outside the caching allocator (paper2020: CUDA context and NCCL buffers) at ``point`` of
    its bracket (default ``simulate.outside_point``)."""
    cap = device_bytes(cfg.cluster)
    if cap <= 0:
        raise ValueError(f"cluster {cfg.cluster.name!r} has no device memory size: choose a "
                         f"cluster with one (e.g. cluster=dgx2_v100)")
    return stack_of(cfg).capacity_bytes(cap, point or cfg.simulate.outside_point)


@dataclass
class Judgement:
    n_layer: int
    fits: bool
    peak_reserved: int  # replay with the capacity (<= capacity unless it ran out)
    peak_allocated: int  # allocator model, rounded blocks
    peak_live: int  # exact live bytes, last iteration
    ledger_model_states: int
    seconds: float  # the dry run's own wall time (it may have run as a probe or in parallel)
    build_peak_live: int = 0  # live bytes during the build (judged: see module docstring)
    # smallest capacity at which this depth's judged replay fits (allocator.min_capacity):
    # fits iff min_capacity <= capacity; the search steers on it. None: not computed (a
    # judgement of the search's end game, decided by verdicts alone: ``DryRunJudge.capacities``)
    min_capacity: int | None = None
    # the judged replay repeated the last traced step this often before the allocator's
    # state settled (steady) -- or until the OOM (allocator.replay, repeat_from)
    repeats: int = 0
    steady: bool = False


@dataclass
class MaxSizeResult:
    n_layer: int  # the increasing sweep's answer: one below its first failure (0: none fits)
    params: int  # parameter count of that model (TP 1, padded vocabulary)
    capacity: float
    seed: int
    seed_from: str  # "probe" (two small dry runs) | "analytic"
    judgements: list = field(default_factory=list)  # Judgement, in evaluation order
    seconds: float = 0.0
    analytic_seed: int = 0  # the closed-form model's answer (scale.analytic)
    probes: list = field(default_factory=list)  # [(n_layer, peak_allocated, seconds)]
    n_dry_runs: int = 0  # dry runs actually executed (probes + judgements, cache misses)
    backend: str = "meta"  # how the dry runs ran without data (dry_run's backend)
    largest_fit: int = 0  # the largest depth judged to fit with LOOKAHEAD failures above it
    sweep_start: int = 0  # the increasing sweep's start: every depth up to it taken to fit

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class DryRunJudge:
    """``judge(n_layer) -> bool``: the dry run at that depth fits ``capacity``. Memoised; one
    dry run per depth serves both a probe and a judgement (its trace is replayed again with the
    capacity), and results are shared by judges of the same configuration in this process
    (``_shared``: e.g. Table 2 and Figure 6 asking about the same setup)."""

    _shared: dict = {}  # (resolved config, iterations) -> DryRunResult; bounded below
    _SHARED_MAX = 64

    def __init__(self, cfg: C.Config, capacity: float, iterations: int = 2, store=None):
        self.cfg, self.capacity, self.iterations = cfg, capacity, iterations
        # judgements kept across processes and experiments (``get(key)`` / ``put(key, value)``,
        # ``lab.judged``): a depth judged before at this capacity is not dry-run again
        self.store = store
        self.backend = "meta"  # dry_run's default
        # paper2020: the judged replay includes the build, whose cached blocks inflate the
        # reserved-over-allocated slack but are released before an OOM; the search then steers
        # on the exact live peak instead of the allocator's peak allocated (``steer``)
        self.with_build = judges_with_build(stack_of(cfg), cfg)
        self.memo: dict[int, Judgement] = {}
        self.order: list[Judgement] = []
        self.n_runs = 0
        self._pending = None  # (key, n_layer, future) of the dry run in the helper process
        # compute each judged depth's needed capacity (~10 allocator replays, ~20% of a dry
        # run): the search turns it off for the rounds whose verdicts alone decide, ``steer``
        # computes it when asked
        self.capacities = True

    def close(self) -> None:
        """End of a search. The helper process stays for the next search of this process
        (spawning one and importing torch in it costs ~5 s): a dry run still running there
        is awaited and kept for the judges that follow (``_shared``)."""
        if self._pending is not None:
            self._collect(self._pending[0])
        self._pending = None

    def _cfg_at(self, n_layer: int) -> C.Config:
        return dataclasses.replace(self.cfg, model=dataclasses.replace(self.cfg.model,
                                                                         n_layer=n_layer))

    def _store(self, key: tuple, res) -> None:
        if len(self._shared) >= self._SHARED_MAX:
            self._shared.pop(next(iter(self._shared)))
        self._shared[key] = res

    def _stored(self, n_layer: int) -> dict:
        """What ``store`` keeps of ``n_layer`` at this capacity: {judgement, min_capacity}."""
        if self.store is None:
            return {}
        key = [self._key(self._cfg_at(n_layer))[0], self.iterations, self.capacity]
        return self.store.get(key) or {}

    def _keep(self, n_layer: int, **value) -> None:
        if self.store is not None:
            key = [self._key(self._cfg_at(n_layer))[0], self.iterations, self.capacity]
            self.store.put(key, {**self._stored(n_layer), **value})

    def prefetch(self, n_layer: int) -> None:
        """Start the dry run at ``n_layer`` in the helper process (the dry run is single-
        threaded Python: a second core runs the search's second depth of a round while this
        process runs the first); ``run`` collects it. One at a time."""
        kept = self._stored(n_layer)
        if "judgement" in kept and (kept.get("min_capacity") is not None
                                    or not self.capacities):
            return
        cfg = self._cfg_at(n_layer)
        key, src = self._key(cfg), twin.trace_config(cfg)
        if key in self._shared or self._key(src) in self._shared or self._pending is not None:
            return
        dicts = [OmegaConf.to_container(OmegaConf.structured(c), resolve=True)
                 for c in (src, cfg)]
        self._pending = (key, n_layer, _helper().submit(_child_dry_run, *dicts,
                                                        self.iterations, self.capacities))

    def _collect(self, key: tuple) -> None:
        if self._pending is None or self._pending[0] != key:
            return
        _, n_layer, fut = self._pending
        self._pending = None
        try:
            src, res = fut.result()
            self._store(self._key(twin.trace_config(self._cfg_at(n_layer))), src)
            self._store(key, res)
            self.n_runs += 1
        except Exception as e:  # noqa: BLE001 - the search then judges it here
            log.warning("parallel dry run at %d layers failed (%s); continuing serially",
                        n_layer, e)
            _drop_helper()

    def _key(self, cfg: C.Config) -> tuple:
        d = dataclasses.asdict(cfg)
        return json.dumps(d, sort_keys=True, default=str), self.iterations

    def run(self, n_layer: int):
        """The dry run at ``n_layer`` (trace kept for replays), from the cache if done."""
        cfg = self._cfg_at(n_layer)
        key = self._key(cfg)
        self._collect(key)
        res = self._shared.get(key)
        if res is None:
            # the program traced once for every stack that judges it (``twin``)
            src_cfg = twin.trace_config(cfg)
            src = self._shared.get(self._key(src_cfg))
            if src is None:
                src = dry_run(src_cfg, iterations=self.iterations, keep_trace=True,
                              details=False)
                self.n_runs += 1
                self._store(self._key(src_cfg), src)
            res = twin.rejudge(src, cfg)
            self._store(key, res)
        return res

    def __call__(self, n_layer: int) -> bool:
        if n_layer in self.memo:
            return self.memo[n_layer].fits
        kept = self._stored(n_layer)
        if "judgement" in kept:
            j = Judgement(**{**kept["judgement"], "min_capacity": kept.get("min_capacity")})
            if j.min_capacity is None and self.capacities:
                self.steer(j)
            self.memo[n_layer] = j
            self.order.append(j)
            return j.fits
        res = self.run(n_layer)
        # the dry run's own judged replay when it ran at this capacity (the cluster's)
        a = res.allocator if res.capacity == self.capacity else res.replay(self.capacity)
        j = Judgement(n_layer, not a["oom"], a["peak_reserved"], a["peak_allocated"],
                      max(res.live_peak_by_iteration.values(), default=0),
                      res.model_state_bytes, res.timings.get("total_s", 0.0),
                      res.live_peak_by_phase.get("build", 0),
                      res.min_capacity(compute=self.capacities), a["repeats"], a["steady"])
        if res.live_peak_steady > 1.001 * j.peak_live:
            log.warning("%d layers: a further iteration would peak at %.2f GB live (this one "
                        "%.2f GB): judge with more iterations", n_layer,
                        res.live_peak_steady / 1e9, j.peak_live / 1e9)
        self.memo[n_layer] = j
        self.order.append(j)
        self._keep(n_layer, judgement=dataclasses.asdict(j), min_capacity=j.min_capacity)
        log.info("dry-run judge: %d layers -> %s (needs %s of %.2f GB, %.1f s, steady after "
                 "%d repeats of the last step)", n_layer, "fits" if j.fits else "OOM",
                 "?" if j.min_capacity is None else f"{j.min_capacity / 1e9:.2f}",
                 self.capacity / 1e9, j.seconds, j.repeats)
        return j.fits

    def probe(self, n_layer: int) -> int:
        """The capacity a small depth needs (``DryRunResult.min_capacity``: the judged
        replay's own fit threshold, so the seed extrapolates the decisive quantity)."""
        need = self._stored(n_layer).get("min_capacity")
        if need is None:
            need = self.run(n_layer).min_capacity()
            self._keep(n_layer, min_capacity=need)
        return need

    def needs_at_most(self, n_layer: int, bound: float) -> bool:
        """Whether depth ``n_layer`` needs at most ``bound`` bytes (``min_capacity`` <= bound,
        decided with as few replays as it takes: ``DryRunResult.needs_at_most``)."""
        need = self._stored(n_layer).get("min_capacity")
        return need <= bound if need is not None else self.run(n_layer).needs_at_most(bound)

    def steer(self, j: "Judgement") -> tuple[int, int]:
        """(bytes the secant steps on, slack on top of them) of a judgement: the capacity the
        depth needs, which already holds the allocator's rounding and fragmentation."""
        if j.min_capacity is None:
            j.min_capacity = self.probe(j.n_layer)
        return j.min_capacity, 0


_HELPER: cf.ProcessPoolExecutor | None = None  # one spawned helper, shared by every judge


def _helper() -> cf.ProcessPoolExecutor:
    global _HELPER
    if _HELPER is None:
        _HELPER = cf.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    return _HELPER


def _drop_helper(wait: bool = False) -> None:
    global _HELPER
    if _HELPER is not None:
        _HELPER.shutdown(wait=wait, cancel_futures=True)
        _HELPER = None


atexit.register(_drop_helper, wait=True)  # ended before the interpreter tears down
# in a multiprocessing child (a ``lab.point_pool`` worker) the exit joins the child's own
# children before ``atexit`` runs: the helper, waiting for work, would never end. A finalizer
# with an exit priority above its queues' (10: they close their feeder threads) runs first.
multiprocessing.util.Finalize(None, _drop_helper, kwargs={"wait": True}, exitpriority=100)


def _child_dry_run(src_dict: dict, cfg_dict: dict, iterations: int, capacity: bool = True):
    """(the dry run of ``src_dict``, it as judged for ``cfg_dict``: ``twin.rejudge``) in the
    judge's helper process (module level: pickled by name), the latter with the capacity it
    needs already found if ``capacity`` (``min_capacity``: ~10 allocator replays, done here in
    parallel with the parent's dry run)."""
    src = dry_run(schema.to_config(src_dict), iterations=iterations, keep_trace=True,
                  details=False)
    res = twin.rejudge(src, schema.to_config(cfg_dict))
    if capacity:
        res.min_capacity()
    return src, res


def _analytic_seed(cfg: C.Config, capacity: float) -> int:
    m, p = cfg.model, cfg.parallel
    zr = cfg.zero_r
    mc = analytic.MemConfig(stage=cfg.zero.stage, checkpointing=zr.activation_checkpointing,
                            p_a=zr.partition_activations, cpu=zr.cpu_checkpointing,
                            c_b=zr.constant_buffers, m_d=zr.contiguous_memory)
    n, _ = analytic.max_model_size(capacity, mc, p.tp, p.world_size // p.tp,
                                   cfg.train.micro_batch_size, m.n_embd, m.n_head,
                                   seq=m.seq_len, vocab=m.vocab_size)
    return max(n, 1)


def probe_depths(cfg: C.Config, analytic_seed: int) -> tuple[int, int]:
    """Two small depths past the point where the two fused gradient buffers (2·R elements,
    ``zero.reduce_bucket_size``) are full: below it the peak also grows by the not-yet-bucketed
    gradients (2 bytes/parameter), above it only by model states and checkpoints, so a slope
    measured there extrapolates."""
    m, z = cfg.model, cfg.zero
    per_layer = 12 * m.n_embd * m.n_embd / cfg.parallel.tp  # this rank's block parameters
    full = int(2 * z.reduce_bucket_size // per_layer) + 2
    a = max(4, min(full, analytic_seed // 4))
    b = max(a + 4, min(2 * a, analytic_seed // 2))
    return a, b


def max_layers(cfg: C.Config, capacity: float | None = None,
               probes: tuple[int, int] | None = None, max_n: int = 2000,
               iterations: int = 2, parallel: bool | None = None,
               store=None) -> MaxSizeResult:
    """Largest ``model.n_layer`` (hidden, heads and everything else from ``cfg``) whose dry run
    fits ``capacity`` bytes (default: the cluster's device memory).

    Seed: two probe dry runs at small depths (``probe_depths`` unless ``probes`` is given)
    measure the per-layer slope of the peak; the seed extrapolates from the deeper probe. The
    analytic model's answer is logged next to it and is the fallback seed. ``parallel``
    (default: when the machine has 2+ cores) runs two dry runs at once: the second probe
    beside the first, and in every round of the search a second depth beside the first
    (``depth_search.search``). ``store``: judgements kept from earlier runs
    (``DryRunJudge``; ``lab.judged``)."""
    t0 = time.perf_counter()
    cap = capacity_of(cfg) if capacity is None else capacity
    judge = DryRunJudge(cfg, cap, iterations, store)
    n_analytic = _analytic_seed(cfg, cap)
    points: list[tuple[int, float]] = []
    probe_log: list = []
    if parallel is None:
        parallel = (os.cpu_count() or 1) >= 2
    try:
        a, b = probes or probe_depths(cfg, n_analytic)
        if parallel:
            judge.prefetch(b)
        for n in (a, b):
            tp = time.perf_counter()
            points.append((n, judge.probe(n)))
            probe_log.append((n, points[-1][1], time.perf_counter() - tp))
        (a, ma), (b, mb) = points
        slope = (mb - ma) / (b - a)
        if slope <= 0:
            raise ValueError("memory does not grow with depth")
        # the probes measure the capacity each depth needs (fragmentation and the cached
        # segments the replay releases before an OOM included), ~affine in depth
        x = b + (cap - mb) / slope
        seed, seed_from = int(x), "probe"
    except (ValueError, ZeroDivisionError) as e:
        log.warning("probe seed failed (%s); using the analytic seed", e)
        seed, seed_from = n_analytic, "analytic"
    seed = min(max(seed, 1), max_n)
    log.info("max-layers seed %d (%s; analytic %d)", seed, seed_from, n_analytic)
    try:
        top = search(judge, seed, max_n, points, cap, pairs=parallel)
        n, start = increasing_sweep(judge, cap, top, pairs=parallel)
    finally:
        judge.close()
    params = flops.param_count(dataclasses.replace(cfg.model, n_layer=n)) if n else 0
    return MaxSizeResult(n, params, cap, seed, seed_from, list(judge.order),
                         time.perf_counter() - t0, n_analytic, probe_log, judge.n_runs,
                         judge.backend, top, start)


# ------------------------------------------------------------------------------ max batch
# The batch sizes a search may answer: powers of two and three times powers of two. The paper
# harness's sweeps use 2, 4, 8, 16, 32, 48, 64, 96 (DeepSpeedExamples@405ce794
# Megatron-LM/scripts/hyperscale/config{6,7}_*node.dat) and the paper's tables 6, 12, 24.
BATCH_GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


@dataclass
class BatchJudgement:
    batch: int
    fits: bool
    min_capacity: int  # smallest allocator capacity this batch's judged replay fits in
    peak_reserved: int
    seconds: float


@dataclass
class MaxBatchResult:
    batch: int  # largest grid batch judged to fit whose next grid batch does not (0: none)
    capacity: float
    judgements: list = field(default_factory=list)  # BatchJudgement, in evaluation order
    seconds: float = 0.0

    def next_capacity(self) -> int | None:
        """The capacity the next grid batch above the answer needs (None: not judged): the
        answer moves up once the allocator's share of the device reaches it."""
        above = [j for j in self.judgements if j.batch > self.batch]
        return min(above, key=lambda j: j.batch).min_capacity if above else None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def max_batch(cfg: C.Config, capacity: float | None = None, seed: int = 8,
              grid: tuple[int, ...] = BATCH_GRID, iterations: int = 2) -> MaxBatchResult:
    """Largest ``train.micro_batch_size`` on ``grid`` whose dry run of ``cfg`` fits
    ``capacity`` (default: the cluster's device less the stack's bytes outside the allocator,
    ``capacity_of``), judged as ``max_layers`` judges a depth: the steady-state allocator
    replay does not run out of memory. Walks the grid from ``seed`` (up while it fits, down
    while it does not); the answer is a batch judged to fit whose next grid batch was judged
    not to (or the grid's end). Every judged batch carries the capacity it needs, so the
    answer at another capacity can be read off the judgements."""
    t0 = time.perf_counter()
    cap = capacity_of(cfg) if capacity is None else capacity
    memo: dict[int, BatchJudgement] = {}
    order: list[BatchJudgement] = []

    def judge(b: int) -> bool:
        if b not in memo:
            j = judge_batch(cfg, b, cap, iterations)
            memo[b] = j
            order.append(j)
        return memo[b].fits

    i = max(0, max((k for k, g in enumerate(grid) if g <= max(1, seed)), default=0))
    if judge(grid[i]):
        while i + 1 < len(grid) and judge(grid[i + 1]):
            i += 1
        answer = grid[i]
    else:
        while i > 0 and not judge(grid[i - 1]):
            i -= 1
        answer = grid[i - 1] if i > 0 else 0
    return MaxBatchResult(answer, cap, order, time.perf_counter() - t0)


def judge_batch(cfg: C.Config, batch: int, capacity: float, iterations: int = 2
                ) -> BatchJudgement:
    """One batch judged as ``max_batch`` judges it: the dry run of ``cfg`` at ``batch`` per
    GPU, its verdict at ``capacity`` and the capacity it needs."""
    tb = time.perf_counter()
    c = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch_size=batch))
    res = dry_run(c, iterations=iterations, keep_trace=True, details=False,
                  allocator_capacity=capacity)
    j = BatchJudgement(batch, not res.allocator["oom"], int(res.min_capacity()),
                       int(res.allocator["peak_reserved"]), time.perf_counter() - tb)
    log.info("max-batch judge: batch %d -> %s (needs %.2f of %.2f GB, %.1f s)", batch,
             "fits" if j.fits else "OOM", j.min_capacity / 1e9, capacity / 1e9, j.seconds)
    return j


# ------------------------------------------------------------------------------ depth scan
def scan(cfg: C.Config, depths, capacity: float | None = None, iterations: int = 2,
         parallel: bool | None = None) -> list[Judgement]:
    """Every depth of ``depths`` judged (two at a time on 2+ cores): what the search samples,
    written out -- e.g. the band near the top where the fit is not monotone in depth."""
    cap = capacity_of(cfg) if capacity is None else capacity
    judge = DryRunJudge(cfg, cap, iterations)
    depths = list(depths)
    if parallel is None:
        parallel = (os.cpu_count() or 1) >= 2
    try:
        for i, n in enumerate(depths):
            if parallel and i % 2 == 0 and i + 1 < len(depths):
                judge.prefetch(depths[i + 1])
            judge(n)
    finally:
        judge.close()
    return [judge.memo[n] for n in depths]


def main(argv=None) -> int:
    """``python -m zero_repro.scale.dryrun.maxsize --config C1 --stack paper2020 --scan 50 62``:
    judge every depth of a Figure 6 configuration (400 V100, MP 16) in a range; one line per
    depth: fits or OOM, and the capacity it needs."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--config", default="C1", help="ZeRO configuration C1..C5 (Figure 6)")
    ap.add_argument("--stack", default="paper2020", choices=sorted(S.STACKS))
    ap.add_argument("--scan", nargs=2, type=int, metavar=("FIRST", "LAST"), required=True,
                    help="depths (layers) to judge, both included")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    s = next((s for s in setups("fig6") if s.zero_config == args.config), None)
    if s is None:
        ap.error(f"--config {args.config!r}: choose one of C1..C5")
    first, last = args.scan
    if not 1 <= first <= last:
        ap.error("--scan FIRST LAST: 1 <= FIRST <= LAST")
    cfg = apply_overrides(C.Config(), {**setup_overrides(s, "dgx2_v100"),
                                       "simulate.stack": args.stack})
    t0 = time.perf_counter()
    js = scan(cfg, range(first, last + 1))
    print(f"{args.config} {args.stack}: judged at {capacity_of(cfg) / 1e9:.2f} GB "
          f"({time.perf_counter() - t0:.0f} s)")
    for j in js:
        print(f"  {j.n_layer:4d} layers  {'fits' if j.fits else 'OOM '}  needs "
              f"{j.min_capacity / 1e9:.2f} GB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
