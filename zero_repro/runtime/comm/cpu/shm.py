"""Shared-memory channel: CPU (gloo) ranks on one host move bucket chunks without sockets.

Each rank of a group maps one segment per group rank (``channel_for``, built once,
collectively), writes what its peers need into its own segment and reads theirs, as NCCL does
inside a node. A segment has no name (``O_TMPFILE`` in ``SHM_DIR``, whose size limits it): its
creator tells the peers its process and descriptor and a random magic word, they open it
through ``/proc/<pid>/fd`` (as torch.multiprocessing passes descriptors), so nothing in
``SHM_DIR`` can be seen, guessed, planted or left behind by a kill at any instant, and another
account cannot open it. Ranks on another host (boot, host name or PID namespace differ) fall
back to gloo; the reason is kept on the group (``Group.channel_refused``) for the step line.

Protocol (the invariant every collective keeps): a collective is cut into *pieces* that each
fit one of ``SLOTS`` slots of ``SLOT_BYTES``; pieces are numbered in issue order (the same on
every rank) and piece ``j`` lives in slot ``j % SLOTS``. Each rank writes two counters, ``ready``
(pieces published) and ``done`` (peers' pieces consumed). A rank writes piece ``j`` only once
every rank's ``done >= j - SLOTS`` and reads it only once every peer's ``ready >= j``; a wait
completes every earlier piece first, so all ranks move through the pieces in one order and no
wait depends on a piece a peer cannot reach. A dead or hung peer fails the wait after the
world's collective timeout, naming it; a long wait backs off to sleeps of up to
``MAX_SLEEP_S`` (at most ~1/``BACKOFF`` of the time waited so far). x86-64 only: its stores
become visible in program order, so a counter is never seen before the data it covers
(elsewhere ranks stay on gloo).

*Shared buffers* (``Channel.shared_buffer``, a ``Region``) are memory every peer maps: a
collective on a view of one publishes only its counter and the peers read in place; its owner
writes it again only after ``await_readers`` (the peers' ``done`` past the collective's last
piece; the transport's ``wait`` does it). ``ZR_CPU_TRANSPORT`` (``mode()``): ``auto`` (default:
shared memory when possible, else gloo point-to-point), ``shm`` (required; one error line when
impossible), ``pairwise`` (never), ``native`` (gloo's own reduce-scatter / all-gather: the
NCCL-shaped transport on CPU). Timings: ``results/peers/notes.md``.
"""
from __future__ import annotations

import datetime
import errno
import os
import platform
import secrets
import socket
import stat
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
MIN_SLEEP_S, MAX_SLEEP_S = 50e-6, 5e-3  # sleeps between polls after that ...
BACKOFF = 20  # ... of 1/BACKOFF of the time waited so far: at most ~5% late, ~0.5% of a core


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
    """One group's mapped segments and its piece sequence (protocol: the module docstring).
    A piece is published when issued if its slot is free (the peers start on it while this
    rank computes), else when waited."""

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
        ~2000 polls (a peer usually is microseconds away), then sleeps growing with the wait
        (50 µs up to ``MAX_SLEEP_S``: a rank that waits long, e.g. on a stopped peer or with
        more ranks than cores, leaves its core to others); gives up after the timeout."""
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
                time.sleep(min(MAX_SLEEP_S, max(MIN_SLEEP_S, (now - start) / BACKOFF)))


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
def host_identity() -> tuple | None:
    """What ranks that can map each other's segments share: the kernel's boot, the host name
    (a node of its own: its UTS namespace) and the PID namespace (``/proc/<pid>`` names the
    peer). None where ``/proc`` does not tell."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        ns = os.stat("/proc/self/ns/pid")
    except OSError:
        return None
    return boot, socket.gethostname(), ns.st_dev, ns.st_ino


def _open_anonymous(directory: str, nbytes: int) -> int:
    """A file of ``nbytes`` in ``directory``'s filesystem that has no name (``O_TMPFILE``: it
    never appears in the directory, and goes when its last descriptor and mapping do, however
    this process ends), mode 0600, its pages reserved. Where the filesystem has no
    ``O_TMPFILE``: a random name (``O_EXCL``) unlinked at once."""
    try:
        fd = os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_EXCL, 0o600)
    except (AttributeError, IsADirectoryError, OSError) as e:
        if isinstance(e, OSError) and e.errno not in (errno.EOPNOTSUPP, errno.EISDIR,
                                                      errno.EINVAL, errno.ENOENT):
            raise
        path = os.path.join(directory, f"zr-{secrets.token_hex(16)}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.unlink(path)
    try:
        # reserve the pages now: a full tmpfs then fails here (ENOSPC: gloo is used instead)
        # rather than with SIGBUS when a mapped page is first touched mid-step
        os.posix_fallocate(fd, 0, nbytes)
    except OSError:
        os.close(fd)
        raise
    return fd


ROOM_MARGIN = 1.25  # free room a group asks for beyond its segments
ANOTHER_HOST = "another host"  # the reason that is no fall-back: gloo is the transport there


def room() -> int:
    """Free bytes in ``SHM_DIR``."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def room_needed(group_size: int, groups: int = 1, nbytes: int | None = None) -> int:
    """Free bytes ``groups`` groups of ``group_size`` ranks on one host need to map their
    segments of ``nbytes`` (default: the slots, ``segment_bytes``) one group after another:
    each asks for its own segments x ``ROOM_MARGIN`` while the earlier ones hold theirs."""
    seg = group_size * (segment_bytes() if nbytes is None else nbytes)
    return int((groups - 1) * seg + seg * ROOM_MARGIN)


def _own_segment(nbytes: int, need: int) -> tuple[int, torch.Tensor | None, int, str]:
    """(descriptor, mapping, magic word, why not) of this rank's new nameless segment, made
    where ``SHM_DIR`` has ``need`` bytes free."""
    if not (_architecture_ok() and os.path.isdir(SHM_DIR)):
        return -1, None, 0, f"{SHM_DIR} is missing, or this is not x86-64"
    if room() <= need:
        return -1, None, 0, f"{SHM_DIR} has less than {need / 2**20:.0f} MiB free"
    fd = -1
    try:
        fd = _open_anonymous(SHM_DIR, nbytes)
        seg = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=nbytes,
                              dtype=torch.uint8)
        magic = secrets.randbits(62) + 1
        seg[:HEADER_BYTES].view(torch.int64)[_MAGIC] = magic
        return fd, seg, magic, ""
    except (OSError, RuntimeError) as e:
        if fd >= 0:
            os.close(fd)
        return -1, None, 0, f"{SHM_DIR}: {e}"


def _peer_segment(offer: tuple, nbytes: int) -> torch.Tensor:
    """A peer's segment, opened through its descriptor (``/proc/<pid>/fd/<fd>``: only its own
    account may), checked to be a file of ``nbytes`` starting with the magic word it sent."""
    _, pid, fd, magic = offer
    path = f"/proc/{pid}/fd/{fd}"
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode) or st.st_size != nbytes:
        raise OSError(f"{path} is not its segment")
    seg = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    if int(seg[:HEADER_BYTES].view(torch.int64)[_MAGIC]) != magic:
        raise OSError(f"{path} is another file")
    return seg


def _map_all(group: comm.Group, nbytes: int, what: str) -> tuple[list[torch.Tensor] | None, str]:
    """Collectively: one segment of ``nbytes`` per group rank, created by its rank with no name
    (nothing in ``SHM_DIR`` to see, guess, plant or leave behind, whenever a rank is killed) and
    mapped by every peer on the same host through the creator's descriptor; each checked by a
    random magic word its creator tells the peers alone. Returns (segments, "") or (None, why
    not) -- the same answer on every rank. ``what`` names the segments in messages."""
    me = group.rank
    host = host_identity()
    # every rank of the host maps every segment: room for all of them, with a margin
    need = room_needed(group.size, nbytes=nbytes)
    fd, mine, magic, why = _own_segment(nbytes, need) if host is not None else \
        (-1, None, 0, "/proc does not tell the host")
    offers = comm.all_gather_object(
        (host, os.getpid(), fd, magic) if mine is not None else None, group)
    segments: list[torch.Tensor | None] = [None] * group.size
    if all(o is not None for o in offers):
        segments[me] = mine
        for q in range(group.size):
            if q == me:
                continue
            if offers[q][0] != host:
                why = f"rank {group.global_rank(q)} is on {ANOTHER_HOST}"
                continue
            try:
                segments[q] = _peer_segment(offers[q], nbytes)
            except (OSError, RuntimeError) as e:
                why = f"rank {group.global_rank(q)}'s {what} segment cannot be mapped ({e})"
    # also the point by which every peer has opened this rank's descriptor, or given up
    shared = comm.all_gather_object(all(x is not None for x in segments), group)
    if fd >= 0:
        os.close(fd)  # the mappings keep the memory; nothing else does
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
        group.channel_refused = "" if why.endswith(ANOTHER_HOST) else why
        if want == "shm":
            raise ValueError(f"ZR_CPU_TRANSPORT=shm but group {group.name!r} cannot share "
                             f"memory ({why}): unset it to use gloo")
        return None
    group.channel = Channel(group, segments, comm.default_timeout())
    return group.channel
