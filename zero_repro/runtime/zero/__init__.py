"""ZeRO-DP (paper §5): one Strategy per stage behind one interface (``strategy.Strategy``),
built by ``build_strategy``.

The stages side by side (Ψ parameters, N_d DP ranks, K = 12 for mixed-precision Adam; memory in
bytes per rank at fp16 params/grads, Table 1; communication in elements per step over the DP
group, §7 convention of ``zero_repro.runtime.comm.comm``):

=========================  =============  ==============  ==================  ==============
                           0 baseline DP  1 P_os          2 P_os+g            3 P_os+g+p
=========================  =============  ==============  ==================  ==============
module                     stage0_ddp     stage1_os       stage2_g            stage3_p
params (training dtype)    full           full            full                shard, gathered
                                                                              per unit in use
grads                      full (flat)    full (flat)     shard               shard
optimizer (master, m, v)   full           shard           shard               shard
memory                     (2+2+K)Ψ       4Ψ + KΨ/N_d     2Ψ + (2+K)Ψ/N_d     (2+2+K)Ψ/N_d
gradient store             FullGrads      FullGrads       FusedGrads          FusedGrads
parameter store            Replicated     Gathered        Gathered            Units
a gradient goes            into the flat  into the flat   into a fused        into a fused
                           grad buffer    grad buffer     buffer -> reduce-   buffer -> reduce-
                                                          scattered into      scattered into
                                                          the shard           the shard
reduced when               last micro-    last micro-     every micro-batch   every micro-batch
                           batch          batch
bucket collective          all-reduce     reduce-scatter  reduce-scatter      reduce-scatter
step publishes             nothing        all-gather of   all-gather of       nothing (next
                           (full update)  updated chunks  updated chunks      forward gathers)
comm volume                2Ψ             2Ψ              2Ψ                  3Ψ (- root -
                                                                              last block, kept;
                                                                              + 2Ψ_V, a table
                                                                              read in slices)
fused buffers F            0              0               min(D, n_R)·C_R·b   min(D, n_R)·C_R·b
                                                          (C_B off: 0)
overlap knobs              -              overlap_param_  overlap_param_      prefetch_next_
                                          gather          gather              step, keep_
                                                                              gathered_turn
=========================  =============  ==============  ==================  ==============

Buffers (``comm_buffers`` of the ledger, per rank, ``comm_buffer_bytes``) = F + T. The bucket
knobs: ``zero.reduce_bucket_size`` R = elements per gradient bucket, ``zero.allgather_bucket_size``
A = elements per parameter all-gather bucket; one collective moves one bucket of the grid
G = min(R, A) (``partition``). F, the fused gradient buffers of stages 2-3 (b bytes per
element): D = 2 with C_B (one filling, one on the wire) of C_R, the largest gradient bucket
(<= R), never more than the n_R buckets there are; without C_B stage 3 keeps D = 1 of its largest
unit, and stage 2 none: it reduces its one model-size bucket in place in its full gradient
buffer, as stages 0-1 do (counted as ``grads``; the shard lies in it: stage 1's memory, the
paper's baseline of one fused buffer of Ψ). T, what the DP transport holds itself
(``zero_repro.runtime.comm.transport.held_bytes_of``; c the largest chunk G/N_d, n_G the number
of buckets): native min(2, n_G)·c·b where a stage's collectives alias their inputs (in-place
reduce-scatters of a full gradient buffer, the gathers of stages 1-2), else 0; pairwise gloo
min(2, n_G)·(N_d - 1)·c·b for in-place reduce-scatters, min(2, n_G, D)·(N_d - 2)·c·b where
fused buffers reduce into the shard, 0 at stage 0; the CPU channel of one host its constant
segment of slots; the dry run's rooted one 0. (With gradient accumulation, later micro-batches
of stages 2-3 reduce in place: one more chunk per reduce-scatter in flight.) Invariant: no
stage holds more than the one before it, C_B on or off.

ZeRO-Offload (Ren et al. 2021; ``zero.offload_optimizer=cpu``, ``offload.HostAdamW``): the
optimizer row of the table moves to the host at any stage (stage 0 only at N_d = 1): master, m
and v of the shard plus the lp copy of its gradients, (12 + lp)Ψ/N_d host bytes; the device
keeps the stage's parameters and gradients (P_os+g: 2Ψ + 2Ψ/N_d); lp·Ψ/N_d bytes over PCIe each
way per step (``scale.paper.table1.offload_bytes``).

Shared machinery: ``strategy`` (the step's lifecycle, clipping, optimizer, state dict),
``grads`` (gradient stores), ``params`` (parameter stores of stages 0-2), ``flat_buffer`` (flat
parameters, gradient shards), ``partition`` (bucket arithmetic). How a bucket travels over the
DP group is the group's transport (``zero_repro.runtime.comm.transport``), chosen once per
strategy. The overlap knobs (``ZeroConfig``, on by default, bit-identical on or off) are
described in ``strategy``; ``python -m zero_repro.lab.bench --ab KNOB`` races each off against on.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from zero_repro.config import TrainConfig, ZeroConfig, ZeroRConfig
from zero_repro.runtime.comm.topology import Topology
from zero_repro.runtime.comm.transport import held_bytes_of
from zero_repro.runtime.zero.build_init import Init
from zero_repro.runtime.zero.optim import OptimizerArg
from zero_repro.runtime.zero.partition import geometry
from zero_repro.runtime.zero.stage0_ddp import Stage0DDP
from zero_repro.runtime.zero.stage1_os import Stage1Os
from zero_repro.runtime.zero.stage2_g import Stage2G
from zero_repro.runtime.zero.stage3_p import Stage3P
from zero_repro.runtime.zero.strategy import StepInfo, Strategy
from zero_repro.runtime.zero.units import Units

__all__ = ["STAGES", "StepInfo", "Strategy", "build_strategy", "comm_buffer_bytes"]

STAGES: dict[int, type[Strategy]] = {0: Stage0DDP, 1: Stage1Os, 2: Stage2G, 3: Stage3P}
UNBOUNDED = 1 << 62  # a bucket knob without C_B: one bucket per flat group


def build_strategy(model: nn.Module, topo: Topology, zero: ZeroConfig, train: TrainConfig,
                   zero_r: ZeroRConfig | None = None, *, units: Units = None,
                   optimizer: OptimizerArg | None = None, device: torch.device | str | None = None,
                   init: Init | None = None) -> Strategy:
    """The strategy class for ``zero.stage`` wrapping ``model`` (parameters are re-pointed into
    flat buffers and cast to ``zero.dtype``; build it after TP and activation checkpointing).

    ``units`` (stage 3): which modules are gathered and freed as one (``units``: modules
    in forward order or a predicate; default ``model.blocks``). ``optimizer``: a
    ``torch.optim.Optimizer`` built on the model's parameters, or a callable taking the model's
    (name, parameter) pairs and returning one; it is moved onto this rank's fp32 shard
    (``optim``; ``strategy.optimizer`` is it); default the built-in sharded AdamW of ``train``. ``device``: where the buffers go (default the parameters');
    a model built on the ``meta`` device is materialised there group by group (stage 3: unit
    by unit) and filled by ``init`` (``build_init``; default each module's
    ``reset_parameters()``)."""
    if zero.stage not in STAGES:
        raise ValueError(f"zero.stage={zero.stage} is not one of {sorted(STAGES)}")
    return STAGES[zero.stage](model, topo, zero, train, zero_r, units=units,
                              optimizer=optimizer, device=device, init=init)


def comm_buffer_bytes(stage: int, groups: Sequence[int | tuple[int, int]], n_d: int, elt: int,
                      buckets: tuple[int, int] | None, transport: str = "native") -> int:
    """The stage table's buffers F + T per rank, in bytes: ``groups`` the elements of every flat
    group (stages 0-2: [Ψ]; stage 3: every unit's; a unit with a bucket grid of its own, stage
    3's sliced vocabulary table, as (elements, grid)), ``elt`` bytes per training-dtype element,
    ``buckets`` (R, A) with C_B or None without, ``transport`` the DP transport's ``name``."""
    r, a = buckets or (UNBOUNDED, UNBOUNDED)
    sized = [(g, UNBOUNDED) if isinstance(g, int) else g for g in groups]
    if stage == 0:  # one shard, gradient buckets only
        parts = [geometry(n, 1, min(r, g)) for n, g in sized if n]
    else:
        parts = [geometry(n, n_d, min(r, g), min(a, g)) for n, g in sized if n]
    depth = 2 if buckets else 1
    full_store = stage < 2 or (stage == 2 and buckets is None)  # reduced in place, no F
    fused = 0
    if not full_store and parts:
        n_r = sum(p.grad_buckets for p in parts)
        fused = min(depth, n_r) * max(p.capacity for p in parts) * elt
    n_g = sum(p.buckets for p in parts)
    c = max((p.chunk for p in parts), default=0)
    # collectives in flight at once: a full gradient buffer starts every bucket's before
    # waiting any, stages 1-2 every gather bucket's (in place); fused buffers reduce as many
    # buckets as are in use, into the shard
    staged = n_g if stage in (1, 2) else 0
    reduce_scatters = 0 if stage == 0 else n_g if full_store else min(n_g, depth)
    return fused + held_bytes_of(transport, n_d, c, elt, staged, reduce_scatters,
                                 rs_in_place=full_store)
