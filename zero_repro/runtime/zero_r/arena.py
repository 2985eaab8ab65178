"""M_D for activation checkpoints: one pre-allocated contiguous arena (paper §6.3).

Long-lived checkpoints interleaved with short-lived activations in one pool leave holes a later
large request cannot use ("OOM with free memory"); ``CheckpointArena`` pre-allocates one buffer
for all checkpoints and hands out views in order. Memory it must satisfy (per rank, elements):

    capacity = n_slots * slot_numel,     slot_numel = B*S*H            (no P_a)
                                         slot_numel = ceil(B*S*H / m)  (P_a, m = TP degree)

for ``n_slots`` checkpointed blocks: allocated at the first forward, reused every step (``reset``),
never grown (a changed shape or an overflow raises ``ValueError`` with the fix).
``fragmentation_stats()`` reads the CUDA caching allocator (``{}`` without CUDA).
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


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
        self.buffer: torch.Tensor | None = None  # [n_slots * slot_numel], allocated lazily
        self.slot_numel = 0
        self.next_slot = 0  # slots [0, next_slot) are in use this step
        self.high_water = 0  # most slots in use at once since the last reset

    # ------------------------------------------------------------------ geometry
    @property
    def allocated(self) -> bool:
        return self.buffer is not None

    def _allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        pin = self.pin_memory and device.type == "cpu" and torch.cuda.is_available()
        # one allocation for the whole run: this is the point of M_D
        self.buffer = torch.empty(self.n_slots * numel, dtype=dtype, device=device,
                                  pin_memory=pin)
        self.slot_numel = numel
        self._asked = device  # as asked (a dry run on meta tensors places the buffer on meta)
        log.info("M_D arena %r: %d slots x %d elements of %s on %s (%.2f MB%s)", self.name,
                 self.n_slots, numel, dtype, device, self.capacity_bytes / 2**20,
                 ", pinned" if pin else "")

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
        if self.buffer is None:
            self._allocate(numel, dtype, device)
        self._check(numel, dtype, device)
        start = self.next_slot * self.slot_numel
        self.next_slot += 1
        self.high_water = max(self.high_water, self.next_slot)
        assert self.buffer is not None
        return self.buffer[start:start + numel]

    def reset(self) -> None:
        """All slots free again (start of a step). The storage is kept."""
        self.next_slot = 0
        self.high_water = 0

    # ------------------------------------------------------------------ accounting
    @property
    def capacity_bytes(self) -> int:
        if self.buffer is None:
            return 0
        return self.buffer.numel() * self.buffer.element_size()

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
