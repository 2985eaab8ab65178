"""One training run's build (``build``): the model and every parallelism applied from outside, in a
fixed order (as torchtitan's ``parallelize_llama``): 1. TP (Megatron: the model, GPT or Llama by
``model.family``, is built with the TP group); 2. activation checkpointing (ZeRO-R §6.1: P_a, P_a+cpu, the M_D arena) wraps the blocks;
3. the ZeRO-DP wrap (§5, stages 0-3): parameters re-pointed into flat buffers in the training
dtype, this rank's shard of fp32 master + Adam state created by the strategy.

Construction is partitioned (§5.3: no rank holds the whole model, not even while building it):
the model is built on the ``meta`` device (shapes, no storage) and the strategy materialises it
on the device group by group -- stage 3 one unit at a time, its chunks kept, the unit freed --
each filled by the model's own TP-consistent initialisation (``init_weights(only=...)``: the
same values as a model built with them, for any stage, DP size and unit order). Build peak:
stages 0-2 the flat parameters + optimizer state, stage 3 the largest unit + this rank's shards.

Used by the rank program, the dry run (``zero_repro.scale.dryrun.dryrun``: meta tensors, fake
group), the benchmark and the tests. The model is built in the training dtype (an fp32 build of
one rank of a 100B model, 6.25B parameters at TP 16, would need 25 GB before the cast); the fp32
master exists for this rank's shard only.
"""
from __future__ import annotations

import contextlib
import functools
import logging
from typing import Callable, ContextManager

import torch

from zero_repro import config as C
from zero_repro.runtime.comm import launch
from zero_repro.runtime.comm.topology import Topology
from zero_repro.runtime.model import model_class
from zero_repro.runtime.model.gpt import GPT
from zero_repro.runtime.model.llama import Llama
from zero_repro.runtime.zero import build_strategy
from zero_repro.runtime.zero.precision import lp_dtype
from zero_repro.runtime.zero.strategy import Strategy
from zero_repro.runtime.zero_r.activation_ckpt import ActivationCheckpointing, apply_activation_checkpointing

log = logging.getLogger(__name__)


def dp1_warning(cfg: C.Config, dp: int) -> str | None:
    """ZeRO-DP partitions over the DP group (§5): at DP = 1 there is nothing to partition, so
    stages 1-3 hold the same memory and compute the same thing as stage 0."""
    if cfg.zero.stage >= 1 and dp == 1:
        p = cfg.parallel
        return (f"zero.stage={cfg.zero.stage} with DP = 1 (world {p.world_size} = TP {p.tp} x "
                f"DP 1): ZeRO partitions over DP ranks, so this run is stage 0 in all but name; "
                f"raise parallel.world_size or lower parallel.tp to see the stage")
    return None


def build(cfg: C.Config, topo: Topology, device: torch.device, *,
          make_model: Callable | None = None, make_ckpt: Callable | None = None,
          make_strategy: Callable | None = None, warn_dp1: bool = True,
          partitioned: bool = True,
          skeleton_scope: Callable[[], ContextManager] = contextlib.nullcontext
          ) -> tuple[GPT | Llama, ActivationCheckpointing | None, Strategy]:
    """TP model -> activation checkpointing -> ZeRO strategy. Returns (model, checkpointing
    handle or None, strategy).

    The three steps can be replaced, the order cannot: the paper-scale dry run's ``paper2020``
    stack (``zero_repro.scale.dryrun.stack``) passes the 2019 layer (``make_model(cfg, topo,
    device, dtype)``), the 2019 checkpointing (``make_ckpt(model, topo, zero_r)``) and
    DeepSpeed 0.2's ZeRO-DP allocation sequence (``make_strategy(model, topo, cfg)``); the
    defaults are the runtime's. ``partitioned`` (default): the model is made on the meta
    device and materialised by the strategy (module docstring); False: made on ``device``
    with its values, then wrapped (the 2020 build, which had no partitioned construction).
    ``skeleton_scope``: the context the storage-less model is made in (the dry run's tracer
    leaves it out: on a real device it holds no memory). ``warn_dp1=False``: a caller that builds stages 1-3 at DP 1 on purpose
    (Table 1's N_d = 1 row) is not warned that they equal stage 0."""
    warning = dp1_warning(cfg, topo.dp) if warn_dp1 else None
    if warning and topo.rank == 0:
        log.warning(warning)
    torch.manual_seed(cfg.train.seed)
    dtype = lp_dtype(cfg.zero.dtype)
    # a GPU draws its weights itself (a rank draws every full TP=1 tensor: 60B samples for
    # Fig 3's model, ~18 min single-threaded on a CPU, seconds on the device)
    on = "device" if device.type == "cuda" else "cpu"
    make = make_model or functools.partial(_family_model, init_on=on)
    init = None
    if partitioned:
        with skeleton_scope():
            model = make(cfg, topo, torch.device("meta"), dtype)
        # the model's own default seed (0), as a model built with its values draws them
        init = functools.partial(_init_named, model, 0, on)
    else:
        model = make(cfg, topo, device, dtype)
    ckpt = None
    if cfg.zero_r.activation_checkpointing:
        ckpt = (make_ckpt or apply_activation_checkpointing)(model, topo, cfg.zero_r)
    if make_strategy is None:
        # automatic knobs resolved for the cluster's device, not this process's (the dry run
        # of a GPU cluster runs on CPU fake tensors and must take the GPU schedule)
        strategy = build_strategy(model, topo, C.effective_zero(cfg.zero, cfg.cluster.device),
                                  cfg.train, cfg.zero_r, device=device, init=init)
    else:
        strategy = make_strategy(model, topo, cfg)
    return model, ckpt, strategy


def _family_model(cfg: C.Config, topo: Topology, device: torch.device, dtype: torch.dtype,
                  init_on: str = "cpu") -> GPT | Llama:
    """The family's class (GPT or Llama), TP layers built in."""
    return model_class(cfg.model)(cfg.model, tp_group=topo.tp_group, device=device,
                                  dtype=dtype, init_on=init_on)


def _init_named(model, seed: int, on: str, named: list) -> None:
    model.init_weights(seed, on=on, only=[t for _, t in named])


def device_for(cfg: C.Config, local_rank: int) -> torch.device:
    """The device of this rank (``cluster.device``); CUDA: ``launch.cuda_device(local_rank)``
    (``local_rank`` modulo the visible GPUs)."""
    if cfg.cluster.device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("cluster.device=cuda but CUDA is not available on this machine; "
                               "use cluster=local")
        return launch.cuda_device(local_rank)
    return torch.device("cpu")
