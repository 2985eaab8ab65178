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
         e67a3def0e29ee7e81501bac3958519562438141  2020-05-01 "Squased dev zero (#14)" (the
                                                   dev-zero branch squashed; committed on
                                                   ccaa9901 of 2020-05-14)
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

from zero_repro.scale.dryrun.stack import outside

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
TIME = "time"  # a switch of the performance model's step time (scale.perf_model), no memory
CATEGORIES = (FP16_PARAMS, MASTER_ADAM, GRAD_PARTITION, BUCKETS, CHECKPOINTS, WORKING_LAYER,
              LOGITS_LOSS, GATHER, BUILD, STEP_TEMP, OTHER)

# the point of the outside-allocator bracket a single verdict is judged at (``simulate.
# outside_point``): its middle, no end being better sourced than the other; every run the paper
# reports fits across the whole bracket (tests/integration/test_paper_runs_fit.py), so the paper's own runs
# do not narrow it (results/prediction_memory/notes.md)
DEFAULT_POINT = "mid"

DS_F2A = "DeepSpeed@f2ac7eafd"
DS_E67 = "DeepSpeed@e67a3def0"
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
        False, f"{DSE_07D}:Megatron-LM/pretrain_gpt2.py L76-80 (get_model: model.cuda() in "
        f"fp32, then FP16_Module -> module.half()) vs {DSE_405}:Megatron-LM/pretrain_gpt2.py "
        "L81-85 (model.half() then .cuda())", BUILD,
        "True: the whole fp32 model is put on the device (4 B/param, ``model.cuda()``), then "
        "halved parameter by parameter (``nn.Module.half``: each fp16 copy made before its fp32 "
        "tensor is freed), the fp32 blocks left in the cache. Default False: the paper's "
        "harness (405ce794, branch samyamr/scripts-for-automation, commit 06c0082a of "
        "2020-03-25 'make sure model converts to half before moving to gpu') halves on the host "
        "first; the public master of Jan-May 2020 (07d1ce0d) did not, and could not build the "
        "largest models at all. Which one each figure ran is not known: a setting.")
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
    stage1_interval_layout: bool = _switch(
        False, f"{DS_F2A}:deepspeed/pt/zero_optimizer_stage1.py L13-93 "
        "(flatten_dense_tensors_sub_partition_aligned: padded to whole comm intervals), "
        "L406-496 (get_flat_sub_partitions: one _flatten_dense_tensors per interval, L479), "
        "L536-547 and L571-577 (reduce_scatter_gradients: every rank's sub-partitions, one "
        "dist.reduce_scatter per interval), L585-602 (torch.cat per own parameter), L604-699 "
        "(step: overflow/norm per parameter, fp32 sub-partitions per interval, optimizer.step, "
        "dist.all_gather per interval; no initialize_optimizer_states: Adam's state at the "
        "first step); the same at DS@e67a3def0", BUCKETS,
        "P_os as DeepSpeed laid it out: the flat fp16 buffer padded to a whole number of "
        "comm intervals (max_elements_per_comm rounded down to N_d sub-partitions), so Ψ "
        "grows to ceil(Ψ / interval)·interval; after backward one sub-partition tensor per "
        "(rank, interval) instead of one 2Ψ tensor, each reduce-scatter staged through "
        "PyTorch 1.x NCCL's flattened copy of its interval; at the step per-parameter fp32 "
        "copies for the overflow check and the norm, this rank's fp32 gradient "
        "sub-partitions built interval by interval, Adam's state made at the first step, and "
        "one list all-gather per interval. Off: one contiguous 2Ψ flat, padded to N_d.")
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
    stage2_step: str = _switch(
        "none", f"{DS_E67}:deepspeed/pt/deepspeed_zero_optimizer.py L1344-1351 (fp16 "
        "_flatten_dense_tensors of the gradient partition), L1406-1408 (gradients freed), "
        "L1418-1425 (fused Adam: fp16 grads in, fp16 params out), L352-366 (fp16 zero "
        f"gradient at init) | {DS_F2A}:deepspeed/pt/deepspeed_zero_optimizer.py L1078-1080 "
        "(_flatten_dense_tensors(...).to(fp32) while the fp16 partition lives), L1086-1088 "
        "(freed after), L1095 (fp32 Adam), L1100-1102 (fp32 -> fp16 copy), L349-363 (fp32 zero "
        "gradient at init); both: _has_inf_or_nan x.float() per tensor (f2ac7eafd L1229), "
        "g.double().norm() per tensor (f2ac7eafd L952), a list all_gather per allgather shard "
        "(f2ac7eafd L1111-1144)", STEP_TEMP,
        "P_os+g's step at the commit that ran: 'e67a3def0' (the squashed dev-zero branch, "
        "authored 2020-05-01, the paper's era: the ZeRO-100B runs predate the public "
        "f2ac7eafd of 2020-05-19): the fp16 gradient partition (2Ψ/N_d) and its fp16 flat "
        "copy (2Ψ/N_d) feed a fused Adam that writes the fp16 parameters; 'f2ac7eafd' (the "
        "public ZeRO-2 release): the flat copy is cast to fp32 (4Ψ/N_d) while the fp16 "
        "partition still lives, 8Ψ/N_d at that moment. Both add per-tensor fp32 / fp64 "
        "temporaries of the overflow check and the norm. 'none' (modern): the update upcasts "
        "one all-gather shard at a time.")
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
    reentrant_checkpointing: bool = _switch(
        False, f"{DSE_405}:Megatron-LM/mpu/random.py L437-509 (CheckpointFunction.backward: "
        "recompute under enable_grad L492-493, torch.autograd.backward(outputs, args) L502, "
        "grads returned L509)", WORKING_LAYER,
        "2019 checkpointing was reentrant: a layer's backward recomputes its forward and runs "
        "an inner torch.autograd.backward, keeping the recomputed output and the incoming "
        "gradient (b·s·h each) alive through the whole layer backward. Off: today's "
        "non-reentrant checkpointing (torch.utils.checkpoint use_reentrant=False).")
    collective_stream_reuse: str = _switch(
        "at_free", "PyTorch 1.x c10d ProcessGroupNCCL (recordStream on collective inputs, "
        "outputs and flattened staging tensors) + CUDACachingAllocator (free -> insert_events, "
        "process_events, free_cached_blocks -> synchronize_and_free_events); pytorch/pytorch"
        "#76861; the harness's synchronisation points with file@commit:line: stack.streams",
        OTHER,
        "When a block an NCCL collective touched can be reused. 'after_sync' (PyTorch 1.x, the "
        "host ahead of the device): freed while its stream has work issued since the last "
        "synchronisation point, it is held until the next one of the 2020 harness (per "
        "layer, DeepSpeed's timers, the step's .item() reads), or returned to the pool when "
        "an allocation would fail; 'at_free' (the device keeps up; today's PyTorch keeps the "
        "tensors in the collective's Work instead): reusable at its Python free.")
    pa_cpu_pageable_sync: bool = _switch(
        False, f"{DSE_405}:Megatron-LM/mpu/random.py L354-369 (buffers new_empty(..., "
        "device='cpu'), copy_ into them / partition.cpu()), L278-285 (copy_ back in "
        "get_full_inputs)", CHECKPOINTS,
        "P_a+cpu copies partitions to pageable host memory synchronously (no pinned memory, no "
        "side stream): no device memory held across the copy; a time cost, not a memory one "
        "(scale.perf_model ``pa_cpu_sync``: both copies exposed).")
    zero_step_time: bool = _switch(
        False, f"{DS_E67} / {DS_F2A}:deepspeed/pt/deepspeed_zero_optimizer.py step (overflow "
        "check, norm, flatten, casts, Adam, copies; lines in scale.perf_model.STEP_BYTES); "
        f"{DS_F2A}:deepspeed/pt/zero_optimizer_stage1.py L604-699", TIME,
        "The ZeRO step's memory-bound passes over the partition (and, for stage 1, over every "
        "gradient) at the HBM roof, at the commit ``stage2_step`` names: per step, not per "
        "sample (scale.perf_model ``step_commit``).")
    stage2_rooted_reduces: bool = _switch(
        False, f"{DS_F2A}:deepspeed/pt/deepspeed_zero_optimizer.py L616-629 (average_tensor: one "
        f"dist.reduce per destination rank's slice of the bucket); {DS_E67}: the same, "
        "L653-666", TIME,
        "P_os+g reduces each bucket with one rooted NCCL reduce per destination rank instead of "
        "a reduce-scatter: a ring reduce moves its slice over every link (S/B per bucket "
        "instead of (n-1)/n·S/B), n·(n-1) ring steps of latency (scale.perf_model "
        "``rooted_reduce``).")
    outside_allocator: str = _switch(
        "none", "stack.outside (NVIDIA/nccl@v2.4.8 buffers; pytorch/pytorch#20532, #28394 "
        "measured CUDA contexts)", OUTSIDE,
        "The bracket [low, high] of bytes per process outside the caching allocator (CUDA "
        "context with every kernel image, NCCL's per-connection FIFOs): they reduce the "
        "allocator's capacity and never appear in 'max cached'. paper2020: 0.37..2.23 GiB "
        "per V100 rank (``stack.outside``); none: the whole device is the allocator's.")
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

    def outside_bytes(self, point: str = DEFAULT_POINT) -> int:
        """Bytes outside the allocator at ``point`` (low | mid | high) of the stack's bracket."""
        return outside.at(self.outside_allocator, point)

    def outside_bracket(self) -> tuple[int, int]:
        return outside.bracket(self.outside_allocator)

    def capacity_bytes(self, device_bytes: float, point: str = DEFAULT_POINT) -> float:
        """Device bytes the caching allocator can use: the device (as it reports itself,
        ``scale.hardware.device_bytes``) less the bytes outside the allocator at ``point``."""
        return device_bytes - self.outside_bytes(point)


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
                 stage1_flatten_reduce_scatter=True, stage1_interval_layout=True,
                 stage2_single_ipg_bucket=True, stage2_step="e67a3def0",
                 allgather_bucket_size=int(2e8), reentrant_checkpointing=True,
                 collective_stream_reuse="after_sync", zero_step_time=True,
                 stage2_rooted_reduces=True,
                 pa_per_layer_checkpoints=True, contiguous_ckpt_only_with_pa=True,
                 pa_cpu_pageable_sync=True, outside_allocator="paper2020", report_gib=True)


def paper2020_least() -> Stack:
    """paper2020 with every choice the 2020 sources leave open at its least-memory end: the
    device keeps up with the collectives (``collective_stream_reuse='at_free'``), stage 2's
    step as at e67a3def0. Judged with the outside-allocator bytes at their low end
    (``BRACKET``)."""
    return dataclasses.replace(paper2020(), name="paper2020_least",
                               collective_stream_reuse="at_free", stage2_step="e67a3def0")


def paper2020_most() -> Stack:
    """paper2020 with every open choice at its most-memory end: blocks held until the
    harness's next synchronisation, stage 2's step as at f2ac7eafd; judged with the
    outside-allocator bytes at their high end."""
    return dataclasses.replace(paper2020(), name="paper2020_most",
                               collective_stream_reuse="after_sync", zero_step_time=True,
                 stage2_rooted_reduces=True, stage2_step="f2ac7eafd")


STACKS = {"modern": modern, "paper2020": paper2020, "paper2020_least": paper2020_least,
          "paper2020_most": paper2020_most}
# the bracket a paper2020 answer is drawn with: end -> (stack, outside-allocator point)
BRACKET = {"low": ("paper2020_least", "low"), "high": ("paper2020_most", "high")}


def bracket_end(name: str, end: str) -> tuple[str, str]:
    """(stack, outside point) of ``end`` (low | high) of stack ``name``'s bracket: the
    paper2020 ambiguities (``BRACKET``); other stacks: the same stack at that outside point."""
    if name == "paper2020":
        return BRACKET[end]
    return name, end


def get(name: str) -> Stack:
    try:
        return STACKS[name]()
    except KeyError as e:
        raise ValueError(f"unknown software stack {name!r}; use one of {sorted(STACKS)}") from e
