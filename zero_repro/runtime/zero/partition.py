"""Pure shard arithmetic for ZeRO-DP (paper §5): flat layout, padding, buckets and ownership
(integers only: no tensors, no communication; tested exhaustively).

One group's parameters (the whole model for stages 0-2, one unit for stage 3) are laid end to end
in ``named_parameters`` order (``layout``) and cut into *buckets* of at most G = min(R, A)
elements (§6.3: ``zero.reduce_bucket_size`` R per gradient bucket, ``zero.allgather_bucket_size``
A per all-gather bucket; C_B off: one bucket per group), each split into N_d equal *chunks*; DP
rank r owns chunk r of every bucket (``Partition``), and one collective moves one bucket. A
gradient bucket (``grad_buckets``) is the run of consecutive buckets of at most R elements filled
and reduced together, a gather bucket (``gather_buckets``) the run of at most A gathered together
(one of the two is always a single bucket). Invariants: full buckets hold N_d·c elements,
c = min(G // N_d, ceil(Ψ/N_d)); the last holds the remainder rounded up to a multiple of N_d
(padding < N_d elements per group, always zero); a rank's shard is padded_numel / N_d elements,
so its optimizer state is 12·Ψ/N_d bytes (+ < 12·N_d bytes of padding per group).
"""
from __future__ import annotations

from dataclasses import dataclass
from math import gcd
from typing import Iterable, Sequence


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def padded_numel(numel: int, world: int) -> int:
    """``numel`` rounded up to a multiple of ``world``."""
    return ceil_div(numel, world) * world


def intersect(a0: int, a1: int, b0: int, b1: int) -> tuple[int, int] | None:
    """Intersection of half-open ranges [a0, a1) and [b0, b1), or None if empty."""
    lo, hi = max(a0, b0), min(a1, b1)
    return (lo, hi) if lo < hi else None


@dataclass(frozen=True)
class Slot:
    """Where one parameter lives in its group's flat buffer."""

    name: str
    offset: int
    numel: int
    shape: tuple[int, ...]

    @property
    def end(self) -> int:
        return self.offset + self.numel


def layout(names: Sequence[str], shapes: Sequence[Sequence[int]]) -> tuple[list[Slot], int]:
    """Lay parameters end to end; return their slots and the unpadded total."""
    slots, off = [], 0
    for name, shape in zip(names, shapes):
        n = 1
        for d in shape:
            n *= int(d)
        slots.append(Slot(name, off, n, tuple(int(d) for d in shape)))
        off += n
    return slots, off


@dataclass(frozen=True)
class Span:
    """A run of consecutive buckets ``first .. stop - 1`` = flat range [start, end): a gradient
    bucket or a gather bucket."""

    index: int
    first: int
    stop: int
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Bucket:
    index: int
    start: int  # offset of the bucket in the flat buffer
    size: int  # elements, a multiple of world
    chunk: int  # size // world: what each rank owns of this bucket
    shard_offset: int  # where this bucket's chunk sits in a rank's shard

    @property
    def end(self) -> int:
        return self.start + self.size

    def owned(self, rank: int) -> tuple[int, int]:
        """Flat range of the chunk owned by ``rank``."""
        s = self.start + rank * self.chunk
        return s, s + self.chunk


class Partition:
    """Buckets and per-rank ownership of one flat buffer of ``numel`` real elements: gradient
    buckets of at most ``bucket_capacity`` (R) elements, gather buckets of at most
    ``gather_capacity`` (A, default R)."""

    def __init__(self, numel: int, world: int, bucket_capacity: int,
                 gather_capacity: int | None = None):
        gather_capacity = bucket_capacity if gather_capacity is None else gather_capacity
        if numel < 0 or world < 1 or bucket_capacity < 1 or gather_capacity < 1:
            raise ValueError(f"bad partition numel={numel} world={world} "
                             f"bucket_capacity={bucket_capacity} "
                             f"gather_capacity={gather_capacity}")
        self.numel, self.world = int(numel), int(world)
        self.grid = grid = min(bucket_capacity, gather_capacity)
        chunk = max(1, min(grid // world, ceil_div(max(numel, 1), world)))
        full = chunk * world
        buckets, start = [], 0
        while start < numel:
            rem = numel - start
            c = chunk if rem >= full else ceil_div(rem, world)
            buckets.append(Bucket(len(buckets), start, c * world, c, start // world))
            start += c * world
        self.buckets: list[Bucket] = buckets
        self.padded_numel = start
        self.shard_numel = start // world
        self.grad_buckets = _runs(buckets, bucket_capacity)
        self.gather_buckets = _runs(buckets, gather_capacity)
        # elements of the largest gradient bucket (a fused buffer holds one)
        self.capacity = max((s.size for s in self.grad_buckets), default=0)

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    def shard_ranges(self, rank: int) -> list[tuple[int, int, int]]:
        """(flat_start, shard_start, length) for every chunk ``rank`` owns."""
        return [(b.owned(rank)[0], b.shard_offset, b.chunk) for b in self.buckets]

    def buckets_of(self, offset: int, numel: int) -> list[Bucket]:
        """Buckets that intersect the flat range [offset, offset + numel)."""
        return [b for b in self.buckets if intersect(b.start, b.end, offset, offset + numel)]

    def spans_of(self, spans: list[Span], offset: int, numel: int) -> list[tuple[Span, int, int]]:
        """(span, flat lo, flat hi) of every part of the flat range [offset, offset + numel)
        inside each of ``spans`` (the gradient or the gather buckets), in order."""
        out = []
        for s in spans:
            r = intersect(s.start, s.end, offset, offset + numel)
            if r is not None:
                out.append((s, *r))
        return out

    def real_in(self, s: Span | Bucket) -> int:
        """Real (non-padding) elements of a span or bucket."""
        return max(0, min(s.end, self.numel) - s.start)

    def describe(self) -> dict:
        return {"numel": self.numel, "padded_numel": self.padded_numel, "world": self.world,
                "shard_numel": self.shard_numel,
                "buckets": [(b.start, b.size, b.chunk) for b in self.buckets]}


@dataclass(frozen=True)
class Geometry:
    """What a ``Partition`` holds, counted without building it (closed forms at paper scale)."""

    buckets: int  # collectives (grid buckets)
    chunk: int  # the largest chunk, elements
    grad_buckets: int
    capacity: int  # the largest gradient bucket, elements


def geometry(numel: int, world: int, bucket_capacity: int,
             gather_capacity: int | None = None) -> Geometry:
    """``Partition(numel, world, bucket_capacity, gather_capacity)``'s counts in O(1)."""
    gather_capacity = bucket_capacity if gather_capacity is None else gather_capacity
    if numel <= 0:
        return Geometry(0, 0, 0, 0)
    c = max(1, min(min(bucket_capacity, gather_capacity) // world, ceil_div(numel, world)))
    full = c * world
    f, rem = divmod(numel, full)
    last = ceil_div(rem, world) * world  # the last, smaller bucket (0: none)
    k = max(1, bucket_capacity // full)  # full buckets per gradient bucket
    runs, cap = f // k, k * full if f >= k else 0
    left = f % k
    if left or last:
        if not left and runs and cap + last <= bucket_capacity:  # it joins the last full run
            cap = max(cap, cap + last)
        else:
            runs += 1
            cap = max(cap, left * full + last)
    return Geometry(f + (1 if last else 0), c, runs, cap)


def row_grid(cols: int, world: int, bucket_capacity: int, gather_capacity: int,
             limit: int) -> int:
    """The bucket grid of a table of rows of ``cols`` elements gathered a row slice at a time
    (stage 3's vocabulary table): min(R, A, ``limit``) rounded down to a multiple of
    lcm(cols, world), at least that: every full bucket is whole rows and splits into equal
    chunks."""
    step = cols * world // gcd(cols, world)
    return max(step, min(bucket_capacity, gather_capacity, limit) // step * step)


def _runs(buckets: list[Bucket], capacity: int) -> list[Span]:
    """Consecutive buckets grouped greedily into runs of at most ``capacity`` elements (at
    least one bucket each)."""
    runs: list[Span] = []
    i = 0
    while i < len(buckets):
        j, size = i + 1, buckets[i].size
        while j < len(buckets) and size + buckets[j].size <= capacity:
            size += buckets[j].size
            j += 1
        runs.append(Span(len(runs), i, j, buckets[i].start, buckets[j - 1].end))
        i = j
    return runs


def counted_subranges(slots: Iterable[Slot], counted: set[str], lo: int, hi: int
                      ) -> list[tuple[int, int]]:
    """Sub-ranges of the flat range [lo, hi), relative to ``lo``, that belong to parameters in
    ``counted`` (used for the grad norm: TP-replicated parameters are counted on one TP rank)."""
    out = []
    for s in slots:
        if s.name in counted:
            r = intersect(s.offset, s.end, lo, hi)
            if r is not None:
                out.append((r[0] - lo, r[1] - lo))
    return out
