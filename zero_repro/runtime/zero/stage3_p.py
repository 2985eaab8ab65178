"""P_os+g+p: optimizer-state, gradient and parameter partitioning (paper §5.3, §7.2.2), ``Stage3P``.

Memory per rank: (2 + 2 + 12)Ψ/N_d = 16Ψ/N_d bytes of model states, plus the gathered units in
use (the block being computed and ``zero.prefetch_blocks`` ahead) and constant-size buffers.
Communication per step: all-gather of the parameters in forward (Ψ) and again in backward (Ψ) +
reduce-scatter of the gradients (Ψ) = 3Ψ elements, 1.5× baseline DP; with
``zero.keep_gathered_turn`` (default) the root and the last block stay gathered from forward
into backward: 3Ψ - Ψ_root - Ψ_last block.

Units: each child of ``model.blocks`` plus one *root* unit (every other parameter), each with
its own ``FlatParams`` padded to its bucket grid; this rank keeps only its chunks and the flat
storage is freed whenever the unit is not in use. Schedule: forward pre-hooks gather a block
(prefetching ``prefetch_blocks`` ahead), post-hooks release it; backward (``strategy.backward``)
gathers in reverse, and once every gradient of a unit has accumulated its gradients are
reduce-scattered into the persistent shard and the unit released; ``step`` gathers nothing (the
updated shard is the parameter storage); with ``zero.prefetch_next_step`` (default) the next
forward's first gathers start inside ``step`` as each unit's shard is updated. Whatever changes
the shards first releases what is gathered (never stale). Each unit is a state machine
(``UnitState``: SHARDED -> GATHERING -> GATHERED -> SHARDED); a hook that fires in the wrong
state raises an error naming the unit (e.g. ``loss.backward()`` instead of
``strategy.backward(loss)``).
"""
from __future__ import annotations

import enum
import functools

import torch
from torch import nn

from zero_repro.config import TrainConfig, ZeroConfig, ZeroRConfig
from zero_repro.runtime.comm.topology import Topology
from zero_repro.runtime.comm.buffers import InFlight
from zero_repro.runtime.comm.transport import bucket_transport
from zero_repro.runtime.zero.buckets import reduce_to_shard, scale_into
from zero_repro.runtime.zero.ledger import MemoryLedger
from zero_repro.runtime.zero.flat_buffer import FlatParams, GradShards, PeakBytes
from zero_repro.runtime.zero.strategy import Strategy


class UnitState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


class _Unit:
    def __init__(self, name: str, group: FlatParams, shard: torch.Tensor, piece_base: int):
        self.name, self.group, self.shard = name, group, shard  # shard: (padded/N_d,)
        self.piece_base = piece_base  # index of this unit's first chunk in the shard lists
        self.state = UnitState.SHARDED
        self.works: list = []
        self.grad_buf: torch.Tensor | None = None  # transient full gradients of the unit
        self.filled = 0
        self.got: set[int] = set()  # ids of the parameters whose gradient is in grad_buf

    def expect(self, *states: UnitState, event: str) -> None:
        if self.state not in states:
            raise RuntimeError(
                f"stage 3 unit '{self.name}': {event} while the unit is {self.state.value} "
                f"(expected {' or '.join(s.value for s in states)}); call "
                f"strategy.backward(loss), not loss.backward(), and keep one forward per backward")


class Stage3P(Strategy):
    stage = 3

    def __init__(self, model: nn.Module, topo: Topology, zero: ZeroConfig, train: TrainConfig,
                 zero_r: ZeroRConfig | None = None):
        super().__init__(model, topo, zero, train, zero_r)
        self.transport = bucket_transport(self.dp_group)
        block_list = self._build_units()
        self.inflight = InFlight(max_in_flight=2)
        self.gathered_peak, self.buffer_peak = PeakBytes(), PeakBytes()
        self._phase = "idle"
        present = [i for i, u in enumerate(self.block_units) if u is not None]
        self._last_block = present[-1] if present else None
        self._module_hooks = self._register_module_hooks(block_list)
        self._attach([u.group for u in self.units], shard_rank=self.dp_rank, counts_norm=True)

    def _build_units(self) -> list[nn.Module]:
        """One flat, sharded unit per block plus the root; returns the blocks."""
        blocks = getattr(self.module, "blocks", None)
        block_list = list(blocks) if isinstance(blocks, nn.ModuleList) else []
        owner: dict[int, int] = {}
        for i, blk in enumerate(block_list):
            for p in blk.parameters():
                owner.setdefault(id(p), i + 1)
        per_unit: list[list] = [[] for _ in range(len(block_list) + 1)]
        for n, p in self.named:
            per_unit[owner.get(id(p), 0)].append((n, p))
        cap = self._bucket_capacity()
        self.units: list[_Unit] = []
        self.block_units: list[_Unit | None] = [None] * len(block_list)
        self.root: _Unit | None = None
        self.unit_of: dict[int, _Unit] = {}
        piece_base = 0
        flats = [(idx, FlatParams("root" if idx == 0 else f"blocks.{idx - 1}", params,
                                  self.dtype, self.n_d, cap))
                 for idx, params in enumerate(per_unit) if params]
        # every unit's shard in one store; where the DP transport offers memory its peers read
        # in place (CPU ranks on one host), there: a gather then copies nothing into its slots,
        # and the optimizer first waits until the peers have read it (``_before_update``)
        total = sum(g.partition.shard_numel for _, g in flats)
        store = self.transport.shared_buffer(total, self.dtype)
        self._shared_store = store
        if store is None:
            store = torch.empty(total, dtype=self.dtype, device=self.device)
        at = 0
        for idx, g in flats:
            params = per_unit[idx]
            shard = store[at:at + g.partition.shard_numel]
            at += g.partition.shard_numel
            for b, mine in zip(g.partition.buckets, g.owned_chunks(self.dp_rank)):
                shard[b.shard_offset:b.shard_offset + b.chunk].copy_(mine)
            g.release()
            u = _Unit(g.name, g, shard, piece_base)
            piece_base += len(g.partition.buckets)
            self.units.append(u)
            if idx == 0:
                self.root = u
            else:
                self.block_units[idx - 1] = u
            for _, p in params:
                self.unit_of[id(p)] = u
        self._init_grad_storage(piece_base)
        return block_list

    def _init_grad_storage(self, n_pieces: int) -> None:
        sizes = [b.chunk for u in self.units for b in u.group.partition.buckets]
        assert len(sizes) == n_pieces
        # buckets are laid out unit after unit, each unit's shard contiguous: the same order
        # as the optimizer's chunks (``_param_chunks``)
        self.grads = GradShards(sizes, self.dtype, self.zero_r.contiguous_memory, self.device)

    def _register_module_hooks(self, block_list) -> list:
        hooks = [self.module.register_forward_pre_hook(self._root_pre),
                 self.module.register_forward_hook(self._root_post)]
        for i, blk in enumerate(block_list):
            if self.block_units[i] is None:
                continue
            hooks.append(blk.register_forward_pre_hook(functools.partial(self._block_pre, i)))
            hooks.append(blk.register_forward_hook(functools.partial(self._block_post, i)))
        return hooks

    def remove_hooks(self) -> None:
        super().remove_hooks()
        for h in self._module_hooks:
            h.remove()
        self._module_hooks = []

    # ------------------------------------------------------------------ gather / release
    def _gather(self, u: _Unit) -> None:
        u.expect(UnitState.SHARDED, event="gather requested")
        u.group.materialize()
        self.gathered_peak.alloc(u.group.nbytes)
        flat = u.group.flat
        u.works = [w for b in u.group.partition.buckets
                   for w in self.transport.all_gather(
                       flat[b.start:b.end], u.shard[b.shard_offset:b.shard_offset + b.chunk])]
        u.state = UnitState.GATHERING

    def _ensure(self, u: _Unit) -> None:
        if u.state is UnitState.SHARDED:
            self._gather(u)
        if u.state is UnitState.GATHERING:
            for w in u.works:
                w.wait()
            u.works = []
            u.state = UnitState.GATHERED

    def _prefetch(self, indices) -> None:
        for j in indices:
            if 0 <= j < len(self.block_units):
                u = self.block_units[j]
                if u is not None and u.state is UnitState.SHARDED:
                    self._gather(u)

    def _release(self, u: _Unit) -> None:
        if u.state is UnitState.GATHERING:  # prefetched but never used
            self._ensure(u)
        u.expect(UnitState.GATHERED, event="release requested")
        u.group.release()
        self.gathered_peak.free(u.group.nbytes)
        u.state = UnitState.SHARDED

    # ------------------------------------------------------------------ module hooks
    def _root_pre(self, module, args) -> None:
        self._gather_first()
        if self.root is not None:
            self._ensure(self.root)

    def _gather_first(self) -> None:
        """Start the gathers a forward needs first: the root and the first blocks."""
        if self.root is not None and self.root.state is UnitState.SHARDED:
            self._gather(self.root)
        self._prefetch(range(self.zero.prefetch_blocks))

    def _keeps_turn(self) -> bool:
        """Keep the root and the last block gathered from forward into backward."""
        return self.zero.keep_gathered_turn and torch.is_grad_enabled()

    def _root_post(self, module, args, output) -> None:
        if self.root is not None and self._phase != "backward":
            if not self._keeps_turn():
                self._release(self.root)
            if torch.is_grad_enabled():  # fail loudly, naming the unit, on a bare backward
                outs = output if isinstance(output, (tuple, list)) else (output,)
                for t in outs:
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(self._check_backward_phase)

    def _check_backward_phase(self, grad: torch.Tensor) -> None:
        if self._phase != "backward" and self.root is not None:
            raise RuntimeError(
                f"stage 3 unit '{self.root.name}': backward started outside "
                f"strategy.backward(loss); call strategy.backward(loss), not loss.backward(), "
                f"and keep one forward per backward")

    def _block_pre(self, i: int, module, args) -> None:
        self._ensure(self.block_units[i])
        if self._phase != "backward":  # not an activation-checkpoint recompute
            self._prefetch(range(i + 1, i + 1 + self.zero.prefetch_blocks))

    def _block_post(self, i: int, module, args, output):
        if self._phase == "backward":
            return None  # recompute inside backward: keep the unit until its grads are in
        if torch.is_grad_enabled():
            outs = output if isinstance(output, (tuple, list)) else (output,)
            for t in outs:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(functools.partial(self._pre_backward, i))
                    break
        if i != self._last_block or not self._keeps_turn():
            self._release(self.block_units[i])
        return None

    def _pre_backward(self, i: int, grad: torch.Tensor) -> None:
        self._ensure(self.block_units[i])
        self._prefetch(range(i - 1, i - 1 - self.zero.prefetch_blocks, -1))

    # ------------------------------------------------------------------ backward
    def _begin_backward(self) -> None:
        self._phase = "backward"
        if self.root is not None:
            self._ensure(self.root)  # head and embedding gradients need the root unit
        n = len(self.block_units)
        self._prefetch(range(n - 1, n - 1 - self.zero.prefetch_blocks, -1))

    @torch.no_grad()
    def _on_grad(self, p: torch.Tensor) -> None:
        u = self.unit_of[id(p)]
        u.expect(UnitState.GATHERED, event="a parameter gradient arrived")
        if u.grad_buf is None:
            # not zeroed: every gradient is written into it; the rest is zeroed in _reduce_unit
            u.grad_buf = torch.empty(u.group.partition.padded_numel, dtype=self.dtype,
                                     device=self.device)
            self.buffer_peak.alloc(u.grad_buf.numel() * u.grad_buf.element_size())
        s = u.group.slot_of[id(p)]
        # divided by N_d on the way in: one pass instead of a copy and a division
        scale_into(u.grad_buf[s.offset:s.end], p.grad.reshape(-1), self.n_d)
        u.got.add(id(p))
        p.grad = None
        u.filled += s.numel
        if u.filled == u.group.numel:
            self._reduce_unit(u)
            self._release(u)  # every use of the unit's parameters in backward is done

    def _reduce_unit(self, u: _Unit) -> None:
        buf, u.grad_buf, u.filled = u.grad_buf, None, 0
        g = u.group
        if len(u.got) < len(g.params):  # parameters without a gradient reduce as zeros
            for prm in g.params:
                if id(prm) not in u.got:
                    s = g.slot_of[id(prm)]
                    buf[s.offset:s.end].zero_()
        u.got = set()
        buf[g.partition.numel:].zero_()  # padding
        part = g.partition
        # the transport's scratch for the reduced shard: none when it reduces in place
        out = torch.empty(self.transport.scratch_numel(part.shard_numel), dtype=self.dtype,
                          device=self.device)
        self.buffer_peak.alloc(out.numel() * out.element_size())
        works, finishes = [], []
        sn = self.transport.scratch_numel  # linear in the chunk: one slice per bucket
        for k, b in enumerate(part.buckets):
            w, finish = reduce_to_shard(self.transport, self.grads, u.piece_base + k,
                                        buf[b.start:b.end],
                                        out[sn(b.shard_offset):sn(b.shard_offset + b.chunk)])
            works += w
            finishes.append(finish)

        def done():
            for finish in finishes:
                finish()
            self.buffer_peak.free((buf.numel() + out.numel()) * buf.element_size())

        self.inflight.launch(works, done)

    def _finish_backward(self) -> None:
        for u in self.units:  # units some of whose parameters got no gradient
            if u.grad_buf is not None:
                self._reduce_unit(u)
        for u in self.units:
            if u.state is not UnitState.SHARDED:
                self._release(u)
        self._phase = "idle"

    def _before_update(self) -> None:
        # units kept or prefetched since the last backward would be stale after the update
        for u in self.units:
            if u.state is not UnitState.SHARDED and u.grad_buf is None:
                self._release(u)
        if self._shared_store is not None:  # the peers have read the shards: overwrite them
            self.transport.fence(self._shared_store)

    def _chunk_publisher(self):
        if not self.zero.prefetch_next_step:
            return None
        first = [self.root] + [self.block_units[j] for j in range(self.zero.prefetch_blocks)
                               if j < len(self.block_units)]
        # chunk index that completes a unit -> the unit (root first: the order of _gather_first)
        ends = {u.piece_base + len(u.group.partition.buckets) - 1: u
                for u in first if u is not None and u.group.partition.buckets}

        def publish(i: int) -> None:
            u = ends.get(i)
            if u is not None and u.state is UnitState.SHARDED:
                self._gather(u)

        return publish

    def _after_step(self) -> None:
        if self.zero.prefetch_next_step:  # a skipped step updated nothing: start them now
            self._gather_first()

    def _wait_reductions(self) -> None:
        self.inflight.wait_all()
        for u in self.units:
            u.expect(UnitState.SHARDED, event="optimizer step")

    # ------------------------------------------------------------------ shards
    def _param_chunks(self) -> list[torch.Tensor]:
        return [u.shard[b.shard_offset:b.shard_offset + b.chunk]
                for u in self.units for b in u.group.partition.buckets]

    def _grad_chunks(self) -> list[torch.Tensor | None]:
        return self.grads.chunks()

    def _zero_grads(self) -> None:
        self.grads.zero()

    def _ledger(self, ledger: MemoryLedger) -> None:
        shard_bytes = sum(u.shard.numel() * u.shard.element_size() for u in self.units)
        ledger.add("params_lp", shard_bytes)
        ledger.add("grads", shard_bytes)  # persistent gradient shard, same size and dtype
        ledger.add("comm_buffers", self.buffer_peak.peak)  # peak unit grad + output buffers
        ledger.add("params_gathered", self.gathered_peak.peak)  # transient, not Table 1
