"""ZeRO-R (paper §6): P_a / P_a+cpu activation checkpoints, C_B constant buffers, M_D arenas.
Table 3's C1-C5 live in ``zero_repro.scale.paper.table3``."""
from zero_repro.runtime.zero_r.activation_ckpt import (ActivationCheckpointing, CheckpointedBlock,
                                                       apply_activation_checkpointing,
                                                       canonical_name)
from zero_repro.runtime.zero_r.arena import CheckpointArena, fragmentation_stats

__all__ = ["ActivationCheckpointing", "CheckpointedBlock", "apply_activation_checkpointing",
           "canonical_name", "CheckpointArena", "fragmentation_stats"]
