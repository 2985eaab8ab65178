"""P_os+g+p: optimizer-state, gradient and parameter partitioning (paper §5.3, §7.2.2), ``Stage3P``.

Memory per rank: (2 + 2 + 12)Ψ/N_d = 16Ψ/N_d bytes of model states, plus the gathered units in
use (the root, the block being computed and ``zero.prefetch_blocks`` ahead) and the fused
gradient buffers (C_B: two of R elements; without C_B one of the largest unit). Communication
per step: all-gather of the parameters in forward (Ψ) and again in backward (Ψ) + reduce-scatter
of the gradients (Ψ) = 3Ψ elements, 1.5× baseline DP; with ``zero.keep_gathered_turn`` (default)
the root and the last block stay gathered from forward into backward: 3Ψ - Ψ_root - Ψ_last block.
With ``zero.shard_size`` = G < N_d (``strategy``): 16Ψ/G, the gathers inside the G-rank shard
group, plus an all-reduce of the owned Ψ/G gradient elements over the N_d/G replicas (2Ψ/G).

Units (``Units``, the parameter store; which modules, ``zero.units``: by default each child of
``model.blocks``, any modules or a predicate for another model) plus the *root* (one unit per
other top-level module, gathered and freed together), each with its own ``FlatParams`` padded
to its bucket grid (frozen parameters in a second one, gathered with it, no gradient, no
optimizer state); this rank keeps only its chunks (every unit's in one store from the
transport's ``buffer``) and the flat storage is freed whenever the unit is not in use.
Construction is partitioned (DeepSpeed's ``zero.Init``, FSDP2's meta-device init): a unit is
whole only while it is initialised -- its flat buffer allocated, its parameters (built on the
``meta`` device, no storage) pointed into it and filled by ``init``, this rank's chunks copied
out, the buffer freed -- before the next unit; build peak <= the largest unit + this rank's
shards. A parameter read while its unit is freed raises an error (``guard``). Gradients
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
import logging
from collections.abc import Callable

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from zero_repro.config import TrainConfig, ZeroConfig, ZeroRConfig
from zero_repro.runtime.comm import comm
from zero_repro.runtime.comm.topology import Topology
from zero_repro.runtime.comm.transport import Transport, bucket_transport
from zero_repro.runtime.model.tp import RowSource
from zero_repro.runtime.zero import units as U
from zero_repro.runtime.zero.flat_buffer import FlatParams, PeakBytes
from zero_repro.runtime.zero.hpz import Secondary
from zero_repro.runtime.zero.ledger import MemoryLedger
from zero_repro.runtime.zero.offload import host_zeros
from zero_repro.runtime.zero.partition import Partition, layout, row_grid
from zero_repro.runtime.zero.strategy import Strategy

log = logging.getLogger(__name__)


class UnitState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


class _Unit:
    """One unit: its groups (trainable first, then frozen; each a ``FlatParams`` with this
    rank's shard of it), its state and the gathers in flight."""

    def __init__(self, name: str, parts: list[tuple[FlatParams, torch.Tensor]],
                 trainable: bool, first_chunk: int):
        self.name, self.parts = name, parts  # [(group, shard (padded/N_d,))]
        self.group = parts[0][0] if trainable else None  # the trainable group, if any
        self.shard = parts[0][1] if trainable else None
        self.first_chunk = first_chunk  # index of this unit's first chunk in the shard lists
        self.state = UnitState.SHARDED
        self.works: list = []
        self.sliced = False  # a vocabulary table gathered a row slice at a time
        # hpZ (``zero.hpz``): the secondary holds this unit's current values; the gather in
        # flight reads it
        self.hpz_ok = self.via_hpz = False

    @property
    def last_chunk(self) -> int:
        n = len(self.group.partition.buckets) if self.group is not None else 0
        return self.first_chunk + n - 1

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g, _ in self.parts)

    def expect(self, *states: UnitState, event: str) -> None:
        if self.state not in states:
            raise RuntimeError(
                f"stage 3 unit '{self.name}': {event} while the unit is {self.state.value} "
                f"(expected {' or '.join(s.value for s in states)}); call "
                f"strategy.backward(loss), not loss.backward(), and keep one forward per backward")


def _vocab_tables(plans: list[U.UnitPlan], n_d: int,
                  buckets: tuple[int, int]) -> dict[str, tuple[int, int]]:
    """Root units to gather in row slices, each with its bucket grid (G, G): a unit that is the
    one 2-D weight of a module reading it through a ``RowSource`` (the vocabulary table) and
    larger than the largest per-layer unit. G = min(R, A, the largest layer unit's elements)
    rounded down to whole rows and a multiple of N_d (at least lcm(h, N_d)): every bucket is
    whole rows, one gather each, and no slice is larger than a layer."""
    block = max((sum(p.numel() for _, p in u.params) for u in plans if u.layer), default=0)
    out = {}
    for u in plans:
        mod = u.module
        if (block == 0 or u.layer or u.frozen or not hasattr(mod, "row_source")
                or len(u.params) != 1 or u.params[0][1] is not getattr(mod, "weight", None)
                or u.params[0][1].dim() != 2 or u.params[0][1].numel() <= block):
            continue
        grid = row_grid(u.params[0][1].shape[1], n_d, *buckets, block)
        out[u.name] = (grid, grid)
    return out


def _shard_numel(named: list, n_d: int, grid: tuple[int, int]) -> int:
    _, numel = layout([n for n, _ in named], [tuple(p.shape) for _, p in named])
    return Partition(numel, n_d, *grid).shard_numel


class _RowSlices(RowSource):
    """A sliced unit's table for its module: bucket by bucket all-gathered into one of two
    buffers of the grid's size (the next bucket's gather starts before the current slice is
    used), each storage freed once the reader moves on (resized, not replaced, as
    ``FlatParams`` does: two storages for the run); counted in ``params_gathered``."""

    def __init__(self, units: "Units", u: _Unit):
        self.units, self.u = units, u
        self.cols = u.group.params[0].shape[1]
        grid = max(b.size for b in u.group.partition.buckets)
        self.buffers = [torch.empty(grid, dtype=u.shard.dtype, device=units.device)
                        for _ in range(2)]
        for buf in self.buffers:
            buf.untyped_storage().resize_(0)

    def _start(self, b, slot: int, via_hpz: bool):
        u, units = self.u, self.units
        buf = self.buffers[slot]
        nbytes = buf.numel() * buf.element_size()
        buf.untyped_storage().resize_(nbytes)
        units.gathered_peak.alloc(nbytes)
        out = buf[:b.size]
        if via_hpz:  # hpZ: the backward's slices inside the node
            return b, out, units.hpz.gather_bucket(u.group, b, out), slot
        mine = u.shard[b.shard_offset:b.shard_offset + b.chunk]
        if units.host:  # parameter offload: onto the device, into its own chunk of the slice
            lo = units.rank * b.chunk
            out[lo:lo + b.chunk].copy_(mine, non_blocking=True)
            mine = out[lo:lo + b.chunk]
        work = units.transport.all_gather(out, mine)
        return b, out, work, slot

    def _drop(self, slot: int) -> None:
        buf = self.buffers[slot]
        buf.untyped_storage().resize_(0)
        self.units.gathered_peak.free(buf.numel() * buf.element_size())

    def slices(self, reverse: bool = False):
        part, hpz = self.u.group.partition, self.units.hpz
        order = part.buckets[::-1] if reverse else part.buckets
        # hpZ: slices read from the primary shard refill the secondary, bucket by bucket
        via = self.units.reads_secondary(self.u)
        fills = hpz is not None and not via
        self.u.hpz_ok = via
        ahead = [self._start(order[0], 0, via)] if order else []
        try:
            for i in range(len(order)):
                if i + 1 < len(order):
                    ahead.append(self._start(order[i + 1], (i + 1) % 2, via))
                b, out, work, slot = ahead.pop(0)
                work.wait()
                if fills:
                    hpz.fill(self.u.group, [b], out)
                r0, r1 = b.start // self.cols, min(b.end, part.numel) // self.cols
                yield r0, r1, out[:(r1 - r0) * self.cols].view(r1 - r0, self.cols)
                self._drop(slot)
            self.u.hpz_ok = hpz is not None  # every bucket read: the secondary is current
        finally:  # a reader that stopped early: nothing stays on the wire
            for _, _, work, slot in ahead:
                work.wait()
                self._drop(slot)


Init = Callable[[list], None]  # fills the (name, parameter) pairs it is given


class Units:
    """Stage 3's parameter store: the units, their shards and gathers, the module hooks."""

    def __init__(self, module: nn.Module, plans: list[U.UnitPlan], dtype: torch.dtype,
                 n_d: int, rank: int, buckets: tuple[int, int], transport: Transport,
                 zero: ZeroConfig, device: torch.device, init: Init | None = None,
                 secondary: tuple[comm.Group, Transport] | None = None):
        """``init``: None to copy the parameters' values in (a model built with them), else
        the partitioned construction's initialisation, called once per unit with the unit's
        (name, parameter) pairs while they are views of its gathered buffer; ``secondary``:
        hpZ's shard group and its transport (``hpz``), None without hpZ."""
        self.module, self.rank, self.transport, self.zero = module, rank, transport, zero
        self.device = torch.device(device)
        self.gathered_peak = PeakBytes()
        self._phase = "idle"
        self._fresh: set[int] = set()  # units gathered since the last update started
        self.pinned = 0  # depth of strategy.gathered(): every unit stays gathered
        tables = _vocab_tables(plans, n_d, buckets) if zero.slice_vocab_gather else {}
        grids = {u.name: tables.get(u.name, buckets) for u in plans}
        # every unit's shard in one store, where the transport wants it (its peers may read
        # it); the frozen parameters' shards in a second one (no gradient, no optimizer)
        total = sum(_shard_numel(u.params, n_d, grids[u.name]) for u in plans if u.params)
        frozen = sum(_shard_numel(u.frozen, n_d, buckets) for u in plans if u.frozen)
        # ZeRO-3 Offload (zero.offload_param=cpu): the shards in host memory (pinned where
        # CUDA is), copied to the device bucket by bucket as a unit is gathered
        self.host = zero.offload_param == "cpu"
        store = self._host_store if self.host else transport.buffer
        stores = {False: store(total, dtype) if total else None,
                  True: store(frozen, dtype) if frozen else None}
        self.stores = [t for t in stores.values() if t is not None]
        at = {False: 0, True: 0}
        self.units: list[_Unit] = []
        self.unit_of: dict[int, _Unit] = {}
        self.names: dict[int, str] = {}
        chunk = 0
        for plan in plans:  # one unit whole at a time (partitioned construction)
            groups = [(FlatParams(plan.name, named, dtype, n_d, grid, device=device,
                                  copy=init is None), is_frozen)
                      for named, grid, is_frozen in ((plan.params, grids[plan.name], False),
                                                     (plan.frozen, buckets, True)) if named]
            if init is not None:
                init(plan.params + plan.frozen)
            parts = []
            for g, is_frozen in groups:
                n = g.partition.shard_numel
                shard = stores[is_frozen][at[is_frozen]:at[is_frozen] + n]
                at[is_frozen] += n
                with torch.no_grad():
                    for b, mine in zip(g.partition.buckets, g.owned_chunks(rank)):
                        shard[b.shard_offset:b.shard_offset + b.chunk].copy_(mine)
                g.free()
                parts.append((g, shard))
            u = _Unit(plan.name, parts, bool(plan.params), chunk)
            chunk += len(u.group.partition.buckets) if u.group is not None else 0
            self.units.append(u)
            for n, p in plan.params + plan.frozen:
                self.unit_of[id(p)] = u
                self.names[id(p)] = n
        by_name = {u.name: u for u in self.units}
        self.layer_modules = [p.module for p in plans if p.layer]
        self.block_units: list[_Unit] = [by_name[p.name] for p in plans if p.layer]
        # a vocabulary table cut into row slices is never gathered whole: its module reads it
        # through a RowSource; the other root units are gathered around the forward
        self.tables = {by_name[p.name]: p.module for p in plans if p.name in tables}
        self.row_buffers: list[torch.Tensor] = []  # the tables' two slice buffers each
        for u, mod in self.tables.items():
            u.sliced = True
            mod.row_source = _RowSlices(self, u)
            self.row_buffers += mod.row_source.buffers
        self.roots = [u for u, p in zip(self.units, plans) if not p.layer and u not in self.tables]
        self._last_block = len(self.block_units) - 1 if self.block_units else None
        self.grad_units = [u for u in self.units if u.group is not None]
        self.hpz = None if secondary is None else Secondary(*secondary, self.all_groups, dtype)
        self.hooks = self._register_module_hooks(self.layer_modules)

    @property
    def groups(self) -> list[FlatParams]:
        """The trainable groups, one per unit that has trainable parameters."""
        return [u.group for u in self.grad_units]

    @property
    def all_groups(self) -> list[FlatParams]:
        """Every group, trainable and frozen (the storages gathered and freed)."""
        return [g for u in self.units for g, _ in u.parts]

    def formula_groups(self) -> list[int | tuple[int, int]]:
        """Every trainable group for ``comm_buffer_bytes``: its elements, with its own grid
        if sliced."""
        return [(u.group.numel, u.group.partition.grid) if u.sliced else u.group.numel
                for u in self.grad_units]

    def chunks(self) -> list[torch.Tensor]:
        return [u.shard[b.shard_offset:b.shard_offset + b.chunk]
                for u in self.grad_units for b in u.group.partition.buckets]

    def _host_store(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return host_zeros(numel, dtype, self.device, pinned=True)

    def host_tensors(self) -> list[torch.Tensor]:
        """The shards' stores where they are host memory (``zero.offload_param``)."""
        return list(self.stores) if self.host else []

    def gathered_chunks(self) -> list[torch.Tensor]:
        """``chunks``' elements as the gathered units hold them (inside ``pin``: what a write
        into the whole parameters changed), in the same order."""
        return [c for u in self.grad_units for c in u.group.owned_chunks(self.rank)]

    def write_back_frozen(self) -> None:
        """Inside ``pin``: the gathered frozen parameters' values into this rank's shards."""
        with torch.no_grad():
            for u in self.units:
                for g, shard in u.parts[1 if u.group is not None else 0:]:
                    for b, mine in zip(g.partition.buckets, g.owned_chunks(self.rank)):
                        shard[b.shard_offset:b.shard_offset + b.chunk].copy_(mine)

    def freed(self, p: torch.Tensor) -> str | None:
        """Why parameter ``p`` holds no data now, or None (the guard's question)."""
        u = self.unit_of.get(id(p))
        if u is None or u.state is UnitState.GATHERED:
            return None
        if u.sliced:
            return "is a vocabulary table read in row slices (never gathered whole)"
        return (f"its unit '{u.name}' is {u.state.value}" if u.state is UnitState.GATHERING
                else f"its unit '{u.name}' is freed")

    # ------------------------------------------------------------------ gather / free
    def reads_secondary(self, u: _Unit) -> bool:
        """hpZ: a backward gather of a unit whose secondary is current reads it."""
        return self.hpz is not None and self._phase == "backward" and u.hpz_ok

    def _gather(self, u: _Unit) -> None:
        u.expect(UnitState.SHARDED, event="gather requested")
        u.works = []
        u.via_hpz = self.reads_secondary(u)
        u.hpz_ok = u.hpz_ok and u.via_hpz  # a primary gather refills it as it lands
        for g, shard in u.parts:
            g.materialize()
            self.gathered_peak.alloc(g.nbytes)
            if u.via_hpz:
                u.works += self.hpz.gather(g)
                continue
            for b in g.partition.buckets:
                mine = shard[b.shard_offset:b.shard_offset + b.chunk]
                if self.host:  # onto the device: its own chunk of the gathered buffer
                    lo, hi = b.owned(self.rank)
                    g.flat[lo:hi].copy_(mine, non_blocking=True)
                    mine = g.flat[lo:hi]
                u.works.append(self.transport.all_gather(g.flat[b.start:b.end], mine))
        u.state = UnitState.GATHERING

    def _ensure(self, u: _Unit) -> None:
        if u.state is UnitState.SHARDED:
            self._gather(u)
        if u.state is UnitState.GATHERING:
            for w in u.works:
                w.wait()
            u.works = []
            u.state = UnitState.GATHERED
            if self.hpz is not None and not u.via_hpz:
                for g, _ in u.parts:
                    self.hpz.fill(g)
                u.hpz_ok = True

    def _prefetch(self, indices) -> None:
        for j in indices:
            if 0 <= j < len(self.block_units):
                u = self.block_units[j]
                if u.state is UnitState.SHARDED:
                    self._gather(u)

    def _free(self, u: _Unit) -> None:
        if u.state is UnitState.GATHERING:  # prefetched but never used
            self._ensure(u)
        if self.pinned:
            return  # strategy.gathered(): every unit stays until it ends
        u.expect(UnitState.GATHERED, event="free requested")
        for g, _ in u.parts:
            g.free()
            self.gathered_peak.free(g.nbytes)
        u.state = UnitState.SHARDED

    def free_unit(self, index: int) -> None:
        """Every gradient of trainable group ``index`` is in the fused buffers: its unit's
        parameters go."""
        u = self.grad_units[index]
        if u.sliced and u.state is UnitState.SHARDED:
            return  # never gathered whole
        u.expect(UnitState.GATHERED, event="its last gradient arrived")
        self._free(u)

    # ------------------------------------------------------------------ gathered()
    def pin(self) -> None:
        """Gather every unit (vocabulary tables whole) and keep them until ``unpin``."""
        self.finish_param_sync()
        if not self.pinned:
            for mod in self.tables.values():
                mod.row_source = None  # the table is whole: read it directly
        self.pinned += 1
        for u in self.units:
            if u.state is UnitState.SHARDED:
                self._gather(u)
        for u in self.units:
            self._ensure(u)

    def unpin(self) -> None:
        self.pinned -= 1
        if self.pinned:
            return
        for u in self.units:
            if u.state is not UnitState.SHARDED:
                self._free(u)
        for u, mod in self.tables.items():
            mod.row_source = self._row_sources[u]

    # ------------------------------------------------------------------ module hooks
    def _register_module_hooks(self, block_list) -> list:
        self._row_sources = {u: mod.row_source for u, mod in self.tables.items()}
        hooks = [self.module.register_forward_pre_hook(self._root_pre),
                 self.module.register_forward_hook(self._root_post)]
        for i, blk in enumerate(block_list):
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
                for t in tree_leaves(output):
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
            for t in tree_leaves(output):
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
            if i not in self._fresh:
                u.hpz_ok = False  # the shards changed: the secondary is stale
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
                 zero_r: ZeroRConfig | None = None, **kw):
        super().__init__(model, topo, zero, train, zero_r, **kw)
        plans = U.plan(self.module, self.units_spec, warn=self.dp_rank == 0)
        shard = self.mesh.shard  # units sharded and gathered over G ranks (HSDP: G < N_d)
        secondary = None
        if zero.hpz:  # hpZ: the mesh shards over all N_d; the secondary over G (``hpz``)
            group = topo.dp_mesh(zero.shard_size, hpz=True).shard
            secondary = (group, bucket_transport(group, self.device))
        units = Units(self.module, plans, self.dtype, shard.size, shard.rank, self.buckets,
                      self.transport, self.zero, self.device, self.init, secondary)
        grads = self._fused_grads(units.groups, on_filled=units.free_unit)
        # replicas hold the same shard: the first replica counts it in the norm
        self._compose(units, grads, units.groups, shard_rank=shard.rank,
                      counts_norm=self.mesh.replicate.rank == 0)

    def _ledger(self, ledger: MemoryLedger) -> None:
        shard_bytes = sum(u.shard.numel() * u.shard.element_size()
                          for u in self.params.grad_units)
        frozen = sum(sh.numel() * sh.element_size() for u in self.params.units
                     for _, sh in u.parts[1 if u.group is not None else 0:])
        where = "_host" if self.params.host else ""  # zero.offload_param: host memory
        ledger.add("params_lp" + where, shard_bytes)
        if frozen:
            ledger.add("params_frozen" + where, frozen)
        ledger.add("grads", self.grads.grad_bytes)  # the persistent gradient shard (offload: 0)
        ledger.add("comm_buffers", self.grads.buffer_bytes)  # the fused gradient buffers
        ledger.add("params_gathered", self.params.gathered_peak.peak)  # transient, peak
        if self.params.hpz is not None:  # hpZ's secondary shards: 2Ψ/G (fp16/bf16)
            ledger.add("params_hpz", self.params.hpz.nbytes)
            ledger.add("comm_buffers", self.params.hpz.transport.held_bytes())
