"""A model of PyTorch's CUDA caching allocator, to replay a dry run's allocation trace and predict
"max cached memory" (paper §10.5, Figure 7: ``max_memory_cached``, today ``max_memory_reserved``)
and the fragmentation M_D removes (§6.3).

Rules modelled (c10/cuda/CUDACachingAllocator.cpp, default configuration: no max_split_size, no
expandable segments, one allocation stream):

  * request rounding: ``round_size(n) = max(512, 512·ceil(n/512))`` (kMinBlockSize = 512 B);
    zero-byte requests allocate nothing;
  * pool choice: rounded size <= 1 MiB (kSmallSize) -> small pool, else large pool;
  * segment size when no cached block fits (``cudaMalloc``): small requests get a 2 MiB
    segment (kSmallBuffer); large requests below 10 MiB (kMinLargeAlloc) a 20 MiB segment
    (kLargeBuffer); larger ones their size rounded up to 2 MiB (kRoundLarge);
  * best fit: the smallest free block of the pool with size >= request (ties: lowest address);
  * split: the remainder becomes a free block if it is >= 512 B (small pool) or > 1 MiB (large
    pool); otherwise the whole block is handed out (internal slack counts as allocated);
  * free: the block returns to its pool and merges with free neighbours of the same segment;
    segments are never returned to the device -- except on allocation failure under a
    ``capacity``: then every completely free segment is released (``cudaFree``, as
    ``release_cached_blocks`` does) and the allocation retried once; if it still does not fit
    the replay records an OOM (and makes the allocation anyway, so ``peak_reserved`` says by
    how much it overflowed).
  * streams (PyTorch 1.x ``recordStream``, events ``free_held`` / ``sync`` of
    ``tracer``): a block freed while a collective's stream may still use it (``free_held``) is
    *held*: not handed out, not merged with its neighbours (``event_count > 0``), counted in
    neither allocated nor free bytes, until the next ``sync`` event returns it to the pool (as
    ``process_events`` does once the stream's event completed); an allocation that would fail
    first returns every held block to the pool (``free_cached_blocks`` ->
    ``synchronize_and_free_events``), then releases the completely free segments and retries
    the ``cudaMalloc`` once -- the pool is not searched again (PyTorch 1.4-1.5
    ``DeviceCachingAllocator::malloc`` / ``free`` / ``free_cached_blocks``; PyTorch's
    ``record_stream`` docs). Today's PyTorch keeps a collective's tensors alive in its ``Work``
    instead (``TORCH_NCCL_AVOID_RECORD_STREAMS``, then always, pytorch/pytorch#76861, #194701):
    the ``modern`` stack's traces carry no held frees.

Steady state (``replay(..., repeat_from=i)``): ``events[i:]`` must be one closed iteration
(``closed_from``: every storage it allocates it frees, or it leaves alive for the next one
exactly what it found); it is repeated until the allocator's state at the end of a repetition (the
ordered segments, the size and in-use flag of every block) equals that of the previous one, so
the result is that of an arbitrarily long run (``ReplayResult.repeats``, ``steady``). Outputs:
``peak_reserved`` (segment bytes, what Figure 7 plots), ``peak_allocated`` (handed-out rounded
bytes), fragmentation = 1 - peak_allocated / peak_reserved; ``min_capacity`` bisects the
smallest capacity a trace fits.
"""
from __future__ import annotations

import math
from bisect import bisect_left, insort
from dataclasses import dataclass

HELD, SYNC = "free_held", "sync"  # event kinds of a stream-aware trace (``tracer``)

MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = 1 << 20  # kSmallSize: largest "small" request
SMALL_BUFFER = 2 << 20  # kSmallBuffer: small-pool segment
LARGE_BUFFER = 20 << 20  # kLargeBuffer: segment for 1-10 MiB requests
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc
ROUND_LARGE = 2 << 20  # kRoundLarge
ADDR_BITS = 56  # a free block's key: size << ADDR_BITS | addr (addresses stay below 2**56)


def round_size(n: int) -> int:
    """Bytes the allocator hands out for a request of ``n`` bytes."""
    if n < MIN_BLOCK:
        return MIN_BLOCK
    return MIN_BLOCK * ((n + MIN_BLOCK - 1) // MIN_BLOCK)


def is_small(rounded: int) -> bool:
    return rounded <= SMALL_SIZE


def segment_size(rounded: int) -> int:
    """``cudaMalloc`` size for a request that no cached block can serve."""
    if rounded <= SMALL_SIZE:
        return SMALL_BUFFER
    if rounded < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * ((rounded + ROUND_LARGE - 1) // ROUND_LARGE)


def should_split(small: bool, block_size: int, rounded: int) -> bool:
    remaining = block_size - rounded
    return remaining >= MIN_BLOCK if small else remaining > SMALL_SIZE


class _Block:
    __slots__ = ("seg", "addr", "size", "allocated", "prev", "next", "small")

    def __init__(self, seg: int, addr: int, size: int, small: bool):
        self.seg, self.addr, self.size, self.small = seg, addr, size, small
        self.allocated = False
        self.prev: _Block | None = None
        self.next: _Block | None = None


class AllocatorOOM(MemoryError):
    pass


@dataclass
class ReplayResult:
    peak_allocated: int = 0  # rounded block bytes handed out, high-water mark
    peak_requested: int = 0  # requested (unrounded) bytes live, high-water mark
    peak_reserved: int = 0  # segment bytes, high-water mark ("max cached memory")
    reserved_end: int = 0
    n_segments_peak: int = 0
    n_mallocs: int = 0
    n_releases: int = 0  # segments released on allocation failure
    peak_held: int = 0  # bytes of blocks held for a collective's stream, high-water mark
    n_reclaims: int = 0  # failed allocations that first returned the held blocks to the pool
    oom: bool = False
    oom_request: int = 0  # first request that did not fit (rounded bytes)
    capacity: float | None = None
    repeats: int = 0  # repetitions of the repeated iteration replayed (``replay(repeat_from)``)
    steady: bool = False  # the allocator state settled within them (a fixed point)

    @property
    def fragmentation(self) -> float:
        """Share of the cache never in use at once: 1 - peak_allocated / peak_reserved."""
        if not self.peak_reserved:
            return 0.0
        return 1.0 - self.peak_allocated / self.peak_reserved

    def as_dict(self) -> dict:
        d = dict(vars(self))
        d["fragmentation"] = self.fragmentation
        return d


class CachingAllocator:
    """Block bookkeeping of one device, one stream. Addresses are virtual (segments are laid
    out one after another; only their order matters for best-fit ties)."""

    def __init__(self, capacity: float | None = None):
        self.capacity = capacity
        self._free = {True: [], False: []}  # small? -> sorted keys (``_insert_free``)
        self._by_key: dict[bool, dict] = {True: {}, False: {}}  # small? -> key -> block
        self._segments: dict[int, tuple[int, int, bool]] = {}  # seg -> (addr, size, small)
        self._seg_head: dict[int, _Block] = {}
        self._next_addr = 0
        self._next_seg = 0
        self.reserved = self.allocated = self.requested = 0
        self.held = 0  # bytes of blocks held for a collective's stream (module docstring)
        self._held: list[_Block] = []
        self.result = ReplayResult(capacity=capacity)

    # ------------------------------------------------------------------ free lists
    # (the replay's hot path: ~10^6 calls per min_capacity at paper scale, kept free of
    # helper calls; the rules are the module docstring's). A free block's key is one int,
    # ``size << ADDR_BITS | addr``: ordered as (size, addr), best fit's order, and compared
    # in one step where a tuple takes two.
    def _insert_free(self, b: _Block) -> None:
        key = b.size << ADDR_BITS | b.addr
        insort(self._free[b.small], key)
        self._by_key[b.small][key] = b

    def _remove_free(self, b: _Block) -> None:
        key = b.size << ADDR_BITS | b.addr
        lst = self._free[b.small]
        del lst[bisect_left(lst, key)]
        del self._by_key[b.small][key]

    # ------------------------------------------------------------------ segments
    def _malloc_segment(self, small: bool, rounded: int) -> _Block | None:
        size = segment_size(rounded)
        if self.capacity is not None and self.reserved + size > self.capacity:
            return None
        if self._next_addr + size >= 1 << ADDR_BITS:
            raise OverflowError("allocator model: virtual addresses past 2**ADDR_BITS")
        seg = self._next_seg
        self._next_seg += 1
        b = _Block(seg, self._next_addr, size, small)
        self._segments[seg] = (self._next_addr, size, small)
        self._seg_head[seg] = b
        self._next_addr += size
        self.reserved += size
        self.result.n_mallocs += 1
        return b

    def sync(self) -> None:
        """Every held block goes back to the pool (a synchronisation point)."""
        held, self._held, self.held = self._held, [], 0
        for b in held:
            b.allocated = False
            self._merge_insert(b)

    def release_cached(self) -> int:
        """cudaFree every segment that holds no allocated block; returns bytes released."""
        freed = 0
        for seg, head in list(self._seg_head.items()):
            if head.allocated or head.next is not None or head.prev is not None:
                continue  # split (some part may be allocated) or in use
            self._remove_free(head)
            freed += head.size
            del self._seg_head[seg], self._segments[seg]
            self.result.n_releases += 1
        self.reserved -= freed
        return freed

    def state(self) -> tuple:
        """The allocator's state up to address translation: per segment in address order, its
        pool and its blocks' (size, in use). Two equal states make the same decisions for the
        same requests (best fit breaks ties by address order, not by address)."""
        out = []
        held = {id(b) for b in self._held}
        for seg in sorted(self._segments, key=lambda k: self._segments[k][0]):
            b, blocks = self._seg_head[seg], []
            while b is not None:
                blocks.append((b.size, b.allocated, id(b) in held))
                b = b.next
            out.append((self._segments[seg][2], tuple(blocks)))
        return tuple(out)

    # ------------------------------------------------------------------ malloc / free
    def malloc(self, nbytes: int) -> _Block | None:
        if nbytes <= 0:
            return None
        rounded = MIN_BLOCK if nbytes < MIN_BLOCK else MIN_BLOCK * ((nbytes + MIN_BLOCK - 1)
                                                                    // MIN_BLOCK)
        small = rounded <= SMALL_SIZE
        lst = self._free[small]
        i = bisect_left(lst, rounded << ADDR_BITS)  # best fit: smallest size, lowest address
        if i < len(lst):
            b = self._by_key[small].pop(lst.pop(i))
        else:
            b = self._malloc_segment(small, rounded)
            if b is None:
                if self._held:  # free_cached_blocks: synchronize_and_free_events first
                    self.result.n_reclaims += 1
                    self.sync()
                self.release_cached()
                b = self._malloc_segment(small, rounded)
            if b is None:  # a real run stops here with "CUDA out of memory"
                if not self.result.oom:
                    self.result.oom, self.result.oom_request = True, rounded
                cap, self.capacity = self.capacity, None
                b = self._malloc_segment(small, rounded)
                self.capacity = cap
        remaining = b.size - rounded
        if (remaining >= MIN_BLOCK) if small else (remaining > SMALL_SIZE):  # should_split
            rest = _Block(b.seg, b.addr + rounded, remaining, small)
            rest.prev, rest.next = b, b.next
            if b.next is not None:
                b.next.prev = rest
            b.next = rest
            b.size = rounded
            key = remaining << ADDR_BITS | rest.addr
            insort(lst, key)
            self._by_key[small][key] = rest
        b.allocated = True
        self.allocated += b.size
        self.requested += nbytes
        r = self.result
        if self.allocated > r.peak_allocated:
            r.peak_allocated = self.allocated
        if self.requested > r.peak_requested:
            r.peak_requested = self.requested
        if self.reserved > r.peak_reserved:
            r.peak_reserved = self.reserved
            r.n_segments_peak = len(self._segments)
        return b

    def free(self, b: _Block | None, nbytes: int = 0, held: bool = False) -> None:
        """``held``: the block waits for a collective's stream (module docstring): it stays
        marked in use until ``sync``."""
        if b is None:
            return
        self.allocated -= b.size
        self.requested -= nbytes
        if held:
            self._held.append(b)
            self.held += b.size
            if self.held > self.result.peak_held:
                self.result.peak_held = self.held
            return
        b.allocated = False
        self._merge_insert(b)

    def _merge_insert(self, b: _Block) -> None:
        prev, nxt = b.prev, b.next  # merge with free neighbours of the same segment
        small = b.small
        lst, by_key = self._free[small], self._by_key[small]
        if prev is not None and not prev.allocated:
            key = prev.size << ADDR_BITS | prev.addr  # _remove_free(prev), inline
            del lst[bisect_left(lst, key)]
            del by_key[key]
            prev.size += b.size  # prev absorbs b
            prev.next = nxt
            if nxt is not None:
                nxt.prev = prev
            b = prev
        if nxt is not None and not nxt.allocated:
            key = nxt.size << ADDR_BITS | nxt.addr
            del lst[bisect_left(lst, key)]
            del by_key[key]
            b.size += nxt.size  # b absorbs nxt
            b.next = after = nxt.next
            if after is not None:
                after.prev = b
        key = b.size << ADDR_BITS | b.addr  # _insert_free(b)
        insort(lst, key)
        by_key[key] = b


MAX_REPEATS = 16  # repetitions of the repeated iteration before giving up on a steady state


def closed_from(events, start: int) -> bool:
    """Whether ``events[start:]`` can be replayed again and again with the same storage ids:
    what it frees of older storages it allocates again, same id and bytes, and leaves alive at
    its end (a cycle: e.g. stage 3's units gathered at the end of a step for the next forward,
    released by it), and everything else it allocates it frees."""
    born: dict = {}
    carried_in: dict = {}
    for ev in events[start:]:
        if ev[0] == SYNC:
            continue
        if ev[0] == "alloc":
            born[ev[1]] = ev[2]
        elif ev[1] in born:
            del born[ev[1]]
        elif ev[1] in carried_in:
            return False
        else:
            carried_in[ev[1]] = ev[2]
    return born == carried_in


def replay(events, capacity: float | None = None, repeat_from: int | None = None,
           max_repeats: int = MAX_REPEATS, stop_at_oom: bool = False,
           cycles: bool = False) -> ReplayResult:
    """Replay (kind, sid, nbytes, ...) events (kind ``alloc``/``free``) through the model.

    ``repeat_from``: then replay ``events[repeat_from:]`` (a closed iteration, ``closed_from``)
    again until the allocator state repeats (module docstring: steady state) or
    ``max_repeats``. ``stop_at_oom``: return at the first OOM (a fit decision needs no more).
    ``cycles``: also stop once the state at the end of a repetition equals that at the end of
    ANY earlier one (a layout alternating between a few states, which never settles): from
    there on the repetitions replay a cycle already replayed, so neither ``oom`` nor a peak
    can change; ``repeats`` then counts up to the first recurrence (``steady`` True). The fit
    decisions (``min_capacity``) use it; the judged replay keeps the plain rule."""
    alloc = CachingAllocator(capacity)
    live: dict[int, tuple[_Block | None, int]] = {}
    res = alloc.result

    malloc, free, pop = alloc.malloc, alloc.free, live.pop

    def run(evs) -> bool:
        for ev in evs:
            kind = ev[0]
            if kind == "alloc":
                live[ev[1]] = (malloc(ev[2]), ev[2])
                if stop_at_oom and res.oom:
                    return False
            elif kind == SYNC:
                alloc.sync()
            else:
                blk = pop(ev[1], None)
                if blk is not None:
                    free(blk[0], blk[1], kind == HELD)
        return True

    ok = run(events)
    if ok and repeat_from is not None:
        tmpl = events[repeat_from:]
        before = alloc.state()
        seen = {before} if cycles else ()
        for r in range(1, max_repeats + 1):
            if not run(tmpl):
                break
            res.repeats = r
            after = alloc.state()
            if after == before or after in seen:
                res.steady = True
                break
            before = after
            if cycles:
                seen.add(after)
    res.reserved_end = alloc.reserved
    return res


def min_capacity(events, tol: float = 8 * 2**20, repeat_from: int | None = None,
                 known: tuple[float, bool] | None = None, bound: float | None = None) -> int:
    """The smallest device capacity (bytes, within ``tol``) at which ``events`` replay without
    running out of memory: the quantity a fit decision actually compares with the device
    (fits iff min_capacity <= capacity, the allocator releasing its cached segments before an
    OOM as PyTorch does). Bisection between the peak allocated bytes (nothing fits below) and
    the peak reserved bytes of the unconstrained replay (fits there); each step is one replay
    (cost: results/fig6_max_model/notes.md). ``repeat_from``: every replay runs to
    the allocator's steady state (``replay``), so the answer holds for a long run.
    ``known``: (capacity, fits) of a replay already made, which narrows the bracket (a search
    judging near the answer halves the steps) and keeps the answer consistent with it.
    ``bound``: only whether the answer is <= ``bound`` is wanted: the bisection stops once its
    bracket lies on one side of it, and the value returned is on the same side of ``bound``
    as the answer (not the answer itself)."""
    free = replay(events, capacity=None, repeat_from=repeat_from, cycles=True)
    lo, hi = float(free.peak_allocated) - 1.0, float(free.peak_reserved)
    if known is not None:
        cap, fits = known
        if fits and lo < cap < hi:
            hi = float(cap)
        elif not fits and lo < cap < hi:
            lo = float(cap)
    while hi - lo > tol:
        if bound is not None and (hi <= math.floor(bound) or lo >= bound):
            break  # answer = ceil(final hi): <= ceil(hi) <= bound, or > final lo >= bound
        mid = (lo + hi) / 2
        if replay(events, capacity=mid, repeat_from=repeat_from, stop_at_oom=True,
                  cycles=True).oom:
            lo = mid
        else:
            hi = mid
    return int(math.ceil(hi))


def training_trace(events) -> list:
    """The trace as the allocator sees it after ``torch.cuda.empty_cache()`` at the end of the
    build: allocations still alive after the build appear as the first events (in their
    allocation order), build-time temporaries (e.g. the fp32 model the flat fp16 buffers were
    copied from) do not."""
    first = next((i for i, e in enumerate(events) if e[3] != "build"), len(events))
    live: dict[int, tuple] = {}
    for e in events[:first]:
        if e[0] == "alloc":
            live[e[1]] = e
        else:
            live.pop(e[1], None)
    return list(live.values()) + list(events[first:])
