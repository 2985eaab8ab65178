"""Software-stack axis of the paper-scale dry run (``paper2020`` vs ``modern``), issue 13.

Modules: ``switches`` (the Stack dataclass, one documented switch per 2020 behaviour with its
file@commit), ``megatron2019`` (the 2019 layer and loss, same parameter names as
``model.gpt``), ``deepspeed02`` (DeepSpeed 0.2's ZeRO-DP build / gradient allocation sequence),
``categories`` (CategoryTracer + per-category breakdown at the reserved peak),
``checkpoint2019`` (the 2019 P_a checkpointing: per-layer partitions, zeroed full input + list
all-gather, no arena without P_a).

Selected by ``cfg.simulate.stack`` (modern | paper2020) or ``cfg.simulate.only_switches`` (modern
plus the named paper2020 switches); ``simulate.dryrun`` integrates it as follows:
  1. ``stack = switches.get(cfg_stack_name)``; use ``categories.CategoryTracer()`` in place of
     ``AllocationTracer()`` (same events; adds ``category_of``).
  2. build: when ``stack`` changes the layer (materialized_scores / dropout_masks /
     tanh_gelu_intermediates / fp32_logits) build ``megatron2019.GPT2019(cfg.model, stack,
     topo.tp_group, device, dtype=fp16)`` instead of ``GPT`` (worker.build's first line), then
     activation checkpointing and the strategy as today; wrap the build in
     ``tracer.category(FP16_PARAMS)``.
  3. ZeRO-DP stages 1/2 with ``build_sequence``: drive ``deepspeed02.DeepSpeed02(params, dp,
     stage, stack)``: ``build()`` after the model, ``backward_begin()`` before
     ``loss.backward()``, ``grad_ready(i, p.grad)`` from a post-accumulate-grad hook (then
     ``p.grad = None``), ``backward_end()`` after, ``step()`` for the step; add the ids of
     ``host_tensors`` to ``host_sids``. It replaces the strategy's allocations for these stages
     (it does no real optimisation math, only the same tensor traffic), so the strategy's own
     flat buffers must not also be built in that mode.
  4. judge on the replay WITH the build phase (``allocator_with_build``), never
     ``training_trace``, when ``build_sequence``; capacity = ``stack.capacity_bytes(device)``.
  5. tag checkpoints: after each forward, ``category_of[sid] = CHECKPOINTS`` for the sids of the
     checkpoint handle's kept tensors (as ``_host_sids`` finds them); then
     ``categories.breakdown(trace, tracer.category_of, host_sids, capacity)``.
"""
