"""What the peers race runs: the frameworks it knows (each with the ZeRO stage it is the peer of
and its family), the optimizer modes, and ``PeerSpec``, everything one race needs (picklable:
it travels to the spawned ranks). Shared by the runners (``frameworks``, ``runners``) and the
report, so neither imports the other for it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from zero_repro.config import ModelConfig, TrainConfig, ZeroConfig, ZeroRConfig

# framework -> (ZeRO stage it is the peer of, family)
FRAMEWORKS: dict[str, tuple[int, str]] = {
    "torch_ddp": (0, "torch"),
    # DDP with its buckets all-reduced through this project's shared-memory transport (a comm
    # hook): DDP on zero_repro_s0's transport. Not a peer of its own (family "hybrid": never
    # the "best peer"), the transport's contribution shown on DDP itself
    "torch_ddp_shm": (0, "hybrid"),
    "torch_zero_redundancy": (1, "torch"),
    "fsdp2_no_reshard": (2, "torch"),
    "fsdp2_reshard": (3, "torch"),
    "deepspeed_z1": (1, "deepspeed"),
    "deepspeed_z2": (2, "deepspeed"),
    "deepspeed_z3": (3, "deepspeed"),
    "zero_repro_s0": (0, "zero_repro"),
    "zero_repro_s1": (1, "zero_repro"),
    "zero_repro_s2": (2, "zero_repro"),
    "zero_repro_s3": (3, "zero_repro"),
    # the same stages with their DP buckets on gloo's sockets (point-to-point), as the peers'
    # are, instead of shared memory (runtime.comm.cpu.shm): what the transport alone gives
    "zero_repro_s0_p2p": (0, "zero_repro"),
    "zero_repro_s1_p2p": (1, "zero_repro"),
    "zero_repro_s2_p2p": (2, "zero_repro"),
    "zero_repro_s3_p2p": (3, "zero_repro"),
    "lower_bound": (-1, "bound"),  # compute only: not a framework, the floor of every stage
    # hierarchical sharding (``PeerSpec.hsdp_shard_size`` G): FSDP2's HSDP (fully_shard on a
    # (replicate, shard) mesh) and this project's stage 3 with zero.shard_size=G; race them
    # with each other, not with the plain stage 3 entries (another configuration)
    "fsdp2_hsdp": (3, "torch"),
    "zero_repro_s3_hsdp": (3, "zero_repro"),
    # ZeRO++'s hpZ (its secondary over ``hsdp_shard_size`` ranks): DeepSpeed's
    # zero_hpz_partition_size and this project's zero.hpz
    "deepspeed_z3_hpz": (3, "deepspeed"),
    "zero_repro_s3_hpz": (3, "zero_repro"),
}
TORCH_PEERS = ("torch_ddp", "torch_zero_redundancy", "fsdp2_no_reshard", "fsdp2_reshard")
HSDP = ("fsdp2_hsdp", "zero_repro_s3_hsdp")
HPZ = ("deepspeed_z3_hpz", "zero_repro_s3_hpz")
DEEPSPEED_PEERS = ("deepspeed_z1", "deepspeed_z2", "deepspeed_z3")
OURS = ("zero_repro_s0", "zero_repro_s1", "zero_repro_s2", "zero_repro_s3",
        "zero_repro_s0_p2p", "zero_repro_s1_p2p", "zero_repro_s2_p2p", "zero_repro_s3_p2p")
LOWER_BOUND = "lower_bound"
# frameworks that replace a torch function for the whole process (measured: DeepSpeed 0.19.8's
# ZeRO-3 engine sets torch.nn.functional.linear to its own autograd function; stages 1-2 leave
# torch's functions alone). Every framework sharing the process would run through it, so they
# run in a process set of their own (``process_sets``).
PATCHES_TORCH: dict[str, str] = {"deepspeed_z3": "torch.nn.functional.linear",
                                 "deepspeed_z3_hpz": "torch.nn.functional.linear"}
OPTIMIZERS = ("fused", "as_shipped")


@dataclass
class PeerSpec:
    """Everything a run needs (picklable: travels to spawned ranks)."""

    model: ModelConfig
    train: TrainConfig  # lr, betas, eps, weight_decay, micro_batch_size, steps, warmup, seed
    zero: ZeroConfig  # bucket sizes for the project's stages and DeepSpeed; dtype must be fp32
    frameworks: tuple = ()
    digest_every: int = 1  # compare with the reference every k steps (and at the last step)
    comm_step: int = -1  # step counted by CommCounter (untimed); -1: the last warm-up step
    param_tol_rel_lr: float = 0.05  # |Δθ| floor at step s: param_tol_rel_lr · lr · (s + 1)
    # "fused": every peer's AdamW is torch.optim.AdamW(fused=True), the kernel this project's
    # ShardAdamW runs (like with like); "as_shipped": the peers' defaults (on CPU torch's
    # AdamW then takes its single-tensor path). The project's stages run fused in both.
    optimizer: str = "fused"
    reference: bool = True  # train the single-process reference and compare (equivalence)
    hsdp_shard_size: int = 2  # G of the HSDP entries (``HSDP``): must divide the world size
    # fp32 rounding of a gradient, relative to the largest gradient of its tensor, that the
    # conditioning budget assumes (report.py: principled parameter tolerance)
    grad_rounding_rel: float = 1e-5
    # the project's ZeRO-R knobs (C_B with the zero section's bucket sizes, as DeepSpeed is
    # given them; M_D): the memory regime zero_repro races in
    zero_r: ZeroRConfig = field(default_factory=lambda: ZeroRConfig(
        name="custom", constant_buffers=True, contiguous_memory=True))

    def __post_init__(self) -> None:
        unknown = [f for f in self.frameworks if f not in FRAMEWORKS]
        if unknown:
            raise ValueError(f"unknown peer frameworks {unknown}: choose from {list(FRAMEWORKS)}")
        if self.zero.dtype != "fp32":
            raise ValueError("peer comparisons run in fp32: set zero.dtype=fp32")
        if self.train.grad_accum != 1:
            raise ValueError("peer comparisons use train.grad_accum=1")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={self.optimizer!r}: choose from {list(OPTIMIZERS)}")
