"""The software stack an estimate assumes (``scale.estimate``'s first line), and what the 2020
stack changes in its memory (paper §10's runs: DeepSpeed 0.2-0.3, Megatron-LM 2019-20, PyTorch
1.x, NCCL 2.4, cuBLAS 10, no fused attention / LayerNorm / Adam).

  * ``modern``: this runtime on today's PyTorch (flash attention, bf16, the modern time model
    ``scale.modern_step``, the modern stack's bytes outside the allocator);
  * ``2020`` (the estimate's ``--time-model paper2020``): time by the paper's Fig 2-calibrated
    V100 model (``scale.perf_model``), memory by the dry run with the 2019 Megatron layer's
    activation extras (``MEGATRON_2019``, each a switch of ``dryrun.stack.switches`` with its
    source): fp16 attention scores and probabilities materialized (b·a/t·s² each), the
    dropout masks and outputs (p = 0.1, 1-byte masks), the tanh GELU's intermediates and the
    fp32 logits with the cross-entropy's fp32 copies, with or without ZeRO-Offload (a layer
    switch changes activations only). The GPT family only (Megatron 2019 had no other);
    stage 3 keeps this runtime's layer (DeepSpeed 0.2-0.3 had no stage 3, and the
    2019 layer reads its tied head whole, which stage 3's row-sliced table does not allow).
"""
from __future__ import annotations

import dataclasses

from zero_repro import config as C
from zero_repro.validation import MEGATRON_2019_LAYER

# DeepSpeed 0.2's stage 1-2 ran with overlap_comm=False (its default; the paper harness's rows:
# ``dryrun.stack.deepspeed02``), 2019 Megatron's DDP all-reduced after backward
# (``scale.perf_model``): the 2020 stack's time model hides no DP collective behind compute
OVERLAP_COMM_2020 = False
MEGATRON_2019 = MEGATRON_2019_LAYER  # stages 0-2, with or without ZeRO-Offload
STACKS = {
    "modern": "modern (this runtime on today's PyTorch: fused / flash attention, no dropout; "
              "the kernel time model)",
    "2020": "2020 (DeepSpeed 0.2-0.3, Megatron-LM 2019 layer, PyTorch 1.x, NCCL 2.4, "
            "cuBLAS 10; memory with the 2019 layer's activation extras, time by the paper's "
            "Fig 2-calibrated V100 model)",
}


def stack_of(time_model: str) -> str:
    """The stack an estimate with this time model assumes (``STACKS`` key)."""
    return "2020" if time_model == "paper2020" else "modern"


def megatron_extras(cfg: C.Config, stack: str) -> bool:
    """Whether the 2019 Megatron layer's extras apply to ``cfg`` (module doc)."""
    return stack == "2020" and cfg.model.family == "gpt" and cfg.zero.stage != 3


def with_stack(cfg: C.Config, stack: str) -> C.Config:
    """``cfg`` whose dry run runs the stack's layer (module doc)."""
    if not megatron_extras(cfg, stack):
        return cfg
    return dataclasses.replace(cfg, simulate=dataclasses.replace(
        cfg.simulate, only_switches=list(MEGATRON_2019)))


def describe(stack: str, model_family: str = "gpt") -> str:
    """The first line of an estimate: the stack it assumes."""
    out = f"Stack assumed: {STACKS[stack]}"
    if stack == "2020" and model_family != "gpt":
        out += f"; a {model_family} model: this runtime's layer (no 2019 extras)"
    return out
