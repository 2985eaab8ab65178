"""Validation of a ``Config`` (``validate``): every group, every numeric field's domain; one
``ValueError`` naming the key and the fix, before any process starts. Pure: no files, devices
or machine resources (those are ``lab.launcher.check_runnable`` and ``lab.preflight``).
"""
from __future__ import annotations

import math
import os

from zero_repro.config import (BACKENDS, DATASETS, DEVICES, DTYPES, FAMILIES, LAUNCHERS, OFFLOAD,
                               LOG_LEVELS, MAX_SCALE_POWER, MAX_TIMEOUT_S,
                               MIN_COLLECTIVE_TIMEOUT_S, OUTSIDE_POINTS, SIM_STACKS, STAGES,
                               WANDB_MODES, ZERO_R_NAMES, Config, ModelConfig, ParallelConfig,
                               ffn_width, kv_heads, padded_vocab)


def _choice(value, allowed, key: str) -> None:
    if value not in allowed:
        raise ValueError(f"{key}={value!r} is not one of {list(allowed)}: set {key} to one of them")


def _number(value, key: str, lo: float | None = None, hi: float | None = None,
            lo_open: bool = False, hi_open: bool = False, integer: bool = False) -> None:
    """``value`` is a finite number (an int if ``integer``) in the range lo..hi (open ends
    where asked); ValueError naming ``key`` and the range otherwise."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and (isinstance(value, int) if integer else math.isfinite(value))
    if ok and lo is not None:
        ok = value > lo if lo_open else value >= lo
    if ok and hi is not None:
        ok = value < hi if hi_open else value <= hi
    if not ok:
        lo_s = "" if lo is None else f"{'>' if lo_open else '>='} {lo:g}"
        hi_s = "" if hi is None else f"{'<' if hi_open else '<='} {hi:g}"
        rng = " and ".join(x for x in (lo_s, hi_s) if x)
        kind = "an integer" if integer else "a finite number"
        raise ValueError(f"{key}={value!r} must be {rng} ({kind})" if rng
                         else f"{key}={value!r} must be {kind}")


def _positive(value, key: str) -> None:
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
            and math.isfinite(value)):
        raise ValueError(f"{key}={value!r} must be a positive number")


def validate(cfg: Config) -> Config:
    """Raise ValueError with an actionable one-line message for any inconsistent setting: every
    group, every numeric field's domain. Pure (no files, devices or machine resources: those are
    ``launcher.check_runnable`` and ``zero_repro.lab.preflight``)."""
    _validate_model_parallel(cfg)
    _validate_zero(cfg)
    _validate_train(cfg)
    _validate_cluster_launcher(cfg)
    _validate_logging_experiment(cfg)
    _validate_checkpoint(cfg)
    _validate_fault(cfg)
    return cfg


def _validate_model_parallel(cfg: Config) -> None:
    m, p = cfg.model, cfg.parallel
    for key, v in [("model.n_layer", m.n_layer), ("model.n_embd", m.n_embd),
                   ("model.n_head", m.n_head), ("model.seq_len", m.seq_len),
                   ("model.vocab_size", m.vocab_size), ("parallel.world_size", p.world_size),
                   ("parallel.tp", p.tp), ("model.vocab_pad_multiple", m.vocab_pad_multiple)]:
        _positive(v, key)
    _number(m.dropout, "model.dropout", 0, 1, hi_open=True)
    _number(m.init_std, "model.init_std", 0, 10, lo_open=True)
    if m.n_embd % m.n_head:
        raise ValueError(f"model.n_embd={m.n_embd} is not divisible by model.n_head={m.n_head}")
    if m.n_head % p.tp:
        raise ValueError(f"parallel.tp={p.tp} does not divide model.n_head={m.n_head}: choose a tp "
                         f"that divides {m.n_head}")
    if m.n_embd % p.tp:
        raise ValueError(f"parallel.tp={p.tp} does not divide model.n_embd={m.n_embd}")
    _validate_family(m, p)
    if ffn_width(m) % p.tp:
        raise ValueError(f"parallel.tp={p.tp} does not divide the MLP width {ffn_width(m)}")
    if padded_vocab(m, p.tp) % p.tp:
        raise ValueError(f"parallel.tp={p.tp} does not divide the padded vocabulary")
    if p.world_size % p.tp:
        raise ValueError(f"parallel.world_size={p.world_size} is not divisible by parallel.tp="
                         f"{p.tp}: use a world size that is a multiple of {p.tp}")
    if m.dropout > 0 and p.tp > 1:
        # dropout inside a TP region needs per-rank RNG streams (Megatron's RNG tracker)
        raise ValueError(f"model.dropout={m.dropout} with parallel.tp={p.tp} is not supported: "
                         f"set model.dropout=0 or parallel.tp=1")


def _validate_family(m: ModelConfig, p: ParallelConfig) -> None:
    _choice(m.family, FAMILIES, "model.family")
    _number(m.n_kv_head, "model.n_kv_head", 0, integer=True)
    _number(m.ffn_hidden, "model.ffn_hidden", 0, integer=True)
    _number(m.rope_theta, "model.rope_theta", 0, lo_open=True)
    _number(m.norm_eps, "model.norm_eps", 0, lo_open=True)
    if m.family != "llama":
        return
    if m.bias or m.dropout:
        raise ValueError("model.family=llama has no biases and no dropout: set model.bias=false "
                         "and model.dropout=0")
    if (m.n_embd // m.n_head) % 2:
        raise ValueError(f"model.family=llama: the head size {m.n_embd // m.n_head} must be even "
                         f"(rotary positions rotate pairs)")
    kv = kv_heads(m)
    if m.n_head % kv:
        raise ValueError(f"model.n_kv_head={kv} does not divide model.n_head={m.n_head}")
    if kv % p.tp:
        # each TP rank keeps n_head/tp query heads and the n_kv_head/tp key/value heads they
        # read; replicating key/value heads over TP ranks (tp > n_kv_head) is not implemented
        raise ValueError(f"parallel.tp={p.tp} does not divide model.n_kv_head={kv}: choose a tp "
                         f"that divides {kv}")


def _validate_zero(cfg: Config) -> None:
    z, zr = cfg.zero, cfg.zero_r
    _choice(z.stage, STAGES, "zero.stage")
    _choice(z.dtype, DTYPES, "zero.dtype")
    _choice(zr.name, ZERO_R_NAMES, "zero_r.name")
    _positive(z.reduce_bucket_size, "zero.reduce_bucket_size")
    _positive(z.allgather_bucket_size, "zero.allgather_bucket_size")
    _number(z.prefetch_blocks, "zero.prefetch_blocks", 0, integer=True)
    _number(z.grad_clip, "zero.grad_clip", 0)
    _number(z.initial_scale_power, "zero.initial_scale_power", 0, MAX_SCALE_POWER, integer=True)
    _number(z.loss_scale_window, "zero.loss_scale_window", 1, integer=True)
    _number(z.min_loss_scale, "zero.min_loss_scale", 0, lo_open=True)
    _number(z.hysteresis, "zero.hysteresis", 1, integer=True)
    if z.dtype == "fp16" and z.min_loss_scale > 2.0 ** z.initial_scale_power:
        raise ValueError(f"zero.min_loss_scale={z.min_loss_scale:g} is above the initial loss "
                         f"scale 2**zero.initial_scale_power={2.0 ** z.initial_scale_power:g}: "
                         f"lower zero.min_loss_scale or raise zero.initial_scale_power")
    _choice(cfg.simulate.stack, SIM_STACKS, "simulate.stack")
    _choice(cfg.simulate.outside_point, OUTSIDE_POINTS, "simulate.outside_point")
    if (zr.partition_activations or zr.cpu_checkpointing) and not zr.activation_checkpointing:
        raise ValueError("zero_r.partition_activations / cpu_checkpointing need "
                         "zero_r.activation_checkpointing=true (P_a partitions checkpoints)")
    if zr.cpu_checkpointing and not zr.partition_activations:
        raise ValueError("zero_r.cpu_checkpointing (P_a+cpu) needs "
                         "zero_r.partition_activations=true, as in the paper's C5")
    _validate_offload(cfg)
    _validate_shard_size(cfg)


def _validate_shard_size(cfg: Config) -> None:
    """``zero.shard_size``: a G that divides N_d ("node": the DP ranks of one node as
    ``ranks_per_node`` says, the same count the runtime uses); stages 1-3 (stage 0 shards
    nothing); ``zero.hpz``: stage 3 only (its G is the secondary's); not with ZeRO-Offload yet."""
    z = cfg.zero
    if z.hpz and z.stage != 3:
        raise ValueError(f"zero.hpz=true at zero.stage={z.stage}: hpZ keeps a secondary copy of "
                         f"stage 3's partitioned parameters; use zero.stage=3 or drop zero.hpz")
    if str(z.shard_size) == "all" and not z.hpz:
        return
    if z.stage == 0:
        raise ValueError(f"zero.shard_size={z.shard_size} at zero.stage=0: stage 0 shards "
                         f"nothing; use zero.stage=1, 2 or 3, or drop zero.shard_size")
    if z.offload_optimizer != "none" or z.offload_param != "none":
        knob = "zero.hpz" if z.hpz else "zero.shard_size"
        raise ValueError(f"{knob} with ZeRO-Offload is not supported: "
                         f"drop {knob} or set zero.offload_optimizer=none and "
                         f"zero.offload_param=none")
    tp = max(1, cfg.parallel.tp)
    shard_size_of(z.shard_size, max(1, cfg.parallel.world_size // tp),
                  ranks_per_node(cfg) // tp, hpz=z.hpz)


def ranks_per_node(cfg: Config, launched: bool = True) -> int:
    """The ranks that share one node for ``cfg``, which ``zero.shard_size=node`` shards over
    (validation and the runtime's ``Topology`` both ask this): ``launcher=local`` starts every
    rank on this host (``parallel.world_size``); torchrun and srun start
    min(``cluster.gpus_per_node``, world size) per node, as does a simulated run of the
    cluster (``launched=False``: the dry run, the estimate)."""
    world = max(1, cfg.parallel.world_size)
    if launched and cfg.launcher.name == "local":
        return world
    return min(max(1, cfg.cluster.gpus_per_node), world)


def shard_size_of(shard_size: int | str | None, dp: int, per_node: int,
                  hpz: bool = False) -> int:
    """``zero.shard_size`` -> G: None or "all": every DP rank (``dp``; with ``hpz``, whose G is
    the secondary's partition, as "node"); "node": ``per_node`` DP ranks (those of one node,
    at most ``dp``); else the integer, which must divide ``dp``. Raises ValueError with the
    fix in the message."""
    if (shard_size is None or shard_size == "all") and hpz:
        shard_size = "node"
    if shard_size is None or shard_size == "all":
        return dp
    if shard_size == "node":
        if per_node < 1:
            raise ValueError("zero.shard_size=node: a node holds fewer ranks than parallel.tp: "
                             "give zero.shard_size as a number")
        g = min(dp, per_node)
    else:
        try:
            g = int(shard_size)
        except (TypeError, ValueError):
            raise ValueError(f"zero.shard_size={shard_size!r}: use a positive integer, 'node' "
                             f"(the DP ranks of one node) or 'all' (plain ZeRO)") from None
    if g < 1 or dp % g:
        divisors = [d for d in range(1, dp + 1) if dp % d == 0]
        raise ValueError(f"zero.shard_size={shard_size} must divide the DP size {dp} (world "
                         f"size / parallel.tp): choose one of {divisors}")
    return g


# the 2019 Megatron layer's switches (``scale.era``): they change the activations only, not
# ZeRO's states, so they may run beside the offloaded optimizer (ZeRO-Offload ran on it in 2020)
MEGATRON_2019_LAYER = ("materialized_scores", "dropout_masks", "tanh_gelu_intermediates",
                       "fp32_logits")


def _stack_2020(cfg: Config) -> bool:
    """Whether the dry run's stack is more of 2020 than its Megatron layer."""
    sim = cfg.simulate
    return sim.stack != "modern" or not set(sim.only_switches) <= set(MEGATRON_2019_LAYER)


def _validate_offload(cfg: Config) -> None:
    z = cfg.zero
    _choice(z.offload_optimizer, OFFLOAD, "zero.offload_optimizer")
    _choice(z.offload_param, OFFLOAD, "zero.offload_param")
    if z.offload_param != "none" and z.stage != 3:
        raise ValueError(f"zero.offload_param={z.offload_param} at zero.stage={z.stage}: only "
                         f"stage 3 partitions the parameters (P_p); use zero.stage=3, or "
                         f"zero.offload_optimizer=cpu alone")
    if z.offload_param != "none" and _stack_2020(cfg):
        raise ValueError(f"zero.offload_param={z.offload_param}: the 2020 stack had no "
                         f"parameter offload; use simulate.stack=modern")
    if z.offload_dpu and z.offload_optimizer != "cpu":
        raise ValueError("zero.offload_dpu=true delays the host's update: it needs "
                         "zero.offload_optimizer=cpu")
    if z.offload_dpu_warmup < 0:
        raise ValueError(f"zero.offload_dpu_warmup={z.offload_dpu_warmup}: use 0 or more "
                         f"steps before the update is delayed")
    if z.offload_optimizer == "none":
        return
    dp = cfg.parallel.world_size // max(1, cfg.parallel.tp)
    if z.stage == 0 and dp > 1:
        raise ValueError(f"zero.offload_optimizer={z.offload_optimizer} at zero.stage=0 with DP "
                         f"{dp} keeps the whole optimizer on every rank's host: use zero.stage=1 "
                         f"or 2 (each host then holds 1/{dp} of it)")
    if _stack_2020(cfg):
        raise ValueError(f"zero.offload_optimizer={z.offload_optimizer}: the 2020 stack "
                         f"(simulate.stack={cfg.simulate.stack}, simulate.only_switches) had no "
                         f"offload; use simulate.stack=modern or zero.offload_optimizer=none")


def _validate_train(cfg: Config) -> None:
    t = cfg.train
    for key, v in [("train.micro_batch_size", t.micro_batch_size),
                   ("train.grad_accum", t.grad_accum), ("train.steps", t.steps)]:
        _positive(v, key)
    _number(t.log_every, "train.log_every", 0, integer=True)
    if t.warmup_steps < 0 or t.warmup_steps >= t.steps:
        raise ValueError(f"train.warmup_steps={t.warmup_steps} must be >= 0 and < train.steps="
                         f"{t.steps}, so that at least one step is timed")
    _number(t.lr, "train.lr", 0, lo_open=True)
    _number(t.beta1, "train.beta1", 0, 1, hi_open=True)
    _number(t.beta2, "train.beta2", 0, 1, hi_open=True)
    _number(t.eps, "train.eps", 0, lo_open=True)
    _number(t.weight_decay, "train.weight_decay", 0)
    if t.lr * t.weight_decay >= 1:
        raise ValueError(f"train.lr * train.weight_decay = {t.lr * t.weight_decay:g} >= 1: AdamW "
                         f"would flip the weights' sign every step; lower one of them")
    _number(t.seed, "train.seed", 0, 2 ** 63, hi_open=True, integer=True)
    _choice(t.data, DATASETS, "train.data")
    if t.data == "tokens" and not t.data_path:
        raise ValueError("train.data=tokens needs train.data_path=/path/to/tokens.bin (uint16)")
    if t.data_path and t.data != "tokens":
        raise ValueError(f"train.data_path={t.data_path!r} is read only with train.data=tokens "
                         f"(train.data={t.data}): add train.data=tokens, or drop "
                         f"train.data_path")
    if t.data == "pystdlib" and cfg.model.vocab_size < 256:
        raise ValueError(f"train.data=pystdlib (byte tokens) needs model.vocab_size >= 256, got "
                         f"model.vocab_size={cfg.model.vocab_size}")


def _validate_cluster_launcher(cfg: Config) -> None:
    c, la = cfg.cluster, cfg.launcher
    _choice(c.device, DEVICES, "cluster.device")
    _choice(c.backend, BACKENDS, "cluster.backend")
    _choice(la.name, LAUNCHERS, "launcher.name")
    _positive(c.gpus_per_node, "cluster.gpus_per_node")
    for key in ("device_memory_gb", "device_memory_mib", "peak_tflops", "intra_node_gbps",
                "inter_node_gbps", "pcie_gbps", "hbm_gbps", "sm_count"):
        _number(getattr(c, key), f"cluster.{key}", 0)
    if c.device == "cpu" and c.backend == "nccl":
        raise ValueError("cluster.backend=nccl needs cluster.device=cuda; use gloo on CPU")
    if c.backend == "fake":
        # the fake group's collectives do nothing: losses trained on it are not measurements
        raise ValueError("cluster.backend=fake is the dry-run backend (its collectives do "
                         "nothing, so losses would be wrong); use cluster.backend=gloo "
                         "(or nccl), dry runs select fake themselves")
    _number(la.signal_delay_s, "launcher.signal_delay_s", 0, integer=True)
    _number(la.timeout_min, "launcher.timeout_min", 0, MAX_TIMEOUT_S / 60, lo_open=True)
    _number(la.collective_timeout_s, "launcher.collective_timeout_s",
            MIN_COLLECTIVE_TIMEOUT_S, MAX_TIMEOUT_S)


def _validate_logging_experiment(cfg: Config) -> None:
    lg, e = cfg.logging, cfg.experiment
    if not isinstance(lg.level, str) or lg.level.upper() not in LOG_LEVELS:
        raise ValueError(f"logging.level={lg.level!r} is not one of {list(LOG_LEVELS)}")
    _choice(lg.wandb_mode, WANDB_MODES, "logging.wandb_mode")
    _choice(e.action, ("run", "plot", "plan", "list"), "experiment.action")
    if not e.results_dir:
        raise ValueError("experiment.results_dir='' : give a directory for the records")
    if not e.name:
        raise ValueError("experiment.name='' : select an experiment with +exp=NAME")


def _validate_checkpoint(cfg: Config) -> None:
    ck = cfg.checkpoint
    _number(ck.save_every, "checkpoint.save_every", 0, integer=True)
    _number(ck.keep, "checkpoint.keep", 0, integer=True)
    if not isinstance(ck.allow_untrusted, bool):
        raise ValueError(f"checkpoint.allow_untrusted={ck.allow_untrusted!r}: give true (resume "
                         f"from a checkpoint another account owns or may write) or false")
    if ck.resume in ("", "auto", "latest"):
        return
    if not os.path.isfile(os.path.join(ck.resume, "manifest.json")):
        what = "does not exist" if not os.path.exists(ck.resume) else "has no manifest.json"
        raise ValueError(f"checkpoint.resume={ck.resume!r} {what}: give a checkpoint directory "
                         f"(step_NNNNNNNN), 'latest' or 'auto'")


def _validate_fault(cfg: Config) -> None:
    f = cfg.fault
    _choice(f.mode, ("kill", "raise", "hang"), "fault.mode")
    if f.rank >= cfg.parallel.world_size:
        raise ValueError(f"fault.rank={f.rank} is not a rank of parallel.world_size="
                         f"{cfg.parallel.world_size}")
    if f.rank >= 0 and not 0 <= f.step < cfg.train.steps:
        raise ValueError(f"fault.step={f.step} never happens: train.steps={cfg.train.steps}")


