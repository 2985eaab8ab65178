"""Typed configuration schema (registered in Hydra's ConfigStore) and its validation.

YAML under ``conf/`` only selects and overrides; the schema and its defaults live here.
``validate(cfg)`` raises ``ValueError`` with a one-line message that says what to change; the
CLI calls it before any worker process starts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

STAGES = (0, 1, 2, 3)
DTYPES = ("fp32", "fp16", "bf16")
ZERO_R_NAMES = ("off", "c1", "c2", "c3", "c4", "c5", "custom")
DEVICES = ("cpu", "cuda")
BACKENDS = ("gloo", "nccl", "fake")
LAUNCHERS = ("local", "torchrun", "slurm")
DATASETS = ("synthetic", "tokens", "pystdlib")
# software stacks of the paper-scale dry run (zero_repro.simulate.stack.switches.STACKS)
SIM_STACKS = ("modern", "paper2020")


@dataclass
class ModelConfig:
    name: str = "tiny"
    n_layer: int = 2
    n_embd: int = 64  # hidden size h
    n_head: int = 4
    seq_len: int = 64
    vocab_size: int = 50257  # GPT-2 BPE
    # Megatron pads the vocabulary to a multiple of (this * tp) so that it splits evenly
    vocab_pad_multiple: int = 128
    bias: bool = True
    dropout: float = 0.0
    init_std: float = 0.02
    nominal: str = ""  # the paper's name for the size, e.g. "60B"


@dataclass
class ParallelConfig:
    world_size: int = 2  # total ranks (GPUs) = tp * dp
    tp: int = 1  # Megatron tensor (model) parallel degree, inside a node


@dataclass
class ZeroConfig:
    stage: int = 0  # 0 baseline DP, 1 P_os, 2 P_os+g, 3 P_os+g+p
    dtype: str = "fp32"  # parameter/gradient precision; master + Adam states are fp32
    # C_B: constant-size fused buffers, in elements (independent of the model size)
    reduce_bucket_size: int = 2_000_000
    allgather_bucket_size: int = 2_000_000
    # read only by the DeepSpeed peer (peers/runners.py); this runtime reduces each bucket as
    # it fills, on the compute stream. Kept in the schema because every point key hashes the
    # zero section (measure.records.point_key): removing it would orphan the committed records
    overlap_comm: bool = True
    prefetch_blocks: int = 1  # stage 3: how many blocks ahead to gather
    grad_clip: float = 1.0  # global-norm clip; 0 disables
    # dynamic loss scaling (fp16 only)
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    min_loss_scale: float = 1.0
    hysteresis: int = 2


@dataclass
class ZeroRConfig:
    name: str = "off"  # off | c1..c5 (paper Table 3) | custom
    activation_checkpointing: bool = False  # recompute each block in backward
    partition_activations: bool = False  # P_a: keep 1/tp of each checkpoint
    cpu_checkpointing: bool = False  # P_a+cpu: partitioned checkpoints in CPU memory
    constant_buffers: bool = False  # C_B
    contiguous_memory: bool = False  # M_D: arenas for checkpoints and gradient shards


@dataclass
class TrainConfig:
    micro_batch_size: int = 4  # per data-parallel rank
    grad_accum: int = 1
    steps: int = 10
    warmup_steps: int = 2  # not timed
    lr: float = 3e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0
    seed: int = 1234
    data: str = "synthetic"  # synthetic | tokens (memmap file) | pystdlib (real text, offline)
    data_path: str = ""
    log_every: int = 1
    progress: bool = True


@dataclass
class ClusterConfig:
    name: str = "local"
    device: str = "cpu"
    backend: str = "gloo"
    gpus_per_node: int = 2  # ranks per node
    device_memory_gb: float = 0.0  # 0 = unknown/unbounded (CPU)
    peak_tflops: float = 0.0  # dense half-precision peak of one device (0 = unknown)
    intra_node_gbps: float = 0.0  # GB/s per device inside a node (NVSwitch/NVLink)
    inter_node_gbps: float = 0.0  # Gb/s per node between nodes (InfiniBand)
    pcie_gbps: float = 0.0  # GB/s host<->device
    description: str = "local CPU ranks on gloo"


@dataclass
class LauncherConfig:
    name: str = "local"  # local | torchrun | slurm
    timeout_min: int = 60
    partition: str = ""
    account: str = ""
    collective_timeout_s: float = 300.0


@dataclass
class LoggingConfig:
    wandb: bool = False
    wandb_project: str = "zero-repro"
    wandb_entity: str = ""
    wandb_mode: str = "offline"  # offline | online | disabled
    level: str = "INFO"


@dataclass
class CheckpointConfig:
    """DCP checkpoints (zero_repro.checkpoint): save every N steps, resume on another stage or
    DP size (same TP degree)."""

    dir: str = ""  # "" = <run dir>/checkpoints
    save_every: int = 0  # steps between saves; 0 = never
    resume: str = ""  # "" = start fresh | auto (latest if any) | latest (must exist) | a path
    keep: int = 2  # committed checkpoints kept (0 = all)
    verify: bool = True  # check every file's SHA-256 before loading


@dataclass
class FaultConfig:
    """Fault injection for tests of the failure path (a rank dies or raises mid-step)."""

    rank: int = -1  # -1 = off
    step: int = 0  # before the optimizer step of this step index
    mode: str = "kill"  # kill (os._exit, like an OOM kill or a lost node) | raise | hang


@dataclass
class ExperimentConfig:
    name: str = "smoke"
    action: str = "run"  # run | plot | plan
    force: bool = False  # re-run points already in results/
    results_dir: str = "results"
    params: dict = field(default_factory=dict)  # experiment-specific knobs (see conf/exp/)


@dataclass
class SimulateConfig:
    """Paper-scale dry run (``zero_repro.simulate``); not part of a record's config key
    (``harness.records.KEY_SECTIONS``): experiments put the stack into their point params."""

    # software stack the dry run executes: modern (this runtime) | paper2020 (DeepSpeed 0.2 +
    # 2019 Megatron-LM + PyTorch 1.x allocator, ``simulate.stack.switches``)
    stack: str = "modern"
    # non-empty: modern with only these paper2020 switches on (one switch's cost), e.g.
    # [materialized_scores]; the stack name is then ignored
    only_switches: list = field(default_factory=list)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    zero_r: ZeroRConfig = field(default_factory=ZeroRConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    experiment: ExperimentConfig = field(default_factory=ExperimentConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    simulate: SimulateConfig = field(default_factory=SimulateConfig)


def register_configs() -> None:
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    for group, node in [("model", ModelConfig), ("parallel", ParallelConfig), ("zero", ZeroConfig),
                        ("zero_r", ZeroRConfig), ("train", TrainConfig),
                        ("cluster", ClusterConfig), ("launcher", LauncherConfig),
                        ("logging", LoggingConfig), ("checkpoint", CheckpointConfig),
                        ("fault", FaultConfig), ("simulate", SimulateConfig)]:
        cs.store(group=group, name=f"base_{group}", node=node)


# ------------------------------------------------------------------------------------ helpers
def padded_vocab(model: ModelConfig, tp: int) -> int:
    """Megatron's padding: round the vocabulary up to a multiple of vocab_pad_multiple * tp."""
    m = model.vocab_pad_multiple * tp
    return int(math.ceil(model.vocab_size / m) * m)


def to_config(cfg: DictConfig | Config) -> Config:
    """DictConfig (from Hydra or a resolved YAML file) -> typed ``Config`` object."""
    if isinstance(cfg, Config):
        return cfg
    merged = OmegaConf.merge(OmegaConf.structured(Config), cfg)
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


def load(path: str) -> Config:
    return to_config(OmegaConf.load(path))


def save(cfg: Config | DictConfig, path: str) -> None:
    import os

    tmp = path + ".tmp"
    OmegaConf.save(OmegaConf.structured(cfg) if isinstance(cfg, Config) else cfg, tmp)
    os.replace(tmp, path)


def _choice(value, allowed, key: str) -> None:
    if value not in allowed:
        raise ValueError(f"{key}={value!r} is not one of {list(allowed)}: set {key} to one of them")


def _positive(value, key: str) -> None:
    if not (isinstance(value, (int, float)) and value > 0):
        raise ValueError(f"{key}={value!r} must be a positive number")


def validate(cfg: Config) -> Config:
    """Raise ValueError with an actionable message for any inconsistent setting."""
    m, p, z, zr, t = cfg.model, cfg.parallel, cfg.zero, cfg.zero_r, cfg.train
    for key, v in [("model.n_layer", m.n_layer), ("model.n_embd", m.n_embd),
                   ("model.n_head", m.n_head), ("model.seq_len", m.seq_len),
                   ("model.vocab_size", m.vocab_size), ("parallel.world_size", p.world_size),
                   ("parallel.tp", p.tp), ("train.micro_batch_size", t.micro_batch_size),
                   ("train.grad_accum", t.grad_accum), ("train.steps", t.steps),
                   ("zero.reduce_bucket_size", z.reduce_bucket_size),
                   ("zero.allgather_bucket_size", z.allgather_bucket_size),
                   ("model.vocab_pad_multiple", m.vocab_pad_multiple)]:
        _positive(v, key)
    if t.warmup_steps < 0 or t.warmup_steps >= t.steps:
        raise ValueError(f"train.warmup_steps={t.warmup_steps} must be >= 0 and < train.steps="
                         f"{t.steps}, so that at least one step is timed")
    if m.n_embd % m.n_head:
        raise ValueError(f"model.n_embd={m.n_embd} is not divisible by model.n_head={m.n_head}")
    if m.n_head % p.tp:
        raise ValueError(f"parallel.tp={p.tp} does not divide model.n_head={m.n_head}: choose a tp "
                         f"that divides {m.n_head}")
    if m.n_embd % p.tp:
        raise ValueError(f"parallel.tp={p.tp} does not divide model.n_embd={m.n_embd}")
    if (4 * m.n_embd) % p.tp:
        raise ValueError(f"parallel.tp={p.tp} does not divide the MLP width 4*{m.n_embd}")
    if padded_vocab(m, p.tp) % p.tp:
        raise ValueError(f"parallel.tp={p.tp} does not divide the padded vocabulary")
    if p.world_size % p.tp:
        raise ValueError(f"parallel.world_size={p.world_size} is not divisible by parallel.tp="
                         f"{p.tp}: use a world size that is a multiple of {p.tp}")
    _choice(z.stage, STAGES, "zero.stage")
    _choice(z.dtype, DTYPES, "zero.dtype")
    _choice(zr.name, ZERO_R_NAMES, "zero_r.name")
    _choice(cfg.cluster.device, DEVICES, "cluster.device")
    _choice(cfg.cluster.backend, BACKENDS, "cluster.backend")
    _choice(cfg.launcher.name, LAUNCHERS, "launcher.name")
    _choice(t.data, DATASETS, "train.data")
    _choice(cfg.simulate.stack, SIM_STACKS, "simulate.stack")
    _choice(cfg.experiment.action, ("run", "plot", "plan"), "experiment.action")
    if t.data == "tokens" and not t.data_path:
        raise ValueError("train.data=tokens needs train.data_path=/path/to/tokens.bin (uint16)")
    if z.prefetch_blocks < 0:
        raise ValueError(f"zero.prefetch_blocks={z.prefetch_blocks} must be >= 0")
    if z.grad_clip < 0:
        raise ValueError(f"zero.grad_clip={z.grad_clip} must be >= 0 (0 disables clipping)")
    if (zr.partition_activations or zr.cpu_checkpointing) and not zr.activation_checkpointing:
        raise ValueError("zero_r.partition_activations / cpu_checkpointing need "
                         "zero_r.activation_checkpointing=true (P_a partitions checkpoints)")
    if zr.cpu_checkpointing and not zr.partition_activations:
        raise ValueError("zero_r.cpu_checkpointing (P_a+cpu) needs "
                         "zero_r.partition_activations=true, as in the paper's C5")
    if cfg.cluster.device == "cuda" and cfg.cluster.backend == "gloo" and p.world_size > 1:
        pass  # allowed (slow) for debugging
    if cfg.cluster.device == "cpu" and cfg.cluster.backend == "nccl":
        raise ValueError("cluster.backend=nccl needs cluster.device=cuda; use gloo on CPU")
    if cfg.launcher.collective_timeout_s <= 0:
        raise ValueError(f"launcher.collective_timeout_s={cfg.launcher.collective_timeout_s} "
                         f"must be > 0 (a dead rank must not hang the others forever)")
    _validate_checkpoint(cfg)
    _validate_fault(cfg)
    return cfg


def _validate_checkpoint(cfg: Config) -> None:
    ck = cfg.checkpoint
    if ck.save_every < 0:
        raise ValueError(f"checkpoint.save_every={ck.save_every} must be >= 0 (0 = never)")
    if ck.keep < 0:
        raise ValueError(f"checkpoint.keep={ck.keep} must be >= 0 (0 = keep all)")
    if ck.resume in ("", "auto", "latest"):
        return
    import os

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


def summary(cfg: Config) -> dict[str, Any]:
    """Flat dict of the knobs that identify a run point (for records and W&B)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore

