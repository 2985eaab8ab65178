"""The ZeRO runtime a user imports: communication, the model, ZeRO-DP stages 0-3, ZeRO-R, training.

Depends on torch and ``zero_repro.config`` only; imports nothing of ``zero_repro.scale`` or
``zero_repro.lab``. Sub-packages: ``comm`` (process groups, the one caller of torch.distributed,
bucket transports; CPU-only fast paths fenced in ``comm.cpu``), ``model`` (GPT-2-like with
Megatron tensor parallelism), ``zero`` (P_os, P_os+g, P_os+g+p, paper §5), ``zero_r`` (P_a, C_B,
M_D, paper §6), ``train`` (build, the step, the loop, data, checkpoints).
"""
