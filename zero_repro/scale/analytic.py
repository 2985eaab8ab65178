"""Closed-form per-rank memory model of ZeRO (paper §3, §5, §6; Tables 1-2, the Figure 6 seed).

Model states per DP rank: Table 1's formula (``zero_repro.scale.paper.table1``; Ψ = parameters
of one TP shard, K = 12): baseline 16Ψ, P_os 4Ψ + KΨ/N_d, P_os+g 2Ψ + 14Ψ/N_d, P_os+g+p 16Ψ/N_d.
Residual states (§3.2, §6): activations without checkpointing (the paper's footnote ≈12·h·b·s·l
elements, fp16: GPT-2 1.5B, s = 1K, b = 32 -> 60 GB, ``activation_elements_footnote``;
``activation_bytes_per_layer`` counts one Megatron block per op on one TP rank); checkpoints
b·s·h elements per layer (P_a: 1/tp of them; P_a+cpu: none on the device); working memory of one
block's recompute and backward plus the LM-head logits; fused buffers by the runtime's formula
(``zero_repro.runtime.zero.comm_buffer_bytes``: with C_B two gradient buckets of R elements at
stages 2-3 plus the transport's scratch; without it one fused buffer of the model, the paper's
32-bit one: 1.5B -> 6 GB). Bytes everywhere, ``GB`` = 1e9 bytes as in the paper's tables. The
paper's §6.1 example (100B, b = 32, s = 1024, MP 16, "≈33 GB -> ≈2 GB") matches the *element*
count b·s·h·l = 33.5e9 of Table 5's 100B shape (125 x 8192); in fp16 bytes that is 67 GB (§3.2's
"≈60 GB"): we compute bytes, the tests document the gap.
Hierarchical sharding (``shard_size`` G): the states partition over G instead of N_d (Table 1
with G). Communication per rank and step split by link (inside a node, between nodes; §7's ring
counts): ``comm_ledger`` (``scale.hsdp``: plain ZeRO stages 0-3, G, hpZ).
Entry points: ``table1``, ``max_params``, ``memory_breakdown``, ``fits``, ``max_model_size``,
``comm_ledger``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal
from typing import Callable

from zero_repro.runtime.model.flops import param_count_formula
from zero_repro.runtime.zero import UNBOUNDED, comm_buffer_bytes
from zero_repro.runtime.zero.partition import row_grid
from zero_repro.scale.hsdp import comm_ledger  # noqa: F401 (an entry point of this module)
from zero_repro.scale.paper.table1 import (
    K_ADAM,
    STAGE_NAMES,
    TABLE1_ND,
    TABLE1_PSI,
    model_state_bytes,
)
from zero_repro.scale.paper.table3 import BASELINE, TABLE3, Table3Row

GB = 1e9


# ----------------------------------------------------------------------------- model states


def model_state_breakdown(psi: float, stage: int, n_d: int, lp_bytes: int = 2,
                          shard_size: int | None = None) -> dict[str, float]:
    """The same total split into fp16 params / fp16 grads / fp32 master / Adam m / Adam v;
    ``shard_size`` G: partitioned over G ranks (Table 1 with G)."""
    n_d = shard_size or n_d
    p_div = n_d if stage >= 3 else 1
    g_div = n_d if stage >= 2 else 1
    o_div = n_d if stage >= 1 else 1
    return {"lp_params": lp_bytes * psi / p_div, "lp_grads": lp_bytes * psi / g_div,
            "fp32_params": 4 * psi / o_div, "adam_m": 4 * psi / o_div,
            "adam_v": 4 * psi / o_div}


def paper_display(gb: float, truncate: bool = False) -> float:
    """Table 1's displayed precision: >= 100 as integers, else 3 significant figures (<= 2 decimals).

    The paper truncates (instead of rounding) a few integer cells; ``truncate=True`` mimics it.
    """
    if gb >= 100:
        return float(math.floor(gb)) if truncate else float(
            Decimal(repr(gb)).quantize(Decimal(1), rounding=ROUND_HALF_UP))
    exp = math.floor(math.log10(abs(gb))) if gb else 0
    q = Decimal(1).scaleb(max(exp - 2, -2))  # 3 significant figures, at most 2 decimals
    return float(Decimal(repr(gb)).quantize(q, rounding=ROUND_HALF_UP))


@dataclass(frozen=True)
class Table1Cell:
    model: str  # "7.5B" | "128B" | "1T"
    scheme: str  # "Pos" | "Pos+g" | "Pos+g+p"
    n_d: int
    gb: float  # exact, GB = 1e9 bytes
    display: float  # correctly rounded to the paper's precision
    paper_display: float  # what the paper prints (truncated where it truncates)
    truncated_by_paper: bool


def table1() -> list[Table1Cell]:
    """All 54 cells of Table 1 (3 model sizes x 3 schemes x 6 N_d), K = 12, fp16."""
    cells = []
    for model, psi in TABLE1_PSI.items():
        for stage in (1, 2, 3):
            for n_d in TABLE1_ND:
                gb = model_state_bytes(psi, stage, n_d) / GB
                rnd, trunc = paper_display(gb), paper_display(gb, truncate=True)
                cells.append(Table1Cell(model, STAGE_NAMES[stage], n_d, gb, rnd, trunc,
                                        rnd != trunc))
    return cells


def max_params(device_bytes: float, stage: int, n_d: int, tp: int = 1, K: int = K_ADAM
               ) -> float:
    """Table 2 theory: largest total Ψ whose model states fit (activations ignored)."""
    return device_bytes / model_state_bytes(1.0, stage, n_d, K) * tp


# ------------------------------------------------------------------------------ activations
def activation_elements_footnote(hidden: int, batch: int, seq: int, n_layer: int) -> float:
    """The paper's footnote 3: ≈ 12·h·b·s·l activation *elements* (fp16 -> x2 bytes)."""
    return 12.0 * hidden * batch * seq * n_layer


def activation_bytes_per_layer(batch: int, seq: int, hidden: int, heads: int, tp: int = 1,
                               dropout: bool = True, lp_bytes: int = 2) -> float:
    """Bytes one Megatron block keeps for backward on one TP rank (no checkpointing).

    Op enumeration (elements; masks are 1 byte): replicated across TP: LN1 in, QKV in (=LN1 out),
    LN2 in, fc1 in (=LN2 out) -> 4·bsh, plus 2 dropout masks bsh; split over TP: Q, K, V,
    proj in -> 4·bsh/tp, GELU in and fc2 in -> 8·bsh/tp; attention: softmax out a·b·s²/tp (+
    its dropout mask and output). With fp16 and dropout: bsh·(10 + 24/tp) + 5·a·b·s²/tp bytes.
    """
    b, s, h, a = batch, seq, hidden, heads
    bsh = b * s * h
    rep = 4 * bsh * lp_bytes + (2 * bsh if dropout else 0)
    split = 12 * bsh / tp * lp_bytes
    scores = a * b * s * s / tp
    attn = scores * lp_bytes + (scores * (1 + lp_bytes) if dropout else 0)
    return rep + split + attn


def checkpoint_bytes(batch: int, seq: int, hidden: int, n_layer: int, tp: int = 1,
                     p_a: bool = False, cpu: bool = False, lp_bytes: int = 2) -> float:
    """Device bytes of activation checkpoints (one block input b·s·h per layer).

    P_a: each TP rank keeps 1/tp of every checkpoint; P_a+cpu: all of them live in host memory.
    """
    if cpu:
        return 0.0
    full = float(batch) * seq * hidden * n_layer * lp_bytes
    return full / tp if p_a else full


def logits_bytes(batch: int, seq: int, vocab: int, tp: int = 1, lp_bytes: int = 2) -> float:
    """LM-head logits (vocab-parallel: V/tp per rank) in lp + their fp32 copy for the loss."""
    return float(batch) * seq * vocab / tp * (lp_bytes + 4)


def buffer_bytes(psi: float, constant_buffers: bool, reduce_bucket: int = 2_000_000,
                 allgather_bucket: int = 2_000_000, lp_bytes: int = 2, stage: int = 2,
                 n_d: int = 1, groups: list[int | tuple[int, int]] | None = None,
                 transport: str = "native") -> float:
    """Per-rank communication buffers of ``stage``: the runtime's formula (the stage table of
    ``runtime.zero``, ``comm_buffer_bytes``) for ``groups`` (default: one flat group of Ψ;
    stage 3: its units), ``lp_bytes`` per fused-buffer element, ``transport`` the DP one (the
    paper's GPUs: ``native``). C_B: constant in Ψ; without it stage 3 holds one of its largest
    unit, and stage 2's one buffer of Ψ is its gradient store (``memory_breakdown``'s
    ``lp_grads``: the paper's 32-bit fused buffer, 6 GB for 1.5B), reduced in place."""
    return float(comm_buffer_bytes(stage, groups or [int(psi)], n_d, lp_bytes,
                                   (reduce_bucket, allgather_bucket) if constant_buffers
                                   else None, transport))


# ------------------------------------------------------------------------ configurations
@dataclass(frozen=True)
class MemConfig:
    """One ZeRO configuration: DP stage + ZeRO-R switches (paper Table 3 for C1..C5)."""
    stage: int = 2
    checkpointing: bool = True
    p_a: bool = False
    cpu: bool = False
    c_b: bool = True
    m_d: bool = True  # contiguous arenas: no fragmentation term in this closed form either way

    @classmethod
    def from_table3(cls, row: Table3Row) -> "MemConfig":
        return cls(stage=row.stage, checkpointing=row.activation_checkpointing,
                   p_a=row.partition_activations, cpu=row.cpu_checkpointing,
                   c_b=row.constant_buffers, m_d=row.contiguous_memory)


# Table 3 (``paper.table3``) as the memory model's flags, keyed C1..C5 and baseline
ZERO_CONFIGS = {**{name.upper(): MemConfig.from_table3(r) for name, r in TABLE3.items()},
                "baseline": MemConfig.from_table3(BASELINE)}


def as_mem_config(config: str | MemConfig | tuple) -> MemConfig:
    """'C1'..'C5' / 'baseline', a MemConfig, or a (stage, P_a, cpu, C_B, M_D) tuple."""
    if isinstance(config, MemConfig):
        return config
    if isinstance(config, str):
        if config not in ZERO_CONFIGS:
            raise ValueError(f"config={config!r}: use one of {sorted(ZERO_CONFIGS)}")
        return ZERO_CONFIGS[config]
    stage, p_a, cpu, c_b, m_d = config
    return MemConfig(stage=stage, p_a=p_a, cpu=cpu, c_b=c_b, m_d=m_d)


def memory_breakdown(n_layer: int, hidden: int, heads: int, tp: int, n_d: int,
                     batch_per_gpu: int, config: str | MemConfig | tuple = "C4",
                     seq: int = 1024, vocab: int = 50257, reduce_bucket: int = 2_000_000,
                     allgather_bucket: int = 2_000_000, dropout: bool = True,
                     buffer_lp_bytes: int = 2, transport: str = "native",
                     shard_size: int | None = None) -> dict[str, float]:
    """Per-GPU bytes by category for one training step at its peak (closed form); the buffers
    in ``buffer_lp_bytes`` per element over the DP ``transport`` (``buffer_bytes``); the model
    states and buffers over ``shard_size`` G ranks (default N_d): plain ZeRO over G ranks (the
    replicas' all-reduce runs in place on the owned chunks)."""
    c = as_mem_config(config)
    if shard_size and c.stage:
        n_d = shard_size
    psi = param_count_formula(n_layer, hidden, vocab, seq) / tp
    out = model_state_breakdown(psi, c.stage, n_d)
    if c.stage == 2 and not c.c_b:  # one fused buffer of Ψ, the shard in it (the runtime's)
        out["lp_grads"] = buffer_lp_bytes * psi
    layer = activation_bytes_per_layer(batch_per_gpu, seq, hidden, heads, tp, dropout)
    if c.checkpointing:
        out["activation_checkpoints"] = checkpoint_bytes(batch_per_gpu, seq, hidden, n_layer,
                                                         tp, c.p_a, c.cpu)
        # recompute of one block: its activations, plus the all-gathered input under P_a
        gathered = batch_per_gpu * seq * hidden * 2.0 if c.p_a else 0.0
        out["activation_working"] = layer + gathered
    else:
        out["activation_checkpoints"] = 0.0
        out["activation_working"] = layer * n_layer
    out["logits"] = logits_bytes(batch_per_gpu, seq, vocab, tp)
    groups = None
    if c.stage == 3:  # its flat groups: the root, then one unit per block
        root = param_count_formula(0, hidden, vocab, seq) / tp
        block = int(param_count_formula(1, hidden, vocab, seq) / tp - root)
        groups = [int(root)] + [block] * n_layer
        table = vocab * hidden // tp
        if table > block:  # the runtime's zero.slice_vocab_gather: a unit of row slices
            r, a = (reduce_bucket, allgather_bucket) if c.c_b else (UNBOUNDED, UNBOUNDED)
            groups[:1] = [(table, row_grid(hidden, n_d, r, a, block)), int(root) - table]
    out["buffers"] = buffer_bytes(psi, c.c_b, reduce_bucket, allgather_bucket, buffer_lp_bytes,
                                  c.stage, n_d, groups, transport)
    return out


def fits(device_bytes: float, *args, usable_fraction: float = 1.0, **kwargs) -> bool:
    """True when ``sum(memory_breakdown(*args, **kwargs))`` <= usable_fraction·device_bytes."""
    return sum(memory_breakdown(*args, **kwargs).values()) <= usable_fraction * device_bytes


def max_model_size(device_bytes: float, config: str | MemConfig | tuple, tp: int, n_d: int,
                   batch_per_gpu: int, hidden: int, heads: int, seq: int = 1024,
                   vocab: int = 50257, fits_fn: Callable[[int], bool] | None = None,
                   max_layers: int = 100_000, **kwargs) -> tuple[int, int]:
    """Largest n_layer (and its parameter count) at fixed hidden that fits, by bisection.

    The analytic model gives the seed (memory is affine in n_layer, so the analytic answer is
    solved directly); ``fits_fn(n_layer) -> bool`` (e.g. a fake-tensor dry run) is then the
    judge: the bracket is grown from the seed by doubling and closed by bisection, assuming
    monotonicity. Returns (0, 0) if not even one layer fits.
    """
    def analytic(n: int) -> bool:
        return fits(device_bytes, n, hidden, heads, tp, n_d, batch_per_gpu, config, seq=seq,
                    vocab=vocab, **kwargs)

    judge = fits_fn or analytic
    m0 = sum(memory_breakdown(0, hidden, heads, tp, n_d, batch_per_gpu, config, seq, vocab,
                              **kwargs).values())
    m1 = sum(memory_breakdown(1, hidden, heads, tp, n_d, batch_per_gpu, config, seq, vocab,
                              **kwargs).values())
    seed = int((device_bytes - m0) // max(m1 - m0, 1.0))
    seed = min(max(seed, 1), max_layers)
    lo, hi = 0, None  # invariant: judge(lo) (lo=0 trivially), not judge(hi)
    if judge(seed):
        lo, step = seed, max(1, seed // 8)
        while hi is None:
            cand = min(lo + step, max_layers)
            if cand == lo:
                return lo, param_count_formula(lo, hidden, vocab, seq)
            if judge(cand):
                lo, step = cand, step * 2
            else:
                hi = cand
    else:
        hi = seed
        cand = seed // 2
        while cand >= 1 and not judge(cand):
            hi, cand = cand, cand // 2
        lo = max(cand, 0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if judge(mid):
            lo = mid
        else:
            hi = mid
    return lo, (param_count_formula(lo, hidden, vocab, seq) if lo else 0)
