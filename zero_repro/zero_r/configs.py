"""Labels for ZeRO configurations in the paper's notation (Table 3, §10.4). The table itself
(C1-C5) lives in ``zero_repro.paper.table3``; it is re-exported here for the runtime's callers.
"""
from __future__ import annotations

from zero_repro.config import ZeroRConfig
from zero_repro.paper.table3 import TABLE3, Table3Row, zero_r_config

__all__ = ["TABLE3", "Table3Row", "describe", "zero_r_config"]

_DP_NAMES = {0: "baseline DP", 1: "P_os", 2: "P_os+g", 3: "P_os+g+p"}


def describe(stage: int, zero_r: ZeroRConfig) -> str:
    """Label in the paper's notation, e.g. ``P_os+g | C_B+M_D+P_a+cpu``."""
    parts = []
    if zero_r.constant_buffers:
        parts.append("C_B")
    if zero_r.contiguous_memory:
        parts.append("M_D")
    if zero_r.partition_activations:
        parts.append("P_a+cpu" if zero_r.cpu_checkpointing else "P_a")
    if zero_r.activation_checkpointing and not zero_r.partition_activations:
        parts.append("ckpt")
    return f"{_DP_NAMES.get(stage, f'stage {stage}')} | {'+'.join(parts) or 'no ZeRO-R'}"
