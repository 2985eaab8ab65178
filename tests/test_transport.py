"""gloo's bucket transports in real spawned ranks, point-to-point (``PairwiseTransport``) and
shared memory (``ShmTransport``, also with slots of a few bytes so that every bucket is many
pieces and the slots wrap around while several buckets are in flight): the reduce-scatter,
all-gather and all-reduce of a bucket give exactly the sums and the owners' chunks, for an odd
group size (3: two peers), several buckets in flight at once, and count the bucket's §7
volume; a peer that never answers fails the wait after the collective timeout instead of
hanging it."""
from __future__ import annotations

import time

import pytest
import torch

from zero_repro.runtime.comm.cpu import shm
from zero_repro.runtime.comm.launch import spawn
from zero_repro.runtime.comm.topology import Topology
from zero_repro.runtime.comm.buffers import InFlight
from zero_repro.runtime.comm.transport import (PairwiseTransport, ShmTransport,
                                              bucket_transport)

# ZR_CPU_TRANSPORT, the transport it gives, the slot size of the shared-memory segments
MODES = [("pairwise", PairwiseTransport, shm.SLOT_BYTES), ("shm", ShmTransport, shm.SLOT_BYTES),
         ("shm", ShmTransport, 16)]  # 16 bytes: one or two float64 per piece

N_BUCKETS, CHUNK = 3, 5


def _rank(rank: int, world: int, slot_bytes: int) -> dict:
    shm.SLOT_BYTES = slot_bytes
    topo = Topology.build(tp=1)
    g = topo.dp_group
    t = bucket_transport(g)
    n = CHUNK * world
    # bucket k on rank r: (r + 1) * (k * n + i) for i in [0, n)
    buckets = [(rank + 1) * torch.arange(k * n, (k + 1) * n, dtype=torch.float64)
               for k in range(N_BUCKETS)]
    inflight, outs = InFlight(1 << 30), []
    for b in buckets:  # every bucket launched before any is waited
        scratch = torch.empty(t.scratch_numel(CHUNK), dtype=torch.float64)
        works, out = t.reduce_scatter(b, scratch)
        inflight.launch(works, lambda: None)
        outs.append(out)
    inflight.wait_all()
    reduced = [o.clone() for o in outs]
    # all-gather: each rank's chunk k of a bucket holds 100 * rank + k
    full = [torch.full((n,), -1.0, dtype=torch.float64) for _ in range(N_BUCKETS)]
    works = []
    for k, f in enumerate(full):
        works += t.all_gather(f, torch.full((CHUNK,), 100.0 * rank + k, dtype=torch.float64))
    for w in works:
        w.wait()
    # all-reduce of random fp32 buckets (not a multiple of the group size), waited in reverse
    torch.manual_seed(rank)
    summed = [torch.randn(7 * k + 3) for k in range(N_BUCKETS)]
    parts = [s.clone() for s in summed]
    works = [t.all_reduce(s) for s in summed]
    for w in reversed(works):
        for h in w:
            h.wait()
    ledger = topo.ledger.as_dict()
    # the same on a buffer the peers read in place (shared memory only): two steps, each
    # rank rewriting its buffer after the fence, every bucket all-reduced or reduce-scattered
    shared, steps = t.shared_buffer(3 * 7 + 3 * n, torch.float32), []
    for step in range(2 if shared is not None else 0):
        t.fence(shared)
        shared.copy_(torch.arange(shared.numel(), dtype=torch.float32) * (rank + 1) + step)
        ar = [shared[:10], shared[10:21]]  # 10 and 11 elements: tails at world 3
        rs = [shared[21:21 + n], shared[21 + n:21 + 2 * n]]
        ag = shared[21 + 2 * n:21 + 3 * n]  # the own chunk is this rank's: read in place
        ag[rank * CHUNK:(rank + 1) * CHUNK] = 100.0 * rank + step
        works = [w for b in ar for w in t.all_reduce(b)]
        outs = []
        for b in rs:
            w, out = t.reduce_scatter(b)
            works += w
            outs.append(out)
        works += t.all_gather_in_place(ag)
        for w in works:
            w.wait()
        steps.append({"ar": [b.clone() for b in ar], "rs": [o.clone() for o in outs],
                      "ag": ag.clone()})
    return {"kind": type(t).__name__, "reduced": reduced, "gathered": full,
            "summed": summed, "parts": parts, "ledger": ledger, "shared_steps": steps}


@pytest.mark.parametrize("mode,kind,slot_bytes", MODES)
def test_bucket_collectives_are_exact_at_world_3(monkeypatch, mode, kind, slot_bytes):
    monkeypatch.setenv("ZR_CPU_TRANSPORT", mode)
    world = 3
    res = spawn(_rank, world, slot_bytes)
    n = CHUNK * world
    total = sum(r + 1 for r in range(world))  # rank r contributes (r + 1) * value
    for k in range(N_BUCKETS):  # the all-reduce: the same bits on every rank, the right sum
        want = sum(r["parts"][k].double() for r in res)
        assert torch.allclose(res[0]["summed"][k].double(), want, rtol=1e-6, atol=1e-6)
        assert all(torch.equal(r["summed"][k], res[0]["summed"][k]) for r in res)
    total_w = sum(q + 1 for q in range(world))
    for step in range(2 if kind is ShmTransport else 0):  # the shared buffer's steps
        full = torch.arange(21 + 2 * n, dtype=torch.float32) * total_w + world * step
        for rank, r in enumerate(res):
            got = r["shared_steps"][step]
            assert torch.equal(got["ar"][0], full[:10]) and torch.equal(got["ar"][1], full[10:21])
            for k, o in enumerate(got["rs"]):
                lo = 21 + k * n + rank * CHUNK
                assert torch.equal(o, full[lo:lo + CHUNK]), (step, rank, k)
            gathered = torch.cat([torch.full((CHUNK,), 100.0 * q + step) for q in range(world)])
            assert torch.equal(got["ag"], gathered), (step, rank)
    for rank, r in enumerate(res):
        assert r["kind"] == kind.__name__
        for k in range(N_BUCKETS):
            own = torch.arange(k * n + rank * CHUNK, k * n + (rank + 1) * CHUNK,
                               dtype=torch.float64)
            assert torch.equal(r["reduced"][k], total * own), (rank, k)
            want = torch.cat([torch.full((CHUNK,), 100.0 * q + k, dtype=torch.float64)
                              for q in range(world)])
            assert torch.equal(r["gathered"][k], want), (rank, k)
        # the §7 volume of what was moved: N_BUCKETS reduce-scatters and all-gathers of n
        counts = {key: v for key, v in r["ledger"].items() if key.endswith("/dp")}
        assert counts["reduce_scatter/dp"]["elements"] == N_BUCKETS * n, counts
        assert counts["all_gather/dp"]["elements"] == N_BUCKETS * n, counts


def _peer_never_sends(rank: int, world: int) -> str:
    topo = Topology.build(tp=1)
    t = bucket_transport(topo.dp_group)
    if rank == 1:
        time.sleep(8)  # alive, but never takes part
        return "idle"
    full = torch.zeros(2 * CHUNK)
    t0 = time.monotonic()
    try:
        for w in t.all_gather_in_place(full):
            w.wait()
    except RuntimeError as e:
        return f"raised after {time.monotonic() - t0:.1f} s: {e}"
    return "returned"


@pytest.mark.parametrize("mode", ["pairwise", "shm"])
def test_a_silent_peer_fails_the_wait_after_the_collective_timeout(monkeypatch, mode):
    monkeypatch.setenv("ZR_CPU_TRANSPORT", mode)
    res = spawn(_peer_never_sends, 2, timeout_s=2.0)
    assert res[0].startswith("raised after"), res[0]
    waited = float(res[0].split()[2])
    assert 1.5 <= waited <= 6.0, res[0]


def _slow_reader(rank: int, world: int, fence: bool) -> list:
    if not fence:
        shm.Channel.fence = lambda self, buf: None  # to show the test can fail
    t = bucket_transport(Topology.build(tp=1).dp_group)
    n = CHUNK * world
    shared, outs = t.shared_buffer(n, torch.float32), []
    for step in range(2):
        t.fence(shared)  # the peers have read the last step's values: overwrite them
        shared.copy_(torch.full((n,), 10.0 * step + rank))
        works, out = t.reduce_scatter(shared)
        if rank == world - 1 and step == 0:
            time.sleep(0.5)  # the last rank reads late: its peers are a step ahead
        for w in works:
            w.wait()
        outs.append(out.clone())
    return outs


@pytest.mark.parametrize("fence", [True, False])
def test_a_shared_buffer_is_not_rewritten_before_its_readers_are_done(monkeypatch, fence):
    monkeypatch.setenv("ZR_CPU_TRANSPORT", "shm")
    world = 3
    res = spawn(_slow_reader, world, fence)
    want = [torch.full((CHUNK,), float(sum(10 * step + q for q in range(world))))
            for step in range(2)]
    ok = all(torch.equal(o, w) for r in res for o, w in zip(r, want))
    assert ok == fence, res  # without the fence the late reader sums the next step's values


def _late_view_reader(rank: int, world: int, release: bool) -> list:
    if not release:
        shm.Channel.release = lambda self, buf: None  # to show the test can fail
    t = bucket_transport(Topology.build(tp=1).dp_group)
    n = 2 * world + 1  # a tail of one element: summed by every rank in place
    shared, got = t.shared_buffer(n, torch.float32), []
    for step in range(2):
        t.fence(shared)
        shared.copy_(torch.arange(n, dtype=torch.float32) * (rank + 1) + 10.0 * step)
        works, views = t.all_reduce_views(shared)
        for w in works:
            w.wait()
        if rank == world - 1 and step == 0:
            time.sleep(0.5)  # reads the peers' sums late, in place: they are a step ahead
        got.append((len(views), torch.cat([v.clone() for v in views])))
        t.release(shared)  # done with the peers' sums: they may write their buffers again
    return got


@pytest.mark.parametrize("release", [True, False])
def test_all_reduce_views_read_the_peers_sums_in_place_until_released(monkeypatch, release):
    """Stage 0's all-reduce on shared memory: only the reduce-scatter half runs, each rank's
    sums are read in its own buffer by the peers; the owner writes again only after every
    reader's ``release`` (without it the late reader sees the next step's raw values)."""
    monkeypatch.setenv("ZR_CPU_TRANSPORT", "shm")
    world = 3
    res = spawn(_late_view_reader, world, release)
    n = 2 * world + 1
    total = sum(q + 1 for q in range(world))
    want = [torch.arange(n, dtype=torch.float32) * total + 10.0 * world * step
            for step in range(2)]
    ok = all(torch.equal(v, w) for r in res for (_, v), w in zip(r, want))
    assert ok == release, res
    assert all(k == world + 1 for r in res for k, _ in r)  # one view per rank + the tail
