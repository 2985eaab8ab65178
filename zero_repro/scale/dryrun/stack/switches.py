"""The software-stack axis of the paper-scale dry run: ``paper2020`` (the stack that produced the
ZeRO paper's numbers, arXiv:1910.02054v3 §10, Figures 6-7) vs ``modern`` (this runtime).

The paper measured DeepSpeed's ZeRO-100B (early 2020, public as DeepSpeed 0.2) driving the 2019
Megatron-LM GPT-2 code of DeepSpeedExamples on PyTorch 1.x. That stack held memory today's runtime
does not. Each behaviour is one named switch below; each field's metadata says

  * ``source``   the file@commit it is read from (behaviour modelled, no code copied),
  * ``category`` the memory category of ``stack.categories`` it changes,
  * ``doc``      what it does and, where the paper's setting is unknown, why the default.

Sources (full hashes; read with ``git show COMMIT:PATH`` in the repository snapshots):
  DS   = microsoft/DeepSpeed
         f2ac7eafd54c49acb8981650637dedd939e96c14  2020-05-19 "ZeRO-2 (#217)"
         ec79b2390101273e3636e64bafb40fdc5c1954c5  2020-02-03 (v0.1)
         01e848b336b90e7a281206e7b8f070ec0e9bfd34  2020-05-27 contiguous_gradients default -> False
  DSE  = microsoft/DeepSpeedExamples
         405ce794319c48a82e8e339e1c58380dfddb9a23  2020-03-31 "add hyperscale configs" (branch
                                                   samyamr/scripts-for-automation: the paper's
                                                   experiment harness, scripts/hyperscale/*.dat)
         07d1ce0d26044602a7b8bb289e590a980f14aded  2020-01-30 initial Megatron-LM example
         5426d18a2061b36716f1e055780423e0f92b90a1  2020-05-14 "DeepSpeed 0.2 support (#21)"
                                                   (a DSE commit, not DS: it adds ``model.half()``
                                                   before ``.cuda()`` "to prevent OOM for model
                                                   sizes that cannot fit in GPU memory in full
                                                   precision" to the public master)

``modern`` is every switch off: the dry run as ``zero_repro.scale.dryrun.dryrun`` runs it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

# memory categories (the "where did the memory go" breakdown, stack.categories)
FP16_PARAMS = "fp16_params"
MASTER_ADAM = "fp32_master_adam"
GRAD_PARTITION = "grad_partition"
BUCKETS = "buckets"
CHECKPOINTS = "checkpoints"
WORKING_LAYER = "working_layer"
LOGITS_LOSS = "logits_loss"
GATHER = "gather_buffers"
BUILD = "build_transient"
STEP_TEMP = "step_transient"
OUTSIDE = "outside_allocator"
OTHER = "other"
CATEGORIES = (FP16_PARAMS, MASTER_ADAM, GRAD_PARTITION, BUCKETS, CHECKPOINTS, WORKING_LAYER,
              LOGITS_LOSS, GATHER, BUILD, STEP_TEMP, OTHER)

DS_F2A = "DeepSpeed@f2ac7eafd"
DS_01E = "DeepSpeed@01e848b33"
DSE_405 = "DeepSpeedExamples@405ce794"
DSE_07D = "DeepSpeedExamples@07d1ce0d"
DSE_542 = "DeepSpeedExamples@5426d18a"


def _switch(default, source: str, category: str, doc: str):
    return field(default=default, metadata={"source": source, "category": category, "doc": doc})


@dataclass(frozen=True)
class Stack:
    """One software stack. ``paper2020()`` / ``modern()`` build the two named ones; any switch
    can be flipped (``dataclasses.replace``) to see what it costs."""

    name: str = "modern"
    # ---------------------------------------------------------------- the 2019 Megatron layer
    materialized_scores: bool = _switch(
        False, f"{DSE_405}:Megatron-LM/mpu/transformer.py (GPT2ParallelSelfAttention.forward)",
        WORKING_LAYER,
        "Attention as explicit matmuls: fp16 scores (b, heads/t, s, s) from q·kᵀ, divided by "
        "sqrt(head_dim), masked by multiply-and-subtract (scores·mask - 10000·(1-mask)), fp16 "
        "softmax (its output saved for backward), probs·v. Off: one fused SDPA call that keeps "
        "no s² tensor. Costs b·(heads/t)·s²·2 B per score tensor alive.")
    dropout_masks: bool = _switch(
        False, f"{DSE_405}:Megatron-LM/arguments.py (--attention-dropout/--hidden-dropout 0.1) "
        "and mpu/transformer.py (attention_dropout, output_dropout, mlp dropout)",
        WORKING_LAYER,
        "Dropout p=0.1 on the attention probabilities, the attention output and the MLP output "
        "(and the embedding): each keeps its output (fp16) and a 1-byte mask for backward "
        "(PyTorch 1.x fused_dropout: uint8 mask; here aten.native_dropout: bool, same bytes).")
    dropout_p: float = 0.1
    tanh_gelu_intermediates: bool = _switch(
        False, f"{DSE_405}:Megatron-LM/mpu/transformer.py (gelu_impl, torch.jit.script)",
        WORKING_LAYER,
        "GELU as 0.5·x·(1+tanh(0.79788·x·(1+0.044715·x·x))) op by op: autograd keeps both "
        "inputs of every product and tanh's output, 6 extra (b, s, 4h/t) fp16 tensors beyond "
        "the exact GELU's input. The 2019 function is torch.jit.script'ed; its autodiff needs "
        "the same values (mul: both operands, tanh: result), so eager is the model chosen.")
    fp32_logits: bool = _switch(
        False, f"{DSE_405}:Megatron-LM/fp16/fp16.py (FP16_Module.forward: fp16_to_fp32), "
        "mpu/cross_entropy.py (_VocabParallelCrossEntropy: clone, exp, saved exp_logits), "
        "pretrain_gpt2.py (forward_step: output.float())", LOGITS_LOSS,
        "The model returns fp32 logits (a b·s·V/t·4 B copy of the fp16 ones); the "
        "cross-entropy clones them (4 B) and keeps exp_logits (4 B) for backward, turned into "
        "the gradient in place. Modern: one fp32 upcast kept as the softmax.")
    # ---------------------------------------------------------------- build sequence
    build_sequence: bool = _switch(
        False, f"{DS_F2A}:deepspeed/pt/deepspeed_zero_optimizer.py (__init__: move_to_cpu, "
        "flatten_dense_tensors_aligned(...).cuda()), zero_optimizer_stage1.py (__init__: flatten "
        "on the device), deepspeed_light.py (_configure_distributed_model: module.half(), "
        "module.to(device)); no empty_cache / reset_max_memory_* in DS@f2ac7eafd or "
        "DSE@405ce794", BUILD,
        "Megatron halves the model and moves it to the GPU parameter by parameter; stage 2 "
        "moves the fp16 parameters to the host 'to free up GPU space for creating flat buffer' "
        "and copies one flat buffer back (stage 1 flattens on the device while the "
        "per-parameter tensors are alive); the freed per-parameter blocks stay in PyTorch's "
        "cache and 'max cached' counts from process start.")
    fp32_model_on_gpu_before_half: bool = _switch(
        False, f"{DSE_405}:Megatron-LM/pretrain_gpt2.py (get_model: model.half() then "
        f".cuda()) vs {DSE_07D}:Megatron-LM/pretrain_gpt2.py (model.cuda() then FP16_Module)",
        BUILD,
        "Default False: the paper's harness (405ce794, branch samyamr/scripts-for-automation, "
        "commit 06c0082a of 2020-03-25 'make sure model converts to half before moving to gpu') "
        "halves on the host first; True models the public master of Jan-May 2020 (07d1ce0d), "
        "which put the fp32 model on the GPU (4 B/param cached) before halving and could not "
        "build the largest models at all.")
    # ---------------------------------------------------------------- ZeRO-DP gradient path
    stage1_per_param_grads: bool = _switch(
        False, f"{DS_F2A}:deepspeed/pt/zero_optimizer_stage1.py (no gradient buffer; "
        "autograd .grad per parameter)", GRAD_PARTITION,
        "P_os: gradients are ordinary per-parameter fp16 autograd tensors (2Ψ), no flat "
        "gradient buffer.")
    stage1_flatten_reduce_scatter: bool = _switch(
        False, f"{DS_F2A}:deepspeed/pt/zero_optimizer_stage1.py (reduce_scatter_gradients: "
        "get_flat_sub_partitions for every rank, one dist.reduce_scatter per comm interval of "
        "max_elements_per_comm=5e8; step: fp32 flat sub-partitions)", BUCKETS,
        "After backward every rank's sub-partitions are flattened (a further 2Ψ fp16 "
        "transient), then one reduce_scatter per 5e8-element interval, each with PyTorch 1.x "
        "NCCL's flattened input copy (interval·2 B); the step flattens this rank's gradient "
        "sub-partitions to fp32 (4Ψ/N_d).")
    stage1_max_elements_per_comm: int = int(5e8)
    stage2_single_ipg_bucket: bool = _switch(
        False, f"{DS_F2A}:deepspeed/pt/deepspeed_zero_optimizer.py (backward: ipg_buffer of "
        "reduce_bucket_size fp16, a second one only with overlap_comm; copy_grads_in_partition: "
        "grads_in_partition allocated at the first bucket of every backward, released at the "
        "step; contiguous_gradients default True at f2ac7eafd, False from 01e848b33; the "
        "harness writes the misspelt key 'contigious_gradients', so the default applied)",
        BUCKETS,
        "P_os+g: one ipg bucket of reduce_bucket_size=5e8 fp16 elements (1 GB) allocated at "
        "every backward, freed at its end (cached); per-parameter autograd gradients copied "
        "into it; a 2Ψ/N_d fp16 gradient partition allocated lazily per backward.")
    stage2_reduce_bucket_size: int = int(5e8)
    stage2_fp32_grad_partition_at_step: bool = _switch(
        False, f"{DS_F2A}:deepspeed/pt/deepspeed_zero_optimizer.py (step: _flatten_dense_"
        "tensors(averaged_gradients).to(fp32); get_grad_norm_direct: g.double() per tensor; "
        "_has_inf_or_nan: x.float() per tensor; dist.all_gather of lists per allgather shard)",
        STEP_TEMP,
        "At the step: an fp16 flat copy of the gradient partition (2Ψ/N_d, transient) cast to "
        "an fp32 gradient partition (4Ψ/N_d) alive through Adam, plus per-tensor fp32/fp64 "
        "temporaries of the overflow check and the norm, and the all-gather's flattened list.")
    allgather_bucket_size: int = _switch(
        0, f"{DSE_405}:Megatron-LM/scripts/hyperscale/*.dat (allgather-bucket 2e8); "
        f"{DS_F2A}:deepspeed/pt/deepspeed_zero_config.py (default 5e8)", GATHER,
        "Elements per parameter all-gather shard after the step (0: the runtime's own).")
    # ---------------------------------------------------------------- ZeRO-R checkpoints
    pa_per_layer_checkpoints: bool = _switch(
        False, f"{DSE_405}:Megatron-LM/mpu/random.py (CheckpointFunction.forward: "
        "contigious_data_buffers = [new_empty(partition) for each layer]; get_full_inputs: "
        "torch.zeros(full) + dist.all_gather of a list)", CHECKPOINTS,
        "P_a: the checkpoint partitions are separate per-layer tensors (even the 'contiguous' "
        "buffer is a list of num_layers tensors, allocated at the first forward); in backward "
        "each layer's full input is re-materialised in a zeroed b·s·h tensor plus the NCCL "
        "list all-gather's flattened temporary.")
    contiguous_ckpt_only_with_pa: bool = _switch(
        False, f"{DSE_405}:Megatron-LM/mpu/random.py (contiguous buffers only inside "
        f"'if PARTITION_ACTIVATIONS'); {DS_F2A}:deepspeed/pt/deepspeed_checkpointing.py "
        "(configure(): assert PARTITION_ACTIVATIONS)", CHECKPOINTS,
        "Without P_a (C1, C3) checkpoints are the plain saved layer inputs; M_D for "
        "activations exists only with P_a.")
    pa_cpu_pageable_sync: bool = _switch(
        False, f"{DSE_405}:Megatron-LM/mpu/random.py (partition.cpu(); "
        "new_empty(..., device='cpu'))", CHECKPOINTS,
        "P_a+cpu copies partitions to pageable host memory synchronously (no pinned memory, no "
        "side stream): no device memory held across the copy; a time cost, not a memory one.")
    cuda_context_nccl_bytes: int = _switch(
        0, "NVIDIA V100 + NCCL 2.x process overhead (STACK_2020.md: ~1.5-2.5 GB)", OUTSIDE,
        "Bytes per process outside the caching allocator (CUDA context, cuBLAS workspace, NCCL "
        "buffers): reduce the usable capacity, never appear in 'max cached'. Default 2.0 GiB "
        "in paper2020 (middle of the range); 0 in modern.")
    report_gib: bool = _switch(
        False, f"{DSE_405}:Megatron-LM/mpu/random.py (see_memory_usage: /(1024*1024*1024) "
        "'GigaBytes'); utils.py report_memory (MB = 2^20)", OTHER,
        "The harness printed max_memory_cached in GiB labelled 'GigaBytes'.")

    # ------------------------------------------------------------------ helpers
    def switches(self) -> dict[str, object]:
        """Switch name -> value (every field with a source)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if "source" in f.metadata}

    def with_only(self, *names: str) -> "Stack":
        """``modern`` with only the named switches taken from this stack (one switch's cost)."""
        base = modern()
        return dataclasses.replace(base, name="+".join(names) or "modern",
                                   **{n: getattr(self, n) for n in names})

    def capacity_bytes(self, device_bytes: float) -> float:
        """Device bytes the caching allocator can use: the device minus the context/NCCL."""
        return device_bytes - self.cuda_context_nccl_bytes


def describe(name: str) -> dict:
    """source / category / doc of switch ``name``."""
    for f in dataclasses.fields(Stack):
        if f.name == name and "source" in f.metadata:
            return dict(f.metadata)
    raise ValueError(f"unknown stack switch {name!r}; use one of {sorted(modern().switches())}")


def modern() -> Stack:
    return Stack()


def paper2020() -> Stack:
    return Stack(name="paper2020", materialized_scores=True, dropout_masks=True,
                 tanh_gelu_intermediates=True, fp32_logits=True, build_sequence=True,
                 fp32_model_on_gpu_before_half=False, stage1_per_param_grads=True,
                 stage1_flatten_reduce_scatter=True, stage2_single_ipg_bucket=True,
                 stage2_fp32_grad_partition_at_step=True, allgather_bucket_size=int(2e8),
                 pa_per_layer_checkpoints=True, contiguous_ckpt_only_with_pa=True,
                 pa_cpu_pageable_sync=True, cuda_context_nccl_bytes=2 << 30, report_gib=True)


STACKS = {"modern": modern, "paper2020": paper2020}


def get(name: str) -> Stack:
    try:
        return STACKS[name]()
    except KeyError as e:
        raise ValueError(f"unknown software stack {name!r}; use one of {sorted(STACKS)}") from e
