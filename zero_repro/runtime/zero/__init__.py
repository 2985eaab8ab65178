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
a gradient goes            into the flat  into the flat   into a fused C_B    into its unit's
                           grad buffer    grad buffer     bucket -> reduce-   buffer -> reduce-
                                                          scattered, added    scattered, added
                                                          to the shard        to the shard
reduced when               last micro-    last micro-     every micro-batch   every micro-batch
                           batch          batch
bucket collective          all-reduce     reduce-scatter  reduce-scatter      reduce-scatter
step publishes             nothing        all-gather of   all-gather of       nothing (next
                           (full update)  updated chunks  updated chunks      forward gathers)
comm volume                2Ψ             2Ψ              2Ψ                  3Ψ (- root -
                                                                              last block, kept)
overlap knobs              -              overlap_param_  overlap_param_      prefetch_next_
                                          gather          gather              step, keep_
                                                                              gathered_turn
=========================  =============  ==============  ==================  ==============

Shared machinery: ``strategy`` (step, clipping, optimizer, state dict), ``buckets`` (bucket
pieces and arrivals, stage 0/1 full gradients, the stage 1/2 parameter all-gather),
``flat_buffer`` (flat parameters, gradient shards). How a bucket travels over the DP group is
the group's transport (``zero_repro.runtime.comm.transport``), chosen once per group. The
overlap knobs (``ZeroConfig``, on by default, bit-identical on or off) are described in
``strategy``; ``python -m zero_repro.lab.bench --ab KNOB`` races each off against on.
"""
from __future__ import annotations

from torch import nn

from zero_repro.config import TrainConfig, ZeroConfig, ZeroRConfig
from zero_repro.runtime.comm.topology import Topology
from zero_repro.runtime.zero.stage0_ddp import Stage0DDP
from zero_repro.runtime.zero.stage1_os import Stage1Os
from zero_repro.runtime.zero.stage2_g import Stage2G
from zero_repro.runtime.zero.stage3_p import Stage3P
from zero_repro.runtime.zero.strategy import StepInfo, Strategy

__all__ = ["STAGES", "StepInfo", "Strategy", "build_strategy"]

STAGES: dict[int, type[Strategy]] = {0: Stage0DDP, 1: Stage1Os, 2: Stage2G, 3: Stage3P}


def build_strategy(model: nn.Module, topo: Topology, zero: ZeroConfig, train: TrainConfig,
                   zero_r: ZeroRConfig | None = None) -> Strategy:
    """The strategy class for ``zero.stage`` wrapping ``model`` (parameters are re-pointed into
    flat buffers and cast to ``zero.dtype``; build it after TP and activation checkpointing)."""
    if zero.stage not in STAGES:
        raise ValueError(f"zero.stage={zero.stage} is not one of {sorted(STAGES)}")
    return STAGES[zero.stage](model, topo, zero, train, zero_r)
