"""Largest trainable model judged by the dry run (paper §10.5 Figure 6, Table 2 "measured").

``max_layers(cfg, capacity)``: the largest depth l (hidden, heads and the rest from ``cfg``, the
paper's Table 7 families) that trains on a device of C bytes. Depth l fits iff the steady-state
replay of its dry run's trace (``zero_repro.scale.dryrun.dryrun``) through the caching-allocator
model never runs out of memory at C (after releasing cached segments, as PyTorch does before
raising); M(l), the smallest such capacity (``allocator.min_capacity``), decides: fits iff
M(l) <= C.

Search: M is close to affine in l once the gradient buckets are full (``probe_depths``), so two
probes seed l* = l_b + (C - M(l_b)) / slope; full-size dry runs then judge, secant steps close
the bracket [fits, does not fit] (two depths per round with 2+ cores, one in a helper process),
and once at most ``ENDGAME`` depths are open ``_plan`` picks the deciding ones; it finds the
largest depth judged to fit whose next ``LOOKAHEAD`` = 2 depths do not (``largest_fit``).

Reported answer: what the paper's harness did -- grow the model until it fails (DSE@405ce794
Megatron-LM/scripts/ds_gpt_experiment_loop.sh L141-145: the sweep of a ``.dat`` file stops at
the first "CUDA out of memory"). Near the top the verdict is not monotone in depth
(fragmentation), so the increasing sweep can stop below ``largest_fit``: ``increasing_sweep``
walks down from ``largest_fit`` judging every depth until one fits with its needed capacity at
least ``SAFE_MARGIN`` below the capacity (from there down every depth is taken to fit: the
needed capacity is ~affine in depth, its jitter well under the margin), and reports one below
the smallest depth judged not to fit above it (``n_layer``; ``scan`` judges a range). The analytic model
(``zero_repro.scale.analytic``) is logged beside the seed and is the fallback. Returns the depth
and its ``flops.param_count`` (padded vocabulary, TP 1); judgements are memoised per process.
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
import functools
import itertools
import json
import logging
import multiprocessing
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
    _SHARED_MAX = 48

    def __init__(self, cfg: C.Config, capacity: float, iterations: int = 2):
        self.cfg, self.capacity, self.iterations = cfg, capacity, iterations
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
        (spawning one and importing torch in it costs ~5 s), unless it is still busy."""
        if self._pending is not None:
            _drop_helper()
        self._pending = None

    def _cfg_at(self, n_layer: int) -> C.Config:
        return dataclasses.replace(self.cfg, model=dataclasses.replace(self.cfg.model,
                                                                         n_layer=n_layer))

    def _store(self, key: tuple, res) -> None:
        if len(self._shared) >= self._SHARED_MAX:
            self._shared.pop(next(iter(self._shared)))
        self._shared[key] = res

    def prefetch(self, n_layer: int) -> None:
        """Start the dry run at ``n_layer`` in the helper process (the dry run is single-
        threaded Python: a second core runs the search's second depth of a round while this
        process runs the first); ``run`` collects it. One at a time."""
        key = self._key(self._cfg_at(n_layer))
        if key in self._shared or self._pending is not None:
            return
        cfg_dict = OmegaConf.to_container(OmegaConf.structured(self._cfg_at(n_layer)),
                                          resolve=True)
        self._pending = (key, n_layer, _helper().submit(_child_dry_run, cfg_dict,
                                                        self.iterations, self.capacities))

    def _collect(self, key: tuple) -> None:
        if self._pending is None or self._pending[0] != key:
            return
        _, n_layer, fut = self._pending
        self._pending = None
        try:
            self._store(key, fut.result())
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
            res = dry_run(cfg, iterations=self.iterations, keep_trace=True, details=False)
            self.n_runs += 1
            self._store(key, res)
        return res

    def __call__(self, n_layer: int) -> bool:
        if n_layer in self.memo:
            return self.memo[n_layer].fits
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
        log.info("dry-run judge: %d layers -> %s (needs %s of %.2f GB, %.1f s, steady after "
                 "%d repeats of the last step)", n_layer, "fits" if j.fits else "OOM",
                 "?" if j.min_capacity is None else f"{j.min_capacity / 1e9:.2f}",
                 self.capacity / 1e9, j.seconds, j.repeats)
        return j.fits

    def probe(self, n_layer: int) -> int:
        """The capacity a small depth needs (``DryRunResult.min_capacity``: the judged
        replay's own fit threshold, so the seed extrapolates the decisive quantity)."""
        return self.run(n_layer).min_capacity()

    def steer(self, j: "Judgement") -> tuple[int, int]:
        """(bytes the secant steps on, slack on top of them) of a judgement: the capacity the
        depth needs, which already holds the allocator's rounding and fragmentation."""
        if j.min_capacity is None:
            j.min_capacity = self.run(j.n_layer).min_capacity()
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


def _child_dry_run(cfg_dict: dict, iterations: int, capacity: bool = True):
    """A dry run in the judge's helper process (module level: pickled by name), with the
    capacity it needs already found if ``capacity`` (``min_capacity``: ~10 allocator replays,
    done here in parallel with the parent's dry run)."""
    res = dry_run(schema.to_config(cfg_dict), iterations=iterations, keep_trace=True,
                  details=False)
    if capacity:
        res.min_capacity()
    return res


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
               iterations: int = 2, parallel: bool | None = None) -> MaxSizeResult:
    """Largest ``model.n_layer`` (hidden, heads and everything else from ``cfg``) whose dry run
    fits ``capacity`` bytes (default: the cluster's device memory).

    Seed: two probe dry runs at small depths (``probe_depths`` unless ``probes`` is given)
    measure the per-layer slope of the peak; the seed extrapolates from the deeper probe. The
    analytic model's answer is logged next to it and is the fallback seed. ``parallel``
    (default: when the machine has 2+ cores) runs two dry runs at once: the second probe
    beside the first, and in every round of the search a second depth beside the first
    (``_search``)."""
    t0 = time.perf_counter()
    cap = capacity_of(cfg) if capacity is None else capacity
    judge = DryRunJudge(cfg, cap, iterations)
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
        top = _search(judge, seed, max_n, points, cap, pairs=parallel)
        n, start = increasing_sweep(judge, cap, top)
    finally:
        judge.close()
    params = flops.param_count(dataclasses.replace(cfg.model, n_layer=n)) if n else 0
    return MaxSizeResult(n, params, cap, seed, seed_from, list(judge.order),
                         time.perf_counter() - t0, n_analytic, probe_log, judge.n_runs,
                         judge.backend, top, start)


SAFE_MARGIN = 2**30  # below capacity - this, a depth's verdict is taken as monotone


def increasing_sweep(judge, capacity: float, top: int,
                     margin: float = SAFE_MARGIN) -> tuple[int, int]:
    """(answer, start) of the paper's increasing sweep (module docstring) given the search's
    ``top`` (largest depth judged to fit): depths from ``top`` down are judged until one fits
    needing at most ``capacity - margin`` (``start``; depth 0 if none); the answer is one
    below the smallest depth in (start, top + 1] judged not to fit (``top + 1`` is, by the
    search's look-ahead)."""
    if top <= 0:
        return 0, 0
    memo = getattr(judge, "memo", {})
    start = top
    while start > 0:
        fits = judge(start)
        need = memo[start].min_capacity if start in memo else None
        if need is None and start in memo and hasattr(judge, "steer"):
            need = judge.steer(memo[start])[0]
        if fits and need is not None and need <= capacity - margin:
            break
        start -= 1
    fails = [d for d in range(start + 1, top + 1) if not judge(d)]
    return (min(fails) - 1 if fails else top), start


LOOKAHEAD = 2  # the answer's LOOKAHEAD depths above it are judged not to fit
SPREAD = 2  # an estimate that follows a miss is judged with depths SPREAD below and above it
WIDE = 8  # a bracket of more open depths than this is narrowed by interpolation, not halving
ENDGAME = 4  # a judged bracket with at most this many open depths is finished by ``_plan``
HORIZON = 3  # rounds ``_plan`` looks ahead


def _bracket(verdict: dict, max_n: int) -> tuple[int, int]:
    """(the largest depth judged to fit or 0, the smallest above it judged not to or
    ``max_n + 1``)."""
    lo = max((d for d, v in verdict.items() if v), default=0)
    return lo, min((d for d, v in verdict.items() if not v and d > lo), default=max_n + 1)


def _answer(verdict: dict, max_n: int, lookahead: int = LOOKAHEAD) -> int | None:
    """The search's answer once it is decided: the largest depth judged to fit when its
    ``lookahead`` depths above are all judged not to (or lie past ``max_n``); else None."""
    lo = _bracket(verdict, max_n)[0]
    if all(d > max_n or verdict.get(d) is False for d in range(lo + 1, lo + lookahead + 1)):
        return lo
    return None


def _plan(verdict: dict, per_round: int, max_n: int, lookahead: int = LOOKAHEAD,
          horizon: int = HORIZON) -> tuple[int, ...]:
    """The depths to judge next (``per_round`` of them, run side by side) near the end of a
    search, chosen by looking ``horizon`` rounds ahead: fewest rounds to a decided answer
    (``_answer``) whatever the verdicts (fit is not monotone in depth near the top, so every
    open depth may go either way), then fewest on average over equally likely verdicts, then
    the deeper depths. Open depths considered: those from the bracket's lower end up to
    ``2 * lookahead`` past its upper end."""
    if _answer(verdict, max_n, lookahead) is not None:
        return ()
    lo, hi = _bracket(verdict, max_n)
    window = tuple(d for d in range(lo + 1, min(hi + 2 * lookahead, max_n) + 1)
                   if d not in verdict)
    if not window:
        return ()
    base = {d: v for d, v in verdict.items() if d >= lo}

    @functools.lru_cache(maxsize=None)
    def cost(known: frozenset, depth: int) -> tuple[int, float]:
        v = {**base, **dict(known)}
        if _answer(v, max_n, lookahead) is not None:
            return 0, 0.0
        open_ = [d for d in window if d not in v]
        if depth == horizon or not open_:
            return horizon + 1, float(horizon + 1)  # not decided within the look-ahead
        return min(_rate(known, c, depth) for c in
                   itertools.combinations(open_, min(per_round, len(open_))))[:2]

    def _rate(known: frozenset, depths: tuple, depth: int) -> tuple[int, float, tuple]:
        outs = [cost(known | frozenset(zip(depths, o)), depth + 1)
                for o in itertools.product((True, False), repeat=len(depths))]
        return (1 + max(w for w, _ in outs), 1 + sum(m for _, m in outs) / len(outs),
                tuple(-d for d in sorted(depths, reverse=True)))

    best = min(itertools.combinations(window, min(per_round, len(window))),
               key=lambda c: _rate(frozenset(), c, 0))
    return tuple(sorted(best, reverse=True))


def _search(judge, seed: int, max_n: int, points: list[tuple[int, float]] | None = None,
            capacity: float | None = None, pairs: bool = False) -> int:
    """Largest n in [0, max_n] with judge(n) true (monotone judge), starting at ``seed``.

    Secant steps on the judged depths' needed capacity (``DryRunJudge.steer``: ~affine in n)
    pick the next depth inside the open bracket (lo fits, hi does not); each judged depth
    shrinks it. A run of outcomes in one direction gallops (1, 2, 4, ... layers); once a depth
    that fits and one that does not are both judged, the search bisects.

    ``pairs`` (a judge with ``prefetch``: a helper process): every round judges two depths, the
    second run beside the first -- next to an estimate its neighbour (the answer is a pair:
    fits, does not fit); when bisecting, the two depths that cut the bracket in thirds; once
    the judged bracket has at most ``ENDGAME`` open depths, the ones ``_plan`` picks.
    Fragmentation makes the verdict non-monotone near the top (paper2020 C1:
    results/fig6_max_model/notes.md): the answer is the largest depth judged to fit
    whose ``LOOKAHEAD`` depths above were judged not to (a depth that does not fit below a
    larger one that does is passed over, as "largest model that trains" asks)."""
    pts = list(points or [])
    verdict: dict[int, bool] = {}
    lo, hi, n = 0, max_n + 1, seed
    slack = 0.0
    # a run of nudges in one direction gallops (1, 2, 4, ... layers) instead of creeping by
    # one (a safeguard: the needed capacity steers well on every stack measured)
    gallop = True
    streak, last_ok = 0, None
    prefetch = getattr(judge, "prefetch", None) if pairs else None
    memo = getattr(judge, "memo", {})
    def need(d: int) -> float:
        if hasattr(judge, "steer"):
            return judge.steer(memo[d])[0]
        return memo[d].peak_allocated

    while True:
        lo, hi = _bracket(verdict, max_n)
        if verdict and _answer(verdict, max_n) is not None:
            return lo
        endgame = hi - lo - 1 <= ENDGAME and (lo == 0 or lo in verdict) and hi in verdict
        if hasattr(judge, "capacities"):  # the end game needs verdicts only
            judge.capacities = not endgame
        if endgame:
            # near the end: the depths that decide the answer in the fewest rounds
            plan = _plan(verdict, 1 if prefetch is None else 2, max_n)
            if not plan:  # every depth that could decide it is judged: cannot happen
                raise AssertionError(f"max-layers search stuck at {sorted(verdict.items())}")
            if len(plan) > 1:
                prefetch(plan[1])
            for d in plan:
                verdict[d] = judge(d)
            continue
        interior = hi - lo - 1
        bisecting = lo in verdict and hi in verdict
        if (bisecting and interior > WIDE and capacity is not None and lo in memo
                and hi in memo and need(hi) > need(lo)):
            # a wide bracket: interpolate between its ends (their needed capacity is affine to
            # ~±0.5 GB, a few layers; halving a wide bracket would take several rounds)
            frac = (capacity - slack - need(lo)) / (need(hi) - need(lo))
            n, bisecting = lo + int(frac * (hi - lo)), False
        if bisecting and prefetch is not None and interior >= 2:
            n, m = lo + max(1, (interior + 1) // 3), lo + max(2, (2 * interior + 2) // 3)
        else:
            n = (lo + hi) // 2 if bisecting else min(max(n, lo + 1), hi - 1)
            # the seed's neighbour (when the seed is right, the pair is the answer); once an
            # estimate has missed, a pair around it (its error is a few layers either way)
            spread = SPREAD if (verdict and not bisecting) else 0
            n, m = min(max(n - spread, lo + 1), hi - 1), n + spread + (spread == 0)
            if not lo < m < hi or m == n:
                m = n - 1
            if prefetch is None or not lo < m < hi or m in verdict:
                m = None
        if m is not None:
            prefetch(m)
        verdict[n] = judge(n)
        if m is not None:
            verdict[m] = judge(m)
        lo, hi = _bracket(verdict, max_n)
        judged = [d for d in (n, m) if d is not None]
        if len({verdict[d] for d in judged}) > 1 or (lo in verdict and hi in verdict):
            continue  # both ends of the bracket are judged: bisect
        # steer from the bracket end this round moved
        n = max(judged) if verdict[judged[0]] else min(judged)
        ok = verdict[n]
        if capacity is None or n not in memo:
            n = (lo + hi) // 2
            continue
        for d in judged:
            used, extra = judge.steer(memo[d]) if hasattr(judge, "steer") else (
                need(d), memo[d].peak_reserved - memo[d].peak_allocated)
            if verdict[d]:
                slack = max(slack, extra)
            pts = [p for p in pts if p[0] != d] + [(d, used)]
        used = dict(pts)[n]
        # slope over the widest baseline (the shallowest probe to this depth): neighbouring
        # depths differ by ~0.1 GB per layer but their needed capacity carries ~±0.5 GB of
        # fragmentation, so a slope between them is mostly noise
        (n1, p1) = min(pts) if len(pts) > 1 else (0, 0.0)
        slope = (used - p1) / (n - n1) if n != n1 else 0.0
        est = n + int((capacity - slack - used) // slope) if slope > 0 else n
        # the estimate, nudged off the bracket end just judged so the bracket always shrinks
        if lo < est < hi:
            n, streak = est, 0
            continue
        streak = streak + 1 if (gallop and last_ok == ok) else 0
        last_ok = ok
        step = 2 ** streak if gallop else 1
        n = lo + step if ok else hi - step
        if gallop and not lo < n < hi:
            n = (lo + hi) // 2


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
