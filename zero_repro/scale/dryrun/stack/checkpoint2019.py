"""The 2019 Megatron-LM activation checkpointing with P_a as the paper's harness ran it (ZeRO
paper §6.1 P_a / P_a+cpu, §6.3 M_D for activations), for the ``paper2020`` stack of the dry run.

Source (behaviour modelled, no code copied): DeepSpeedExamples@405ce794
``Megatron-LM/mpu/random.py`` (``CheckpointFunction.forward`` L304-434 / ``backward`` L436-509,
``get_full_inputs`` L267-294) and DeepSpeed@f2ac7eafd ``deepspeed/pt/deepspeed_checkpointing.py``
(``configure()`` asserts ``PARTITION_ACTIVATIONS`` for contiguous checkpointing).

``Checkpointing2019`` is ``zero_r.activation_ckpt.ActivationCheckpointing`` (same wrappers,
same pack/unpack points) with these behaviours replaced, each one switch of
``stack.switches.Stack``:

  pa_per_layer_checkpoints      with P_a, each layer's checkpoint partition is its own tensor:
                                with contiguous checkpointing a list of ``n_layer`` tensors
                                allocated together at a step's first checkpointed forward
                                (L356-366) and dropped at its first backward (L449-461: each
                                partition then lives until its layer's backward), otherwise a
                                fresh tensor per forward; in backward the full input is rebuilt
                                in a zeroed b·s·h tensor from a list all-gather (L278-287),
                                which PyTorch 1.x NCCL stages through one more flattened b·s·h
                                temporary (2·b·s·h·2 B transient per layer); the partition is
                                freed once gathered (``item.data = input_tensor.data``, L289).
  contiguous_ckpt_only_with_pa  without P_a (C1, C3) there is no activation arena: the kept
                                checkpoint is the block input itself.
  reentrant_checkpointing       a layer's backward recomputes it under ``enable_grad`` and runs
                                an inner ``torch.autograd.backward(outputs, args)`` (L492-502):
                                the recomputed output and the incoming gradient stay alive
                                through the whole layer backward; its input gradient is
                                returned at the end (L509).

Synchronisation (``streams``, switch ``collective_stream_reuse``): the harness ran with
``--synchronize-each-layer``, a ``torch.cuda.synchronize()`` at the start and end of every
layer's forward and backward (L308, L432, L443, L507). With every switch off the class behaves
exactly as its base (the tests check the traces are equal).
"""
from __future__ import annotations

import torch

from zero_repro.runtime.comm import comm
from zero_repro.runtime.zero_r.activation_ckpt import ActivationCheckpointing, _identity
from zero_repro.scale.dryrun.stack import streams
from zero_repro.scale.dryrun.stack import switches as S


class _Reentrant(torch.autograd.Function):
    """mpu/random.py's CheckpointFunction (L297-509) on one block: the input kept as
    ``handle._pack`` keeps it, the block run without grad; in backward the input unpacked
    (gathered with P_a), the block recomputed, an inner backward run."""

    @staticmethod
    def forward(ctx, handle, index, block, x):
        streams.sync("checkpointed layer forward start")  # L308
        ctx.handle, ctx.index, ctx.block = handle, index, block
        ctx.stored = handle._pack(index, _identity(x), x)
        with torch.no_grad():
            out = block(x)
        streams.sync("checkpointed layer forward end")  # L432
        return out

    @staticmethod
    def backward(ctx, grad):
        streams.sync("checkpointed layer backward start")  # L443
        ctx.handle._backward_begins()
        stored, ctx.stored = ctx.stored, None
        full = ctx.handle._unpack(stored)  # get_full_inputs (L472)
        del stored  # the partition freed once gathered (L289)
        x = full.detach().requires_grad_(True)  # detach_variable (L473)
        del full
        with torch.enable_grad():
            out = ctx.block(x)  # L492-493
        torch.autograd.backward(out, grad)  # L502: out and grad alive throughout
        del out
        streams.sync("checkpointed layer backward end")  # L507
        return None, None, None, x.grad


class _SyncInBackward(torch.autograd.Function):
    """Identity whose backward marks a synchronisation point (the non-reentrant path's layer
    boundaries in backward)."""

    @staticmethod
    def forward(ctx, where, x):
        ctx.where = where
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        streams.sync(ctx.where)
        return None, grad


class Checkpointing2019(ActivationCheckpointing):
    """Activation checkpointing of the 2019 Megatron harness (``stack`` says which parts)."""

    def __init__(self, model, topo, zero_r, stack: S.Stack):
        super().__init__(model, topo, zero_r)
        self.stack = stack
        self.per_layer_mode = bool(stack.pa_per_layer_checkpoints and self.partition)
        if stack.contiguous_ckpt_only_with_pa and not self.partition:
            self.contiguous, self.arena = False, None  # no M_D arena without P_a
        if self.per_layer_mode:
            self.arena = None  # a list of per-layer tensors instead of one buffer
        self.n_layers = len(self.inner_blocks)
        self._cc_list: list[torch.Tensor] | None = None  # L356-366: this step's partitions
        self._cc_next = 0
        self._cc_bytes = 0  # capacity of the last list (the ledger's arena_capacity)

    def run_block(self, index, block, x, *args, **kwargs):
        if not self.stack.reentrant_checkpointing:
            if self.stack.collective_stream_reuse == streams.AFTER_SYNC:
                streams.sync("checkpointed layer forward start")
                x = _SyncInBackward.apply("checkpointed layer backward end", x)
                out = super().run_block(index, block, x, *args, **kwargs)
                streams.sync("checkpointed layer forward end")
                return _SyncInBackward.apply("checkpointed layer backward start", out)
            return super().run_block(index, block, x, *args, **kwargs)
        if args or kwargs:
            raise ValueError("the 2019 checkpointing wraps blocks of one input")
        if self.tracker.n_live == 0:
            self.begin_step()
        return _Reentrant.apply(self, index, block, x)

    def _backward_begins(self) -> None:
        """L449-461: the first backward drops the step's list of partitions (each one then
        lives only as long as its layer's saved input)."""
        self._cc_list = None

    def _home_tensor(self, index: int, slot: int, dtype: torch.dtype,
                     home: torch.device) -> torch.Tensor:
        if not self.per_layer_mode:
            return super()._home_tensor(index, slot, dtype, home)
        if not self.contiguous:  # a fresh partition tensor per forward, freed in backward
            return torch.empty(slot, dtype=dtype, device=home)
        lst = self._cc_list
        if (lst is None or self._cc_next >= len(lst) or lst[0].numel() != slot
                or lst[0].dtype != dtype):
            lst = self._cc_list = [torch.empty(slot, dtype=dtype, device=home)
                                   for _ in range(self.n_layers)]  # L357: all at once
            self._cc_next = 0
            self._cc_bytes = sum(t.numel() * t.element_size() for t in lst)
        buf = lst[self._cc_next]
        self._cc_next += 1
        return buf

    def _gather_full(self, local: torch.Tensor) -> torch.Tensor:
        if not self.per_layer_mode:
            return super()._gather_full(local)
        n = local.numel() * self.m
        full = torch.zeros(n, dtype=local.dtype, device=local.device)  # get_full_inputs
        staged = torch.empty(n, dtype=local.dtype, device=local.device)  # NCCL list flatten
        comm.all_gather_into(staged, local, self.tp_group)
        full.copy_(staged)  # on the NCCL stream: the outputs are recorded there too
        streams.record(full)
        del staged
        return full

    def memory(self) -> dict[str, int]:
        out = super().memory()
        if out and self._cc_bytes:
            out["arena_capacity"] = self._cc_bytes
        return out


def make_ckpt(stack: S.Stack):
    """``train.build.build``'s ``make_ckpt`` for ``stack``."""
    def _make(model, topo, zero_r):
        return Checkpointing2019(model, topo, zero_r, stack)
    return _make
