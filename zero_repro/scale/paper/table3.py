"""Table 3 (paper §10.4): the ZeRO configurations C1-C5, plus the Megatron-LM baseline the
throughput figures compare against, stated once.

    C1  P_os    C_B + M_D              C3  P_os+g  C_B + M_D
    C2  P_os    C_B + M_D + P_a        C4  P_os+g  C_B + M_D + P_a
                                       C5  P_os+g  C_B + M_D + P_a+cpu

Activation checkpointing is on in all five (the paper's runs recompute every block; P_a
partitions those checkpoints); the baseline is stage 0 with Megatron-LM's checkpointing and no
ZeRO-R component. Exported from this one table: ``zero_r_config(name)`` (the runtime's
ZeroRConfig), ``zero_overrides(name)`` (Hydra overrides ``zero.stage`` + ``zero_r.*``),
``describe(stage, zero_r)`` (a label in the paper's notation) and the rows, which
``zero_repro.scale.analytic.MemConfig.from_table3`` turns into the memory model's flags.
``conf/zero_r/c1.yaml`` ... ``c5.yaml`` select the same settings through Hydra;
tests/unit/test_zero_r.py checks that they equal this table.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from zero_repro.config import ZeroRConfig
from zero_repro.scale.paper.table1 import STAGE_NOTATION


@dataclass(frozen=True)
class Table3Row:
    stage: int  # ZeRO-DP stage: 0 = baseline DP, 1 = P_os, 2 = P_os+g
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
# Megatron-LM / PyTorch DDP baseline of Figures 2-4: stage 0, checkpointing as Megatron-LM did
BASELINE = Table3Row(stage=0, partition_activations=False, cpu_checkpointing=False,
                     constant_buffers=False, contiguous_memory=False)


def row(name: str) -> Table3Row:
    """The row of ``name``: c1..c5 (any case) or ``baseline``."""
    key = name.lower()
    if key == "baseline":
        return BASELINE
    try:
        return TABLE3[key]
    except KeyError as e:
        raise ValueError(f"unknown ZeRO configuration {name!r}: use baseline or one of "
                         f"{sorted(TABLE3)}") from e


def zero_r_config(name: str) -> ZeroRConfig:
    """ZeroRConfig for Table 3's ``name`` (c1..c5), ``baseline`` (name ``custom``) or ``off``."""
    if name == "off":
        return ZeroRConfig(name="off")
    if name.lower() != "baseline" and name not in TABLE3:
        raise ValueError(f"unknown ZeRO-R configuration {name!r}: use off or one of "
                         f"{sorted(TABLE3)}")
    r = row(name)
    return ZeroRConfig(name="custom" if r is BASELINE else name.lower(),
                       activation_checkpointing=r.activation_checkpointing,
                       partition_activations=r.partition_activations,
                       cpu_checkpointing=r.cpu_checkpointing,
                       constant_buffers=r.constant_buffers,
                       contiguous_memory=r.contiguous_memory)


def zero_overrides(name: str) -> dict:
    """``zero.stage`` + every ``zero_r.*`` field for c1..c5 / C1..C5 or ``baseline``."""
    zr = dataclasses.asdict(zero_r_config(name if name.lower() == "baseline" else name.lower()))
    return {"zero.stage": row(name).stage, **{f"zero_r.{k}": v for k, v in zr.items()}}


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
    return f"{STAGE_NOTATION.get(stage, f'stage {stage}')} | {'+'.join(parts) or 'no ZeRO-R'}"
