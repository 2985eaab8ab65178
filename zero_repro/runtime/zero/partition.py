"""Pure shard arithmetic for ZeRO-DP (paper §5): flat layout, padding, buckets and ownership
(integers only: no tensors, no communication; tested exhaustively).

One group's parameters (the whole model for stages 0-2, one unit for stage 3) are laid end to end
in ``named_parameters`` order (``layout``) and cut into *buckets* of at most C_B elements (§6.3),
each split into N_d equal *chunks*; DP rank r owns chunk r of every bucket (``Partition``), so a
bucket filled in backward is reduce-scattered as it is and all-gathered the same way after the
step. Invariants: full buckets hold N_d·c elements, c = min(C_B // N_d, ceil(Ψ/N_d)); the last
holds the remainder rounded up to a multiple of N_d (padding < N_d elements per group, always
zero); a rank's shard is padded_numel / N_d elements, so its optimizer state is 12·Ψ/N_d bytes
(+ < 12·N_d bytes of padding per group).
"""
from __future__ import annotations

from dataclasses import dataclass
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
    """Buckets and per-rank ownership of one flat buffer of ``numel`` real elements."""

    def __init__(self, numel: int, world: int, bucket_capacity: int):
        if numel < 0 or world < 1 or bucket_capacity < 1:
            raise ValueError(f"bad partition numel={numel} world={world} "
                             f"bucket_capacity={bucket_capacity}")
        self.numel, self.world = int(numel), int(world)
        chunk = max(1, min(bucket_capacity // world, ceil_div(max(numel, 1), world)))
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
        self.capacity = max((b.size for b in buckets), default=0)  # fused buffer elements

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    def shard_ranges(self, rank: int) -> list[tuple[int, int, int]]:
        """(flat_start, shard_start, length) for every chunk ``rank`` owns."""
        return [(b.owned(rank)[0], b.shard_offset, b.chunk) for b in self.buckets]

    def buckets_of(self, offset: int, numel: int) -> list[Bucket]:
        """Buckets that intersect the flat range [offset, offset + numel)."""
        return [b for b in self.buckets if intersect(b.start, b.end, offset, offset + numel)]

    def real_in_bucket(self, b: Bucket) -> int:
        """Real (non-padding) elements of bucket ``b``."""
        return max(0, min(b.end, self.numel) - b.start)

    def describe(self) -> dict:
        return {"numel": self.numel, "padded_numel": self.padded_numel, "world": self.world,
                "shard_numel": self.shard_numel,
                "buckets": [(b.start, b.size, b.chunk) for b in self.buckets]}


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
