"""DeepSpeed's own estimate of model-state memory beside this project's (``lab.estimate``):
the largest module one TP rank holds, which its ZeRO-3 estimator asks for, and its ZeRO-2 / ZeRO-3
estimators' numbers, called where DeepSpeed is installed (an optional dependency)."""
from __future__ import annotations

import contextlib
import dataclasses
import io
import logging

from zero_repro import config as C
from zero_repro.runtime.comm import comm
from zero_repro.runtime.model import model_class

def largest_layer(model: C.ModelConfig, tp: int) -> int:
    """Parameters of the largest module of one TP rank (what DeepSpeed's ZeRO-3 estimator asks
    for: ``model_to_params`` in deepspeed/runtime/zero/stage3.py), from a one-block model on
    meta (every block is the same)."""
    group = comm.Group("tp", tuple(range(tp)), 0, None, comm.CommLedger())
    one = model_class(model)(dataclasses.replace(model, n_layer=1), group, device="meta")
    return max(sum(p.numel() for p in mod.parameters(recurse=False)) for mod in one.modules())


def deepspeed_figures(psi: float, n_d: int, per_node: int, largest: int,
                      offload: bool = False, offload_param: bool = False) -> dict:
    """DeepSpeed's own model-state estimates per GPU (bytes): ZeRO-2
    (``estimate_zero2_model_states_mem_needs``, the numbers
    ``estimate_zero2_model_states_mem_needs_all_cold`` prints) and ZeRO-3 (likewise), with the
    optimizer offloaded to the CPU where ``offload`` (ZeRO-3's parameters too where
    ``offload_param``; then also ``"host"``: {stage: its CPU bytes per node, as DeepSpeed
    states them}); {} when DeepSpeed is not installed. ``psi`` =
    the parameters the DP group shards (one TP rank's), ``n_d`` DP ranks, ``per_node`` of them
    on a node."""
    try:
        # optional dependency (pip install -e ".[deepspeed]"); its import logs its accelerator
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
            import deepspeed
            from deepspeed.runtime.zero import stage3, stage_1_and_2
    except Exception:  # noqa: BLE001 - not installed or not importable here: no figure
        return {}
    per_node = max(1, min(per_node, n_d))
    nodes = max(1, n_d // per_node)
    h2, z2 = stage_1_and_2.estimate_zero2_model_states_mem_needs(
        int(psi), num_gpus_per_node=per_node, num_nodes=nodes, cpu_offload=offload)
    h3, z3, _ = stage3.estimate_zero3_model_states_mem_needs(
        int(psi), largest, num_gpus_per_node=per_node, num_nodes=nodes, cpu_offload=offload,
        cpu_offload_params=offload_param)
    out = {"version": deepspeed.__version__, 2: z2, 3: z3, "largest_layer": largest,
           "offload": offload}
    if offload:
        out["host"] = {2: h2, 3: h3}
    return out
