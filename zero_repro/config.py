"""Typed configuration: plain dataclasses and the pure helpers on them (the runtime's configs:
no Hydra, no OmegaConf).

YAML under ``conf/`` only selects and overrides; the schema and its defaults live here. Beside
it, by concern: ``schema`` (Hydra's ConfigStore, OmegaConf conversions, YAML files),
``validation`` (``validate(cfg)`` raises ``ValueError`` with a one-line message that says what
to change; the CLI calls it before any worker process starts) and ``identity`` (which fields
identify a run point).
"""
from __future__ import annotations

import dataclasses
import math
import threading
from dataclasses import dataclass, field
from typing import Optional

from zero_repro import gpus, paths

STAGES = (0, 1, 2, 3)
DTYPES = ("fp32", "fp16", "bf16")
OFFLOAD = ("none", "cpu")  # zero.offload_optimizer, zero.offload_param
# the estimate's offload modes: name -> (zero.offload_optimizer, zero.offload_param); the
# parameters offload at stage 3 only (the other stages of a mode keep the optimizer part)
OFFLOAD_MODES = {"none": ("none", "none"), "cpu": ("cpu", "none"), "param": ("none", "cpu"),
                 "cpu+param": ("cpu", "cpu")}
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
    # ZeRO-Offload (Ren et al. 2021; DeepSpeed's offload_optimizer): "cpu" keeps the fp32
    # master and Adam moments of this rank's shard in host memory and runs AdamW there; the
    # gradients go to the host and the updated parameters come back over PCIe
    # (runtime.zero.offload). Stages 1-3, and stage 0 at DP 1
    offload_optimizer: str = "none"  # none | cpu
    # ZeRO-3 Offload (DeepSpeed's offload_param, ZeRO-Infinity's CPU tier): "cpu" keeps stage
    # 3's fp16 parameter shard in host memory; each unit's shard is copied to the device as it
    # is gathered (runtime.zero.stage3_p). Stage 3 only; with or without offload_optimizer.
    # Records made before the knob existed ran it off
    offload_param: str = field(default="none", metadata={ABSENT: "none"})  # none | cpu
    # ZeRO-Offload's delayed parameter update (Ren et al. 2021 §4.2): after offload_dpu_warmup
    # steps the host's update of step t runs while step t+1 computes on parameters one update
    # old (it changes the math on purpose; runtime.zero.offload). Needs offload_optimizer=cpu
    offload_dpu: bool = field(default=False, metadata={ABSENT: False})
    offload_dpu_warmup: int = field(default=40, metadata={ABSENT: 40})
    # hierarchical sharding (FSDP2's HSDP, ZeRO++'s hpZ, MiCS): stages 1-3 shard their states
    # over G DP ranks and keep N_d/G replicas; gradients reduce-scatter inside the shard group,
    # then the owned shard is all-reduced across replicas. "all" (every DP rank: plain ZeRO),
    # "node" (the DP ranks of one node) or G, which must divide N_d (runtime.comm.topology)
    shard_size: str = "all"
    # ZeRO++'s hpZ (Wang et al. 2023 §3.2; DeepSpeed's zero_hpz_partition_size), stage 3: the
    # states stay partitioned over all N_d DP ranks, and a secondary copy of the parameters
    # (training dtype) is kept partitioned over the shard_size G ranks of a node ("all": the
    # node's); the backward's all-gathers read it, inside the node (runtime.zero.hpz).
    # Records made before the knob existed ran it off
    hpz: bool = field(default=False, metadata={ABSENT: False})
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


# the GPU facts a cluster takes from its GPU (``zero_repro.gpus``): ClusterConfig field -> Gpu's
GPU_FIELDS = {"device_memory_gb": "memory_gb", "device_memory_mib": "memory_mib",
              "peak_tflops": "peak_tflops", "hbm_gbps": "hbm_gbps", "sm_count": "sm_count"}


@dataclass
class ClusterConfig:
    """A cluster: its nodes, links and hosts, and its GPU. ``gpu`` names a ``zero_repro.gpus``
    kind whose datasheet facts (``GPU_FIELDS``) fill the fields left at 0, the one home of a
    GPU's facts (a field set explicitly is a what-if and stays); without ``gpu`` the fields are
    the cluster's own (a custom cluster, the CPU one)."""
    name: str = "local"
    device: str = "cpu"
    backend: str = "gloo"
    gpus_per_node: int = 2  # ranks per node
    # the GPU kind (zero_repro/gpus/<key>.py); "" = none named. Its facts are identity, not it
    gpu: str = field(default="", metadata=NOT_IDENTITY)
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
    # a node's host per GPU (its CPUs, RAM and DRAM bandwidth over gpus_per_node; each yaml
    # cites its source): what ZeRO-Offload's host step and host memory are judged against
    # (scale.offload_time); 0 = unknown. They change no measurement: not identity
    host_memory_gb: float = field(default=0.0, metadata=NOT_IDENTITY)  # host RAM, GB = 1e9 B
    host_cores: float = field(default=0.0, metadata=NOT_IDENTITY)  # CPU cores
    host_memory_gbps: float = field(default=0.0, metadata=NOT_IDENTITY)  # DRAM line rate, GB/s
    # a host core's fp32 SIMD lanes retired per cycle (FMA pipes x vector width / 32) and its
    # clock, base and highest turbo (GHz): the host step's compute rate (scale.offload_time)
    host_fp32_lanes: float = field(default=0.0, metadata=NOT_IDENTITY)
    host_ghz: float = field(default=0.0, metadata=NOT_IDENTITY)
    host_turbo_ghz: float = field(default=0.0, metadata=NOT_IDENTITY)
    # words for tables (the throughput figures' hardware column): not what a point measures
    description: str = field(default="local CPU ranks on gloo", metadata=NOT_IDENTITY)

    def __post_init__(self):
        if self.gpu:
            g = gpus.gpu(self.gpu)  # ValueError naming the known GPUs
            for mine, its in GPU_FIELDS.items():
                if not getattr(self, mine):
                    setattr(self, mine, type(getattr(self, mine))(getattr(g, its)))


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
    # run even when the local ranks outnumber the GPUs or the CPU cores (x RANKS_PER_CORE) or
    # the analytic memory estimate exceeds this machine's memory (zero_repro.lab.preflight)
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
    # resume from a checkpoint another account owns or may write (loading it runs what its
    # writer chose): refused unless true
    allow_untrusted: bool = False


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
    # simulated points of an experiment that declares them independent run this many at once
    # (``lab.point_pool``); 0: the cores this process may use; 1: one after another
    workers: int = 1


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


def effective_zero(zero: "ZeroConfig", device_type: str) -> "ZeroConfig":
    """``zero`` with its automatic knobs resolved for ranks on ``device_type`` (``cuda`` |
    ``cpu``): ``overlap_param_gather`` None -> on for CUDA, off for CPU."""
    if zero.overlap_param_gather is None:
        return dataclasses.replace(zero, overlap_param_gather=device_type == "cuda")
    return zero
