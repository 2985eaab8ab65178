"""The software-stack axis of the paper-scale dry run: ``paper2020`` (the stack behind the paper's
numbers) vs ``modern`` (this runtime), selected by ``cfg.simulate.stack`` or
``cfg.simulate.only_switches`` (modern plus the named paper2020 switches).

``switches`` (``Stack``: one documented switch per 2020 behaviour, with its file@commit),
``megatron2019`` (the 2019 layer and loss, ``model.gpt``'s parameter names), ``checkpoint2019``
(the 2019 P_a checkpointing), ``deepspeed02`` (DeepSpeed 0.2's ZeRO-DP allocation sequence, in
place of the strategy's allocations for stages 1-2), ``categories`` (the per-category breakdown
at the reserved peak). ``zero_repro.scale.dryrun.dryrun`` wires them in (``stack_of``,
``builders``, ``judges_with_build``, ``capacity_for``).
"""
