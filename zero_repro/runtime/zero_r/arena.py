"""M_D for activation checkpoints: one pre-allocated contiguous arena (paper §6.3).

Long-lived checkpoints interleaved with short-lived activations in one pool leave holes a later
large request cannot use ("OOM with free memory"); ``CheckpointArena`` pre-allocates one buffer
for all checkpoints and hands out views in order. Memory it must satisfy (per rank, elements):

    capacity = n_slots * slot_numel,     slot_numel = B*S*H            (no P_a)
                                         slot_numel = ceil(B*S*H / m)  (P_a, m = TP degree)

for ``n_slots`` checkpointed blocks (a pinned arena's blocks, below, hold a little more):
allocated at the first forward, reused every step (``reset``), never grown (a changed shape or an
overflow raises ``ValueError`` with the fix).
``fragmentation_stats()`` reads the CUDA caching allocator (``{}`` without CUDA).

Pinned host arenas (P_a+cpu, paper §6.1): PyTorch's pinned-memory allocator rounds every request
up to a power of two and pins the rounded size (torch 2.13 ``aten/src/ATen/core/
CachingHostAllocator.h``, ``CachingHostAllocatorImpl::allocate``: ``roundSize =
c10::llvm::PowerOf2Ceil(size)`` unless the size exceeds ``pinned_max_round_threshold_mb`` /
``pinned_max_cached_size_mb`` of the allocator config, unset by default and missing in older
releases; ``allocate_host_memory(roundSize)`` then pins that, by ``cudaHostAlloc`` or
``cudaHostRegister``; pytorch/pytorch issues 95823, 150517). An arena of 4.2 GiB would pin 8 GiB. So a pinned arena is
``pinned_layout(n_slots, slot_bytes)``: blocks of exactly 2^k bytes (rounding leaves them as they
are), each holding whole slots: less than one slot spare per block, ~log2(n_slots) blocks at
most, never more than the one rounded allocation. A device arena is one buffer.
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


def pinned_layout(n_slots: int, slot_bytes: int) -> list[tuple[int, int]]:
    """(slots, bytes) per pinned block, every block exactly a power of two bytes holding whole
    slots: of the slots left, either all in one block (the power of two above them) or as many
    as the power of two below them holds and the rest laid out alike, whichever pins less. Never
    more than the one rounded allocation would pin; less than one slot spare per block."""
    need = n_slots * slot_bytes
    up = 1 << (need - 1).bit_length()  # the power of two the allocator would round to
    down = 1 << (need.bit_length() - 1)
    k = down // slot_bytes
    if k == 0 or k >= n_slots:
        return [(n_slots, up)]
    split = [(k, down)] + pinned_layout(n_slots - k, slot_bytes)
    return split if sum(b for _, b in split) < up else [(n_slots, up)]


def _empty(numel: int, dtype: torch.dtype, device: torch.device, pin: bool) -> torch.Tensor:
    """One arena block (the allocation tests observe)."""
    return torch.empty(numel, dtype=dtype, device=device, pin_memory=pin)


class CheckpointArena:
    """A flat buffer of ``n_slots`` equal slots; ``take()`` returns the next free slot as a view.

    Slots are handed out in order and all come back at once with ``reset()`` (one training
    step = one pass of forwards, then one backward that consumes them). The slot geometry
    (numel, dtype, device) is fixed by the first ``take``.
    """

    def __init__(self, n_slots: int, pin_memory: bool = False, name: str = "ckpt"):
        if n_slots < 1:
            raise ValueError(f"M_D arena needs at least one slot, got n_slots={n_slots}")
        self.n_slots = n_slots
        self.pin_memory = pin_memory
        self.name = name
        # [n_slots * slot_numel] as one block (device), or power-of-two pinned blocks
        # (``pinned_layout``), allocated lazily; slot i is blocks[b][offset:offset + slot_numel]
        self.blocks: list[torch.Tensor] = []
        self._slot_at: list[tuple[int, int]] = []  # slot -> (block, element offset)
        self.slot_numel = 0
        self.next_slot = 0  # slots [0, next_slot) are in use this step
        self.high_water = 0  # most slots in use at once since the last reset

    # ------------------------------------------------------------------ geometry
    @property
    def allocated(self) -> bool:
        return bool(self.blocks)

    @property
    def buffer(self) -> torch.Tensor | None:
        """The first block (the whole arena unless pinned in several blocks)."""
        return self.blocks[0] if self.blocks else None

    def _allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        pin = self.pin_memory and device.type == "cpu" and torch.cuda.is_available()
        # allocated once for the whole run: this is the point of M_D
        size = dtype.itemsize
        layout = pinned_layout(self.n_slots, numel * size) if pin else [
            (self.n_slots, self.n_slots * numel * size)]
        for b, (k, nbytes) in enumerate(layout):
            self.blocks.append(_empty(nbytes // size, dtype, device, pin))
            self._slot_at += [(b, i * numel) for i in range(k)]
        self.slot_numel = numel
        self._asked = device  # as asked (a dry run on meta tensors places the buffer on meta)
        log.info("M_D arena %r: %d slots x %d elements of %s on %s (%.2f MB%s)", self.name,
                 self.n_slots, numel, dtype, device, self.capacity_bytes / 2**20,
                 f", pinned in {len(layout)} power-of-two blocks" if pin else "")

    def _check(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        buf = self.buffer
        assert buf is not None
        if numel != self.slot_numel or dtype != buf.dtype or device != self._asked:
            raise ValueError(
                f"M_D arena {self.name!r}: checkpoint geometry changed mid-run from "
                f"({self.slot_numel} elements, {buf.dtype}, {self._asked}) to ({numel} elements, "
                f"{dtype}, {device}). The arena is sized at the first forward and reused every "
                f"step; keep micro-batch size and sequence length fixed (drop the last partial "
                f"batch) or set zero_r.contiguous_memory=false")
        if self.next_slot >= self.n_slots:
            raise ValueError(
                f"M_D arena {self.name!r} overflow: all {self.n_slots} checkpoint slots are in "
                f"use. This happens when a second forward runs before the previous backward "
                f"released its checkpoints (e.g. several micro-batch forwards, then one "
                f"backward). Run backward after each forward or set "
                f"zero_r.contiguous_memory=false")

    # ------------------------------------------------------------------ use
    def take(self, numel: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """Next free slot as a 1-D view of ``numel`` elements (contents undefined)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if not self.blocks:
            self._allocate(numel, dtype, device)
        self._check(numel, dtype, device)
        b, start = self._slot_at[self.next_slot]
        self.next_slot += 1
        self.high_water = max(self.high_water, self.next_slot)
        return self.blocks[b][start:start + numel]

    def reset(self) -> None:
        """All slots free again (start of a step). The storage is kept."""
        self.next_slot = 0
        self.high_water = 0

    # ------------------------------------------------------------------ accounting
    @property
    def capacity_bytes(self) -> int:
        """Bytes the arena holds (pinned: the blocks, rounding-free)."""
        return sum(t.numel() * t.element_size() for t in self.blocks)

    @property
    def used_bytes(self) -> int:
        """Bytes of slots in use at the high-water mark of the current step."""
        if self.buffer is None:
            return 0
        return self.high_water * self.slot_numel * self.buffer.element_size()

    @property
    def device(self) -> torch.device | None:
        return None if self.buffer is None else self.buffer.device

    def storage_ptr(self) -> int:
        """Data pointer of the arena (tests check it is stable across steps)."""
        return 0 if self.buffer is None else self.buffer.data_ptr()


def fragmentation_stats(device: int | None = None) -> dict[str, int]:
    """CUDA caching-allocator fragmentation, in bytes (measured). ``{}`` without CUDA.

    * ``reserved``/``allocated``: current bytes held by the allocator / by live tensors;
    * ``reserved_minus_allocated``: memory cached but not usable by live tensors;
    * ``largest_free_block``: the largest inactive block in any segment, i.e. the biggest
      request the cache can serve without asking the driver for a new segment;
    * ``inactive_split``: bytes in inactive blocks of split segments (the allocator's own
      fragmentation counter).
    """
    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats(device)
    largest = 0
    for seg in torch.cuda.memory_snapshot():
        if device is not None and seg.get("device") != device:
            continue
        for blk in seg.get("blocks", []):
            if blk.get("state") == "inactive":
                largest = max(largest, int(blk.get("size", 0)))
    reserved = int(stats.get("reserved_bytes.all.current", 0))
    allocated = int(stats.get("allocated_bytes.all.current", 0))
    return {
        "reserved": reserved,
        "allocated": allocated,
        "reserved_minus_allocated": reserved - allocated,
        "largest_free_block": largest,
        "inactive_split": int(stats.get("inactive_split_bytes.all.current", 0)),
        "peak_reserved": int(stats.get("reserved_bytes.all.peak", 0)),
        "peak_allocated": int(stats.get("allocated_bytes.all.peak", 0)),
    }
