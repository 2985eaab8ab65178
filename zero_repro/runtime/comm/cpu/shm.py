"""Shared-memory channel: how CPU (gloo) ranks on one host move bucket chunks without sockets.

gloo carries every byte of a CPU collective through a loopback TCP socket: the sender's kernel
copies it into a socket buffer, the receiver's copies it out, and on a 2-core machine gloo's
threads take those cycles from the ranks' compute. Ranks on one host can instead read each
other's memory (as NCCL does inside a node through its shared-memory / P2P transports): each
rank of a group maps one segment of ``/dev/shm`` per group rank, writes what its peers need
into its own segment and reads what it needs from theirs. Measured (world 2, 2 cores, Ψ =
41.6M fp32 in 2M buckets, 2026-12-02, ``/work`` microbench of this design): reduce-scatter
22 ms vs gloo point-to-point 73-85 ms, all-gather 21 ms vs 62-75 ms.

A segment holds a header (this rank's counters) and ``SLOTS`` slots of ``SLOT_BYTES``. A
collective is cut into *pieces* that each fit one slot; pieces get consecutive sequence
numbers, in the order the collectives are issued (the same on every rank, as collectives
are), and piece ``j`` lives in slot ``j % SLOTS`` of every segment. Two counters per rank,
each written only by its rank:

* ``ready``: every piece through it is written into this rank's slots (publish),
* ``done``: this rank has read every peer's piece through it (consume).

A rank may write piece ``j`` once every rank's ``done`` is at least ``j - SLOTS`` (the slot's
previous piece is read, by the peers and by itself: an all-reduce reads its own slot too), and may read it once every peer's ``ready`` is at least ``j``. Pieces
are published when issued if their slot is free (the peers can start on them while this rank
computes), else when waited; a wait completes every earlier piece first, in order, so every
rank moves through the pieces in one order, as through blocking collectives, and nothing
waits on a piece its peer cannot reach. Waits poll with ``sched_yield``, then with short sleeps,
and give up after the
world's collective timeout (a dead or hung peer fails the wait, naming it). x86-64 only: its
stores become visible in program order, so a counter is never seen before the data it covers
(other architectures would need fences: they stay on gloo).

*Shared buffers* (``Channel.shared_buffer``) go one copy further: a buffer every peer maps (a
stage's persistent buckets and shards) needs no slots at all: a collective on a view of it
publishes nothing but its counter and the peers read the values in place (a piece's write is a
no-op). Its owner may write it again only once every peer has read it: ``await_readers`` waits
for the peers' ``done`` to pass the collective's last piece (the transport's ``wait`` does).
An all-reduce's gather half is published only after its reduce-scatter half is read, so the
sums it overwrites are never ones a peer still has to read.

Segments are created when a group first builds a bucket transport (``channel_for``), checked
to be shared (every rank reads every peer's magic word through its own mapping; ranks on other
hosts see no file or another one) and unlinked at once: the mappings stay, nothing is left in
``/dev/shm`` when a rank dies. ``ZR_CPU_TRANSPORT`` picks the mode: ``auto`` (default) uses
shared memory when it can and gloo point-to-point otherwise, ``shm`` requires it (one error
line when it cannot), ``pairwise`` never uses it, ``native`` runs gloo's own reduce-scatter and
all-gather (the NCCL-shaped transport, e.g. to test it on CPU).
"""
from __future__ import annotations

import datetime
import os
import platform
import secrets
import time
from collections import deque
from collections.abc import Callable

import torch

from zero_repro.runtime.comm import comm

MODES = ("auto", "shm", "pairwise", "native")
SLOTS = 4
SLOT_BYTES = 1 << 20
HEADER_BYTES = 64  # int64 words: magic, ready, done
_MAGIC, _READY, _DONE = 0, 1, 2
SHM_DIR = "/dev/shm"
YIELD_POLLS = 2000  # polls of a peer's counter with sched_yield before sleeping between them


def mode() -> str:
    """``ZR_CPU_TRANSPORT``, validated: ``auto`` unless set."""
    want = os.environ.get("ZR_CPU_TRANSPORT", "") or "auto"
    if want not in MODES:
        raise ValueError(f"ZR_CPU_TRANSPORT={want!r}: use one of {', '.join(MODES)}")
    if want == "shm" and not _architecture_ok():
        raise ValueError(f"ZR_CPU_TRANSPORT=shm needs x86-64 (this machine: "
                         f"{platform.machine()}): unset it to use gloo")
    return want


def _architecture_ok() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def segment_bytes() -> int:
    return HEADER_BYTES + SLOTS * SLOT_BYTES


class ShmError(RuntimeError):
    """A shared-memory wait that gave up (a peer died or hung)."""


class Channel:
    """One group's mapped segments and its piece sequence (see the module docstring)."""

    def __init__(self, group: comm.Group, segments: list[torch.Tensor],
                 timeout: datetime.timedelta | None):
        self.group = group
        self.me = group.rank
        self.peers = [q for q in range(group.size) if q != self.me]
        self.segments = segments
        self.flags = [s[:HEADER_BYTES].view(torch.int64).numpy() for s in segments]
        self.timeout_s = (timeout or datetime.timedelta(seconds=300)).total_seconds()
        self.assigned = 0  # sequence number of the last piece issued
        self.published = 0  # of the last piece written into this rank's slots
        self.consumed = 0  # of the last piece read (an all-reduce reads its own slot too)
        # (seq, write, read, written only after the earlier pieces are read), not yet read
        self.pending: deque = deque()
        self.regions: list[Region] = []  # shared buffers (zero-copy collectives)

    # ------------------------------------------------------------------ slots
    def slot(self, rank: int, seq: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        start = HEADER_BYTES + (seq % SLOTS) * SLOT_BYTES
        esize = torch.empty(0, dtype=dtype).element_size()
        return self.segments[rank][start:start + numel * esize].view(dtype)

    def piece_numel(self, dtype: torch.dtype, parts: int) -> int:
        """Elements of one piece when a slot holds ``parts`` of them (one per peer)."""
        esize = torch.empty(0, dtype=dtype).element_size()
        return max(1, SLOT_BYTES // (esize * max(1, parts)))

    # ------------------------------------------------------------------ shared buffers
    def shared_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """Collectively: a zeroed tensor of ``numel`` elements in shared memory that every
        peer maps too (``Region``), or None (no room: the same answer on every rank). A
        collective on a view of it moves nothing through the slots: the peers read it in
        place (``region_of``); this rank writes it again only after ``await_readers``."""
        esize = torch.empty(0, dtype=dtype).element_size()
        segs, _ = _map_all(self.group, HEADER_BYTES + numel * esize, f"buf{len(self.regions)}")
        if segs is None:
            return None
        region = Region([seg[HEADER_BYTES:].view(dtype) for seg in segs], self.me)
        region.tensors[self.me].zero_()
        self.regions.append(region)
        return region.tensors[self.me]

    def region_of(self, t: torch.Tensor) -> tuple[Region, int] | None:
        """(region, element offset of ``t`` in it) when ``t`` is a contiguous view of one of
        this rank's shared buffers, else None."""
        for r in self.regions:
            mine = r.tensors[self.me]
            off = (t.data_ptr() - mine.data_ptr()) // mine.element_size()
            if t.dtype == mine.dtype and t.is_contiguous() and \
                    0 <= off and off + t.numel() <= mine.numel():
                return r, off
        return None

    def await_readers(self, through: int) -> None:
        """Until every peer has read every piece through ``through`` (e.g. this rank's shared
        buffer, read in place by the collectives issued so far): then this rank may write it."""
        self._await(_DONE, through, "the peers' reads of a shared buffer")

    # ------------------------------------------------------------------ pieces
    def issue(self, pieces: list[tuple[Callable[[int], None], Callable[[int], None]]],
              after: int = -1):
        """Queue ``pieces`` = [(write(seq), read(seq))]; write into this rank's slot of the
        piece, read from the peers' slots of it. Pieces from index ``after`` on are written only
        once every earlier piece is read (e.g. an all-reduce's gather of the sums its
        reduce-scatter pieces make). Returns a work handle (waits every piece through the last
        one)."""
        for i, (write, read) in enumerate(pieces):
            self.assigned += 1
            self.pending.append((self.assigned, write, read, 0 <= after <= i))
        self._publish_free()
        return _Work(self, self.assigned)

    def _slot_free(self, seq: int) -> bool:
        need = seq - SLOTS
        return self.consumed >= need and all(self.flags[q][_DONE] >= need for q in self.peers)

    def _publish(self, seq: int, write: Callable[[int], None]) -> None:
        write(seq)
        self.published = seq
        self.flags[self.me][_READY] = seq

    def _publish_free(self) -> None:
        """Publish pending pieces in order while their slots are free (never waits)."""
        for seq, write, _, after_reads in self.pending:
            if seq <= self.published:
                continue
            if seq != self.published + 1 or not self._slot_free(seq) or \
                    (after_reads and self.consumed < seq - 1):
                return
            self._publish(seq, write)

    def complete(self, through: int) -> None:
        """Publish and consume every pending piece through ``through``, in order."""
        while self.pending and self.pending[0][0] <= through:
            seq, write, read, _ = self.pending.popleft()
            if seq > self.published:
                self._await(_DONE, seq - SLOTS, f"slot of piece {seq}")
                self._publish(seq, write)
            self._await(_READY, seq, f"piece {seq}")
            read(seq)
            self.consumed = seq
            self.flags[self.me][_DONE] = seq
            self._publish_free()

    def _await(self, word: int, value: int, what: str) -> None:
        """Until every peer's counter ``word`` reaches ``value``: ``sched_yield`` for the first
        ~2000 polls (a peer usually is microseconds away), then 50 µs sleeps (a rank that waits
        long leaves its core to others, e.g. more ranks than cores); gives up after the
        timeout."""
        start = None
        spins = 0
        for q in self.peers:
            f = self.flags[q]
            while f[word] < value:
                spins += 1
                if spins < YIELD_POLLS:
                    os.sched_yield()
                    continue
                now = time.monotonic()
                start = start or now
                if now - start > self.timeout_s:
                    raise ShmError(  # "timed out": the launcher's mark of a lost peer
                        f"shared-memory transport of group {self.group.name!r}: rank "
                        f"{self.group.global_rank(self.me)} timed out after "
                        f"{now - start:.0f} s waiting for rank {self.group.global_rank(q)} "
                        f"({what}): it died or hangs")
                time.sleep(50e-6)


class Region:
    """A shared buffer: every rank's tensor of it (this rank's is written by it alone; the
    peers' are read in place)."""

    def __init__(self, tensors: list[torch.Tensor], me: int):
        self.tensors, self.me = tensors, me


class _Work:
    """Work handle of an issued collective: ``wait()`` completes its pieces (and any earlier)."""

    def __init__(self, channel: Channel, through: int):
        self.channel, self.through = channel, through

    def wait(self) -> None:
        self.channel.complete(self.through)

    def is_completed(self) -> bool:
        return not self.channel.pending or self.channel.pending[0][0] > self.through


# ---------------------------------------------------------------------- set-up
def _create(path: str, nbytes: int) -> torch.Tensor:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        # reserve the pages now: a full tmpfs then fails here (ENOSPC: gloo is used instead)
        # rather than with SIGBUS when a mapped page is first touched mid-step
        os.posix_fallocate(fd, 0, nbytes)
    except OSError:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def _room() -> int:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def _map_all(group: comm.Group, nbytes: int, what: str) -> tuple[list[torch.Tensor] | None, str]:
    """Collectively: one segment of ``nbytes`` per group rank, created by its rank and mapped by
    every rank, each checked by the magic word at its start (a rank on another host sees no
    file, or another one) and unlinked once all are mapped. Returns (segments, "") or (None,
    why not) -- the same answer on every rank."""
    me = group.rank
    token = comm.all_gather_object(secrets.token_hex(7), group)[0]
    # every rank of the host maps every segment: room for all of them, with a margin
    fits = _architecture_ok() and os.path.isdir(SHM_DIR) and \
        _room() > group.size * nbytes * 1.25
    paths = [os.path.join(SHM_DIR, f"zr-{token}-{group.name}-{what}-{q}")
             for q in range(group.size)]
    mine, why = None, ""
    if fits:
        try:
            mine = _create(paths[me], nbytes)
            mine[:HEADER_BYTES].view(torch.int64)[_MAGIC] = int(token, 16) + me
        except OSError as e:
            why = f"{SHM_DIR}: {e}"
    else:
        why = f"{SHM_DIR} lacks {group.size * nbytes / 2**20:.0f} MiB or not x86-64"
    created = comm.all_gather_object(mine is not None, group)
    segments: list[torch.Tensor | None] = [None] * group.size
    if all(created):
        segments[me] = mine
        for q in range(group.size):
            if q == me:
                continue
            try:
                # torch.from_file would create a missing file: look first, without O_CREAT
                if os.stat(paths[q]).st_size != nbytes:
                    raise OSError(f"{paths[q]} has another size")
                seg = torch.from_file(paths[q], shared=True, size=nbytes, dtype=torch.uint8)
                if int(seg[:HEADER_BYTES].view(torch.int64)[_MAGIC]) == int(token, 16) + q:
                    segments[q] = seg
                else:
                    why = f"rank {group.global_rank(q)}'s segment is another file"
            except (OSError, RuntimeError):
                why = f"rank {group.global_rank(q)} is on another host"
    # (also the point by which every rank has opened every segment or given up: unlink)
    shared = comm.all_gather_object(all(x is not None for x in segments), group)
    if mine is not None:
        os.unlink(paths[me])
    comm.barrier(group)  # and every segment unlinked: none of this group's files is left
    if not all(shared):
        return None, why or "a peer could not"
    return segments, ""  # type: ignore[return-value]


def channel_for(group: comm.Group) -> Channel | None:
    """The shared-memory channel of ``group`` (built once, collectively: every rank of the
    group calls it at the same point), or None where ``mode()`` or the host rules it out.
    Raises ValueError when ``ZR_CPU_TRANSPORT=shm`` and it cannot be had."""
    if group.channel is not None:
        return group.channel
    want = mode()
    if want in ("pairwise", "native") or group.size == 1 or group.backend != "gloo":
        return None
    segments, why = _map_all(group, segment_bytes(), "slots")
    if segments is None:
        if want == "shm":
            raise ValueError(f"ZR_CPU_TRANSPORT=shm but group {group.name!r} cannot share "
                             f"memory ({why}): unset it to use gloo")
        return None
    group.channel = Channel(group, segments, comm.default_timeout())
    return group.channel
