"""The fake-tensor dry run of the real runtime (scale/dryrun/dryrun.py) and its max-size search.

* model-state bytes of the dry run equal Table 1 exactly, every stage, at a paper-shaped
  configuration (hidden 8192, TP 16, 400 ranks; 2 layers by default, the full 100B slow);
* checkpoint bytes: P_a keeps 1/tp, P_a+cpu keeps nothing on the device;
* faithfulness: a real gloo run (world 2) and the dry run of the same configuration report the
  same bytes in every ledger category;
* the allocation trace is consistent (allocator peaks >= exact live peak >= model states).
"""
from __future__ import annotations

import collections
import dataclasses
import itertools

import pytest
from omegaconf import OmegaConf

from zero_repro import config as C
from zero_repro import validation
from zero_repro.runtime.comm.launch import spawn
from zero_repro.scale.paper.buckets import PAPER_BUCKETS
from zero_repro.scale.paper.overrides import paper_overrides
from zero_repro.scale.paper.table1 import model_state_bytes
from zero_repro.scale.paper.table3 import zero_r_config
from zero_repro.scale.dryrun import allocator as A
from zero_repro.scale.dryrun import depth_search, maxsize
from zero_repro.scale.dryrun.dryrun import (
    apply_overrides,
    device_events,
    dry_run,
    live_peaks,
    repeat_start,
    steady_peak,
)
from zero_repro.scale.dryrun.real_run import (
    allocator_live_peaks,
    last_step_peak_categories,
    real_ledgers,
    real_live_peaks,
)

MODEL_STATES = ("params_lp", "grads", "master_fp32", "adam_m", "adam_v")


def paper_cfg(n_layer: int, zc: str, stage: int | None = None, batch: int = 1,
              buckets: dict | None = None) -> C.Config:
    ov = paper_overrides(n_layer, 8192, 64, 400, 16, batch, zc)
    if stage is not None:
        ov["zero.stage"] = stage
    return apply_overrides(C.Config(), {**ov, **(buckets or PAPER_BUCKETS)})


def tiny_cfg(world: int, tp: int, stage: int, zr: str = "off") -> C.Config:
    cfg = C.Config()  # the tiny model
    cfg.parallel = C.ParallelConfig(world_size=world, tp=tp)
    cfg.zero = dataclasses.replace(cfg.zero, stage=stage, dtype="fp16")
    cfg.zero_r = zero_r_config(zr)
    cfg.train = dataclasses.replace(cfg.train, micro_batch_size=2)
    return validation.validate(cfg)


def _check_model_states(res, stage: int, n_d: int) -> None:
    assert res.model_state_bytes == model_state_bytes(res.psi_padded, stage, n_d)
    assert 0 <= res.psi_padded - res.psi <= res.n_buckets * n_d  # padding only
    assert max(res.live_peak_by_iteration.values()) >= res.model_state_bytes
    assert res.allocator["peak_reserved"] >= res.allocator["peak_allocated"] >= \
        max(res.live_peak_by_iteration.values())


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_paper_shaped_model_states_equal_table1(stage):
    res = dry_run(paper_cfg(2, "c4", stage=stage), keep_trace=False)
    _check_model_states(res, stage, n_d=25)
    assert res.config["world_size"] == 400 and res.config["tp"] == 16


def test_checkpoints_partitioned_and_offloaded():
    b, s, h, l, m = 2, 1024, 8192, 2, 16
    c4 = dry_run(paper_cfg(l, "c4", batch=b), keep_trace=False)
    assert c4.ledger["ckpt_device"] == b * s * h * l * 2 // m  # P_a: 1/m of every checkpoint
    assert c4.host_bytes == 0
    c5 = dry_run(paper_cfg(l, "c5", batch=b), keep_trace=False)
    assert c5.ledger["ckpt_cpu"] == b * s * h * l * 2 // m  # P_a+cpu: in host memory ...
    assert c5.host_bytes == c5.ledger["arena_capacity"]  # ... the arena is not device memory
    gap = max(c4.live_peak_by_iteration.values()) - max(c5.live_peak_by_iteration.values())
    assert gap == c4.ledger["ckpt_device"]
    c3 = dry_run(paper_cfg(l, "c3", batch=b), keep_trace=False)
    assert c3.ledger["ckpt_device"] == b * s * h * l * 2  # no P_a: full checkpoints


@pytest.mark.slow
def test_dry_run_matches_real_gloo_run():
    cfgs = [tiny_cfg(2, 1, st) for st in (0, 1, 2, 3)] + [tiny_cfg(2, 2, 2, "c4"),
                                                          tiny_cfg(2, 2, 1, "c1")]
    real = spawn(real_ledgers, 2, [OmegaConf.to_container(OmegaConf.structured(c))
                                   for c in cfgs])[0]
    for cfg, r in zip(cfgs, real):
        fake = dry_run(cfg, keep_trace=False, transport_of=r["transport"])
        assert fake.ledger == r["ledger"], (cfg.zero.stage, cfg.zero_r.name)
        assert fake.psi_padded == r["psi_padded"]
        n_d = cfg.parallel.world_size // cfg.parallel.tp
        # stage 2 without C_B reduces one model-size gradient bucket in place (its shard inside
        # it): Table 1's P_os+g needs the gradients reduced in buckets; without them it holds
        # P_os's bytes
        as_stage = 1 if cfg.zero.stage == 2 and not cfg.zero_r.constant_buffers else cfg.zero.stage
        assert r["model_state_bytes"] == model_state_bytes(r["psi_padded"], as_stage, n_d)


def _world4_cfg(name: str) -> C.Config:
    """fp32 configs of ``test_dry_run_live_peak_matches_real_run_at_world_4``: ``sK`` stage K of
    the tiny model, ``wide-s3`` stage 3 of the tiny model with a vocabulary of 1024 (a tied
    table larger than a block: read in row slices, ``zero.slice_vocab_gather``), ``wide-s3-tp2-
    c4`` the same at TP 2 with C4 (P_a, C_B, M_D)."""
    wide = name.startswith("wide")
    stage, tp, zr = int(name.split("s")[-1][0]), 2 if "tp2" in name else 1, "c4" if "c4" in name \
        else "off"
    cfg = tiny_cfg(4, tp, stage, zr)
    cfg.zero = dataclasses.replace(cfg.zero, dtype="fp32")
    if wide:
        cfg.model = dataclasses.replace(cfg.model, vocab_size=1024)
    return validation.validate(cfg)


# dry run vs the CPU allocator's count of a real run, per step: the dry run may not exceed it by
# more than 1%, and may fall short of it by at most 10% -- the allocator also counts the pairwise
# transport's in-flight scratch and the kernels' own, whose overlap depends on the ranks' timing
# (seen 0.6% on a quiet machine, 2.3-7.3% at load 10 with TP 2 + C4); a tracer that counted
# every storage at 3/4 of its size falls 25% short and fails
ALLOCATOR_TOL = (-0.10, 0.01)


def _traced_and_counted(rank: int, world: int, cfg_dicts: list[dict],
                        count: bool = True) -> tuple[list, list | None]:
    """A real run measured twice in one rank: with the polling tracer (``real_live_peaks``),
    then again with the CPU allocator's count alone (``allocator_live_peaks``; it counts only
    blocks allocated while it runs, so the first run's leftovers are not counted)."""
    real = real_live_peaks(rank, world, cfg_dicts)
    return real, allocator_live_peaks(rank, world, cfg_dicts) if count else None


# the second, allocator-counted run in the same ranks hung or lost a rank twice where the ranks
# run on tcmalloc (CI installs it: a gloo send timed out after 300 s; a peer closed its
# connection), never without it here: the default suite traces only, "-counted" (-m slow) adds
# the count
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow)
                                  for n in ("s0", "s1", "s2", "s3", "wide-s3-counted",
                                            "wide-s3-tp2-c4-counted")]
                         + ["wide-s3", "wide-s3-tp2-c4"])
def test_dry_run_live_peak_matches_real_run_at_world_4(monkeypatch, name):
    """The dry run's live bytes (meta tensors, fake group, the strategy's flat buffers watched
    for in-place resizes) against a real gloo run of the same config at world 4 measured with
    no shortcut (real tensors and collectives, every storage polled before every allocating
    op): the live peak of each step and the live bytes per category at the last step's peak,
    stages 0-3 (``-m slow``) and stage 3 with a table read in row slices, alone and with TP 2 +
    P_a. Stage 3 releases its gathered units and slices by resizing their storage to 0 bytes,
    which no dispatch mode sees: a dry run blind to it keeps every unit alive (fp16_params =
    the whole model). Tolerance: 64 B (a 0-dim tensor's storage), every stage. The polling
    tracer is the dry run's own tracer: each step's peak is also held to the same steps
    counted by the CPU allocator alone (``ALLOCATOR_TOL``)."""
    monkeypatch.setenv("ZR_CPU_TRANSPORT", "pairwise")  # gloo: peers' segments are not ours
    count = name.endswith("-counted")
    cfg = _world4_cfg(name.removesuffix("-counted"))
    # fresh ranks per config, as a training run has: storages an earlier config's run leaves
    # in the process (the polling tracer counts them once a later op touches them) are not
    # this config's
    r, counted = spawn(_traced_and_counted, 4,
                       [OmegaConf.to_container(OmegaConf.structured(cfg))], count)[0]
    r, counted = r[0], counted[0] if counted else None
    what = (cfg.zero.stage, cfg.parallel.tp, cfg.zero_r.name, cfg.model.vocab_size)
    dry = dry_run(cfg, transport_of=r["transport"])
    dev = device_events(dry.trace, set(dry.host_sids))
    cats = last_step_peak_categories(dev, dry.category_of)
    by_iter = dry.live_peak_by_iteration
    tol = 64
    assert set(by_iter) == set(r["by_iteration"]) == {0, 1}, what
    for it, peak in r["by_iteration"].items():
        assert abs(by_iter[it] - peak) <= tol, (what, it)
        # the same steps counted by the CPU allocator, no tracer: an error the dry run shares
        # with the polling tracer does not pass (kernels' own scratch: within ALLOCATOR_TOL)
        if counted is not None:
            got = counted["by_iteration"][it]
            assert ALLOCATOR_TOL[0] <= by_iter[it] / got - 1 <= ALLOCATOR_TOL[1], (
                what, it, by_iter[it], got)
    assert set(cats) == set(r["categories"]), what
    for cat, nbytes in r["categories"].items():
        assert abs(cats[cat] - nbytes) <= tol, (what, cat, cats[cat], nbytes)


def test_stage3_live_peak_grows_by_the_shards_only():
    """Stage 3 at 400 GPUs, MP 16, h 8192: from 8 to 16 layers the training live peak grows by
    exactly the added model states (16Ψ/(N_d·MP) of the 8 layers) and checkpoints; gathered
    units are released (before: it grew like stage 2's full fp16 parameters, 0.91 -> 1.75 GB)."""
    r8, r16 = (dry_run(paper_cfg(n, "c4", stage=3, batch=1), keep_trace=False) for n in (8, 16))
    grown = r16.live_peak_by_iteration[1] - r8.live_peak_by_iteration[1]
    assert grown == (r16.model_state_bytes - r8.model_state_bytes
                     + r16.ledger["ckpt_device"] - r8.ledger["ckpt_device"])
    assert r16.ledger["params_gathered"] == r8.ledger["params_gathered"]


@pytest.mark.slow
def test_1t_stage3_on_1024_gpus_peak_is_its_itemised_parts():
    """1T parameters (128 x 25600, 160 heads), 1024 GPUs (MP 16 x N_d 64), stage 3 + C4, batch 1:
    the training live peak is 16Ψ/(N_d·MP) (15.76 GB) plus what the ledger itemises -- the
    gathered units (root + the block computed + one prefetched), the checkpoints -- plus at
    most the unit-sized gradient buffers of the reductions in flight (ledger comm_buffers) and
    one block's fp16 parameters' worth of working memory. Measured: 22.36 GB (~80 s)."""
    ov = paper_overrides(128, 25600, 160, 1024, 16, 1, "c4")
    ov["zero.stage"] = 3
    r = dry_run(apply_overrides(C.Config(), {**ov, **PAPER_BUCKETS}), keep_trace=False)
    psi_total = r.psi * 16  # this TP rank's parameters x MP
    assert r.model_state_bytes == model_state_bytes(r.psi_padded, 3, 64)
    assert abs(r.model_state_bytes - 16 * psi_total / 1024) < 1e-3 * r.model_state_bytes
    floor = r.model_state_bytes + r.ledger["params_gathered"] + r.ledger["ckpt_device"]
    block = 12 * 25600 * 25600 // 16 * 2
    peak = r.live_peak_by_iteration[1]
    assert floor <= peak <= floor + r.ledger["comm_buffers"] + block


def test_trace_phases_and_item_values():
    res = dry_run(tiny_cfg(4, 2, 2, "c4"), iterations=2)
    phases = {e[3] for e in res.trace}
    assert phases == {"build", "forward", "backward", "step"}
    allocs = sum(e[2] for e in res.trace if e[0] == "alloc")
    frees = sum(e[2] for e in res.trace if e[0] == "free")
    assert allocs >= frees > 0
    assert set(res.live_peak_by_iteration) == {0, 1}


def test_steady_peak_adds_lazy_state_created_after_the_peak():
    it = [("alloc", 1, 100, "forward", 0), ("free", 1, 100, "backward", 0),
          ("alloc", 2, 30, "step", 0)]  # lazy: alive at the end, created after the peak
    build = [("alloc", 0, 10, "build", 0)]
    assert live_peaks(build + it)[2] == {0: 110}
    assert steady_peak(build + it) == 140
    assert steady_peak(build + it + [("free", 2, 30, "step", 0)]) == 110  # not lazy


@pytest.mark.parametrize("zc,stage", [("c1", None), ("c4", None), ("c5", None),
                                      ("c3", 3)])
def test_one_iteration_shows_the_steady_state(zc, stage):
    # one step's predicted steady live peak equals what a second step really reaches, and
    # at these small shapes the allocator replay does not change either (the experiments
    # trace 2 steps and replay the second to the allocator's steady state: next test)
    cfg = paper_cfg(3, zc, stage=stage, batch=2)
    one, two = dry_run(cfg, iterations=1), dry_run(cfg, iterations=2)
    assert one.live_peak_steady == two.live_peak_by_iteration[1] == two.live_peak_steady
    assert one.allocator["peak_reserved"] == two.allocator["peak_reserved"]
    assert one.replay(None)["peak_allocated"] == one.allocator["peak_allocated"]


def test_max_layers_search_is_tight():
    # the answer n must be judged to fit and n + 1 judged not to (each judgement a dry run
    # whose trace is replayed with the capacity: cached segments are released before an OOM)
    cfg = paper_cfg(2, "c4", batch=1)
    r = maxsize.max_layers(cfg, capacity=2.0e9, probes=(1, 2), iterations=1, parallel=True)
    verdict = {j.n_layer: j.fits for j in r.judgements}
    # probes and judgements share dry runs; at most one speculative parallel run is unused
    assert r.n_dry_runs <= len(r.judgements) + 3
    assert r.n_layer >= 3 and verdict[r.n_layer] and not verdict[r.n_layer + 1]
    # the increasing sweep's answer: every depth from its start up to it judged to fit
    assert r.sweep_start <= r.n_layer <= r.largest_fit
    assert all(verdict[d] for d in range(max(r.sweep_start, 1), r.n_layer + 1))
    assert all(j.peak_allocated <= 2.0e9 for j in r.judgements if j.fits)
    assert r.params > 12 * r.n_layer * 8192**2  # weights of the blocks + embeddings
    # the scan writes the same judgements out (the dry runs are shared in the process)
    js = maxsize.scan(cfg, [r.n_layer, r.n_layer + 1], capacity=2.0e9, iterations=1,
                      parallel=False)
    assert [j.fits for j in js] == [True, False]
    by = {j.n_layer: j for j in r.judgements}
    assert all(j.min_capacity is not None for j in js)  # the scan computes every one
    assert all(by[j.n_layer].min_capacity in (None, j.min_capacity) for j in js)


class _NoisyJudge:
    """A judge whose needed capacity is affine in depth plus ±0.5 GB of fragmentation noise
    (as measured for paper2020 C4 near 29.85 GB), the verdict monotone at ``last``."""

    def __init__(self, last: int, cap: float = 29.85e9, per_layer: float = 0.13e9):
        self.last, self.cap, self.per_layer = last, cap, per_layer
        self.memo, self.calls = {}, []

    def need(self, n: int) -> float:
        noise = 0.5e9 * (((n * 7919) % 11) / 5.0 - 1.0)  # deterministic, in [-0.5, 0.5] GB
        base = self.cap + (n - self.last - 0.5) * self.per_layer
        return min(base + noise, self.cap - 1) if n <= self.last else max(base + noise,
                                                                           self.cap + 1)

    def __call__(self, n: int) -> bool:
        self.calls.append(n)
        self.memo[n] = maxsize.Judgement(n, n <= self.last, 0, 0, 0, 0, 0.0, 0,
                                         int(self.need(n)))
        return n <= self.last

    def steer(self, j):
        return j.min_capacity, 0


@pytest.mark.parametrize("seed,last", [(180, 176), (169, 176), (199, 176), (150, 176),
                                       (139, 131)])
def test_search_with_noisy_capacity_ends_in_few_judgements(seed, last):
    """(139, 131): paper2020 C2's search, whose first two depths did not fit; bisecting
    between them and 0 layers (never judged) cost 8 extra dry runs before this was fixed."""
    judge = _NoisyJudge(last=last)
    probes = [(21, judge.need(21)), (42, judge.need(42))]
    n = depth_search.search(judge, seed, 2000, probes, judge.cap)
    assert n == last
    assert len(judge.calls) <= 7, judge.calls  # incl. the LOOKAHEAD check above the answer
    assert last + 2 in judge.calls


class _PairedJudge(_NoisyJudge):
    """The noisy judge with a helper process: ``prefetch`` marks the depth the round runs in
    parallel (a round = one unprefetched judgement, with or without a prefetched one)."""

    def __init__(self, last: int):
        super().__init__(last)
        self.prefetched: list[int] = []

    def prefetch(self, n: int) -> None:
        self.prefetched.append(n)


@pytest.mark.parametrize("seed,last", [(180, 176), (169, 176), (199, 176), (150, 176),
                                       (139, 131), (183, 176)])
def test_paired_search_finds_the_same_depth_in_fewer_rounds(seed, last):
    paired, single = _PairedJudge(last), _NoisyJudge(last)
    probes = [(21, single.need(21)), (42, single.need(42))]
    n2 = depth_search.search(paired, seed, 2000, probes, paired.cap, pairs=True)
    n1 = depth_search.search(single, seed, 2000, probes, single.cap)
    assert n2 == n1 == last
    rounds = len(paired.calls) - len(paired.prefetched)
    assert set(paired.prefetched) <= set(paired.calls)  # every prefetched depth is judged
    assert rounds <= 5 and rounds <= len(single.calls), (paired.calls, single.calls)
    assert {last + 2, last + 3} <= set(paired.calls)  # the look-ahead, one round


class _BandJudge(_NoisyJudge):
    """Not monotone near the top, as paper2020 C1 (fits at 53, not 54, again at 55-59)."""

    def __init__(self, last: int, holes=(), islands=()):
        super().__init__(last)
        self.holes, self.islands = set(holes), set(islands)

    def __call__(self, n: int) -> bool:
        super().__call__(n)
        fits = (n <= self.last and n not in self.holes) or n in self.islands
        j = self.memo[n]
        self.memo[n] = dataclasses.replace(j, fits=fits, min_capacity=int(
            self.cap - 1e6 if fits else self.cap + 1e6))
        return fits


@pytest.mark.parametrize("pairs", [False, True])
def test_search_answer_is_the_largest_fit_below_two_that_do_not(pairs):
    """A depth that does not fit below the answer is passed over; a depth that fits two above
    the first failure above it is found (LOOKAHEAD = 2)."""
    judge = (_PairedJudge if pairs else _NoisyJudge)(176)
    band = _BandJudge(176, holes={171, 172, 175}, islands={178})
    band.prefetch = judge.prefetch if pairs else None
    if not pairs:
        del band.prefetch
    probes = [(21, band.need(21)), (42, band.need(42))]
    n = depth_search.search(band, 180, 2000, probes, band.cap, pairs=pairs)
    assert n == 178 and not band.memo[179].fits and not band.memo[180].fits, band.calls


class _SweepJudge(_BandJudge):
    """The band judge with needs falling one GB per 8 layers below the band."""

    def __call__(self, n: int) -> bool:
        fits = super().__call__(n)
        if fits and n < 170:
            self.memo[n] = dataclasses.replace(self.memo[n], min_capacity=int(
                self.cap - (170 - n) * 0.13e9))
        return fits


def test_increasing_sweep_stops_at_the_first_failure():
    """The paper grew the model until it failed (ds_gpt_experiment_loop.sh): the answer is one
    below the smallest depth judged not to fit, found walking down from the search's largest
    fit until a depth fits with a margin; monotone: the search's answer."""
    band = _SweepJudge(176, holes={171, 172, 175}, islands={178})
    n, start = depth_search.increasing_sweep(band, band.cap, 178)
    assert n == 170 and start < 170
    assert band.memo[start].min_capacity <= band.cap - depth_search.SAFE_MARGIN
    assert all(band.memo[d].fits for d in range(start, 171))
    mono = _SweepJudge(176)
    assert depth_search.increasing_sweep(mono, mono.cap, 176)[0] == 176


def test_min_capacity_is_the_fit_threshold_the_search_steers_on():
    """allocator.min_capacity: the judged replay fits at it and runs out of memory 2 tol below
    it; it lies between the peak allocated and the unconstrained peak reserved bytes; every
    judgement's verdict agrees with it."""
    res = dry_run(paper_cfg(3, "c4", batch=1), iterations=1, keep_trace=True)
    ev = res.judged_events()
    tol = 8 * 2**20
    m = A.min_capacity(ev, tol=tol)
    free = A.replay(ev, capacity=None)
    assert free.peak_allocated <= m <= free.peak_reserved
    assert not A.replay(ev, capacity=m).oom
    assert A.replay(ev, capacity=m - 2 * tol).oom
    # the result's own min_capacity narrows the bracket by its judged replay (same threshold)
    assert res.min_capacity() == A.min_capacity(
        ev, tol=tol, known=(res.capacity, not res.allocator["oom"]))
    assert abs(res.min_capacity() - m) <= tol
    for cap in (m - 4 * tol, m + 4 * tol):  # a known verdict on either side of the threshold
        fits = not A.replay(ev, capacity=cap).oom
        hinted = A.min_capacity(ev, tol=tol, known=(cap, fits))
        assert abs(hinted - m) <= tol and (hinted <= cap) == fits
    r = maxsize.max_layers(paper_cfg(2, "c4", batch=1), capacity=2.0e9, probes=(1, 2),
                           iterations=1, parallel=False)
    measured = [j for j in r.judgements if j.min_capacity is not None]  # None: a verdict only
    assert measured and all(j.fits == (j.min_capacity <= 2.0e9 + tol) for j in measured)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_100b_model_states_equal_table1(stage):
    res = dry_run(paper_cfg(125, "c4", stage=stage, batch=32), keep_trace=False)
    _check_model_states(res, stage, n_d=25)


def _canon(events):
    """A trace up to renaming of storage ids: (kind, allocation index, bytes, phase, it)."""
    idx: dict = {}
    out = []
    n = 0
    for kind, sid, nbytes, phase, it in events:
        if kind == "alloc":  # every allocation a new index (a resized storage keeps its sid)
            idx[sid], n = n, n + 1
        out.append((kind, idx.get(sid), nbytes, phase, it))
    return out


def _renamed(step, off: int):
    """One step's events with the storages it creates renamed (sid + off); the storages it
    finds alive and frees first (stage 3's units gathered at the previous step's end) keep
    their ids: the next step frees what this one leaves alive."""
    first: dict = {}
    for kind, sid, *_ in step:
        first.setdefault(sid, kind)
    return [(k, s + off if first[s] == "alloc" else s, n, p, it) for k, s, n, p, it in step]


@pytest.mark.parametrize("zc,stack,stage", [("c1", "paper2020", None), ("c4", "modern", None),
                                            ("c5", "paper2020", None), ("c3", "modern", 3)])
def test_the_repeated_second_step_is_what_later_steps_trace(zc, stack, stage):
    """The judged replays repeat the 2nd traced step to the allocator's steady state: that is
    exact only if every later step allocates and frees what the 2nd does. Traced 4 steps =
    2 traced steps with the 2nd written out twice more (storage ids renamed), event for event;
    and the steady replay of either trace reaches the same verdict and peaks."""
    cfg = paper_cfg(3, zc, stage=stage, batch=2)
    cfg.simulate = dataclasses.replace(cfg.simulate, stack=stack)
    two, four = dry_run(cfg, iterations=2), dry_run(cfg, iterations=4)
    ev2, ev4 = two.judged_events(), four.judged_events()
    rep = repeat_start(ev2)
    assert rep is not None and ev2[rep][4] == 1  # the 2nd step, closed
    off = 1 + max(e[1] for e in ev2)
    later = [[(k, s, n, p, it + r) for k, s, n, p, it in _renamed(ev2[rep:], r * off)]
             for r in (1, 2)]
    assert _canon(ev2 + later[0] + later[1]) == _canon(ev4)
    cap = 0.5 * (two.allocator["peak_allocated"] + two.allocator["peak_reserved"])
    a2, a4 = two.replay(cap), four.replay(cap)
    assert (a2["oom"], a2["peak_reserved"], a2["peak_allocated"]) == \
        (a4["oom"], a4["peak_reserved"], a4["peak_allocated"])
    assert a2["steady"] and a4["steady"]
    assert two.min_capacity() == four.min_capacity()


def test_one_traced_step_is_not_repeated():
    # the first step creates the lazy state (Adam moments, ...): it is not what later steps do
    res = dry_run(paper_cfg(2, "c1", batch=1), iterations=1)
    assert repeat_start(res.judged_events()) is None
    assert res.allocator["repeats"] == 0


class _PatternJudge:
    """Every fit pattern of depths 101..108 (100 and below fit, 109 and above do not), the
    needed capacity on a line crossing the capacity at 104.5 away from the band; a round = one
    judgement not run beside another (``prefetch``)."""

    CAP = 30e9

    def __init__(self, pattern: dict):
        self.pattern, self.memo, self.calls, self.prefetched = pattern, {}, [], []

    def fits(self, n: int) -> bool:
        return self.pattern.get(n, n <= 100)

    def need(self, n: int) -> int:
        if 101 <= n <= 108:
            return int(self.CAP - 1e6 if self.fits(n) else self.CAP + 1e6)
        return int(self.CAP + (n - 104.5) * 0.13e9)

    def prefetch(self, n: int) -> None:
        self.prefetched.append(n)

    def steer(self, j):
        return j.min_capacity, 0

    def __call__(self, n: int) -> bool:
        if n not in self.memo:
            self.calls.append(n)
            self.memo[n] = maxsize.Judgement(n, self.fits(n), 0, 0, 0, 0, 0.0, 0, self.need(n))
        return self.memo[n].fits


def test_search_answer_holds_for_every_fit_pattern_near_the_top():
    """Exhaustive: for each of the 256 patterns and 3 seeds the answer fits, its LOOKAHEAD
    depths do not, no judged depth above it fits -- and the end game (``_plan``) decides in
    few rounds: 3.45 on average, 6 at worst (the rule before it, bisecting in thirds and
    then checking the look-ahead: 4.11 and 9)."""
    rounds = []
    for bits in itertools.product((True, False), repeat=8):
        for seed in (100, 104, 108):
            judge = _PatternJudge(dict(zip(range(101, 109), bits)))
            probes = [(20, judge.need(20)), (40, judge.need(40))]
            n = depth_search.search(judge, seed, 2000, probes, judge.CAP, pairs=True)
            assert judge.fits(n) and not any(judge.fits(n + k)
                                             for k in range(1, depth_search.LOOKAHEAD + 1))
            assert not [d for d in judge.calls if d > n and judge.fits(d)], (bits, seed)
            assert set(judge.prefetched) <= set(judge.calls)
            rounds.append(len(judge.calls) - len(judge.prefetched))
    assert max(rounds) <= 6 and sum(rounds) / len(rounds) <= 3.5, collections.Counter(rounds)


def test_plan_finishes_a_bracket_with_its_look_ahead_in_one_round():
    # paper2020 C5's end: 192 fits, 196 and 198 do not; 195 and 197 decide it (if 195 fits
    # and 197 does not: 195) where bisecting took three rounds (193+194, 195, 197)
    assert depth_search.plan({192: True, 196: False, 198: False, 202: False}, 2, 2000) == (197, 195)
    assert depth_search.plan({100: True, 102: False}, 1, 2000) == (101,)  # serial: the one open
    assert depth_search.plan({100: True, 101: False, 102: False}, 2, 2000) == ()  # decided


def test_dry_run_without_details_judges_the_same():
    # the search's dry runs skip the breakdown and the with-build replay, nothing else
    cfg = paper_cfg(2, "c4", batch=1)
    full, lean = dry_run(cfg, details=True), dry_run(cfg, details=False)
    assert full.breakdown and not lean.breakdown
    assert full.allocator_with_build and not lean.allocator_with_build
    assert lean.allocator == full.allocator and lean.trace == full.trace
    assert lean.min_capacity(compute=False) is None
    assert lean.min_capacity() == full.min_capacity() == lean.min_capacity(compute=False)
