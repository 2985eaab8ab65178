"""Activation checkpointing with ZeRO-R's P_a, P_a+cpu and M_D (paper §6.1, §6.3, Table 3).

Each transformer block is recomputed in backward; only its input x ([B, S, H], replicated on the
m TP ranks) is kept. Kept per rank and checkpointed block (elements):

    plain checkpointing   B*S*H                   on the device
    P_a                   ceil(B*S*H / m)         on the device    (+1 TP all-gather in backward)
    P_a+cpu               ceil(B*S*H / m)         in (pinned) CPU memory, 0 on the device
    M_D                   the kept tensors live in one pre-allocated arena (zero_r/arena.py)

P_a communicates one TP all-gather of B*S*H elements (padded to a multiple of m) per block per
backward. Mechanism: ``saved_tensors_hooks`` *around* ``torch.utils.checkpoint.checkpoint(...,
use_reentrant=False)`` see only the block input (``pack`` keeps this rank's slice, ``unpack``
gathers it). ``apply_activation_checkpointing`` replaces ``model.blocks[i]`` by a
``CheckpointedBlock`` holding it as ``block`` (``canonical_name`` maps parameter names back);
``state_dict`` keeps the original keys, so checkpoints load with or without it. Hooks that must
also fire during recompute belong on the inner block (``handle.inner_blocks``). Order
(ARCHITECTURE): TP -> activation checkpointing -> ZeRO wrap -> optimizer.
"""
from __future__ import annotations

import logging
import math
import re
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from zero_repro.runtime.comm import comm
from zero_repro.runtime.zero_r.arena import CheckpointArena

log = logging.getLogger(__name__)

INNER = "block"  # child name of the wrapped block
_WRAPPED_NAME = re.compile(r"((?:^|\.)blocks\.\d+\.)" + INNER + r"\.")


def _identity(t: torch.Tensor) -> tuple:
    """Which tensor a saved-tensor hook sees: the storage (by its C++ object, since
    ``data_ptr()`` is deprecated on the fake tensors of the memory dry run), offset, shape, dtype."""
    return (t.untyped_storage()._cdata, t.storage_offset(), tuple(t.shape), t.dtype)


def canonical_name(name: str) -> str:
    """``blocks.3.block.attn.qkv.weight`` -> ``blocks.3.attn.qkv.weight`` (the wrapper's child
    ``block`` dropped; names without it are returned unchanged)."""
    return _WRAPPED_NAME.sub(r"\1", name, count=1)


class CheckpointedBlock(nn.Module):
    """Runs ``block`` under activation checkpointing with the handle's pack/unpack hooks."""

    def __init__(self, block: nn.Module, index: int, handle: "ActivationCheckpointing"):
        super().__init__()
        self.block = block
        self.index = index
        # a strong reference (a plain attribute, not a submodule): dropping the handle returned
        # by apply_activation_checkpointing must not silently turn checkpointing off
        self.handle = handle
        self.register_state_dict_post_hook(_strip_inner_keys)
        self.register_load_state_dict_pre_hook(_add_inner_keys)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self.block(x, *args, **kwargs)  # eval / no_grad: nothing is saved anyway
        return self.handle.run_block(self.index, self.block, x, *args, **kwargs)


def _strip_inner_keys(module, state_dict, prefix, local_metadata) -> None:
    inner = prefix + INNER + "."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner):]] = state_dict.pop(key)


def _add_inner_keys(module, state_dict, prefix, local_metadata, strict, missing, unexpected,
                    errors) -> None:
    inner = prefix + INNER + "."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix):]] = state_dict.pop(key)


@dataclass(eq=False)  # identity semantics: weakref.finalize tracks each instance
class _Stored:
    """What ``pack`` returns for one saved tensor; its lifetime is the checkpoint's lifetime."""

    block: int
    data: torch.Tensor  # the kept tensor: full x, this rank's slice, or its CPU copy
    shape: torch.Size
    numel: int  # elements of the full checkpoint
    device: torch.device  # where the recompute needs it
    partitioned: bool
    ready: object = None  # CUDA event: D2H copy done (P_a+cpu on CUDA)
    prefetched: torch.Tensor | None = None  # device copy fetched ahead of use (CUDA)
    prefetch_ready: object = None


class _Tracker:
    """Live bytes of kept checkpoints per placement, and their peak since the last step start.

    Counted from the tensors actually kept (in ``pack``) and released when autograd drops the
    packed object (``weakref.finalize``), not from formulas."""

    def __init__(self):
        self.live = {"device": 0, "cpu": 0}
        self.peak = {"device": 0, "cpu": 0}
        self.n_live = 0

    def add(self, placement: str, nbytes: int) -> None:
        self.live[placement] += nbytes
        self.n_live += 1
        self.peak[placement] = max(self.peak[placement], self.live[placement])

    def release(self, placement: str, nbytes: int) -> None:
        self.live[placement] -= nbytes
        self.n_live -= 1

    def new_step(self) -> None:
        self.peak = dict(self.live)


class ActivationCheckpointing:
    """Handle returned by ``apply_activation_checkpointing``: wrappers, arena, accounting."""

    def __init__(self, model: nn.Module, topo, zero_r):
        self.model = model
        self.enabled = bool(zero_r.activation_checkpointing)
        if (zero_r.partition_activations or zero_r.cpu_checkpointing) and not self.enabled:
            raise ValueError("zero_r.partition_activations / cpu_checkpointing need "
                             "zero_r.activation_checkpointing=true (P_a partitions checkpoints)")
        if zero_r.cpu_checkpointing and not zero_r.partition_activations:
            raise ValueError("zero_r.cpu_checkpointing (P_a+cpu) needs "
                             "zero_r.partition_activations=true, as in the paper's C5")
        self.tp_group: comm.Group | None = None if topo is None else topo.tp_group
        self.m = 1 if self.tp_group is None else self.tp_group.size
        self.tp_rank = 0 if self.tp_group is None else self.tp_group.rank
        self.partition = bool(zero_r.partition_activations)
        self.cpu = bool(zero_r.cpu_checkpointing)
        self.contiguous = bool(zero_r.contiguous_memory) and self.enabled
        if self.partition and self.m == 1:
            log.warning("P_a (zero_r.partition_activations) is a no-op with tensor parallel "
                        "degree 1: each checkpoint is kept whole%s",
                        " (still offloaded to CPU: P_a+cpu)" if self.cpu else "")
        self.tracker = _Tracker()
        self.arena: CheckpointArena | None = None
        self._stream = None  # CUDA side stream for P_a+cpu copies, created on first use
        self._live_cpu: dict[int, weakref.ref] = {}  # block -> _Stored, for H2D prefetch
        self.kept: "weakref.WeakSet[_Stored]" = weakref.WeakSet()  # live checkpoints (dry run)
        self.inner_blocks: list[nn.Module] = []
        self._orig_blocks: list[nn.Module] = []
        if self.enabled:
            self._wrap()

    # ------------------------------------------------------------------ wrapping
    def _wrap(self) -> None:
        blocks = getattr(self.model, "blocks", None)
        if not isinstance(blocks, nn.ModuleList):
            raise ValueError("activation checkpointing needs model.blocks to be an "
                             f"nn.ModuleList of transformer blocks, got {type(blocks).__name__}")
        if any(isinstance(b, CheckpointedBlock) for b in blocks):
            raise ValueError("model.blocks is already wrapped by activation checkpointing; "
                             "apply it once")
        self._orig_blocks = list(blocks)
        self.inner_blocks = list(blocks)
        for i, block in enumerate(self._orig_blocks):
            blocks[i] = CheckpointedBlock(block, i, self)
        if self.contiguous:
            # P_a+cpu keeps the arena in pinned host memory: the checkpoints live there
            self.arena = CheckpointArena(len(blocks), pin_memory=self.cpu, name="activations")

    def remove(self) -> None:
        """Put the original blocks back (parameters are shared, nothing is copied)."""
        blocks = self.model.blocks
        for i, block in enumerate(self._orig_blocks):
            blocks[i] = block
        self._orig_blocks, self.inner_blocks, self.enabled = [], [], False

    # ------------------------------------------------------------------ forward
    def run_block(self, index: int, block: nn.Module, x: torch.Tensor, *args, **kwargs):
        if self.tracker.n_live == 0:
            self.begin_step()  # previous backward released everything: a new step starts
        key = _identity(x)
        pack = lambda t: self._pack(index, key, t)  # noqa: E731
        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            return checkpoint(block, x, *args, use_reentrant=False, **kwargs)

    def begin_step(self) -> None:
        """Reset the arena and the peak counters. Called automatically when a block runs
        forward while no checkpoint is alive; call it yourself only between steps."""
        if self.tracker.n_live:
            raise RuntimeError(f"{self.tracker.n_live} activation checkpoints are still alive; "
                               "finish (or drop) the previous backward first")
        self.tracker.new_step()
        if self.arena is not None:
            self.arena.reset()

    # ------------------------------------------------------------------ pack / unpack
    def _pack(self, index: int, key, t: torch.Tensor):
        if t.numel() == 0:
            return t  # checkpoint's own zero-size marker
        if _identity(t) != key:
            # another tensor argument of the block (e.g. a mask): kept as is, counted
            return self._keep(index, t.detach(), t, partitioned=False, copy=False)
        src = t.detach().reshape(-1)  # [B*S*H]
        if self.partition and self.m > 1:
            k = math.ceil(src.numel() / self.m)  # slice length, padded
            lo, hi = self.tp_rank * k, min((self.tp_rank + 1) * k, src.numel())
            return self._keep(index, src[lo:hi], t, partitioned=True, copy=True, slot=k)
        return self._keep(index, src, t, partitioned=False, copy=self.contiguous or self.cpu)

    def _keep(self, index, src: torch.Tensor, t: torch.Tensor, partitioned: bool, copy: bool,
              slot: int | None = None):
        """Store ``src`` (1-D, or t itself when copy=False) in its final home; return _Stored."""
        slot = src.numel() if slot is None else slot
        if not copy:
            data = src
        else:
            home = torch.device("cpu") if self.cpu else src.device
            data = self._home_tensor(index, slot, src.dtype, home)
            if slot > src.numel():
                data[src.numel():].zero_()  # padding of the last TP rank's slice
        stored = _Stored(index, data, t.shape, t.numel(), t.device, partitioned)
        self.kept.add(stored)
        if copy:
            self._copy_in(stored, src)
        nbytes = data.numel() * data.element_size()
        placement = "cpu" if (copy and self.cpu) else "device"  # P_a+cpu copies to the host
        self.tracker.add(placement, nbytes)
        weakref.finalize(stored, self.tracker.release, placement, nbytes)
        if self.cpu:
            self._live_cpu[index] = weakref.ref(stored)
        return stored

    def _home_tensor(self, index: int, slot: int, dtype: torch.dtype,
                     home: torch.device) -> torch.Tensor:
        """Where a copied checkpoint of ``slot`` elements lives: the M_D arena, else its own
        tensor (pinned host memory for P_a+cpu on CUDA)."""
        if self.arena is not None:
            return self.arena.take(slot, dtype, home)
        pin = self.cpu and torch.cuda.is_available()
        return torch.empty(slot, dtype=dtype, device=home, pin_memory=pin)

    def _copy_in(self, stored: _Stored, src: torch.Tensor) -> None:
        dst = stored.data[:src.numel()]
        if src.is_cuda and dst.device.type == "cpu":
            # D2H on a side stream so the next block's forward overlaps the copy
            stream = self._side_stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
                stored.ready = torch.cuda.Event()
                stored.ready.record(stream)
            src.record_stream(stream)  # the allocator must not reuse src before the copy ends
        else:
            dst.copy_(src)

    def _unpack(self, stored):
        if not isinstance(stored, _Stored):
            return stored
        local = self._to_device(stored)
        if not stored.partitioned:
            return local[:stored.numel].view(stored.shape) if local.dim() == 1 else local
        return self._gather_full(local)[:stored.numel].view(stored.shape)

    def _gather_full(self, local: torch.Tensor) -> torch.Tensor:
        """This rank's slice -> the full (padded) checkpoint: the one TP all-gather of P_a."""
        full = torch.empty(local.numel() * self.m, dtype=local.dtype, device=local.device)
        comm.all_gather_into(full, local, self.tp_group)
        return full

    def _to_device(self, stored: _Stored) -> torch.Tensor:
        data = stored.data
        if data.device == stored.device:
            return data
        if stored.device.type != "cuda":
            return data.to(stored.device)
        stream = self._side_stream()
        if stored.prefetched is None:
            self._fetch(stored, stream)
        self._prefetch_before(stored.block, stream)
        out, ev = stored.prefetched, stored.prefetch_ready
        stored.prefetched = stored.prefetch_ready = None
        torch.cuda.current_stream().wait_event(ev)
        out.record_stream(torch.cuda.current_stream())
        return out

    def _fetch(self, stored: _Stored, stream) -> None:
        """H2D copy of ``stored`` on the side stream (ordered after its D2H copy)."""
        with torch.cuda.stream(stream):
            if stored.ready is not None:
                stream.wait_event(stored.ready)
            out = torch.empty_like(stored.data, device=stored.device)
            out.copy_(stored.data, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
        stored.prefetched, stored.prefetch_ready = out, ev

    def _prefetch_before(self, index: int, stream) -> None:
        """Backward visits blocks in reverse: start fetching block index-1 during this one."""
        ref = self._live_cpu.get(index - 1)
        nxt = ref() if ref is not None else None
        if nxt is not None and nxt.prefetched is None and nxt.device.type == "cuda":
            self._fetch(nxt, stream)

    def _side_stream(self):
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream

    # ------------------------------------------------------------------ accounting
    def memory(self) -> dict[str, int]:
        """Bytes (measured from the kept tensors): peak since the last step start.

        ``ckpt_device`` / ``ckpt_cpu``: checkpoints kept on the device / in CPU memory at the
        peak of the step; ``arena_capacity`` / ``arena_used``: the M_D buffer and its
        high-water mark (the arena bytes are the same bytes as the kept checkpoints, not
        additional ones). Empty when checkpointing is off."""
        if not self.enabled:
            return {}
        out = {"ckpt_device": self.tracker.peak["device"], "ckpt_cpu": self.tracker.peak["cpu"],
               "arena_capacity": 0, "arena_used": 0}
        if self.arena is not None:
            out["arena_capacity"] = self.arena.capacity_bytes
            out["arena_used"] = self.arena.used_bytes
        return out

    def add_to_ledger(self, ledger) -> None:
        """``ledger.add(category, bytes)`` for each category of ``memory()``."""
        for category, nbytes in self.memory().items():
            ledger.add(category, nbytes)


def apply_activation_checkpointing(model: nn.Module, topo, zero_r) -> ActivationCheckpointing:
    """Wrap every ``model.blocks[i]`` for checkpointing as ``zero_r`` (ZeroRConfig) says.

    ``topo``: a Topology (its ``tp_group`` partitions P_a) or None for a single process.
    With ``zero_r.activation_checkpointing`` false nothing is wrapped and the handle is
    disabled (``memory()`` is empty)."""
    return ActivationCheckpointing(model, topo, zero_r)
