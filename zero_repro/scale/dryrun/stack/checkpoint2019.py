"""The 2019 Megatron-LM activation checkpointing with P_a as the paper's harness ran it (ZeRO
paper §6.1 P_a / P_a+cpu, §6.3 M_D for activations), for the ``paper2020`` stack of the dry run.

Source (behaviour modelled, no code copied): DeepSpeedExamples@405ce794
``Megatron-LM/mpu/random.py`` (``CheckpointFunction.forward`` / ``backward``,
``get_full_inputs``) and DeepSpeed@f2ac7eafd ``deepspeed/pt/deepspeed_checkpointing.py``
(``configure()`` asserts ``PARTITION_ACTIVATIONS`` for contiguous checkpointing).

``Checkpointing2019`` is ``zero_r.activation_ckpt.ActivationCheckpointing`` (same wrappers,
same pack/unpack points) with two behaviours replaced, each one switch of
``stack.switches.Stack``:

  pa_per_layer_checkpoints      with P_a, each layer's checkpoint partition is its own tensor:
                                with contiguous checkpointing a list of ``n_layer`` tensors
                                allocated at the first forward and reused every step (no single
                                arena), otherwise a fresh tensor per forward; in backward the
                                full input is rebuilt in a zeroed b·s·h tensor from a list
                                all-gather, which PyTorch 1.x NCCL stages through one more
                                flattened b·s·h temporary (2·b·s·h·2 B transient per layer).
  contiguous_ckpt_only_with_pa  without P_a (C1, C3) there is no activation arena: the kept
                                checkpoint is the block input itself.

Both off, the class behaves exactly as its base (the tests check the traces are equal).
"""
from __future__ import annotations

import torch

from zero_repro.runtime.comm import comm
from zero_repro.scale.dryrun.stack import switches as S
from zero_repro.runtime.zero_r.activation_ckpt import ActivationCheckpointing


class Checkpointing2019(ActivationCheckpointing):
    """Activation checkpointing of the 2019 Megatron harness (``stack`` says which parts)."""

    def __init__(self, model, topo, zero_r, stack: S.Stack):
        super().__init__(model, topo, zero_r)
        self.stack = stack
        self.per_layer: dict[int, torch.Tensor] = {}  # block -> its persistent partition
        self.per_layer_mode = bool(stack.pa_per_layer_checkpoints and self.partition)
        if stack.contiguous_ckpt_only_with_pa and not self.partition:
            self.contiguous, self.arena = False, None  # no M_D arena without P_a
        if self.per_layer_mode:
            self.arena = None  # a list of per-layer tensors instead of one buffer

    def _home_tensor(self, index: int, slot: int, dtype: torch.dtype,
                     home: torch.device) -> torch.Tensor:
        if not self.per_layer_mode:
            return super()._home_tensor(index, slot, dtype, home)
        if not self.contiguous:  # a fresh partition tensor per forward, freed in backward
            return torch.empty(slot, dtype=dtype, device=home)
        buf = self.per_layer.get(index)
        if buf is None or buf.numel() != slot or buf.dtype != dtype:
            buf = self.per_layer[index] = torch.empty(slot, dtype=dtype, device=home)
        return buf

    def _gather_full(self, local: torch.Tensor) -> torch.Tensor:
        if not self.per_layer_mode:
            return super()._gather_full(local)
        n = local.numel() * self.m
        full = torch.zeros(n, dtype=local.dtype, device=local.device)  # get_full_inputs
        staged = torch.empty(n, dtype=local.dtype, device=local.device)  # NCCL list flatten
        comm.all_gather_into(staged, local, self.tp_group)
        full.copy_(staged)
        del staged
        return full

    def memory(self) -> dict[str, int]:
        out = super().memory()
        if out and self.per_layer:
            out["arena_capacity"] = sum(t.numel() * t.element_size()
                                        for t in self.per_layer.values())
        return out


def make_ckpt(stack: S.Stack):
    """``train.build.build``'s ``make_ckpt`` for ``stack``."""
    def _make(model, topo, zero_r):
        return Checkpointing2019(model, topo, zero_r, stack)
    return _make
