"""ZeRO-R (paper §6): P_a / P_a+cpu activation checkpoints, M_D arenas, Table 3 configs."""
from zero_repro.zero_r.activation_ckpt import (ActivationCheckpointing, CheckpointedBlock,
                                               apply_activation_checkpointing, canonical_name)
from zero_repro.zero_r.arena import CheckpointArena, fragmentation_stats
from zero_repro.zero_r.configs import TABLE3, describe, zero_r_config

__all__ = ["ActivationCheckpointing", "CheckpointedBlock", "apply_activation_checkpointing",
           "canonical_name", "CheckpointArena", "fragmentation_stats", "TABLE3", "describe",
           "zero_r_config"]
