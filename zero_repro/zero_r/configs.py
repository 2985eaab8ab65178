"""The paper's ZeRO configurations C1-C5 (Table 3, §10.4) as data.

Table 3 pairs a ZeRO-DP stage with a set of ZeRO-R components:

    C1  P_os    C_B + M_D              C3  P_os+g  C_B + M_D
    C2  P_os    C_B + M_D + P_a        C4  P_os+g  C_B + M_D + P_a
                                       C5  P_os+g  C_B + M_D + P_a+cpu

Activation checkpointing is on in all five (the paper's runs recompute every block; P_a
partitions those checkpoints). ``conf/zero_r/c1.yaml`` ... ``c5.yaml`` select the same settings
through Hydra; tests/test_zero_r.py checks that they agree with this table.
"""
from __future__ import annotations

from dataclasses import dataclass

from zero_repro.config import ZeroRConfig


@dataclass(frozen=True)
class Table3Row:
    stage: int  # ZeRO-DP stage: 1 = P_os, 2 = P_os+g
    partition_activations: bool  # P_a
    cpu_checkpointing: bool  # P_a+cpu
    constant_buffers: bool = True  # C_B
    contiguous_memory: bool = True  # M_D
    activation_checkpointing: bool = True


TABLE3: dict[str, Table3Row] = {
    "c1": Table3Row(stage=1, partition_activations=False, cpu_checkpointing=False),
    "c2": Table3Row(stage=1, partition_activations=True, cpu_checkpointing=False),
    "c3": Table3Row(stage=2, partition_activations=False, cpu_checkpointing=False),
    "c4": Table3Row(stage=2, partition_activations=True, cpu_checkpointing=False),
    "c5": Table3Row(stage=2, partition_activations=True, cpu_checkpointing=True),
}

_DP_NAMES = {0: "baseline DP", 1: "P_os", 2: "P_os+g", 3: "P_os+g+p"}


def zero_r_config(name: str) -> ZeroRConfig:
    """ZeroRConfig for Table 3's ``name`` (c1..c5) or ``off``."""
    if name == "off":
        return ZeroRConfig(name="off")
    try:
        row = TABLE3[name]
    except KeyError as e:
        raise ValueError(f"unknown ZeRO-R configuration {name!r}: use off or one of "
                         f"{sorted(TABLE3)}") from e
    return ZeroRConfig(name=name, activation_checkpointing=row.activation_checkpointing,
                       partition_activations=row.partition_activations,
                       cpu_checkpointing=row.cpu_checkpointing,
                       constant_buffers=row.constant_buffers,
                       contiguous_memory=row.contiguous_memory)


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
