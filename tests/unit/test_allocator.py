"""The CUDA caching-allocator model (scale/dryrun/allocator.py) against hand-computed traces."""
from __future__ import annotations

import pytest

from zero_repro.scale.dryrun import allocator as A

MiB = 1 << 20


def test_rounding_and_pools():
    assert [A.round_size(n) for n in (1, 511, 512, 513, 1536)] == [512, 512, 512, 1024, 1536]
    assert A.is_small(A.round_size(MiB)) and not A.is_small(A.round_size(MiB + 1))
    assert A.segment_size(512) == 2 * MiB  # small pool: 2 MiB segments
    assert A.segment_size(A.round_size(MiB + 1)) == 20 * MiB  # 1-10 MiB: 20 MiB segment
    assert A.segment_size(5 * MiB) == 20 * MiB
    assert A.segment_size(10 * MiB) == 10 * MiB  # >= 10 MiB: rounded to 2 MiB
    assert A.segment_size(11 * MiB + 1) == 12 * MiB


def test_small_pool_split_and_best_fit_reuse():
    a = A.CachingAllocator()
    b1 = a.malloc(1000)  # 1024 B block carved from a new 2 MiB segment
    b2 = a.malloc(1000)  # same segment
    assert a.result.n_mallocs == 1 and a.reserved == 2 * MiB
    assert (b1.addr, b2.addr) == (0, 1024)
    a.free(b1, 1000)
    b3 = a.malloc(300)  # best fit: the freed 1024 block, not the ~2 MiB remainder
    assert b3.addr == 0 and b3.size == 512
    assert a.allocated == 512 + 1024
    assert a.result.peak_allocated == 2048 and a.result.peak_reserved == 2 * MiB


def test_large_pool_split_threshold():
    a = A.CachingAllocator()
    x = a.malloc(5 * MiB)  # 20 MiB segment, remainder 15 MiB > 1 MiB: split
    y = a.malloc(12 * MiB)  # fits the 15 MiB remainder: no new segment
    assert a.result.n_mallocs == 1 and y.addr == 5 * MiB
    a.free(x, 5 * MiB)
    a.free(y, 12 * MiB)  # merges back into one free 20 MiB block
    assert a.release_cached() == 20 * MiB and a.reserved == 0
    z = a.malloc(11 * MiB + MiB // 2)  # 12 MiB segment, remainder 0.5 MiB <= 1 MiB: no split
    assert z.size == 12 * MiB and a.allocated == 12 * MiB


def test_capacity_release_then_oom():
    a = A.CachingAllocator(capacity=30 * MiB)
    a.free(a.malloc(5 * MiB), 5 * MiB)  # 20 MiB cached, nothing allocated
    big = a.malloc(25 * MiB)  # 26 MiB segment: 20 + 26 > 30 -> release the cache, retry
    assert a.result.n_releases == 1 and not a.result.oom and a.reserved == 26 * MiB
    assert big.size == 26 * MiB  # remainder 1 MiB is not split off in the large pool
    a.malloc(5 * MiB)  # needs a 20 MiB segment; nothing cached to release
    assert a.result.oom and a.result.oom_request == 5 * MiB
    assert a.result.peak_reserved == 46 * MiB  # how far past the capacity it would go


def test_replay_out_of_memory_with_free_memory():
    # §6.3's failure: a freed short-lived tensor between two long-lived ones leaves a hole; the
    # segment has 8 MiB free in two pieces (6 + 2) but a 7 MiB request cannot be served, and
    # the capacity leaves no room for a new 20 MiB segment
    ev = [("alloc", 0, 6 * MiB), ("alloc", 1, 6 * MiB), ("alloc", 2, 6 * MiB),
          ("free", 1, 6 * MiB), ("alloc", 3, 7 * MiB)]
    r = A.replay(ev, capacity=20 * MiB)
    assert r.oom and r.oom_request == 7 * MiB
    assert r.peak_allocated == 19 * MiB and r.peak_reserved == 40 * MiB  # went on regardless
    # without the hole (the long-lived tensors contiguous, as M_D arranges) it fits
    ev_md = [("alloc", 0, 6 * MiB), ("alloc", 2, 6 * MiB), ("alloc", 1, 6 * MiB),
             ("free", 1, 6 * MiB), ("alloc", 3, 7 * MiB)]
    r_md = A.replay(ev_md, capacity=20 * MiB)
    assert not r_md.oom and r_md.peak_reserved == 20 * MiB
    # the 7 MiB request takes the whole 8 MiB block: a 1 MiB remainder is not split off
    assert r_md.peak_allocated == 20 * MiB and r_md.fragmentation == 0.0


def test_training_trace_drops_build_temporaries():
    ev = [("alloc", 0, 100, "build", 0), ("alloc", 1, 50, "build", 0), ("free", 0, 100, "build", 0),
          ("alloc", 2, 10, "forward", 0), ("free", 2, 10, "forward", 0)]
    t = A.training_trace(ev)
    assert [e[1] for e in t] == [1, 2, 2]


@pytest.mark.parametrize("n", [0, -5])
def test_zero_size_requests_allocate_nothing(n):
    a = A.CachingAllocator()
    assert a.malloc(n) is None and a.reserved == 0


# One closed step (it frees all it allocates) whose caching-allocator layout drifts under a
# capacity of 52 MiB. Step 1: a 26 MiB, b and c 12 MiB segments each (50 MiB); b, c freed;
# d (18 MiB) finds no free block >= 18 MiB, would need 68 MiB, so the cached b / c segments are
# released and d gets its own segment (44 MiB); a, d freed. Step 2: a reuses a's segment,
# b is best-fit into d's 18 MiB segment (split 12 + 6), c finds no free 12 MiB block and no
# whole free segment to release: 26 + 18 + 12 = 56 MiB > 52 -> out of memory in step 2.
DRIFT = [("alloc", 1, 25 * MiB, "forward", 1), ("alloc", 2, 12 * MiB, "forward", 1),
         ("alloc", 3, 12 * MiB, "forward", 1), ("free", 2, 12 * MiB, "forward", 1),
         ("free", 3, 12 * MiB, "forward", 1), ("alloc", 4, 18 * MiB, "forward", 1),
         ("free", 1, 25 * MiB, "forward", 1), ("free", 4, 18 * MiB, "forward", 1)]


def test_a_step_that_fits_once_can_run_out_of_memory_when_repeated():
    assert A.closed_from(DRIFT, 0)
    once = A.replay(DRIFT, capacity=52 * MiB)
    assert not once.oom and once.peak_reserved == 50 * MiB
    twice = A.replay(DRIFT + DRIFT, capacity=52 * MiB)  # closed: the same ids again
    assert twice.oom and twice.oom_request == 12 * MiB
    steady = A.replay(DRIFT, capacity=52 * MiB, repeat_from=0)
    assert steady.oom and steady.oom_request == 12 * MiB
    first = A.replay(DRIFT, capacity=52 * MiB, repeat_from=0, stop_at_oom=True)
    assert first.oom and first.repeats == 0  # stopped inside its first repetition
    # the fit threshold with the repetition is the 56 MiB of step 2, not step 1's 50 MiB
    assert A.min_capacity(DRIFT, tol=MiB) <= 51 * MiB
    assert 55 * MiB <= A.min_capacity(DRIFT, tol=MiB, repeat_from=0) <= 57 * MiB


def test_the_steady_replay_equals_the_repetitions_written_out():
    for cap in (56 * MiB, 60 * MiB, 80 * MiB, None):
        st = A.replay(DRIFT, capacity=cap, repeat_from=0)
        assert st.steady and not st.oom and 1 <= st.repeats <= A.MAX_REPEATS
        for extra in (st.repeats, st.repeats + 3):  # past the fixed point nothing changes
            out = A.replay(DRIFT * (1 + extra), capacity=cap)
            assert (out.oom, out.peak_reserved, out.peak_allocated, out.reserved_end) == \
                (st.oom, st.peak_reserved, st.peak_allocated, st.reserved_end)


def test_only_a_closed_step_is_repeated():
    assert not A.closed_from(DRIFT[:-1], 0)  # keeps d into the next step
    assert not A.closed_from([("free", 9, MiB, "forward", 1)] + DRIFT, 0)  # frees older state
    assert A.closed_from([("alloc", 9, MiB, "build", 0)] + DRIFT, 1)


# ------------------------------------------------------------------ streams (PyTorch 1.x)
def test_held_block_is_reused_only_after_a_sync():
    """A block freed while a collective's stream may use it is not handed out, not merged,
    counted in neither allocated nor free bytes, until a sync returns it to the pool."""
    a = A.CachingAllocator()
    x = a.malloc(12 * MiB)  # its own 12 MiB segment
    a.free(x, 12 * MiB, held=True)
    assert a.held == 12 * MiB and a.allocated == 0 and a.result.peak_held == 12 * MiB
    y = a.malloc(12 * MiB)  # the held block cannot serve it: a second segment
    assert a.reserved == 24 * MiB and y.addr != x.addr
    a.sync()
    assert a.held == 0
    z = a.malloc(12 * MiB)  # back in the pool: reused
    assert z.addr == x.addr and a.reserved == 24 * MiB


def test_failed_allocation_first_reclaims_held_blocks_then_releases_segments():
    """free_cached_blocks: synchronize_and_free_events (held blocks to the pool), release the
    completely free segments, retry the cudaMalloc once; the pool is not searched again."""
    a = A.CachingAllocator(capacity=30 * MiB)
    x = a.malloc(12 * MiB)
    a.free(x, 12 * MiB, held=True)
    a.malloc(14 * MiB)  # 26 MiB reserved
    a.malloc(12 * MiB)  # 38 > 30: reclaim the held block, release its segment, retry
    r = a.result
    assert r.n_reclaims == 1 and r.n_releases == 1 and not r.oom and a.reserved == 26 * MiB


def test_replay_of_held_frees_and_sync_events():
    ev = [("alloc", 1, 12 * MiB, "backward", 0), ("free_held", 1, 12 * MiB, "backward", 0),
          ("alloc", 2, 12 * MiB, "backward", 0), ("free", 2, 12 * MiB, "backward", 0),
          ("sync", -1, 0, "backward", 0), ("alloc", 3, 24 * MiB, "step", 0),
          ("free", 3, 24 * MiB, "step", 0)]
    r = A.replay(ev)
    assert r.peak_held == 12 * MiB and r.peak_reserved == 24 * MiB + 24 * MiB
    at_free = A.replay([(("free",) + e[1:]) if e[0] == "free_held" else e
                        for e in ev if e[0] != "sync"])
    assert at_free.peak_reserved == 12 * MiB + 24 * MiB  # the same block reused at once
    assert A.closed_from(ev, 0)


# a closed step whose layout under 68 MiB alternates between two states and never settles
ALTERNATING = [("alloc", 100, 12 * MiB, "build", 0)] + [
    (k, i, n * MiB, "forward", 1) for k, i, n in (
        ("alloc", 5, 18), ("free", 5, 18), ("alloc", 0, 1), ("free", 0, 1), ("alloc", 3, 18),
        ("alloc", 4, 8), ("alloc", 2, 14), ("free", 2, 14), ("free", 3, 18), ("free", 4, 8),
        ("alloc", 1, 22), ("free", 1, 22))]


def test_a_replay_that_cycles_stops_at_the_first_recurring_state():
    plain = A.replay(ALTERNATING, capacity=68 * MiB, repeat_from=1)
    assert not plain.steady and plain.repeats == A.MAX_REPEATS  # a 2-cycle, never a fixed point
    cyc = A.replay(ALTERNATING, capacity=68 * MiB, repeat_from=1, cycles=True)
    assert cyc.steady and cyc.repeats == 2
    assert (cyc.oom, cyc.peak_reserved, cyc.peak_allocated) == \
        (plain.oom, plain.peak_reserved, plain.peak_allocated)


def test_stopping_at_a_cycle_changes_no_fit_decision():
    """Random closed steps over persistent state, every capacity from the peak allocated to
    the peak reserved: the verdict and the peaks with ``cycles`` equal the plain replay's."""
    import random
    rng = random.Random(2)
    for _ in range(150):
        pre = [("alloc", 100 + k, rng.choice([2, 6, 12, 20]) * MiB, "build", 0)
               for k in range(rng.randint(0, 2))]
        sizes = [rng.choice([1, 2, 3, 4, 6, 8, 12, 14, 18, 22, 26, 30]) * MiB
                 for _ in range(rng.randint(3, 6))]
        ev, alive, pending = [], set(), list(range(len(sizes)))
        rng.shuffle(pending)
        while pending or alive:
            if pending and (not alive or rng.random() < 0.5):
                i = pending.pop()
                alive.add(i)
                ev.append(("alloc", i, sizes[i], "forward", 1))
            else:
                i = rng.choice(sorted(alive))
                alive.remove(i)
                ev.append(("free", i, sizes[i], "forward", 1))
        tr = pre + ev
        free = A.replay(tr, repeat_from=len(pre))
        for cap in range(free.peak_allocated, free.peak_reserved + 2 * MiB, 2 * MiB):
            a = A.replay(tr, capacity=cap, repeat_from=len(pre))
            b = A.replay(tr, capacity=cap, repeat_from=len(pre), cycles=True)
            assert (a.oom, a.peak_reserved, a.peak_allocated) == \
                (b.oom, b.peak_reserved, b.peak_allocated)


def test_a_bounded_min_capacity_decides_the_comparison_with_fewer_replays(monkeypatch):
    """``min_capacity(bound=b)`` is on the same side of ``b`` as the full bisection's answer,
    and a bound far from the answer is decided by the unconstrained replay alone."""
    for trace, rep in ((DRIFT, 0), (ALTERNATING, 1)):
        need = A.min_capacity(trace, tol=MiB, repeat_from=rep)
        for b in range(need - 8 * MiB, need + 8 * MiB, MiB // 2):
            got = A.min_capacity(trace, tol=MiB, repeat_from=rep, bound=b)
            assert (got <= b) == (need <= b), (b, got, need)
    calls = []
    real = A.replay
    monkeypatch.setattr(A, "replay", lambda *a, **k: calls.append(k) or real(*a, **k))
    assert A.min_capacity(DRIFT, tol=MiB, repeat_from=0, bound=200 * MiB) <= 200 * MiB
    assert len(calls) == 1  # above the unconstrained peak reserved: no bisection
