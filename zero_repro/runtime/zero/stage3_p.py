"""P_os+g+p: optimizer-state, gradient and parameter partitioning (paper §5.3, §7.2.2), ``Stage3P``.

Memory per rank: (2 + 2 + 12)Ψ/N_d = 16Ψ/N_d bytes of model states, plus the gathered units in
use (the root, the block being computed and ``zero.prefetch_blocks`` ahead) and the fused
gradient buffers (C_B: two of R elements; without C_B one of the largest unit). Communication
per step: all-gather of the parameters in forward (Ψ) and again in backward (Ψ) + reduce-scatter
of the gradients (Ψ) = 3Ψ elements, 1.5× baseline DP; with ``zero.keep_gathered_turn`` (default)
the root and the last block stay gathered from forward into backward: 3Ψ - Ψ_root - Ψ_last block.

Units (``Units``, the parameter store): each child of ``model.blocks`` plus the *root* (one unit
per other top-level module, gathered and freed together), each with its own ``FlatParams``
padded to its bucket grid; this rank keeps only its chunks (every unit's in one store from the
transport's ``buffer``) and the flat storage is freed whenever the unit is not in use. Gradients
go through stage 2's fused buffers (``grads.FusedGrads``, one flat group per unit). Schedule:
forward pre-hooks gather a block (prefetching ``prefetch_blocks`` ahead), post-hooks free it;
``pre_backward`` gathers the root and the last blocks, backward gathers in reverse and frees a
unit once its last gradient is copied in, ``post_backward`` frees the rest; ``step`` gathers
nothing (the updated shard is the parameter storage); with ``zero.prefetch_next_step`` (default)
the next forward's first gathers start inside ``step`` as each unit's shard is updated
(``start_param_sync``). Whatever changes the shards first frees what is gathered (never stale).
Each unit is a state machine (SHARDED -> GATHERING -> GATHERED -> SHARDED); a hook that fires in
the wrong state raises an error naming the unit (e.g. ``loss.backward()`` instead of
``strategy.backward(loss)``).

Vocabulary tables (``zero.slice_vocab_gather``, default on): a root unit that is the one weight of
a module reading it through a ``RowSource`` (``runtime.model.tp.VocabParallelEmbedding``: the
token lookup and GPT's tied head) and larger than the largest block is never gathered whole. Its
bucket grid is G = min(R, A, Ψ_block) in whole rows (``partition.row_grid``); the lookup, the
head's forward and the head's backward each gather it bucket by bucket into two slice buffers
(the next on the wire while one is used), so the gathered working set is at most a block
+ prefetch + 2G instead of the whole table Ψ_V: at N_d = 2 a table of 62% of Ψ (gpt_20m) gathered
whole outweighs the Ψ/N_d of parameters stage 3 saves over stage 2. The price: the table is
gathered three times per step instead of once (kept from forward into backward), 3Ψ - Ψ_kept
+ 2Ψ_V elements; without C_B its fused gradient buffer is a block's, not the table's.
"""
from __future__ import annotations

import enum
import functools

import torch
from torch import nn

from zero_repro.config import TrainConfig, ZeroConfig, ZeroRConfig
from zero_repro.runtime.comm.topology import Topology
from zero_repro.runtime.comm.transport import Transport
from zero_repro.runtime.model.tp import RowSource
from zero_repro.runtime.zero.flat_buffer import FlatParams, PeakBytes
from zero_repro.runtime.zero.grads import FusedGrads
from zero_repro.runtime.zero.ledger import MemoryLedger
from zero_repro.runtime.zero.partition import row_grid
from zero_repro.runtime.zero.strategy import Strategy


class UnitState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


class _Unit:
    def __init__(self, name: str, group: FlatParams, shard: torch.Tensor, first_chunk: int):
        self.name, self.group, self.shard = name, group, shard  # shard: (padded/N_d,)
        self.first_chunk = first_chunk  # index of this unit's first chunk in the shard lists
        self.state = UnitState.SHARDED
        self.works: list = []
        self.sliced = False  # a vocabulary table gathered a row slice at a time

    @property
    def last_chunk(self) -> int:
        return self.first_chunk + len(self.group.partition.buckets) - 1

    def expect(self, *states: UnitState, event: str) -> None:
        if self.state not in states:
            raise RuntimeError(
                f"stage 3 unit '{self.name}': {event} while the unit is {self.state.value} "
                f"(expected {' or '.join(s.value for s in states)}); call "
                f"strategy.backward(loss), not loss.backward(), and keep one forward per backward")


def _unit_params(module: nn.Module, named: list) -> tuple[list[nn.Module], list[tuple[str, list]]]:
    """(the blocks, [(unit name, its (name, param) list)]): the root units (one per top-level
    module other than the blocks, one for the model's own parameters) first, then one per
    block, each in ``named_parameters`` order."""
    blocks = getattr(module, "blocks", None)
    block_list = list(blocks) if isinstance(blocks, nn.ModuleList) else []
    owner: dict[int, str] = {}
    for i, blk in enumerate(block_list):
        for p in blk.parameters():
            owner.setdefault(id(p), f"blocks.{i}")
    for name, child in module.named_children():
        if child is not blocks:
            for p in child.parameters():
                owner.setdefault(id(p), name)
    per_unit: dict[str, list] = {}
    for n, p in named:
        per_unit.setdefault(owner.get(id(p), "root"), []).append((n, p))
    block_names = [f"blocks.{i}" for i in range(len(block_list))]
    roots = [u for u in per_unit if u not in block_names]
    return block_list, [(u, per_unit[u]) for u in roots + block_names if u in per_unit]


def _vocab_tables(module: nn.Module, per_unit: list[tuple[str, list]], n_d: int,
                  buckets: tuple[int, int]) -> dict[str, tuple[int, int]]:
    """Root units to gather in row slices, each with its bucket grid (G, G): a unit that is the
    one 2-D weight of a module reading it through a ``RowSource`` (the vocabulary table) and
    larger than the largest block unit. G = min(R, A, the largest block's elements) rounded
    down to whole rows and a multiple of N_d (at least lcm(h, N_d)): every bucket is whole rows,
    one gather each, and no slice is larger than a block."""
    block = max((sum(p.numel() for _, p in params) for name, params in per_unit
                 if name.startswith("blocks.")), default=0)
    out = {}
    for name, params in per_unit:
        mod = getattr(module, name, None)
        if (block == 0 or name.startswith("blocks.") or not hasattr(mod, "row_source")
                or len(params) != 1 or params[0][1] is not getattr(mod, "weight", None)
                or params[0][1].dim() != 2 or params[0][1].numel() <= block):
            continue
        grid = row_grid(params[0][1].shape[1], n_d, *buckets, block)
        out[name] = (grid, grid)
    return out


class _RowSlices(RowSource):
    """A sliced unit's table for its module: bucket by bucket all-gathered into one of two
    buffers of the grid's size (the next bucket's gather starts before the current slice is
    used), each storage freed once the reader moves on (resized, not replaced, as
    ``FlatParams`` does: two storages for the run); counted in ``params_gathered``."""

    def __init__(self, units: "Units", u: _Unit):
        self.units, self.u = units, u
        self.cols = u.group.params[0].shape[1]
        grid = max(b.size for b in u.group.partition.buckets)
        self.buffers = [torch.empty(grid, dtype=u.shard.dtype, device=u.shard.device)
                        for _ in range(2)]
        for buf in self.buffers:
            buf.untyped_storage().resize_(0)

    def _start(self, b, slot: int):
        u, units = self.u, self.units
        buf = self.buffers[slot]
        nbytes = buf.numel() * buf.element_size()
        buf.untyped_storage().resize_(nbytes)
        units.gathered_peak.alloc(nbytes)
        out = buf[:b.size]
        work = units.transport.all_gather(out, u.shard[b.shard_offset:b.shard_offset + b.chunk])
        return b, out, work, slot

    def _drop(self, slot: int) -> None:
        buf = self.buffers[slot]
        buf.untyped_storage().resize_(0)
        self.units.gathered_peak.free(buf.numel() * buf.element_size())

    def slices(self, reverse: bool = False):
        part = self.u.group.partition
        order = part.buckets[::-1] if reverse else part.buckets
        ahead = [self._start(order[0], 0)] if order else []
        try:
            for i in range(len(order)):
                if i + 1 < len(order):
                    ahead.append(self._start(order[i + 1], (i + 1) % 2))
                b, out, work, slot = ahead.pop(0)
                work.wait()
                r0, r1 = b.start // self.cols, min(b.end, part.numel) // self.cols
                yield r0, r1, out[:(r1 - r0) * self.cols].view(r1 - r0, self.cols)
                self._drop(slot)
        finally:  # a reader that stopped early: nothing stays on the wire
            for _, _, work, slot in ahead:
                work.wait()
                self._drop(slot)


class Units:
    """Stage 3's parameter store: the units, their shards and gathers, the module hooks."""

    def __init__(self, module: nn.Module, named: list, dtype: torch.dtype, n_d: int, rank: int,
                 buckets: tuple[int, int], transport: Transport, zero: ZeroConfig):
        self.module, self.rank, self.transport, self.zero = module, rank, transport, zero
        self.gathered_peak = PeakBytes()
        self._phase = "idle"
        self._fresh: set[int] = set()  # units gathered since the last update started
        block_list, per_unit = _unit_params(module, named)
        tables = _vocab_tables(module, per_unit, n_d, buckets) if zero.slice_vocab_gather else {}
        flats = [FlatParams(name, params, dtype, n_d, tables.get(name, buckets))
                 for name, params in per_unit]
        # every unit's shard in one store, where the transport wants it (its peers may read it)
        total = sum(g.partition.shard_numel for g in flats)
        store = transport.buffer(total, dtype)
        self.units: list[_Unit] = []
        self.unit_of: dict[int, _Unit] = {}
        at = chunk = 0
        for g, (_, params) in zip(flats, per_unit):
            shard = store[at:at + g.partition.shard_numel]
            at += g.partition.shard_numel
            for b, mine in zip(g.partition.buckets, g.owned_chunks(rank)):
                shard[b.shard_offset:b.shard_offset + b.chunk].copy_(mine)
            g.free()
            u = _Unit(g.name, g, shard, chunk)
            chunk += len(g.partition.buckets)
            self.units.append(u)
            for _, p in params:
                self.unit_of[id(p)] = u
        by_name = {u.name: u for u in self.units}
        self.block_units: list[_Unit | None] = [by_name.get(f"blocks.{i}")
                                                for i in range(len(block_list))]
        # a vocabulary table cut into row slices is never gathered whole: its module reads it
        # through a RowSource; the other root units are gathered around the forward
        self.tables = {by_name[n]: getattr(module, n) for n in tables}
        self.row_buffers: list[torch.Tensor] = []  # the tables' two slice buffers each
        for u, mod in self.tables.items():
            u.sliced = True
            mod.row_source = _RowSlices(self, u)
            self.row_buffers += mod.row_source.buffers
        self.roots = [u for u in self.units
                      if not u.name.startswith("blocks.") and u not in self.tables]
        present = [i for i, u in enumerate(self.block_units) if u is not None]
        self._last_block = present[-1] if present else None
        self.hooks = self._register_module_hooks(block_list)

    @property
    def groups(self) -> list[FlatParams]:
        return [u.group for u in self.units]

    def formula_groups(self) -> list[int | tuple[int, int]]:
        """Every unit for ``comm_buffer_bytes``: its elements, with its own grid if sliced."""
        return [(u.group.numel, u.group.partition.grid) if u.sliced else u.group.numel
                for u in self.units]

    def chunks(self) -> list[torch.Tensor]:
        return [u.shard[b.shard_offset:b.shard_offset + b.chunk]
                for u in self.units for b in u.group.partition.buckets]

    # ------------------------------------------------------------------ gather / free
    def _gather(self, u: _Unit) -> None:
        u.expect(UnitState.SHARDED, event="gather requested")
        u.group.materialize()
        self.gathered_peak.alloc(u.group.nbytes)
        flat = u.group.flat
        u.works = [self.transport.all_gather(flat[b.start:b.end],
                                             u.shard[b.shard_offset:b.shard_offset + b.chunk])
                   for b in u.group.partition.buckets]
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

    def _free(self, u: _Unit) -> None:
        if u.state is UnitState.GATHERING:  # prefetched but never used
            self._ensure(u)
        u.expect(UnitState.GATHERED, event="free requested")
        u.group.free()
        self.gathered_peak.free(u.group.nbytes)
        u.state = UnitState.SHARDED

    def free_unit(self, index: int) -> None:
        """Every gradient of unit ``index`` is in the fused buffers: its parameters go."""
        u = self.units[index]
        if u.sliced:
            return  # never gathered whole
        u.expect(UnitState.GATHERED, event="its last gradient arrived")
        self._free(u)

    # ------------------------------------------------------------------ module hooks
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
        for h in self.hooks:
            h.remove()
        self.hooks = []
        for mod in self.tables.values():
            mod.row_source = None

    def _root_pre(self, module, args) -> None:
        self._gather_first()
        for u in self.roots:
            self._ensure(u)

    def _gather_first(self) -> None:
        """Start the gathers a forward needs first: the root and the first blocks."""
        for u in self.roots:
            if u.state is UnitState.SHARDED:
                self._gather(u)
        self._prefetch(range(self.zero.prefetch_blocks))

    def _keeps_turn(self) -> bool:
        """Keep the root and the last block gathered from forward into backward."""
        return self.zero.keep_gathered_turn and torch.is_grad_enabled()

    def _root_post(self, module, args, output) -> None:
        if self.roots and self._phase != "backward":
            if not self._keeps_turn():
                for u in self.roots:
                    self._free(u)
            if torch.is_grad_enabled():  # fail loudly, naming the unit, on a bare backward
                outs = output if isinstance(output, (tuple, list)) else (output,)
                for t in outs:
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(self._check_backward_phase)

    def _check_backward_phase(self, grad: torch.Tensor) -> None:
        if self._phase != "backward" and self.roots:
            raise RuntimeError(
                f"stage 3 unit '{self.roots[0].name}': backward started outside "
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
                    t.register_hook(functools.partial(self._pre_block_backward, i))
                    break
        if i != self._last_block or not self._keeps_turn():
            self._free(self.block_units[i])
        return None

    def _pre_block_backward(self, i: int, grad: torch.Tensor) -> None:
        self._ensure(self.block_units[i])
        self._prefetch(range(i - 1, i - 1 - self.zero.prefetch_blocks, -1))

    # ------------------------------------------------------------------ lifecycle
    def pre_backward(self) -> None:
        self._phase = "backward"
        for u in self.roots:
            self._ensure(u)  # head and embedding gradients need the root units
        n = len(self.block_units)
        self._prefetch(range(n - 1, n - 1 - self.zero.prefetch_blocks, -1))

    def post_backward(self) -> None:
        for u in self.units:  # units some of whose parameters got no gradient
            if u.state is not UnitState.SHARDED:
                self._free(u)
        self._phase = "idle"

    def finish_param_sync(self) -> None:
        """Every gather in flight has landed: nothing reads the shards any more."""
        for u in self.units:
            if u.state is UnitState.GATHERING:
                self._ensure(u)
        self._fresh = set()

    def start_param_sync(self, chunk: int | None = None) -> None:
        """``chunk``: the optimizer finished chunk ``chunk``; with ``zero.prefetch_next_step``
        the unit among the next forward's first that it completes is gathered now. None: the
        update is done; every copy gathered before it is freed (stale), and the next forward's
        first gathers start (``zero.prefetch_next_step``)."""
        if chunk is not None:
            if self.zero.prefetch_next_step:
                first = self.roots + [self.block_units[j] for j in range(self.zero.prefetch_blocks)
                                      if j < len(self.block_units)]
                for u in first:
                    if u is not None and u.last_chunk == chunk:
                        self._regather(u)
            return
        for i, u in enumerate(self.units):
            if u.state is not UnitState.SHARDED and i not in self._fresh:
                self._free(u)
        if self.zero.prefetch_next_step:
            self._gather_first()

    def _regather(self, u: _Unit) -> None:
        if u.state is not UnitState.SHARDED:
            self._free(u)  # gathered before this update: stale
        self._gather(u)
        self._fresh.add(self.units.index(u))


class Stage3P(Strategy):
    stage = 3

    def __init__(self, model: nn.Module, topo: Topology, zero: ZeroConfig, train: TrainConfig,
                 zero_r: ZeroRConfig | None = None):
        super().__init__(model, topo, zero, train, zero_r)
        units = Units(self.module, self.named, self.dtype, self.n_d, self.dp_rank, self.buckets,
                      self.transport, self.zero)
        grads = FusedGrads(units.groups, self.n_d, self.dp_rank, self.transport, self.fused_depth,
                           self.zero_r.contiguous_memory, self.device, on_filled=units.free_unit)
        self._compose(units, grads, units.groups, shard_rank=self.dp_rank, counts_norm=True)

    def _ledger(self, ledger: MemoryLedger) -> None:
        shard_bytes = sum(u.shard.numel() * u.shard.element_size() for u in self.params.units)
        ledger.add("params_lp", shard_bytes)
        ledger.add("grads", shard_bytes)  # persistent gradient shard, same size and dtype
        ledger.add("comm_buffers", self.grads.buffer_bytes)  # the fused gradient buffers
        ledger.add("params_gathered", self.params.gathered_peak.peak)  # transient, peak
