"""Typed configuration schema (registered in Hydra's ConfigStore) and its validation.

YAML under ``conf/`` only selects and overrides; the schema and its defaults live here.
``validate(cfg)`` raises ``ValueError`` with a one-line message that says what to change; the
CLI calls it before any worker process starts.
"""
from __future__ import annotations

import dataclasses
import math
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from zero_repro import paths
from zero_repro.paths import conf_group_dir

STAGES = (0, 1, 2, 3)
DTYPES = ("fp32", "fp16", "bf16")
ZERO_R_NAMES = ("off", "c1", "c2", "c3", "c4", "c5", "custom")
DEVICES = ("cpu", "cuda")
BACKENDS = ("gloo", "nccl", "fake")
LAUNCHERS = ("local", "torchrun", "slurm")
DATASETS = ("synthetic", "tokens", "pystdlib")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
WANDB_MODES = ("offline", "online", "disabled")
# results directories: the user's own, git-ignored, and the committed reference set (written only
# with publish=true); ``to_config`` anchors them (``paths.results_path``), not the working dir
LOCAL_RESULTS = paths.LOCAL_RESULTS
REFERENCE_RESULTS = paths.REFERENCE_RESULTS
# 2**initial_scale_power must be a finite fp32 number that leaves fp16 gradients room: fp16's
# largest value is 65504 = 2**16 * 0.9995, DeepSpeed's default power is 16, 2**32 the most any
# recipe uses; beyond it every step overflows until the scale has halved back down
MAX_SCALE_POWER = 32
# the longest wait the clocks under a run accept: Python keeps timeouts as int64 nanoseconds
# (threading.TIMEOUT_MAX, also signal.setitimer's limit), ~292 years; c10d takes more
MAX_TIMEOUT_S = threading.TIMEOUT_MAX
# c10d counts whole milliseconds and the rendezvous of the ranks (init_process_group, same
# timeout) takes longer than a second on a loaded machine: below this nothing can run
MIN_COLLECTIVE_TIMEOUT_S = 1.0
# software stacks of the paper-scale dry run (zero_repro.scale.dryrun.stack.switches.STACKS)
SIM_STACKS = ("modern", "paper2020", "paper2020_least", "paper2020_most")
# Record identity, declared on the fields (``identity``). Every field identifies a run point
# unless its metadata holds ``identity: False``; ``ABSENT`` is the value a record made before
# the field existed ran with (default: the field's default). A schema change that alters
# identities migrates the committed records' keys (``zero_repro.lab.records.migrate``)
IDENTITY = "identity"
NOT_IDENTITY = {IDENTITY: False}
ABSENT = "absent"
OUTSIDE_POINTS = ("low", "mid", "high")  # scale.dryrun.stack.outside.POINTS
FAMILIES = ("gpt", "llama")


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
    # architecture: gpt (GPT-2: LayerNorm, GELU MLP of 4h, learned positions, tied head) | llama
    # (RMSNorm, SwiGLU MLP of ffn_hidden, rotary positions, grouped-query attention, untied
    # head; no biases, no dropout: runtime.model.llama)
    family: str = "gpt"
    n_kv_head: int = 0  # llama: key/value heads (grouped-query attention); 0 = n_head
    ffn_hidden: int = 0  # llama: SwiGLU width; 0 = Meta's rule for multiple_of 256 (ffn_width)
    rope_theta: float = 10000.0  # llama: rotary base
    norm_eps: float = 1e-5  # llama: RMSNorm epsilon


@dataclass
class ParallelConfig:
    world_size: int = 2  # total ranks (GPUs) = tp * dp
    tp: int = 1  # Megatron tensor (model) parallel degree, inside a node


@dataclass
class ZeroConfig:
    stage: int = 0  # 0 baseline DP, 1 P_os, 2 P_os+g, 3 P_os+g+p
    dtype: str = "fp32"  # parameter/gradient precision; master + Adam states are fp32
    # C_B (zero_r.constant_buffers), in elements, independent of the model size: a gradient
    # bucket (filled, then all-reduced / reduce-scattered at once) and a parameter all-gather
    # bucket; without C_B one bucket of the whole model each
    reduce_bucket_size: int = 2_000_000
    allgather_bucket_size: int = 2_000_000
    prefetch_blocks: int = 1  # stage 3: how many blocks ahead to gather
    # stages 1-2: a bucket's parameter all-gather starts as soon as Adam updated its chunk and
    # the next forward waits per module for the buckets it reads (bit-identical results). Off:
    # the all-gather completes inside step(). None (default): on when the ranks run on GPUs
    # (cluster.device=cuda: NCCL transfers on their own engines), off on CPU, where gloo's
    # transfers take the cores Adam and the next forward need (measured 11% slower at stage 2
    # on 2 cores: results/peers/overlap_ab.md). ``effective_zero`` resolves it. Records made
    # before the knob existed ran with it on (``ABSENT``)
    overlap_param_gather: Optional[bool] = field(default=None, metadata={ABSENT: True})
    # stage 3: the next forward's first gathers (root, first ``prefetch_blocks`` blocks) start
    # in step() as soon as Adam updated their shards, overlapping the rest of the update
    prefetch_next_step: bool = True
    # stage 3: the root unit (embeddings, tied head) and the last block stay gathered from the
    # end of forward into backward instead of being released and gathered again at once; the
    # params_gathered peak is unchanged (forward already holds root + 1 + prefetch_blocks
    # blocks), the root is held while the loss is computed
    keep_gathered_turn: bool = True
    # stage 3: a vocabulary table (the token embedding, GPT's tied head) larger than a block is
    # never gathered whole: its lookup and the head read it a row slice at a time (slices of at
    # most a block's elements and of A), so the gathered working set stays a block's; it costs
    # the table's gather twice more per step (lookup, head forward, head backward). Off: the
    # table is a root unit gathered whole. Records made before the knob existed ran it off
    slice_vocab_gather: bool = field(default=True, metadata={ABSENT: False})
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
    # rank 0 logs a step line every N steps (and the last); 0 = none
    log_every: int = field(default=1, metadata=NOT_IDENTITY)
    # the sweep's progress bar (points done / total, ETA)
    progress: bool = field(default=True, metadata=NOT_IDENTITY)


@dataclass
class ClusterConfig:
    name: str = "local"
    device: str = "cpu"
    backend: str = "gloo"
    gpus_per_node: int = 2  # ranks per node
    device_memory_gb: float = 0.0  # datasheet size, GB = 1e9 B: closed-form Tables 1/2 only
    # total device memory as the device reports it (nvidia-smi / NVML total, MiB = 2^20 B):
    # what an allocator can ever hold (scale.hardware.device_bytes); 0 = device_memory_gb
    device_memory_mib: float = 0.0
    peak_tflops: float = 0.0  # dense half-precision peak of one device (0 = unknown)
    intra_node_gbps: float = 0.0  # GB/s per device inside a node (NVSwitch/NVLink)
    inter_node_gbps: float = 0.0  # Gb/s per node between nodes (InfiniBand)
    pcie_gbps: float = 0.0  # GB/s host<->device
    hbm_gbps: float = 0.0  # GB/s device memory bandwidth (vendor datasheet; 0 = unknown)
    sm_count: int = 0  # streaming multiprocessors per device (vendor; 0 = unknown)
    # words for tables (the throughput figures' hardware column): not what a point measures
    description: str = field(default="local CPU ranks on gloo", metadata=NOT_IDENTITY)


@dataclass
class LauncherConfig:
    name: str = "local"  # local | torchrun | slurm
    # per point: Slurm's --time; on the local launcher the point's ranks are stopped after it
    # and its record says ``timeout`` (zero_repro.lab.sweep.wall_clock_limit)
    timeout_min: float = 60.0
    partition: str = ""
    account: str = ""
    collective_timeout_s: float = 300.0
    # launcher=slurm: Slurm sends SIGUSR2 this long before the time limit (submitit's --signal)
    signal_delay_s: int = 120
    # run even when the local ranks outnumber the CPU cores (x RANKS_PER_CORE) or the analytic
    # memory estimate exceeds this machine's memory (zero_repro.lab.preflight)
    oversubscribe: bool = False


@dataclass
class LoggingConfig:
    wandb: bool = False
    wandb_project: str = "zero-repro"
    wandb_entity: str = ""
    wandb_mode: str = "offline"  # offline | online | disabled
    level: str = "INFO"


@dataclass
class CheckpointConfig:
    """DCP checkpoints (zero_repro.runtime.train.checkpoint): save every N steps, resume on another stage or
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
    action: str = "run"  # run | plot | plan | list
    force: bool = False  # re-run points already in results/
    verbose: bool = False  # plan lines list each point's config overrides
    # where this run's records, tables and figures go: the git-ignored results/local/ by
    # default; the committed results/ (the reference set) only on purpose, with publish=true
    results_dir: str = LOCAL_RESULTS
    publish: bool = False  # write into the reference set results/ (results_dir is then results)
    params: dict = field(default_factory=dict)  # experiment-specific knobs (see conf/exp/)


@dataclass
class SimulateConfig:
    """Paper-scale dry run (``zero_repro.scale``); not part of a record's identity
    (``Config.simulate``): experiments put the stack into their point params."""

    # software stack the dry run executes: modern (this runtime) | paper2020 (DeepSpeed 0.2 +
    # 2019 Megatron-LM + PyTorch 1.x allocator, ``scale.dryrun.stack.switches``)
    stack: str = "modern"
    # non-empty: modern with only these paper2020 switches on (one switch's cost), e.g.
    # [materialized_scores]; the stack name is then ignored
    only_switches: list = field(default_factory=list)
    # where in the stack's bracket of bytes outside the caching allocator (CUDA context, NCCL;
    # ``scale.dryrun.stack.outside``) the judged capacity sits: low | mid | high
    outside_point: str = "mid"


@dataclass
class Config:
    """The whole configuration. A section or field whose metadata says ``identity: False``
    does not identify a run point (``identity``): how a run is launched, logged, stored or
    displayed, not what it computes."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    zero_r: ZeroRConfig = field(default_factory=ZeroRConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig, metadata=NOT_IDENTITY)
    logging: LoggingConfig = field(default_factory=LoggingConfig, metadata=NOT_IDENTITY)
    experiment: ExperimentConfig = field(default_factory=ExperimentConfig,
                                         metadata=NOT_IDENTITY)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig,
                                         metadata=NOT_IDENTITY)
    fault: FaultConfig = field(default_factory=FaultConfig, metadata=NOT_IDENTITY)
    simulate: SimulateConfig = field(default_factory=SimulateConfig, metadata=NOT_IDENTITY)


def register_resolvers() -> None:
    """``${zr_home:}`` in ``conf/config.yaml`` (Hydra's run/sweep folders):
    ``paths.home()``."""
    OmegaConf.register_new_resolver("zr_home", lambda: str(paths.home()),
                                    replace=True)


def register_configs() -> None:
    register_resolvers()
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


def kv_heads(model: ModelConfig) -> int:
    """Key/value heads: ``n_kv_head`` (grouped-query attention), else one per query head."""
    return model.n_kv_head or model.n_head


def ffn_width(model: ModelConfig) -> int:
    """The MLP's hidden width: 4h for GPT; for Llama ``ffn_hidden`` or, when 0, Meta's rule
    (llama/model.py FeedForward: int(2·4h/3) rounded up to a multiple of 256)."""
    if model.family != "llama":
        return 4 * model.n_embd
    if model.ffn_hidden:
        return model.ffn_hidden
    return 256 * -(-int(2 * 4 * model.n_embd / 3) // 256)


def to_config(cfg: DictConfig | Config) -> Config:
    """DictConfig (from Hydra or a resolved YAML file) -> typed ``Config`` object.
    ``experiment.publish=true`` turns the default results directory into the reference set;
    the results directory becomes an absolute path (``paths.results_path``)."""
    if isinstance(cfg, Config):
        return cfg
    merged = OmegaConf.merge(OmegaConf.structured(Config), cfg)
    out = OmegaConf.to_object(merged)
    e = out.experiment
    if e.publish and e.results_dir == LOCAL_RESULTS:
        e.results_dir = REFERENCE_RESULTS
    if e.results_dir:  # '' is refused by validate
        e.results_dir = str(paths.results_path(e.results_dir))
    return out  # type: ignore[return-value]


def load(path: str) -> Config:
    return to_config(OmegaConf.load(path))


def save(cfg: Config | DictConfig, path: str) -> None:
    tmp = path + ".tmp"
    OmegaConf.save(OmegaConf.structured(cfg) if isinstance(cfg, Config) else cfg, tmp)
    os.replace(tmp, path)


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


def effective_zero(zero: "ZeroConfig", device_type: str) -> "ZeroConfig":
    """``zero`` with its automatic knobs resolved for ranks on ``device_type`` (``cuda`` |
    ``cpu``): ``overlap_param_gather`` None -> on for CUDA, off for CPU."""
    if zero.overlap_param_gather is None:
        return dataclasses.replace(zero, overlap_param_gather=device_type == "cuda")
    return zero


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


def summary(cfg: Config) -> dict[str, Any]:
    """The resolved config as nested plain dicts (a record's ``config``, W&B)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore


def _identifies(f: dataclasses.Field) -> bool:
    return f.metadata.get(IDENTITY, True)


def _absent_value(f: dataclasses.Field) -> Any:
    if ABSENT in f.metadata:
        return f.metadata[ABSENT]
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def identity_fields() -> dict[str, list[dataclasses.Field]]:
    """{section: its identifying fields}, from the schema's field metadata."""
    return {sec.name: [f for f in dataclasses.fields(sec.default_factory) if _identifies(f)]
            for sec in dataclasses.fields(Config) if _identifies(sec)}


def identity(config: dict) -> dict[str, dict[str, Any]]:
    """The part of a resolved config (``summary``, or a record's ``config``, perhaps written
    by an older schema) that identifies a run point: every identifying field of today's
    schema, a field the config lacks at its ``ABSENT`` value; fields the schema no longer has
    are left out."""
    out = {}
    for sec, fields in identity_fields().items():
        have = config.get(sec) or {}
        out[sec] = {f.name: have[f.name] if f.name in have else _absent_value(f)
                    for f in fields}
    return out


def model_files() -> dict:
    """Every conf/model/<name>.yaml as {name: fields} (``defaults`` dropped)."""
    out = {}
    for p in sorted(conf_group_dir("model").glob("*.yaml")):
        d = OmegaConf.to_container(OmegaConf.load(p))
        d.pop("defaults", None)
        out[p.stem] = d
    return out


def model_conf(name: str) -> dict:
    """The fields of conf/model/<name>.yaml (for local points' overrides)."""
    try:
        return dict(model_files()[name])
    except KeyError:
        raise ValueError(f"no conf/model/{name}.yaml; choose one of {sorted(model_files())}") from None
