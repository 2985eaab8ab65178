"""The bucket transports behind their one contract (``buffer``, ``reduce_scatter``,
``all_gather``, ``all_reduce``, ``held_bytes``) in real spawned ranks: gloo point-to-point
(``PairwiseTransport``), the native collectives (``NativeTransport``, NCCL-shaped, on gloo) and
shared memory (``ShmTransport``, also with slots of a few bytes so that every bucket is many
slot pieces and the slots wrap around while several buckets are in flight). Every collective
gives exactly the sums and the owners' chunks, in place or into separate outputs, on buffers
from ``buffer`` or the torch heap, for an odd group size (3: two peers), several collectives in
flight at once, and counts the bucket's §7 volume; a buffer a collective read in place may be
rewritten once its work is waited (the peers are done reading it); what a transport holds is
what it allocated; a peer that never answers fails the wait after the collective timeout."""
from __future__ import annotations

import gc
import os
import time
import weakref

import pytest
import torch

from zero_repro.runtime.comm.cpu import shm
from zero_repro.runtime.comm.cpu.shm_transport import ShmTransport
from zero_repro.runtime.comm.launch import spawn
from zero_repro.runtime.comm.topology import Topology
from zero_repro.runtime.comm.transport import NativeTransport, PairwiseTransport, bucket_transport
from zero_repro.runtime.comm.work import Scratch

# ZR_CPU_TRANSPORT, the transport it gives, the slot size of the shared-memory segments
MODES = [("pairwise", PairwiseTransport, shm.SLOT_BYTES),
         ("native", NativeTransport, shm.SLOT_BYTES),
         ("shm", ShmTransport, shm.SLOT_BYTES),
         ("shm", ShmTransport, 16)]  # 16 bytes: one or two float64 per slot piece

N_BUCKETS, CHUNK = 3, 5
STEPS = 2  # every buffer is written, reduced in place and written again


def _rank(rank: int, world: int, slot_bytes: int) -> dict:
    shm.SLOT_BYTES = slot_bytes
    topo = Topology.build(tp=1)
    t = bucket_transport(topo.dp_group)
    n = CHUNK * world
    # heap buckets into separate outputs: bucket k on rank r holds (r + 1) * (k * n + i)
    works, outs = [], []
    for k in range(N_BUCKETS):
        b = (rank + 1) * torch.arange(k * n, (k + 1) * n, dtype=torch.float64)
        outs.append(torch.full((CHUNK,), -1.0, dtype=torch.float64))
        works.append(t.reduce_scatter(outs[-1], b))
    for w in works:  # every bucket started before any is waited
        w.wait()
    reduced = [o.clone() for o in outs]
    full = [torch.full((n,), -1.0, dtype=torch.float64) for _ in range(N_BUCKETS)]
    works = [t.all_gather(f, torch.full((CHUNK,), 100.0 * rank + k, dtype=torch.float64))
             for k, f in enumerate(full)]
    for w in works:
        w.wait()
    # all-reduce of random fp32 buckets (not a multiple of the group size), waited in reverse
    torch.manual_seed(rank)
    summed = [torch.randn(7 * k + 3) for k in range(N_BUCKETS)]
    parts = [s.clone() for s in summed]
    works = [t.all_reduce(s) for s in summed]
    for w in reversed(works):
        w.wait()
    ledger = topo.ledger.as_dict()
    held = t.held_bytes()
    # the same in place, on one buffer from ``buffer`` (shared memory on one host: read in
    # place by the peers), rewritten every step once the last step's works are waited
    buf, steps = t.buffer(21 + 3 * n, torch.float32), []
    for step in range(STEPS):
        buf.copy_(torch.arange(buf.numel(), dtype=torch.float32) * (rank + 1) + step)
        ar = [buf[:10], buf[10:21]]  # 10 and 11 elements: tails at world 3
        rs = [buf[21:21 + n], buf[21 + n:21 + 2 * n]]
        ag = buf[21 + 2 * n:21 + 3 * n]
        mine = ag[rank * CHUNK:(rank + 1) * CHUNK]
        mine.fill_(100.0 * rank + step)
        works = [t.all_reduce(b) for b in ar]
        works += [t.reduce_scatter(b[rank * CHUNK:(rank + 1) * CHUNK], b) for b in rs]
        works.append(t.all_gather(ag, mine))
        if rank == world - 1 and step == 0:
            time.sleep(0.5)  # the last rank reads late: its peers must not run ahead
        for w in works:
            w.wait()
        steps.append({"ar": [b.clone() for b in ar],
                      "rs": [b[rank * CHUNK:(rank + 1) * CHUNK].clone() for b in rs],
                      "ag": ag.clone()})
    return {"kind": type(t).__name__, "reduced": reduced, "gathered": full,
            "summed": summed, "parts": parts, "ledger": ledger, "steps": steps, "held": held,
            "shared": getattr(t, "channel", None) is not None and
            t.channel.region_of(buf) is not None}


def _every_mode(rank: int, world: int) -> dict:
    """``_rank`` for each of ``MODES`` in turn on the same three ranks, each on groups of its
    own (``Topology.build``): ``ZR_CPU_TRANSPORT`` is read when ``bucket_transport`` picks the
    transport, and ``shm.SLOT_BYTES`` when a channel is mapped and used."""
    out = {}
    for mode, _, slot_bytes in MODES:
        os.environ["ZR_CPU_TRANSPORT"] = mode
        try:
            out[(mode, slot_bytes)] = _rank(rank, world, slot_bytes)
        except Exception as e:
            raise RuntimeError(f"ZR_CPU_TRANSPORT={mode}, SLOT_BYTES={slot_bytes}: {e}") from e
        gc.collect()  # this mode's transport and its segments go before the next one's
    return out


@pytest.fixture(scope="module")
def world3_every_mode() -> list[dict]:
    """``_every_mode`` on three ranks: one spawn for the four cases below, not four."""
    return spawn(_every_mode, 3)


@pytest.mark.parametrize("mode,kind,slot_bytes", MODES)
def test_bucket_collectives_are_exact_at_world_3(world3_every_mode, mode, kind, slot_bytes):
    world = 3
    res = [r[(mode, slot_bytes)] for r in world3_every_mode]
    n = CHUNK * world
    total = sum(r + 1 for r in range(world))  # rank r contributes (r + 1) * value
    for k in range(N_BUCKETS):  # the all-reduce: the same bits on every rank, the right sum
        want = sum(r["parts"][k].double() for r in res)
        assert torch.allclose(res[0]["summed"][k].double(), want, rtol=1e-6, atol=1e-6)
        assert all(torch.equal(r["summed"][k], res[0]["summed"][k]) for r in res)
    for step in range(STEPS):  # in place, on a buffer rewritten every step
        full = torch.arange(21 + 2 * n, dtype=torch.float32) * total + world * step
        for rank, r in enumerate(res):
            got = r["steps"][step]
            assert torch.equal(got["ar"][0], full[:10]) and torch.equal(got["ar"][1], full[10:21])
            for k, o in enumerate(got["rs"]):
                lo = 21 + k * n + rank * CHUNK
                assert torch.equal(o, full[lo:lo + CHUNK]), (step, rank, k)
            gathered = torch.cat([torch.full((CHUNK,), 100.0 * q + step) for q in range(world)])
            assert torch.equal(got["ag"], gathered), (step, rank)
    for rank, r in enumerate(res):
        assert r["kind"] == kind.__name__
        assert r["shared"] == (kind is ShmTransport)  # shared memory: buffers the peers map
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
        # what the transport holds: the slots (shared memory), the receive scratch of at most
        # 2 reduce-scatters in flight (pairwise into separate outputs: the first peer's part
        # lands in the output, (N - 2) chunks each), nothing else (native: separate outputs
        # need no staging)
        want_held = {ShmTransport: shm.HEADER_BYTES + shm.SLOTS * slot_bytes,
                     PairwiseTransport: 2 * (world - 2) * CHUNK * 8, NativeTransport: 0}[kind]
        assert r["held"] == want_held, (kind, r["held"])


def _in_place_native(rank: int, world: int) -> dict:
    """Native requests whose output aliases the input: staged through at most 2 scratch
    chunks, the third collective waits for the oldest one's."""
    t = bucket_transport(Topology.build(tp=1).dp_group)
    n = CHUNK * world
    bufs = [(rank + 1) * torch.arange(n, dtype=torch.float32) + k for k in range(3)]
    works = [t.reduce_scatter(b[rank * CHUNK:(rank + 1) * CHUNK], b) for b in bufs]
    first_done = works[0].done  # the third had to wait for the first one's scratch
    for w in works:
        w.wait()
    return {"own": [b[rank * CHUNK:(rank + 1) * CHUNK].clone() for b in bufs],
            "held": t.held_bytes(), "first_done": first_done}


def test_native_in_place_requests_hold_at_most_two_chunks_of_scratch(monkeypatch):
    monkeypatch.setenv("ZR_CPU_TRANSPORT", "native")
    world = 2
    res = spawn(_in_place_native, world)
    total = sum(q + 1 for q in range(world))
    for rank, r in enumerate(res):
        for k, own in enumerate(r["own"]):
            want = total * torch.arange(rank * CHUNK, (rank + 1) * CHUNK,
                                        dtype=torch.float32) + world * k
            assert torch.equal(own, want), (rank, k)
        assert r["held"] == 2 * CHUNK * 4 and r["first_done"]


def _peer_never_sends(rank: int, world: int, done: str) -> str:
    topo = Topology.build(tp=1)
    t = bucket_transport(topo.dp_group)
    if rank == 1:  # alive, but never takes part, until rank 0's wait ended (8 s at most)
        end = time.monotonic() + 8
        while not os.path.exists(done) and time.monotonic() < end:
            time.sleep(0.05)
        return "idle"
    full = torch.zeros(2 * CHUNK)
    t0 = time.monotonic()
    try:
        t.all_gather(full, full[:CHUNK]).wait()
    except RuntimeError as e:
        return f"raised after {time.monotonic() - t0:.1f} s: {e}"
    finally:
        open(done, "w").close()
    return "returned"


@pytest.mark.parametrize("mode", ["pairwise", "shm"])
def test_a_silent_peer_fails_the_wait_after_the_collective_timeout(monkeypatch, mode, tmp_path):
    monkeypatch.setenv("ZR_CPU_TRANSPORT", mode)
    res = spawn(_peer_never_sends, 2, str(tmp_path / "rank0_done"), timeout_s=2.0)
    assert res[0].startswith("raised after"), res[0]
    waited = float(res[0].split()[2])
    assert 1.5 <= waited <= 6.0, res[0]


def _slow_reader(rank: int, world: int, wait_readers: bool) -> list:
    if not wait_readers:
        shm.Channel.await_readers = lambda self, through: None  # to show the test can fail
    t = bucket_transport(Topology.build(tp=1).dp_group)
    n = CHUNK * world
    buf, outs = t.buffer(n, torch.float32), []
    for step in range(2):
        buf.copy_(torch.full((n,), 10.0 * step + rank))  # the last step's readers are done
        out = torch.empty(CHUNK)
        work = t.reduce_scatter(out, buf)
        if rank == world - 1 and step == 0:
            time.sleep(0.5)  # the last rank reads late: its peers are a step ahead
        work.wait()
        outs.append(out)
    return outs


@pytest.mark.parametrize("wait_readers", [True, False])
def test_a_shared_buffer_is_not_rewritten_before_its_readers_are_done(monkeypatch,
                                                                      wait_readers):
    """On shared memory the peers read this rank's buffer in place: ``wait`` returns only
    once they have (without that the late reader sums the next step's values)."""
    monkeypatch.setenv("ZR_CPU_TRANSPORT", "shm")
    world = 3
    res = spawn(_slow_reader, world, wait_readers)
    want = [torch.full((CHUNK,), float(sum(10 * step + q for q in range(world))))
            for step in range(2)]
    ok = all(torch.equal(o, w) for r in res for o, w in zip(r, want))
    assert ok == wait_readers, res


def test_a_waited_collective_holds_nothing_past_its_owner():
    """``Scratch.run``'s completion names its own ``Work``; once waited, the pair must not stay
    in a reference cycle with the scratch and the collective's tensors (they would live until
    the collector runs: a peak that depends on the collector's timing). With the collector off,
    the tensors the completion used die with their last owner."""
    scratch = Scratch(depth=1, device="cpu")
    ran, outs = [], []

    def start(buf):
        buf.fill_(1.0)
        out = torch.zeros(8)  # the collective's output, held by its completion only
        outs.append(weakref.ref(out))
        return [], lambda: (torch.add(out, buf, out=out), ran.append(float(out.sum())))

    was = gc.isenabled()
    gc.disable()
    try:
        work = scratch.run(8, torch.float32, start)
        lent = weakref.ref(work)
        work.wait()
        assert ran == [8.0]
        assert not scratch.lent and scratch.nbytes == 8 * 4  # the buffer is back in the pool
        del work
        assert lent() is None and outs[0]() is None
    finally:
        if was:
            gc.enable()
